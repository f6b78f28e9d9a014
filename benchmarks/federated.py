"""Strategy comparison on synthetic i2b2 (3 heterogeneous sites), one run.

centralized (pooled data, E epochs) against local, fedavg and fedprox (R
rounds of one local epoch each); by default E = R = 8, so every strategy
makes the same number of passes over the training data. Reports final and best held-out
strict micro F1 and the MB each strategy uploaded. Writes ``RESULTS/federated.json`` and
``RESULTS/federated.md``.

    .venv/bin/python benchmarks/federated.py            # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/federated.py --quick    # tiny model, a smoke run
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import datasets
import transformers

from clinfed.core.runs import atomic_write_json, atomic_write_text, read_jsonl
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.synth import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=8, help="centralized epochs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model, docs, rounds, epochs = (
        ("tiny", 8, 2, 2) if args.quick else ("minilm", 40, args.rounds, args.epochs)
    )
    results = {
        "model": model,
        "docs_per_site": docs,
        "rounds": rounds,
        "centralized_epochs": epochs,
        "seed": args.seed,
    }
    rows = []
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "data"
        generate(data, sites=3, docs=docs, seed=args.seed)
        for strategy in ("centralized", "local", "fedavg", "fedprox"):
            out = Path(work) / strategy
            started = time.perf_counter()
            summary = run_training(
                RunConfig.of(
                    task="i2b2",
                    data=str(data),
                    out=str(out),
                    strategy=strategy,
                    model=model,
                    epochs=epochs,
                    rounds=rounds,
                    seed=args.seed,
                )
            )
            wall = time.perf_counter() - started
            records = read_jsonl(out / "metrics.jsonl")
            curve = [r["f1"] for r in records if "client" not in r]
            mb_up = summary.get("mb_up", 0.0)
            results[strategy] = {
                "f1": summary["f1"],
                "best_f1": max(curve),
                "f1_curve": curve,
                "mb_up": mb_up,
                "wall_s": round(wall, 1),
                "per_site_f1": summary.get("per_site_f1"),
            }
            rows.append((strategy, summary["f1"], max(curve), mb_up, wall))
            print(
                f"{strategy}: f1 {summary['f1']:.4f}  up {mb_up:.0f} MB  {wall / 60:.1f} min",
                flush=True,
            )
    lines = [
        "| strategy | final F1 | best F1 | MB uploaded (all sites, all rounds) | wall time |",
        "|---|---|---|---|---|",
    ]
    for strategy, f1, best, mb, wall in rows:
        lines.append(
            f"| {strategy} | {f1:.3f} | {best:.3f} | "
            f"{'-' if strategy == 'centralized' else f'{mb:.0f}'} | {wall / 60:.1f} min |"
        )
    table = "\n".join(lines) + "\n"
    suffix = "-quick" if args.quick else ""
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / f"federated{suffix}.json", results)
    atomic_write_text(args.results / f"federated{suffix}.md", table)
    print(table)


if __name__ == "__main__":
    main()
