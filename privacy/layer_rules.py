"""Book-keeping's layer rules: for each layer type, a privacy unit's
squared gradient norm and the clipped sum from the layer's inputs and
output gradients (:mod:`clinfed.privacy.bookkeeping` records them and
drives the rules).

One :class:`LayerRule` per layer type, registered in :data:`RULES` as
Opacus registers its grad samplers: ``nn.Linear`` (peft's LoRA factors are
linear layers), ``nn.LayerNorm``, ``nn.Embedding``, a decoder family's
RMSNorm (:func:`register_rms_norm`), and any layer registered with its
per-example gradient (:func:`register`). A rule sees a layer's calls in
each pass its units' rows ran in (:class:`Piece`) and which unit each
example of the pass belongs to (:class:`Units`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _per_example(x: torch.Tensor, examples: int) -> torch.Tensor:
    """``(rows, ..., d)`` as ``(examples, tokens, d)``: an example's rows
    (MIMIC-III chunks, example-major) laid end to end."""
    if x.dim() == 2 and x.shape[0] == examples:
        return x.unsqueeze(1)
    return x.reshape(examples, -1, x.shape[-1])


def _end_to_end(calls: list[torch.Tensor], examples: int) -> torch.Tensor:
    """A layer's tensors from each of its calls, as ``(examples, tokens, d)``
    with the calls' tokens laid end to end (no copy for a single call)."""
    if len(calls) == 1:
        return _per_example(calls[0], examples)
    return torch.cat([_per_example(x, examples) for x in calls], dim=1)


class Units:
    """Which privacy unit each example of a pass belongs to (``owner[i]``),
    out of ``count`` units in all, and the per-unit views the norms need.

    A unit's rows may run in several passes (a note's sentences, grouped by
    length with other notes' sentences): ``count`` then numbers the units of
    every such pass, and this pass holds some of them (:attr:`ids`).

    Parameters
    ----------
    owner
        The unit of each example, ``(examples,)``.
    count
        How many units the passes hold together (default: this pass's).
    """

    def __init__(self, owner: torch.Tensor, count: int | None = None):
        self.owner = owner
        self.examples = len(owner)
        cpu = owner.cpu()
        if count is None:
            count = int(cpu.max()) + 1 if self.examples else 0
        self.count = count
        self._rows: list[torch.Tensor | None] | None = None
        self.single = bool(count == self.examples and torch.equal(cpu, torch.arange(count)))
        self.width = 1
        self.ids = torch.arange(count, device=owner.device)  # the units this pass holds
        if not self.single:
            ids, local = torch.unique(cpu, return_inverse=True)
            self.ids = ids.to(owner.device)
            # layout[u, s]: the s-th example of the pass's u-th unit, or
            # ``examples`` (a zero row) past the unit's last.
            order = torch.argsort(local, stable=True)
            sizes = torch.bincount(local, minlength=len(ids))
            self.width = int(sizes.max())
            starts = torch.cumsum(sizes, 0) - sizes
            sorted_local = local[order]
            slot = torch.arange(self.examples) - starts[sorted_local]
            layout = torch.full((len(ids), self.width), self.examples, dtype=torch.long)
            layout[sorted_local, slot] = order
            self.layout = layout.to(owner.device)

    def end_to_end(self, x: torch.Tensor) -> torch.Tensor:
        """``(examples, tokens, ...)`` as ``(units here, width * tokens, ...)``:
        each of this pass's units' examples' tokens laid end to end,
        zero-padded (in the order of :attr:`ids`)."""
        if self.single:
            return x
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
        laid = padded[self.layout.to(x.device)]
        return laid.reshape(len(self.ids), self.width * x.shape[1], *x.shape[2:])

    def rows(self, unit: int) -> torch.Tensor | None:
        """The examples of ``unit`` in this pass (``None``: it has none here)."""
        if self._rows is None:
            order = torch.argsort(self.owner, stable=True)
            sizes = torch.bincount(self.owner, minlength=self.count).tolist()
            self._rows = [part if len(part) else None for part in order.split(sizes)]
        return self._rows[unit]

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """Per-unit tensors of this pass's units (:meth:`end_to_end`'s order)
        as ``(count, ...)``, zero for the units this pass does not hold."""
        if len(self.ids) == self.count:  # ids are sorted: every unit, in order
            return x
        out = x.new_zeros((self.count, *x.shape[1:]))
        out[self.ids.to(x.device)] = x
        return out

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """Per-example tensors ``(examples, ...)`` summed per unit, ``(count, ...)``."""
        if self.single:
            return x
        out = x.new_zeros((self.count, *x.shape[1:]))
        return out.index_add_(0, self.owner.to(x.device), x)


