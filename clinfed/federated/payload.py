"""What travels: tensors serialized with safetensors, so bytes are measured."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes


def encode(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The wire form of a set of named tensors (safetensors bytes)."""
    return save_bytes({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def decode(data: bytes) -> dict[str, torch.Tensor]:
    return load_bytes(data)
