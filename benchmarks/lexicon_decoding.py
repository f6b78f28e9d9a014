"""The public chemical lexicon at decoding: does it close the DP gap?

Post-processing of released models, so no privacy cost: each saved run's
predictions on BC5CDR devel (``RUN/predictions/SITE-devel-1.con``, as
``benchmarks/dp_utility.py --corpus bc5cdr`` writes them) get a
``treatment`` (chemical) span wherever the public lexicon
(``benchmarks/data/chemicals.txt``, the same lookup as ``--public
lexicon``) names words the model left outside every span. Prints strict
F1, precision and recall with and without it, scored here against the
devel files' gold tags (the same figures as the runs' own, checked).

    python benchmarks/lexicon_decoding.py runs/A runs/B \\
        --test runs/bc5cdr-corpus/data/test

``--terminology`` takes the public terminologies' chemicals and diseases
(``terminology.py``) instead of the hand-written chemical list.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import terminology  # noqa: E402
from dp_utility import LEXICON, lexicon_tags  # noqa: E402

TYPES = {"Chemical": "treatment", "Disease": "problem"}
CONCEPT = re.compile(r'c=".*" (\d+):(\d+) (\d+):(\d+)\|\|t="(\w+)"$')
Span = tuple[int, int, int, str]  # sentence (from 1), first and last word, type


def read_lexicon() -> tuple[set[str], tuple[str, ...]]:
    names, stems = set(), []
    for line in LEXICON.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            (stems.append(line[1:]) if line.startswith("~") else names.add(line.lower()))
    return names, tuple(stems)


def read_sentences(tsv: Path) -> list[list[tuple[str, str]]]:
    sentences, current = [], []
    for line in tsv.read_text().splitlines():
        if line.strip():
            word, tag = line.split("\t")
            current.append((word, tag))
        elif current:
            sentences.append(current)
            current = []
    return sentences + ([current] if current else [])


def tagged_spans(tags_by_sentence: list[list[str]], types: dict[str, str]) -> set[Span]:
    spans = set()
    for number, tags in enumerate(tags_by_sentence, 1):
        start = kind = None
        for j, tag in enumerate([*tags, "O"]):
            if start is not None and not tag.startswith("I-"):
                spans.add((number, start, j - 1, kind))
                start = None
            if tag.startswith("B-") or (tag.startswith("I-") and start is None):
                start, kind = j, types[tag[2:]]
    return spans


def predicted_spans(con: Path) -> set[Span]:
    spans = set()
    for line in con.read_text().splitlines():
        found = CONCEPT.match(line)
        if found is None:
            raise SystemExit(f"{con}: not an i2b2 concept line")
        spans.add((int(found[1]), int(found[2]), int(found[4]), found[5]))
    return spans


def lexicon_spans(sentences, predicted: set[Span], lexicon) -> set[Span]:
    """The lexicon's spans over words no predicted span covers: chemicals of
    the hand-written list, or (``--terminology``, a dict of name sets by
    type) chemicals and diseases of the public terminologies."""
    covered = {(n, j) for n, a, b, _ in predicted for j in range(a, b + 1)}
    tags_by_sentence = []
    for number, sentence in enumerate(sentences, 1):
        words = [word for word, _ in sentence]
        tags = ["X" if (number, j) in covered else "O" for j in range(len(words))]
        if isinstance(lexicon, dict):
            terminology.tag(words, tags, lexicon)
        else:
            lexicon_tags(words, tags, *lexicon)
        tags_by_sentence.append([t if t != "X" else "O" for t in tags])
    return tagged_spans(
        tags_by_sentence, TYPES if isinstance(lexicon, dict) else {"Chemical": "treatment"}
    )


def score(run: Path, test: Path, lexicon) -> tuple[dict[str, float], dict[str, float]]:
    counts = {"none": [0, 0, 0], "lexicon": [0, 0, 0]}
    for site in sorted(p.name for p in test.iterdir() if p.is_dir()):
        sentences = read_sentences(test / site / "devel.tsv")
        gold = tagged_spans([[tag for _, tag in s] for s in sentences], TYPES)
        predicted = predicted_spans(run / "predictions" / f"{site}-devel-1.con")
        with_lexicon = predicted | lexicon_spans(sentences, predicted, lexicon)
        for name, spans in (("none", predicted), ("lexicon", with_lexicon)):
            count = counts[name]
            count[0] += len(spans & gold)
            count[1] += len(spans - gold)
            count[2] += len(gold - spans)

    def f1(tp: int, fp: int, fn: int) -> dict[str, float]:
        precision, recall = tp / (tp + fp), tp / (tp + fn)
        return {"f1": 2 * precision * recall / (precision + recall), "p": precision, "r": recall}

    return f1(*counts["none"]), f1(*counts["lexicon"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--test", type=Path, default=Path("runs/bc5cdr-corpus/data/test"))
    parser.add_argument(
        "--terminology",
        action="store_true",
        help="the public terminologies' chemicals and diseases (terminology.py) instead",
    )
    parser.add_argument(
        "--only",
        choices=sorted(TYPES),
        default=None,
        help="with --terminology: that type's names alone",
    )
    args = parser.parse_args()
    lexicon = terminology.lexicons() if args.terminology else read_lexicon()
    if args.terminology and args.only:
        lexicon = {args.only: lexicon[args.only]}
    print("| run | F1 (P, R) as decoded | with the lexicon's names | moved |")
    print("|---|---|---|---|")
    for run in args.runs:
        plain, assisted = score(run, args.test, lexicon)
        print(
            f"| `{run.name}` | {plain['f1']:.4f} ({plain['p']:.3f}, {plain['r']:.3f}) | "
            f"{assisted['f1']:.4f} ({assisted['p']:.3f}, {assisted['r']:.3f}) | "
            f"{100 * (assisted['f1'] - plain['f1']):+.2f} |"
        )


if __name__ == "__main__":
    main()
