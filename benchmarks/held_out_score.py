"""Score saved models on the test split a training run holds out of a corpus.

Usage (from the repository root)::

    .venv/bin/python benchmarks/held_out_score.py runs/mimic3-1k-data \\
        runs/m1k-start runs/m1k-pub-fedavg-inf [--json OUT]

``clinfed evaluate RUN --data DIR`` scores every annotated document of DIR.
A MIMIC-III corpus has no test folder: ``clinfed train`` holds each
patient's admissions out by a keyed split (or the sites' ``*_hadm_ids.csv``
files). This scores each model (a run folder or a saved model, such as
``clinfed warm-start``'s) on exactly that held-out split, with the task
options the model was saved with, so a starting model alone can be put
beside the runs that start from it. Prints the task's metrics per model;
no text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clinfed.core.errors import ProblemLog
from clinfed.core.scratch import temporary_folder
from clinfed.modeling.training import predict
from clinfed.runners.inference import saved_model_and_task


def held_out_metrics(model_path: Path, data: Path, cache_dir: str) -> dict:
    """The task's metrics of one saved model on ``data``'s held-out split."""
    model, tokenizer, meta, task = saved_model_and_task(model_path, cache_dir)
    problems = ProblemLog("skip")
    records = task.load(data, problems).test  # the split clinfed train holds out
    examples = task.encode(records, tokenizer, meta["max_length"], cache_dir)
    metrics = task.evaluate(records, examples, predict(model, task, examples))
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))} | {
        "examples": len(examples)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path)
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    with temporary_folder("cache") as cache_dir:
        for model in args.models:
            results[str(model)] = held_out_metrics(model, args.data, cache_dir)
            shown = ", ".join(f"{k} {v:.4f}" for k, v in results[str(model)].items())
            print(f"{model}: {shown}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
