"""FedFrozen (after Du et al., arXiv 2605.06446): warm up, then freeze the
attention kernel.

Rounds before the warm-up ends train and exchange the whole model
(embeddings only with ``train_embeddings``). From then on every layer's
attention query and key weights and biases are frozen: never trained,
uploaded or downloaded again, so the global Q/K stay bit-identical while
values, feed-forward blocks and the head keep learning.

``freeze_from="auto"`` freezes once the kernel has settled, judged on the
released global models only (so it costs nothing under DP): the relative
change of all Q/K weights between consecutive global models,
``||QK_r - QK_{r-1}|| / ||QK_{r-1}||``, must stay below ``threshold`` for
``patience`` rounds in a row. The measure is logged every round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from clinfed.core.errors import ClinfedError
from clinfed.core.schema import setting
from clinfed.federated.plan import Plan
from clinfed.federated.strategies.base import Strategy
from clinfed.modeling.blocks import block_of


def is_query_key(name: str) -> bool:
    return block_of(name).kind == "query_key"


TRAIN_EMBEDDINGS_HELP = "SAFL, FedFrozen: train and exchange the embeddings too."


@dataclass
class FedFrozenOptions:
    """FedFrozen's settings.

    ``freeze_from``: round from which Q/K are frozen (1 freezes from the
    start), or ``auto``; ``freeze_threshold`` / ``freeze_patience``: ``auto``
    freezes after that many consecutive rounds whose relative Q/K change is
    below the threshold.
    """

    freeze_from: str = setting(
        "3", "FedFrozen: round from which Q/K are frozen, or 'auto'.", int_ok=True
    )
    freeze_threshold: float = setting(
        0.01, "FedFrozen auto: relative Q/K change counted as settled.", above=0.0
    )
    freeze_patience: int = setting(
        2, "FedFrozen auto: settled rounds in a row before freezing.", minimum=1, maximum=10_000
    )
    train_embeddings: bool = setting(False, TRAIN_EMBEDDINGS_HELP)

    def validate(self) -> None:
        value = str(self.freeze_from)
        if value != "auto" and not (value.isdigit() and int(value) >= 1):
            raise ClinfedError("`freeze_from` must be a round number >= 1 or 'auto'")
        self.freeze_from = value

    @property
    def first_frozen_round(self) -> int | None:
        return None if self.freeze_from == "auto" else int(self.freeze_from)


class FedFrozen(Strategy):
    """Freezes Q/K from ``options.freeze_from`` (see :class:`FedFrozenOptions`)."""

    name = "fedfrozen"
    summary = "the whole model warms up, then attention query/key freeze and never travel"
    options = FedFrozenOptions
    follows_task_plan = False  # its plan is which encoder weights freeze

    def __init__(self, options: FedFrozenOptions | None = None):
        super().__init__(options)
        self.opts.validate()
        self.train_embeddings = self.opts.train_embeddings
        self.threshold, self.patience = self.opts.freeze_threshold, self.opts.freeze_patience
        self.frozen_from: int | None = self.opts.first_frozen_round
        self._previous: torch.Tensor | None = None
        self._calm_rounds = 0

    def frozen(self, round_number: int) -> bool:
        return self.frozen_from is not None and round_number >= self.frozen_from

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        moving = [n for n in names if self.train_embeddings or block_of(n).kind != "embeddings"]
        if self.frozen(round_number):
            moving = [n for n in moving if not is_query_key(n)]
        chosen = frozenset(moving)
        # Round 1 syncs the whole model; afterwards a site only needs what it
        # trains (frozen weights are identical everywhere), except in the
        # first frozen round: Q/K were averaged once more at the end of the
        # round before, and every site must take that final value.
        received = chosen
        if round_number == 1:
            received = frozenset(names)
        elif round_number == self.frozen_from:
            received = chosen | frozenset(n for n in names if is_query_key(n))
        return Plan(chosen, chosen, received)

    @staticmethod
    def _query_key(global_state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(
            [
                v.detach().flatten().double()
                for k, v in sorted(global_state.items())
                if is_query_key(k)
            ]
        )

    def observe(self, round_number: int, global_state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Measure the Q/K change of the new global model; decide ``auto``."""
        qk = self._query_key(global_state)
        change = None
        if self._previous is not None:
            change = float((qk - self._previous).norm() / self._previous.norm().clamp(min=1e-12))
            if self.frozen_from is None:
                self._calm_rounds = self._calm_rounds + 1 if change < self.threshold else 0
                if self._calm_rounds >= self.patience:
                    self.frozen_from = round_number + 1
        self._previous = qk
        return {"qk_change": change, "qk_frozen_from": self.frozen_from}

    def state_dict(self) -> dict[str, Any]:
        return {"frozen_from": self.frozen_from, "calm_rounds": self._calm_rounds}

    def load_state_dict(
        self, state: dict[str, Any], global_state: dict[str, torch.Tensor] | None = None
    ) -> None:
        self.frozen_from = state["frozen_from"]
        self._calm_rounds = state["calm_rounds"]
        # The last observed global model is the checkpoint resumed from.
        self._previous = None if global_state is None else self._query_key(global_state)
