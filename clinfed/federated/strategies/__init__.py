"""Federated strategies, one file each; register new ones in STRATEGIES.

A new strategy is one file (a :class:`Strategy` subclass with its options
dataclass) plus one line here; its flags, config keys and Flower settings
come from its options, and every runner uses it as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.federated.strategies.base import Strategy, StrategyContext
from clinfed.federated.strategies.centralized import Centralized
from clinfed.federated.strategies.ditto import Ditto
from clinfed.federated.strategies.fedadam import FedAdam
from clinfed.federated.strategies.fedavg import FedAvg
from clinfed.federated.strategies.fedfrozen import FedFrozen
from clinfed.federated.strategies.fedprox import FedProx
from clinfed.federated.strategies.local import Local
from clinfed.federated.strategies.pfeddc import PFedDC
from clinfed.federated.strategies.safl import SAFL, SAFLFedFrozen

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        Centralized,
        FedAvg,
        FedProx,
        Local,
        FedFrozen,
        SAFL,
        SAFLFedFrozen,
        PFedDC,
        FedAdam,
        Ditto,
    )
}


def get_strategy(
    name: str,
    options: Mapping[str, Any] | None = None,
    context: StrategyContext | None = None,
) -> Strategy:
    """A strategy by name with its options (a mapping of its option fields).

    ``context`` is needed by strategies that build from the task (SAFL's
    public probe); without one, such a strategy gets none.
    """
    if name not in STRATEGIES:
        raise ClinfedError(f"unknown strategy {name!r} (choose from {', '.join(STRATEGIES)})")
    cls = STRATEGIES[name]
    opts = cls.make_options(dict(options or {}), name)
    if context is None:
        return cls(opts)
    return cls.build(opts, context)


__all__ = ["STRATEGIES", "Strategy", "StrategyContext", "get_strategy"]
