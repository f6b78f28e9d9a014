"""What secure aggregation costs: time and bytes up, against plain
aggregation of the same run, in this process (the engine's stages, the
sites' key agreement, Shamir shares and ChaCha20 masks; no network).

For each plan the same run is made twice, plain then secure, with the same
seed; the script reports the wall time of each run, the MB every site sent
up, and the largest difference between the two final models.

Writes ``RESULTS/secure_cost.json`` and ``.md``.

    .venv/bin/python benchmarks/secure_cost.py            # MiniLM, 3 sites x 8 documents
    .venv/bin/python benchmarks/secure_cost.py --quick    # tiny model, a smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLANS = {
    "fedavg": ("fedavg", {}, {}),
    "safl K=2 (global selection)": ("safl", {"top_layers": 2, "selection": "global"}, {}),
    "fedavg + LoRA": ("fedavg", {}, {"adapter": "lora"}),
}


def main() -> None:
    from safetensors.torch import load_file

    from clinfed.core.quiet import quiet_libraries
    from clinfed.core.runs import atomic_write_json, atomic_write_text, read_jsonl
    from clinfed.runners.pipeline import RunConfig, run_training
    from clinfed.tasks.i2b2.synth import generate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--docs", type=int, default=8, help="documents per site")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--name", default="secure_cost")
    args = parser.parse_args()
    quiet_libraries()
    model = "tiny" if args.quick else "minilm"
    results: dict = {
        "model": model,
        "sites": 3,
        "docs_per_site": args.docs,
        "rounds": args.rounds,
        "seed": args.seed,
        "plans": {},
    }
    started_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="clinfed-bench-") as work:
        data = Path(work) / "data"
        generate(data, sites=3, docs=args.docs, seed=args.seed)
        for label, (strategy, options, extra) in PLANS.items():
            row: dict = {}
            finals = {}
            for mode in ("plain", "secure"):
                out = Path(work) / f"{strategy}-{len(results['plans'])}-{mode}"
                config = RunConfig.of(
                    task="i2b2",
                    data=str(data),
                    out=str(out),
                    strategy=strategy,
                    model=model,
                    rounds=args.rounds,
                    seed=args.seed,
                    threads=args.threads,
                    strategy_options=options,
                    secure_aggregation=mode == "secure",
                    **extra,
                )
                started = time.perf_counter()
                run_training(config)
                wall = time.perf_counter() - started
                sites = [r for r in read_jsonl(out / "metrics.jsonl") if "bytes_up" in r]
                row[mode] = {
                    "wall_s": round(wall, 1),
                    "mb_up_per_site_round": round(
                        sum(r["bytes_up"] for r in sites) / len(sites) / 1e6, 3
                    ),
                }
                finals[mode] = load_file(str(out / "model" / "model.safetensors"))
            row["time_ratio"] = round(row["secure"]["wall_s"] / row["plain"]["wall_s"], 2)
            row["bytes_ratio"] = round(
                row["secure"]["mb_up_per_site_round"] / row["plain"]["mb_up_per_site_round"], 2
            )
            row["max_weight_difference"] = max(
                float((finals["plain"][k].double() - finals["secure"][k].double()).abs().max())
                for k in finals["plain"]
            )
            results["plans"][label] = row
            print(label, row, flush=True)
    results["wall_s"] = round(time.perf_counter() - started_all, 1)
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / f"{args.name}.json", results)
    lines = [
        f"# Secure aggregation's cost ({model}, 3 sites x {args.docs} documents, "
        f"{args.rounds} rounds, seed {args.seed}; in-process)",
        "",
        "| plan | plain run (s) | secure run (s) | time ratio | MB up per site-round, plain "
        "| secure | bytes ratio | max weight difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, row in results["plans"].items():
        lines.append(
            f"| {label} | {row['plain']['wall_s']} | {row['secure']['wall_s']} "
            f"| {row['time_ratio']}x | {row['plain']['mb_up_per_site_round']} "
            f"| {row['secure']['mb_up_per_site_round']} | {row['bytes_ratio']}x "
            f"| {row['max_weight_difference']:.1e} |"
        )
    lines += ["", f"Wall time of the whole benchmark: {results['wall_s']} s."]
    atomic_write_text(args.results / f"{args.name}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
