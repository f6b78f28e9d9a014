"""The report says no more than the run folder proves: every damage to a
ledger, seal, record file, summary or commit ends in the same report or in a
refusal naming the file, and the folder is never written to."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from clinfed.core.errors import USER_ERRORS
from clinfed.reporting.report import write_report
from tests.test_cli import run_cli


@pytest.fixture(scope="module")
def finished(tmp_path_factory, i2b2_corpus):
    """A finished two-round DP run in process, and its report."""
    from clinfed.runners.pipeline import run_training
    from clinfed.settings import RunConfig

    out = tmp_path_factory.mktemp("verify") / "run"
    run_training(
        RunConfig.of(
            task="i2b2",
            strategy="fedavg",
            model="tiny",
            rounds=2,
            max_length=32,
            threads=1,
            noise_multiplier=1.0,
            adapter="bias",
            data=str(i2b2_corpus),
            out=str(out),
        )  # fmt: skip
    )
    page = (write_report(out) / "report.md").read_text()
    shutil.rmtree(out / "report")
    return out, page


def _bytes(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def _drop_last_line(path: Path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))


def _round_one_bytes(run: Path) -> int:
    """Where metrics.jsonl's round-1 records end."""
    size = 0
    for raw in (run / "metrics.jsonl").read_bytes().splitlines(keepends=True):
        if json.loads(raw)["round"] > 1:
            break
        size += len(raw)
    return size


def _roll_back(run: Path, name: str) -> None:
    """The file as the round before would have left it."""
    path = run / name
    if name.endswith(".jsonl"):
        _drop_last_line(path)
    elif name == "state.json":
        state = json.loads(path.read_text())
        state["round"], state["metrics_bytes"] = 1, _round_one_bytes(run)
        path.write_text(json.dumps(state))
    elif name == "summary.json":
        summary = json.loads(path.read_text())
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        summary["round"] = 1
        summary["epsilon"] = {
            r["site"]: r["epsilon"] for r in records if r.get("round") == 1 and "epsilon" in r
        }
        path.write_text(json.dumps(summary))
    else:  # a seal: the digest of the ledger's first line
        ledger = path.with_name(path.name.removesuffix(".seal"))
        first = ledger.read_bytes().splitlines(keepends=True)[0]
        digest = {"bytes": len(first), "sha256": hashlib.sha256(first).hexdigest()}
        path.write_text(json.dumps(digest))


DAMAGED = [
    "privacy/beth.jsonl",
    "sites/beth/privacy/beth.jsonl",
    "sites/beth/privacy/beth.jsonl.seal",
    "metrics.jsonl",
    "summary.json",
    "state.json",
]


@pytest.mark.parametrize("damage", ["delete", "truncate", "roll back"])
@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_run_folder_gives_the_same_report_or_a_refusal_naming_the_file(
    finished, tmp_path, name, damage
):
    source, page = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)
    path = run / name
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        _roll_back(run, name)
    before = _bytes(run)
    try:
        folder = write_report(run)
    except USER_ERRORS as err:
        said = str(err)
        assert Path(name).name in said, said
        assert not (run / "report").exists()
    else:
        assert (folder / "report.md").read_text() == page.replace(str(source), str(run))
        shutil.rmtree(folder)
    assert _bytes(run) == before


def test_records_and_ledger_copies_shortened_together_are_refused(finished, tmp_path):
    # As on Flower, where the run folder holds the ledgers' copies alone.
    source, _ = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)
    shutil.rmtree(run / "sites")
    size = _round_one_bytes(run)
    (run / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes()[:size])
    for ledger in (run / "privacy").glob("*.jsonl"):
        ones = [
            x for x in ledger.read_text().splitlines(keepends=True) if json.loads(x)["round"] == 1
        ]
        ledger.write_text("".join(ones))
    with pytest.raises(USER_ERRORS, match="metrics.jsonl|summary.json"):
        write_report(run)


def test_a_deleted_ledger_is_named_even_when_its_seal_went_too(finished, tmp_path):
    source, _ = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)
    for path in (
        run / "privacy" / "partners.jsonl",
        *(run / "sites" / "partners").rglob("*.jsonl*"),
    ):
        path.unlink()
    with pytest.raises(USER_ERRORS, match="partners"):
        write_report(run)


def test_damaged_records_are_one_line_and_exit_2(finished, tmp_path):
    source, _ = finished
    for name, damage in (("metrics.jsonl", "middle"), ("summary.json", "garbage")):
        run = tmp_path / name
        shutil.copytree(source, run)
        path = run / name
        if damage == "middle":
            lines = path.read_text().splitlines(keepends=True)
            lines[1] = '{"round": 1, "site"\n'
            path.write_text("".join(lines))
        else:
            path.write_bytes(b"\x00garbage{")
        result = run_cli("report", str(run))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"{name}:" in result.stderr and len(result.stderr.strip().splitlines()) == 1
        if damage == "middle":
            assert f"{name}:2:" in result.stderr


def test_a_report_refuses_its_own_run_as_the_reference(finished, tmp_path):
    source, _ = finished
    result = run_cli("report", str(source), "--reference", str(source))
    assert result.returncode == 2 and "names the run itself" in result.stderr


def test_the_grid_shows_a_bias_plan_as_a_small_part_of_each_layer(finished):
    source, page = finished
    grid = [line for line in page.splitlines() if line.startswith("| round ")]
    assert grid and all("■" not in line.split("|", 2)[2].rsplit("|", 2)[0] for line in grid)
    assert all("▫" in line for line in grid)


def test_the_audit_s_words_follow_every_interval(finished, tmp_path):
    from clinfed.core.seal import seal_run

    source, _ = finished
    run = tmp_path / "run"
    shutil.copytree(source, run)

    def attack(low, high):
        return {"auc": (low + high) / 2, "ci_low": low, "ci_high": high, "reading": "chance"}

    final = {"members": 40, "non_members": 40}
    final |= {"loss_threshold": attack(0.4, 0.6), "calibrated_loss": attack(0.42, 0.61)}
    beth = {"loss_threshold": attack(0.45, 0.55), "calibrated_loss": attack(0.566, 0.834)}
    audit = {"holdout_share": 0.1, "final_model": final, "site_updates": {"beth": beth}}
    (run / "audit.json").write_text(json.dumps(audit))
    seal_run(run)  # as clinfed audit seals what it writes
    page = (write_report(run) / "report.md").read_text()
    words = next(line for line in page.splitlines() if line.startswith("In plain words"))
    assert "better than chance" in words and "beth's last update" in words
    assert "0.566-0.834" in words and "no evidence of privacy" not in page
