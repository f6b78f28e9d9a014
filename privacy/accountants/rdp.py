"""Rényi DP of the Poisson-subsampled Gaussian (Mironov 2017; Mironov, Talwar
and Zhang 2019), through Opacus's RDP analysis.

Under add/remove this is Opacus's own figure. Under replace-one, D and D'
are two add/remove steps apart (D -> D minus x -> D minus x plus x'), and
the weak triangle inequality of RDP (Mironov 2017, Proposition 11, p = q = 2)
bounds it::

    eps_replace(a) <= (a - 1/2) / (a - 1) * eps(2a) + eps(2a - 1)

(Opacus's bound holds in both directions, Mironov, Talwar and Zhang 2019,
Theorem 5). It is valid but loose (1.1-2.7x the PLD figure on the settings
we tried), so reports show it beside the budget figure, never instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from clinfed.privacy.accountants.base import Accountant, Mechanism, check_delta, grouped

# Opacus's default order grid, extended: small epsilons need large orders.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 128, 256, 512]


def _rdp(sigma: float, q: float, steps: int, orders: Sequence[float]) -> np.ndarray:
    # RDP composes by adding: ``steps`` steps cost ``steps`` times one step,
    # which is what Opacus computes too (one step's RDP times the steps).
    return np.asarray(_one_step(sigma, q, tuple(orders))) * steps


@functools.lru_cache(maxsize=1024)
def _one_step(sigma: float, q: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    # Cached: the report and the ledger ask for the same mechanism round
    # after round, and one step's RDP at every order costs about 0.1 s.
    # Imported here: importing Opacus costs a Flower message (a fresh
    # process) over a second, and most messages never account by RDP.
    from opacus.accountants.analysis import rdp as rdp_analysis

    return tuple(
        rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders))
    )


class RDPAccountant(Accountant):
    name = "rdp"

    @property
    def description(self) -> str:
        if self.relation == "add-remove":
            return "RDP, add/remove (Opacus RDP analysis of the Poisson-subsampled Gaussian)"
        return (
            "RDP, replace-one (Opacus RDP of the Poisson-subsampled Gaussian through the "
            "weak triangle inequality; an upper bound)"
        )

    def epsilon(self, mechanisms: Sequence[Mechanism], delta: float) -> float:
        check_delta(delta)
        composition = grouped(mechanisms, self.relation)
        if not composition:
            return 0.0
        orders = np.asarray(ORDERS, dtype=float)
        if self.relation == "add-remove":
            rdp = sum(_rdp(sigma, q, n, orders) for sigma, q, n in composition)
        else:
            twice = sum(_rdp(sigma, q, n, 2 * orders) for sigma, q, n in composition)
            twice_less_one = sum(_rdp(sigma, q, n, 2 * orders - 1) for sigma, q, n in composition)
            rdp = (orders - 0.5) / (orders - 1) * twice + twice_less_one
        from opacus.accountants.analysis import rdp as rdp_analysis

        eps, _ = rdp_analysis.get_privacy_spent(orders=ORDERS, rdp=rdp, delta=delta)
        return float(eps)
