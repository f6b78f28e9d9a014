"""Run configuration: task defaults and validation before anything is written."""

from __future__ import annotations

import pytest

from clinfed.errors import ClinfedError
from clinfed.pipeline import RunConfig
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
        ({"task": "radiology"}, "--task must be one of"),
        ({"strategy": "fedsomething"}, "--strategy must be one of"),
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"lr": -1.0}, "--lr must be positive"),
        ({"head_lr": 0.0}, "--head-lr must be positive"),
        ({"lr": float("inf")}, "--lr must be a finite number"),
        ({"data": "/no/such/folder"}, "not a folder"),
        ({"secure_aggregation": True}, "centralized sends no updates"),
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
