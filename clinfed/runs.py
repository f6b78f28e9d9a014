"""Run folders: atomic writes, the resolved config, ``metrics.jsonl``.

Every file is written to a temporary name in the same folder, flushed, fsynced
and renamed over the target, so a kill at any moment leaves either the old
file or the new one, never a torn one. ``metrics.jsonl`` is append-only.
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

from clinfed.errors import ClinfedError


def _fsync_dir(folder: Path) -> None:
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
    _fsync_dir(path.parent)


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


def ensure_new_run_folder(path: Path | str, what: str = "run folder") -> None:
    """Refuse a folder (``what``: a run folder, the predictions folder...)
    that already holds files, or a file in its place.

    Refusing, rather than overwriting, means a mistyped ``--out`` can never
    damage an earlier run.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ClinfedError(
            f"{path}: a file is there, not a folder; choose a new --out for the {what}"
        )
    if path.exists() and any(path.iterdir()):
        raise ClinfedError(
            f"{path}: already exists and is not empty; choose a new --out for the {what}"
        )


def create_run_folder(path: Path | str) -> Path:
    """Create a new, empty run folder (see :func:`ensure_new_run_folder`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if any(p.name != RUN_LOCK for p in path.iterdir()):
        ensure_new_run_folder(path)
    return path


RUN_LOCK = ".clinfed.lock"


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, busy: str) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``lock_path`` (created 0600) while
    the block runs; another holder makes it a ClinfedError saying ``busy``.
    The lock ends with the process, so a crash never leaves it held."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ClinfedError(f"{lock_path.parent}: cannot write here ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClinfedError(busy) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _refuse_if_used(path: Path) -> None:
    if any(p.name != RUN_LOCK for p in path.iterdir()):
        hint = (
            " (it died before its first round: --resume starts it over)"
            if (path / "config.json").is_file() and not (path / "state.json").exists()
            else ""
        )
        raise ClinfedError(
            f"{path}: run folder already exists and is not empty{hint}; choose a new --out"
        )


@contextlib.contextmanager
def claimed_run_folder(path: Path | str, resume: bool) -> Iterator[Path]:
    """Hold ``path`` as this process's run folder while the block runs.

    The check and the claim are one step: the folder is created (if new)
    and an exclusive ``fcntl`` lock taken on ``RUN/.clinfed.lock`` before
    anything else looks at it, so a second process writing the same folder
    (a second run on one ``--out``, two ``--resume`` at once) is refused
    with a clear message. A new run needs the folder empty (but for the
    lock). Hidden ``.*.tmp`` files that a killed process left behind are
    removed. If the block fails before it wrote anything, a folder it
    created is removed again: a failed start leaves nothing behind.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ClinfedError(f"{path}: not a folder; choose a new --out")
    if not resume and path.is_dir():
        _refuse_if_used(path)  # before the lock file is made: a refused folder is untouched
    created = not path.exists()
    lock_existed = (path / RUN_LOCK).exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClinfedError(f"{path}: cannot write the run folder ({exc.strerror})") from None
    busy = (
        f"{path}: another clinfed process is writing this run folder now; wait for it or "
        "choose another --out"
    )
    with exclusive_lock(path / RUN_LOCK, busy):
        if not resume:
            try:
                _refuse_if_used(path)  # again, under the lock: another process may have won
            except ClinfedError:
                if not lock_existed:
                    (path / RUN_LOCK).unlink(missing_ok=True)
                raise
        for stale in path.rglob(".*.tmp"):
            stale.unlink(missing_ok=True)  # a write a killed process never finished
        try:
            yield path
        except BaseException:
            if created and all(p.name == RUN_LOCK for p in path.iterdir()):
                (path / RUN_LOCK).unlink(missing_ok=True)
                path.rmdir()
            raise
