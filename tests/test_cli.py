"""The clinfed command end to end, and how it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clinfed.commands import main

from .conftest import CANARY


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The command in this process (flags, files, exit status and output as a
    user sees them, without a new interpreter per call)."""
    import contextlib
    import io

    from clinfed.commands import main

    stdout, stderr = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(list(args))
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def run_installed(*args: str) -> subprocess.CompletedProcess:
    """The installed console script in a subprocess."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "clinfed"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        timeout=600,
    )


def test_help_on_every_command():
    for args in (
        [],
        ["data"],
        ["data", "synth"],
        ["data", "check"],
        ["score"],
        ["train"],
        ["sweep"],
        ["flower", "run"],
        ["baseline"],
        ["privacy"],
        ["privacy", "epsilon"],
        ["privacy", "noise"],
        ["report"],
        ["audit"],
    ):
        result = run_cli(*args, "--help")
        assert result.returncode == 0, result.stderr
        assert "Usage" in result.stdout
    # Settings are grouped by concern, and the installed script runs.
    shown = run_installed("train", "--help")
    assert shown.returncode == 0, shown.stderr
    for panel in (
        "Task and data",
        "Local training",
        "Federation",
        "Strategy options",
        "Privacy (DP-SGD)",
        "Machine",
    ):
        assert panel in shown.stdout, panel
    assert "--freeze-from" in shown.stdout and "--server-lr" in shown.stdout


def test_data_check_json_keys(i2b2_corpus, mimic_corpus, capsys):
    assert main(["data", "check", str(i2b2_corpus / "train"), "--task", "i2b2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {"documents", "concepts", "sites"} <= set(summary)
    assert set(summary["concepts"]) == {"problem", "test", "treatment"}
    assert main(["data", "check", str(mimic_corpus), "--task", "mimic3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {"admissions", "notes", "label_counts"} <= set(summary)
    assert all(isinstance(v, int) for v in summary["label_counts"].values())


def test_train_centralized_i2b2_writes_a_complete_run_folder(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        "train",
        "--task",
        "i2b2",
        "--data",
        str(i2b2_corpus),
        "--strategy",
        "centralized",
        "--model",
        "tiny",
        "--epochs",
        "2",
        "--out",
        str(run),
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert all(0.0 <= r["f1"] <= 1.0 and r["tokens_per_s"] > 0 for r in records)
    config = json.loads((run / "config.json").read_text())
    assert config["federation"]["strategy"] == "centralized"
    assert config["data"]["max_length"] == 128
    assert "head.weight" in load_file(str(run / "model" / "model.safetensors"))
    predictions = sorted(p.stem for p in (run / "predictions").glob("*.con"))
    assert predictions == sorted(p.stem for p in (i2b2_corpus / "test").rglob("*.txt"))
    # the written predictions are scorable and agree with the last epoch's f1
    scored = run_cli(
        "score",
        "--task",
        "i2b2",
        "--gold",
        str(i2b2_corpus / "test"),
        "--pred",
        str(run / "predictions"),
        "--json",
    )
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["exact"]["micro"]["f1"] == pytest.approx(records[-1]["f1"])


def test_train_centralized_mimic3_and_no_note_text_in_any_file(mimic_corpus, tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        "train",
        "--task",
        "mimic3",
        "--data",
        str(mimic_corpus),
        "--model",
        "tiny",
        "--epochs",
        "1",
        "--top-k",
        "10",
        "--max-length",
        "64",
        "--max-chunks",
        "3",
        "--out",
        str(run),
    )
    assert result.returncode == 0, result.stderr
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {
        "f1",
        "micro_f1",
        "macro_f1",
        "macro_f1_mean",
        "micro_auc",
        "macro_auc",
        "p_at_5",
    } <= set(record)
    header = (run / "predictions" / "predictions.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["HADM_ID", "CODES"] and len(header) == 12
    for path in run.rglob("*"):
        if path.is_file() and path.suffix != ".safetensors":
            assert CANARY not in path.read_text(errors="ignore"), path
    assert CANARY not in result.stdout + result.stderr
    scored = run_cli(
        "score",
        "--task",
        "mimic3",
        "--gold",
        str(mimic_corpus),
        "--pred",
        str(run / "predictions" / "predictions.csv"),
        "--json",
    )
    assert scored.returncode == 0, scored.stderr
    result = json.loads(scored.stdout)
    assert result["labels"] == 10
    for key in ("micro_f1", "macro_f1", "micro_auc", "p_at_5"):
        assert result[key] == pytest.approx(record[key], abs=1e-4), key


def test_bad_data_exits_2_with_one_line_per_problem_and_no_traceback(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "record-1.txt").write_text("Secretword fever .\n")
    (data / "record-1.con").write_text('c="fever" 1:7 1:7||t="problem"\nnonsense\n')
    result = run_cli("data", "check", str(data), "--task", "i2b2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"error: {data / 'record-1.con'}:1: token offset 7 past the end of line 1 (3 tokens)",
        f"error: {data / 'record-1.con'}:2: malformed concept line "
        '(expected c="..." L:T L:T||t="...")',
    ]
    assert "Traceback" not in result.stderr and "secretword" not in result.stderr.lower()
    skipped = run_cli("data", "check", str(data), "--task", "i2b2", "--on-error", "skip", "--json")
    assert skipped.returncode == 0 and len(json.loads(skipped.stdout)["problems"]) == 2


def test_an_existing_run_folder_is_never_touched(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "keep.txt").write_text("earlier results")
    result = run_cli(
        "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny", "--out", str(run)
    )
    assert result.returncode == 2 and "already exists" in result.stderr
    assert [p.name for p in run.iterdir()] == ["keep.txt"]
    assert (run / "keep.txt").read_text() == "earlier results"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy", "fedsomething"], "--strategy must be one of"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--max-length", "4"], "--max-length must be at least 8"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--strategy", "fedavg", "--mu", "0.1"], "--mu does not apply to --strategy fedavg"),
        (["--model", "/no/such/model"], "not 'minilm', 'tiny' or a folder"),
        (
            ["--model", "tiny", "--strategy", "safl", "--top-layers", "3"],
            "--top-layers 3 exceeds the model's 2 layers",
        ),
    ],
)
def test_bad_flags_exit_2(i2b2_corpus, tmp_path, args, message):
    result = run_cli(
        "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--out", str(tmp_path / "run"), *args
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_baselines_cli(i2b2_corpus, mimic_corpus, capsys):
    assert (
        main(
            [
                "baseline",
                "--task",
                "i2b2",
                "--data",
                str(i2b2_corpus),
                "--kind",
                "dictionary",
                "--json",
            ]
        )
        == 0
    )
    assert 0 < json.loads(capsys.readouterr().out)["f1"] < 1
    for kind in ("frequency", "keyword"):
        assert (
            main(
                [
                    "baseline",
                    "--task",
                    "mimic3",
                    "--data",
                    str(mimic_corpus),
                    "--kind",
                    kind,
                    "--top-k",
                    "10",
                    "--json",
                ]
            )
            == 0
        )
        assert 0 <= json.loads(capsys.readouterr().out)["micro_f1"] <= 1
    assert (
        main(["baseline", "--task", "i2b2", "--data", str(i2b2_corpus), "--kind", "keyword"]) == 2
    )


def test_config_file_evaluate_and_predict(i2b2_corpus, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        f'task = "i2b2"\ndata = "{i2b2_corpus}"\n[federation]\nstrategy = "fedavg"\n'
        'rounds = 1\n[model]\nmodel = "tiny"\n[training]\nbatch_size = 8\n'
    )
    run = tmp_path / "run"
    result = run_cli("train", "--config", str(config), "--rounds", "2", "--out", str(run))
    assert result.returncode == 0, result.stderr
    saved = json.loads((run / "config.json").read_text())
    assert (saved["federation"]["strategy"], saved["federation"]["rounds"]) == ("fedavg", 2)
    assert saved["training"]["batch_size"] == 8
    final = json.loads((run / "summary.json").read_text())

    evaluated = run_cli("evaluate", str(run), "--data", str(i2b2_corpus / "test"), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["f1"] == pytest.approx(final["f1"])

    predicted = run_cli(
        "predict", str(run), "--data", str(i2b2_corpus / "test"), "--out", str(tmp_path / "pred")
    )
    assert predicted.returncode == 0, predicted.stderr
    assert sorted(p.name for p in (tmp_path / "pred").iterdir()) == sorted(
        p.name for p in (run / "predictions").iterdir()
    )

    config.write_text("bogus = 1\n")
    bad = run_cli("train", "--config", str(config), "--out", str(tmp_path / "other"))
    assert bad.returncode == 2 and "unknown setting 'bogus'" in bad.stderr
    config.write_text("rouds = 1\n")
    bad = run_cli("train", "--config", str(config), "--out", str(tmp_path / "other"))
    assert bad.returncode == 2 and "did you mean 'rounds'" in bad.stderr
    config.write_text("rounds = 1.5\n")
    bad = run_cli("train", "--config", str(config), "--out", str(tmp_path / "other"))
    assert bad.returncode == 2 and "expected an integer" in bad.stderr

    # The run's own config.json is a settings file: the same run again.
    again = tmp_path / "again"
    result = run_cli("train", "--config", str(run / "config.json"), "--out", str(again))
    assert result.returncode == 0, result.stderr
    first = load_file(str(run / "model" / "model.safetensors"))
    second = load_file(str(again / "model" / "model.safetensors"))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((again / "summary.json").read_text())["f1"] == pytest.approx(final["f1"])
