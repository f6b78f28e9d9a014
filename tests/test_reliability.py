"""Nothing leaked, nothing lost: protected text never outlives a process
outside the folders the user named, whatever ends it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import CANARY


def _holding(root: Path, needle: bytes) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                found.append(path)
        except OSError:
            continue
    return found


def _clinfed(args: list[str], home: Path, tmp: Path) -> subprocess.Popen:
    env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "clinfed"), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_no_note_text_is_left_in_tmp_or_home_after_a_signal(mimic_corpus, tmp_path, signum):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    train = ["train", "--task", "mimic3", "--data", str(mimic_corpus), "--model", "tiny",
             "--rounds", "50", "--max-length", "32", "--max-chunks", "2", "--threads", "1",
             "--out", str(tmp_path / "run")]  # fmt: skip
    process = _clinfed(train, home, tmp)
    deadline = time.monotonic() + 120
    # Wait until tokenized notes are on disk in the scratch folder.
    while time.monotonic() < deadline and process.poll() is None:
        if _holding(tmp, CANARY.encode()):
            break
        time.sleep(0.2)
    assert process.poll() is None, "the run ended before it could be stopped"
    assert _holding(tmp, CANARY.encode())  # the canary really is in what was written
    process.send_signal(signum)
    code = process.wait(timeout=60)
    if signum == signal.SIGTERM:
        assert code == 128 + signal.SIGTERM  # a clean exit, its scratch folder removed
    else:
        assert code == -signal.SIGKILL
        # The next command cleans up after the killed one.
        nxt = _clinfed(["privacy", "epsilon", "--sample-rate", "0.1", "--noise-multiplier",
                        "1", "--steps", "10", "--delta", "1e-5"], home, tmp)  # fmt: skip
        assert nxt.wait(timeout=120) == 0
    assert _holding(tmp, CANARY.encode()) == []
    assert _holding(home, CANARY.encode()) == []
    assert not list(tmp.glob("clinfed-scratch-*"))


def test_data_check_leaves_no_arrow_cache_in_home(mimic_corpus, tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    check = _clinfed(["data", "check", "--task", "mimic3", str(mimic_corpus)], home, tmp)
    assert check.wait(timeout=300) == 0
    assert not (home / ".cache" / "huggingface" / "datasets").exists()
    assert _holding(home, CANARY.encode()) == [] and _holding(tmp, CANARY.encode()) == []
