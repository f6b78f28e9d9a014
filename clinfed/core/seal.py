"""A finished run folder's seal: the SHA-256 of every file the report and
the model card read, written last (``RUN/seal.json``).

The report and the model card state what a run folder proves. The sites'
ledgers anchor epsilon (each sealed at its site, and by the run's commit);
the seal anchors everything else they state: F1 and bytes
(``metrics.jsonl``, ``summary.json``), delta, target and clip norm
(``privacy/policy.json``), the ledgers' copies, rounds and strategy
(``config.json``), the model and the audit. A file the seal names that is
missing or changed is refused by name; a file of those kinds that the seal
does not name was added afterwards and is refused too. A finished run
without a seal (a run folder from before seals, or one whose seal was
deleted) is reported with its figures marked unverified.

The seal is a checksum, not a signature: whoever can rewrite a run folder
can rewrite its seal to match. It catches an edit to one figure; what binds
epsilon is each site's own ledger, not this file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.core.runs import atomic_write_json

SEAL = "seal.json"
# What the report, the model card and the audit read, relative to the run.
SEALED = (
    "config.json",
    "metrics.jsonl",
    "summary.json",
    "state.json",
    "labels.json",
    "audit.json",
    "repairs.jsonl",
    "privacy/*",
    "model/**/*",
    "audit/**/*",
)


def sealed_files(run: Path) -> list[Path]:
    """The files of ``run`` that a seal covers, sorted."""
    found = {path for pattern in SEALED for path in run.glob(pattern) if path.is_file()}
    return sorted(found)


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def seal_run(run: Path) -> dict[str, Any]:
    """Write ``RUN/seal.json`` over the run's files as they are now."""
    run = Path(run)
    files = {str(path.relative_to(run)): _digest(path) for path in sealed_files(run)}
    seal = {"files": files, "schema": 1}
    atomic_write_json(run / SEAL, seal)
    return seal


def check_seal(run: Path) -> str | None:
    """Refuse (``ClinfedError`` naming the file) a run whose sealed files
    were changed, deleted or added to; return why the run's figures are
    unverified (a finished run without a seal), or ``None``."""
    run = Path(run)
    path = run / SEAL
    if not path.is_file():
        if (run / "summary.json").is_file():
            return (
                f"{path} is missing (a run from before seals, or the file was deleted): the "
                "figures below other than epsilon are as the run folder says, unverified"
            )
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8")).get("files")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        files = None
    if not isinstance(files, dict):
        raise ClinfedError(f"{path}: not a run's seal; the run folder is damaged")
    for name, digest in sorted(files.items()):
        file = run / name
        if not file.is_file():
            raise ClinfedError(
                f"{file}: missing, though {path} names it: the run folder was changed; "
                "nothing is stated from it"
            )
        if _digest(file) != digest:
            raise ClinfedError(
                f"{file}: changed since the run sealed it ({path}): its figures cannot be stated"
            )
    for file in sealed_files(run):
        if str(file.relative_to(run)) not in files:
            raise ClinfedError(
                f"{file}: added after the run sealed its folder ({path}): it cannot be trusted"
            )
    return None
