"""The strategy interface: one class per strategy, server side and site side.

A strategy is one file plus its line in ``STRATEGIES``. It owns its
algorithm; no runner branches on its name.

Server side (the round engine calls these):

* :meth:`Strategy.envelope` - what a site in sync receives and the only
  names the server accepts back;
* :meth:`Strategy.aggregator` / :meth:`Strategy.apply` - how replies become
  the next global model (per-parameter weighted mean by default; a server
  optimizer in :meth:`apply`);
* :meth:`Strategy.observe` - a look at the new global model;
* :meth:`Strategy.state_dict` (JSON) and :meth:`Strategy.tensor_state`
  (safetensors) - what survives a restart.

Site side (the site runner calls these):

* :meth:`Strategy.select` then :meth:`Strategy.plan` - data-dependent
  choices, then which parameters train, travel up and come down;
* :meth:`Strategy.local_update` - the local procedure (one
  :func:`~clinfed.federated.client.client_update` with the strategy's
  :meth:`objective` by default; Ditto trains twice);
* :meth:`Strategy.evaluations` - which models a site evaluates (the one it
  holds; pfeddc adds the global prompt alone, Ditto the global model).

Build-time hooks: :attr:`options` (the strategy's own settings dataclass),
:meth:`prepare_model` (extra modules, pfeddc's prompts), :meth:`check_model`,
:attr:`training_defaults`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from clinfed.core.errors import ClinfedError
from clinfed.federated.aggregation import Aggregator
from clinfed.federated.plan import Plan
from clinfed.privacy.accountants import Mechanism


@dataclass
class NoOptions:
    """A strategy without options of its own."""


@dataclass
class StrategyContext:
    """What a strategy may need to build itself, wherever it is built (the
    server, every site): the task adapter, the tokenizer, the encoding
    window, the run's seed and a cache folder for public probe data."""

    task: Any
    tokenizer: Any
    max_length: int
    seed: int
    cache_dir: str


@dataclass
class Objective:
    """A data-independent term of the local loss (FedProx's and Ditto's
    proximal term): ``loss`` for plain training, ``grad`` (added after
    clipping and noise) for DP-SGD, so it costs no privacy."""

    loss: Any
    grad: Any


def proximal(
    model: nn.Module, mu: float, anchor: Mapping[str, torch.Tensor] | None = None
) -> Objective | None:
    """``mu/2 * ||w - w0||^2`` over the trainable parameters; ``w0`` is
    ``anchor`` (by name), or the parameters' values now (the weights the
    site received)."""
    if mu <= 0:
        return None
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if anchor is None:
        anchor = {n: p.detach().clone() for n, p in params}

    def loss() -> torch.Tensor:
        return mu / 2 * sum(((p - anchor[n]) ** 2).sum() for n, p in params)

    def grad() -> None:
        with torch.no_grad():
            for n, p in params:
                p.grad.add_(p - anchor[n], alpha=mu)

    return Objective(loss, grad)


