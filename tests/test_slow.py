"""Long runs with the bundled MiniLM (``pytest -m slow``; minutes on 2 cores)."""

from __future__ import annotations

import pytest

from clinfed.core.errors import ProblemLog
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.tasks.i2b2.baselines import i2b2_dictionary
from clinfed.tasks.i2b2.synth import generate


@pytest.mark.slow
def test_minilm_centralized_i2b2_beats_the_dictionary_and_reaches_080(tmp_path):
    generate(tmp_path / "data", sites=3, docs=24, seed=3)
    corpus = I2b2Task().load(tmp_path / "data", ProblemLog())
    dictionary = i2b2_dictionary(corpus.train, corpus.test)["f1"]
    summary = run_training(
        RunConfig.of(
            task="i2b2",
            data=str(tmp_path / "data"),
            out=str(tmp_path / "run"),
            model="minilm",
            strategy="centralized",
            epochs=3,
        )
    )
    assert summary["f1"] >= 0.80
    assert summary["f1"] > dictionary + 0.1


@pytest.mark.slow
def test_the_readme_s_first_run_gives_the_f1_it_states(tmp_path):
    """The README's first run, command by command as printed there."""
    import json
    import shlex
    from pathlib import Path

    from tests.test_cli import run_cli

    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    block = readme.split("## A first run", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    for line in block.strip().splitlines():
        args = shlex.split(line.split("#", 1)[0])
        assert args[0] == "clinfed"
        args = [str(repo / a) if a.startswith("examples/") else a for a in args[1:]]
        result = run_cli(*args, cwd=tmp_path)
        assert result.returncode == 0, (line, result.stderr)
    summary = json.loads((tmp_path / "runs" / "first" / "summary.json").read_text())
    # The README states 0.964 under DP at epsilon 8 (one draw of the noise).
    assert summary["f1"] >= 0.94 and max(summary["epsilon"].values()) <= 8.0
    assert "0.964 under DP" in readme
