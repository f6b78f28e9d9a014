"""The damage pass: a finished private run, each of its records damaged in
turn (deleted, emptied, truncated, torn, rolled back, a value flipped), then
``--resume`` and ``report``. A resume ends identical (verified, nothing
written), or refused with exit 2 naming a file of the run and nothing
changed; it never rewrites the model, the predictions or a ledger. The
report ends with its page or exit 2, and changes nothing outside it."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from .test_cli import run_cli

SITES = ("beth", "partners", "site3")
FILES = [
    *(f"sites/{s}/privacy/{s}.jsonl" for s in SITES),
    *(f"sites/{s}/privacy/{s}.jsonl.seal" for s in SITES),
    *(f"privacy/{s}.jsonl" for s in SITES),
    "metrics.jsonl",
    "summary.json",
    "state.json",
    "config.json",
    "privacy/policy.json",
]


def _delete(path: Path) -> None:
    path.unlink()


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _tear(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-2])


def _roll_back(path: Path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))


def _flip(path: Path) -> None:
    text = path.read_text()
    digits = [m.start() for m in re.finditer(r"[0-9]", text)]
    at = digits[len(digits) // 2]
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])


DAMAGES = {
    "delete": _delete,
    "empty": _empty,
    "truncate": _truncate,
    "tear": _tear,
    "roll-back": _roll_back,
    "flip": _flip,
}
KEPT = ("model/", "predictions/", "sites/")  # never rewritten by a resume


def _checksums(run: Path, skip: str | None = None) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and not (skip and str(p.relative_to(run)).startswith(skip))
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory, i2b2_corpus) -> Path:
    run = tmp_path_factory.mktemp("damage") / "run"
    result = run_cli(
        "train", "--data", str(i2b2_corpus), "--model", "tiny", "--max-length", "32",
        "--rounds", "2", "--local-epochs", "1", "--adapter", "bias", "--target-epsilon", "8",
        "--threads", "1", "--out", str(run),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return run


def _damaged(finished: Path, tmp_path: Path, file: str, damage: str) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    DAMAGES[damage](run / file)
    return run


def _resume_holds_its_contract(run: Path, file: str, damage: str) -> None:
    before = _checksums(run)
    result = run_cli("train", "--resume", "--out", str(run))
    after = _checksums(run)
    assert "Traceback" not in result.stderr, (file, damage)
    if result.returncode == 2:
        assert str(run) in result.stderr, (file, damage, result.stderr)
        assert after == before, (file, damage, "a refusal changed the folder")
        return
    assert result.returncode == 0, (file, damage, result.stderr)
    # Accepted: the damage left nothing the commit point covers (a file a
    # finished run does not need); nothing kept was rewritten.
    assert after == before or "repaired" in result.stderr, (file, damage)
    for name in before:
        if name.startswith(KEPT):
            assert after.get(name) == before[name], (file, damage, name)


def _report_holds_its_contract(run: Path, file: str, damage: str) -> None:
    before = _checksums(run, skip="report/")
    result = run_cli("report", str(run))
    assert "Traceback" not in result.stderr, (file, damage)
    assert result.returncode in (0, 2), (file, damage, result.stderr)
    if result.returncode == 2:
        assert str(run) in result.stderr, (file, damage, result.stderr)
    assert _checksums(run, skip="report/") == before, (file, damage)


# The default run: every file once, the damages taken in turn; the whole
# pass (every file, every damage, both commands) is marked slow.
SAMPLE = [(file, list(DAMAGES)[i % len(DAMAGES)]) for i, file in enumerate(FILES)]


@pytest.mark.parametrize("file, damage", SAMPLE)
def test_a_damaged_finished_run_is_refused_or_left_as_it_is(finished, tmp_path, file, damage):
    _resume_holds_its_contract(_damaged(finished, tmp_path, file, damage), file, damage)


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("file", FILES)
def test_the_whole_damage_pass(finished, tmp_path, file, damage):
    run = _damaged(finished, tmp_path, file, damage)
    _resume_holds_its_contract(run, file, damage)
    _report_holds_its_contract(run, file, damage)


def test_a_resume_of_a_finished_run_verifies_it_and_writes_nothing(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = _checksums(run)
    result = run_cli("train", "--resume", "--out", str(run))
    assert result.returncode == 0, result.stderr
    assert "already finished" in result.stdout
    assert _checksums(run) == before


def test_a_setting_changed_on_resume_is_refused_by_name_with_the_command(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = _checksums(run)
    result = run_cli("train", "--resume", "--out", str(run), "--rounds", "3")
    assert result.returncode == 2 and "rounds was 2, now 3" in result.stderr
    assert f"clinfed train --config {run / 'config.json'} --rounds VALUE --out NEW" in (
        result.stderr.replace("\n", "")
    )
    assert _checksums(run) == before


def test_a_deleted_commit_point_never_restarts_over_the_outputs(finished, tmp_path):
    run = _damaged(finished, tmp_path, "state.json", "delete")
    before = _checksums(run)
    result = run_cli("train", "--resume", "--out", str(run))
    assert result.returncode == 2 and "state.json: missing" in result.stderr
    assert _checksums(run) == before


def test_records_after_the_commit_are_dropped_and_said(finished, tmp_path, i2b2_corpus):
    # A run killed after round 2's site records, before its commit: the
    # resume says what it dropped, the report says the run was repaired.
    import json

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    state = json.loads((run / "state.json").read_text())
    for name in ("summary.json", "model", "predictions"):
        path = run / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    with open(run / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"round": 3, "client": "beth", "torn')
    assert state["round"] == 2
    result = run_cli("train", "--resume", "--out", str(run))
    assert result.returncode == 0, result.stderr
    assert "repaired" in result.stderr and "dropped (the last one torn)" in result.stderr
    assert '"torn' not in (run / "metrics.jsonl").read_text()
    page = run_cli("report", str(run))
    assert page.returncode == 0, page.stderr
    assert "Repaired on resume" in (run / "report" / "report.md").read_text()
