"""Federated strategies, one file each; register new ones in STRATEGIES."""

from __future__ import annotations

from clinfed.errors import ClinfedError
from clinfed.federated.strategies.base import Strategy
from clinfed.federated.strategies.fedavg import FedAvg
from clinfed.federated.strategies.fedprox import FedProx
from clinfed.federated.strategies.local import Local

STRATEGIES: dict[str, type[Strategy]] = {"fedavg": FedAvg, "fedprox": FedProx, "local": Local}


def get_strategy(name: str, mu: float = 0.01) -> Strategy:
    if name not in STRATEGIES:
        raise ClinfedError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
    return FedProx(mu) if name == "fedprox" else STRATEGIES[name]()


__all__ = ["STRATEGIES", "Strategy", "get_strategy"]
