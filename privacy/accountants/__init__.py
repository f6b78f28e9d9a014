"""Privacy accounting, pure math and no I/O: the accountants (one file each,
behind :class:`Accountant`) and the shortcuts every other module uses.

Every release a site makes is a :class:`Mechanism`: ``steps`` compositions
of the Poisson-subsampled Gaussian mechanism with noise multiplier ``sigma``
(noise standard deviation over one unit's L2 bound) and sampling rate
``q``. DP-SGD is one mechanism per round (q = batch / n_site, steps = local
steps); SAFL's private layer selection is another (q = 1, one step); under
add/remove a site's count release is a third (:mod:`clinfed.privacy.count`).

Relations: under ``add-remove`` (the CLI's default) a site releases its
count once under noise and neighbouring datasets differ by one unit; under
``replace-one`` (the library's :data:`RELATION`, which unlabelled lines of
old ledgers read as) the exact count is public and one unit is replaced.
``budget_accountant(relation)`` (dp-accounting's privacy loss distribution,
pessimistic) is the accountant every budget check, calibration and ledger
line uses; ``reference_accountant(relation)`` (Opacus's RDP, a looser bound
from another analysis) is shown beside it in reports. A new accountant is
a file here and a line in :data:`ACCOUNTANTS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from clinfed.privacy.accountants.base import RELATIONS, Accountant, Mechanism, check_delta
from clinfed.privacy.accountants.pld import PLDAccountant
from clinfed.privacy.accountants.rdp import RDPAccountant

ACCOUNTANTS: dict[str, type[Accountant]] = {"rdp": RDPAccountant, "pld": PLDAccountant}
# The neighbouring relation every figure clinfed reports is under.
RELATION = "replace-one"
# The accountant every budget check uses.
BUDGET = PLDAccountant(RELATION)
# A second analysis of the same composition, for reports.
REFERENCE = RDPAccountant(RELATION)


def budget_accountant(relation: str = RELATION) -> Accountant:
    """The accountant budgets are checked with, under ``relation``."""
    return BUDGET if relation == RELATION else PLDAccountant(relation)


def reference_accountant(relation: str = RELATION) -> Accountant:
    """The second analysis reports show, under ``relation``."""
    return REFERENCE if relation == RELATION else RDPAccountant(relation)


ACCOUNTANT = BUDGET.description
# The smallest noise multiplier clinfed accounts for. Below it one step
# already costs epsilon in the tens (q = 0.01, sigma 0.3, one step: 10.6;
# q = 0.1, sigma 0.1, 30 steps: 583), and the privacy loss distribution
# grows as 1 / sigma^2 until it fills memory (sigma 0.01: out of memory).
MIN_NOISE_MULTIPLIER = 0.1
REFERENCE_ACCOUNTANT = REFERENCE.description


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
        The search stops once the planned epsilon lies in
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

    # Search on a 10x coarser grid first where the accountant has one (an
    # evaluation costs a tenth): it is pessimistic, so the noise it finds
    # meets the target on the fine grid too, and the fine grid then moves
    # that noise down the last few percent along a curve whose slope the
    # coarse search has measured.
    coarse = getattr(accountant, "coarse", None)
    rough = coarse() if coarse is not None else accountant
    seen: dict[float, float] = {}

    def rough_planned(sigma: float) -> float:
        seen[sigma] = planned(sigma, rough)
        return seen[sigma]

    high = _bracket(rough_planned, target_epsilon, delta, rounds)
    slope = _log_slope(seen, high)
    rough_tolerance = tolerance if coarse is None else 0.02
    high = _refine(
        rough_planned, target_epsilon, high, slope, MIN_NOISE_MULTIPLIER, rough_tolerance
    )
    if coarse is None:
        return high
    return _refine(
        lambda s: planned(s, accountant),
        target_epsilon,
        high,
        _log_slope(seen, high),
        MIN_NOISE_MULTIPLIER,
        tolerance,
    )


def _log_slope(seen: dict[float, float], at: float) -> float:
    """d log(epsilon) / d log(sigma) between ``at`` and its nearest other
    point in ``seen`` (negative: more noise, less epsilon)."""
    others = [s for s in seen if s != at and math.isfinite(seen[s]) and seen[s] > 0]
    if not others or not seen.get(at, 0) > 0:
        return -1.5  # eps falls as 1 / sigma for large noise, faster below
    near = min(others, key=lambda s: abs(math.log(s / at)))
    slope = math.log(seen[near] / seen[at]) / math.log(near / at)
    return slope if slope < 0 else -1.5


def _refine(
    planned: Callable[[float], float],
    target: float,
    high: float,
    slope: float,
    floor: float,
    tolerance: float,
) -> float:
    """Lower ``high`` (whose planned epsilon meets ``target``) until its
    epsilon lies in ``[target * (1 - tolerance), target]``.

    Secant steps on log(epsilon) against log(sigma), aimed at the middle of
    that window and started from ``slope``; once a noise over the target has
    been seen, steps stay inside the bracket (Illinois regula falsi, and
    halving when a step would leave it). On the smooth monotone curve this
    takes two or three evaluations where bisection takes six or seven.
    ``floor`` itself is never tried; a noise within ``tolerance`` of it is
    accepted.
    """
    aim = math.log(target * (1 - tolerance / 2))
    enough = target * (1 - tolerance)
    spent = planned(high)
    x_high, f_high = math.log(high), math.log(spent) - aim  # f < 0: under the aim
    x_low = f_low = None  # once seen: a noise whose epsilon exceeds the target
    last = None  # which end the previous step replaced (Illinois)
    for _ in range(100):
        if spent >= enough or high <= floor * (1 + tolerance):
            break
        if x_low is None:
            x = x_high - f_high / slope if slope < 0 else x_high
            if not math.log(floor) < x < x_high:
                x = (math.log(floor) + x_high) / 2
        else:
            x = x_high - f_high * (x_high - x_low) / (f_high - f_low)
            if not x_low < x < x_high:
                x = (x_low + x_high) / 2
        sigma = math.exp(x)
        epsilon = planned(sigma)
        f = math.log(epsilon) - aim
        if epsilon > target:
            if last == "low":
                f_high /= 2
            x_low, f_low, last = x, f, "low"
        else:
            if x_low is None:
                slope = (f - f_high) / (x - x_high)
            elif last == "high":
                f_low /= 2
            x_high, f_high, high, spent, last = x, f, sigma, epsilon, "high"
        if x_low is not None and x_high - x_low < 1e-6:
            break
    return high


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


__all__ = [
    "ACCOUNTANT",
    "ACCOUNTANTS",
    "BUDGET",
    "MIN_NOISE_MULTIPLIER",
    "REFERENCE",
    "REFERENCE_ACCOUNTANT",
    "RELATION",
    "RELATIONS",
    "Accountant",
    "Mechanism",
    "budget_accountant",
    "calibrate_noise",
    "check_delta",
    "epsilon",
    "reference_accountant",
    "reference_epsilon",
]
