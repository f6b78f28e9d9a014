"""DP-SGD for one site's local training, composed from small parts like
Opacus's ``make_private``:

* :mod:`clinfed.privacy.sampler` - Poisson batches of privacy units (each
  unit joins with probability ``q = batch_size / n_units``);
* :mod:`clinfed.privacy.clipping` - per-unit clipping over all trainable
  parameters jointly (book-keeping, Opacus hooks, or ghost clipping): the gradient of a
  unit is the sum over all its rows (the windows of one i2b2 sentence; at
  ``--privacy-unit document`` or ``patient``, every example of the note or
  patient), clipped once;
* :mod:`clinfed.privacy.noise` - Gaussian noise of standard deviation
  ``noise_multiplier * max_grad_norm`` on each step's sum (Opacus's DP
  optimizer; a noise-only step for an empty batch);
* the optimizer step (the round's AdamW, wrapped for the round).

Per round the plan decides which parameters train before anything here
runs; :func:`make_private` attaches clipping to exactly those, the round
trains, and :meth:`PrivateStep.detach` takes it off again, so the same model
object can serve the next site with another plan. Each step is exactly the
subsampled Gaussian mechanism the ledger accounts.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn

from clinfed.device import device_of, to_device
from clinfed.privacy.accountants import Mechanism
from clinfed.privacy.clipping import CLIPPERS, CLIPPINGS, choose_clipping
from clinfed.privacy.noise import add_noise, noise_only_step
from clinfed.privacy.randomness import SiteRandomness
from clinfed.privacy.sampler import PoissonSampler, sample_rate, steps_per_epoch
from clinfed.tasks.base import Task
from clinfed.training import EpochStats

__all__ = [
    "CLIPPINGS",
    "MICROBATCH_OVERHEAD_TOKENS",
    "DPSettings",
    "PrivateStep",
    "choose_clipping",
    "make_private",
    "microbatches",
    "round_mechanism",
    "sample_rate",
    "steps_per_epoch",
    "train_private",
]


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
        ``auto``, ``bk``, ``hooks`` or ``ghost`` (see :mod:`clinfed.privacy.clipping`).
    reproducible
        Noise from the public seed: tests only, not private.
    unit
        The privacy unit (``example``, ``document``, ``patient``; see
        :meth:`clinfed.tasks.base.Task.unit_keys`).
    batch_size
        Expected Poisson batch in units (``None``: the run's ``--batch-size``);
        see :mod:`clinfed.privacy.recipe`.
    lr_scale
        Factor on the site's rates that goes with a derived batch.
    """

    noise_multiplier: float
    max_grad_norm: float = 1.0
    clipping: str = "auto"
    reproducible: bool = False
    unit: str = "example"
    batch_size: int | None = None
    lr_scale: float = 1.0


def unit_rows(task: Task, dataset: datasets.Dataset, unit: str) -> list[np.ndarray]:
    """The rows of each privacy unit of ``dataset`` (in first-seen order)."""
    index: dict[Any, int] = {}
    rows: list[list[int]] = []
    for row, key in enumerate(task.unit_keys(dataset, unit)):
        if key not in index:
            index[key] = len(rows)
            rows.append([])
        rows[index[key]].append(row)
    return [np.asarray(r, dtype=np.int64) for r in rows]


def count_units(task: Task, dataset: datasets.Dataset, unit: str) -> int:
    """How many privacy units ``dataset`` holds (what a site's sampling rate
    and accounting are over)."""
    return len(unit_rows(task, dataset, unit))


def round_mechanism(examples: int, batch_size: int, epochs: int, noise: float) -> Mechanism:
    """The DP-SGD mechanism of one round at one site."""
    return Mechanism(
        "dp-sgd",
        noise,
        sample_rate(examples, batch_size),
        epochs * steps_per_epoch(examples, batch_size),
    )


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


