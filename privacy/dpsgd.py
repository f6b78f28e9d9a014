"""DP-SGD for one site's local training, on Opacus.

Per round: the plan decides which parameters train (``apply_plan``) before
anything here runs; Opacus's per-example gradient hooks are then attached
to exactly those parameters, the round trains, and the hooks come off again,
so the same model object can serve the next site with another plan. Each
step samples a Poisson batch (every example joins with probability
``q = batch_size / n``), clips each example's gradient over all trainable
parameters jointly to ``max_grad_norm``, adds Gaussian noise of standard
deviation ``noise_multiplier * max_grad_norm`` and divides by the expected
batch size: exactly the subsampled Gaussian mechanism the ledger accounts.

Two ways to clip, picked by what is trainable (``--clipping auto``):

* ``hooks``: per-example gradients materialised by Opacus's layer hooks.
  Works for every task; needed for MIMIC-III, where an admission is several
  encoder rows (chunks) whose per-row gradients are summed into the
  admission's before clipping.
* ``ghost``: Opacus's ghost clipping computes per-example norms without
  materialising per-example gradients (two backward passes). Cheaper when
  the 30k x 384 word-embedding matrix trains; needs one encoder row per
  example (i2b2).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import datasets
import numpy as np
import torch
from opacus.grad_sample import (
    GradSampleHooks,
    GradSampleHooksFastGradientClipping,
    register_grad_sampler,
)
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from torch import nn

from clinfed.blocks import EMBEDDINGS, block_of
from clinfed.errors import ClinfedError
from clinfed.models import LabelwiseLinear
from clinfed.privacy.accountant import Mechanism
from clinfed.tasks.base import Task
from clinfed.training import EpochStats

CLIPPINGS = ("auto", "hooks", "ghost")


@register_grad_sampler(LabelwiseLinear)
def _labelwise_grad_sample(
    layer: LabelwiseLinear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    # logit_bl = <w_l, v_bl> + b_l, so d logit_bl / d w_l = v_bl per example.
    summary = activations[0]  # (B, L, H)
    grads = {}
    if layer.weight.requires_grad:
        grads[layer.weight] = backprops.unsqueeze(-1) * summary
    if layer.bias.requires_grad:
        grads[layer.bias] = backprops
    return grads


@dataclass(frozen=True)
class DPSettings:
    """DP-SGD settings of one site.

    Attributes
    ----------
    noise_multiplier
        Noise standard deviation over the clipping norm.
    max_grad_norm
        Per-example L2 clipping norm over all trainable parameters.
    clipping
        ``auto``, ``hooks`` or ``ghost`` (see the module docstring).
    """

    noise_multiplier: float
    max_grad_norm: float = 1.0
    clipping: str = "auto"


def sample_rate(examples: int, batch_size: int) -> float:
    """Poisson sampling rate of a site with ``examples`` examples."""
    return min(1.0, batch_size / examples)


def steps_per_epoch(examples: int, batch_size: int) -> int:
    """Steps that make one expected pass over the site's data."""
    return max(1, round(examples / batch_size))


def round_mechanism(examples: int, batch_size: int, epochs: int, noise: float) -> Mechanism:
    """The DP-SGD mechanism of one round at one site."""
    return Mechanism(
        "dp-sgd",
        noise,
        sample_rate(examples, batch_size),
        epochs * steps_per_epoch(examples, batch_size),
    )


def choose_clipping(model: nn.Module, task: Task, requested: str) -> str:
    """``hooks`` or ``ghost`` for the parameters trainable now."""
    if requested not in CLIPPINGS:
        raise ClinfedError(f"--clipping must be one of {', '.join(CLIPPINGS)}")
    one_row_per_example = task.head == "token"
    if requested == "ghost" and not one_row_per_example:
        raise ClinfedError(
            f"--clipping ghost needs one encoder row per example; {task.name} splits an example "
            "into chunks: use hooks (or auto)"
        )
    if requested != "auto":
        return requested
    embeddings = any(
        p.requires_grad and block_of(n) == EMBEDDINGS for n, p in model.named_parameters()
    )
    # Measured on MiniLM (DESIGN.md 6): ghost wins with trainable embeddings,
    # hooks without.
    return "ghost" if embeddings and one_row_per_example else "hooks"


# Fixed cost of one forward/backward pass, in padded tokens: measured on
# MiniLM on 2 CPU cores, a pass costs about as much as 32 tokens of work
# before its first token (hooks, Python, kernel launches).
MICROBATCH_OVERHEAD_TOKENS = 32


