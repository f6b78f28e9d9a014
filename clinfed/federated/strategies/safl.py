"""SAFL (after Li and Zhang, arXiv 2504.11793): send only the layers that
attend most to task-relevant tokens.

Each round a site profiles its copy of the model (see
``clinfed.federated.attention``), keeps the top-K encoder layers by score,
trains those layers plus the task head (embeddings only with
``train_embeddings``) and uploads just them.

The layer choice is itself released information (DESIGN.md section 4), so
where the profile comes from is a setting:

* ``global`` (default): the downloaded global model profiled on a public
  probe set. Uses only released and public data, so it costs no privacy;
  every site then picks the same layers in a round.
* ``public``: each site profiles its model on the public probe set. Free as
  well; differs from ``global`` once sites hold different weights.
* ``private``: each site profiles on ``profile_examples`` of its own
  examples. Per-example scores lie in [0, 1]; their per-layer sums get
  Gaussian noise of standard deviation ``noise * sqrt(layers)`` (one example
  moves the vector of sums by at most ``sqrt(layers)`` in L2) before top-K.
  The mechanism's parameters are recorded per site and round so the privacy
  ledger can charge them.

With ``freezer`` (``safl+fedfrozen``), query/key blocks inside the selected
layers stop training and travelling once the freezer's warm-up is over.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn

from clinfed.core.errors import ClinfedError
from clinfed.core.schema import setting
from clinfed.federated.attention import profile, top_k_layers
from clinfed.federated.client import site_key
from clinfed.federated.plan import Plan, names_in
from clinfed.federated.strategies.base import Strategy, StrategyContext
from clinfed.federated.strategies.fedfrozen import (
    TRAIN_EMBEDDINGS_HELP,
    FedFrozen,
    FedFrozenOptions,
)
from clinfed.modeling.blocks import EMBEDDINGS, HEAD, Block, block_of, num_layers, parameter_blocks
from clinfed.privacy.accountants import Mechanism
from clinfed.tasks.base import Task

SELECTIONS = ("global", "public", "private")


@dataclass
class SAFLOptions:
    top_layers: int = setting(
        2, "SAFL: encoder layers each site trains and sends per round.", minimum=1, maximum=1_024
    )
    selection: str = setting(
        "global",
        "SAFL layer choice from: global (released model, public probe; free), public (site "
        "model, public probe; free) or private (site data, noised; has a privacy cost).",
        choices=SELECTIONS,
    )
    profile_examples: int = setting(
        16, "SAFL: examples per attention profile.", minimum=1, maximum=100_000
    )
    selection_noise: float = setting(
        1.0,
        "SAFL --selection private: noise multiplier of the layer choice (charged to the "
        "privacy ledger every round).",
        above=0.0,
    )
    train_embeddings: bool = setting(False, TRAIN_EMBEDDINGS_HELP)


@dataclass
class SAFLFedFrozenOptions(SAFLOptions, FedFrozenOptions):
    """SAFL's and FedFrozen's options together."""


class SAFL(Strategy):
    """Top-K layers by attention to task-relevant tokens.

    Parameters
    ----------
    options
        :class:`SAFLOptions` (``top_layers``, ``selection``,
        ``profile_examples``, ``selection_noise``, ``train_embeddings``).
    probe
        Public, already-encoded examples for ``global``/``public`` selection.
    seed
        Seeds the private selection's noise.
    freezer
        A :class:`FedFrozen` whose warm-up decides when Q/K freeze.
    """

    name = "safl"
    selects_layers = True
    follows_task_plan = False  # it chooses the encoder layers that train
    summary = "each round only the top-K layers by attention to task tokens (and the head) travel"
    options = SAFLOptions

    def __init__(
        self,
        options: SAFLOptions | None = None,
        probe: datasets.Dataset | None = None,
        seed: int = 0,
        freezer: FedFrozen | None = None,
    ):
        super().__init__(options)
        opts = self.opts
        self.top_k, self.selection, self.probe = opts.top_layers, opts.selection, probe
        self.profile_examples = opts.profile_examples
        self.train_embeddings = opts.train_embeddings
        self.noise, self.seed, self.freezer = opts.selection_noise, seed, freezer
        self._chosen: dict[str, list[int]] = {}
        self._global_choice: tuple[int, list[int], list[float]] | None = None

    @classmethod
    def build(cls, options: SAFLOptions, context: StrategyContext) -> SAFL:
        probe = None
        if options.selection != "private":
            # Public data only: no private example shapes the free choice.
            probe = context.task.public_probe(
                context.tokenizer, context.max_length, context.cache_dir
            )
        return cls(options, probe, context.seed)

    @classmethod
    def check_model(cls, options: SAFLOptions, names: list[str]) -> None:
        layers = num_layers(parameter_blocks(names))
        if options.top_layers > layers:
            raise ClinfedError(
                f"`top_layers` {options.top_layers} exceeds the model's {layers} layers"
            )

    # ------------------------------------------------------------ selection
    def select(
        self,
        round_number: int,
        site: str,
        model: nn.Module,
        task: Task,
        local: datasets.Dataset,
        rng: np.random.Generator | None = None,
        unit: str = "example",
    ) -> dict[str, Any]:
        layers_total = num_layers(parameter_blocks([n for n, _ in model.named_parameters()]))
        if self.top_k > layers_total:
            raise ClinfedError(
                f"`top_layers` {self.top_k} exceeds the model's {layers_total} layers"
            )
        info: dict[str, Any] = {"selection": self.selection}
        if (
            self.selection == "global"
            and self._global_choice is not None
            and self._global_choice[0] == round_number
        ):
            _, layers, scores = self._global_choice
        elif self.selection in ("global", "public"):
            if self.probe is None:
                raise RuntimeError("global and public selection need a probe set (build())")
            sample = self.probe.select(range(min(self.profile_examples, len(self.probe))))
            scores = profile(model, task, sample).mean(axis=0).tolist()
            layers = top_k_layers(scores, self.top_k)
            if self.selection == "global":
                self._global_choice = (round_number, layers, scores)
        else:
            if rng is None:
                # Without DP nothing is protected: a public stream, resume-safe
                # and independent of the data order. Under DP the site passes
                # its secret generator.
                rng = np.random.default_rng([self.seed, round_number, site_key(site)])
            # Whole privacy units are profiled, each contributing the mean
            # of its rows' clipped scores: one unit moves the sum by at most
            # sqrt(L), however many rows (windows, sentences) it has.
            units = task.unit_rows(local, unit)
            idx = rng.choice(len(units), size=min(self.profile_examples, len(units)), replace=False)
            chosen = [units[u] for u in np.sort(idx)]
            rows = np.concatenate(chosen)
            per_row = np.clip(profile(model, task, local.select(rows)), 0.0, 1.0)
            owner = np.repeat(np.arange(len(chosen)), [len(r) for r in chosen])
            per_unit = np.zeros((len(chosen), layers_total))
            np.add.at(per_unit, owner, per_row)
            per_unit /= np.asarray([len(r) for r in chosen], dtype=float)[:, None]
            sigma = self.noise * math.sqrt(layers_total)
            noisy = per_unit.sum(axis=0) + rng.normal(0.0, sigma, size=layers_total)
            # Scaled by the public number of units a profile takes, never by
            # how many the site had: a site with fewer would release its exact
            # count through the divisor (the layer order is the same).
            scores = (noisy / self.profile_examples).tolist()
            layers = top_k_layers(scores, self.top_k)
            info["selection_mechanism"] = {
                "type": "gaussian",
                # Under add/remove and under replace-one alike.
                "l2_sensitivity": math.sqrt(layers_total),
                "sigma": sigma,
                # At most this many units profiled: a public setting, not a count.
                "profile_units": int(self.profile_examples),
            }
        self._chosen[site] = layers
        return info | {"layers": layers, "scores": [round(s, 6) for s in scores]}

    def selection_mechanism(self) -> Mechanism | None:
        """Private selection adds Gaussian noise of sigma = noise * sqrt(L) to
        a sum of per-unit score vectors in [0, 1]^L (each the mean of the
        unit's clipped rows). Adding or removing a unit moves the sum by at
        most sqrt(L); so does replacing one, since two vectors of the box
        differ by at most its diagonal: a Gaussian of noise multiplier
        ``noise`` under either relation (``replace_sensitivity`` 1, not the
        2 of a clipped gradient sum). The profiled subset is not counted as
        subsampling (no amplification claimed)."""
        if self.selection != "private":
            return None
        return Mechanism("safl-selection", self.noise, 1.0, 1, replace_sensitivity=1.0)

    # ----------------------------------------------------------------- plan
    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        if site not in self._chosen:
            raise RuntimeError("SAFL.select must run before SAFL.plan")
        layers = self._chosen[site]
        frozen_qk = self.freezer is not None and self.freezer.frozen(round_number)
        kinds = ("value", "rest") if frozen_qk else ("query_key", "value", "rest")
        blocks = {Block(kind, layer) for layer in layers for kind in kinds} | {HEAD}
        if self.train_embeddings:
            blocks.add(EMBEDDINGS)
        chosen = names_in(names, blocks)
        return Plan(chosen, chosen, self.envelope(round_number, names).downloaded)

    def envelope(self, round_number: int, names: list[str]) -> Plan:
        """Any layer may be chosen: the envelope is every layer's blocks and
        the head. A site needs the current global value of everything that
        can have changed in the last aggregation: all but what nobody trains
        (embeddings when frozen; Q/K from the round after they froze). Round
        1 syncs the whole model."""
        frozen_qk = self.freezer is not None and self.freezer.frozen(round_number)
        qk_settled = frozen_qk and round_number != self.freezer.frozen_from

        def trainable(name: str) -> bool:
            block = block_of(name)
            if block == EMBEDDINGS:
                return self.train_embeddings
            return not (frozen_qk and block.kind == "query_key")

        def changing(name: str) -> bool:
            block = block_of(name)
            if block == EMBEDDINGS:
                return self.train_embeddings
            return not (qk_settled and block.kind == "query_key")

        allowed = frozenset(n for n in names if trainable(n))
        received = (
            frozenset(names) if round_number == 1 else frozenset(n for n in names if changing(n))
        )
        return Plan(allowed, allowed, received)

    def observe(self, round_number: int, global_state: dict[str, torch.Tensor]) -> dict[str, Any]:
        return self.freezer.observe(round_number, global_state) if self.freezer else {}

    def state_dict(self) -> dict[str, Any]:
        return {"freezer": self.freezer.state_dict() if self.freezer else None}

    def load_state_dict(
        self, state: dict[str, Any], global_state: dict[str, torch.Tensor] | None = None
    ) -> None:
        if self.freezer is not None and state.get("freezer") is not None:
            self.freezer.load_state_dict(state["freezer"], global_state)


class SAFLFedFrozen(SAFL):
    """SAFL whose selected layers stop training and sending Q/K once
    FedFrozen's warm-up is over."""

    name = "safl+fedfrozen"
    summary = "SAFL's top-K layers, with their query/key frozen after FedFrozen's warm-up"
    options = SAFLFedFrozenOptions

    def __init__(
        self,
        options: SAFLFedFrozenOptions | None = None,
        probe: datasets.Dataset | None = None,
        seed: int = 0,
    ):
        options = options if options is not None else SAFLFedFrozenOptions()
        freezer = FedFrozen(FedFrozenOptions(**_fields_of(FedFrozenOptions, options)))
        super().__init__(options, probe, seed, freezer)


def _fields_of(kind: type, options: Any) -> dict[str, Any]:
    values = asdict(options)
    return {k: values[k] for k in kind.__dataclass_fields__}
