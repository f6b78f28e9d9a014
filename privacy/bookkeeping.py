"""Book-keeping clipping: DP-SGD's clipped sum in one backward pass.

Opacus's hooks materialise every example's gradient (a ``(B, out, in)``
tensor per linear layer); its ghost clipping avoids that but runs backward
twice. Book-keeping (Bu et al. 2023, "Differentially private optimization on
large model at small cost", the FastDP library) runs it once:

1. the forward pass keeps each trainable layer's input ``a`` and the
   backward pass its output gradient ``g``; autograd computes no parameter
   gradient at all (the parameters are marked not to need one while the
   forward runs);
2. each example's squared gradient norm comes from ``a`` and ``g``: for a
   linear layer the "ghost norm" ``sum_ts <a_t, a_s> <g_t, g_s>`` (cost
   ``T^2 (in + out)`` per example), or the example's gradient itself where
   that is cheaper (LoRA's rank-``r`` factors);
3. with every example's clip factor ``c_i`` known, each parameter gets its
   clipped sum in one matrix product, ``sum_i c_i g_i^T a_i``: the same work
   as the non-private weight gradient.

Layer types covered: ``nn.Linear`` (peft's LoRA factors are linear layers),
``nn.LayerNorm``, ``nn.Embedding``, a decoder family's RMSNorm
(:func:`register_rms_norm`), one :class:`LayerRule` each
(:mod:`clinfed.privacy.layer_rules`), and any layer registered with its
per-example gradient (:func:`register`; clinfed's ``LabelwiseLinear``
registers itself). A model with any other trainable
parameter (pfeddc's prompts) uses hooks. Rows of one
example must be contiguous and equally many (MIMIC-III's chunks are).

A privacy unit may span several examples (the windows of a long i2b2 line,
every sentence of a note at ``--privacy-unit document``, every admission of
a patient): its gradient is the sum of its examples', so its squared norm
is the ghost norm over all their tokens together. The unit's examples are
laid end to end (:class:`Units`; shorter units padded with zero rows, which
add nothing), and every example's share of the clipped sum takes its unit's
factor. A unit's examples need not run in one pass: a note's sentences run
with other notes' sentences of their length (padding each to the note's
longest sentence cost 3x the tokens), each pass's layer inputs and output
gradients are carried until the pass that closes the note, and the norm
covers its tokens in every pass (:class:`Piece`: one layer's calls in one
pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from clinfed.privacy.errors import SettingError
from clinfed.privacy.layer_rules import (
    GRAD_SAMPLERS,
    RULES,
    EmbeddingRule,
    LayerNormRule,
    LayerRule,
    LinearRule,
    PerExample,
    Piece,
    RMSNormRule,
    Units,
    covered,
    register,
    register_rms_norm,
    rms_norm_per_example,
    rule_for,
)

# The extension points live with the rules; clinfed and its users reach
# them here, beside the clipping they extend.
__all__ = [
    "GRAD_SAMPLERS",
    "RULES",
    "BookKeepingClipping",
    "EmbeddingRule",
    "LayerNormRule",
    "LayerRule",
    "LinearRule",
    "PerExample",
    "Piece",
    "RMSNormRule",
    "Units",
    "clip_factors",
    "covered",
    "register",
    "register_rms_norm",
    "rms_norm_per_example",
    "shared_parameters",
    "supports",
]


def clip_factors(squared_norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Each unit's clip factor from its squared gradient norm: Opacus's
    ``min(1, C / (norm + 1e-6))``, so every clipping mode takes the same step."""
    return (max_grad_norm / (squared_norms.sqrt() + 1e-6)).clamp(max=1.0)


def shared_parameters(model: nn.Module) -> dict[str, list[str]]:
    """Trainable parameters that more than one module uses (tied weights,
    such as an output layer that reuses the word embeddings), with the
    modules that use each. Book-keeping takes a squared norm per module, so
    a tied weight's per-unit gradient (the sum over its uses) is not what it
    would clip: such a model uses Opacus's hooks, which add the uses up."""
    users: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if param.requires_grad:
                users.setdefault(id(param), []).append(module_name or "(model)")
                names.setdefault(id(param), f"{module_name}.{name}" if module_name else name)
    return {names[key]: sorted(set(found)) for key, found in users.items() if len(set(found)) > 1}


def supports(model: nn.Module) -> bool:
    """Whether every trainable parameter belongs to a layer type with a rule,
    and to one module only."""
    if shared_parameters(model):
        return False
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and rule_for(module) is None:
            return False
    return True


