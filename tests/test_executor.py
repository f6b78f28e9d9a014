"""A node's executor: the site built once and kept between messages,
answers equal to a message handled on its own, rebuilt whenever what it
was built from changes; only clinfed's app answered, on the Flower
releases it was tested on; its log says where, never what."""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from clinfed.core.errors import USER_ERRORS, ClinfedError
from clinfed.federated.engine import Message
from clinfed.flower import executor, handler
from clinfed.flower.deploy import flower_run_config
from clinfed.flower.records import message_records, read_reply
from clinfed.runners.factories import make_model, make_task


def _config(tmp_path, **settings):
    values = {
        "task": "i2b2",
        "model": "tiny",
        "strategy": "fedavg",
        "max_length": 32,
        "rounds": 3,
        "batch_size": 8,
        "threads": 1,
    } | settings
    return flower_run_config(values, tmp_path / "run")


def _records(config, round_number: int, name: str = "run"):
    """A round's training message carrying the run's starting model."""
    model = make_model(config, make_task(config, ""))
    message = Message("train", round_number, model.state_dict(), full=True, evaluate=False)
    return message_records(message, {"name": name, "config": config.to_dict()})


def _values(data, state, **extra) -> dict:
    return {"data": str(data), "state": str(state), "site": "beth", "allow-no-dp": True} | extra


def _upload(records) -> dict[str, torch.Tensor]:
    return read_reply(records).upload


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def builds(monkeypatch):
    """How many sites the handler built."""
    made = []
    real = handler.NodeSite

    def counting(*args, **kwargs):
        made.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(handler, "NodeSite", counting)
    return made


def test_the_cache_builds_a_site_once_and_answers_like_a_fresh_one(i2b2_corpus, tmp_path, builds):
    data = tmp_path / "data"
    shutil.copytree(i2b2_corpus, data)
    config = _config(tmp_path)
    cache = handler.SiteCache()
    try:
        kept = [
            _upload(handler.answer(_records(config, r), _values(data, tmp_path / "a"), cache))
            for r in (1, 2)
        ]
        assert builds == ["run"]  # built once for both messages
        fresh = [
            _upload(handler.answer(_records(config, r), _values(data, tmp_path / "b")))
            for r in (1, 2)
        ]
        assert all(_same(k, f) for k, f in zip(kept, fresh, strict=True))
        builds.clear()
        # Another run, then changed notes: each builds the site again.
        handler.answer(_records(config, 1, name="other"), _values(data, tmp_path / "a"), cache)
        note = next(data.rglob("*.txt"))
        note.write_text(note.read_text() + "\nadded line .\n")
        handler.answer(_records(config, 1, name="other"), _values(data, tmp_path / "a"), cache)
        assert builds == ["other", "other"]
    finally:
        cache.drop()


def test_a_kept_site_refuses_a_ledger_shortened_behind_it(i2b2_corpus, tmp_path):
    config = _config(tmp_path, target_epsilon=8.0, reproducible_noise=True)
    values = _values(i2b2_corpus, tmp_path / "state", **{"max-epsilon": 100.0})
    cache = handler.SiteCache()
    try:
        for round_number in (1, 2):
            handler.answer(_records(config, round_number), values, cache)
        (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
        whole = ledger.read_bytes()
        ledger.write_bytes(whole[: whole.index(b"\n") + 1])  # cut back to round 1
        # The kept site checks the file before it charges round 3.
        with pytest.raises(USER_ERRORS, match="shortened"):
            handler.answer(_records(config, 3), values, cache)
    finally:
        cache.drop()


def test_only_the_tested_flower_releases_run_the_executor(monkeypatch):
    import flwr

    executor.check_flower()  # this environment's Flower is a tested one
    monkeypatch.setattr(flwr, "__version__", "1.42.0")
    with pytest.raises(ClinfedError, match="tested on Flower 1.41.0, and this is Flower 1.42.0"):
        executor.check_flower()


def _flower_message(records):
    from flwr.app import Message

    return Message(records, dst_node_id=1, message_type="train")


def test_the_executor_answers_clinfed_s_app_only_and_never_quotes_an_error(
    i2b2_corpus, tmp_path, monkeypatch
):
    from flwr.app import Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    # What pulling a task sets in the executor (Flower's record of it).
    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)

    config = _config(tmp_path)
    values = _values(i2b2_corpus, tmp_path / "state")
    context = Context(run_id=1, node_id=1, node_config=values, state=RecordDict(), run_config={})
    cache = handler.SiteCache()
    try:
        ours = types.SimpleNamespace(fab_id=executor.APP_ID)
        reply, word = executor._reply(_flower_message(_records(config, 1)), context, ours, cache)
        assert word == "answered" and not reply.has_error()
        fresh = handler.answer(_records(config, 1), _values(i2b2_corpus, tmp_path / "fresh"))
        assert _same(_upload(reply.content), _upload(fresh))
        # Another app's run: nothing of it runs here.
        other = types.SimpleNamespace(fab_id="someone/else")
        reply, word = executor._reply(_flower_message(_records(config, 2)), context, other, cache)
        assert reply.has_error() and "clinfed's app only" in reply.error.reason
        # An unexpected error is reported by type and place, never by its
        # message, which could quote data.
        bad = _records(config, 2)
        info = json.loads(bad.config_records["info"]["json"])
        info["round"] = "quoted note text"  # int() fails and quotes it
        bad.config_records["info"]["json"] = json.dumps(info)
        reply, word = executor._reply(_flower_message(bad), context, ours, cache)
        assert "ValueError at messages.py" in reply.error.reason
        assert "quoted" not in reply.error.reason and "quoted" not in word
    finally:
        cache.drop()
