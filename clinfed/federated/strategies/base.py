"""The strategy interface: a plan per round and site, and state for resume."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from clinfed.federated.plan import Plan
from clinfed.privacy.accountant import Mechanism


class Strategy(ABC):
    """Decides, per round and site, what is trained and what travels.

    ``shares_model`` is False for strategies where each site keeps a model of
    its own (``local``); the runner then stores site state between rounds.
    """

    name: ClassVar[str]
    shares_model: ClassVar[bool] = True

    @abstractmethod
    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        """The plan of ``site`` in round ``round_number`` (1-based) for a model
        whose parameters are ``names``."""

    def envelope(self, round_number: int, names: list[str]) -> Plan:
        """The widest plan any site can have in ``round_number``: what the
        server sends a site that is in sync (``downloaded``) and the only
        names it accepts back (``uploaded``). Strategies whose plan depends
        on :meth:`select` override it; the others' plan does not depend on
        the site."""
        return self.plan(round_number, "", names)

    def select(
        self, round_number: int, site: str, model: Any, task: Any, local: Any
    ) -> dict[str, Any]:
        """Data-dependent choices made at the site before :meth:`plan` (SAFL's
        attention profile); ``model`` holds the weights the site starts the
        round from. What it returns joins the site's record."""
        del round_number, site, model, task, local
        return {}

    def selection_mechanism(self) -> Mechanism | None:
        """The privacy cost, per site and round, of what :meth:`select`
        releases about local data (``None``: nothing data-dependent)."""
        return None

    def observe(self, round_number: int, global_state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """See the new global model after a round's aggregation; what it
        returns joins the round's record in ``metrics.jsonl``."""
        del round_number, global_state
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Strategy state saved after each round (for ``--resume``); kept
        small: it goes into ``state.json``."""
        return {}

    def load_state_dict(
        self, state: dict[str, Any], global_state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Restore :meth:`state_dict`; ``global_state`` is the checkpoint the
        run resumes from."""
        del state, global_state
