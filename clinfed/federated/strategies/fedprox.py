"""FedProx (Li et al., 2020): FedAvg plus a proximal term that keeps each
site's model near the global one, which damps drift on heterogeneous sites."""

from __future__ import annotations

from clinfed.errors import ClinfedError
from clinfed.federated.plan import Plan, full_plan
from clinfed.federated.strategies.base import Strategy


class FedProx(Strategy):
    """Parameters
    ----------
    mu
        Weight of ``mu/2 * ||w - w_global||^2`` in every local loss.
    """

    name = "fedprox"

    def __init__(self, mu: float = 0.01):
        if mu < 0:
            raise ClinfedError("--mu must be 0 or more")
        self.mu = mu

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        return full_plan(names, proximal_mu=self.mu)
