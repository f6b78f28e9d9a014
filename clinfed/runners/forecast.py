"""``clinfed privacy plan``: what a budget buys, before any is spent.

A privacy officer's first question is what epsilon 1, 4 or 8 costs in model
quality. The plan answers it from the sites' sizes alone (declared, or the
counts a run released under noise): for each budget, each site's derived
batch, steps, noise multiplier, epsilon after each round and the noise on
its averaged step (:func:`noise_plan`, instant, no data read). With public
annotated text it also forecasts F1: the same plan runs on that text dealt
into sites of the same sizes, several times per budget (each draw its own
deal, seed and secret noise) and once without DP; the forecast is the
draws' mean with an interval (their range widened by F1's scoring error
on the public held-out text and on the sites' own, estimated from sizes),
and the forecast cost of DP its difference from the run without
(:func:`forecast`). No private text is read at any point.

The forecast is only as good as the public text is close to the sites'
(docs/results.md gives its measured error): give text the starting model
did not train on, or the forecast is run on text the model already knows.
Text that leaves one of the run's types unannotated is refused
(:func:`check_public_text`): there the forecast misled by 50 points.
"""

from __future__ import annotations

import math
import random
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.events import Reporter, silent
from clinfed.privacy.accountants import epsilon
from clinfed.privacy.policy import COUNT_MECHANISM, PrivacyPolicy
from clinfed.privacy.recipe import steps_per_epoch
from clinfed.settings import RunConfig
from clinfed.tasks import TASKS

# Held-out units of the public text the forecast scores on, at most, and
# the fewest it scores on.
FORECAST_TEST_UNITS = 2000
MIN_TEST_UNITS = 50
# A site's units at most: the plan sizes its batch and accounting from it.
MAX_UNITS = 10**9
# Deals of the public text into sites, each trained at every budget: their
# spread is the forecast's interval (DP noise, sampling and which notes).
FORECAST_DRAWS = 3


def parse_units(text: str) -> dict[str, int]:
    """``"1520,1520,1400"`` -> ``{"site1": 1520, ...}``: each site's units."""
    sizes = {}
    for number, part in enumerate(text.split(","), start=1):
        try:
            value = int(part.strip())
        except ValueError:
            raise ClinfedError(f"`units`: {part.strip()!r} is not a whole number") from None
        if not 1 <= value <= MAX_UNITS:
            raise ClinfedError(f"`units`: {value} is not a number of units from 1 to {MAX_UNITS:,}")
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


def deal(units: list, sizes: dict[str, int], seed: int) -> tuple[dict[str, list], list]:
    """Deal ``units`` at random (``seed``) into sites of ``sizes`` and a
    held-out share of at most :data:`FORECAST_TEST_UNITS`."""
    units = list(units)
    random.Random(seed).shuffle(units)
    parts, start = {}, 0
    for site, n in sizes.items():
        parts[site] = units[start : start + n]
        start += n
    return parts, units[start : start + FORECAST_TEST_UNITS]


def check_public_text(config: RunConfig, task: Any, units: list, sizes: dict[str, int]) -> None:
    """Refuse public text a forecast cannot speak from: too little to deal
    into the sites and score, or text that leaves one of the run's types
    unannotated (its F1 would say nothing of that type, and measured on
    BC5CDR such text overstated DP's cost by 50 points: docs/results.md)."""
    wanted = sum(sizes.values())
    if len(units) < wanted + MIN_TEST_UNITS:
        raise ClinfedError(
            f"`public_data` {config.public_data}: {len(units):,} units, and the plan's sites "
            f"need {wanted:,} plus at least {MIN_TEST_UNITS} to score on"
        )
    mentions = task.public_mentions(units)
    # The types the run's declaration names (--types, or the i2b2 preset):
    # what the sites' text is declared to hold, all of it public.
    named = getattr(task, "named_types", None) or set(task.entity_types)
    declared = [kind for kind in task.entity_types if kind in named]
    missing = [kind for kind in declared if not mentions.get(kind)]
    if missing:
        raise ClinfedError(
            f"`public_data` {config.public_data}: annotates no mention of {' or '.join(missing)} "
            f"(the run's types name {', '.join(declared)}); public text unlike the sites "
            "gives a forecast that misleads, so none is made: give text that annotates "
            "every type (map its own with `public_types`)"
        )


