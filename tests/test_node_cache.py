"""A node's encoded-data cache: read back instead of re-encoding, private on
disk, and never stale (any change of data, tokenizer settings or window is
a new entry)."""

from __future__ import annotations

import shutil
import stat

import pytest

from clinfed.flower.deploy import flower_run_config
from clinfed.runners.node import NodeConfig, NodeSite
from clinfed.runners.node_cache import FOLDER, KEEP
from clinfed.tasks.i2b2.adapter import I2b2Task


@pytest.fixture
def encodes(monkeypatch):
    """How many datasets the task encoded."""
    calls = []
    real = I2b2Task.encode

    def counting(self, records, *args, **kwargs):
        calls.append(len(records))
        return real(self, records, *args, **kwargs)

    monkeypatch.setattr(I2b2Task, "encode", counting)
    return calls


def _site(data, state, **settings) -> NodeSite:
    config = flower_run_config(
        {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32} | settings,
        state.parent / "run",
    )
    node = NodeConfig(data, state, site="beth", allow_no_dp=True)
    return NodeSite(config, node, "run")


def _rows(site: NodeSite) -> tuple:
    runner = site.runner
    return runner.train["input_ids"], runner.test["input_ids"], len(runner.test_records)


def test_a_second_message_reads_the_encoding_back(i2b2_corpus, tmp_path, encodes):
    first = _site(i2b2_corpus, tmp_path / "state")
    assert len(encodes) == 2  # train and test
    before = _rows(first)
    first.close()
    second = _site(i2b2_corpus, tmp_path / "state")
    assert len(encodes) == 2  # nothing encoded again
    assert _rows(second) == before
    assert second.runner.task.labels == first.runner.task.labels
    second.close()
    # Protected: only the node's operator can read it.
    root = tmp_path / "state" / FOLDER
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path


def test_a_changed_note_or_window_is_encoded_again(i2b2_corpus, tmp_path, encodes):
    data = tmp_path / "data"
    shutil.copytree(i2b2_corpus, data)
    _site(data, tmp_path / "state").close()
    assert len(encodes) == 2
    _site(data, tmp_path / "state", max_length=24).close()  # another window
    assert len(encodes) == 4
    note = next(data.rglob("*.txt"))
    note.write_text(note.read_text() + "\nadded line .\n")  # another note text
    _site(data, tmp_path / "state").close()
    assert len(encodes) == 6
    entries = [p for p in (tmp_path / "state" / FOLDER).iterdir()]
    assert len(entries) == 3 <= KEEP and not any(p.name.startswith(".") for p in entries)


def test_a_node_remembers_its_calibration_and_checks_it(tmp_path, monkeypatch):
    import json

    import clinfed.privacy.policy as policy_module
    from clinfed.privacy.accountants import epsilon
    from clinfed.privacy.policy import PrivacyPolicy

    calls = []
    real = policy_module.calibrate_noise

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(policy_module, "calibrate_noise", counting)
    memo = tmp_path / "calibration.json"

    def build():
        return PrivacyPolicy.build(tmp_path, {"s": 500}, 50, 1, 3, 1e-5, 2.0, None, memo=memo)

    first = build()
    assert len(calls) == 1
    assert build().noise == first.noise and len(calls) == 1  # read back, not recalibrated
    # A remembered value that no longer meets the target is never used.
    memo.write_text(json.dumps(dict.fromkeys(json.loads(memo.read_text()), 0.3)))
    third = build()
    assert len(calls) == 2 and third.noise == first.noise
    assert epsilon(third.round_mechanisms("s") * 3, 1e-5) <= 2.0
