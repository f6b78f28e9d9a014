"""A node's encoded data, kept between messages in its state folder.

Flower starts a new ClientApp process for every message, so without this a
node would read, parse and tokenize its notes again each time; on a site of
3,300 sentences that is about 15 s per message, most of it ``datasets``
hashing the parsed documents to name its own cache. Instead a node keeps
what it encoded in ``STATE/encoded/<key>/``:

* ``train/`` and ``test/``: the encoded examples (Arrow, memory-mapped when
  read back);
* ``records.pkl`` or ``records/``: the test documents, which predictions
  are written against;
* ``meta.json``: the site's name and what loading the data taught the task
  (its label set, and what else the task's load set: Task.loaded_state).

The key is a SHA-256 over everything that changes the encoding: the data
folder's fingerprint (names, sizes and contents of its files, as the ledger
uses), the tokenizer's checkpoint folder's fingerprint, the site asked
for, the task's data settings, the window, the seed (it splits a corpus
without one) and clinfed's version. Any change gives a new key, so a stale
entry is never read; only the newest ``KEEP`` entries stay.

This is protected health information (token ids are the notes): it stays
inside the node's state folder, which its operator chose, written with
folders 0700 and files 0600, and atomically (a temporary folder renamed),
so a node killed while writing leaves no half entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from clinfed.core.version import __version__

# The settings that change what encoding produces (besides data and tokenizer).
ENCODING_SETTINGS = (
    "task",
    "format",
    "types",
    "codes",
    "top_k",
    "max_chunks",
    "labels",
    "partial_labels",
    "max_length",
    "on_error",
    "seed",
    "model",
)
KEEP = 4
FOLDER = "encoded"


@dataclass
class Encoded:
    """One site's encoded data and what loading taught the task."""

    site: str
    train: datasets.Dataset
    test: datasets.Dataset
    test_records: Any
    task_state: dict[str, Any]


def task_state(task: Any) -> dict[str, Any]:
    """What ``task.load`` set from the data (JSON-ready)."""
    return task.loaded_state()


def restore_task_state(task: Any, state: dict[str, Any]) -> None:
    task.restore_loaded_state(state)


def cache_key(
    settings: dict[str, Any], site: str | None, data_fingerprint: str, tokenizer_fingerprint: str
) -> str:
    """The entry's name: a digest of everything its contents depend on."""
    described = {
        "settings": {k: settings.get(k) for k in ENCODING_SETTINGS},
        "site": site,
        "data": data_fingerprint,
        "tokenizer": tokenizer_fingerprint,
        "clinfed": __version__,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


@contextlib.contextmanager
def _private_files() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _lock_down(folder: Path) -> None:
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o700)
        for name in dirs:
            os.chmod(Path(root) / name, 0o700)
        for name in files:
            os.chmod(Path(root) / name, 0o600)


class EncodedCache:
    """``STATE/encoded/``: one entry per key (see the module docstring)."""

    def __init__(self, state: Path):
        self.root = Path(state) / FOLDER

    def load(self, key: str) -> Encoded | None:
        entry = self.root / key
        if not (entry / "meta.json").is_file():
            return None
        meta = json.loads((entry / "meta.json").read_text())
        if (entry / "records.pkl").is_file():
            with open(entry / "records.pkl", "rb") as fh:
                records = pickle.load(fh)  # written by this node, in its own state folder
        else:
            records = datasets.load_from_disk(str(entry / "records"))
        os.utime(entry)  # newest first when evicting
        return Encoded(
            meta["site"],
            datasets.load_from_disk(str(entry / "train")),
            datasets.load_from_disk(str(entry / "test")),
            records,
            meta["task_state"],
        )

    def save(self, key: str, encoded: Encoded) -> None:
        with _private_files():
            self.root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
            work = Path(tempfile.mkdtemp(prefix=".writing-", dir=self.root))
            try:
                encoded.train.save_to_disk(str(work / "train"))
                encoded.test.save_to_disk(str(work / "test"))
                if isinstance(encoded.test_records, datasets.Dataset):
                    encoded.test_records.save_to_disk(str(work / "records"))
                else:
                    with open(work / "records.pkl", "wb") as fh:
                        pickle.dump(encoded.test_records, fh)
                meta = {"site": encoded.site, "task_state": encoded.task_state}
                (work / "meta.json").write_text(json.dumps(meta))
                _lock_down(work)
                target = self.root / key
                if target.exists():  # another message of this node wrote it first
                    shutil.rmtree(work)
                else:
                    os.replace(work, target)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        self._evict()

    def _evict(self) -> None:
        entries = [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP:]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".writing-*"):  # left by a node killed mid-write
            if stale.stat().st_mtime < time.time() - 3600:
                shutil.rmtree(stale, ignore_errors=True)
