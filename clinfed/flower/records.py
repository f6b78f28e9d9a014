"""Tensors and settings in and out of Flower records.

Tensors travel in an ArrayRecord (Flower's own array transport); settings
and reports as one JSON string in a ConfigRecord, so nested values survive.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict


def to_records(tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> RecordDict:
    arrays = ArrayRecord(
        torch_state_dict={k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    )
    return RecordDict({"tensors": arrays, "info": ConfigRecord({"json": json.dumps(info)})})


def from_records(content: RecordDict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    arrays = content.array_records["tensors"]
    tensors = dict(arrays.to_torch_state_dict()) if len(arrays) else {}
    info = json.loads(str(content.config_records["info"]["json"]))
    if not isinstance(info, dict):
        raise ValueError("info is not a JSON object")
    return tensors, info
