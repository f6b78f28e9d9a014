"""Optimizers for DP-SGD's noisy averaged gradient (``--optimizer``).

Each private step hands the optimizer ``g + z``: the mean of the batch's
clipped gradients plus Gaussian noise whose standard deviation on every
coordinate is ``s = sigma * C / B`` (noise multiplier, clip norm,
expected batch). The noise is known to the site, so an optimizer can take
it into account:

* ``adamw`` (the default): AdamW as without DP. Where the noise dominates a
  coordinate, Adam's second moment tracks ``s**2`` and each step
  moves it by about the rate in a random direction.
* ``adambc``: DP-AdamBC (Tang et al. 2024, "DP-AdamBC: your DP-Adam is
  actually DP-SGD (unless you apply bias correction)"): Adam with the
  noise's variance taken out of the second moment, ``max(v - s**2,
  floor)``, so the denominator estimates the signal's scale alone.
* ``sgd``: SGD with momentum 0.9 at Adam-equivalent rates: each rate is
  multiplied by ``(1 - momentum) / s``, the step Adam takes where
  the noise dominates (then ``--lr`` means the same under either).

All three see only the noised gradient and public settings, so the choice
costs no privacy. Measured against each other in docs/results.md
("Private models").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from clinfed.privacy.noise import noise_std

OPTIMIZERS = ("adamw", "adambc", "sgd")
SGD_MOMENTUM = 0.9
# DP-AdamBC's floor on the corrected second moment, as a share of the noise
# variance: the estimate of v from a round's few dozen steps is itself
# noisy (relative error about sqrt(2 / steps)), and a floor far below the
# noise variance would let that error blow up the steps of the coordinates
# that carry no signal.
ADAMBC_FLOOR = 0.1


def mean_noise_std(noise_multiplier: float, max_grad_norm: float, expected_batch: int) -> float:
    """Standard deviation of the noise on each coordinate of the averaged
    step: the sum's (:func:`clinfed.privacy.noise.noise_std`) over the batch."""
    return noise_std(noise_multiplier, max_grad_norm) / max(1, expected_batch)


class DPAdamBC(torch.optim.Optimizer):
    """AdamW whose second moment has the DP noise's variance subtracted.

    Parameters
    ----------
    params
        Parameters or parameter groups, as any torch optimizer.
    noise_variance
        ``s**2`` of the averaged step (:func:`mean_noise_std`).
    lr, betas, eps, weight_decay
        As :class:`torch.optim.AdamW` (decoupled weight decay).
    floor
        The corrected second moment is at least ``floor * noise_variance``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        noise_variance: float,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        floor: float = ADAMBC_FLOOR,
    ):
        if noise_variance <= 0:
            raise ValueError("DP-AdamBC needs the noise's variance (a DP run)")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.noise_variance = noise_variance
        self.floor = floor * noise_variance

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("DPAdamBC takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(param)
                    state["v"] = torch.zeros_like(param)
                state["step"] += 1
                t, m, v = state["step"], state["m"], state["v"]
                grad = param.grad
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                # The bias correction of Adam, then the noise's variance out.
                v_hat = (v / (1 - beta2**t) - self.noise_variance).clamp_(min=self.floor)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.addcdiv_(m_hat, v_hat.sqrt_().add_(group["eps"]), value=-group["lr"])


def private_optimizer(
    kind: str,
    groups: list[dict[str, Any]],
    weight_decay: float,
    noise: float,
) -> torch.optim.Optimizer:
    """The ``adambc`` or ``sgd`` optimizer over ``groups`` (each with its
    Adam-scale ``lr``), for a step whose noise has std ``noise`` per coordinate."""
    if kind == "adambc":
        return DPAdamBC(groups, noise**2, weight_decay=weight_decay)
    if kind == "sgd":
        scaled = [g | {"lr": g["lr"] * (1 - SGD_MOMENTUM) / noise} for g in groups]
        # No weight decay: at these rates it would be the noise scale's, not the rate's.
        return torch.optim.SGD(scaled, momentum=SGD_MOMENTUM)
    raise ValueError(f"unknown DP optimizer {kind!r}; one of {', '.join(OPTIMIZERS)}")
