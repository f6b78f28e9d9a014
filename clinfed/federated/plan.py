"""What a site does in one round: which parameters it trains, receives and sends."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from clinfed.modeling.blocks import Block, block_of


@dataclass(frozen=True)
class Plan:
    """One site's instructions for one round.

    Attributes
    ----------
    trainable
        Parameter names the site trains; every other parameter is frozen.
    uploaded
        Names the site sends back (a subset of ``trainable``: a frozen
        parameter has nothing new to say).
    downloaded
        Names the site receives from the server before training.
    """

    trainable: frozenset[str]
    uploaded: frozenset[str]
    downloaded: frozenset[str]

    def __post_init__(self) -> None:
        if not self.uploaded <= self.trainable:
            extra = sorted(self.uploaded - self.trainable)[:3]
            raise ValueError(f"plan uploads parameters it does not train: {extra}")


def names_in(names: Iterable[str], blocks: Iterable[Block]) -> frozenset[str]:
    """The parameter names that belong to any of ``blocks``."""
    wanted = set(blocks)
    return frozenset(n for n in names if block_of(n) in wanted)


def full_plan(names: Iterable[str]) -> Plan:
    """Train, receive and send everything (FedAvg, FedProx)."""
    everything = frozenset(names)
    return Plan(everything, everything, everything)
