"""``clinfed sweep``: F1 at fixed privacy budgets, per strategy.

Every cell (strategy, epsilon, seed) is an ordinary run folder under the
sweep folder, named ``<strategy>-eps<epsilon>-seed<seed>``. A cell with a
``summary.json`` is finished and never rerun; any other cell is resumed
(from its last committed round, or from the start if it died before one).
A sweep never overwrites: its folder is new, or an earlier sweep's (marked
by ``sweep.json``) continued with ``--resume``. The table
(``sweep.csv``, ``sweep.md``) and the plot (``sweep.png``) are rewritten
from all finished cells after every cell. ``times.jsonl`` records each
cell's wall time (every attempt of a resumed cell adds its own line); the
table gives their sum per cell. A cell trained with adapters is labelled
with them (``fedavg + lora``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib

from clinfed.core.errors import ClinfedError
from clinfed.core.events import CellEnd, CellStart, Reporter, SweepStart, silent
from clinfed.core.runs import (
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    cell_name,
    read_jsonl,
)
from clinfed.federated.strategies import STRATEGIES
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.runners.resume import check_same_settings
from clinfed.settings import read_run_config

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse_epsilons(text: str) -> list[float]:
    """``"0.5,1,inf"`` -> ``[0.5, 1.0, inf]``; every value positive."""
    values = []
    for part in text.split(","):
        try:
            value = float(part.strip())
        except ValueError:
            raise ClinfedError(f"`epsilons`: {part.strip()!r} is not a number or 'inf'") from None
        if not value > 0:
            raise ClinfedError(f"`epsilons`: {value} is not positive")
        values.append(value)
    return values


def _check_request(
    base: RunConfig, out: Path, strategies: list[str], epsilons: list[float], seeds: int
) -> None:
    """Everything a sweep checks before its folder is made."""
    if not strategies:
        raise ClinfedError("`strategies`: name at least one federated strategy")
    if not epsilons:
        raise ClinfedError("`epsilons`: name at least one target epsilon (inf: no DP)")
    for strategy in strategies:
        if strategy not in STRATEGIES or STRATEGIES[strategy].pooled:
            raise ClinfedError(f"`strategies`: {strategy!r} is not a federated strategy")
    if seeds < 1:
        raise ClinfedError("`seeds` must be at least 1")
    # Validated before the sweep folder is made: never inside what runs read.
    from clinfed.core.runs import ensure_outside
    from clinfed.settings import PUBLIC_INPUTS, flag

    ensure_outside(out, base.data)
    for name in PUBLIC_INPUTS:
        if getattr(base, name) and Path(getattr(base, name)).is_dir():
            ensure_outside(out, getattr(base, name), flag(name))
    # Never overwrite: a sweep folder is new, or an earlier sweep's
    # (sweep.json) continued with --resume.
    marker = out / "sweep.json"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not out.is_dir() or not marker.is_file():
            raise ClinfedError(f"{out}: exists and is not a sweep folder; choose a new `out`")
        if not base.resume:
            raise ClinfedError(
                f"{out}: holds a sweep already; `resume` continues it, or choose a new `out`"
            )
    elif base.resume:
        raise ClinfedError(f"{out}: no sweep to resume (no sweep.json); drop `resume` to start one")


def run_sweep(
    base: RunConfig,
    out: Path,
    strategies: list[str],
    epsilons: list[float],
    seeds: int,
    report: Reporter = silent,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run every missing cell; return one row per finished cell.

    ``options`` are strategy options; each cell takes those its strategy has.
    """
    options = dict(options or {})
    _check_request(base, out, strategies, epsilons, seeds)
    marker = out / "sweep.json"
    out.mkdir(parents=True, exist_ok=True)
    if not marker.is_file():
        atomic_write_json(
            marker,
            {"strategies": strategies, "epsilons": [str(e) for e in epsilons], "seeds": seeds},
        )
    planned = {
        cell_name(strategy, eps, seed): replace(
            base,
            out=str(out / cell_name(strategy, eps, seed)),
            strategy=strategy,
            seed=seed,
            target_epsilon=None if math.isinf(eps) else eps,
            resume=False,
            strategy_options=options_for(strategy, options),
        )
        for strategy in strategies
        for eps in epsilons
        for seed in range(seeds)
    }
    finished = [name for name in planned if (out / name / "summary.json").is_file()]
    for name in finished:
        # A finished cell is kept only if it is the cell this sweep asks for
        # (checked for every cell before any trains).
        check_same_settings(planned[name].resolved(), out / name, "sweep --resume: cell")
    report(SweepStart(cells=len(planned), finished=len(finished)))
    for name, config in planned.items():
        folder = out / name
        if name in finished:
            continue
        # A started cell continues (or starts over if it died before its
        # first round); a folder that is not a run is left alone.
        resume = folder.exists()
        if resume and not (folder / "config.json").is_file():
            raise ClinfedError(f"{folder}: not a clinfed run folder; the sweep will not touch it")
        report(CellStart(cell=name))
        started = time.perf_counter()
        run_training(replace(config, resume=resume))
        seconds = round(time.perf_counter() - started, 1)
        append_jsonl(out / TIMES, {"cell": name, "seconds": seconds})
        write_table(out, collect(out))
        report(CellEnd(cell=name, seconds=seconds))
    rows = collect(out)
    write_table(out, rows)
    return rows


