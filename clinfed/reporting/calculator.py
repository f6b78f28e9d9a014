"""``clinfed privacy epsilon|noise``: the accountant with checked inputs."""

from __future__ import annotations

import math
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.privacy.accountants import (
    MIN_NOISE_MULTIPLIER,
    RELATIONS,
    Mechanism,
    budget_accountant,
    calibrate_noise,
    epsilon,
    reference_accountant,
    reference_epsilon,
)


def _run_relation() -> str:
    """What ``clinfed train`` runs under unless told otherwise (its
    ``neighbours`` setting's default: declared once, in the schema)."""
    from clinfed.settings import schema_fields

    return str(schema_fields()["neighbours"].default)


def _finite(flag: str, value: float) -> None:
    if not math.isfinite(value):
        raise ClinfedError(f"{flag} must be a finite number, not {value}")


def _check(sample_rate: float, steps: int, delta: float) -> None:
    _finite("`sample_rate`", sample_rate)
    _finite("`delta`", delta)
    if not 0 < sample_rate <= 1:
        raise ClinfedError(f"`sample_rate` must be in (0, 1], not {sample_rate}")
    if steps < 1:
        raise ClinfedError(f"`steps` must be at least 1, not {steps}")
    if not 0 < delta < 1:
        raise ClinfedError(f"`delta` must be in (0, 1), not {delta}")


def _once(relation: str, count: bool) -> list[Mechanism]:
    """What a run releases once beside its steps: under add/remove (with
    ``count``) the noisy unit count its ledger charges as round 0."""
    from clinfed.privacy.count import count_mechanism

    if relation not in RELATIONS:
        raise ClinfedError(f"`neighbours` must be one of {', '.join(RELATIONS)}, not {relation}")
    return [count_mechanism()] if relation == "add-remove" and count else []


def _described(relation: str, count: bool, unit: str) -> dict[str, Any]:
    return {
        "relation": relation,
        "count_included": bool(_once(relation, count)),
        "unit": unit,
        "accountant": budget_accountant(relation).description,
    }


def epsilon_for(
    sample_rate: float,
    noise: float,
    steps: int,
    delta: float,
    relation: str | None = None,
    count: bool = True,
    unit: str = "example",
) -> dict[str, Any]:
    """Epsilon (the budget figure, and the reference RDP bound beside it) of
    ``steps`` subsampled Gaussian steps under ``relation``, as a run's
    ledger states it: under add/remove with the count released once
    (``count``), which every private run's ledger charges."""
    relation = relation or _run_relation()
    _check(sample_rate, steps, delta)
    _finite("`noise_multiplier`", noise)
    if not noise >= MIN_NOISE_MULTIPLIER:
        raise ClinfedError(
            f"`noise_multiplier` must be at least {MIN_NOISE_MULTIPLIER} (below it one step "
            f"costs epsilon in the tens and the accountant runs out of memory), not {noise}"
        )
    mechanisms = [*_once(relation, count), Mechanism("dp-sgd", noise, sample_rate, steps)]
    return {
        "epsilon": epsilon(mechanisms, delta, relation),
        "epsilon_rdp": reference_epsilon(mechanisms, delta, relation),
        "delta": delta,
        "reference_accountant": reference_accountant(relation).description,
    } | _described(relation, count, unit)


def noise_for(
    target: float,
    delta: float,
    sample_rate: float,
    steps: int,
    relation: str | None = None,
    count: bool = True,
    unit: str = "example",
) -> dict[str, Any]:
    """The smallest noise multiplier whose epsilon is at most ``target``
    (under add/remove with the count's release, as a run calibrates)."""
    relation = relation or _run_relation()
    _check(sample_rate, steps, delta)
    _finite("`target_epsilon`", target)
    if not target > 0:
        raise ClinfedError(f"`target_epsilon` must be positive, not {target}")
    once = _once(relation, count)

    def one_step(sigma: float) -> list[Mechanism]:
        return [Mechanism("dp-sgd", sigma, sample_rate, steps)]

    try:
        sigma = calibrate_noise(
            target, delta, one_step, rounds=1, accountant=budget_accountant(relation), once=once
        )
    except ValueError as err:
        raise ClinfedError(str(err)) from None
    return {
        "noise_multiplier": sigma,
        "epsilon": epsilon([*once, *one_step(sigma)], delta, relation),
        "delta": delta,
    } | _described(relation, count, unit)
