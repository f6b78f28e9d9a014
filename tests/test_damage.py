"""The damage pass: a finished private run, each of its records damaged in
turn (deleted, emptied, truncated, torn, rolled back, a value flipped), then
``--resume`` and ``report``. A resume ends identical (verified, nothing
written), or refused with exit 2 naming a file of the run and nothing
changed; it never rewrites the model, the predictions or a ledger. The
report ends with its page or exit 2, and changes nothing outside it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
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
    assert result.returncode == 2 and "--rounds was 2, now 3" in result.stderr
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
        fh.write(b'{"round": 3, "site": "beth", "torn')
    assert state["round"] == 2
    result = run_cli("train", "--resume", "--out", str(run))
    assert result.returncode == 0, result.stderr
    assert "repaired" in result.stderr and "dropped (the last one torn)" in result.stderr
    assert '"torn' not in (run / "metrics.jsonl").read_text()
    page = run_cli("report", str(run))
    assert page.returncode == 0, page.stderr
    assert "Repaired on resume" in (run / "report" / "report.md").read_text()


def _edit_json(name: str, change) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        values = json.loads((run / name).read_text())
        change(values)
        (run / name).write_text(json.dumps(values))

    return edit


def _edit_lines(name: str, key: str, value) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        lines = [json.loads(line) for line in (run / name).read_text().splitlines()]
        for line in lines:
            if key in line:
                line[key] = value
        (run / name).write_text("".join(json.dumps(line) + "\n" for line in lines))

    return edit


# Each figure the report and the model card state, edited in the file it is
# read from (the cases a QA pass found accepted), and the file the refusal names.
EDITS = {
    "ledger copy's delta": (_edit_lines("privacy/beth.jsonl", "delta", 1e-6), "beth.jsonl"),
    "ledger copy's noise": (
        _edit_lines("privacy/beth.jsonl", "noise_multiplier", 9.0),
        "beth.jsonl",
    ),
    "summary's F1": (_edit_json("summary.json", lambda v: v.update(f1=0.9)), "summary.json"),
    "summary's epsilon": (
        _edit_json("summary.json", lambda v: v["epsilon"].update(beth=1.0)),
        "summary.json",
    ),
    "policy's delta": (
        _edit_json("privacy/policy.json", lambda v: v.update(delta=1e-6)),
        "policy.json",
    ),
    "policy's clip norm": (
        _edit_json("privacy/policy.json", lambda v: v.update(max_grad_norm=0.01)),
        "policy.json",
    ),
    "records' F1": (_edit_lines("metrics.jsonl", "f1", 0.99), "metrics.jsonl"),
    "records' bytes": (_edit_lines("metrics.jsonl", "bytes_up", 1), "metrics.jsonl"),
    "config's rounds": (
        _edit_json("config.json", lambda v: v["federation"].update(rounds=1)),
        "config.json",
    ),
    "config's strategy": (
        _edit_json("config.json", lambda v: v["federation"].update(strategy="fedprox")),
        "config.json",
    ),
    "a site's own ledger folder": (
        lambda run: shutil.rmtree(run / "sites" / "beth" / "privacy"),
        "sites/beth/privacy",
    ),
}


def test_an_edited_figure_is_never_stated_report_and_card_refuse_it(finished, tmp_path):
    # Every case in one test: one finished run per worker, not one per case.
    for edit, (change, named) in EDITS.items():
        run = tmp_path / edit.replace(" ", "-").replace("'", "")
        shutil.copytree(finished, run)
        change(run)
        before = _checksums(run)
        exported = tmp_path / f"{run.name}-model"
        for command in (("report", str(run)), ("export", str(run), "--out", str(exported))):
            result = run_cli(*command)
            assert result.returncode == 2, (edit, command[0], result.stdout)
            assert named in result.stderr and "Traceback" not in result.stderr, (
                edit,
                result.stderr,
            )
        assert _checksums(run) == before and not exported.exists(), edit


def test_without_its_seal_a_run_s_figures_are_stated_as_unverified(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "seal.json").unlink()
    _edit_json("summary.json", lambda v: v.update(f1=0.9))(run)
    result = run_cli("report", str(run))
    assert result.returncode == 0, result.stderr
    assert "UNVERIFIED" in result.stdout and "seal.json" in result.stdout
    page = (run / "report" / "report.md").read_text()
    assert page.index("UNVERIFIED") < page.index("0.9000")


def test_a_run_folder_written_before_site_was_the_word_still_reads(finished, tmp_path):
    # Records and settings said "client" then: metrics.jsonl's key and
    # federation.clients; such a folder has no seal either.
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"site":', '"client":'))
    config = json.loads((run / "config.json").read_text())
    config["federation"]["clients"] = config["federation"].pop("sites")
    (run / "config.json").write_text(json.dumps(config))
    (run / "seal.json").unlink()
    assert '"client": "beth"' in metrics.read_text()
    result = run_cli("report", str(run))
    assert result.returncode == 0, result.stderr
    page = (run / "report" / "report.md").read_text()
    for site in SITES:
        assert f"round 1, {site}" in page and f"| {site} |" in page