@dataclass
class Piece:
    """A layer's calls in one pass, and the unit of each of the pass's examples."""

    calls: list[tuple[torch.Tensor, torch.Tensor]]
    units: Units

    def end_to_end(self, index: int) -> torch.Tensor:
        """The calls' inputs (``index`` 0) or output gradients (1) as
        ``(examples, tokens, d)``."""
        return _end_to_end([call[index] for call in self.calls], self.units.examples)


class LayerRule:
    """Book-keeping for one layer type: each unit's squared gradient norm
    and the clipped sum of the layer's parameters, from the layer's inputs
    and output gradients (``pieces``: one per pass the units' rows ran in,
    each with one input and output gradient per time the layer ran in that
    pass, laid end to end as more tokens of each example; pfeddc's fusion
    runs once per prompted encoder layer).

    Subclasses fill :attr:`kept` (one dict per piece) with per-example
    gradients by parameter name (where building them is cheapest) and may
    add a norm computed without them (:meth:`ghost_norms`) and sums computed
    in one product (:meth:`product_sums`). One rule per layer type,
    registered with :func:`register`, as Opacus registers its grad
    samplers. Norms are per privacy unit, sums per example.
    """

    def __init__(self, module: nn.Module, pieces: list[Piece]):
        self.module, self.pieces = module, pieces
        self.count = pieces[0].units.count
        self.device = pieces[0].calls[0][1].device  # where the output gradients are
        self.kept: list[dict[str, torch.Tensor]] = [{} for _ in pieces]

    def ghost_norms(self) -> torch.Tensor | None:
        """Each unit's squared norm of the gradients not in :attr:`kept`
        (``None``: none)."""
        return None

    def product_sums(self, piece: int, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """One piece's clipped sums of the parameters not in :attr:`kept`."""
        del piece, factors
        return {}

    def norms(self) -> torch.Tensor:
        """Each unit's squared gradient norm over this layer's parameters."""
        total = self.ghost_norms()
        if total is None:
            total = torch.zeros(self.count, device=self.device)
        for name in self.kept[0]:
            # A unit's gradient: its examples' summed over every piece.
            unit = sum(p.units.total(kept[name]) for p, kept in zip(self.pieces, self.kept))
            total = total + unit.pow(2).flatten(1).sum(1)
        return total

    def accumulate(self, factors: torch.Tensor) -> None:
        """Add ``sum_i factors[unit of i] * grad_i`` into each parameter's
        ``.grad`` (``factors``: per unit)."""
        for index, piece in enumerate(self.pieces):
            own = factors[piece.units.owner.to(factors.device)]
            sums = {name: torch.tensordot(own, g, dims=1) for name, g in self.kept[index].items()}
            sums |= self.product_sums(index, own)
            for name, total in sums.items():
                param = getattr(self.module, name)
                if param.grad is None:
                    param.grad = total.view_as(param)
                else:
                    param.grad.add_(total.view_as(param))


def _trains(module: nn.Module, name: str) -> bool:
    param = getattr(module, name, None)
    return param is not None and param.requires_grad


def _laid(pieces: list[Piece], tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every unit's tokens from every piece laid end to end, ``(count, tokens, ...)``
    (zero where a piece does not hold the unit; no copy for one piece of all)."""
    laid = [p.units.spread(p.units.end_to_end(x)) for p, x in zip(pieces, tensors)]
    return laid[0] if len(laid) == 1 else torch.cat(laid, dim=1)


class LinearRule(LayerRule):
    """``y = x W^T + b``: the weight's norm as a ghost norm
    ``sum_ts <a_t, a_s> <g_t, g_s>`` (cost ``T^2 (in + out)`` per unit) or
    from the unit's gradient where that is smaller (LoRA's rank-``r``
    factors, long units); its clipped sum in one product per piece."""

    def __init__(self, module, pieces):
        super().__init__(module, pieces)
        self.g = [p.end_to_end(1) for p in pieces]
        if _trains(module, "bias"):
            for kept, g in zip(self.kept, self.g):
                kept["bias"] = g.sum(1)
        # How the weight's norm is found: "ghost" (Gram matrices), "unit"
        # (each unit's gradient, built and dropped), or kept per example.
        self.weight_norm: str | None = None
        if _trains(module, "weight"):  # else the inputs are not needed: no copy
            self.a = [p.end_to_end(0) for p in pieces]
            # A unit's tokens, end to end over the pieces.
            tokens = sum(a.shape[1] * p.units.width for a, p in zip(self.a, pieces))
            d_in, d_out = self.a[0].shape[2], self.g[0].shape[2]
            if tokens * (d_in + d_out) < d_in * d_out:
                self.weight_norm = "ghost"
            elif len(pieces) == 1 and pieces[0].units.single:
                # the example's gradient serves its norm and the sum
                self.kept[0]["weight"] = torch.bmm(self.g[0].transpose(1, 2), self.a[0])
            else:  # per unit, not per example: a note's rows share one gradient
                self.weight_norm = "unit"

    def ghost_norms(self) -> torch.Tensor | None:
        if self.weight_norm == "unit" and len(self.pieces) == 1:
            units, a, g = self.pieces[0].units, self.a[0], self.g[0]
            grads = torch.bmm(units.end_to_end(g).transpose(1, 2), units.end_to_end(a))
            return units.spread(grads).pow(2).sum((1, 2))
        if self.weight_norm == "unit":
            # A unit's rows over several passes: its gradient from its own
            # rows of each, one product a unit (no rows padded to the pass's
            # unit with the most).
            norms = torch.zeros(self.count, device=self.device)
            for unit in range(self.count):
                rows = [(p.units.rows(unit), a, g) for p, a, g in zip(self.pieces, self.a, self.g)]
                g = torch.cat([g[r].flatten(0, 1) for r, _, g in rows if r is not None])
                a = torch.cat([a[r].flatten(0, 1) for r, a, _ in rows if r is not None])
                norms[unit] = (g.t() @ a).pow(2).sum()
            return norms
        if self.weight_norm == "ghost":
            a, g = _laid(self.pieces, self.a), _laid(self.pieces, self.g)
            return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
        return None

    def product_sums(self, piece: int, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.weight_norm is None:
            return {}
        a, g = self.a[piece], self.g[piece]
        weighted = (g * factors.view(-1, 1, 1)).reshape(-1, g.shape[-1])
        return {"weight": weighted.t() @ a.reshape(-1, a.shape[-1])}


class LayerNormRule(LayerRule):
    """The weight multiplies the normalised input: per-example gradients
    ``sum_t g_t * x_hat_t`` and ``sum_t g_t``."""

    def __init__(self, module, pieces):
        super().__init__(module, pieces)
        shape, eps = module.normalized_shape, module.eps
        for kept, piece in zip(self.kept, pieces):
            n, g = piece.units.examples, piece.end_to_end(1)
            if _trains(module, "weight"):
                normed = [F.layer_norm(x, shape, eps=eps) for x, _ in piece.calls]
                kept["weight"] = (g * _end_to_end(normed, n)).sum(1)
            if _trains(module, "bias"):
                kept["bias"] = g.sum(1)


def _rms_normalised(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNormRule(LayerRule):
    """A decoder's RMSNorm (Llama, Qwen2, Mistral; Gemma's scales by
    ``1 + weight``, the same gradient): the weight multiplies ``x / rms(x)``,
    so an example's gradient is ``sum_t g_t * x_t / rms(x_t)``."""

    def __init__(self, module, pieces):
        super().__init__(module, pieces)
        if _trains(module, "weight"):
            for kept, piece in zip(self.kept, pieces):
                n = piece.units.examples
                g = _end_to_end([g.float() for _, g in piece.calls], n)
                a = _end_to_end([_rms_normalised(module, x) for x, _ in piece.calls], n)
                kept["weight"] = (g * a).sum(1)


