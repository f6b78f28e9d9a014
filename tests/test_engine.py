"""The round engine against a scripted transport, in this process: retries,
``min_sites``, rejected replies, what a site in sync receives, resume; the
server-side strategies (FedAdam) on tensors small enough to check by hand."""

from __future__ import annotations

import math

import pytest
import torch

from clinfed.core.runs import read_jsonl
from clinfed.federated.engine import Deployment, Reply, RoundEngine
from clinfed.federated.messages import ReleasedAsReplies
from clinfed.federated.state import load
from clinfed.federated.strategies import get_strategy

NAMES = ["encoder.layer.0.attention.self.query.weight", "head.weight"]


class CountsTask:
    """The engine only asks a task for metrics from summed counts."""

    def metrics_from_counts(self, counts):
        hits, total = counts["hits"]
        return {"f1": hits / total if total else 0.0}


class ScriptedTransport(ReleasedAsReplies):
    """Sites whose replies a test scripts: ``behave(site, message, attempt)``."""

    def __init__(self, sites, behave):
        self.sites, self.behave = list(sites), behave
        self.sent: list[tuple[str, object]] = []
        self.attempts: dict[tuple[str, int], int] = {}

    def addresses(self):
        return list(self.sites)

    def exchange(self, messages, timeout):
        for address in sorted(messages):
            message = messages[address]
            self.sent.append((address, message))
            key = (address, message.round)
            self.attempts[key] = self.attempts.get(key, 0) + 1
            yield address, self.behave(address, message, self.attempts[key])


def good(site, message, value=1.0, examples=10, names=tuple(NAMES)):
    evaluation = {"counts": {"": {"hits": [1, 2]}}, "examples": 2, "seconds": 0.0}
    if message.kind == "evaluate":
        return Reply(site=site, evaluation=evaluation)
    upload = {n: torch.full((2,), value) for n in names}
    record = {"round": message.round, "site": site, "examples": examples, "bytes_up": 16}
    evaluated = evaluation if message.evaluate else None
    return Reply(site=site, upload=upload, record=record, evaluation=evaluated)


def engine(tmp_path, strategy="fedavg", options=None, rounds=2, **deployment):
    tmp_path.mkdir(parents=True, exist_ok=True)
    state = {n: torch.zeros(2) for n in NAMES}
    return RoundEngine(
        CountsTask(),
        get_strategy(strategy, options),
        state,
        NAMES,
        tmp_path,
        rounds,
        deployment=Deployment(**({"wait_for_sites": 0.0} | deployment)),
    )


def test_the_mean_is_weighted_by_examples_and_bad_replies_are_left_out(tmp_path):
    def behave(site, message, attempt):
        if site == "a":
            return good(site, message, value=1.0, examples=10)
        if site == "b":
            return good(site, message, value=4.0, examples=30)
        if site == "nan":
            reply = good(site, message)
            reply.upload[NAMES[0]] = torch.tensor([math.nan, 0.0])
            return reply
        reply = good(site, message)
        reply.upload["intruder.weight"] = torch.ones(2)
        return reply

    run = engine(tmp_path, rounds=1)
    run.run(ScriptedTransport(["a", "b", "nan", "extra"], behave))
    expected = (1.0 * 10 + 4.0 * 30) / 40
    assert torch.allclose(run.global_state[NAMES[0]], torch.full((2,), expected))
    records = read_jsonl(tmp_path / "metrics.jsonl")
    rejected = {r["site"]: r["rejected"] for r in records if "rejected" in r}
    assert "NaN or Inf" in rejected["nan"] and "unexpected parameter" in rejected["extra"]
    assert sorted(r["site"] for r in records if "bytes_up" in r) == ["a", "b"]


def test_a_round_short_of_min_sites_is_retried_then_the_run_stops(tmp_path):
    def behave(site, message, attempt):
        return "error 0: site down" if site == "down" else good(site, message)

    transport = ScriptedTransport(["a", "down"], behave)
    run = engine(tmp_path, min_sites=2, round_retries=2)
    summary = run.run(transport)
    assert transport.attempts[("down", 1)] == 3  # the first try and two retries
    assert "stopped in round 1" in summary["stopped"]
    failed = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "failed" in r]
    assert len(failed) == 3 and all(r["site"] == "node down" for r in failed)
    assert not (tmp_path / "state.json").exists()  # nothing was committed


def test_a_retry_that_reaches_min_sites_completes_the_round(tmp_path):
    def behave(site, message, attempt):
        if site == "flaky" and message.round == 1 and attempt == 1:
            return "no reply within 5 s"
        return good(site, message)

    transport = ScriptedTransport(["a", "flaky"], behave)
    summary = engine(tmp_path, min_sites=2, round_retries=1, rounds=1).run(transport)
    assert "stopped" not in summary and load(tmp_path).round == 1


def test_a_site_that_missed_round_one_gets_what_changed_since_round_zero(tmp_path):
    def behave(site, message, attempt):
        if site == "late" and message.round == 1:
            return "error 0: down"
        return good(site, message, names=(NAMES[1],))  # Q/K are frozen: never sent

    transport = ScriptedTransport(["a", "late"], behave)
    engine(tmp_path, "fedfrozen", {"freeze_from": "1"}, rounds=2).run(transport)
    round_two = {a: m for a, m in transport.sent if m.round == 2}
    # "a" took part in round 1: it holds global round 0 and gets what changed.
    assert not round_two["a"].full and round_two["a"].base == 0
    assert set(round_two["a"].download) == {NAMES[1]}
    # "late" was never heard from: it builds round 0 from the run's seed and
    # gets the same; frozen Q/K never travel.
    assert not round_two["late"].full and round_two["late"].base == 0
    assert set(round_two["late"].download) == {NAMES[1]}