def options_for(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options among ``options`` that ``strategy`` takes."""
    from dataclasses import fields

    own = {f.name for f in fields(STRATEGIES[strategy].options)}
    return {k: v for k, v in options.items() if k in own}


TIMES = "times.jsonl"


def collect(out: Path) -> list[dict[str, Any]]:
    rows = []
    seconds: dict[str, float] = {}
    if (out / TIMES).is_file():
        for line in read_jsonl(out / TIMES):
            seconds[line["cell"]] = seconds.get(line["cell"], 0.0) + line["seconds"]
    for summary_path in sorted(out.glob("*/summary.json")):
        config = read_run_config(summary_path.parent)
        summary = json.loads(summary_path.read_text())
        target = config.get("target_epsilon")
        spent = summary.get("epsilon") or {}
        adapter = config.get("adapter", "none")
        cell = summary_path.parent.name
        rows.append(
            {
                "strategy": config["strategy"] + ("" if adapter == "none" else f" + {adapter}"),
                "target_epsilon": math.inf if target is None else target,
                "seed": config["seed"],
                "f1": summary.get("f1"),  # None: no site evaluated
                "max_epsilon_spent": max(spent.values()) if spent else math.inf,
                "mb_up": summary.get("mb_up"),
                "wall_min": round(seconds[cell] / 60, 1) if cell in seconds else None,
                "run": cell,
            }
        )
    return rows


def write_table(out: Path, rows: list[dict[str, Any]]) -> None:
    buffer = io.StringIO()
    fields = [
        "strategy",
        "target_epsilon",
        "seed",
        "f1",
        "max_epsilon_spent",
        "mb_up",
        "wall_min",
        "run",
    ]
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out / "sweep.csv", buffer.getvalue())
    cells: dict[tuple[str, float], list[float]] = {}
    for row in rows:
        scores = cells.setdefault((row["strategy"], row["target_epsilon"]), [])
        if row["f1"] is not None:
            scores.append(row["f1"])
    strategies = sorted({s for s, _ in cells})
    epsilons = sorted({e for _, e in cells})
    header = "| strategy | " + " | ".join(f"eps {e:g}" for e in epsilons) + " |"
    lines = [header, "|---" * (len(epsilons) + 1) + "|"]
    for strategy in strategies:
        values = []
        for eps in epsilons:
            f1s = cells.get((strategy, eps))
            values.append(f"{statistics.fmean(f1s):.3f}" if f1s else "-")
        lines.append(f"| {strategy} | " + " | ".join(values) + " |")
    atomic_write_text(out / "sweep.md", "\n".join(lines) + "\n")
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    finite = [e for e in epsilons if not math.isinf(e)]
    inf_x = (max(finite) * 2) if finite else 1.0
    for strategy in strategies:
        xs = [e for e in epsilons if cells.get((strategy, e))]
        ys = [statistics.fmean(cells[(strategy, e)]) for e in xs]
        ax.plot([inf_x if math.isinf(e) else e for e in xs], ys, marker="o", label=strategy)
    ax.set_xscale("log")
    ax.set(xlabel="target epsilon (rightmost: no DP)", ylabel="held-out F1", ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.savefig(out / "sweep.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
