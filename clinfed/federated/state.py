"""Durable run state: what a run folder commits after every round.

The commit point is ``RUN/state.json``; everything it names is on disk and
fsynced before it is replaced (atomically), so a kill at any moment leaves
the previous commit or the new one::

    RUN/checkpoints/round-NNNN.safetensors   global weights after round N
    RUN/checkpoints/strategy-NNNN.safetensors  strategy tensors (FedAdam's moments)
    RUN/state.json   {"round", "checkpoint", "strategy_tensors", "strategy",
                      "sampling", "holds", "metrics_bytes", "ledgers", "schema"}

``holds`` is the server's view of which global round each site's copy holds
(so a resumed run sends sites in sync only what changed); ``metrics_bytes``
is the length of ``metrics.jsonl`` at the commit, to which a resumed run
cuts it back; ``ledgers`` each site ledger's length and SHA-256 as its site
last reported them, so a resumed run refuses a ledger that was deleted or
shortened. Site-owned state (each site's copy of the model, its
personal tensors, its ledger) lives with the site, not here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from clinfed.core.errors import ClinfedError
from clinfed.core.runs import atomic_write_bytes, atomic_write_json

log = logging.getLogger("clinfed.state")

STATE = "state.json"
SCHEMA = 2


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Safetensors written to a temporary file, fsynced, renamed, folder fsynced."""
    atomic_write_bytes(path, save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ClinfedError(f"{path}: unreadable or truncated weights ({exc})") from None


@dataclass
class RunState:
    """One commit of a federated run."""

    round: int
    checkpoint: str
    strategy: dict[str, Any]
    strategy_tensors: str | None
    sampling: dict[str, Any]
    holds: dict[str, int] = field(default_factory=dict)
    metrics_bytes: int = 0
    ledgers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per shared parameter, the round its global value last changed; per
    # recent round, the global model's digest (what a site's copy must match).
    changed: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    schema: int = SCHEMA
    # SHA-256 of what the commit covers: metrics.jsonl's first metrics_bytes
    # and config.json ("" in commits written before they were recorded).
    metrics_sha256: str = ""
    config_sha256: str = ""


def commit(
    out: Path,
    round_number: int,
    global_state: dict[str, torch.Tensor],
    strategy_state: dict[str, Any],
    strategy_tensors: dict[str, torch.Tensor],
    sampling: dict[str, Any],
    holds: dict[str, int],
    ledgers: dict[str, dict[str, Any]] | None = None,
    changed: dict[str, int] | None = None,
    digests: dict[str, str] | None = None,
) -> RunState:
    """Write round ``round_number``'s weights, then ``state.json``; drop
    what the previous commit named."""
    name = f"checkpoints/round-{round_number:04d}.safetensors"
    save_tensors(out / name, global_state)
    tensors_name = None
    if strategy_tensors:
        tensors_name = f"checkpoints/strategy-{round_number:04d}.safetensors"
        save_tensors(out / tensors_name, strategy_tensors)
    metrics = out / "metrics.jsonl"
    state = RunState(
        round_number,
        name,
        strategy_state,
        tensors_name,
        sampling,
        dict(holds),
        metrics.stat().st_size if metrics.exists() else 0,
        dict(ledgers or {}),
        dict(changed or {}),
        dict(digests or {}),
        metrics_sha256=_sha256(metrics) if metrics.exists() else "",
        config_sha256=_sha256(out / "config.json") if (out / "config.json").exists() else "",
    )
    atomic_write_json(out / STATE, asdict(state))
    keep = {Path(name).name, Path(tensors_name).name if tensors_name else None}
    for old in (out / "checkpoints").glob("*.safetensors"):
        if old.name not in keep:
            old.unlink()
    return state


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(out: Path) -> RunState:
    path = out / STATE
    if not path.is_file():
        raise ClinfedError(f"{out}: nothing to resume (no {STATE})")
    try:
        values = json.loads(path.read_text())
        state = RunState(**values)
    except (ValueError, TypeError) as exc:
        raise ClinfedError(f"{path}: not a clinfed run state ({exc})") from None
    if state.schema != SCHEMA:
        raise ClinfedError(f"{path}: state schema {state.schema}, this clinfed reads {SCHEMA}")
    return state


def cut_metrics(out: Path, size: int) -> None:
    """Drop what was appended to ``metrics.jsonl`` after the commit."""
    path = out / "metrics.jsonl"
    if path.exists() and path.stat().st_size > size:
        with open(path, "r+b") as fh:
            fh.truncate(size)
            fh.flush()
            os.fsync(fh.fileno())
