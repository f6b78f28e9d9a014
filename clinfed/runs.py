"""Run folders: atomic writes, the resolved config, ``metrics.jsonl``.

Every file is written to a temporary name in the same folder, flushed, fsynced
and renamed over the target, so a kill at any moment leaves either the old
file or the new one, never a torn one. ``metrics.jsonl`` is append-only.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clinfed.errors import ClinfedError


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_jsonl(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON object as one line, fsynced before returning."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (a crash mid-append) is ignored."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for raw in fh:
            if not raw.endswith("\n"):
                break
            records.append(json.loads(raw))
    return records


def ensure_new_run_folder(path: Path | str) -> None:
    """Refuse a run folder that already holds files.

    Refusing, rather than overwriting, means a mistyped ``--out`` can never
    damage an earlier run.
    """
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ClinfedError(
            f"{path}: run folder already exists and is not empty; choose a new --out"
        )


def create_run_folder(path: Path | str) -> Path:
    """Create a new, empty run folder (see :func:`ensure_new_run_folder`)."""
    ensure_new_run_folder(path)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path