def interval(
    values: list[float], public_mentions: int, site_mentions: int
) -> tuple[float, float, float]:
    """The point forecast (the draws' mean) and its interval: the draws'
    range widened by twice the scoring error of an F1 measured twice, once
    on the forecast's ``public_mentions`` and once on the sites' own held-out
    ``site_mentions`` (``sqrt(F(1-F)/n)`` each): what the sites will measure
    carries their test set's sampling error too, and one draw still gets an
    interval."""
    point = sum(values) / len(values)
    spread = max(point * (1 - point), 0.0)
    error = 2 * math.sqrt(spread / max(public_mentions, 1) + spread / max(site_mentions, 1))
    return point, max(0.0, min(values) - error), min(1.0, max(values) + error)


def site_mentions(task: Any, sizes: dict[str, int], mentions_per_unit: float) -> int:
    """The mentions the sites' held-out notes hold, estimated from their
    training units, the task's held-out share and the public text's
    mentions per unit (the sites' own counts are private)."""
    share = task.held_out_share
    return max(1, round(sum(sizes.values()) * share / (1 - share) * mentions_per_unit))


def forecast(
    config: RunConfig,
    sizes: dict[str, int],
    epsilons: list[float],
    out: Path,
    draws: int = FORECAST_DRAWS,
    report: Reporter = silent,
) -> dict[str, Any]:
    """Run the plan on ``config.public_data`` dealt into sites of ``sizes``:
    ``draws`` times at each budget, each draw its own deal and seed, and
    once without DP (one ``clinfed sweep`` per draw under ``out``); return
    F1 per budget as a point (the draws' mean) with an interval, and the
    forecast cost of DP in points. The public text is read and checked
    (:func:`check_public_text`) before ``out`` is made."""
    from clinfed.core.scratch import temporary_folder
    from clinfed.runners.factories import make_task
    from clinfed.runners.sweep import run_sweep

    if not config.public_data:
        raise ClinfedError("a forecast needs `public_data`: annotated public text to run on")
    if draws < 1:
        raise ClinfedError(f"`forecast_draws`: {draws} is not a positive number of draws")
    with temporary_folder("cache") as cache:
        task = make_task(config.resolved(), cache)
    problems = ProblemLog(config.on_error)
    units = task.public_units(Path(config.public_data), config.public_types, problems)
    check_public_text(config, task, units, sizes)
    out.mkdir(parents=True, exist_ok=False)
    budgets = sorted(e for e in set(epsilons) if not math.isinf(e))
    f1: dict[float, list[float]] = {e: [] for e in [*budgets, math.inf]}
    mentions = 0
    for draw in range(draws):
        parts, test = deal(units, sizes, config.seed + draw)
        mentions += sum(task.public_mentions(test).values())
        corpus = out / f"public-sites-{draw}"
        task.write_public_sites(parts, test, corpus)
        base = replace(
            config, data=str(corpus), public_data=None, public_types=None,
            out=str(out / f"runs-{draw}"), resume=False, seed=config.seed + draw,
            **task.forecast_settings(),
        )  # fmt: skip
        # The cost of DP needs one run without it; each draw adds the budgets.
        cells = [*budgets, math.inf] if draw == 0 else budgets
        for row in run_sweep(base, out / f"runs-{draw}", [config.strategy], cells, 1, report):
            if row["f1"] is not None:
                f1[row["target_epsilon"]].append(row["f1"])
    per_draw = mentions // draws
    at_sites = site_mentions(task, sizes, per_draw / max(len(test), 1))
    forecasts = {
        ("inf" if math.isinf(e) else f"{e:g}"): dict(
            zip(("f1", "low", "high"), interval(values, per_draw, at_sites)), draws=values
        )
        for e, values in f1.items()
        if values
    }
    reference = forecasts.get("inf", {}).get("f1")
    return {
        "public_data": str(Path(config.public_data).resolve()),
        "sites": sizes,
        "test_units": len(test),
        "test_mentions": per_draw,
        "site_mentions_estimate": at_sites,
        "forecasts": forecasts,
        "f1": {name: made["f1"] for name, made in forecasts.items()},
        "cost_points": {
            name: None if reference is None else 100 * (reference - made["f1"])
            for name, made in forecasts.items()
            if name != "inf"
        },
    }
