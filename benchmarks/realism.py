"""How far the synthetic i2b2 text is from real text (BC5CDR).

Measures, for the project's synthetic i2b2 corpus (``clinfed data synth``,
3 sites x 40 documents, seed 0) and for BC5CDR (train / devel, real PubMed
abstracts with expert spans):

* vocabulary: distinct lowercased words in the first 20,000 tokens;
* distinct sentence shapes in the first 3,000 sentences (a shape: each token
  as ``A`` capitalized, ``a`` lower case, ``0`` digits, ``.`` other, runs
  collapsed);

(equal-sized prefixes, since both counts grow with corpus size);
* sentence length in tokens: mean, standard deviation, 10th and 90th
  percentiles;
* the share of test spans whose text never occurs as a training span.

Writes ``RESULTS/realism.json`` and ``.md``. Takes seconds.

    .venv/bin/python benchmarks/realism.py
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import numpy as np

from clinfed.core.errors import ProblemLog
from clinfed.core.runs import atomic_write_json, atomic_write_text
from clinfed.tasks.i2b2.conll import read_conll
from clinfed.tasks.i2b2.format import Document, read_corpus
from clinfed.tasks.i2b2.synth import generate

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpora" / "bc5cdr"
TYPES = {"Disease": "problem", "Chemical": "treatment"}


def _shape(tokens: list[str]) -> str:
    classes = []
    for token in tokens:
        if token[:1].isupper():
            classes.append("A")
        elif token.isalpha():
            classes.append("a")
        elif token.isdigit():
            classes.append("0")
        else:
            classes.append(".")
    return re.sub(r"(.)\1+", r"\1+", "".join(classes))


def measure(train: list[Document], test: list[Document]) -> dict:
    sentences = [line for doc in train + test for line in doc.lines if line]
    tokens = [t.lower() for line in sentences for t in line]
    lengths = np.asarray([len(line) for line in sentences])
    train_spans = {c.text for d in train for c in d.concepts}
    test_spans = [c.text for d in test for c in d.concepts]
    return {
        "sentences": len(sentences),
        "tokens": len(tokens),
        "vocabulary_in_20k_tokens": len(set(tokens[:20_000])),
        "shapes_in_3000_sentences": len({_shape(s) for s in sentences[:3000]}),
        "length_mean": round(float(lengths.mean()), 1),
        "length_std": round(float(lengths.std()), 1),
        "length_p10_p90": [int(np.percentile(lengths, 10)), int(np.percentile(lengths, 90))],
        "test_spans_unseen_in_training": round(
            sum(t not in train_spans for t in test_spans) / len(test_spans), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp) / "synth", sites=3, docs=40, seed=0)
        synthetic = measure(
            read_corpus(Path(tmp) / "synth" / "train", ProblemLog()),
            read_corpus(Path(tmp) / "synth" / "test", ProblemLog()),
        )
        for split in ("train", "devel"):
            folder = Path(tmp) / "bc5cdr" / split / "bc5cdr"
            folder.mkdir(parents=True)
            (folder / f"{split}.tsv").write_bytes((CORPUS / f"{split}.tsv").read_bytes())
        real = measure(
            read_conll(Path(tmp) / "bc5cdr" / "train", ProblemLog(), TYPES),
            read_conll(Path(tmp) / "bc5cdr" / "devel", ProblemLog(), TYPES),
        )
    result = {"synthetic i2b2 (3 x 40 documents, seed 0)": synthetic, "BC5CDR train/devel": real}
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / "realism.json", result)
    keys = [
        ("sentences", "sentences"),
        ("tokens", "tokens"),
        ("vocabulary_in_20k_tokens", "distinct words in the first 20,000 tokens"),
        ("shapes_in_3000_sentences", "distinct sentence shapes in the first 3,000 sentences"),
        ("length_mean", "sentence length, mean (tokens)"),
        ("length_std", "sentence length, std"),
        ("length_p10_p90", "sentence length, p10-p90"),
        ("test_spans_unseen_in_training", "test spans unseen in training"),
    ]
    names = list(result)
    lines = ["| measure | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, label in keys:
        cells = []
        for name in names:
            value = result[name][key]
            cells.append("-".join(map(str, value)) if isinstance(value, list) else str(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    atomic_write_text(args.results / "realism.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
