"""The client update: one site's local training under a plan.

The same function serves every transport (the in-process one and Flower),
so a site computes the same update from the same inputs wherever it runs.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn

from clinfed.core.device import pass_units_for
from clinfed.federated.plan import Plan
from clinfed.modeling.training import (
    EpochStats,
    PlainUpdate,
    make_optimizer,
    plain_steps,
    run_epoch,
)
from clinfed.privacy.dpsgd import DPSettings, make_private
from clinfed.privacy.randomness import SiteRandomness
from clinfed.tasks.base import Task


@dataclass
class LocalSettings:
    """How a site trains in one round."""

    epochs: int = 1
    batch_size: int = 16
    lr: float = 1e-4
    head_lr: float | None = None
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"  # bf16 autocast for training without DP only
    # Under DP: at most this many units in one forward/backward pass (0: no
    # cap), to fit an accelerator's memory; the steps are the same.
    dp_pass_units: int = 0
    # ``linear``: the rates fall to zero over the run's ``rounds`` (see
    # :func:`decay_rates`); ``none`` keeps them.
    lr_decay: str = "none"
    rounds: int = 1


@dataclass
class LocalWork:
    """Everything one site's local procedure works with in one round.

    ``model`` already holds the weights the site starts from; ``personal``
    holds tensors the site keeps for itself between rounds (Ditto's personal
    model), which the procedure may replace.
    """

    model: nn.Module
    task: Task
    dataset: datasets.Dataset
    plan: Plan
    settings: LocalSettings
    generator: np.random.Generator
    dp: DPSettings | None = None
    personal: dict[str, torch.Tensor] = field(default_factory=dict)
    # Under DP: the site's secret sampling and noise (clinfed.privacy.randomness).
    randomness: SiteRandomness | None = None
    # Progress of the local training: (examples or units done in a step,
    # expected over the whole local training). Local display only.
    on_step: Callable[[int, int], None] | None = None
    round_number: int = 1


@dataclass
class ClientResult:
    upload: dict[str, torch.Tensor]
    # Privacy units trained on (sentences, admissions, notes, patients: never
    # rows, whose count depends on the window and the notes' lengths). It is
    # released and weighs the site's update in the aggregate.
    num_examples: int
    stats: list[EpochStats]
    seconds: float
    trainable_params: int
    clipping: str | None = None  # DP-SGD's clipping mode, None without DP

    def record(self, round_number: int, site: str, bytes_up: int) -> dict[str, Any]:
        """The site's line of ``metrics.jsonl`` for this round (every runner).

        Everything here is released; under DP the privacy layer filters it
        (``clinfed.privacy.site.release_filter``).
        """
        return {
            "round": round_number,
            "site": site,
            "bytes_up": bytes_up,
            "trainable_params": self.trainable_params,
            "uploaded_params": sum(t.numel() for t in self.upload.values()),
            "examples": self.num_examples,
            "train_tokens": sum(s.tokens for s in self.stats),
            "train_loss": self.stats[-1].loss if self.stats else None,
            "wall_s": round(self.seconds, 3),
        }


def _progress(
    on_step: Callable[[int, int], None] | None, total: int
) -> Callable[[int], None] | None:
    return None if on_step is None else (lambda done: on_step(done, total))


def site_key(site: str) -> int:
    """A stable integer for a site name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(site.encode("utf-8")).digest()[:8], "little")


def site_generator(seed: int, round_number: int, site: str) -> np.random.Generator:
    """The random stream of ``site`` in round ``round_number``; also seeds torch.

    Data order draws from the returned generator, dropout from torch's,
    seeded here from it. Both depend on (seed, round, site) only, so a site
    computes the same update whichever transport carries it, in whatever
    order sites run, and after any restart. This randomness is public: what
    protects privacy under DP (Poisson sampling, noise) comes from
    ``clinfed.privacy.randomness`` instead.
    """
    generator = np.random.default_rng([seed, round_number, site_key(site)])
    torch.manual_seed(int(generator.integers(2**62)))
    return generator


def apply_plan(model: nn.Module, plan: Plan) -> int:
    """Freeze everything the plan does not train; return the trainable count.

    Decided before the optimizer is built, each round, so the optimizer (and
    the DP wrapper) only ever sees the planned parameters.
    """
    count = 0
    for name, param in model.named_parameters():
        param.requires_grad_(name in plan.trainable)
        count += param.numel() if name in plan.trainable else 0
    return count


