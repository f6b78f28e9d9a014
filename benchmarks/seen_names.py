"""Strict F1 of saved models split by where a test mention's name was seen.

Usage (from the repository root, after runs of ``benchmarks/dp_utility.py``
on ``--corpus bc5cdr``)::

    .venv/bin/python benchmarks/seen_names.py runs/bc5cdr-corpus \\
        runs/bc-lex-fedavg-inf runs/bc-lex-b190-e6 --public runs/bc5cdr-corpus/public-lexicon

Each gold mention of the test split (and each predicted one) is put in one
of three groups by its words (lower-cased) and type:

* ``public``: the name is a mention of that type in the public text the run
  started from (``--public``, CoNLL files);
* ``private only``: not in the public text, but a mention of that type in
  the sites' train split;
* ``unseen``: in neither.

With ``--by-count``, ``private only`` is split by how many of the sites'
train sentences hold the name (1, 2-4, 5-19, 20 or more): how often a
private name must occur before a private model learns it.

Per group: gold mentions, recall, precision (predicted spans of that group
that are right) and F1. The question it answers: is the gap between a
private model and its no-DP reference in names the private data alone
holds (what DP is built to keep a model from memorising), or everywhere?
Predictions are written under each run's ``seen-names/`` folder by
``clinfed predict``; only counts are printed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# The benchmark's type names (dp_utility.py maps Disease -> problem, Chemical -> treatment).
RUN_TYPE = {"problem": "Disease", "treatment": "Chemical"}
CON = re.compile(r'^c="(.*)" (\d+):(\d+) (\d+):(\d+)\|\|t="([^"]+)"$')


def sentence_spans(block: str) -> list[tuple[int, int, str, str]]:
    """(first word, last word, type, name) of each mention of one CoNLL
    sentence; the name is its words, lower-cased."""
    rows = [r.split("\t") for r in block.strip("\n").splitlines()]
    words, tags = [r[0] for r in rows], [r[-1] for r in rows]
    spans, start, kind = [], None, ""
    for i, tag in enumerate([*tags, "O"]):
        if start is not None and not (tag.startswith("I-") and tag[2:] == kind):
            spans.append((start, i - 1, kind, " ".join(words[start:i]).lower()))
            start = None
        if tag.startswith("B-") or (tag.startswith("I-") and start is None):
            start, kind = i, tag[2:]
    return spans


def conll_spans(path: Path) -> list[tuple[int, int, int, str, str]]:
    """(line, first word, last word, type, name) of each mention; lines 1-based."""
    blocks = [b for b in path.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    numbered = enumerate(blocks, start=1)
    return [(line, *span) for line, block in numbered for span in sentence_spans(block)]


def names(folder: Path) -> Counter:
    """(type, name) of every mention in the CoNLL files under ``folder``,
    with the number of sentences that hold it."""
    found = set()
    for path in sorted(folder.rglob("*.tsv")):
        found |= {(path, line, kind, name) for line, *_, kind, name in conll_spans(path)}
    return Counter((kind, name) for *_, kind, name in found)


# (fewer than, label): the private-only names by the sentences that hold them.
BUCKETS = ((2, "private 1"), (5, "private 2-4"), (20, "private 5-19"))


def predicted(folder: Path) -> dict[str, set[tuple[int, int, int, str, str]]]:
    """The spans of each ``SITE-devel-*.con`` file clinfed predict wrote, by site."""
    out: dict[str, set] = {}
    for path in sorted(folder.glob("*.con")):
        site = path.name.split("-")[0]
        for row in path.read_text(encoding="utf-8").splitlines():
            match = CON.match(row)
            if match:
                text, line, first, _, last, kind = match.groups()
                out.setdefault(site, set()).add(
                    (int(line), int(first), int(last), RUN_TYPE.get(kind, kind), text.lower())
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "corpus", type=Path, help="dp_utility's corpus folder (data/train, data/test)"
    )
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--public", type=Path, required=True, help="the public text's folder")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--by-count", action="store_true", help="split private-only names by sentences holding them"
    )
    args = parser.parse_args()

    public = names(args.public)
    private = names(args.corpus / "data" / "train")
    groups = ["public", "private only", "unseen"]
    if args.by_count:
        groups[1:2] = [label for _, label in BUCKETS] + ["private 20+"]

    def group(kind: str, name: str) -> str:
        if (kind, name) in public:
            return "public"
        if (kind, name) not in private:
            return "unseen"
        if not args.by_count:
            return "private only"
        held = private[kind, name]
        return next((label for below, label in BUCKETS if held < below), "private 20+")

    gold = {
        path.parent.name: set(conll_spans(path))
        for path in sorted((args.corpus / "data" / "test").glob("*/*.tsv"))
    }
    counts = Counter(group(s[3], s[4]) for spans in gold.values() for s in spans)
    results = {"gold": dict(counts), "runs": {}}
    print(f"test mentions: {dict(counts)}")
    for run in args.runs:
        out = run / "seen-names"
        shutil.rmtree(out, ignore_errors=True)
        clinfed = Path(sys.executable).with_name("clinfed")
        subprocess.run(
            [
                str(clinfed),
                "-q",
                "predict",
                str(run),
                "--data",
                str(args.corpus / "data" / "test"),
                "--out",
                str(out),
            ],
            check=True,
        )
        guessed = predicted(out)
        tp, pred = Counter(), Counter()
        for site, spans in gold.items():
            for span in guessed.get(site, set()):
                pred[group(span[3], span[4])] += 1
                # A name is the words of the span, so the group of a right
                # prediction is the gold mention's group.
                tp[group(span[3], span[4])] += span in spans
        row = {}
        for name in groups:
            recall = tp[name] / counts[name] if counts[name] else 0.0
            precision = tp[name] / pred[name] if pred[name] else 0.0
            f1 = 2 * recall * precision / (recall + precision) if recall + precision else 0.0
            row[name] = {
                "recall": recall,
                "precision": precision,
                "f1": f1,
                "predicted": pred[name],
            }
        total_tp, total_pred = sum(tp.values()), sum(pred.values())
        recall, precision = total_tp / sum(counts.values()), total_tp / max(total_pred, 1)
        row["all"] = {"f1": 2 * recall * precision / max(recall + precision, 1e-12)}
        results["runs"][str(run)] = row
        print(
            f"{run}: all {row['all']['f1']:.3f}; "
            + "; ".join(
                f"{name} F1 {row[name]['f1']:.3f} (R {row[name]['recall']:.3f}, "
                f"P {row[name]['precision']:.3f})"
                for name in groups
            )
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
