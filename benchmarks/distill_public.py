"""Distil a private model into a whole-model student on public text.

Usage (from the repository root, after ``make install``)::

    .venv/bin/python benchmarks/distill_public.py RUN PUBLIC.tsv DATA OUT [--from-teacher]

``RUN`` is a finished concept-extraction run (its ``model/`` is the
teacher: under DP, a released model, so everything below is
post-processing and costs no privacy); ``PUBLIC.tsv`` is public text in
CoNLL (its own tags are ignored); ``DATA`` is the corpus the run trained
on (its ``test/`` scores the student). The teacher labels the public
sentences (``clinfed.api.predict``), the labels go back onto the CoNLL tokens,
and ``clinfed warm-start`` trains every parameter of a student on them, 2
epochs at the task's whole-model rate: from the run's own starting model,
or with ``--from-teacher`` from the teacher's weights. Prints the
teacher's and the student's strict F1 on ``DATA/test`` as one JSON line
and writes it to ``OUT/distill.json``.

The labelled public text stays under ``OUT`` (public sentences, no note of
any site).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# The benchmark corpora's mapping (dp_utility.py): run type -> CoNLL name.
NAMES = {"problem": "Disease", "treatment": "Chemical"}


def relabel(public: Path, predictions: Path, out: Path) -> int:
    """The teacher's .con spans (one line per public sentence) as the tags
    of ``public``'s tokens; returns the number of spans kept."""
    from clinfed.errors import ProblemLog
    from clinfed.tasks.i2b2.format import read_con

    sentences: list[list[str]] = [[]]
    for line in public.read_text().splitlines():
        if line.strip():
            sentences[-1].append(line.split("\t")[0])
        elif sentences[-1]:
            sentences.append([])
    sentences = [s for s in sentences if s]
    tags = [["O"] * len(words) for words in sentences]
    kept = 0
    for con in predictions.glob("*.con"):
        for concept in read_con(con, sentences, ProblemLog()):
            (line, first), (last_line, last) = concept.start, concept.end
            if line != last_line or concept.type not in NAMES:
                continue
            for i in range(first, last + 1):
                tags[line - 1][i] = ("B-" if i == first else "I-") + NAMES[concept.type]
            kept += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    body = "\n\n".join(
        "\n".join(f"{w}\t{t}" for w, t in zip(words, tag)) for words, tag in zip(sentences, tags)
    )
    out.write_text(body + "\n")
    return kept


def f1(model: Path, test: Path) -> dict:
    from clinfed import api

    scores = api.evaluate(model, test)["scores"]["exact"]
    return {kind: round(scores[kind]["f1"], 4) for kind in ("micro", *NAMES)}


def main() -> None:
    from clinfed import api
    from clinfed.pipeline import RunConfig, warm_start_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("public", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--from-teacher", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    config = json.loads((args.run / "config.json").read_text())
    folder = args.out / "public"
    folder.mkdir(parents=True)
    shutil.copy(args.public, folder)
    api.predict(args.run, folder, args.out / "teacher")
    labelled = args.out / "labelled" / args.public.name
    spans = relabel(args.public, args.out / "teacher", labelled)
    types = ",".join(f"{name}={kind}" for kind, name in NAMES.items())
    student = RunConfig.of(
        task="i2b2",
        out=str(args.out / "student"),
        model=str(args.run / "model" if args.from_teacher else config["model"]["model"]),
        public_data=str(labelled.parent),
        public_types=types,
        public_epochs=2,
        data=str(args.data),
        types=types,
        format="conll",
        max_length=config["data"]["max_length"],
        head_lr=config["training"]["head_lr"] or 0.01,
        seed=0,
        threads=args.threads,
    )
    warm_start_model(student)
    result = {
        "command": " ".join(sys.argv),
        "spans": spans,
        "teacher": f1(args.run, args.data / "test"),
        "student": f1(args.out / "student", args.data / "test"),
    }
    (args.out / "distill.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