def rms_norm_per_example(
    module: nn.Module, x: torch.Tensor, backprop: torch.Tensor
) -> dict[str, torch.Tensor]:
    """RMSNorm's gradient per row of a call (Opacus's hooks)."""
    if not module.weight.requires_grad:
        return {}
    tokens = tuple(range(1, x.dim() - 1))
    return {"weight": (backprop.float() * _rms_normalised(module, x)).sum(tokens)}


def register_rms_norm(layer: type[nn.Module]) -> None:
    """Teach DP-SGD a model family's RMSNorm class (each decoder family
    has its own; clinfed.modeling.models registers those it meets)."""
    RULES[layer] = RMSNormRule
    GRAD_SAMPLERS[layer] = rms_norm_per_example


class EmbeddingRule(LayerRule):
    """A lookup: a unit's gradient norm from the Gram matrix of its output
    gradients over the positions holding the same id; the clipped sum
    scattered into the looked-up rows (the padding row never trains)."""

    def __init__(self, module, pieces):
        super().__init__(module, pieces)
        self.ids, self.g = [], []
        for piece in pieces:
            n = piece.units.examples
            ids = torch.cat([a.reshape(n, -1) for a, _ in piece.calls], dim=1)
            g = piece.end_to_end(1)
            if module.padding_idx is not None:
                g = g * (ids != module.padding_idx).unsqueeze(-1)
            self.ids.append(ids)
            self.g.append(g)

    def ghost_norms(self) -> torch.Tensor | None:
        # A padding row's gradient is zero: whatever id it holds adds nothing.
        ids, g = _laid(self.pieces, self.ids), _laid(self.pieces, self.g)
        same = ids.unsqueeze(2) == ids.unsqueeze(1)
        return (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))

    def accumulate(self, factors: torch.Tensor) -> None:
        # Scattered straight into .grad: a table-sized buffer per pass (the
        # whole vocabulary for a few hundred looked-up rows) cost more than
        # the lookups' own work on a whole-model step.
        weight = self.module.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        for piece, ids, g in zip(self.pieces, self.ids, self.g):
            own = factors[piece.units.owner.to(factors.device)]
            weighted = (g * own.view(-1, 1, 1)).reshape(-1, g.shape[-1])
            weight.grad.index_add_(0, ids.reshape(-1), weighted.to(weight.grad.dtype))

    @staticmethod
    def applies(module: nn.Module) -> bool:
        return not (module.max_norm is not None or module.scale_grad_by_freq or module.sparse)


