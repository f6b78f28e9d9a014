"""Centralized baseline on synthetic i2b2 and MIMIC-III, against model-free baselines.

Measures, in one run: held-out F1 of the bundled MiniLM trained on all sites'
pooled data, the dictionary / frequency / keyword baselines on the same
split, wall time and training tokens/s. Writes ``RESULTS/centralized.json``
and ``RESULTS/centralized.md`` (the table in docs/results.md).

    .venv/bin/python benchmarks/centralized.py            # about 25 minutes on 2 cores
    .venv/bin/python benchmarks/centralized.py --quick    # tiny model, a smoke run
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers

from clinfed.core.errors import ProblemLog
from clinfed.core.runs import atomic_write_json, atomic_write_text, read_jsonl
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks import get_task
from clinfed.tasks.i2b2.baselines import i2b2_dictionary
from clinfed.tasks.i2b2.synth import generate as synth_i2b2
from clinfed.tasks.mimic3.baselines import mimic3_frequency, mimic3_keyword
from clinfed.tasks.mimic3.synth import generate as synth_mimic3


def train(task: str, data: Path, out: Path, model: str, epochs: int) -> dict:
    """A centralized run with the task's default settings."""
    started = time.perf_counter()
    summary = run_training(
        RunConfig.of(task=task, data=str(data), out=str(out), model=model, epochs=epochs)
    )
    wall = time.perf_counter() - started
    records = read_jsonl(out / "metrics.jsonl")
    tokens = sum(r["train_tokens"] for r in records)
    seconds = sum(r["train_seconds"] for r in records)
    return {
        "summary": summary,
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / seconds, 1),
        "f1_per_epoch": [round(r["f1"], 4) for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="tiny model and corpora (smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = "tiny" if args.quick else "minilm"
    sizes = {
        "i2b2_docs": 8 if args.quick else 40,
        "mimic_docs": 24 if args.quick else 150,
        "i2b2_epochs": 1 if args.quick else 4,
        "mimic_epochs": 1 if args.quick else 10,
    }
    rows, results = (
        [],
        {
            "model": model,
            "sizes": sizes,
            "seed": args.seed,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        },
    )
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        # i2b2: 3 heterogeneous sites
        synth_i2b2(work / "i2b2", sites=3, docs=sizes["i2b2_docs"], seed=args.seed)
        task = get_task("i2b2", seed=args.seed)
        corpus = task.load(work / "i2b2", ProblemLog())
        dictionary = i2b2_dictionary(corpus.train, corpus.test)
        run = train("i2b2", work / "i2b2", work / "run-i2b2", model, sizes["i2b2_epochs"])
        results["i2b2"] = {
            "dictionary_f1": dictionary["f1"],
            **run,
            "train_documents": len(corpus.train),
            "test_documents": len(corpus.test),
        }
        rows.append(("i2b2 (strict micro F1)", dictionary["f1"], "dictionary", run))

        # mimic3: 3 sites, top-50 diagnosis codes
        synth_mimic3(work / "mimic3", sites=3, docs=sizes["mimic_docs"], seed=args.seed)
        task = get_task("mimic3", seed=args.seed, cache_dir=str(work / "cache"))
        corpus = task.load(work / "mimic3", ProblemLog())
        frequency = mimic3_frequency(corpus.train["codes"], corpus.test["codes"], task.labels)
        keyword = mimic3_keyword(
            corpus.train["text"],
            corpus.train["codes"],
            corpus.test["text"],
            corpus.test["codes"],
            task.labels,
        )
        run = train("mimic3", work / "mimic3", work / "run-mimic3", model, sizes["mimic_epochs"])
        results["mimic3"] = {
            "frequency_micro_f1": frequency["micro_f1"],
            "keyword_micro_f1": keyword["micro_f1"],
            **run,
            "train_admissions": len(corpus.train),
            "test_admissions": len(corpus.test),
            "labels": len(task.labels),
        }
        best = max(frequency["micro_f1"], keyword["micro_f1"])
        rows.append(
            (
                "mimic3 top-50 (micro F1)",
                best,
                "keyword" if best == keyword["micro_f1"] else "frequency",
                run,
            )
        )

    lines = [
        "| task | model F1 | best baseline F1 | epochs | wall time | training tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, baseline_f1, baseline, run in rows:
        lines.append(
            f"| {name} | {run['summary']['f1']:.3f} | {baseline_f1:.3f} ({baseline}) | "
            f"{len(run['f1_per_epoch'])} | {run['wall_s'] / 60:.1f} min | "
            f"{run['tokens_per_s']:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    atomic_write_json(args.results / f"centralized{suffix}.json", results)
    atomic_write_text(args.results / f"centralized{suffix}.md", table)
    print(table)


if __name__ == "__main__":
    main()
