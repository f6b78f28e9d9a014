"""Every temporary file of a clinfed process in one private folder.

Tokenized notes and the ``datasets`` Arrow files made from them are
protected health information. :func:`private_scratch` gives a process one
folder for all of them:

* created with mode 0700 under the system's temporary folder, named
  ``clinfed-scratch-<pid>-...``;
* ``tempfile``'s default folder and ``datasets``' default cache point into
  it while it is open, so no library writes note content to
  ``~/.cache/huggingface`` or loose in ``$TMPDIR``;
* removed on a normal exit, on an error, on Ctrl-C and on SIGTERM (how
  schedulers and ``docker stop`` end jobs): the SIGTERM handler removes it
  and exits with status 143 at once (written files are atomic, so nothing
  is left half-written);
* a SIGKILL cannot be caught: the next clinfed process removes the scratch
  folders of processes that no longer exist before it starts.

Every shorter-lived temporary folder (a site's tokenized data, a
command's ``datasets`` cache) comes from :func:`temporary_folder`: inside
the scratch folder when one is open, and otherwise (library use) named for
its process too, so a SIGKILL there leaves nothing the next clinfed
process does not remove.

``--cache-dir`` is the only lasting cache, in a folder the user names.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

PREFIX = "clinfed-scratch-"
# The system's temporary folder, before any scratch folder replaced it.
_SYSTEM_TMP = tempfile.gettempdir()


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove the scratch folders of processes that no longer run (a SIGKILL
    left them); returns what was removed."""
    root = Path(root or _SYSTEM_TMP)
    removed = []
    for folder in root.glob(PREFIX + "*"):
        try:
            pid = int(folder.name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not process_alive(pid) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


_ACTIVE: list[Path] = []
# What a command says when SIGTERM ends it (train: how to resume), as on Ctrl-C.
FAREWELL: list[str] = []


def _terminate(signum: int, frame) -> None:
    """SIGTERM: remove the scratch folders now, say the command's farewell
    (:data:`FAREWELL`) and exit 128 + signum. Done here rather than by
    raising, so no library that catches exceptions can keep the process
    (and the notes on disk) alive."""
    del frame
    for folder in _ACTIVE:
        shutil.rmtree(folder, ignore_errors=True)
    for line in FAREWELL:
        os.write(2, (line + "\n").encode())
    os._exit(128 + signum)


_LIBRARY_SCRATCH: Path | None = None


def cache_folder(cache_dir: str | None) -> str:
    """Where ``datasets`` may write for a reader: the folder the caller named,
    else this process's private scratch folder (the CLI's, or, for library
    use, one made on first need and removed at exit), never
    ``~/.cache/huggingface``."""
    global _LIBRARY_SCRATCH
    if cache_dir is not None:
        return str(cache_dir)
    if tempfile.tempdir and Path(tempfile.tempdir).name.startswith(PREFIX):
        return str(Path(tempfile.tempdir) / "datasets")
    if _LIBRARY_SCRATCH is None or not _LIBRARY_SCRATCH.is_dir():
        remove_stale()
        _LIBRARY_SCRATCH = Path(
            tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-lib-", dir=_SYSTEM_TMP)
        )
        atexit.register(shutil.rmtree, _LIBRARY_SCRATCH, True)
    return str(_LIBRARY_SCRATCH)


def temporary_folder(kind: str) -> tempfile.TemporaryDirectory:
    """A temporary folder for protected data (removed by its ``cleanup`` or
    context exit), in the current temporary folder (this process's scratch
    folder when one is open) and named ``clinfed-scratch-<pid>-<kind>-...``,
    so :func:`remove_stale` finds it if this process dies without removing
    it."""
    return tempfile.TemporaryDirectory(prefix=f"{PREFIX}{os.getpid()}-{kind}-")


@contextlib.contextmanager
def private_scratch() -> Iterator[Path]:
    """This process's private temporary folder (see the module docstring)."""
    import datasets

    remove_stale()
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=_SYSTEM_TMP))
    os.chmod(folder, 0o700)
    previous_tempdir = tempfile.tempdir
    previous_cache = datasets.config.HF_DATASETS_CACHE
    handler = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.signal(signal.SIGTERM, _terminate)
    tempfile.tempdir = str(folder)
    datasets.config.HF_DATASETS_CACHE = folder / "datasets"
    _ACTIVE.append(folder)
    try:
        yield folder
    finally:
        _ACTIVE.remove(folder)
        tempfile.tempdir = previous_tempdir
        datasets.config.HF_DATASETS_CACHE = previous_cache
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
        shutil.rmtree(folder, ignore_errors=True)
