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

:func:`make_private` returns the two things the one training loop
(``clinfed.modeling.training.run_epoch``) needs in place of its plain ones: the
steps (:class:`PoissonSteps`: which units each step draws, cut into passes)
and the update (:class:`PrivateStep`: per-unit clipping and noise before the
optimizer's step). Per round the plan decides which parameters train before
anything here runs; clipping is attached to exactly those, the round trains,
and :meth:`PrivateStep.detach` takes it off again, so the same model object
can serve the next site with another plan. Each step is exactly the
subsampled Gaussian mechanism the ledger accounts.

This package is a leaf: it knows tasks only as objects with
``example_losses``, and data only as row indices.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from clinfed.privacy.accountants import Mechanism
from clinfed.privacy.clipping import CLIPPERS, CLIPPINGS, choose_clipping
from clinfed.privacy.noise import add_noise, noise_only_step
from clinfed.privacy.randomness import SiteRandomness
from clinfed.privacy.sampler import PoissonSampler, sample_rate, steps_per_epoch

__all__ = [
    "CLIPPINGS",
    "MICROBATCH_OVERHEAD_TOKENS",
    "DPSettings",
    "PoissonSteps",
    "PrivateStep",
    "choose_clipping",
    "make_private",
    "microbatches",
    "round_mechanism",
    "sample_rate",
    "steps_per_epoch",
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
    population
        Under add/remove neighbours, the site's released noisy count: the
        sampling rate, the steps and the aggregation weight derive from it
        (:mod:`clinfed.privacy.count`); ``None``: the exact count.
    """

    noise_multiplier: float
    max_grad_norm: float = 1.0
    clipping: str = "auto"
    reproducible: bool = False
    unit: str = "example"
    batch_size: int | None = None
    lr_scale: float = 1.0
    population: int | None = None


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


def microbatches(lengths: np.ndarray, overhead_tokens: int, max_units: int = 0) -> list[np.ndarray]:
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
    widest = max_units if max_units > 0 else n
    for start in range(n - 1, -1, -1):  # a group starting here pads to longest[start]
        sizes = np.arange(1, min(n - start, widest) + 1)
        totals = overhead_tokens + sizes * longest[start] + cost[start + sizes]
        best = len(totals) - 1 - int(np.argmin(totals[::-1]))  # ties: fewer passes
        cost[start], cut[start] = totals[best], start + sizes[best]
    groups, start = [], 0
    while start < n:
        groups.append(order[start : cut[start]])
        start = int(cut[start])
    return groups


class PoissonSteps:
    """DP-SGD's steps over one site's privacy units, an epoch at a time.

    Each step draws a Poisson batch of units from the site's secret sampling
    generator (every unit joins with probability ``batch_size / n``, as the
    accountant assumes) and cuts it into length-grouped passes
    (:func:`microbatches`). A step is ``(passes, units, units)`` with each
    pass ``(rows, owner, closes)``: the dataset rows it runs, the unit of
    each row, and whether it closes its units. Whole units (``split_units``
    off) run in passes of their own, owners numbered from 0 in each, each
    pass closing its units; a pass pads to its longest row, so a unit costs
    like its longest row. With ``split_units`` (clipping that carries a unit
    across passes), the drawn units' rows are grouped by length whatever
    their unit: the units of up to ``max_pass_units`` at a time, numbered
    from 0 across their passes, the last of which closes them. A draw with
    no unit is a step with no pass (the loop steps on noise alone).
    """

    def __init__(
        self,
        units: Sequence[np.ndarray],
        row_lengths: np.ndarray,
        batch_size: int,
        sampling: np.random.Generator,
        microbatch_overhead: int = MICROBATCH_OVERHEAD_TOKENS,
        population: int | None = None,
        max_pass_units: int = 0,
        split_units: bool = False,
    ):
        self.units = list(units)
        self.sampler = PoissonSampler(len(self.units), batch_size, sampling, population)
        self.row_lengths = np.asarray(row_lengths)
        self.lengths = np.asarray([self.row_lengths[rows].max() for rows in self.units])
        self.overhead = microbatch_overhead
        self.max_pass_units = max_pass_units
        self.split_units = split_units

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[list[tuple[np.ndarray, torch.Tensor, bool]], int, int]]:
        for _ in range(self.sampler.steps_per_epoch):
            idx = self.sampler.draw()
            passes = []
            if len(idx) and self.split_units:
                passes = self._split(idx)
            elif len(idx):
                for group in microbatches(self.lengths[idx], self.overhead, self.max_pass_units):
                    rows, owner = self._rows(idx[group])
                    passes.append((rows, owner, True))
            yield passes, len(idx), len(idx)

    def _rows(self, drawn: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The rows of ``drawn`` units and the unit of each, numbered from 0."""
        members = [self.units[u] for u in drawn]
        sizes = torch.tensor([len(m) for m in members])
        return np.concatenate(members), torch.repeat_interleave(torch.arange(len(members)), sizes)

    def _split(self, idx: np.ndarray) -> list[tuple[np.ndarray, torch.Tensor, bool]]:
        # Longest units first, so a capped group holds units of like length.
        order = idx[np.argsort(-self.lengths[idx], kind="stable")]
        cap = self.max_pass_units if self.max_pass_units > 0 else len(order)
        passes = []
        for start in range(0, len(order), cap):
            rows, owner = self._rows(order[start : start + cap])
            cuts = microbatches(self.row_lengths[rows], self.overhead)
            for number, cut in enumerate(cuts):
                passes.append((rows[cut], owner[torch.as_tensor(cut)], number == len(cuts) - 1))
        return passes


class PrivateStep:
    """One round's DP-SGD machinery on a model: clipping attached to the
    trainable parameters and the optimizer wrapped to noise and step.

    The update of ``clinfed.modeling.training.run_epoch`` under DP: :meth:`loss` is
    each example's loss, :meth:`backward` clips every pass of a drawn batch
    into the step's sum, :meth:`step` steps on the noisy sum after its last
    pass, :meth:`empty` steps on noise alone for an empty batch, and
    :meth:`detach` takes the machinery off when the round is over.
    """

    precision = "fp32"  # the clipped sums and the noise are exact fp32

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        mode: str,
        dp: DPSettings,
        expected_batch: int,
        noise: torch.Generator,
        extra_grad: Callable[[], None] | None = None,
    ):
        self.mode, self.dp, self.expected_batch = mode, dp, expected_batch
        self.noise = noise
        self.optimizer = optimizer
        self.extra_grad = extra_grad
        self.ready = False
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
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

    def loss(self, task: Any, outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each example's loss (``task.example_losses``): clipping needs them apart."""
        return task.example_losses(outputs, batch)

    def backward(
        self, losses: torch.Tensor, owner: torch.Tensor | None, last: bool, closes: bool = True
    ) -> None:
        """Clip the per-unit gradients of the units this pass closes
        (``owner[i]``: the unit of example ``i``; see :class:`PoissonSteps`)
        into the step's sum (every pass but the last accumulates; the last
        adds the noise once)."""
        if owner is None:
            owner = torch.arange(len(losses), device=losses.device)
        self.clipper.backward(losses, self.dp_optimizer, owner, closes)
        if self.dp_optimizer is None:  # the clipper summed into .grad itself
            if last:
                add_noise(
                    self.params,
                    self.dp.noise_multiplier,
                    self.dp.max_grad_norm,
                    self.expected_batch,
                    self.noise,
                )
            self.ready = last
            return
        # Opacus's virtual steps.
        self.dp_optimizer.signal_skip_step(not last)
        self.ready = self.dp_optimizer.pre_step()
        if not self.ready and not last:
            self.dp_optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """The optimizer step on the noisy mean, plus a data-independent
        gradient (FedProx's proximal term) that costs no privacy."""
        if not self.ready:
            return
        self.ready = False
        if self.extra_grad is not None:
            self.extra_grad()
        self.optimizer.step()

    def empty(self) -> None:
        """The step of an empty Poisson draw: noise alone."""
        self.noise_only()

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
    units: Sequence[np.ndarray],
    row_lengths: np.ndarray,
    dp: DPSettings,
    batch_size: int,
    randomness: SiteRandomness,
    one_row_per_example: bool = True,
    extra_grad: Callable[[], None] | None = None,
    microbatch_overhead: int = MICROBATCH_OVERHEAD_TOKENS,
    max_pass_units: int = 0,
) -> tuple[PoissonSteps, PrivateStep]:
    """DP-SGD's steps and update for the parameters trainable now, in place
    of the plain ones of ``clinfed.modeling.training.run_epoch``.

    Parameters
    ----------
    units
        The dataset rows of each privacy unit (a site's sampling rate and
        accounting are over these).
    row_lengths
        Tokens of each dataset row (to cut a drawn batch into passes).
    batch_size
        The expected Poisson batch, in units.
    randomness
        The site's privacy-protecting randomness: Poisson sampling and noise
        (secret unless ``dp.reproducible``; see ``clinfed.privacy.randomness``).
    one_row_per_example
        Whether a model row is a whole example (token tasks: yes; chunked
        notes: no): ghost clipping needs it.
    extra_grad
        Adds a data-independent gradient after clipping and noise (FedProx's
        proximal term), so it costs no privacy.
    microbatch_overhead
        Per-pass cost in tokens used to cut each sampled batch into
        length-grouped passes (see :func:`microbatches`); the step is the same.
    max_pass_units
        At most this many units in one pass, or carried across passes
        together (0: no cap), to fit the accelerator's memory; the step is
        the same.
    """
    units = list(units)
    grouped = any(len(rows) > 1 for rows in units)
    mode = choose_clipping(model, dp.clipping, one_row_per_example, grouped)
    steps = PoissonSteps(
        units,
        row_lengths,
        batch_size,
        randomness.sampling,
        microbatch_overhead,
        dp.population,
        max_pass_units,
        # A note's (a patient's) rows vary in length: padded to its longest
        # in one pass they cost 3x their tokens, so with clipping that can
        # carry a unit across passes they run with other units' rows of
        # their length. A sentence's windows are all about as long.
        split_units=CLIPPERS[mode].carries_units and dp.unit != "example",
    )
    # With frozen embeddings no module input requires a gradient, and torch
    # warns on every backward hook; the per-example gradients are still right
    # (tests/test_privacy.py checks them against one-example backward passes).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    update = PrivateStep(model, optimizer, mode, dp, batch_size, randomness.noise, extra_grad)
    return steps, update
