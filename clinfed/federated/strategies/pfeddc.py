"""pFedDC adapted to clinical text: personalized prompts on a frozen encoder.

After pFedDC (arXiv 2506.21144). Every site's model is the same frozen
encoder with a :class:`~clinfed.modeling.prompts.DualPrompt` in front of it. A site
trains its global prompt ``P_g``, its local prompt ``P_l``, the fusion
block and its task head; it uploads and receives only ``P_g``, which the
server averages. ``P_l``, the fusion block and the head stay at the site
and persist from round to round (``RUN/sites/`` in the simulator, the
node's state folder on Flower).

The head is local. Only ``P_g`` may travel (that is what keeps the upload
under 1% of FedAvg's), and the head is where a site's own label usage
(how its annotators mark problems, tests and treatments; which codes it
assigns) is learned best. The price: the "global prompt alone" evaluation
still uses each site's own head, with ``P_g`` in place of the fused prompt.

Under DP every trained part (P_g, P_l, fusion, head) is one DP-SGD
parameter set, clipped jointly and noised (DESIGN.md 4); the uploaded P_g is
post-processing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clinfed.core.errors import ClinfedError
from clinfed.core.schema import setting
from clinfed.federated.plan import Plan, names_in
from clinfed.federated.strategies.base import Strategy
from clinfed.modeling.blocks import GLOBAL_PROMPT, HEAD, LOCAL_PROMPT
from clinfed.modeling.prompts import FUSIONS


@dataclass
class PFedDCOptions:
    prompt_length: int = setting(
        8, "pfeddc: vectors in the global and in the local prompt.", minimum=1, maximum=128
    )
    prompt_fusion: str = setting(
        "attention",
        "pfeddc: attention (cross-attention fusion of global and local prompts), concat "
        "(ablation: both prepended, no fusion) or global (ablation: no local prompt).",
        choices=FUSIONS,
    )
    prompt_depth: int = setting(
        1,
        "pfeddc: encoder layers that get prompts of their own (1: the input only; up to the "
        "layer count: deep prompts).",
        minimum=1,
        maximum=1_024,
    )


class PFedDC(Strategy):
    name = "pfeddc"

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.adapter not in (None, "none"):
            raise ClinfedError("`adapter`: pfeddc trains prompts on a frozen encoder already")

    summary = "personalized prompts on a frozen encoder; only shared prompts travel"
    options = PFedDCOptions
    shares_model = False  # each site keeps its own local prompt, fusion and head
    follows_task_plan = False  # its prompts are its trained parameters
    # Prompts and a fresh head on a frozen encoder learn at prompt-tuning
    # rates, not fine-tuning ones.
    training_defaults = {"lr": 1e-2, "head_lr": 1e-2}

    @classmethod
    def prepare_model(
        cls, model: nn.Module, options: PFedDCOptions, seed: int, max_length: int
    ) -> None:
        from clinfed.modeling.models import add_prompts

        add_prompts(model, options.prompt_length, options.prompt_fusion, seed, options.prompt_depth)
        window = model.encoder.config.max_position_embeddings
        if (max_length or 0) + model.prompt.tokens > window:
            raise ClinfedError(
                f"`max_length` {max_length} plus {model.prompt.tokens} prompt vectors "
                f"exceeds the encoder's {window} positions"
            )

    def evaluations(
        self, model: nn.Module, personal: dict[str, torch.Tensor]
    ) -> dict[str, contextlib.AbstractContextManager]:
        """The personalized model, and the global prompt alone (each site's
        own head, P_g in place of the fused prompt)."""
        del personal
        variants: dict[str, contextlib.AbstractContextManager] = {"": contextlib.nullcontext()}
        prompt = getattr(model, "prompt", None)
        if prompt is not None and prompt.local_prompt is not None:
            variants["global_prompt"] = _global_only(prompt)
        return variants

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        trained = names_in(names, {GLOBAL_PROMPT, LOCAL_PROMPT, HEAD})
        shared = names_in(names, {GLOBAL_PROMPT})
        if not shared:
            raise ValueError(
                "pfeddc needs a model with prompts (clinfed.modeling.models.add_prompts)"
            )
        return Plan(trained, shared, shared)


@contextlib.contextmanager
def _global_only(prompt: nn.Module) -> Iterator[None]:
    prompt.global_only = True
    try:
        yield
    finally:
        prompt.global_only = False
