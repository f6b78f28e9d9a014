"""FedProx (Li et al., 2020): FedAvg plus a proximal term that keeps each
site's model near the global one, which damps drift on heterogeneous sites."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from clinfed.core.schema import setting
from clinfed.federated.plan import Plan, full_plan
from clinfed.federated.strategies.base import Objective, Strategy, proximal


@dataclass
class FedProxOptions:
    mu: float = setting(
        0.01, "FedProx: weight of mu/2 ||w - w_global||^2.", minimum=0.0, maximum=100.0
    )


class FedProx(Strategy):
    name = "fedprox"
    summary = "FedAvg with a proximal term that keeps each site near the global model"
    options = FedProxOptions

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        return full_plan(names)

    def objective(self, model: nn.Module, plan: Plan) -> Objective | None:
        return proximal(model, self.opts.mu)