def test_resume_continues_from_the_commit_with_the_same_result(tmp_path):
    def behave(site, message, attempt):
        return good(site, message, value=float(message.round))

    whole = engine(tmp_path / "whole", "fedadam", rounds=3)
    whole.run(ScriptedTransport(["a", "b"], behave))

    first = engine(tmp_path / "cut", "fedadam", rounds=2)
    first.run(ScriptedTransport(["a", "b"], behave))
    again = engine(tmp_path / "cut", "fedadam", rounds=3)
    again.resume()
    assert again.first_round == 3 and again.holds == {"a": 1, "b": 1}
    again.run(ScriptedTransport(["a", "b"], behave))
    for name in NAMES:
        assert torch.equal(whole.global_state[name], again.global_state[name])


def test_fedadam_takes_an_adam_step_on_the_mean_update():
    strategy = get_strategy(
        "fedadam", {"server_lr": 0.1, "server_beta1": 0.9, "server_beta2": 0.99, "server_tau": 1e-3}
    )
    current = {"w": torch.tensor([1.0, 1.0]), "frozen": torch.tensor([5.0])}
    mean = {"w": torch.tensor([1.5, 0.0]), "frozen": torch.tensor([5.0])}
    new = strategy.apply(1, current, mean, frozenset({"w"}))
    delta = torch.tensor([0.5, -1.0], dtype=torch.float64)
    m, v = 0.1 * delta, 0.01 * delta**2
    expected = torch.tensor([1.0, 1.0], dtype=torch.float64) + 0.1 * m / (v.sqrt() + 1e-3)
    assert torch.allclose(new["w"].double(), expected, atol=1e-6)
    assert torch.equal(new["frozen"], current["frozen"])  # not sent: not moved
    moments = strategy.tensor_state()
    restored = get_strategy("fedadam")
    restored.load_tensor_state(moments)
    assert torch.equal(restored.m["w"], strategy.m["w"]) and torch.equal(
        restored.v["w"], strategy.v["w"]
    )


@pytest.mark.parametrize("name", ["privacy", "tasks"])
def test_tasks_and_privacy_import_only_under_clinfed(name):
    # One module name each: a second name would load a second copy of the code.
    with pytest.raises(ImportError):
        __import__(name)


def test_records_written_after_the_last_commit_are_cut_back_on_resume(tmp_path, monkeypatch):
    from clinfed.federated import state

    def behave(site, message, attempt):
        return good(site, message, value=float(message.round))

    commit = state.commit

    def crash_at_round_two(out, round_number, *args, **kwargs):
        if round_number == 2:
            raise KeyboardInterrupt  # killed after round 2's records, before its commit
        return commit(out, round_number, *args, **kwargs)

    monkeypatch.setattr(state, "commit", crash_at_round_two)
    with pytest.raises(KeyboardInterrupt):
        engine(tmp_path, rounds=3).run(ScriptedTransport(["a", "b"], behave))
    written = read_jsonl(tmp_path / "metrics.jsonl")
    assert any(r["round"] == 2 for r in written)  # round 2 had written its records
    monkeypatch.setattr(state, "commit", commit)
    again = engine(tmp_path, rounds=3)
    again.resume()
    again.run(ScriptedTransport(["a", "b"], behave))
    keys = [(r["round"], r.get("site")) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(keys) == len(set(keys)) == 3 * 3  # 3 rounds x (2 sites + 1 global record)


def test_an_evaluation_site_is_evaluated_never_trained_and_no_f1_without_evaluation(tmp_path):
    def trains_only(site, message, attempt):  # holds no held-out data
        reply = good(site, message)
        return Reply(site=site, upload=reply.upload, record=reply.record)

    def behave(site, message, attempt):
        if site == "external":  # held-out notes only
            evaluation = {"counts": {"": {"hits": [3, 4]}}, "examples": 4}
            record = {"round": message.round, "site": site, "evaluation_only": True}
            record = record if message.kind == "train" else None
            return Reply(site=site, record=record, evaluation=evaluation)
        return trains_only(site, message, attempt)

    transport = ScriptedTransport(["a", "external"], behave)
    summary = engine(tmp_path, rounds=3).run(transport)
    kinds = {(site, m.round): m.kind for site, m in transport.sent}
    # Told once it trains nothing, it is only asked to evaluate from then on.
    assert kinds[("external", 1)] == "train" and kinds[("external", 2)] == "evaluate"
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "site" not in r]
    assert [r["f1"] for r in records] == [0.75, 0.75, 0.75]
    assert summary["f1"] == 0.75 and summary["evaluated_sites"] == 1
    assert not any(r.get("site") == "external" for r in read_jsonl(tmp_path / "metrics.jsonl"))

    # Nobody holds held-out data: no F1 at all, and the record says why.
    silent = engine(tmp_path / "silent", rounds=1).run(ScriptedTransport(["a"], trains_only))
    assert "f1" not in silent and silent["evaluated_sites"] == 0
    assert "not_evaluated" in silent
