"""``clinfed privacy plan``: what a budget buys, before any is spent.

A privacy officer's first question is what epsilon 1, 4 or 8 costs in model
quality. The plan answers it from the sites' sizes alone (declared, or the
counts a run released under noise): for each budget, each site's derived
batch, steps, noise multiplier, epsilon after each round and the noise on
its averaged step (:func:`noise_plan`, instant, no data read). With public
annotated text it also forecasts F1: the same plan runs on that text split
into sites of the same sizes, once per budget and once without DP, and the
forecast cost of DP is the difference (:func:`forecast`). No private text
is read at any point.

The forecast is only as good as the public text is close to the sites'
(docs/results.md gives its measured error): give text the starting model
did not train on, or the forecast is run on text the model already knows.
"""

from __future__ import annotations

import math
import random
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.privacy.accountants import epsilon
from clinfed.privacy.policy import COUNT_MECHANISM, PrivacyPolicy
from clinfed.privacy.recipe import steps_per_epoch
from clinfed.settings import RunConfig
from clinfed.tasks import TASKS

# Held-out units of the public text the forecast scores on, at most.
FORECAST_TEST_UNITS = 2000


def parse_units(text: str) -> dict[str, int]:
    """``"1520,1520,1400"`` -> ``{"site1": 1520, ...}``: each site's units."""
    sizes = {}
    for number, part in enumerate(text.split(","), start=1):
        try:
            value = int(part.strip())
        except ValueError:
            raise ClinfedError(f"--units: {part.strip()!r} is not a whole number") from None
        if value < 1:
            raise ClinfedError(f"--units: {value} is not a positive number of units")
        sizes[f"site{number}"] = value
    return sizes


def noise_plan(config: RunConfig, sizes: dict[str, int], epsilons: list[float]) -> list[dict]:
    """One row per budget and site: what the site's DP-SGD would take and
    spend under ``config``'s plan (its settings resolved as a run's are)."""
    rows = []
    task = TASKS[config.task]
    for target in epsilons:
        if math.isinf(target):
            continue
        run = replace(config, target_epsilon=target, noise_multiplier=None).resolved()
        with tempfile.TemporaryDirectory() as folder:
            policy = PrivacyPolicy.build(
                Path(folder), sizes, run.batch_size, run.local_epochs, run.rounds, run.delta,
                target, None, run.max_grad_norm, run.clipping,
                reference_batch=task.defaults["batch_size"], relation=run.neighbours,
                steps_per_epoch=steps_per_epoch(run.adapter),
            )  # fmt: skip
        for site, units in sizes.items():
            first = policy.round_mechanisms(site)
            later = [m for m in first if m.name != COUNT_MECHANISM]
            by_round = [
                epsilon([*first, *later * k], run.delta, run.neighbours) for k in range(run.rounds)
            ]
            batch = policy.batch_sizes[site]
            rows.append({
                "target_epsilon": target,
                "site": site,
                "units": units,
                "batch_size": batch,
                "steps_per_round": first[0].steps,
                "noise_multiplier": policy.noise[site],
                "noise_on_mean_step": policy.noise[site] * run.max_grad_norm / batch,
                "epsilon_by_round": by_round,
                "delta": run.delta,
                "unit": run.privacy_unit,
                "relation": run.neighbours,
            })  # fmt: skip
    return rows


def public_sites(
    config: RunConfig, task: Any, sizes: dict[str, int], out: Path, problems: ProblemLog
) -> int:
    """Write ``config.public_data`` as a corpus under ``out`` (``train/`` with
    a site per entry of ``sizes``, that many units each, and ``test/``) in
    the run's types; returns the held-out units. Units are drawn at random
    (the run's seed)."""
    units = task.public_units(Path(config.public_data), config.public_types, problems)
    wanted = sum(sizes.values())
    if len(units) < wanted + 50:
        raise ClinfedError(
            f"--public-data {config.public_data}: {len(units):,} units, and the plan's sites "
            f"need {wanted:,} plus at least 50 to score on"
        )
    random.Random(config.seed).shuffle(units)
    parts, start = {}, 0
    for site, n in sizes.items():
        parts[site] = units[start : start + n]
        start += n
    test = units[start : start + FORECAST_TEST_UNITS]
    task.write_public_sites(parts, test, out)
    return len(test)


def forecast(
    config: RunConfig,
    sizes: dict[str, int],
    epsilons: list[float],
    out: Path,
    report=lambda event, info: None,
) -> dict[str, Any]:
    """Run the plan on ``config.public_data`` split into sites of ``sizes``,
    at each budget and without DP (one ``clinfed sweep`` under ``out``), and
    return F1 per budget and the forecast cost of DP in points."""
    from clinfed.factories import make_task
    from clinfed.scratch import temporary_folder
    from clinfed.sweep import run_sweep

    if not config.public_data:
        raise ClinfedError("a forecast needs --public-data: annotated public text to run on")
    out.mkdir(parents=True, exist_ok=False)
    corpus = out / "public-sites"
    with temporary_folder("cache") as cache:
        task = make_task(config.resolved(), cache)
    test_units = public_sites(config, task, sizes, corpus, ProblemLog(config.on_error))
    base = replace(
        config, data=str(corpus), public_data=None, public_types=None, out=str(out / "runs"),
        resume=False, **task.forecast_settings(),
    )  # fmt: skip
    budgets = sorted({*epsilons, math.inf})
    rows = run_sweep(base, out / "runs", [config.strategy], budgets, 1, report)
    f1 = {row["target_epsilon"]: row["f1"] for row in rows}
    reference = f1.get(math.inf)
    return {
        "public_data": str(Path(config.public_data).resolve()),
        "sites": sizes,
        "test_units": test_units,
        "f1": {("inf" if math.isinf(e) else f"{e:g}"): f1.get(e) for e in budgets},
        "cost_points": {
            f"{e:g}": None if f1.get(e) is None or reference is None else 100 * (reference - f1[e])
            for e in budgets
            if not math.isinf(e)
        },
    }
