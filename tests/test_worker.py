"""A node's worker: the site built once and kept between messages, answers
equal to a message handled on its own, rebuilt whenever what it was built
from changes, and reachable only by the node's own ClientApps."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time

import pytest
import torch

from clinfed.errors import USER_ERRORS, ClinfedError
from clinfed.factories import make_model, make_task
from clinfed.federated.engine import Message
from clinfed.flower import client, handler, worker
from clinfed.flower.deploy import flower_run_config
from clinfed.flower.records import message_records, read_reply


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


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone too: it no longer runs.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] == "Z"


def test_the_worker_serves_its_clientapps_only_is_replaced_and_ends_with_its_supernode(
    i2b2_corpus, tmp_path
):
    config = _config(tmp_path)
    state = tmp_path / "state"
    values = _values(i2b2_corpus, state)
    # Stands in for the SuperNode: the worker ends when it does.
    supernode = subprocess.Popen(["sleep", "600"])
    try:
        first = _upload(worker.ask(values, _records(config, 1), parent=supernode.pid))
        folder = state / worker.FOLDER
        address = json.loads((folder / "address.json").read_text())
        second = worker.ask(values, _records(config, 2), parent=supernode.pid)
        assert json.loads((folder / "address.json").read_text()) == address  # the same worker
        # The same answers as a message handled in the ClientApp itself.
        here = values | {"state": str(tmp_path / "here"), "worker": False}
        assert _same(first, _upload(client.answer(_records(config, 1), here)))
        assert _same(_upload(second), _upload(client.answer(_records(config, 2), here)))
        assert not (tmp_path / "here" / worker.FOLDER).exists()
        # Only the node's user can read the token; without it, no answer.
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / "address.json").stat().st_mode) == 0o600
        with socket.create_connection(("127.0.0.1", address["port"]), timeout=30) as conn:
            worker._send(conn, json.dumps({"token": "0" * 64, "node": values}).encode())
            worker._send(conn, b"")
            assert conn.recv(1) == b""  # closed without a word
        # Another state folder is not this worker's to serve.
        with pytest.raises(ClinfedError, match="another state folder"):
            with socket.create_connection(("127.0.0.1", address["port"]), timeout=30) as conn:
                request = {"token": address["token"], "node": values | {"state": "/elsewhere"}}
                worker._send(conn, json.dumps(request).encode())
                worker._send(conn, b"")
                header = json.loads(worker._receive(conn))
                raise ClinfedError(header["refused"])
        # An unexpected error is reported by type and place, never by its
        # message, which could quote data.
        bad = _records(config, 1)
        info = json.loads(bad.config_records["info"]["json"])
        info["round"] = "quoted note text"  # int() fails and quotes it
        bad.config_records["info"]["json"] = json.dumps(info)
        with pytest.raises(worker.Failed, match="ValueError at messages.py") as failed:
            worker.ask(values, bad, parent=supernode.pid)
        assert "quoted" not in str(failed.value)
        log = (folder / "worker.log").read_text()
        assert "ValueError" in log and "quoted" not in log
        assert log.count("answered") == 2 and "refused" in log
        # A worker killed outright is replaced by the next message.
        os.kill(address["pid"], signal.SIGKILL)
        third = _upload(worker.ask(values, _records(config, 3), parent=supernode.pid))
        assert _same(third, _upload(client.answer(_records(config, 3), here)))
        replaced = json.loads((folder / "address.json").read_text())
        assert replaced["pid"] != address["pid"]
        address = replaced
    finally:
        supernode.kill()
        supernode.wait()
    deadline = time.monotonic() + 60
    while not _gone(address["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(address["pid"])
    assert not (folder / "address.json").exists()
