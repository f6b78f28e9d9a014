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
from clinfed.core.runs import read_jsonl

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


def run_installed(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed console script in a subprocess."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "clinfed"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
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
        ["privacy", "clip-norm"],
        ["report"],
        ["audit"],
    ):
        result = run_cli(*args, "--help")
        assert result.returncode == 0, result.stderr
        assert "Usage" in result.stdout
    # Settings are grouped by concern (every one under --help-all), and the
    # installed script runs.
    shown = run_installed("train", "--help-all")
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
        "--strategy",
        "centralized",
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
        (["--strategy", "fedsomething"], "Invalid value for '--strategy': 'fedsomething'"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--max-length", "4"], "--max-length must be at least 8"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--strategy", "fedavg", "--mu", "0.1"], "--mu does not apply to --strategy fedavg"),
        (["--model", "/no/such/model"], "not 'minilm', 'tiny', a folder with a config.json"),
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
        f'task = "i2b2"\ndata = "{i2b2_corpus}"\nmax_length = 32\n'
        '[federation]\nstrategy = "fedavg"\nrounds = 1\n'
        '[model]\nmodel = "tiny"\n[training]\nbatch_size = 8\n'
        "[machine]\nthreads = 1\n"  # beside the other test worker: one thread each
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


# ------------------------------------------------------ conventions, exit codes
TINY_FEDERATED = ("--task", "i2b2", "--model", "tiny", "--max-length", "32", "--threads", "1")


def test_version_names_clinfed_and_its_libraries():
    from clinfed import __version__

    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith(f"clinfed {__version__} (torch ")


def test_shell_completion_script_is_offered():
    # What `clinfed --show-completion` prints once it knows the shell (it
    # detects the parent shell, which a test's process tree may not have).
    result = run_installed(env={"_CLINFED_COMPLETE": "source_bash"})
    assert result.returncode == 0 and "_CLINFED_COMPLETE" in result.stdout
    assert "complete -o" in result.stdout


def test_a_run_no_site_can_afford_is_refused_before_anything_is_written(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "2",
        "--target-epsilon", "0.5", "--noise-multiplier", "0.5",
        "--data", str(i2b2_corpus), "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 2
    assert "no site can train round 1 within its privacy budget" in result.stderr
    assert not out.exists()


def test_a_run_that_stops_early_exits_1(i2b2_corpus, tmp_path, monkeypatch):
    from clinfed.federated.engine import RoundEngine

    original = RoundEngine.run_round

    def stop_in_round_2(self, transport, round_number):
        if round_number == 2:
            self.stopped = "stopped in round 2: fewer than 1 sites replied"
            return False
        return original(self, transport, round_number)

    monkeypatch.setattr(RoundEngine, "run_round", stop_in_round_2)
    out = tmp_path / "run"
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "3")
    result = run_cli(*args, "--data", str(i2b2_corpus), "--out", str(out), "--json")
    assert result.returncode == 1
    summary = json.loads(result.stdout)
    assert summary["stopped"].startswith("stopped in round 2") and summary["wall_s"] > 0
    assert json.loads((out / "summary.json").read_text())["stopped"] == summary["stopped"]


def test_ctrl_c_says_how_to_resume(i2b2_corpus, tmp_path, monkeypatch):
    from clinfed.federated.engine import RoundEngine

    def interrupted(self, transport, round_number):
        raise KeyboardInterrupt

    monkeypatch.setattr(RoundEngine, "run_round", interrupted)
    out = tmp_path / "run"
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "2")
    result = run_cli(*args, "--data", str(i2b2_corpus), "--out", str(out))
    assert result.returncode == 130
    assert f"clinfed train --config {out / 'config.json'} --out {out} --resume" in result.stderr


