"""Centralized training: every site's data pooled in one place, no rounds.
The upper reference (and the thing clinfed exists to avoid in practice)."""

from __future__ import annotations

from clinfed.federated.plan import Plan, full_plan
from clinfed.federated.strategies.base import Strategy


class Centralized(Strategy):
    name = "centralized"
    summary = "every site's data pooled in one place, no rounds (the upper reference)"
    pooled = True

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        return full_plan(names)
