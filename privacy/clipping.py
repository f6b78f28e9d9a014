"""Per-example clipping for DP-SGD: three ways to get each example's
gradient norm over every trainable parameter jointly.

* ``bk``: book-keeping (:mod:`clinfed.privacy.bookkeeping`): one backward
  pass, norms from each layer's inputs and output gradients, the clipped
  sum in one product per parameter. For linear, LayerNorm, embedding and
  label-wise layers, whatever rows a unit spans (a MIMIC-III admission's
  chunks, the windows of a long i2b2 line, every sentence of a note at the
  document level, every admission of a patient).

* ``hooks``: per-example gradients materialised by Opacus's layer hooks.
  Works for every task, unit and layer (pfeddc's prompts): the rows'
  gradients are summed into the unit's before clipping.
* ``ghost``: Opacus's ghost clipping computes per-example norms without
  materialising per-example gradients (two backward passes). Cheaper when
  the 30k x 384 word-embedding matrix trains; needs one encoder row per
  unit.

``auto`` picks bk wherever its layer rules cover the trainable parameters
(measured fastest on every plan, see ``benchmarks/dp_overhead.py``), else
ghost when embeddings train and every unit is one row, else hooks. A
parameter used by several modules (tied weights) is clipped exactly only
by hooks, which add its uses before the norm: bk and ghost refuse it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from clinfed.privacy import bookkeeping
from clinfed.privacy.errors import SettingError

CLIPPINGS = ("auto", "hooks", "ghost", "bk")


# Opacus is imported where hooks or ghost clipping is built, not with this
# module: it costs about a second and a half of start-up, paid by every
# Flower message (a fresh process each) that never uses it.


def _opacus_with_own_layers() -> None:
    """Import Opacus and register the per-example gradient of every layer
    type registered with :func:`clinfed.privacy.bookkeeping.register`."""
    from opacus.grad_sample import register_grad_sampler

    for layer, grads in bookkeeping.GRAD_SAMPLERS.items():
        register_grad_sampler(layer)(_as_grad_sampler(grads))


def _as_grad_sampler(grads: bookkeeping.PerExample):
    def grad_sampler(
        layer: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
    ) -> dict[nn.Parameter, torch.Tensor]:
        per_name = grads(layer, activations[0], backprops)
        return {getattr(layer, name): grad for name, grad in per_name.items()}

    return grad_sampler


def choose_clipping(
    model: nn.Module, requested: str, one_row_per_example: bool = True, grouped: bool = False
) -> str:
    """The clipping mode for the parameters trainable now.

    ``one_row_per_example``: a model row is a whole example (a token task's
    sentence; not a chunked note); ``grouped``: some privacy unit spans
    several examples."""
    if requested not in CLIPPINGS:
        raise SettingError("clipping", f"must be one of {', '.join(CLIPPINGS)}")
    one_row_per_unit = one_row_per_example and not grouped
    if requested == "ghost" and not one_row_per_unit:
        raise SettingError(
            "clipping",
            "ghost needs one encoder row per privacy unit; here a unit spans several rows: "
            "use hooks (or auto)",
        )
    shared = bookkeeping.shared_parameters(model)
    if requested in ("bk", "ghost") and shared:
        # Both take a squared norm per module: a weight used by two modules
        # would be clipped at up to sqrt(2) C. Opacus's hooks add its uses.
        name, users = next(iter(shared.items()))
        raise SettingError(
            "clipping",
            f"{requested} cannot clip {name}, used by {' and '.join(users)} (its norm would be "
            "taken per use): use hooks (or auto)",
        )
    if requested == "bk" and not bookkeeping.supports(model):
        raise SettingError(
            "clipping",
            "bk needs only layers with a book-keeping rule "
            f"({bookkeeping.covered()}) training: use hooks (or auto)",
        )
    if requested != "auto":
        return requested
    if bookkeeping.supports(model):
        return "bk"
    embeddings = any(
        isinstance(m, nn.Embedding) and m.weight.requires_grad for m in model.modules()
    )
    # Measured on MiniLM (DESIGN.md 6): ghost wins with a trainable
    # embedding matrix, hooks without; tied weights need hooks.
    return "ghost" if embeddings and one_row_per_unit and not shared else "hooks"


def _fold_rows(params: list[nn.Parameter], owner: torch.Tensor) -> None:
    """Sum per-row gradients into per-unit ones: first the encoder rows of
    one example (MIMIC-III chunks, laid out example-major), then the
    examples of one unit (``owner[i]``: the unit of example ``i``)."""
    examples = len(owner)
    units = int(owner.max()) + 1 if examples else 0
    for p in params:
        g = p.grad_sample
        if g is None:
            continue
        if g.shape[0] != examples:
            g = g.reshape(examples, g.shape[0] // examples, *g.shape[1:]).sum(1)
        if units != examples:
            g = torch.zeros((units, *g.shape[1:]), dtype=g.dtype, device=g.device).index_add_(
                0, owner.to(g.device), g
            )
        p.grad_sample = g


def per_example_gradients(
    model: nn.Module, params: list[nn.Parameter], losses: torch.Tensor
) -> list[torch.Tensor]:
    """Each example's gradient of ``losses[i]`` for every tensor of
    ``params`` (``(examples, *shape)`` each), in one backward pass through
    Opacus's layer hooks. ``losses`` must come from a forward pass taken
    inside :func:`layer_hooks` on ``model``; ``.grad`` is left untouched."""
    saved = [p.grad for p in params]
    try:
        with warnings.catch_warnings():
            # The first trainable layer's input needs no gradient: expected.
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            losses.sum().backward(inputs=params)
        grads = [p.grad_sample for p in params]
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad, p.grad_sample = grad, None
    missing = [i for i, g in enumerate(grads) if g is None]
    if missing:
        raise ValueError(f"no per-example gradient for {len(missing)} tensors (unsupported layer)")
    return grads


class layer_hooks:  # noqa: N801 - a context manager, used like a function
    """Opacus's per-example gradient hooks on ``model`` for the ``with``
    block (see :func:`per_example_gradients`).

    Opacus records a layer's inputs only in training mode: the layers that
    own trainable tensors are put in it for the block (linear, LayerNorm
    and embedding layers compute the same in both), the rest keep their
    mode, so an evaluating model keeps its dropout off."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        _opacus_with_own_layers()
        from opacus.grad_sample import GradSampleHooks

        self.modes = {m: m.training for m in self.model.modules()}
        for module in self.model.modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                module.train()
        self.hooks = GradSampleHooks(self.model, loss_reduction="sum", strict=False)
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.cleanup()
        for module, training in self.modes.items():
            module.training = training


