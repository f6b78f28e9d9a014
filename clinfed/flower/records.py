"""Engine messages and site replies in and out of Flower records.

The wire form is the transport-neutral codec of
:mod:`clinfed.federated.messages` (the in-process transport uses the same):
the tensors as one safetensors buffer, carried here in a single uint8 array
of an ArrayRecord (Flower moves every array as objects of its own, so a model
sent tensor by tensor, 217 objects for MiniLM, costs one transfer per object
at every hop, where one buffer costs one per 5 MB chunk); everything else as
one JSON string in a ConfigRecord, so nested values survive.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from clinfed.federated.messages import (
    Message,
    Reply,
    Wire,
    decode_message,
    decode_reply,
    encode_message,
    encode_reply,
)

PACKED = "safetensors"


def _records(wire: Wire) -> RecordDict:
    data, info = wire
    arrays = ArrayRecord()
    if data:
        arrays[PACKED] = Array(np.frombuffer(data, dtype=np.uint8))
    return RecordDict({"tensors": arrays, "info": ConfigRecord({"json": info})})


def _wire(content: RecordDict) -> Wire:
    arrays = content.array_records["tensors"]
    if set(arrays) - {PACKED}:
        raise ValueError("unexpected arrays beside the packed tensors")
    data = arrays[PACKED].numpy().tobytes() if PACKED in arrays else b""
    return data, str(content.config_records["info"]["json"])


def message_records(message: Message, run: Mapping[str, Any]) -> RecordDict:
    """A message with the run it belongs to (``run``: name and settings)."""
    return _records(encode_message(message, run))


def read_message(content: RecordDict) -> tuple[Message, dict[str, Any]]:
    return decode_message(_wire(content))


def reply_records(reply: Reply) -> RecordDict:
    return _records(encode_reply(reply))


def read_reply(content: RecordDict) -> Reply:
    return decode_reply(_wire(content))
