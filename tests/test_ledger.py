"""A site's ledger survives crashes and neighbours: a torn last line is cut
back (never a complete one), the folder is fsynced when the file is made,
and two processes cannot charge one ledger at once."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from clinfed.privacy.accountants import Mechanism
from clinfed.privacy.errors import PrivacyError
from clinfed.privacy.ledger import Ledger

ROUND = [Mechanism("dp-sgd", 1.0, 0.05, 20)]


def charge_and_die(path, run: str, round_number: int) -> float:
    """Charge ROUND for ``round_number`` in another process that then ends
    without releasing (a site killed mid-round); the epsilon it charged."""
    code = (
        "import sys; from clinfed.privacy.accountants import Mechanism; "
        "from clinfed.privacy.ledger import Ledger; "
        "l = Ledger(sys.argv[1], 'beth', 1e-5, run=sys.argv[2]); "
        "print(l.charge(int(sys.argv[3]), [Mechanism('dp-sgd', 1.0, 0.05, 20)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), run, str(round_number)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(done.stdout)


def test_a_torn_last_line_is_cut_back_and_charging_goes_on(tmp_path):
    path = tmp_path / "beth.jsonl"
    ledger = Ledger(path, "beth", 1e-5)
    first = ledger.charge(1, ROUND)
    second = ledger.charge(2, ROUND)
    with open(path, "ab") as fh:  # a crash in the middle of round 3's line
        fh.write(b'{"site": "beth", "round": 3, "mech')
    torn = path.read_bytes()
    again = Ledger(path, "beth", 1e-5)
    assert again.torn_bytes > 0
    assert [line["epsilon"] for line in again.lines] == [first, second]  # nothing complete lost
    assert path.read_bytes() == torn  # reading a ledger never writes it
    third = again.charge(3, ROUND)  # the torn tail is cut under the lock, then appended to
    assert again.repaired_bytes > 0
    reread = Ledger(path, "beth", 1e-5)
    assert [line["round"] for line in reread.lines] == [1, 2, 3]
    assert reread.lines[-1]["epsilon"] == pytest.approx(third) and third > second


def test_a_complete_line_that_does_not_parse_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "beth.jsonl"
    Ledger(path, "beth", 1e-5).charge(1, ROUND)
    with open(path, "ab") as fh:
        fh.write(b"not json\n")
    with pytest.raises(PrivacyError, match=r"beth.jsonl:2: not a ledger line"):
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
        with pytest.raises(PrivacyError, match="another process is charging"):
            Ledger(path, "beth", 1e-5).charge(1, ROUND)
        assert not path.exists()  # nothing was charged
    finally:
        process.kill()
        process.wait()
    time.sleep(0.1)
    assert Ledger(path, "beth", 1e-5).charge(1, ROUND) > 0  # free again


def test_a_charge_never_released_is_reused_by_the_rerun_and_never_dropped(tmp_path):
    path = tmp_path / "beth.jsonl"
    ledger = Ledger(path, "beth", 1e-5, run="r")
    one = ledger.charge(1, ROUND)
    ledger.release(1)
    two = charge_and_die(path, "r", 2)  # a site that dies before replying
    restarted = Ledger(path, "beth", 1e-5, run="r")
    assert restarted.unreleased(2) and not restarted.unreleased(1)
    assert restarted.charge(2, ROUND) == two  # the same charge, not a second one
    assert len(restarted.lines) == 2
    restarted.release(2)
    # Released rounds are charged again when re-run: the first answer left.
    assert restarted.charge(2, ROUND) > two
    # Another run's unreleased round, or other mechanisms, are never reused.
    other = Ledger(path, "beth", 1e-5, run="s")
    assert other.charge(1, ROUND) > one
    assert other.charge(1, [Mechanism("dp-sgd", 2.0, 0.05, 20)]) is not None
    assert len(Ledger(path, "beth", 1e-5).lines) == 5


def test_a_ledger_shortened_altered_or_deleted_is_refused(tmp_path):
    path = tmp_path / "beth.jsonl"
    ledger = Ledger(path, "beth", 1e-5, run="r")
    for round_number in (1, 2, 3):
        ledger.charge(round_number, ROUND)
        ledger.release(round_number)
    committed = ledger.digest()  # what a run's commit keeps
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2].rsplit(b"\n", 1)[0] + b"\n")
    with pytest.raises(PrivacyError, match="shortened"):
        Ledger(path, "beth", 1e-5)
    path.write_bytes(whole.replace(b'"round": 1', b'"round": 7'))
    with pytest.raises(PrivacyError, match="altered"):
        Ledger(path, "beth", 1e-5)
    path.unlink()
    with pytest.raises(PrivacyError, match="deleted"):
        Ledger(path, "beth", 1e-5)
    # Seal and ledger both gone: the commit's digest still notices.
    (tmp_path / "beth.jsonl.seal").unlink()
    fresh = Ledger(path, "beth", 1e-5)
    with pytest.raises(PrivacyError, match="deleted"):
        fresh.verify(committed, "state.json")
    path.write_bytes(whole)
    Ledger(path, "beth", 1e-5).verify(committed, "state.json")  # intact: accepted


def test_two_handlers_of_one_round_never_share_a_charge(tmp_path):
    # Two attempts of the same run and round at once (two handlers of a
    # replayed message): each is charged; the second never reuses the
    # first's pending charge while the first is still in flight.
    path = tmp_path / "beth.jsonl"
    first, second = (Ledger(path, "beth", 1e-5, run="r") for _ in range(2))
    one = first.charge(1, ROUND)
    two = second.charge(1, ROUND)
    assert two > one
    first.release(1)
    second.release(1)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    charges = [x for x in lines if x.get("state") == "charged"]
    releases = [x for x in lines if x.get("released")]
    assert len(charges) == 2 and len(releases) == 2
    assert {x["attempt"] for x in charges} == {x["attempt"] for x in releases}
    # The same object asked twice while its attempt is in flight: two charges.
    third = Ledger(path, "beth", 1e-5, run="r")
    three = third.charge(2, ROUND)
    assert third.charge(2, ROUND) > three
    # An attempt that failed (abandoned) or settled without release is
    # reused by a re-run: nothing of it left the site.
    fourth = Ledger(path, "beth", 1e-5, run="r")
    four = fourth.charge(3, ROUND)
    fourth.abandon(3)
    assert Ledger(path, "beth", 1e-5, run="r").charge(3, ROUND) == four
    fifth = Ledger(path, "beth", 1e-5, run="r")
    five = fifth.charge(4, ROUND)
    fifth.settle(4)
    assert fifth.charge(4, ROUND) == five


def test_a_ledger_restored_or_deleted_with_its_seal_is_refused_by_the_node_mark(tmp_path):
    path, mark = tmp_path / "ledger" / "beth.jsonl", tmp_path / "ledger-marks.json"
    ledger = Ledger(path, "beth", 1e-5, run="r", mark=mark)
    ledger.charge(1, ROUND)
    ledger.release(1)
    backup = (path.read_bytes(), path.with_name("beth.jsonl.seal").read_bytes())
    ledger.charge(2, ROUND)
    ledger.release(2)
    # Ledger and seal restored together from the older backup: the mark stays.
    path.write_bytes(backup[0])
    path.with_name("beth.jsonl.seal").write_bytes(backup[1])
    with pytest.raises(PrivacyError, match="shortened"):
        Ledger(path, "beth", 1e-5, mark=mark)
    path.unlink()
    path.with_name("beth.jsonl.seal").unlink()
    with pytest.raises(PrivacyError, match="high-water mark"):
        Ledger(path, "beth", 1e-5, mark=mark)


def test_a_dataset_that_trained_without_a_guarantee_can_claim_none_later(tmp_path):
    path = tmp_path / "beth.jsonl"
    Ledger(path, "beth", 1e-5, run="plain").mark_unprotected("trained without DP")
    later = Ledger(path, "beth", 1e-5, budget=100.0, run="dp")
    assert later.spent == float("inf")
    assert later.charge(1, ROUND) is None  # no budget affords it
    # A run that is itself not private (reproducible noise) still trains.
    again = Ledger(path, "beth", 1e-5, budget=100.0, run="t", not_private="reproducible")
    assert again.charge(1, ROUND) is not None


def test_a_later_run_s_epsilon_includes_the_count_it_rests_on(tmp_path):
    # A node charges the dataset's noisy count once, under its first run;
    # every later run's epsilon (its report, its model card) includes it.
    from clinfed.privacy.accountants import budget_accountant, epsilon
    from clinfed.privacy.count import count_mechanism

    sgd = Mechanism("dp-sgd", 1.1, 0.05, 20)
    path = tmp_path / "beth.jsonl"

    def ledger(run: str) -> Ledger:
        return Ledger(path, "beth", 1e-5, 50.0, accountant=budget_accountant("add-remove"), run=run)

    first = ledger("first")
    assert first.charge_once(count_mechanism())
    first.charge(1, [sgd])
    first.release(1)
    later = ledger("later")
    assert later.charge_once(count_mechanism())  # already charged: nothing new
    later.charge(1, [sgd])
    with_count = epsilon([count_mechanism(), sgd], 1e-5, "add-remove")
    assert later.run_spent == pytest.approx(with_count)
    assert later.run_spent > epsilon([sgd], 1e-5, "add-remove")
    assert [line["mechanism"] for line in later.run_lines()] == ["unit-count", "dp-sgd"]
