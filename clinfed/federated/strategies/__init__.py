"""Federated strategies, one file each; register new ones in STRATEGIES."""

from __future__ import annotations

from clinfed.errors import ClinfedError
from clinfed.federated.strategies.base import Strategy
from clinfed.federated.strategies.fedavg import FedAvg
from clinfed.federated.strategies.fedfrozen import FedFrozen
from clinfed.federated.strategies.fedprox import FedProx
from clinfed.federated.strategies.local import Local
from clinfed.federated.strategies.pfeddc import PFedDC
from clinfed.federated.strategies.safl import SAFL

STRATEGIES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "local": Local,
    "fedfrozen": FedFrozen,
    "safl": SAFL,
    "safl+fedfrozen": SAFL,
    "pfeddc": PFedDC,
}


def get_strategy(
    name: str,
    mu: float = 0.01,
    warmup: int | str = 3,
    train_embeddings: bool = False,
    top_layers: int = 2,
    selection: str = "global",
    probe=None,
    profile_examples: int = 16,
    seed: int = 0,
    selection_noise: float = 1.0,
) -> Strategy:
    """A strategy by name, with the run's strategy options."""
    if name not in STRATEGIES:
        raise ClinfedError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
    if name == "fedprox":
        return FedProx(mu)
    if name == "fedfrozen":
        return FedFrozen(warmup, train_embeddings)
    if name in ("safl", "safl+fedfrozen"):
        freezer = FedFrozen(warmup, train_embeddings) if name == "safl+fedfrozen" else None
        return SAFL(
            top_layers,
            selection,
            probe,
            profile_examples,
            train_embeddings,
            noise=selection_noise,
            seed=seed,
            freezer=freezer,
        )
    return STRATEGIES[name]()


__all__ = ["STRATEGIES", "Strategy", "get_strategy"]
