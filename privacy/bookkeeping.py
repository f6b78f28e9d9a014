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
(:func:`register_rms_norm`), one :class:`LayerRule` each, and any
layer registered with its per-example gradient (:func:`register`; clinfed's
``LabelwiseLinear`` registers itself). A model with any other trainable
parameter (pfeddc's prompts) uses hooks. Rows of one
example must be contiguous and equally many (MIMIC-III's chunks are).

A privacy unit may span several examples (the windows of a long i2b2 line,
every sentence of a note at ``--privacy-unit document``, every admission of
a patient): its gradient is the sum of its examples', so its squared norm
is the ghost norm over all their tokens together. The unit's examples are
laid end to end (:class:`Units`; shorter units padded with zero rows, which
add nothing), and every example's share of the clipped sum takes its unit's
factor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from clinfed.privacy.errors import SettingError


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
        if own and _rule(module) is None:
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
    """Which privacy unit each example of a pass belongs to (``owner[i]``,
    numbered from 0), and the per-unit views the norms need.

    Parameters
    ----------
    owner
        The unit of each example, ``(examples,)``.
    """

    def __init__(self, owner: torch.Tensor):
        self.owner = owner
        self.examples = len(owner)
        self.count = int(owner.max()) + 1 if self.examples else 0
        self.single = bool(
            self.count == self.examples and torch.equal(owner.cpu(), torch.arange(self.examples))
        )
        self.width = 1
        if not self.single:
            # layout[u, s]: the s-th example of unit u, or ``examples`` (a
            # zero row) past the unit's last.
            order = torch.argsort(owner.cpu(), stable=True)
            sizes = torch.bincount(owner.cpu(), minlength=self.count)
            self.width = int(sizes.max())
            starts = torch.cumsum(sizes, 0) - sizes
            sorted_owner = owner.cpu()[order]
            slot = torch.arange(self.examples) - starts[sorted_owner]
            layout = torch.full((self.count, self.width), self.examples, dtype=torch.long)
            layout[sorted_owner, slot] = order
            self.layout = layout.to(owner.device)

    def end_to_end(self, x: torch.Tensor) -> torch.Tensor:
        """``(examples, tokens, ...)`` as ``(units, width * tokens, ...)``:
        a unit's examples' tokens laid end to end, zero-padded."""
        if self.single:
            return x
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
        laid = padded[self.layout.to(x.device)]
        return laid.reshape(self.count, self.width * x.shape[1], *x.shape[2:])

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """Per-example tensors ``(examples, ...)`` summed per unit."""
        if self.single:
            return x
        out = x.new_zeros((self.count, *x.shape[1:]))
        return out.index_add_(0, self.owner.to(x.device), x)


class LayerRule:
    """Book-keeping for one layer type: each example's squared gradient norm
    and the clipped sum of the layer's parameters, from the layer's inputs
    and output gradients (``calls``: one pair per time the layer ran in the
    forward pass, laid end to end as more tokens of each example; pfeddc's
    fusion runs once per prompted encoder layer).

    Subclasses fill :attr:`kept` with per-example gradients by parameter
    name (where building them is cheapest) and may add a norm computed
    without them (:meth:`ghost_norms`) and sums computed in one product
    (:meth:`product_sums`). One rule per layer type, registered with
    :func:`register`, as Opacus registers its grad samplers. Norms are per
    privacy unit (``units``), sums per example.
    """

    def __init__(
        self, module: nn.Module, calls: list[tuple[torch.Tensor, torch.Tensor]], units: Units
    ):
        self.module, self.units, self.examples = module, units, units.examples
        self.device = calls[0][1].device  # where the output gradients are
        self.kept: dict[str, torch.Tensor] = {}

    def ghost_norms(self) -> torch.Tensor | None:
        """Each unit's squared norm of the gradients not in :attr:`kept`
        (``None``: none)."""
        return None

    def product_sums(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Clipped sums of the parameters not in :attr:`kept`."""
        del factors
        return {}

    def norms(self) -> torch.Tensor:
        """Each unit's squared gradient norm over this layer's parameters."""
        total = self.ghost_norms()
        if total is None:
            total = torch.zeros(self.units.count, device=self.device)
        for grad in self.kept.values():
            total = total + self.units.total(grad).pow(2).flatten(1).sum(1)
        return total

    def accumulate(self, factors: torch.Tensor) -> None:
        """Add ``sum_i factors[i] * grad_i`` into each parameter's ``.grad``
        (``factors``: per example, each its unit's)."""
        sums = {name: torch.tensordot(factors, grad, dims=1) for name, grad in self.kept.items()}
        sums |= self.product_sums(factors)
        for name, total in sums.items():
            param = getattr(self.module, name)
            if param.grad is None:
                param.grad = total.view_as(param)
            else:
                param.grad.add_(total.view_as(param))


def _trains(module: nn.Module, name: str) -> bool:
    param = getattr(module, name, None)
    return param is not None and param.requires_grad


class LinearRule(LayerRule):
    """``y = x W^T + b``: the weight's norm as a ghost norm
    ``sum_ts <a_t, a_s> <g_t, g_s>`` (cost ``T^2 (in + out)`` per unit) or
    from the unit's gradient where that is smaller (LoRA's rank-``r``
    factors, long units); its clipped sum in one product."""

    def __init__(self, module, calls, units):
        super().__init__(module, calls, units)
        n = units.examples
        self.g = _end_to_end([g for _, g in calls], n)
        if _trains(module, "bias"):
            self.kept["bias"] = self.g.sum(1)
        # How the weight's norm is found: "ghost" (Gram matrices), "unit"
        # (each unit's gradient, built and dropped), or kept per example.
        self.weight_norm: str | None = None
        if _trains(module, "weight"):  # else the inputs are not needed: no copy
            self.a = _end_to_end([a for a, _ in calls], n)
            tokens = self.a.shape[1] * units.width  # a unit's, end to end
            d_in, d_out = self.a.shape[2], self.g.shape[2]
            if tokens * (d_in + d_out) < d_in * d_out:
                self.weight_norm = "ghost"
            elif units.single:  # the example's gradient serves its norm and the sum
                self.kept["weight"] = torch.bmm(self.g.transpose(1, 2), self.a)
            else:  # per unit, not per example: a note's rows share one gradient
                self.weight_norm = "unit"

    def ghost_norms(self) -> torch.Tensor | None:
        if self.weight_norm is None:
            return None
        a, g = self.units.end_to_end(self.a), self.units.end_to_end(self.g)
        if self.weight_norm == "unit":
            return torch.bmm(g.transpose(1, 2), a).pow(2).sum((1, 2))
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))

    def product_sums(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.weight_norm is None:
            return {}
        weighted = (self.g * factors.view(-1, 1, 1)).reshape(-1, self.g.shape[-1])
        return {"weight": weighted.t() @ self.a.reshape(-1, self.a.shape[-1])}


class LayerNormRule(LayerRule):
    """The weight multiplies the normalised input: per-example gradients
    ``sum_t g_t * x_hat_t`` and ``sum_t g_t``."""

    def __init__(self, module, calls, units):
        super().__init__(module, calls, units)
        n = units.examples
        shape, eps = module.normalized_shape, module.eps
        g = _end_to_end([g for _, g in calls], n)
        if _trains(module, "weight"):
            a = _end_to_end([F.layer_norm(x, shape, eps=eps) for x, _ in calls], n)
            self.kept["weight"] = (g * a).sum(1)
        if _trains(module, "bias"):
            self.kept["bias"] = g.sum(1)


def _rms_normalised(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNormRule(LayerRule):
    """A decoder's RMSNorm (Llama, Qwen2, Mistral; Gemma's scales by
    ``1 + weight``, the same gradient): the weight multiplies ``x / rms(x)``,
    so an example's gradient is ``sum_t g_t * x_t / rms(x_t)``."""

    def __init__(self, module, calls, units):
        super().__init__(module, calls, units)
        if _trains(module, "weight"):
            n = units.examples
            g = _end_to_end([g.float() for _, g in calls], n)
            a = _end_to_end([_rms_normalised(module, x) for x, _ in calls], n)
            self.kept["weight"] = (g * a).sum(1)


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
    """A lookup: an example's gradient norm from the Gram matrix of its
    output gradients over the positions holding the same id; the clipped sum
    scattered into the looked-up rows (the padding row never trains)."""

    def __init__(self, module, calls, units):
        super().__init__(module, calls, units)
        n = units.examples
        ids = torch.cat([a.reshape(n, -1) for a, _ in calls], dim=1)
        g = _end_to_end([g for _, g in calls], n)
        if module.padding_idx is not None:
            g = g * (ids != module.padding_idx).unsqueeze(-1)
        self.a, self.g = ids, g

    def ghost_norms(self) -> torch.Tensor | None:
        # A padding row's gradient is zero: whatever id it holds adds nothing.
        ids, g = self.units.end_to_end(self.a), self.units.end_to_end(self.g)
        same = ids.unsqueeze(2) == ids.unsqueeze(1)
        return (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))

    def accumulate(self, factors: torch.Tensor) -> None:
        # Scattered straight into .grad: a table-sized buffer per pass (the
        # whole vocabulary for a few hundred looked-up rows) cost more than
        # the lookups' own work on a whole-model step.
        weighted = (self.g * factors.view(-1, 1, 1)).reshape(-1, self.g.shape[-1])
        weight = self.module.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, self.a.reshape(-1), weighted.to(weight.grad.dtype))

    @staticmethod
    def applies(module: nn.Module) -> bool:
        return not (module.max_norm is not None or module.scale_grad_by_freq or module.sparse)


# Per-example gradient of one call of a layer: (module, its input, its
# output's gradient) -> {parameter name: (examples, *shape)}.
PerExample = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def per_example_rule(grads: PerExample) -> type[LayerRule]:
    """A rule from a layer's per-example gradient (the gradients are built
    and kept; summed over the layer's calls)."""

    class PerExampleRule(LayerRule):
        def __init__(self, module, calls, units):
            super().__init__(module, calls, units)
            for activation, backprop in calls:
                for name, grad in grads(module, activation, backprop).items():
                    self.kept[name] = self.kept[name] + grad if name in self.kept else grad

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


def _rule(module: nn.Module) -> type[LayerRule] | None:
    rule = RULES.get(type(module))
    if rule is None:  # a subclass of a covered type
        rule = next((r for t, r in RULES.items() if isinstance(module, t)), None)
    if rule is EmbeddingRule and not EmbeddingRule.applies(module):
        return None
    return rule


class BookKeepingClipping:
    """Per-example clipping in one backward pass (see the module docstring).

    ``backward`` adds this pass's clipped sum to each trainable parameter's
    ``.grad``; the caller adds the noise and steps.
    """

    mode = "bk"
    optimizer_class = None

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

    def backward(self, losses: torch.Tensor, optimizer, owner: torch.Tensor) -> None:
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
        calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        modules: dict[int, nn.Module] = {}
        for r in self.records:
            if r.backprop is not None:  # else nothing below the loss used it
                calls.setdefault(id(r.module), []).append((r.activation, r.backprop))
                modules[id(r.module)] = r.module
        units = Units(owner)
        layers = [_rule(modules[k])(modules[k], found, units) for k, found in calls.items()]
        norms = torch.zeros(units.count, device=self.params[0].device if self.params else "cpu")
        for layer in layers:
            norms += layer.norms()
        factors = clip_factors(norms, self.max_grad_norm)[owner.to(norms.device)]
        for layer in layers:
            layer.accumulate(factors)
        self.records = []

    def cleanup(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.records = [], []
        for p in self.params:  # a forward pass that raised never marked them back
            p.requires_grad_(True)
