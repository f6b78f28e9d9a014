"""Run folders: atomic writes, the resolved config, ``metrics.jsonl``.

Every file is written to a temporary name in the same folder, flushed, fsynced
and renamed over the target, so a kill at any moment leaves either the old
file or the new one, never a torn one. ``metrics.jsonl`` is append-only.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path

from clinfed.core.errors import USER_ERRORS, ClinfedError

# The ledger's durable writes serve every file of a run folder.
from clinfed.privacy.durable import (  # noqa: F401
    append_jsonl,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    exclusive_lock,
    read_jsonl,
)


def read_user_file(path: Path | str, what: str, encoding: str = "utf-8") -> str:
    """The text of a file the user named (``what``: how to name it in an
    error, e.g. ``--config FILE``). A FIFO, device or folder is refused
    before anything blocks on it: the file is opened without blocking and
    checked to be a regular file before it is read."""
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ClinfedError(f"{what}: cannot read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ClinfedError(f"{what}: not a regular file (a FIFO, device or folder)")
        data = fh.read()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError:
        raise ClinfedError(f"{what}: not {encoding.upper()} text") from None


def site_keyed(record: dict) -> dict:
    """A ``metrics.jsonl`` record with its site under ``site``: records
    written before the word was ``site`` everywhere name it ``client``."""
    if "client" in record and "site" not in record:
        record = dict(record)
        record["site"] = record.pop("client")
    return record


def ensure_outside(out: Path | str, data: Path | str, flag: str = "`data`") -> None:
    """Refuse an output folder that is, or lies inside, an input folder: what
    a command writes there (predictions, a converted corpus, a model) would
    become part of the corpus the next run reads."""
    out_path, data_path = Path(out).resolve(), Path(data).resolve()
    if out_path == data_path or data_path in out_path.parents:
        raise ClinfedError(
            f"`out` {out} is inside {flag} {data}: choose a folder outside it (what is "
            "written there would become part of what is read)"
        )


def ensure_new_run_folder(
    path: Path | str, what: str = "run folder", inputs: dict[str, Path | str] | None = None
) -> None:
    """Refuse a folder (``what``: a run folder, the predictions folder...)
    that already holds files, or a file in its place, or that lies inside
    one of ``inputs`` (``{flag: folder}``, :func:`ensure_outside`).

    Refusing, rather than overwriting, means a mistyped ``--out`` can never
    damage an earlier run or a corpus.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ClinfedError(
            f"{path}: a file is there, not a folder; choose a new `out` for the {what}"
        )
    if path.exists() and any(path.iterdir()):
        raise ClinfedError(
            f"{path}: already exists and is not empty; choose a new `out` for the {what}"
        )
    for flag, folder in (inputs or {}).items():
        ensure_outside(path, folder, flag)


def create_run_folder(path: Path | str) -> Path:
    """Create a new, empty run folder (see :func:`ensure_new_run_folder`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if any(p.name != RUN_LOCK for p in path.iterdir()):
        ensure_new_run_folder(path)
    return path


RUN_LOCK = ".clinfed.lock"


def _refuse_if_used(path: Path) -> None:
    if any(p.name != RUN_LOCK for p in path.iterdir()):
        hint = (
            " (it died before its first round: --resume starts it over)"
            if (path / "config.json").is_file() and not (path / "state.json").exists()
            else ""
        )
        raise ClinfedError(
            f"{path}: run folder already exists and is not empty{hint}; choose a new `out`"
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
        raise ClinfedError(f"{path}: not a folder; choose a new `out`")
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
            except USER_ERRORS:
                if not lock_existed:
                    (path / RUN_LOCK).unlink(missing_ok=True)
                raise
            if lock_existed:
                # Killed right after its claim, before it wrote anything.
                logging.getLogger("clinfed").warning(
                    "%s: holds only the claim of a run that never started; this run takes it over",
                    path,
                )
        for stale in path.rglob(".*.tmp"):
            stale.unlink(missing_ok=True)  # a write a killed process never finished
        try:
            yield path
        except BaseException:
            if created and all(p.name == RUN_LOCK for p in path.iterdir()):
                (path / RUN_LOCK).unlink(missing_ok=True)
                path.rmdir()
            raise


# What --resume writes when it repaired a run (clinfed.runners.resume; the report lists them).
REPAIRS = "repairs.jsonl"


def cell_name(strategy: str, eps: float, seed: int) -> str:
    """A sweep cell's folder name (clinfed.runners.sweep; the report finds a run's
    reference without DP beside it by this name)."""
    label = "inf" if math.isinf(eps) else f"{eps:g}"
    return f"{strategy.replace('+', '-')}-eps{label}-seed{seed}"
