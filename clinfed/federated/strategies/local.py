"""Local training: each site trains its own model on its own data, nothing
is exchanged. The lower reference a federation must beat."""

from __future__ import annotations

from clinfed.federated.plan import Plan
from clinfed.federated.strategies.base import Strategy


class Local(Strategy):
    name = "local"
    summary = "each site trains alone; nothing is exchanged (the lower reference)"
    shares_model = False
    uploads = False

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        return Plan(frozenset(names), frozenset(), frozenset())
