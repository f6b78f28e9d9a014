"""Durable files: what the ledger (and every run folder) is written with.

Every file is written to a temporary name in the same folder, flushed,
fsynced and renamed over the target, so a kill at any moment leaves either
the old file or the new one, never a torn one. JSON-lines files are
append-only, each line fsynced before the call returns; a torn last line (a
crash mid-append) is ignored when read.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from clinfed.privacy.errors import PrivacyError


def fsync_folder(folder: Path) -> None:
    """fsync a folder, so the names created in it survive a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError raised while writing ``path`` names it (a full disk says
    "No space left on device" without a file name)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename."""
    with _naming(Path(path)):
        _atomic_write_bytes(Path(path), data)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
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
    fsync_folder(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_jsonl(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON object as one line, fsynced before returning."""
    with _naming(Path(path)), open(path, "a", encoding="utf-8") as fh:
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


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, busy: str) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``lock_path`` (created 0600) while
    the block runs; another holder makes it a PrivacyError saying ``busy``.
    The lock ends with the process, so a crash never leaves it held."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise PrivacyError(f"{lock_path.parent}: cannot write here ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrivacyError(busy) from None
        yield
    finally:
        os.close(fd)  # releases the lock