def microbatches(lengths: np.ndarray, overhead_tokens: int) -> list[np.ndarray]:
    """Split one sampled batch into groups of similar length.

    Poisson sampling draws a batch whatever its rows' lengths (grouping by
    length as non-private training does would make the batch depend on more
    than the coin flips the accountant assumes), so one pass would pad every
    row to the longest. Instead the drawn batch runs in several passes whose
    clipped gradients Opacus sums into one noisy step. The cut
    minimises padded tokens plus ``overhead_tokens`` per pass, exactly, by
    dynamic programming over the lengths sorted longest first.

    Returns positions into ``lengths``, longest group first.
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    longest = np.asarray(lengths)[order]
    n = len(order)
    cost = np.zeros(n + 1)
    cut = np.full(n + 1, n)
    for start in range(n - 1, -1, -1):  # a group starting here pads to longest[start]
        sizes = np.arange(1, n - start + 1)
        totals = overhead_tokens + sizes * longest[start] + cost[start + sizes]
        best = len(totals) - 1 - int(np.argmin(totals[::-1]))  # ties: fewer passes
        cost[start], cut[start] = totals[best], start + sizes[best]
    groups, start = [], 0
    while start < n:
        groups.append(order[start : cut[start]])
        start = int(cut[start])
    return groups


def _fold_rows(params: list[nn.Parameter], examples: int) -> None:
    """Sum per-row gradients into per-example ones where an example spans
    several encoder rows (MIMIC-III chunks, laid out example-major)."""
    for p in params:
        g = p.grad_sample
        if g is not None and g.shape[0] != examples:
            p.grad_sample = g.reshape(examples, g.shape[0] // examples, *g.shape[1:]).sum(1)


def _noise_only_step(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer, dp: DPSettings, batch_size: int
) -> None:
    # An empty Poisson batch still releases a noisy step: skipping it would
    # reveal that the batch was empty, which depends on membership.
    for p in params:
        p.grad = torch.normal(0.0, dp.noise_multiplier * dp.max_grad_norm, p.shape) / batch_size
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_private(
    model: nn.Module,
    task: Task,
    dataset: datasets.Dataset,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    epochs: int,
    dp: DPSettings,
    generator: np.random.Generator,
    extra_grad: Callable[[], None] | None = None,
    microbatch_overhead: int = MICROBATCH_OVERHEAD_TOKENS,
) -> tuple[list[EpochStats], str]:
    """DP-SGD over the trainable parameters of ``model``.

    Parameters
    ----------
    optimizer
        Built over the trainable parameters; wrapped here for the round.
    extra_grad
        Adds a data-independent gradient after clipping and noise (FedProx's
        proximal term), so it costs no privacy.
    microbatch_overhead
        Per-pass cost in tokens used to cut each sampled batch into
        length-grouped passes (see ``microbatches``); the step is the same.

    Returns
    -------
    (stats per epoch, clipping mode used)
    """
    params = [p for p in model.parameters() if p.requires_grad]
    mode = choose_clipping(model, task, dp.clipping)
    n = len(dataset)
    q = sample_rate(n, batch_size)
    lengths = np.asarray(dataset["n_tokens"])
    common = {
        "noise_multiplier": dp.noise_multiplier,
        "max_grad_norm": dp.max_grad_norm,
        "expected_batch_size": batch_size,
        "loss_reduction": "mean",
    }
    if mode == "ghost":
        hooks = GradSampleHooksFastGradientClipping(
            model, loss_reduction="sum", strict=False, max_grad_norm=dp.max_grad_norm
        )
        dp_optimizer = DPOptimizerFastGradientClipping(optimizer, **common)
    else:
        hooks = GradSampleHooks(model, loss_reduction="sum", strict=False)
        dp_optimizer = DPOptimizer(optimizer, **common)
    model.train()
    stats = []
    # With frozen embeddings no module input requires a gradient, and torch
    # warns on every backward hook; the per-example gradients are still right
    # (tests/test_privacy.py checks them against one-example backward passes).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        for _ in range(epochs):
            started = time.perf_counter()
            total_loss, tokens, steps = 0.0, 0, 0
            for _ in range(steps_per_epoch(n, batch_size)):
                dp_optimizer.zero_grad(set_to_none=True)
                idx = np.flatnonzero(generator.random(n) < q)
                if len(idx) == 0:
                    _noise_only_step(params, optimizer, dp, batch_size)
                    continue
                groups = microbatches(lengths[idx], microbatch_overhead)
                batch_loss = 0.0
                for number, group in enumerate(groups):
                    part = idx[group]
                    batch = task.collate(dataset[part.tolist()])
                    logits = model(**task.model_inputs(batch))
                    losses = task.example_losses(logits, batch)
                    if mode == "ghost":
                        DPTensorFastGradientClipping(hooks, dp_optimizer, losses, "sum").backward()
                    else:
                        losses.sum().backward()
                        _fold_rows(params, len(part))
                    last = number == len(groups) - 1
                    # Opacus's virtual steps: every pass but the last clips and
                    # adds into the running sum; the last adds noise once.
                    dp_optimizer.signal_skip_step(not last)
                    if dp_optimizer.pre_step():
                        if extra_grad is not None:
                            extra_grad()
                        optimizer.step()
                    elif not last:
                        dp_optimizer.zero_grad(set_to_none=True)
                    batch_loss += float(losses.detach().sum())
                    tokens += int(batch["attention_mask"].sum())
                total_loss += batch_loss / len(idx)
                steps += 1
            stats.append(
                EpochStats(total_loss / max(steps, 1), n, tokens, time.perf_counter() - started)
            )
    finally:
        dp_optimizer.zero_grad(set_to_none=True)
        hooks.cleanup()
    return stats, mode