class PrivateStep:
    """One round's DP-SGD machinery on a model: clipping attached to the
    trainable parameters and the optimizer wrapped to noise and step.

    Use :meth:`backward` for every pass of a drawn batch, :meth:`step` after
    its last pass, :meth:`noise_only` for an empty batch, and
    :meth:`detach` when the round is over.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        mode: str,
        dp: DPSettings,
        expected_batch: int,
        noise: torch.Generator,
    ):
        self.mode, self.dp, self.expected_batch = mode, dp, expected_batch
        self.noise = noise
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.clipper = CLIPPERS[mode](model, dp.max_grad_norm)
        self.dp_optimizer = None
        if self.clipper.optimizer_class is not None:
            device = self.params[0].device if self.params else torch.device("cpu")
            if device.type != "cpu":
                # Opacus draws on the gradients' device: a generator there,
                # seeded from the site's secret one (as secret as it).
                seed = int(torch.randint(2**62, (1,), generator=noise))
                noise = torch.Generator(device=device)
                noise.manual_seed(seed)
            self.dp_optimizer = self.clipper.optimizer_class(
                optimizer,
                noise_multiplier=dp.noise_multiplier,
                max_grad_norm=dp.max_grad_norm,
                expected_batch_size=expected_batch,
                loss_reduction="mean",
                # The site's own generator, and Opacus's defence against
                # floating-point attacks on Gaussian sampling
                # (clinfed.privacy.randomness).
                generator=noise,
                secure_mode=True,
            )

    def zero_grad(self) -> None:
        if self.dp_optimizer is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.dp_optimizer.zero_grad(set_to_none=True)

    def backward(self, losses: torch.Tensor, owner: torch.Tensor, last: bool) -> bool:
        """Clip this pass's per-unit gradients (``owner[i]``: the unit of
        example ``i``, numbered from 0 in this pass) into the step's sum
        (every pass but the last accumulates; the last adds the noise once).
        Returns whether the step is ready."""
        self.clipper.backward(losses, self.dp_optimizer, owner)
        if self.dp_optimizer is None:  # the clipper summed into .grad itself
            if last:
                add_noise(
                    self.params,
                    self.dp.noise_multiplier,
                    self.dp.max_grad_norm,
                    self.expected_batch,
                    self.noise,
                )
            return last
        # Opacus's virtual steps.
        self.dp_optimizer.signal_skip_step(not last)
        ready = self.dp_optimizer.pre_step()
        if not ready and not last:
            self.dp_optimizer.zero_grad(set_to_none=True)
        return ready

    def step(self, extra_grad: Callable[[], None] | None = None) -> None:
        """The optimizer step on the noisy mean, plus a data-independent
        gradient (FedProx's proximal term) that costs no privacy."""
        if extra_grad is not None:
            extra_grad()
        self.optimizer.step()

    def noise_only(self) -> None:
        noise_only_step(
            self.params,
            self.optimizer,
            self.dp.noise_multiplier,
            self.dp.max_grad_norm,
            self.expected_batch,
            self.noise,
        )

    def detach(self) -> None:
        self.zero_grad()
        self.clipper.cleanup()


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    dp: DPSettings,
    expected_batch: int,
    noise: torch.Generator,
    grouped: bool = False,
) -> PrivateStep:
    """Attach per-unit clipping and noise (drawn from ``noise``) for the
    parameters trainable now (``grouped``: some unit spans several rows)."""
    mode = choose_clipping(model, task, dp.clipping, grouped)
    return PrivateStep(model, optimizer, mode, dp, expected_batch, noise)


def train_private(
    model: nn.Module,
    task: Task,
    dataset: datasets.Dataset,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    epochs: int,
    dp: DPSettings,
    randomness: SiteRandomness,
    extra_grad: Callable[[], None] | None = None,
    microbatch_overhead: int = MICROBATCH_OVERHEAD_TOKENS,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[list[EpochStats], str]:
    """DP-SGD over the trainable parameters of ``model``.

    Parameters
    ----------
    optimizer
        Built over the trainable parameters; wrapped here for the round.
    randomness
        The site's privacy-protecting randomness: Poisson sampling and noise
        (secret unless ``dp.reproducible``; see ``clinfed.privacy.randomness``).
    extra_grad
        Adds a data-independent gradient after clipping and noise (FedProx's
        proximal term), so it costs no privacy.
    microbatch_overhead
        Per-pass cost in tokens used to cut each sampled batch into
        length-grouped passes (see ``microbatches``); the step is the same.
    on_step
        Called after each step with (units in the batch, units expected over
        every epoch): a local progress bar, never released.

    Returns
    -------
    (stats per epoch, clipping mode used)
    """
    n = len(dataset)
    units = unit_rows(task, dataset, dp.unit)
    sampler = PoissonSampler(len(units), batch_size, randomness.sampling)
    row_lengths = np.asarray(dataset["n_tokens"])
    # A pass pads to its longest row: a unit costs like its longest row.
    lengths = np.asarray([row_lengths[rows].max() for rows in units])
    grouped = any(len(rows) > 1 for rows in units)
    private = make_private(model, optimizer, task, dp, batch_size, randomness.noise, grouped)
    model.train()
    device = device_of(model)
    stats = []
    # With frozen embeddings no module input requires a gradient, and torch
    # warns on every backward hook; the per-example gradients are still right
    # (tests/test_privacy.py checks them against one-example backward passes).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        for _ in range(epochs):
            started = time.perf_counter()
            total_loss, tokens, steps = 0.0, 0, 0
            for _ in range(sampler.steps_per_epoch):
                private.zero_grad()
                idx = sampler.draw()
                if len(idx) == 0:
                    private.noise_only()
                    if on_step is not None:
                        on_step(0, len(units) * epochs)
                    continue
                groups = microbatches(lengths[idx], microbatch_overhead)
                batch_loss = 0.0
                for number, group in enumerate(groups):
                    members = [units[u] for u in idx[group]]
                    part = np.concatenate(members)
                    owner = torch.repeat_interleave(
                        torch.arange(len(members)), torch.tensor([len(m) for m in members])
                    )
                    batch = to_device(task.collate(dataset[part.tolist()]), device)
                    owner = owner.to(device)
                    losses = task.example_losses(model(**task.model_inputs(batch)), batch)
                    if private.backward(losses, owner, last=number == len(groups) - 1):
                        private.step(extra_grad)
                    batch_loss += float(losses.detach().sum())
                    tokens += int(batch["attention_mask"].sum())
                total_loss += batch_loss / len(idx)
                if on_step is not None:
                    on_step(len(idx), len(units) * epochs)
                steps += 1
            stats.append(
                EpochStats(total_loss / max(steps, 1), n, tokens, time.perf_counter() - started)
            )
    finally:
        private.detach()
    return stats, private.mode
