"""The client update: one site's local training under a plan.

The same function serves the in-process simulator and (later) the Flower
ClientApp, so both produce the same update from the same inputs.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from torch import nn

from clinfed.federated.plan import Plan
from clinfed.privacy.dpsgd import DPSettings, train_private
from clinfed.tasks.base import Task
from clinfed.training import EpochStats, make_optimizer, train_epoch


@dataclass
class LocalSettings:
    """How a site trains in one round."""

    epochs: int = 1
    batch_size: int = 16
    lr: float = 1e-4
    head_lr: float | None = None
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0


@dataclass
class ClientResult:
    upload: dict[str, torch.Tensor]
    num_examples: int
    stats: list[EpochStats]
    seconds: float
    trainable_params: int
    clipping: str | None = None  # DP-SGD's clipping mode, None without DP

    def record(self, round_number: int, site: str, bytes_up: int) -> dict[str, Any]:
        """The site's line of ``metrics.jsonl`` for this round (both runners)."""
        record = {
            "round": round_number,
            "client": site,
            "bytes_up": bytes_up,
            "trainable_params": self.trainable_params,
            "uploaded_params": sum(t.numel() for t in self.upload.values()),
            "examples": self.num_examples,
            "train_tokens": sum(s.tokens for s in self.stats),
            "wall_s": round(self.seconds, 3),
        }
        if self.clipping is None:
            # The training loss is computed on private examples; under DP it
            # is not released (it is not covered by the accounting).
            record["train_loss"] = self.stats[-1].loss
        return record


def site_key(site: str) -> int:
    """A stable integer for a site name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(site.encode("utf-8")).digest()[:8], "little")


def site_generator(seed: int, round_number: int, site: str) -> np.random.Generator:
    """The random stream of ``site`` in round ``round_number``; also seeds torch.

    Data order and Poisson sampling draw from the returned generator, dropout
    and DP-SGD noise from torch's, seeded here from it. Both depend on
    (seed, round, site) only, so a site computes the same update whichever
    runner drives it (simulator or Flower), in whatever order sites run, and
    after any restart.
    """
    generator = np.random.default_rng([seed, round_number, site_key(site)])
    torch.manual_seed(int(generator.integers(2**62)))
    return generator


def apply_plan(model: nn.Module, plan: Plan) -> int:
    """Freeze everything the plan does not train; return the trainable count.

    Decided before the optimizer is built, each round, so the optimizer (and
    later the DP wrapper) only ever sees the planned parameters.
    """
    count = 0
    for name, param in model.named_parameters():
        param.requires_grad_(name in plan.trainable)
        count += param.numel() if name in plan.trainable else 0
    return count


def client_update(
    model: nn.Module,
    task: Task,
    dataset: datasets.Dataset,
    plan: Plan,
    settings: LocalSettings,
    generator: np.random.Generator,
    dp: DPSettings | None = None,
) -> ClientResult:
    """Train ``model`` (already holding the weights the site starts from) on
    ``dataset`` under ``plan``; return the planned upload.

    The optimizer is fresh every round, so nothing but the weights carries
    over from one round to the next (as in FedAvg). With ``dp``, every
    trainable parameter trains under DP-SGD (``clinfed.privacy.dpsgd``).
    """
    started = time.perf_counter()
    trainable = apply_plan(model, plan)
    optimizer = make_optimizer(model, settings.lr, settings.weight_decay, settings.head_lr)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    anchor = {}
    if plan.proximal_mu > 0:
        anchor = {n: p.detach().clone() for n, p in params}
    mu = plan.proximal_mu
    clipping = None
    if dp is not None:

        def extra_grad() -> None:
            # The proximal gradient mu * (w - w_global) uses no data.
            with torch.no_grad():
                for n, p in params:
                    p.grad.add_(p - anchor[n], alpha=mu)

        stats, clipping = train_private(
            model,
            task,
            dataset,
            optimizer,
            settings.batch_size,
            settings.epochs,
            dp,
            generator,
            extra_grad if anchor else None,
        )
    else:
        extra_loss = None
        if anchor:

            def extra_loss() -> torch.Tensor:
                return mu / 2 * sum(((p - anchor[n]) ** 2).sum() for n, p in params)

        stats = [
            train_epoch(
                model,
                task,
                dataset,
                optimizer,
                settings.batch_size,
                generator,
                max_grad_norm=settings.max_grad_norm,
                extra_loss=extra_loss,
            )
            for _ in range(settings.epochs)
        ]
    upload = {n: p.detach().clone() for n, p in model.named_parameters() if n in plan.uploaded}
    return ClientResult(
        upload, len(dataset), stats, time.perf_counter() - started, trainable, clipping
    )
