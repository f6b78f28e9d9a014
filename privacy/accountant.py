"""Privacy accounting: pure math, no I/O.

Every release a site makes is a :class:`Mechanism`: ``steps`` compositions
of the Poisson-subsampled Gaussian mechanism with noise multiplier ``sigma``
(noise standard deviation over L2 sensitivity) and sampling rate ``q``.
DP-SGD is one mechanism per round (q = batch / n_site, steps = local steps);
SAFL's private layer selection is another (q = 1, one step). Composition is
by Rényi DP (Mironov 2017; Mironov, Talwar and Zhang 2019) through Opacus's
RDP analysis, the accountant every budget check uses. A tighter
privacy-loss-distribution (PLD) figure from Google's dp-accounting is
available beside it, labelled, for reports only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from clinfed.privacy.accountants import BUDGET, Accountant, Mechanism, check_delta
from clinfed.privacy.accountants.pld import PLDAccountant

ACCOUNTANT = BUDGET.description

__all__ = ["ACCOUNTANT", "Mechanism", "calibrate_noise", "epsilon", "pld_epsilon"]


def epsilon(mechanisms: Sequence[Mechanism], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of ``mechanisms`` by the
    budget accountant (RDP)."""
    return BUDGET.epsilon(mechanisms, delta)


def pld_epsilon(mechanisms: Sequence[Mechanism], delta: float) -> float:
    """The same composition through a privacy loss distribution (tighter;
    shown beside the RDP figure, never used for budget checks)."""
    return PLDAccountant().epsilon(mechanisms, delta)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    round_mechanisms: Callable[[float], Sequence[Mechanism]],
    rounds: int,
    tolerance: float = 0.005,
    accountant: Accountant = BUDGET,
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
    tolerance
        Bisection stops once the planned epsilon lies in
        ``[target * (1 - tolerance), target]``.

    Returns
    -------
    float
        A noise multiplier whose planned epsilon is at most the target.

    Raises
    ------
    ValueError
        When even a huge noise multiplier cannot meet the target (the
        mechanisms that do not depend on it already exceed it).
    """
    if not target_epsilon > 0:
        raise ValueError(f"target epsilon must be positive, not {target_epsilon}")
    check_delta(delta)

    def planned(sigma: float) -> float:
        return accountant.epsilon(list(round_mechanisms(sigma)) * rounds, delta)

    high = 1.0
    while planned(high) > target_epsilon:
        high *= 2
        if high > 1e4:
            raise ValueError(
                f"epsilon {target_epsilon} at delta {delta} is out of reach for {rounds} rounds: "
                "costs that do not depend on the DP-SGD noise already exceed it"
            )
    low = 0.0
    for _ in range(100):
        mid = (low + high) / 2
        eps = planned(mid)
        if eps > target_epsilon:
            low = mid
        else:
            high = mid
            if eps >= target_epsilon * (1 - tolerance):
                break
        if high - low < 1e-6 * high:
            break
    return high


def is_finite(value: float) -> bool:
    return not (math.isinf(value) or math.isnan(value))