# Per-example gradient of one call of a layer: (module, its input, its
# output's gradient) -> {parameter name: (examples, *shape)}.
PerExample = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def per_example_rule(grads: PerExample) -> type[LayerRule]:
    """A rule from a layer's per-example gradient (the gradients are built
    and kept; summed over the layer's calls in a pass)."""

    class PerExampleRule(LayerRule):
        def __init__(self, module, pieces):
            super().__init__(module, pieces)
            for kept, piece in zip(self.kept, pieces):
                for activation, backprop in piece.calls:
                    for name, grad in grads(module, activation, backprop).items():
                        kept[name] = kept[name] + grad if name in kept else grad

    return PerExampleRule


RULES: dict[type[nn.Module], type[LayerRule]] = {
    nn.Linear: LinearRule,  # peft's LoRA factors are linear layers
    nn.LayerNorm: LayerNormRule,
    nn.Embedding: EmbeddingRule,
}
# The same per-example gradients as Opacus grad samplers (hooks clipping).
GRAD_SAMPLERS: dict[type[nn.Module], PerExample] = {}


def register(layer: type[nn.Module], grads: PerExample) -> None:
    """Teach DP-SGD a layer type of the model's own from its per-example
    gradient: book-keeping clipping keeps those gradients, hooks clipping
    registers them with Opacus. (The layer's module calls this.)"""
    RULES[layer] = per_example_rule(grads)
    GRAD_SAMPLERS[layer] = grads


def covered() -> str:
    """The layer types book-keeping has a rule for, in words."""
    return ", ".join(sorted(t.__name__ for t in RULES))


def rule_for(module: nn.Module) -> type[LayerRule] | None:
    rule = RULES.get(type(module))
    if rule is None:  # a subclass of a covered type
        rule = next((r for t, r in RULES.items() if isinstance(module, t)), None)
    if rule is EmbeddingRule and not EmbeddingRule.applies(module):
        return None
    return rule