def _whole_units(mode: str, closes: bool) -> None:
    # Opacus clips what one pass computed: a unit's rows must all be in it.
    if not closes:
        raise ValueError(f"{mode} clipping needs each unit's rows in one pass")


class HooksClipping:
    """Per-example gradients from layer hooks, clipped by the DP optimizer."""

    mode = "hooks"
    carries_units = False  # a unit's rows run in one pass

    def __init__(self, model: nn.Module, max_grad_norm: float):
        _opacus_with_own_layers()
        from opacus.grad_sample import GradSampleHooks
        from opacus.optimizers import DPOptimizer

        self.optimizer_class = DPOptimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.hooks = GradSampleHooks(model, loss_reduction="sum", strict=False)

    def backward(
        self, losses: torch.Tensor, optimizer, owner: torch.Tensor, closes: bool = True
    ) -> None:
        del optimizer
        _whole_units(self.mode, closes)
        losses.sum().backward()
        _fold_rows(self.params, owner)

    def cleanup(self) -> None:
        self.hooks.cleanup()


class GhostClipping:
    """Per-example norms without per-example gradients (two backward passes)."""

    mode = "ghost"
    carries_units = False

    def __init__(self, model: nn.Module, max_grad_norm: float):
        _opacus_with_own_layers()
        from opacus.grad_sample import GradSampleHooksFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping

        self.optimizer_class = DPOptimizerFastGradientClipping
        self.hooks = GradSampleHooksFastGradientClipping(
            model, loss_reduction="sum", strict=False, max_grad_norm=max_grad_norm
        )

    def backward(
        self, losses: torch.Tensor, optimizer, owner: torch.Tensor, closes: bool = True
    ) -> None:
        from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

        del owner  # one row per unit (choose_clipping)
        _whole_units(self.mode, closes)
        DPTensorFastGradientClipping(self.hooks, optimizer, losses, "sum").backward()

    def cleanup(self) -> None:
        self.hooks.cleanup()


CLIPPERS = {
    "hooks": HooksClipping,
    "ghost": GhostClipping,
    "bk": bookkeeping.BookKeepingClipping,
}