class _Tap(torch.autograd.Function):
    """Identity on a layer's output that keeps the gradient reaching it.

    ``anchor`` (a leaf that needs a gradient) keeps the tap in the graph
    when nothing below the layer trains, so the backward pass reaches it."""

    @staticmethod
    def forward(ctx, output, anchor, record):  # noqa: D102
        del anchor
        ctx.record = record
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        ctx.record.backprop = grad.detach()
        return (grad if ctx.needs_input_grad[0] else None), None, None


@dataclass
class _Record:
    """One call of a trainable layer: its input, and its output's gradient
    once the backward pass has reached it."""

    module: nn.Module
    activation: torch.Tensor
    backprop: torch.Tensor | None = None


class BookKeepingClipping:
    """Per-example clipping in one backward pass (see the module docstring).

    ``backward`` adds the clipped sum of the units a pass closes to each
    trainable parameter's ``.grad``; the caller adds the noise and steps.
    """

    mode = "bk"
    optimizer_class = None
    carries_units = True  # a unit's rows may run in several passes

    def __init__(self, model: nn.Module, max_grad_norm: float):
        shared = shared_parameters(model)
        if shared:
            name, users = next(iter(shared.items()))
            raise SettingError(
                "clipping",
                f"bk cannot clip {name}: it is used by {' and '.join(users)}, and book-keeping "
                "would clip each use apart; use hooks (or auto)",
            )
        self.model, self.max_grad_norm = model, max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.anchor = torch.zeros((), requires_grad=True)
        self.records: list[_Record] = []
        # Passes whose units have rows still to run: (owner, records) each.
        self.carried: list[tuple[torch.Tensor, list[_Record]]] = []
        self.handles = [model.register_forward_pre_hook(self._untrack)]
        self.handles.append(model.register_forward_hook(self._retrack))
        self.layers = [
            module
            for module in model.modules()
            if any(p.requires_grad for p in module.parameters(recurse=False))
        ]
        for module in self.layers:
            self.handles.append(module.register_forward_hook(self._keep))

    # Autograd must not build parameter gradients: marked off while the
    # forward runs, back on after it (the plan and optimizer see them as
    # trainable throughout).
    def _untrack(self, module, inputs) -> None:
        del module, inputs
        if torch.is_grad_enabled() and self.model.training:
            self.records = []
            for p in self.params:
                p.requires_grad_(False)

    def _retrack(self, module, inputs, output) -> None:
        del module, inputs, output
        for p in self.params:
            p.requires_grad_(True)

    def _keep(self, module, inputs, output):
        if not (torch.is_grad_enabled() and self.model.training):
            return None
        record = _Record(module, inputs[0].detach())
        self.records.append(record)
        return _Tap.apply(output, self.anchor, record)

    def backward(
        self, losses: torch.Tensor, optimizer, owner: torch.Tensor, closes: bool = True
    ) -> None:
        """This pass's backward; once a pass ``closes`` its units (every row
        of each has run), their norms over every pass they ran in and their
        clipped sum into ``.grad``. Until then the passes' layer inputs and
        output gradients are carried (``owner`` numbers the units of all of
        them from 0)."""
        del optimizer
        # A trainable parameter used other than through its layer's forward
        # would get no gradient here: refuse rather than train it wrongly.
        ran = {id(r.module) for r in self.records}
        missing = [type(m).__name__ for m in self.layers if id(m) not in ran]
        if missing:
            raise RuntimeError(
                f"book-keeping clipping: trainable {', '.join(sorted(set(missing)))} did not "
                "run in the forward pass; use hooks clipping"
            )
        losses.sum().backward()
        self.anchor.grad = None
        # else nothing below the loss used it
        self.carried.append((owner, [r for r in self.records if r.backprop is not None]))
        self.records = []
        if closes:
            passes, self.carried = self.carried, []
            self._clip(passes)

    def _clip(self, passes: list[tuple[torch.Tensor, list[_Record]]]) -> None:
        count = max(int(owner.max()) + 1 for owner, _ in passes)
        pieces: dict[int, list[Piece]] = {}
        modules: dict[int, nn.Module] = {}
        for owner, records in passes:
            units = Units(owner, count)
            calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for r in records:
                calls.setdefault(id(r.module), []).append((r.activation, r.backprop))
                modules[id(r.module)] = r.module
            for key, found in calls.items():
                pieces.setdefault(key, []).append(Piece(found, units))
        layers = [rule_for(modules[key])(modules[key], found) for key, found in pieces.items()]
        norms = torch.zeros(count, device=self.params[0].device if self.params else "cpu")
        for layer in layers:
            norms += layer.norms()
        factors = clip_factors(norms, self.max_grad_norm)
        for layer in layers:
            layer.accumulate(factors)

    def cleanup(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.records, self.carried = [], [], []
        for p in self.params:  # a forward pass that raised never marked them back
            p.requires_grad_(True)
