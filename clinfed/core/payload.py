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


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over named tensors (names, dtypes, shapes, bytes) in name
    order: what a site proves it holds, and what the server checks it against."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        value = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{value.dtype}\0{tuple(value.shape)}\0".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