def _plain_steps(dataset: Any, settings: LocalSettings) -> int:
    return -(-len(dataset) // settings.batch_size)


def rate_factor(schedule: str, round_number: int, rounds: int, done: float) -> float:
    """The share of each rate in force after ``done`` (a share in [0, 1])
    of round ``round_number``'s local steps, in a run of ``rounds`` rounds.

    ``none`` keeps it at 1. ``linear`` falls from 1 to 0 over the run's
    planned steps: round ``r`` runs from ``1 - (r - 1) / R`` to ``1 - r / R``.
    ``cooldown`` keeps it at 1 until the last round, then falls from 1 to 0
    over that round's steps (a warm-up-stable-decay schedule without the
    warm-up): the early rounds move the model at the full rate, which a
    start far from the task needs, and the last one averages the noise of
    its steps instead of leaving the final ones at full weight.
    """
    rounds = max(rounds, round_number)
    if schedule == "linear":
        return max(0.0, 1.0 - (round_number - 1 + done) / rounds)
    if schedule == "cooldown" and round_number >= rounds:
        return max(0.0, 1.0 - done)
    return 1.0


def decay_rates(
    optimizer: torch.optim.Optimizer, settings: LocalSettings, round_number: int, steps: int
) -> None:
    """Scale every rate of ``optimizer`` after each of its ``steps`` local
    steps of round ``round_number`` by :func:`rate_factor` under
    ``settings.lr_decay``.

    Under DP-SGD each step's noise is fixed while the model nears a
    minimum: smaller late steps average the noise over more of them
    instead of letting it move the model at full rate (benchmarks/results/NOTEBOOK.md,
    "Levers")."""
    if settings.lr_decay == "none" or steps == 0:
        return
    base = [group["lr"] for group in optimizer.param_groups]
    done = 0

    def set_rates() -> None:
        factor = rate_factor(settings.lr_decay, round_number, settings.rounds, done / steps)
        for group, rate in zip(optimizer.param_groups, base, strict=True):
            group["lr"] = rate * factor

    def after_step(*_: Any) -> None:
        nonlocal done
        done += 1
        set_rates()

    set_rates()
    optimizer.register_step_post_hook(after_step)


def client_update(work: LocalWork, objective: Any = None) -> ClientResult:
    """Train ``work.model`` on ``work.dataset`` under ``work.plan``; return
    the planned upload. Under DP ``work.randomness`` must be set.

    The optimizer is fresh every round, so nothing but the weights carries
    over from one round to the next (as in FedAvg). With ``work.dp``, every
    trainable parameter trains under DP-SGD (``clinfed.privacy.dpsgd``).
    ``objective`` (a :class:`~clinfed.federated.strategies.base.Objective`)
    adds a data-independent term, built after the plan is applied so it
    covers exactly the trainable parameters.
    """
    started = time.perf_counter()
    model, settings = work.model, work.settings
    trainable = apply_plan(model, work.plan)
    if callable(objective):
        objective = objective()
    # Under DP the site's policy may derive its batch and scale its rates
    # from its size (clinfed.privacy.recipe).
    dp = work.dp
    scale = dp.lr_scale if dp is not None else 1.0
    head_lr = settings.head_lr * scale if settings.head_lr is not None else None
    optimizer = make_optimizer(model, settings.lr * scale, settings.weight_decay, head_lr)
    unit = dp.unit if dp is not None else "example"
    units = work.task.unit_rows(work.dataset, unit)
    if dp is not None:
        # DP-SGD wraps the one loop: Poisson steps over the site's privacy
        # units and a private update (per-unit clipping, then noise).
        if work.randomness is None:
            raise ValueError("DP-SGD needs the site's randomness (LocalWork.randomness)")
        steps, update = make_private(
            model,
            optimizer,
            units,
            np.asarray(work.dataset["n_tokens"]),
            dp,
            dp.batch_size or settings.batch_size,
            work.randomness,
            one_row_per_example=work.task.one_row_per_example,
            # What a private step adds after its noise: the strategy's
            # data-independent term (FedProx's proximal gradient), no privacy.
            extra_grad=objective.grad if objective is not None else None,
            # Not given: sized from the device's free memory (0 on the CPU).
            max_pass_units=settings.dp_pass_units or pass_units_for(model),
        )
        # Each pass over the Poisson steps draws a fresh epoch of batches.
        epochs = [steps] * settings.epochs
        total = len(units) * settings.epochs
    else:
        update = PlainUpdate(
            model,
            optimizer,
            max_grad_norm=settings.max_grad_norm,
            extra_loss=objective.loss if objective is not None else None,
            precision=settings.precision,
        )
        # Each epoch draws its order from the generator when it starts.
        epochs = (
            plain_steps(work.dataset, settings.batch_size, work.generator)
            for _ in range(settings.epochs)
        )
        total = len(work.dataset) * settings.epochs
    planned_steps = len(steps) if dp is not None else _plain_steps(work.dataset, settings)
    decay_rates(optimizer, settings, work.round_number, planned_steps * settings.epochs)
    try:
        progress = _progress(work.on_step, total)
        stats = []
        for steps_of_epoch in epochs:
            stats.append(
                run_epoch(model, work.task, work.dataset, steps_of_epoch, update, progress)
            )
    finally:
        if dp is not None:
            update.detach()
    clipping = update.mode if dp is not None else None
    upload = {n: p.detach().clone() for n, p in model.named_parameters() if n in work.plan.uploaded}
    # The aggregation weight: under add/remove the site's released noisy
    # count (clinfed.privacy.count), never the exact one.
    weight = dp.population if dp is not None and dp.population is not None else len(units)
    return ClientResult(upload, weight, stats, time.perf_counter() - started, trainable, clipping)
