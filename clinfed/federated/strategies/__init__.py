"""Federated strategies, one file each; register new ones in STRATEGIES."""

from __future__ import annotations

from clinfed.errors import ClinfedError
from clinfed.federated.strategies.base import Strategy
from clinfed.federated.strategies.fedavg import FedAvg
from clinfed.federated.strategies.fedfrozen import FedFrozen
from clinfed.federated.strategies.fedprox import FedProx
from clinfed.federated.strategies.local import Local

STRATEGIES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "local": Local,
    "fedfrozen": FedFrozen,
}


def get_strategy(
    name: str, mu: float = 0.01, warmup: int | str = 3, train_embeddings: bool = False
) -> Strategy:
    """A strategy by name, with the run's strategy options."""
    if name not in STRATEGIES:
        raise ClinfedError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
    if name == "fedprox":
        return FedProx(mu)
    if name == "fedfrozen":
        return FedFrozen(warmup, train_embeddings)
    return STRATEGIES[name]()


__all__ = ["STRATEGIES", "Strategy", "get_strategy"]
