"""Where a process computes: ``--device auto|cpu|cuda|cuda:N``.

A site or a simulator moves its model to its device once and each batch as
it is drawn; what leaves a process (uploads, checkpoints, digests, secure
aggregation's fixed-point sums) is always moved to the CPU first, so it is
the same bytes whatever device computed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from clinfed.core.errors import ClinfedError

DEVICES = "auto, cpu, cuda or cuda:N"


def resolve_device(spec: str = "auto") -> torch.device:
    """The device ``spec`` names on this machine; a :class:`ClinfedError`
    (one line, exit 2) for a device this machine does not have."""
    spec = str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        index = spec.partition(":")[2]
        if index and not index.isdigit():
            raise ClinfedError(f"`device` {spec}: expected {DEVICES}")
        if not torch.cuda.is_available():
            raise ClinfedError(
                f"`device` {spec}: this machine has no CUDA device that torch "
                f"{torch.__version__} can use; use `device` cpu (or auto)"
            )
        if index and int(index) >= torch.cuda.device_count():
            raise ClinfedError(
                f"`device` {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device(spec)
    raise ClinfedError(f"`device` {spec}: expected {DEVICES}")


def device_of(model: nn.Module) -> torch.device:
    """The device a model's parameters are on (CPU for a model without any)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """A collated batch with its tensors on ``device`` (other values as they are)."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def autocast(device: torch.device, precision: str):
    """The autocast context of ``precision`` (``fp32``: none) on ``device``."""
    return torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16"
    )


def use_threads(*choices: int | None) -> int:
    """Set torch's CPU thread count to the first choice given (a node's own,
    then the run's ``--threads``), else every core; returns it. The one
    place any runner sets it."""
    import os

    count = next((c for c in choices if c), None) or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count


# Share of the device's free memory a DP pass may fill with per-unit
# gradients; the rest holds the model, the optimizer and the activations.
PASS_MEMORY_SHARE = 0.5


def pass_units_for(model: nn.Module, free_bytes: int | None = None) -> int:
    """How many privacy units one DP pass may hold on ``model``'s device:
    0 (no cap) on the CPU; on CUDA, as many per-unit gradients of the
    trainable numbers (fp32) as fit in :data:`PASS_MEMORY_SHARE` of the free
    memory (``free_bytes``: measured when not given), at least 1. The step,
    and so the privacy, is the same whatever the cap."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    parameter = next(model.parameters(), None)
    if parameter is None or trainable == 0:
        return 0
    if free_bytes is None:
        if parameter.device.type != "cuda":
            return 0
        free_bytes, _ = torch.cuda.mem_get_info(parameter.device)
    return max(1, int(free_bytes * PASS_MEMORY_SHARE // (4 * trainable)))
