"""Privacy accounting: pure math, no I/O.

Every release a site makes is a :class:`Mechanism`: ``steps`` compositions
of the Poisson-subsampled Gaussian mechanism with noise multiplier ``sigma``
(noise standard deviation over one example's L2 bound) and sampling rate
``q``. DP-SGD is one mechanism per round (q = batch / n_site, steps = local
steps); SAFL's private layer selection is another (q = 1, one step).

Relation: a site releases its exact example count, so neighbouring datasets
are one example *replaced* by another (see
:mod:`clinfed.privacy.accountants`). Budgets, calibration and ledger lines
use dp-accounting's privacy loss distribution under replace-one
(:data:`BUDGET`); reports show Opacus's RDP under replace-one beside it
(:data:`REFERENCE`, a looser bound from another analysis).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from clinfed.privacy.accountants import (
    BUDGET,
    REFERENCE,
    RELATION,
    Accountant,
    Mechanism,
    budget_accountant,
    check_delta,
    reference_accountant,
)

ACCOUNTANT = BUDGET.description
# The smallest noise multiplier clinfed accounts for. Below it one step
# already costs epsilon in the tens (q = 0.01, sigma 0.3, one step: 10.6;
# q = 0.1, sigma 0.1, 30 steps: 583), and the privacy loss distribution
# grows as 1 / sigma^2 until it fills memory (sigma 0.01: out of memory).
MIN_NOISE_MULTIPLIER = 0.1
REFERENCE_ACCOUNTANT = REFERENCE.description

__all__ = [
    "ACCOUNTANT",
    "REFERENCE_ACCOUNTANT",
    "RELATION",
    "Mechanism",
    "calibrate_noise",
    "epsilon",
    "reference_epsilon",
]


def epsilon(mechanisms: Sequence[Mechanism], delta: float, relation: str = RELATION) -> float:
    """Epsilon at ``delta`` of the composition of ``mechanisms`` by the
    budget accountant (PLD) under ``relation``."""
    return budget_accountant(relation).epsilon(mechanisms, delta)


def reference_epsilon(
    mechanisms: Sequence[Mechanism], delta: float, relation: str = RELATION
) -> float:
    """The same composition by the reference analysis (RDP; a looser bound
    shown beside the budget figure, never used for checks)."""
    return reference_accountant(relation).epsilon(mechanisms, delta)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    round_mechanisms: Callable[[float], Sequence[Mechanism]],
    rounds: int,
    tolerance: float = 0.005,
    accountant: Accountant = BUDGET,
    once: Sequence[Mechanism] = (),
) -> float:
    """The smallest DP-SGD noise multiplier that keeps a planned run within
    ``target_epsilon``.

    Parameters
    ----------
    round_mechanisms
        Given a noise multiplier, the mechanisms of one round (DP-SGD plus,
        if any, a private selection whose cost does not depend on it).
    rounds
        Rounds the site is planned to train.
    once
        Mechanisms released once per run whatever the noise (a noisy count).
    tolerance
        Bisection stops once the planned epsilon lies in
        ``[target * (1 - tolerance), target]``.

    Returns
    -------
    float
        A noise multiplier whose planned epsilon is at most the target, never
        below :data:`MIN_NOISE_MULTIPLIER` (the search stops there however
        large the target).

    Raises
    ------
    ValueError
        When even a huge noise multiplier cannot meet the target (the
        mechanisms that do not depend on it already exceed it).
    """
    if not 0 < target_epsilon < math.inf:
        raise ValueError(f"target epsilon must be positive and finite, not {target_epsilon}")
    check_delta(delta)

    def planned(sigma: float, by: Accountant) -> float:
        return by.epsilon([*once, *(list(round_mechanisms(sigma)) * rounds)], delta)

    coarse = getattr(accountant, "coarse", None)
    if coarse is not None:
        # Search on the 10x coarser grid first: it is pessimistic, so the
        # noise it finds meets the target on the fine grid too, and the
        # fine search only narrows [0.8x, 1x] of it.
        rough = coarse()
        high = _bisect(
            lambda s: planned(s, rough),
            target_epsilon,
            MIN_NOISE_MULTIPLIER,
            _bracket(lambda s: planned(s, rough), target_epsilon, delta, rounds),
            0.02,
        )
        low = MIN_NOISE_MULTIPLIER
        if high * 0.8 > low and planned(high * 0.8, accountant) > target_epsilon:
            low = high * 0.8
    else:
        high = _bracket(lambda s: planned(s, accountant), target_epsilon, delta, rounds)
        low = MIN_NOISE_MULTIPLIER
    return _bisect(lambda s: planned(s, accountant), target_epsilon, low, high, tolerance)


def _bracket(planned: Callable[[float], float], target: float, delta: float, rounds: int) -> float:
    """A noise multiplier (a power of 2) whose planned epsilon meets ``target``."""
    high = 1.0
    while planned(high) > target:
        high *= 2
        if high > 1e4:
            raise ValueError(
                f"epsilon {target} at delta {delta} is out of reach for {rounds} rounds: "
                "costs that do not depend on the DP-SGD noise already exceed it"
            )
    return high


def _bisect(
    planned: Callable[[float], float], target: float, low: float, high: float, tolerance: float
) -> float:
    """Narrow [low, high] (``high`` meets the target) until it is within
    ``tolerance``; ``low`` itself is never tried (the floor)."""
    if high <= low:
        return high
    for _ in range(100):
        mid = (low + high) / 2
        eps = planned(mid)
        if eps > target:
            low = mid
        else:
            high = mid
            if eps >= target * (1 - tolerance):
                break
        if high - low < 1e-6 * high:
            break
    return high


def is_finite(value: float) -> bool:
    return not (math.isinf(value) or math.isnan(value))
