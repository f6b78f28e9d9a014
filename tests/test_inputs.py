"""No input hangs and no writer writes inside what runs read: every file a
user names is refused (exit 2) if it is a FIFO, device or folder, before it
is opened; settings that size memory have bounds; a command that writes
validates first and leaves no folder when it refuses."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from .test_cli import run_cli

SECONDS = 20  # a refusal takes well under a second; a hang is caught here


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.toml"
    os.mkfifo(path)
    return path


def _bounded(*args: str):
    def hung(signum, frame):
        raise AssertionError(f"clinfed {' '.join(args[:2])} blocked on its input")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(SECONDS)
    try:
        return run_cli(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_fifo_named_as_any_input_file_is_refused_before_it_is_opened(fifo, i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    common = ("--data", str(i2b2_corpus), "--model", "tiny", "--out", str(out))
    cases = {
        "--config": ("train", "--config", str(fifo), *common),
        "--types": ("train", "--types", str(fifo), *common),
        "--public-types": (
            "train", "--public-data", str(i2b2_corpus / "test"), "--public-types", str(fifo),
            *common,
        ),
        "--labels": ("train", "--task", "mimic3", "--labels", str(fifo), *common),
        "plan --config": ("privacy", "plan", "--units", "100", "--config", str(fifo)),
    }  # fmt: skip
    for case, args in cases.items():
        result = _bounded(*args)
        assert result.returncode == 2, (case, result.stdout, result.stderr)
        assert "not a regular file" in result.stderr and str(fifo) in result.stderr, case
        assert "Traceback" not in result.stderr and not out.exists(), case


def test_settings_that_size_memory_or_noise_have_stated_bounds(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    common = ("--data", str(i2b2_corpus), "--model", "tiny", "--out", str(out))
    units = _bounded("privacy", "plan", "--units", "99999999999999999999999")
    assert units.returncode == 2 and "from 1 to 1,000,000,000" in units.stderr
    for flag, value in (("--max-grad-norm", "1e20"), ("--lora-alpha", "1e9")):
        result = run_cli("train", flag, value, "--target-epsilon", "8", *common)
        assert result.returncode == 2 and flag in result.stderr, (flag, result.stderr)
        assert "at most" in result.stderr or "must be in" in result.stderr
    assert not out.exists()


def test_writers_refuse_an_out_inside_what_runs_read_and_leave_nothing(i2b2_corpus, tmp_path):
    public = i2b2_corpus / "test"
    sweep = run_cli(
        "sweep", "--data", str(i2b2_corpus), "--model", "tiny", "--epsilons", "8",
        "--out", str(i2b2_corpus / "sw"),
    )  # fmt: skip
    assert sweep.returncode == 2 and "inside --data" in sweep.stderr, sweep.stderr
    warm = run_cli(
        "warm-start", "--model", "tiny", "--public-data", str(public),
        "--out", str(public / "ws"),
    )  # fmt: skip
    assert warm.returncode == 2 and "inside --public-data" in warm.stderr, warm.stderr
    forecast = run_cli(
        "privacy", "plan", "--units", "10", "--public-data", str(public), "--model", "tiny",
        "--forecast", str(public / "fc"),
    )  # fmt: skip
    assert forecast.returncode == 2 and "inside --public-data" in forecast.stderr
    assert not any((i2b2_corpus / "sw").exists() or (public / n).exists() for n in ("ws", "fc"))
