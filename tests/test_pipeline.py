"""Run configuration: task defaults and validation before anything is written."""

from __future__ import annotations

import pytest

from clinfed.core.errors import ClinfedError
from clinfed.runners.pipeline import RunConfig
from clinfed.tasks.mimic3.adapter import Mimic3Task

TASK_DEFAULTS = {"mimic3": Mimic3Task.defaults}


def test_unset_settings_take_the_task_defaults(tmp_path):
    config = RunConfig.of(task="mimic3", data=str(tmp_path), out=str(tmp_path / "run"), lr=3e-5)
    resolved = config.resolved()
    assert resolved.lr == 3e-5  # set by the user: kept
    assert resolved.batch_size == TASK_DEFAULTS["mimic3"]["batch_size"]
    assert resolved.max_length == 256 and resolved.head_lr == 1e-2
    assert RunConfig.of(task="i2b2", data="d", out="o").resolved().max_length == 128


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"task": "radiology"}, "`task` must be one of"),
        ({"strategy": "fedsomething"}, "`strategy` must be one of"),
        ({"batch_size": 0}, "`batch_size` must be at least 1"),
        ({"lr": -1.0}, r"`lr` must be in \(0, 1\]"),
        ({"head_lr": 0.0}, r"`head_lr` must be in \(0, 1\]"),
        ({"lr": float("inf")}, "`lr` must be a finite number"),
        ({"data": "/no/such/folder"}, "not a folder"),
        ({"secure_aggregation": True, "strategy": "centralized"}, "centralized sends no updates"),
        ({"secure_aggregation": True, "strategy": "local"}, "local sends no updates"),
        (
            {"secure_aggregation": True, "strategy": "fedavg", "audit_holdout": 0.2},
            "choose one",
        ),
    ],
)
def test_impossible_settings_are_refused(tmp_path, changes, message):
    values = {"task": "i2b2", "data": str(tmp_path), "out": str(tmp_path / "run")} | changes
    with pytest.raises(ClinfedError, match=message):
        RunConfig.of(**values).validate()
    assert not (tmp_path / "run").exists()


def test_a_cache_folder_reuses_encoded_notes_only_when_nothing_that_shapes_them_changed(
    i2b2_corpus, tmp_path
):
    # Under --cache-dir a second run takes the tokenized rows from the
    # cache when the mapped dataset's fingerprint matches; the fingerprint
    # is built without pickling the tokenizer, so it must still change with
    # the tokenizer's vocabulary and with what the encoding closes over.
    from pathlib import Path

    from clinfed.core.errors import ProblemLog
    from clinfed.modeling.models import load_tokenizer
    from clinfed.tasks.i2b2.adapter import I2b2Task

    cache = str(tmp_path / "cache")
    task = I2b2Task()
    records = task.load(Path(i2b2_corpus), ProblemLog()).train[:4]
    tokenizer = load_tokenizer("tiny")

    def encoded(tokenizer, max_length):
        return I2b2Task().encode(records, tokenizer, max_length, cache)

    first = encoded(tokenizer, 32)
    again = encoded(load_tokenizer("tiny"), 32)
    assert again._fingerprint == first._fingerprint
    assert again.cache_files == first.cache_files  # read back, not encoded again
    assert again["input_ids"] == first["input_ids"]

    shorter = encoded(tokenizer, 16)
    assert shorter._fingerprint != first._fingerprint
    assert max(len(ids) for ids in shorter["input_ids"]) <= 16

    grown = load_tokenizer("tiny")
    grown.add_tokens([records[0].lines[0][0].lower() + "zq"])
    assert encoded(grown, 32)._fingerprint != first._fingerprint
