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
from dataclasses import asdict, dataclass

from opacus.accountants.analysis import rdp as rdp_analysis

ACCOUNTANT = "RDP (Opacus RDP analysis of the Poisson-subsampled Gaussian)"
# Opacus's default order grid, extended: small epsilons need large orders.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 128, 256, 512]


@dataclass(frozen=True)
class Mechanism:
    """One accounted release.

    Attributes
    ----------
    name
        ``dp-sgd`` (local training) or ``safl-selection`` (noisy layer choice).
    noise_multiplier
        Gaussian noise standard deviation divided by the L2 sensitivity.
    sample_rate
        Poisson sampling probability of each example (1.0: no subsampling).
    steps
        How many times the mechanism runs.
    """

    name: str
    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if self.noise_multiplier <= 0:
            raise ValueError("noise multiplier must be positive")
        if not 0 < self.sample_rate <= 1:
            raise ValueError("sample rate must be in (0, 1]")
        if self.steps < 0:
            raise ValueError("steps must be >= 0")

    def as_dict(self) -> dict:
        return asdict(self)


def check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), not {delta}")


def epsilon(mechanisms: Sequence[Mechanism], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of ``mechanisms`` (RDP)."""
    check_delta(delta)
    active = [m for m in mechanisms if m.steps > 0]
    if not active:
        return 0.0
    rdp = sum(
        rdp_analysis.compute_rdp(
            q=m.sample_rate, noise_multiplier=m.noise_multiplier, steps=m.steps, orders=ORDERS
        )
        for m in active
    )
    eps, _ = rdp_analysis.get_privacy_spent(orders=ORDERS, rdp=rdp, delta=delta)
    return float(eps)


def pld_epsilon(mechanisms: Sequence[Mechanism], delta: float) -> float:
    """The same composition through a privacy loss distribution (tighter;
    shown beside the RDP figure, never used for budget checks)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    check_delta(delta)
    accountant = PLDAccountant(value_discretization_interval=1e-3)
    for m in mechanisms:
        if m.steps > 0:
            event = dp_accounting.PoissonSampledDpEvent(
                m.sample_rate, dp_accounting.GaussianDpEvent(m.noise_multiplier)
            )
            accountant.compose(event, m.steps)
    return float(accountant.get_epsilon(delta))


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    round_mechanisms: Callable[[float], Sequence[Mechanism]],
    rounds: int,
    tolerance: float = 0.005,
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
        return epsilon(list(round_mechanisms(sigma)) * rounds, delta)

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
