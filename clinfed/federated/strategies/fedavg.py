"""FedAvg (McMahan et al., 2017): every site trains and sends the whole model."""

from __future__ import annotations

from clinfed.federated.plan import Plan, full_plan
from clinfed.federated.strategies.base import Strategy


class FedAvg(Strategy):
    name = "fedavg"
    summary = "every site trains and sends the whole model; the server averages"

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        return full_plan(names)