def test_logs_outside_a_terminal_are_one_timestamped_line_per_event(i2b2_corpus, tmp_path):
    import re

    out = tmp_path / "run"
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1")
    result = run_cli(*args, "--data", str(i2b2_corpus), "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")
    assert lines and all(stamp.match(line) for line in lines)
    assert any("round 1 beth:" in line for line in lines)
    assert "wall time" in result.stdout
    quiet = run_cli("--quiet", *args, "--data", str(i2b2_corpus), "--out", str(tmp_path / "q"))
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_report_and_sweep_print_json(i2b2_corpus, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "sweep", *TINY_FEDERATED, "--strategies", "fedavg", "--epsilons", "inf",
        "--rounds", "1", "--data", str(i2b2_corpus), "--out", str(sweep), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == 1 and rows[0]["target_epsilon"] == "inf"
    report = run_cli("report", str(sweep / "fedavg-epsinf-seed0"), "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["differential_privacy"] is False


@pytest.mark.heavy
def test_the_documented_python_api_example_runs_as_written(tmp_path, monkeypatch):
    # On one core, as every test that trains: the example takes every core
    # by default (threads 0), and two threads against the other worker's
    # one spin (115 s in CI against 39 s alone).
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    page = (Path(__file__).resolve().parents[1] / "docs" / "commands.md").read_text()
    section = page.split("## Python API", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        namespace: dict = {}
        exec(compile(code, "docs/commands.md", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(previous)
    summary = namespace["summary"]
    assert set(summary["epsilon"]) == {"beth", "partners", "site3"}
    assert all(0 < e <= 8.0 for e in summary["epsilon"].values())
    assert (tmp_path / namespace["page"]).is_file()
    import clinfed
    from clinfed.core.errors import ClinfedError

    # The library's words, unchanged: the setting as a keyword, no flag.
    with pytest.raises(ClinfedError, match="^`rounds` must be at least 1") as refused:
        clinfed.train(tmp_path / "data", tmp_path / "again", rounds=0)
    assert "--" not in str(refused.value)


def test_report_to_tensorboard_writes_event_files_with_each_rounds_figures(i2b2_corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "2")
    result = run_cli(
        *args, "--target-epsilon", "8", "--report-to", "tensorboard",
        "--data", str(i2b2_corpus), "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"global/f1", "beth/mb_up", "beth/epsilon"} <= tags
    assert [e.step for e in events.Scalars("beth/epsilon")] == [1, 2]
    assert [e.step for e in events.Scalars("global/f1")] == [1, 2]


def test_the_demo_runs_the_private_federated_path_end_to_end(tmp_path):
    out = tmp_path / "demo"
    # Two threads: the private run and its reference side by side, one each
    # (the shipped path on 2 cores); the test below takes the one-core path.
    args = ("demo", "--model", "tiny", "--docs", "3", "--rounds", "1", "--threads", "2")
    result = run_cli(*args, "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert set(summary["epsilon"]) == {"beth", "partners", "site3"}
    assert all(0 < eps <= 8.0 for eps in summary["epsilon"].values())
    assert 0 <= summary["f1_private"] <= 1 and 0 <= summary["f1_no_dp"] <= 1
    assert 0 < summary["ratio_to_fedavg_up"] < 1  # bias terms and head: part of the model
    audit = json.loads((out / "private" / "audit.json").read_text())
    # The audit rebuilt the run's start (bias plan: its shared entries, by digest).
    assert audit["starting_model"]["matches_run"] is True
    assert Path(summary["report"]).is_file()
    for site in summary["epsilon"]:
        assert (out / "private" / "privacy" / f"{site}.jsonl").is_file()
    policy = json.loads((out / "private" / "privacy" / "policy.json").read_text())
    assert policy["relation"] == "add-remove"  # the count released once, under noise
    assert not (out / "no-dp" / "privacy").exists()
    # Both runs start from the same public warm start (the shipped text).
    starts = [json.loads((out / run / "state.json").read_text())["digests"]["0"]
              for run in ("private", "no-dp")]  # fmt: skip
    assert starts[0] == starts[1]
    public = json.loads((out / "private" / "config.json").read_text())["public_start"]
    assert public["types"] == ["problem", "test", "treatment"]  # public notes: every type
    assert public["model"] == str((out / "start").resolve())  # warm-started once, for both
    # The public notes are other notes than any hospital's.
    hospitals = {p.read_bytes() for p in (out / "data").rglob("*.txt")}
    notes = {p.read_bytes() for p in (out / "public").rglob("*.txt")}
    assert notes and not notes & hospitals
    # The server checks each round on public notes of yet other patients,
    # in the private run and its reference alike.
    checked = {p.read_bytes() for p in (out / "public-check").rglob("*.txt")}
    assert checked and not checked & (hospitals | notes)
    # As many notes as the hospitals hold, in each hospital's style.
    styles = {p.name for p in (out / "public-check").glob("*/*")}
    assert len(checked) == len(hospitals) and styles == {"beth", "partners", "site3"}
    for run in ("private", "no-dp"):
        config = json.loads((out / run / "config.json").read_text())
        assert config["public_check_text"]["folder"] == str(out / "public-check")
        rounds = [r for r in read_jsonl(out / run / "metrics.jsonl") if "site" not in r]
        assert all(isinstance(r["public_check"]["kept"], bool) for r in rounds)
    assert 0 <= summary["f1_start"] <= 1 and summary["public"] == "notes"
    content = json.loads((out / "private" / "report" / "privacy.json").read_text())
    assert content["reference_f1"] == pytest.approx(summary["f1_no_dp"])
    again = run_cli(*args, "--out", str(out))
    assert again.returncode == 2 and "choose a new" in again.stderr


@pytest.mark.slow  # a variant of the demo's end-to-end test above: only its public text differs
def test_the_demo_can_start_from_the_shipped_pubmed_text(tmp_path):
    out = tmp_path / "demo"
    args = ("demo", "--model", "tiny", "--docs", "2", "--rounds", "1", "--threads", "1")
    result = run_cli(*args, "--public", "pubmed", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    public = json.loads((out / "private" / "config.json").read_text())["public_start"]
    assert public["examples"] == 2000 and public["types"] == ["problem", "treatment"]
    assert not (out / "public").exists()


def test_the_demo_s_reference_run_fails_in_its_process_as_the_caller_s_clear_error(
    i2b2_corpus, tmp_path
):
    from clinfed.core.errors import ClinfedError
    from clinfed.runners.demo import private_and_reference
    from clinfed.settings import RunConfig

    common = {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32}
    common |= {"rounds": 1, "seed": 0}
    private = RunConfig.of(
        data=str(i2b2_corpus), out=str(tmp_path / "private"), target_epsilon=8.0, **common
    )
    missing = tmp_path / "no-such-corpus"
    reference = RunConfig.of(data=str(missing), out=str(tmp_path / "no-dp"), **common)
    steps = []
    with pytest.raises(ClinfedError, match="no-such-corpus"):
        private_and_reference(private, reference, 2, steps.append, lambda event: None)
    assert any("beside it" in step for step in steps)  # two cores: side by side
    assert (tmp_path / "private" / "summary.json").is_file()  # the private run still ended


def test_the_demo_s_reference_process_silences_the_libraries_progress_bars(monkeypatch):
    # The reference run trains in a spawned process, which starts with the
    # libraries' defaults: datasets' per-map bars would fill the demo's output.
    import datasets

    from clinfed.runners import demo, pipeline

    sent = []

    class Results:
        send = staticmethod(sent.append)

    monkeypatch.setattr(pipeline, "run_training", lambda config: datasets.is_progress_bar_enabled())
    datasets.enable_progress_bars()
    try:
        demo._train_beside(None, Results())
    finally:
        datasets.disable_progress_bars()
    assert sent == [("done", False)]


def test_an_external_validation_site_is_scored_like_its_predictions(tmp_path):
    corpus = tmp_path / "corp"
    assert run_cli("data", "synth", "i2b2", "--out", str(corpus), "--sites", "3",
                   "--docs", "4").returncode == 0  # fmt: skip
    external = corpus / "test" / "external"
    for kind in ("txt", "concepts"):
        (external / kind).mkdir(parents=True)
        for path in (corpus / "test").glob(f"*/{kind}/*"):
            if path.parent.parent != external:
                path.rename(external / kind / path.name)
    out = tmp_path / "run"
    result = run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
                     "--data", str(corpus), "--out", str(out), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluated_sites"] == 1
    scored = run_cli("score", "--task", "i2b2", "--gold", str(corpus / "test"),
                     "--pred", str(out / "predictions"), "--json")  # fmt: skip
    assert summary["f1"] == pytest.approx(json.loads(scored.stdout)["exact"]["micro"]["f1"])
    assert summary["f1"] > 0


def test_target_epsilon_inf_says_not_private_first_and_writes_standard_json(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
            "--target-epsilon", "inf", "--data", str(i2b2_corpus))  # fmt: skip
    result = run_cli(*args, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stderr.lstrip().splitlines()[0].startswith("not private")

    def refuse(name):
        raise ValueError(f"not standard JSON: {name}")

    config = json.loads((out / "config.json").read_text(), parse_constant=refuse)
    assert config["privacy"]["target_epsilon"] == "inf"
    again = run_cli("train", "--config", str(out / "config.json"), "--data", str(i2b2_corpus),
                    "--out", str(tmp_path / "again"))  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert (
        json.loads((tmp_path / "again" / "config.json").read_text())["privacy"]["target_epsilon"]
        == "inf"
    )


def test_task_defaults_as_the_help_says(i2b2_corpus, tmp_path):
    result = run_cli("train", "--model", "tiny", "--max-length", "32", "--strategy", "fedavg",
                     "--rounds", "1", "--threads", "1", "--data", str(i2b2_corpus),
                     "--out", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_resume_repairs_a_torn_metrics_line_and_refuses_a_damaged_one(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "2",
            "--data", str(i2b2_corpus), "--out", str(out))  # fmt: skip
    assert run_cli(*args).returncode == 0
    metrics = out / "metrics.jsonl"
    with open(metrics, "ab") as fh:  # a crash in the middle of an append
        fh.write(b'{"round": 3, "cli')
    # A finished run's seal says what its records were: a tail added since
    # is refused. A run that died before sealing (no seal) is repaired.
    sealed = run_cli(*args, "--resume")
    assert sealed.returncode == 2 and f"{metrics}: changed since the run sealed it" in sealed.stderr
    (out / "seal.json").unlink()
    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert all(line.endswith("}") for line in metrics.read_text().splitlines())
    lines = metrics.read_bytes().split(b"\n")
    lines[1] = lines[1][: len(lines[1]) // 2]  # a damaged line inside the committed part
    metrics.write_bytes(b"\n".join(lines))
    refused = run_cli(*args, "--resume")
    assert refused.returncode == 2
    assert f"{metrics}:2: not a JSON record" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_report_refuses_a_ledger_it_cannot_verify(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    # The bias plan keeps the run short; the ledgers are the same either way.
    assert run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "3",
                   "--adapter", "bias", "--target-epsilon", "8", "--data", str(i2b2_corpus),
                   "--out", str(out)).returncode == 0  # fmt: skip
    assert run_cli("report", str(out)).returncode == 0
    copy = out / "privacy" / "beth.jsonl"
    whole = copy.read_bytes()
    # Sealed, any edit is refused by name; below, the ledger checks alone
    # (a run folder from before seals) must catch each.
    copy.write_bytes(whole + whole.splitlines(keepends=True)[-1])
    sealed = run_cli("report", str(out))
    assert sealed.returncode == 2 and f"{copy}: changed since the run sealed it" in sealed.stderr
    copy.write_bytes(whole)
    (out / "seal.json").unlink()

    def up_to_round_one(data: bytes) -> bytes:
        lines = data.splitlines(keepends=True)
        return b"".join(x for x in lines if json.loads(x)["round"] <= 1)

    copy.write_bytes(up_to_round_one(whole))  # only round 1 kept (and round 0's count)
    refused = run_cli("report", str(out))
    assert refused.returncode == 2 and f"{copy}: no charge for round 2" in refused.stderr
    copy.write_bytes(whole)
    own = out / "sites" / "beth" / "privacy" / "beth.jsonl"
    own.write_bytes(up_to_round_one(own.read_bytes()))
    refused = run_cli("report", str(out))
    assert refused.returncode == 2 and str(own) in refused.stderr


def test_count_settings_have_stated_bounds_and_a_huge_line_is_refused(tmp_path):
    refused = run_cli("train", "--rounds", "99999999999999999999", "--data", str(tmp_path),
                      "--out", str(tmp_path / "run"))  # fmt: skip
    assert refused.returncode == 2 and "--rounds must be at most 10000" in refused.stderr
    corpus = tmp_path / "corp"
    assert run_cli("data", "synth", "i2b2", "--out", str(corpus), "--sites", "1",
                   "--docs", "5").returncode == 0  # fmt: skip
    note = sorted((corpus / "train").rglob("txt/*.txt"))[0]
    note.write_text(note.read_text() + " ".join(["word"] * 10_001) + "\n")
    result = run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
                     "--data", str(corpus), "--out", str(tmp_path / "run"))  # fmt: skip
    assert result.returncode == 2
    lines = len(note.read_text().splitlines())
    assert f"{note}:{lines}: a line of 10,001 tokens; at most 10,000" in result.stderr


def test_resume_needs_only_the_run_folder_and_refuses_other_flags(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    args = ("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "2",
            "--data", str(i2b2_corpus), "--out", str(out))  # fmt: skip
    assert run_cli(*args).returncode == 0
    assert run_cli("train", "--resume", "--out", str(out)).returncode == 0
    # what only this machine decides may change: a run moved to a machine with
    # other cores resumes
    moved = run_cli("train", "--resume", "--out", str(out), "--threads", "2",
                    "--eval-batch-size", "8")  # fmt: skip
    assert moved.returncode == 0, moved.stderr
    other = run_cli("train", "--resume", "--out", str(out), "--lr", "0.5")
    assert other.returncode == 2 and "different config: --lr was" in other.stderr
    inside = run_cli(*args[:-2], "--out", str(i2b2_corpus / "runs" / "x"))
    assert inside.returncode == 2 and "is inside --data" in inside.stderr
    assert not (i2b2_corpus / "runs").exists()
    predicted = run_cli("predict", str(out), "--data", str(i2b2_corpus / "test"),
                        "--out", str(out))  # fmt: skip
    assert predicted.returncode == 2
    assert "choose a new --out for the predictions" in predicted.stderr


def test_data_check_applies_the_rule_train_applies_to_a_note_without_annotations(tmp_path):
    corpus = tmp_path / "corp"
    assert run_cli("data", "synth", "i2b2", "--out", str(corpus), "--sites", "1",
                   "--docs", "4").returncode == 0  # fmt: skip
    con = sorted((corpus / "train").rglob("concept/*.con"))[0]
    con.unlink()
    checked = run_cli("data", "check", str(corpus / "train"), "--task", "i2b2")
    assert checked.returncode == 2 and "no .con file beside this .txt" in checked.stderr
    trained = run_cli("train", *TINY_FEDERATED, "--strategy", "fedavg", "--rounds", "1",
                      "--data", str(corpus), "--out", str(tmp_path / "run"))  # fmt: skip
    assert trained.returncode == 2 and "no .con file beside this .txt" in trained.stderr


def test_the_strategies_command_the_help_cites_lists_every_strategy():
    from clinfed.federated.strategies import STRATEGIES

    result = run_cli("strategies", "--json")
    assert result.returncode == 0
    rows = {row["strategy"]: row for row in json.loads(result.stdout)}
    assert set(rows) == set(STRATEGIES) and all(row["summary"] for row in rows.values())
    assert rows["safl"]["options"][0] == "--top-layers"
    from clinfed.settings import schema_fields

    assert "clinfed strategies" in schema_fields()["strategy"].metadata["help"]


def test_version_answers_without_importing_torch():
    import subprocess
    import sys

    code = (
        "import sys; from clinfed.commands import main; main(['--version']); "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, loaded = done.stdout.strip().splitlines()
    assert first.startswith("clinfed ") and "torch" in first and loaded == "False"


def test_train_help_shows_the_essentials_and_help_all_every_flag_uncut(monkeypatch):
    # In this process (the installed script's help: test_help_on_every_command);
    # rich reads the width from COLUMNS as a terminal would set it.
    monkeypatch.setenv("COLUMNS", "80")
    short = run_cli("train", "--help")
    assert short.returncode == 0
    for flag in ("--data", "--task", "--model", "--strategy", "--target-epsilon", "--rounds",
                 "--out", "--help-all"):  # fmt: skip
        assert flag in short.stdout
    assert "--lr " not in short.stdout and "--gazetteer" not in short.stdout
    full = run_cli("train", "--help-all")
    assert full.returncode == 0 and "--lr " in full.stdout and "--gazetteer" in full.stdout
    assert max(len(line) for line in full.stdout.splitlines()) <= 80
    assert "…" not in full.stdout  # no flag name (nor anything else) cut at 80 columns
    warm = run_cli("warm-start", "--help")
    assert "--public-data" in warm.stdout and "--strategy" not in warm.stdout
    assert "--rounds" not in warm.stdout


def test_an_error_naming_a_path_in_brackets_prints_it_verbatim(tmp_path, capsys):
    """Brackets in an error are text (a file name, "clinfed[terminology]"),
    never rich markup that silently drops them."""
    missing = tmp_path / "notes[site1]"
    assert main(["data", "check", str(missing), "--task", "i2b2"]) == 2
    assert "notes[site1]" in capsys.readouterr().err


def test_a_private_run_logged_to_a_file_says_where_it_is_and_what_next_and_warns_of_nothing(
    i2b2_corpus, tmp_path
):
    # The README's first run (synthetic hospitals, --target-epsilon 8), on
    # the tiny model, its log going to a file: each round says when it
    # starts and, as the next starts, its time and the time left; no warning.
    result = run_cli(
        "train", "--data", str(i2b2_corpus), "--model", "tiny", "--max-length", "32",
        "--rounds", "2", "--local-epochs", "1", "--threads", "1", "--target-epsilon", "8",
        "--out", str(tmp_path / "first"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "warning" not in result.stderr.lower(), result.stderr

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    left = first("round 1/2 trained in ")
    assert "left" in lines[left] and first("round 1/2 started") < left
    assert left < first("round 2 beth:")  # before round 2 ends
    assert first("round 2/2 trained and evaluated in") > left
    # It ends with the run folder's size and the next command, which prints
    # the report's verdicts.
    run = tmp_path / "first"
    assert result.stdout.strip().splitlines()[-1].startswith(f"next: clinfed report {run}")
    assert f"run folder {run} (" in result.stdout and " MB)" in result.stdout
    report = run_cli("report", str(run))
    assert report.returncode == 0, report.stderr
    assert "- beth: within budget. Epsilon" in report.stdout and "**" not in report.stdout


def test_every_command_s_help_fits_80_columns_with_nothing_cut(monkeypatch):
    # Every command and group the CLI has, walked from the app itself, so a
    # new command is covered without being listed here.
    import click
    import typer

    from clinfed.commands.common import app

    monkeypatch.setenv("COLUMNS", "80")
    assert run_cli("--help").returncode == 0  # registers every command group

    def paths(command: click.Command, path: list[str]):
        yield path
        if isinstance(command, click.Group):
            for name, sub in sorted(command.commands.items()):
                if not sub.hidden:
                    yield from paths(sub, [*path, name])

    walked = list(paths(typer.main.get_command(app), []))
    assert ["flower", "supernode"] in walked and ["privacy", "epsilon"] in walked
    for path in walked:
        shown = run_cli(*path, "--help")
        assert shown.returncode == 0, (path, shown.stderr)
        assert "…" not in shown.stdout, (path, [x for x in shown.stdout.splitlines() if "…" in x])
        assert max(len(line) for line in shown.stdout.splitlines()) <= 80, path


def test_a_mistyped_command_or_flag_gets_one_error_style_and_one_suggestion():
    typo = run_cli("trian")
    assert typo.returncode == 2
    assert (
        typo.stderr.count("Did you mean") == 1 and "error: No such command 'trian'" in typo.stderr
    )
    assert "Error:" not in typo.stderr
    flag = run_cli("train", "--rounds", "x")
    assert flag.returncode == 2 and "error: Invalid value for '--rounds'" in flag.stderr
    assert "Try 'clinfed train --help' for help." in flag.stderr


def test_the_python_api_covers_plan_warm_start_export_and_audit(tiny_run, public_i2b2, tmp_path):
    import clinfed

    shown = dir(clinfed)
    for name in ("warm_start", "train", "report", "audit", "export", "plan"):
        assert name in shown and callable(getattr(clinfed, name))
    assert "Any" not in shown
    rows = clinfed.plan([1520, 1400], epsilons=(8.0,), rounds=3)
    assert [r["site"] for r in rows] == ["site1", "site2"]
    assert rows[0]["epsilon_by_round"][-1] <= 8.0 and rows[0]["relation"] == "add-remove"
    start = clinfed.warm_start(public_i2b2, tmp_path / "start", model="tiny", max_length=32,
                               public_epochs=1, threads=1)  # fmt: skip
    assert start["examples"] > 0 and (tmp_path / "start" / "model.json").is_file()
    tiny_run(tmp_path / "run", model=str(tmp_path / "start"), audit_holdout=0.2)
    assert clinfed.audit(tmp_path / "run", max_examples=20)["final_model"]
    record = clinfed.export(tmp_path / "run", tmp_path / "hf")
    assert record["labels"] and (tmp_path / "hf" / "README.md").is_file()
    with pytest.raises(clinfed.api.ClinfedError, match="already exists|not empty"):
        clinfed.export(tmp_path / "run", tmp_path / "hf")


def test_every_command_that_computes_takes_the_machine_s_threads(tmp_path):
    # A shared machine's thread count, as train's --threads; evaluate,
    # predict, audit and clip-norm also take --device.
    for command in (["train"], ["warm-start"], ["sweep"], ["evaluate"], ["predict"],
                    ["export"], ["audit"], ["privacy", "clip-norm"]):  # fmt: skip
        shown = run_cli(*command, "--help-all" if command == ["train"] else "--help")
        assert "--threads" in shown.stdout, command
    for command in (["evaluate"], ["predict"], ["audit"], ["privacy", "clip-norm"]):
        assert "--device" in run_cli(*command, "--help").stdout, command
    # A device this machine lacks is refused by name before any work.
    folder = str(tmp_path)
    for command in (
        ["audit", folder],
        ["privacy", "clip-norm", folder, "--data", folder],
    ):
        refused = run_cli(*command, "--device", "tpu")
        assert refused.returncode == 2 and "--device tpu" in refused.stderr, refused.stderr
