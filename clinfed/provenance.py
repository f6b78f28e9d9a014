"""Where a run came from: the versions that made it and the command line.

Recorded in ``config.json`` and ``summary.json`` so a run folder says, on
its own, what produced it.
"""

from __future__ import annotations

import platform
import shlex
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("clinfed", "torch", "transformers", "opacus", "dp-accounting", "flwr", "peft")


def versions() -> dict[str, str]:
    """Installed versions of clinfed and the libraries a run's results depend on."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def command_line() -> str:
    """This process's command line, as a shell would take it back."""
    program = sys.argv[0].rsplit("/", 1)[-1] if sys.argv else "python"
    return shlex.join([program, *sys.argv[1:]])


def provenance() -> dict[str, Any]:
    """Versions, command line and the time (UTC, ISO 8601)."""
    return {
        "versions": versions(),
        "command": command_line(),
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def data_fingerprint(data: Path, cache: Path | None = None) -> str:
    """SHA-256 over a data folder's files (relative names, sizes, contents).

    Each file's hash is cached in ``cache`` (if given) by size and
    modification time, so a node does not re-read gigabytes of notes for
    every message.
    """
    import hashlib
    import json

    try:
        known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    except ValueError:
        known = {}
    files = sorted(p for p in data.rglob("*") if p.is_file())
    total = hashlib.sha256()
    seen = {}
    for path in files:
        name = path.relative_to(data).as_posix()
        info = path.stat()
        key = [info.st_size, info.st_mtime_ns]
        entry = known.get(name)
        if entry and entry[:2] == key:
            digest = entry[2]
        else:
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            digest = h.hexdigest()
        seen[name] = [*key, digest]
        total.update(f"{name}\0{info.st_size}\0{digest}\n".encode())
    if cache is not None and seen != known:
        from clinfed.runs import atomic_write_json

        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache, seen)
    return total.hexdigest()
