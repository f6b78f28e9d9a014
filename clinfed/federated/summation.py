"""How a round's uploads become its mean: the engine's one seam for
aggregation protocols.

The engine opens one :class:`RoundSum` per round, adds each accepted
training reply to it as the reply arrives, closes it once every reply is in
(a protocol may run more exchanges then, over the same transport), and
takes the mean. :class:`PlainSummation` averages the uploads in the clear
(the strategy's aggregator); ``clinfed.federated.secure_summation`` sums
them under secure aggregation. The engine knows nothing else of either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from clinfed.federated.aggregation import Aggregator

# Send these messages (address -> message); yields (address, reply or why not).
Exchange = Callable[[Mapping[str, Any]], Iterator[tuple[str, Any]]]


@dataclass
class RoundContext:
    """What a protocol may use of the engine while a round closes."""

    round: int
    exchange: Exchange
    site_of: Callable[[str], str]  # address -> site name
    records: list[dict[str, Any]]  # the round's records so far (a protocol may annotate them)
    log: Callable[[str], None] = lambda line: None


@dataclass
class Closed:
    """How a round's sum ended.

    Attributes
    ----------
    dropped
        Addresses that trained but whose update is not in the sum (their
        copies are out of sync with the aggregate).
    failure
        Why the round cannot be aggregated at all (it is retried, or the run
        stops), or ``None``.
    """

    dropped: set[str] = field(default_factory=set)
    failure: str | None = None


class RoundSum(Protocol):
    def add(self, address: str, reply: Any, weight: int) -> str | None:
        """Fold in one accepted training reply; why it is rejected, or ``None``."""

    def close(self, context: RoundContext) -> Closed:
        """Every reply is in: finish the sum."""

    def mean(
        self, global_state: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """The weighted mean and the names any site sent."""


class Summation(Protocol):
    """An aggregation protocol: marks the messages it needs marked and opens
    each round's sum."""

    def prepare(self, message: Any) -> Any:
        """The message as this protocol sends it."""

    def open(
        self, aggregator: Aggregator, allowed: frozenset[str], global_state: Mapping[str, Any]
    ) -> RoundSum:
        """The sum of one round (``allowed``: the names its envelope accepts)."""


class PlainRoundSum:
    """Uploads averaged in the clear by the strategy's aggregator."""

    def __init__(self, aggregator: Aggregator):
        self.aggregator = aggregator
        self.sent: set[str] = set()

    def add(self, address: str, reply: Any, weight: int) -> str | None:
        del address
        if reply.upload:
            self.aggregator.add(reply.upload, weight)
            self.sent |= set(reply.upload)
        return None

    def close(self, context: RoundContext) -> Closed:
        del context
        return Closed()

    def mean(self, global_state):
        return self.aggregator.result(global_state), frozenset(self.sent)


class PlainSummation:
    """Every site's upload reaches the server, which averages them."""

    def prepare(self, message: Any) -> Any:
        return message

    def open(self, aggregator, allowed, global_state) -> PlainRoundSum:
        del allowed, global_state
        return PlainRoundSum(aggregator)
