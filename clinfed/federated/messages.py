"""What travels between the server and a site, and its one wire form.

:class:`Message` (server to site) and :class:`Reply` (site to server) are the
same for every transport. The codec here turns either into its wire form:
the tensors as one safetensors buffer (:mod:`clinfed.core.payload`, the
bytes the engine counts) and everything else as one JSON object. The
in-process transport passes every message and reply through it and back, and
Flower carries the same two parts in its records
(:mod:`clinfed.flower.records`), so a site sees exactly the same message,
and the server exactly the same reply, on either transport.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from clinfed.core import payload
from clinfed.privacy.releases import check_reply


@dataclass
class Message:
    """What the server sends one site.

    Attributes
    ----------
    kind
        ``train`` or ``evaluate``.
    round
        The round being run; the download is global round ``round - 1``.
    download
        Tensors to load (the whole model when ``full``, else to overlay).
    evaluate
        Evaluate the received model first (the previous round's record).
    write_predictions
        Write predictions of the received model where the site keeps them.
    strategy_state
        The strategy's JSON state (FedFrozen's freeze round).
    base
        For a partial download: the global round of the site's copy it
        overlays (everything that changed since then is in the download);
        0 is the run's starting model, which every site builds itself from
        the run's configuration and seed.
    expect
        The digest of global round ``round - 1`` (:func:`payload.digest`):
        a site whose rebuilt copy does not match neither evaluates nor
        trains on it, and says so.
    secure
        Secure aggregation: on a ``train`` message, ``{"stage": "train"}``
        (keep the upload, reply with keys); on a ``secure`` message, the
        stage's request (:mod:`clinfed.federated.secure`).
    """

    kind: str
    round: int
    download: dict[str, torch.Tensor]
    full: bool
    evaluate: bool
    write_predictions: bool = False
    strategy_state: dict[str, Any] = field(default_factory=dict)
    secure: dict[str, Any] | None = None
    # A partial download overlays the site's copy of this global round.
    base: int | None = None
    expect: str | None = None


@dataclass(kw_only=True)
class Reply:
    """What a site sends back (``secure``: its part of a secure
    aggregation stage; ``upload`` then holds masked input, if any).
    Built with keywords only: which field is which is never a position."""

    site: str
    upload: dict[str, torch.Tensor] = field(default_factory=dict)
    record: dict[str, Any] | None = None  # training (or refusal) record; None: evaluated only
    evaluation: dict[str, Any] | None = None  # {"counts": {variant: counts}, "examples"}
    ledger: dict[str, Any] | None = None  # the site's privacy ledger, if it shares it
    secure: dict[str, Any] | None = None
    # Digest of the shared model the site rebuilt from the message (the
    # previous global round, if all went well); None for a model of its own.
    received: str | None = None
    # Whether the site trains under DP: the door then refuses what never
    # leaves a private site (clinfed.privacy.releases). Never sent.
    private: bool = field(default=True, compare=False)


class Transport(Protocol):
    """Moves messages; knows nothing of rounds, strategies or tasks."""

    def addresses(self) -> list[str]:
        """The sites reachable now (in-process: site names; Flower: node ids)."""

    def exchange(
        self, messages: Mapping[str, Message], timeout: float
    ) -> Iterator[tuple[str, Reply | str]]:
        """Send each address its message; yield ``(address, reply)`` as
        replies come, or ``(address, why)`` for one that did not (an error,
        a timeout)."""

    def release(self, round_number: int, sites: list[str]) -> dict[str, dict]:
        """When a site's privacy charge is released is the transport's to
        say: called as the engine is about to write round
        ``round_number``'s results, each of ``sites`` (those that trained)
        marks its charge released now, unless it did as its reply left.
        Returns each ledger's digest after it."""


class ReleasedAsReplies:
    """A transport whose sites release each reply as it leaves (a remote
    site, whose reply is out of its hands once sent): nothing left to mark."""

    def release(self, round_number: int, sites: list[str]) -> dict[str, dict]:
        del round_number, sites
        return {}


# ------------------------------------------------------------------ codec
Wire = tuple[bytes, str]  # (the tensors as one safetensors buffer, the rest as JSON)


def _pack(tensors: Mapping[str, torch.Tensor], info: Mapping[str, Any]) -> Wire:
    return (payload.encode(dict(tensors)) if tensors else b""), json.dumps(info)


def _unpack(wire: Wire) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    data, text = wire
    tensors = {}
    if data:
        try:
            tensors = payload.decode(bytes(data))
        except Exception as exc:  # safetensors' own error type: not a tensor buffer
            raise ValueError(f"the packed tensors do not parse ({type(exc).__name__})") from None
    info = json.loads(text)
    if not isinstance(info, dict):
        raise ValueError("info is not a JSON object")
    return tensors, info


def encode_message(message: Message, run: Mapping[str, Any] | None = None) -> Wire:
    """A message's wire form, with the run it belongs to (``run``: its name
    and settings, for a site that serves several runs)."""
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
        "run": dict(run or {}),
    }
    return _pack(message.download, info)


def decode_message(wire: Wire) -> tuple[Message, dict[str, Any]]:
    """A message and its run from their wire form."""
    tensors, info = _unpack(wire)
    message = Message(
        str(info["kind"]),
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
    return message, dict(info.get("run") or {})


def encode_reply(reply: Reply) -> Wire:
    """A reply's wire form, through the one door: every field is checked
    against :mod:`clinfed.privacy.releases` and nothing undeclared is sent."""
    info = {
        "site": reply.site,
        "record": reply.record,
        "evaluation": reply.evaluation,
        "ledger": reply.ledger,
        "secure": reply.secure,
        "received": reply.received,
    }
    check_reply(info | {"upload": sorted(reply.upload) or None}, reply.private, reply.site)
    return _pack(reply.upload, info)


def decode_reply(wire: Wire) -> Reply:
    tensors, info = _unpack(wire)
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
