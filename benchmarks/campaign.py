"""SAFL / FedFrozen evaluation campaign against FedAvg, over several seeds.

For each task (synthetic i2b2 with 3 heterogeneous sites, synthetic MIMIC-III
with 3 sites) and each configuration below, one federated run per seed. Per
configuration it reports, averaged over seeds:

* final held-out F1 (mean and standard deviation over seeds),
* MB uploaded per round (all sites together) and the share of FedAvg's,
* rounds to reach 95% of the run's final F1,
* stability: the mean absolute round-to-round change of F1.

It writes ``RESULTS/campaign-<task>.json``, ``.md`` and two plots per task
(F1 against round, F1 against cumulative MB uploaded). Each run is a run
folder under ``--work``; finished runs are not rerun, so an interrupted
campaign continues where it stopped.

    .venv/bin/python benchmarks/campaign.py                 # both tasks, 3 seeds
    .venv/bin/python benchmarks/campaign.py --task i2b2 --seeds 1
    .venv/bin/python benchmarks/campaign.py --quick         # tiny model, smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import datasets
import matplotlib
import transformers

from clinfed.core.runs import atomic_write_json, atomic_write_text, read_jsonl
from clinfed.runners.pipeline import RunConfig, run_training

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# name -> RunConfig overrides. K is out of MiniLM's 6 layers.
CONFIGS: dict[str, dict] = {
    "fedavg": {"strategy": "fedavg"},
    "safl K=1": {"strategy": "safl", "top_layers": 1},
    "safl K=2": {"strategy": "safl", "top_layers": 2},
    "safl K=3": {"strategy": "safl", "top_layers": 3},
    "fedfrozen W=1": {"strategy": "fedfrozen", "freeze_from": "1"},
    "fedfrozen W=3": {"strategy": "fedfrozen", "freeze_from": "3"},
    "fedfrozen W=auto": {"strategy": "fedfrozen", "freeze_from": "auto"},
    "safl+fedfrozen K=2 W=3": {"strategy": "safl+fedfrozen", "top_layers": 2, "freeze_from": "3"},
    # Not in the default campaign (--only): the strategies added as one file each.
    "fedadam": {"strategy": "fedadam"},
    "ditto": {"strategy": "ditto"},
}
DEFAULT = [name for name in CONFIGS if name not in ("fedadam", "ditto")]

# Sizes chosen so both tasks x 8 configurations x 3 seeds fit in 90 minutes on
# 2 CPU cores with MiniLM (docs/results.md has the measured wall time).
SIZES = {
    "i2b2": {"docs": 12, "rounds": 8, "max_length": 96, "extra": {"lr": 3e-4}},
    "mimic3": {
        "docs": 24,
        "rounds": 8,
        "max_length": 96,
        # Few admissions per site: two local epochs and a higher encoder rate
        # than the task default, or F1 stays at 0 for most of the 8 rounds.
        "extra": {"top_k": 10, "max_chunks": 2, "local_epochs": 2, "lr": 2e-4},
    },
}
QUICK = {
    "i2b2": {"docs": 6, "rounds": 3, "max_length": 48, "extra": {}},
    "mimic3": {"docs": 16, "rounds": 3, "max_length": 64, "extra": {"top_k": 5, "max_chunks": 2}},
}


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("=", "").replace("+", "-")


def generate(task: str, folder: Path, docs: int, seed: int) -> None:
    if (folder / ".done").exists():
        return
    if task == "i2b2":
        from clinfed.tasks.i2b2.synth import generate as synth
    else:
        from clinfed.tasks.mimic3.synth import generate as synth
    synth(folder, sites=3, docs=docs, seed=seed)
    (folder / ".done").write_text("")


def one_run(
    task: str, data: Path, out: Path, name: str, size: dict, model: str, seed: int, threads: int
):
    """Run (or reuse) one configuration for one seed; return its per-round record."""
    if not (out / "summary.json").exists():
        if out.exists():  # an interrupted run: start it again from scratch
            import shutil

            shutil.rmtree(out)
        started = time.perf_counter()
        run_training(
            RunConfig.of(
                task=task,
                data=str(data),
                out=str(out),
                model=model,
                rounds=size["rounds"],
                max_length=size["max_length"],
                seed=seed,
                threads=threads,
                **size["extra"],
                **CONFIGS[name],
            )
        )
        atomic_write_json(out / "wall.json", {"seconds": time.perf_counter() - started})
    records = read_jsonl(out / "metrics.jsonl")
    rounds = [r for r in records if "client" not in r]
    sites = [r for r in records if "client" in r]
    mb_per_round = [
        sum(s["bytes_up"] for s in sites if s["round"] == r["round"]) / 1e6 for r in rounds
    ]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "f1_curve": [r["f1"] for r in rounds],
        "mb_per_round": mb_per_round,
        "final_f1": summary["f1"],
        "ratio_to_fedavg_up": summary["ratio_to_fedavg_up"],
        "wall_s": json.loads((out / "wall.json").read_text())["seconds"],
    }


def rounds_to_95(curve: list[float]) -> int:
    target = 0.95 * curve[-1]
    return next(i + 1 for i, f1 in enumerate(curve) if f1 >= target)


def spread(curve: list[float]) -> float:
    steps = [abs(b - a) for a, b in zip(curve, curve[1:])]
    return statistics.fmean(steps) if steps else 0.0


def summarize(runs: list[dict]) -> dict:
    finals = [r["final_f1"] for r in runs]
    return {
        "f1_mean": statistics.fmean(finals),
        "f1_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "mb_per_round": statistics.fmean(m for r in runs for m in r["mb_per_round"]),
        "ratio_to_fedavg_up": statistics.fmean(r["ratio_to_fedavg_up"] for r in runs),
        "rounds_to_95": statistics.fmean(rounds_to_95(r["f1_curve"]) for r in runs),
        "spread": statistics.fmean(spread(r["f1_curve"]) for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def plot(task: str, runs: dict[str, list[dict]], results: Path, stem: str = "campaign") -> None:
    fig, (by_round, by_mb) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, seeds in runs.items():
        rounds = len(seeds[0]["f1_curve"])
        mean_curve = [statistics.fmean(r["f1_curve"][i] for r in seeds) for i in range(rounds)]
        mb = [statistics.fmean(r["mb_per_round"][i] for r in seeds) for i in range(rounds)]
        cumulative = [sum(mb[: i + 1]) for i in range(rounds)]
        style = "-" if name.startswith("safl") else "--" if name.startswith("fedfrozen") else ":"
        (line,) = by_round.plot(range(1, rounds + 1), mean_curve, style, marker="o", label=name)
        by_mb.plot(cumulative, mean_curve, style, marker="o", color=line.get_color(), label=name)
    by_round.set(
        xlabel="round", ylabel="held-out F1 (mean over seeds)", title=f"{task}: F1 by round"
    )
    by_mb.set(
        xlabel="MB uploaded, all sites, cumulative", ylabel="held-out F1", title="F1 by upload"
    )
    by_mb.set_xscale("log")
    by_round.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results / f"{stem}-{task}.png", dpi=110)
    plt.close(fig)


def table(task: str, stats: dict[str, dict], size: dict, seeds: int) -> str:
    lines = [
        f"**{task}** (3 sites x {size['docs']} documents, {size['rounds']} rounds, "
        f"max length {size['max_length']}, "
        + "".join(f"{k} {v}, " for k, v in size["extra"].items())
        + f"{seeds} seeds)",
        "",
        "| configuration | final F1 (mean ± sd) | MB up / round | share of FedAvg bytes "
        "| rounds to 95% of final F1 | round-to-round F1 change |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        lines.append(
            f"| {name} | {s['f1_mean']:.3f} ± {s['f1_std']:.3f} | {s['mb_per_round']:.1f} "
            f"| {100 * s['ratio_to_fedavg_up']:.0f}% | {s['rounds_to_95']:.1f} "
            f"| {s['spread']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("i2b2", "mimic3", "both"), default="both")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--only", help="comma-separated configuration names (default: all but fedadam, ditto)"
    )
    parser.add_argument("--name", default="campaign", help="stem of the results files")
    parser.add_argument("--work", type=Path, default=Path("campaign-runs"))
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="tiny model and corpora")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    parser.add_argument(
        "--rounds", type=int, help="override the task's rounds (runs and results get an -rN tag)"
    )
    args = parser.parse_args()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning, module="pyarrow")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    names = args.only.split(",") if args.only else DEFAULT
    if args.quick:  # the tiny model has 2 layers
        names = [n for n in names if "K=3" not in n]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {list(CONFIGS)}")
    model, sizes = ("tiny", QUICK) if args.quick else ("minilm", SIZES)
    tasks = ("i2b2", "mimic3") if args.task == "both" else (args.task,)
    suffix = "-quick" if args.quick else ""
    tag = suffix + (f"-r{args.rounds}" if args.rounds else "")
    started = time.perf_counter()
    for task in tasks:
        size = sizes[task] | ({"rounds": args.rounds} if args.rounds else {})
        data = args.work / f"{task}{suffix}-data"
        # One corpus per task: seeds vary initialisation, sampling and order.
        generate(task, data, size["docs"], seed=0)
        runs: dict[str, list[dict]] = {}
        for name in names:
            runs[name] = []
            for seed in range(args.seeds):
                out = args.work / f"{task}{tag}" / f"{slug(name)}-seed{seed}"
                run = one_run(task, data, out, name, size, model, seed, args.threads)
                runs[name].append(run)
                print(
                    f"{task} {name} seed {seed}: F1 {run['final_f1']:.3f}  "
                    f"{statistics.fmean(run['mb_per_round']):.1f} MB/round  "
                    f"{run['wall_s']:.0f} s",
                    flush=True,
                )
        stats = {name: summarize(seeds) for name, seeds in runs.items()}
        args.results.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            args.results / f"{args.name}-{task}{tag}.json",
            {"model": model, "size": size, "seeds": args.seeds, "stats": stats, "runs": runs},
        )
        md = table(task, stats, size, args.seeds)
        atomic_write_text(args.results / f"{args.name}-{task}{tag}.md", md)
        plot(f"{task}{tag}", runs, args.results, args.name)
        print(md, flush=True)
    print(f"campaign wall time {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
