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
        from clinfed.core.runs import atomic_write_json

        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache, seen)
    return total.hexdigest()


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of each file under ``folder``, by its relative name."""
    import hashlib

    digests = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        digests[path.relative_to(folder).as_posix()] = h.hexdigest()
    return digests


def folder_fingerprints(digests: dict[str, str], sizes: dict[str, int]) -> set[str]:
    """:func:`data_fingerprint` of the folder and of every folder under it,
    from its files' digests and sizes (no file read twice)."""
    import hashlib

    folders: dict[str, list[str]] = {}
    for name in sorted(digests):
        parts = name.split("/")
        for depth in range(len(parts)):
            prefix = "/".join(parts[:depth])
            relative = "/".join(parts[depth:])
            folders.setdefault(prefix, []).append(f"{relative}\0{sizes[name]}\0{digests[name]}\n")
    return {hashlib.sha256("".join(lines).encode()).hexdigest() for lines in folders.values()}


def check_start_is_public(start: dict[str, Any] | None, model: str, data: str | Path) -> None:
    """Refuse a starting model warm-started on the run's own private data:
    its recorded public start (and every earlier one, ``after``) with the
    fingerprint of the data folder or of any folder in it (a site's notes),
    or naming a file with the bytes of one of its files. Such a start was
    trained on private notes without DP; no epsilon the run states would
    hold. Names no file and no content."""
    from clinfed.core.errors import ClinfedError

    if not start:
        return
    data = Path(data)
    digests = file_digests(data)
    sizes = {name: (data / name).stat().st_size for name in digests}
    private = folder_fingerprints(digests, sizes)
    private_files = set(digests.values())
    while start:
        public_files = set(start.get("file_sha256") or ())
        if start.get("data_fingerprint") in private or public_files & private_files:
            raise ClinfedError(
                f"`model` {model}: warm-started on text with the bytes of the private data "
                f"folder {data} (its recorded public start, {start.get('folder', '?')}): a "
                "start trained on private notes without DP voids any epsilon; warm-start on "
                "public text only"
            )
        start = start.get("after")


def check_public_input(flag: str, public: str | Path, data: str | Path) -> None:
    """Refuse a public input (warm-start text, public check notes, name
    lists) that is, or holds, private data: a folder inside ``data`` or
    containing it, a file with the same bytes as one of ``data``'s, or
    private content in another form (:mod:`clinfed.core.overlap`). What
    is public is spent freely, so a private note passed as public would be
    released with no accounting at all. Names no file and no content.

    Raises
    ------
    ClinfedError
        Naming ``flag`` and ``data``, never what matched.
    """
    import hashlib

    from clinfed.core.errors import ClinfedError

    public, data = Path(public).resolve(), Path(data).resolve()
    if public == data or data in public.parents or public in data.parents:
        raise ClinfedError(
            f"{flag} {public}: overlaps the private data folder {data}; public inputs must "
            "come from outside it"
        )
    private = [p for p in data.rglob("*") if p.is_file()] if data.is_dir() else []
    by_size: dict[int, list[Path]] = {}
    for path in private:
        by_size.setdefault(path.stat().st_size, []).append(path)

    def digest(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    candidates = [public] if public.is_file() else sorted(public.rglob("*"))
    private_digests: dict[int, set[str]] = {}
    for path in candidates:
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size == 0 or size not in by_size:  # an empty file holds nothing
            continue
        if size not in private_digests:
            private_digests[size] = {digest(p) for p in by_size[size]}
        if digest(path) in private_digests[size]:
            raise ClinfedError(
                f"{flag} {public}: holds a file with the same bytes as a file of the private "
                f"data folder {data}; public inputs must not be private data"
            )
    from clinfed.core.overlap import private_content

    # Public by content, not by bytes: a converted or edited copy, notes
    # concatenated, names cut from the private annotations (clinfed.core.overlap).
    reason = private_content(public, data)
    if reason is not None:
        raise ClinfedError(
            f"{flag} {public}: {reason} ({data}); public inputs must not be private data"
        )


def describe_warm_start(record: dict[str, Any]) -> str:
    """The warm start in one line for a person (the report's header); a
    start made on an earlier start names every public text, first to last."""
    stages = []
    while record:
        stages.append(
            f"{Path(record['folder']).name} ({record['examples']:,} examples, "
            f"{record.get('label_kind', 'types')} {', '.join(record['types']) or 'none'}, "
            f"{record['epochs']} epoch{'s' if record['epochs'] != 1 else ''})"
        )
        record = record.get("after")
    return (
        f"trained on public text {', then '.join(reversed(stages))} before round 1, "
        "without DP: no site's data, no privacy spent"
    )
