"""Engine messages and site replies in and out of Flower records.

Tensors travel as one safetensors buffer (:mod:`clinfed.federated.payload`,
the bytes the engine counts) in a single uint8 array of an ArrayRecord:
Flower moves every array as objects of its own, so a model sent tensor by
tensor (217 objects for MiniLM) costs one transfer per object at every hop,
where one buffer costs one per 5 MB chunk. Everything else travels as one
JSON string in a ConfigRecord, so nested values survive.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from clinfed.federated import payload
from clinfed.federated.engine import Message, Reply

PACKED = "safetensors"


def to_records(tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> RecordDict:
    arrays = ArrayRecord()
    if tensors:
        packed = np.frombuffer(payload.encode(dict(tensors)), dtype=np.uint8)
        arrays[PACKED] = Array(packed)
    return RecordDict({"tensors": arrays, "info": ConfigRecord({"json": json.dumps(info)})})


def from_records(content: RecordDict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    arrays = content.array_records["tensors"]
    if set(arrays) - {PACKED}:
        raise ValueError("unexpected arrays beside the packed tensors")
    tensors = {}
    if PACKED in arrays:
        try:
            tensors = payload.decode(arrays[PACKED].numpy().tobytes())
        except Exception as exc:  # safetensors' own error type: not a tensor buffer
            raise ValueError(f"the packed tensors do not parse ({type(exc).__name__})") from None
    info = json.loads(str(content.config_records["info"]["json"]))
    if not isinstance(info, dict):
        raise ValueError("info is not a JSON object")
    return tensors, info


def message_records(message: Message, run: Mapping[str, Any]) -> RecordDict:
    """A message with the run it belongs to (``run``: name and settings)."""
    info = {
        "kind": message.kind,
        "round": message.round,
        "full": message.full,
        "evaluate": message.evaluate,
        "write_predictions": message.write_predictions,
        "strategy_state": message.strategy_state,
        "secure": message.secure,
        "base": message.base,
        "expect": message.expect,
        "run": dict(run),
    }
    return to_records(message.download, info)


def read_message(content: RecordDict) -> tuple[Message, dict[str, Any]]:
    tensors, info = from_records(content)
    message = Message(
        info["kind"],
        int(info["round"]),
        tensors,
        bool(info["full"]),
        bool(info["evaluate"]),
        bool(info["write_predictions"]),
        dict(info["strategy_state"]),
        info.get("secure"),
        info.get("base"),
        info.get("expect"),
    )
    return message, dict(info["run"])


def reply_records(reply: Reply) -> RecordDict:
    info = {
        "site": reply.site,
        "record": reply.record,
        "evaluation": reply.evaluation,
        "ledger": reply.ledger,
        "secure": reply.secure,
        "received": reply.received,
    }
    return to_records(reply.upload, info)


def read_reply(content: RecordDict) -> Reply:
    tensors, info = from_records(content)
    if not isinstance(info.get("site"), str):
        raise ValueError("reply without a site name")
    return Reply(
        site=info["site"],
        upload=tensors,
        record=info.get("record"),
        evaluation=info.get("evaluation"),
        ledger=info.get("ledger"),
        secure=info.get("secure"),
        received=info.get("received"),
    )
