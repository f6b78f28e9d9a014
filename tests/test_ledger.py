"""A site's ledger survives crashes and neighbours: a torn last line is cut
back (never a complete one), the folder is fsynced when the file is made,
and two processes cannot charge one ledger at once."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from clinfed.errors import ClinfedError
from clinfed.privacy.accountant import Mechanism
from clinfed.privacy.ledger import Ledger

ROUND = [Mechanism("dp-sgd", 1.0, 0.05, 20)]


def test_a_torn_last_line_is_cut_back_and_charging_goes_on(tmp_path):
    path = tmp_path / "beth.jsonl"
    ledger = Ledger(path, "beth", 1e-5)
    first = ledger.charge(1, ROUND)
    second = ledger.charge(2, ROUND)
    with open(path, "ab") as fh:  # a crash in the middle of round 3's line
        fh.write(b'{"client": "beth", "round": 3, "mech')
    again = Ledger(path, "beth", 1e-5)
    assert again.repaired_bytes > 0
    assert [line["epsilon"] for line in again.lines] == [first, second]  # nothing complete lost
    assert path.read_bytes().endswith(b"\n")
    third = again.charge(3, ROUND)
    reread = Ledger(path, "beth", 1e-5)
    assert [line["round"] for line in reread.lines] == [1, 2, 3]
    assert reread.lines[-1]["epsilon"] == pytest.approx(third) and third > second


def test_a_complete_line_that_does_not_parse_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "beth.jsonl"
    Ledger(path, "beth", 1e-5).charge(1, ROUND)
    with open(path, "ab") as fh:
        fh.write(b"not json\n")
    with pytest.raises(ClinfedError, match=r"beth.jsonl:2: not a ledger line"):
        Ledger(path, "beth", 1e-5)


def test_the_folder_is_fsynced_when_the_ledger_is_created(tmp_path, monkeypatch):
    synced_folders = []
    fsync = os.fsync

    def spy(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced_folders.append(fd)
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    Ledger(tmp_path / "new" / "beth.jsonl", "beth", 1e-5).charge(1, ROUND)
    assert synced_folders


def test_a_second_process_cannot_charge_the_ledger_at_the_same_time(tmp_path):
    path = tmp_path / "beth.jsonl"
    holder = (
        "import fcntl, os, sys, time; "
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(30)"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", holder, str(path) + ".lock"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "locked"
        with pytest.raises(ClinfedError, match="another process is charging"):
            Ledger(path, "beth", 1e-5).charge(1, ROUND)
        assert not path.exists()  # nothing was charged
    finally:
        process.kill()
        process.wait()
    time.sleep(0.1)
    assert Ledger(path, "beth", 1e-5).charge(1, ROUND) > 0  # free again
