"""Federated runs survive SIGKILL: --resume ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .test_cli import run_cli

ARGS = [
    "--task",
    "i2b2",
    "--strategy",
    "fedprox",
    "--model",
    "tiny",
    "--rounds",
    "3",
    "--threads",
    "1",
]


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", *ARGS, "--data", str(data), "--out", str(out), *extra]


def test_sigkill_mid_round_then_resume_gives_the_same_final_weights(i2b2_corpus, tmp_path):
    reference = run_cli(*train_args(i2b2_corpus, tmp_path / "whole"))
    assert reference.returncode == 0, reference.stderr

    run = tmp_path / "killed"
    code = "import sys; from clinfed.commands import main; sys.exit(main())"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *train_args(i2b2_corpus, run)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Wait until round 2 is under way: a site has trained it (its copy of
    # global round 1 is saved) before the round commits.
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list((run / "sites").glob("*/copy.r0001.safetensors")):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads((run / "state.json").read_text())["round"] == 1

    resumed = run_cli(*train_args(i2b2_corpus, run, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    a = load_file(str(tmp_path / "whole" / "model" / "model.safetensors"))
    b = load_file(str(run / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # the interrupted round's lines were dropped: one record per round and client
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["round"], r.get("site")) for r in records]
    assert len(keys) == len(set(keys)) == 3 * 4  # 3 rounds x (3 sites + 1 global record)
    whole = [
        json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["f1"] for r in records if "site" not in r] == [
        r["f1"] for r in whole if "site" not in r
    ]


def test_resume_with_a_different_config_is_refused_and_changes_nothing(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    first = run_cli(*train_args(i2b2_corpus, run, "--rounds", "1"))
    assert first.returncode == 0, first.stderr
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = run_cli(*train_args(i2b2_corpus, run, "--rounds", "1", "--seed", "5", "--resume"))
    assert again.returncode == 2
    assert "different config: --seed was 0, now 5" in again.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sites", "500"], "more than the"),
        (["--sites", "2", "--partition", "sites"], "needs --partition iid or dirichlet"),
        (["--fraction", "0"], "--fraction must be in (0, 1]"),
        (["--resume"], "no run to resume"),
    ],
)
def test_impossible_federated_configurations_exit_2(i2b2_corpus, tmp_path, extra, message):
    result = run_cli(*train_args(i2b2_corpus, tmp_path / "run", *extra))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
