"""Strict F1 of saved NER models with the ``O`` tag's log-probability shifted.

Usage (from the repository root, after runs of ``benchmarks/dp_utility.py``)::

    .venv/bin/python benchmarks/outside_offset.py runs/bc5cdr-corpus/data/test \\
        runs/bc-lex-fedavg-inf runs/bc-lex-full-b190-e6-lr10-r3 --offsets=-1,0,0.5,1

A private model is less sure of itself than its no-DP reference, so it may
trade precision for recall differently; adding a constant to the log-prob of
``O`` before the constrained (valid BIO) decoding moves that trade. The
offsets are scored on the folder given, so on a test split the best offset is
an oracle: an upper bound on what choosing it on public text could gain. The
question it answers: is part of the gap a threshold the private model sets
wrongly? Prints strict F1, precision and recall per run and offset, and
writes them as JSON with ``--json``; no text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clinfed.errors import ProblemLog
from clinfed.models import load_saved_model, saved_run_model
from clinfed.scratch import temporary_folder
from clinfed.tasks import get_task
from clinfed.tasks.i2b2.adapter import IGNORE
from clinfed.tasks.i2b2.bio import allowed_transitions, best_valid_tags
from clinfed.training import batches, device_of, split_batches


def word_log_probs(run: Path, data: Path, cache: str):
    """The task, its records and examples, and each example's per-word
    log-probabilities (``(words, labels)``) under the run's final model."""
    model, tokenizer, meta = load_saved_model(saved_run_model(str(run)))
    options = {k: meta[k] for k in ("format", "types") if k in meta}
    task = get_task(meta["task"], cache_dir=cache, **options)
    task.labels = list(meta["labels"])
    records = task.read_documents(data, ProblemLog("strict"))
    examples = task.encode(records, tokenizer, meta["max_length"], cache)
    model.eval()
    order = np.argsort(np.asarray(examples["n_tokens"]), kind="stable")
    words: list = [None] * len(examples)
    position = 0
    with torch.no_grad():
        for batch in batches(examples, task, split_batches(order, 64), device_of(model)):
            log_probs = F.log_softmax(model(**task.model_inputs(batch)).float(), -1)
            is_word = (batch["labels"] != IGNORE).cpu().numpy()
            for row, mask in zip(log_probs.cpu().numpy(), is_word):
                words[order[position]] = (row, np.flatnonzero(mask))
                position += 1
    return task, records, examples, words


def scores_at(task, records, examples, words, offset: float) -> dict[str, float]:
    """Strict micro scores with ``offset`` added to ``O``'s log-probability."""
    allowed = allowed_transitions(task.labels)
    outside = task.labels.index("O")
    predicted = []
    for row, positions in words:
        shifted = row.copy()
        shifted[:, outside] += offset
        tags = shifted.argmax(-1)
        tags[positions] = best_valid_tags(shifted[positions], allowed)
        predicted.append(tags)
    micro = task.evaluate(records, examples, predicted)["scores"]["exact"]["micro"]
    return {k: round(float(micro[k]), 4) for k in ("f1", "precision", "recall")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="an annotated folder (the runs' format)")
    parser.add_argument("runs", nargs="+", type=Path, help="finished runs (RUN/model)")
    parser.add_argument("--offsets", default="-1,-0.5,0,0.5,1,2", help="comma-separated")
    parser.add_argument("--json", type=Path, help="write the scores here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    offsets = [float(x) for x in args.offsets.split(",")]
    results = {}
    for run in args.runs:
        with temporary_folder("cache") as cache:
            task, records, examples, words = word_log_probs(run, args.data, cache)
            results[str(run)] = {
                str(o): scores_at(task, records, examples, words, o) for o in offsets
            }
        for offset, s in results[str(run)].items():
            print(f"{run.name}  O{float(offset):+.1f}  F1 {s['f1']:.4f}  "
                  f"P {s['precision']:.3f}  R {s['recall']:.3f}", flush=True)  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"data": str(args.data), "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
