"""The Gaussian noise of DP-SGD.

Opacus's DP optimizer adds ``N(0, (noise_multiplier * max_grad_norm)^2)`` to
the sum of clipped per-example gradients of each step and divides by the
expected batch size. One case it never sees is handled here: an empty
Poisson batch still releases a step of pure noise.
"""

from __future__ import annotations

import torch
from torch import nn


def noise_std(noise_multiplier: float, max_grad_norm: float) -> float:
    """Standard deviation of the noise added to a step's sum of clipped gradients."""
    return noise_multiplier * max_grad_norm


def noise_only_step(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch: int,
    generator: torch.Generator,
) -> None:
    """A step of noise alone, from the site's generator. Skipping an empty
    batch would reveal that it was empty, which depends on membership."""
    std = noise_std(noise_multiplier, max_grad_norm)
    for p in params:
        p.grad = torch.normal(0.0, std, p.shape, generator=generator) / expected_batch
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