class Strategy(ABC):
    """Decides, per round and site, what is trained and what travels.

    Class attributes
    ----------------
    options
        The strategy's own settings (a dataclass; flags and config keys are
        its field names).
    shares_model
        False when each site keeps a model of its own between rounds (local,
        pfeddc): a site then never receives more than the envelope, and
        evaluates its own model.
    pooled
        True for ``centralized``: all data in one place, no rounds.
    training_defaults
        Local-training defaults that differ from the task's (pfeddc learns
        prompts at prompt-tuning rates).
    trainings_per_round
        How many DP-SGD trainings one round of local work runs (each is
        charged to the ledger).
    uploads
        False when sites never send anything (local): nothing to aggregate,
        securely or not.
    selects_layers
        True when what travels is chosen from data each round (SAFL's
        top-K layers): the report explains how that choice was made.
    follows_task_plan
        Whether a task's private plan (``Task.dp_adapter``: ICD coding trains
        the head alone under DP) applies when ``--adapter`` is not given.
        False where the strategy decides what trains itself: which encoder
        layers (SAFL, FedFrozen; the head alone would leave them nothing to
        choose) or its own prompts (pfeddc).
    """

    name: ClassVar[str]
    # One line for `clinfed strategies`: what trains and what travels.
    summary: ClassVar[str] = ""
    options: ClassVar[type] = NoOptions
    shares_model: ClassVar[bool] = True
    pooled: ClassVar[bool] = False
    training_defaults: ClassVar[Mapping[str, Any]] = {}
    trainings_per_round: ClassVar[int] = 1
    uploads: ClassVar[bool] = True
    selects_layers: ClassVar[bool] = False
    follows_task_plan: ClassVar[bool] = True

    # ------------------------------------------------------------- building
    @classmethod
    def check_config(cls, config: Any) -> None:
        """Refuse run settings this strategy cannot honour (``config``: the
        run's settings, checked with the rest of them)."""
        del config  # most strategies take any

    @classmethod
    def make_options(cls, values: Mapping[str, Any], name: str | None = None) -> Any:
        """The options dataclass from ``values``; a key another strategy
        owns is refused, naming the strategy."""
        own = {f.name for f in fields(cls.options)}
        for key in values:
            if key not in own:
                raise ClinfedError(f"`{key}` does not apply to `strategy` {name or cls.name}")
        options = cls.options(**dict(values))
        validate = getattr(options, "validate", None)
        if validate is not None:
            validate()
        return options

    @classmethod
    def build(cls, options: Any, context: StrategyContext) -> Strategy:
        """The strategy object for a run (server or site)."""
        del context
        return cls(options)

    def __init__(self, options: Any = None):
        self.opts = options if options is not None else self.options()

    @classmethod
    def prepare_model(cls, model: nn.Module, options: Any, seed: int, max_length: int) -> None:
        """Add the modules the strategy trains that the encoder lacks."""
        del model, options, seed, max_length

    @classmethod
    def check_model(cls, options: Any, names: list[str]) -> None:
        """Refuse options the model cannot serve (before anything is written)."""
        del options, names

    # ---------------------------------------------------------- server side
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

    def aggregator(self, round_number: int) -> Aggregator:
        """Folds replies in as they arrive (memory flat in the number of sites)."""
        del round_number
        return Aggregator()

    def apply(
        self,
        round_number: int,
        global_state: dict[str, torch.Tensor],
        aggregated: dict[str, torch.Tensor],
        sent: frozenset[str],
    ) -> dict[str, torch.Tensor]:
        """The next global model from the mean of the replies (``sent``: the
        names some site sent). Server optimizers override this."""
        del round_number, global_state, sent
        return aggregated

    def observe(self, round_number: int, global_state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """See the new global model after a round's aggregation; what it
        returns joins the round's record in ``metrics.jsonl``."""
        del round_number, global_state
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Small JSON state saved at every commit (for ``--resume``)."""
        return {}

    def load_state_dict(
        self, state: dict[str, Any], global_state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Restore :meth:`state_dict`; ``global_state`` is the checkpoint the
        run resumes from (``None`` at a site)."""
        del state, global_state

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """Server-side tensors that survive a restart (safetensors, never JSON)."""
        return {}

    def load_tensor_state(self, tensors: dict[str, torch.Tensor]) -> None:
        del tensors

    # ------------------------------------------------------------ site side
    def select(
        self,
        round_number: int,
        site: str,
        model: Any,
        task: Any,
        local: Any,
        rng: Any = None,
        unit: str = "example",
    ) -> dict[str, Any]:
        """Data-dependent choices made at the site before :meth:`plan` (SAFL's
        attention profile); ``model`` holds the weights the site starts the
        round from. Under DP, ``rng`` is the site's secret generator: any
        noise that protects the choice must come from it, and one privacy
        ``unit`` (all its rows together) may move it by no more than the
        sensitivity :meth:`selection_mechanism` states. What it returns
        joins the site's record."""
        del round_number, site, model, task, local, rng, unit
        return {}

    def selection_mechanism(self) -> Mechanism | None:
        """The privacy cost, per site and round, of what :meth:`select`
        releases about local data (``None``: nothing data-dependent)."""
        return None

    def objective(self, model: nn.Module, plan: Plan) -> Objective | None:
        """A data-independent term of the local loss (``None``: none)."""
        del model, plan
        return None

    def local_update(self, work: Any) -> Any:
        """The site's local procedure for one round; ``work`` is a
        :class:`~clinfed.federated.client.LocalWork` (model, data, plan,
        settings, randomness, DP settings and the site's own tensors).
        Returns a :class:`~clinfed.federated.client.ClientResult`."""
        from clinfed.federated.client import client_update

        # The objective is built once the plan is applied, over exactly the
        # parameters that train.
        return client_update(work, lambda: self.objective(work.model, work.plan))

    def evaluations(
        self, model: nn.Module, personal: dict[str, torch.Tensor]
    ) -> dict[str, contextlib.AbstractContextManager]:
        """Models a site evaluates: ``""`` is the headline (the model it
        holds); others are reported as ``<name>_f1``."""
        del model, personal
        return {"": contextlib.nullcontext()}


@contextlib.contextmanager
def swapped(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``model`` holds ``state`` inside the block, its own weights after."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=False)
    try:
        yield
    finally:
        model.load_state_dict(saved)
