"""Settings that would quietly mean nothing or spend budget for nothing are
refused by name, with the file's line."""

from __future__ import annotations

import math

import pytest
import torch

from clinfed.core.errors import ClinfedError
from clinfed.settings import RunConfig, load_file
from tests.test_cli import run_cli
from tests.test_engine import ScriptedTransport, engine, good


def test_a_byte_order_mark_is_not_a_setting(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b'\xef\xbb\xbftask = "i2b2"\nrounds = 2\n')
    assert load_file(path) == {"task": "i2b2", "rounds": 2}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('task = "i2b2"\n\nrounds = 1.5\n', "run.toml:3: rounds: expected an integer"),
        ('task = "i2b2"\n\nroundz = 1\n', "run.toml:3: unknown setting 'roundz'"),
        ('task = "i2b2"\n\nrounds = \n', "run.toml:3: not valid TOML"),
        ("[training]\nlr = 5.0\n", "run.toml:2: lr must be in (0, 1]"),
    ],
)
def test_an_error_in_a_settings_file_names_its_line(tmp_path, text, said):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ClinfedError) as refused:
        RunConfig.from_values(load_file(path), str(path)).validate(check_data=False)
    assert said in str(refused.value)


def test_a_strategy_option_the_chosen_strategy_lacks_is_refused_by_name(i2b2_corpus, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('task = "i2b2"\nstrategy = "fedprox"\n\n[strategy_options]\nmu = 0.5\n')
    result = run_cli(
        "train", "--config", str(path), "--strategy", "safl", "--data", str(i2b2_corpus),
        "--model", "tiny", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert result.returncode == 2 and "run.toml:5: mu is an option of fedprox" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--lr", "1e20", "--target-epsilon", "8"), "--lr must be in (0, 1]"),
        (("--head-lr", "50", "--target-epsilon", "8"), "--head-lr must be in (0, 1]"),
        (("--target-epsilon", "1e20"), "--accept-large-epsilon"),
    ],
)
def test_absurd_values_are_refused_before_any_charge(i2b2_corpus, tmp_path, flags, said):
    result = run_cli(
        "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--strategy", "fedavg", *flags, "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert result.returncode == 2 and said in result.stderr
    assert not (tmp_path / "run").exists()  # no folder, no ledger, no charge


def test_a_large_epsilon_runs_when_acknowledged():
    values = {"task": "i2b2", "strategy": "fedavg", "target_epsilon": 80.0}
    with pytest.raises(ClinfedError, match="above 50"):
        RunConfig.from_values(values).validate(check_data=False)
    RunConfig.from_values(values | {"accept_large_epsilon": True}).validate(check_data=False)


def test_a_run_whose_updates_all_diverge_says_why(tmp_path):
    def behave(site, message, attempt):
        reply = good(site, message)
        if message.kind == "train":
            reply.upload[next(iter(reply.upload))] = torch.tensor([math.nan, 0.0])
        return reply

    run = engine(tmp_path, rounds=1, min_sites=1)
    summary = run.run(ScriptedTransport(["a", "b"], behave))
    assert "NaN or Inf" in summary["stopped"] and "lower --lr" in summary["stopped"]


@pytest.mark.parametrize("command", ["predict", "convert", "warm-start"])
def test_no_writer_puts_its_output_inside_the_corpus_it_reads(
    i2b2_corpus, public_i2b2, tmp_path, command
):
    corpus = tmp_path / "corpus"
    import shutil

    shutil.copytree(i2b2_corpus, corpus)
    before = sorted(p.relative_to(corpus) for p in corpus.rglob("*"))
    inside = corpus / "test" / "out"
    if command == "predict":
        args = ("predict", str(tmp_path), "--data", str(corpus / "test"), "--out", str(inside))
    elif command == "convert":
        args = ("data", "convert", str(corpus), "--to", "conll", "--out", str(inside))
    else:
        args = (
            "warm-start", "--task", "i2b2", "--data", str(corpus), "--model", "tiny",
            "--public-data", str(public_i2b2), "--out", str(inside),
        )  # fmt: skip
    result = run_cli(*args)
    assert result.returncode == 2 and "is inside" in result.stderr, result.stderr
    assert sorted(p.relative_to(corpus) for p in corpus.rglob("*")) == before


def test_one_problem_is_reported_once_however_many_readers_meet_it():
    from clinfed.core.errors import ProblemLog

    problems = ProblemLog()
    for _ in range(3):  # format detection, then each reader, on one folder
        problems.add("/data/train/beth", None, "cannot read this folder (Permission denied)")
    problems.add("/data/train/beth", 3, "another problem")
    assert [str(p) for p in problems.problems] == [
        "/data/train/beth: cannot read this folder (Permission denied)",
        "/data/train/beth:3: another problem",
    ]


def test_a_sweep_resumes_only_the_sweep_it_was(i2b2_corpus, tmp_path):
    common = (
        "sweep", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--strategies", "fedavg", "--epsilons", "inf", "--max-length", "32", "--threads", "1",
    )  # fmt: skip
    out = tmp_path / "sweep"
    assert run_cli(*common, "--rounds", "1", "--out", str(out)).returncode == 0
    other = run_cli(*common, "--rounds", "2", "--out", str(out), "--resume")
    assert other.returncode == 2 and "rounds was 1, now 2" in other.stderr
    missing = run_cli(*common, "--out", str(tmp_path / "nothing"), "--resume")
    assert missing.returncode == 2 and "no sweep to resume" in missing.stderr
    assert not (tmp_path / "nothing").exists()
    empty = run_cli(*common[:8], ",", *common[9:], "--out", str(tmp_path / "empty"))
    assert empty.returncode == 2 and "at least one" in empty.stderr


@pytest.mark.parametrize("flags", [("--plan", "bogus"), ("--model", "nowhere"), ("--rounds", "0")])
def test_a_refused_demo_leaves_no_folder_behind(tmp_path, flags):
    result = run_cli("demo", "--out", str(tmp_path / "demo"), "--model", "tiny", *flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert not (tmp_path / "demo").exists()


def test_resume_of_nothing_says_so(tmp_path):
    result = run_cli("train", "--resume", "--out", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no run to resume" in result.stderr


def test_a_run_s_config_names_the_data_it_trained_on(i2b2_corpus, tmp_path):
    import json
    import shutil

    data = tmp_path / "data"
    shutil.copytree(i2b2_corpus, data)
    first = tmp_path / "first"
    result = run_cli(
        "train", "--task", "i2b2", "--data", "data", "--model", "tiny", "--strategy", "fedavg",
        "--rounds", "1", "--max-length", "32", "--threads", "1", "--out", str(first),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    saved = json.loads((first / "config.json").read_text())
    assert saved["data"]["data"] == str(data)  # absolute: the same data from any folder
    note = sorted(data.rglob("*.txt"))[0]
    note.write_bytes(note.read_bytes() + b"\n")  # the corpus changed since
    again = run_cli("train", "--config", str(first / "config.json"), "--out", str(tmp_path / "x"))
    assert again.returncode == 2 and "fingerprint differs" in again.stderr
