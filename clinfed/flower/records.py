"""Engine messages and site replies in and out of Flower records.

Tensors travel in an ArrayRecord (Flower's own array transport); everything
else as one JSON string in a ConfigRecord, so nested values survive.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from clinfed.federated.engine import Message, Reply


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


def message_records(message: Message, run: Mapping[str, Any]) -> RecordDict:
    """A message with the run it belongs to (``run``: name and settings)."""
    info = {
        "kind": message.kind,
        "round": message.round,
        "full": message.full,
        "evaluate": message.evaluate,
        "write_predictions": message.write_predictions,
        "strategy_state": message.strategy_state,
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
    )
    return message, dict(info["run"])


def reply_records(reply: Reply) -> RecordDict:
    info = {
        "site": reply.site,
        "record": reply.record,
        "evaluation": reply.evaluation,
        "ledger": reply.ledger,
    }
    return to_records(reply.upload, info)


def read_reply(content: RecordDict) -> Reply:
    tensors, info = from_records(content)
    if not isinstance(info.get("site"), str):
        raise ValueError("reply without a site name")
    return Reply(
        info["site"], tensors, info.get("record"), info.get("evaluation"), info.get("ledger")
    )
