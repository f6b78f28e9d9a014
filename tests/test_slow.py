"""Long runs with the bundled MiniLM (``pytest -m slow``; minutes on 2 cores)."""

from __future__ import annotations

import pytest

from clinfed.errors import ProblemLog
from clinfed.pipeline import RunConfig, run_training
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
            epochs=3,
        )
    )
    assert summary["f1"] >= 0.80
    assert summary["f1"] > dictionary + 0.1
