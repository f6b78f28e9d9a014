"""Personalized prompts (pfeddc) on strongly heterogeneous sites.

Synthetic i2b2 and MIMIC-III with ``heterogeneity="strong"`` (each i2b2 site
leans hard towards one concept type, MIMIC-III case mixes drift far apart,
abbreviation habits at the extremes). Every configuration is scored on
each site's own held-out data with the model that site would use: the
global model for fedavg and safl+fedfrozen, the site's own for local and
pfeddc. Reported per configuration, over seeds: mean per-site F1, worst
site's F1, MB uploaded per round (all sites) and its share of FedAvg's; for
pfeddc also the global prompt alone (each site's own head).

Writes ``RESULTS/pfeddc-<task>.json`` and ``.md``; runs live under
``--work`` and finished ones are not rerun.

    .venv/bin/python benchmarks/pfeddc_campaign.py                # both tasks, 1 seed
    .venv/bin/python benchmarks/pfeddc_campaign.py --task i2b2 --seeds 2
    .venv/bin/python benchmarks/pfeddc_campaign.py --quick        # tiny model, smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from campaign import SIZES as CAMPAIGN_SIZES  # benchmarks/campaign.py, beside this file

from clinfed.core.quiet import quiet_libraries
from clinfed.core.runs import atomic_write_json, atomic_write_text, read_jsonl
from clinfed.runners.pipeline import RunConfig, run_training

PROMPT_RATES = {"lr": 1e-2, "head_lr": 1e-2}
CONFIGS: dict[str, dict] = {
    "fedavg": {"strategy": "fedavg"},
    "local": {"strategy": "local"},
    "safl+fedfrozen K=2 W=3": {"strategy": "safl+fedfrozen", "top_layers": 2, "freeze_from": "3"},
    "pfeddc": {"strategy": "pfeddc", **PROMPT_RATES},
    "pfeddc, no fusion (concat)": {"strategy": "pfeddc", "prompt_fusion": "concat", **PROMPT_RATES},
    "pfeddc, no local prompt": {"strategy": "pfeddc", "prompt_fusion": "global", **PROMPT_RATES},
    # Deep prompts at every layer need a lower prompt rate: at 1e-2 sites
    # collapsed to F1 0 within 3 rounds in a pilot; 2e-3 was stable.
    "pfeddc, deep prompts (all layers)": {
        "strategy": "pfeddc",
        "prompt_depth": 6,
        "lr": 2e-3,
        "head_lr": 1e-2,
    },
}
# The same sizes as the SAFL/FedFrozen campaign, so the figures sit side by side.
SIZES = CAMPAIGN_SIZES
QUICK = {
    "i2b2": {"docs": 6, "rounds": 2, "max_length": 48, "extra": {}},
    "mimic3": {"docs": 16, "rounds": 2, "max_length": 64, "extra": {"top_k": 5, "max_chunks": 2}},
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def make_data(task: str, folder: Path, docs: int, seed: int) -> None:
    if (folder / ".done").exists():
        return
    if task == "i2b2":
        from clinfed.tasks.i2b2.synth import generate
    else:
        from clinfed.tasks.mimic3.synth import generate
    generate(folder, sites=3, docs=docs, seed=seed, heterogeneity="strong")
    (folder / ".done").write_text("")


def run_cell(
    task: str, name: str, seed: int, data: Path, out: Path, size: dict, model: str, threads: int
):
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text()), None
    if out.exists():
        import shutil

        shutil.rmtree(out)
    config = RunConfig.of(
        task=task,
        data=str(data),
        out=str(out),
        model=model,
        rounds=size["rounds"],
        max_length=size["max_length"],
        seed=seed,
        threads=threads,
        **(size["extra"] | CONFIGS[name]),
    )
    started = time.perf_counter()
    summary = run_training(config)
    return summary, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("i2b2", "mimic3", "both"), default="both")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("campaign-runs/pfeddc"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = parser.parse_args()
    quiet_libraries()
    tasks = ("i2b2", "mimic3") if args.task == "both" else (args.task,)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONFIGS)
    model = "tiny" if args.quick else "minilm"
    for task in tasks:
        size = (QUICK if args.quick else SIZES)[task]
        rows = {}
        for name in names:
            cells = []
            for seed in range(args.seeds):
                data = args.work / f"data-{task}-{seed}"
                make_data(task, data, size["docs"], seed)
                out = args.work / f"{task}-{slug(name)}-s{seed}"
                summary, seconds = run_cell(task, name, seed, data, out, size, model, args.threads)
                last = [r for r in read_jsonl(out / "metrics.jsonl") if "client" not in r][-1]
                sites = last["per_site_f1"]
                cell = {
                    "mean_site_f1": statistics.mean(sites.values()),
                    "worst_site_f1": min(sites.values()),
                    "per_site_f1": sites,
                    "mb_up_per_round": summary["mb_up"] / size["rounds"],
                    "share_of_fedavg_up": summary["ratio_to_fedavg_up"],
                    "seconds": seconds,
                }
                if "global_prompt_per_site_f1" in last:
                    alone = last["global_prompt_per_site_f1"]
                    cell["global_prompt_mean_f1"] = statistics.mean(alone.values())
                    cell["global_prompt_worst_f1"] = min(alone.values())
                cells.append(cell)
                print(
                    f"{task} {name} seed {seed}: mean {cell['mean_site_f1']:.3f} "
                    f"worst {cell['worst_site_f1']:.3f}",
                    flush=True,
                )
            rows[name] = cells
        write(task, rows, size, args, model)


def _mean(cells: list[dict], key: str) -> float | None:
    values = [c[key] for c in cells if c.get(key) is not None]
    return statistics.mean(values) if values else None


def _sd(cells: list[dict], key: str) -> float:
    values = [c[key] for c in cells]
    return statistics.stdev(values) if len(values) > 1 else 0.0


def write(task: str, rows: dict, size: dict, args, model: str) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    atomic_write_json(args.results / f"pfeddc-{task}{suffix}.json", {"size": size, "rows": rows})
    lines = [
        f"# pfeddc on strongly heterogeneous synthetic {task} ({model}, 3 sites x "
        f"{size['docs']} docs, {size['rounds']} rounds, {args.seeds} seed(s))",
        "",
        "| configuration | mean per-site F1 | worst site F1 | global prompt alone (mean / worst) "
        "| MB up per round | share of FedAvg's upload |",
        "|---|---|---|---|---|---|",
    ]
    for name, cells in rows.items():
        alone = _mean(cells, "global_prompt_mean_f1")
        alone_text = (
            f"{alone:.3f} / {_mean(cells, 'global_prompt_worst_f1'):.3f}"
            if alone is not None
            else "-"
        )
        lines.append(
            f"| {name} | {_mean(cells, 'mean_site_f1'):.3f} ± {_sd(cells, 'mean_site_f1'):.3f} "
            f"| {_mean(cells, 'worst_site_f1'):.3f} | {alone_text} "
            f"| {_mean(cells, 'mb_up_per_round'):.3f} | {_mean(cells, 'share_of_fedavg_up'):.4%} |"
        )
    atomic_write_text(args.results / f"pfeddc-{task}{suffix}.md", "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
