"""The Flower deployment: reply checks, run settings, and real SuperLink +
SuperNode processes on 127.0.0.1 against the in-process simulator."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clinfed.commands import main
from clinfed.core.errors import USER_ERRORS, ClinfedError, ProblemLog
from clinfed.core.runs import read_jsonl
from clinfed.federated.engine import Message
from clinfed.federated.messages import Reply, encode_reply
from clinfed.federated.replies import check_upload
from clinfed.federated.strategies import get_strategy
from clinfed.flower.deploy import (
    environment,
    flower_run_config,
    make_certificates,
    make_node_key,
    read_labels,
    register_command,
)
from clinfed.flower.records import PACKED, _records, message_records, read_message, read_reply
from clinfed.privacy.accountants import Mechanism, epsilon
from clinfed.runners.node import NodeConfig, NodeSite
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.synth import generate
from clinfed.tasks.mimic3.adapter import Mimic3Task
from clinfed.tasks.mimic3.metrics import multilabel_metrics
from tests.flower_harness import LocalFederation

SITES = ("beth", "partners", "site3")


# ------------------------------------------------------------ reply checks
GLOBAL = {"a.weight": torch.zeros(2, 3), "b.bias": torch.zeros(3)}
ALLOWED = frozenset(GLOBAL)


def test_records_carry_every_tensor_in_one_packed_array_and_refuse_garbage():
    tensors = {
        "w": torch.randn(3, 4),
        "ids": torch.arange(5),  # int64 buffers travel too
        "half": torch.ones(2, dtype=torch.float16),
    }
    message = Message(
        "train",
        2,
        tensors,
        full=False,
        evaluate=True,
        strategy_state={"k": 1},
        base=0,
        expect="ab" * 32,
    )
    records = message_records(message, {"name": "run", "config": {}})
    assert list(records.array_records["tensors"]) == [PACKED]  # one Flower array, not three
    back, run = read_message(records)
    assert run == {"name": "run", "config": {}} and back.strategy_state == {"k": 1}
    assert (back.full, back.base, back.expect) == (False, 0, "ab" * 32)
    assert back.download.keys() == tensors.keys()
    assert all(
        torch.equal(back.download[k], v) and back.download[k].dtype == v.dtype
        for k, v in tensors.items()
    )
    garbage = _records(encode_reply(Reply(site="beth")))
    from flwr.app import Array

    garbage.array_records["tensors"][PACKED] = Array(np.frombuffer(b"not tensors", np.uint8))
    with pytest.raises(ValueError, match="do not parse"):
        read_reply(garbage)


def test_a_good_upload_passes():
    assert check_upload({"a.weight": torch.ones(2, 3)}, ALLOWED, GLOBAL) is None


@pytest.mark.parametrize(
    ("upload", "reason"),
    [
        ({"c.weight": torch.ones(3)}, "unexpected parameter c.weight"),
        ({"a.weight": torch.ones(3, 2)}, "shape (3, 2), expected (2, 3)"),
        ({"b.bias": torch.ones(3, dtype=torch.float64)}, "dtype torch.float64"),
        ({"b.bias": torch.tensor([0.0, math.nan, 1.0])}, "NaN or Inf"),
        ({"b.bias": torch.tensor([0.0, math.inf, 1.0])}, "NaN or Inf"),
    ],
)
def test_bad_uploads_are_rejected_with_the_reason(upload, reason):
    assert reason in check_upload(upload, ALLOWED, GLOBAL)


def test_an_upload_outside_the_rounds_envelope_is_rejected():
    # After FedFrozen's warm-up, Q/K may not come back even though the
    # model has them.
    strategy = get_strategy("fedfrozen", {"freeze_from": "2"})
    names = ["encoder.layer.0.attention.self.query.weight", "encoder.layer.0.output.dense.weight"]
    envelope = strategy.envelope(2, names)
    state = {n: torch.zeros(2) for n in names}
    assert check_upload({names[0]: torch.ones(2)}, envelope.uploaded, state) is not None
    assert check_upload({names[1]: torch.ones(2)}, envelope.uploaded, state) is None


def test_the_first_frozen_round_still_delivers_the_last_averaged_query_key():
    names = ["encoder.layer.0.attention.self.query.weight", "encoder.layer.0.output.dense.weight"]
    for name in ("fedfrozen", "safl+fedfrozen"):
        options = {"freeze_from": "3"} | ({"top_layers": 1} if name.startswith("safl") else {})
        strategy = get_strategy(name, options)
        assert names[0] in strategy.envelope(3, names).downloaded  # averaged at the end of 2
        assert names[0] not in strategy.envelope(4, names).downloaded
        assert names[0] not in strategy.envelope(3, names).uploaded


# ----------------------------------------------------------- run settings
def test_flower_run_settings_refuse_what_belongs_to_the_simulator(tmp_path):
    with pytest.raises(ClinfedError, match="not a Flower setting"):
        flower_run_config({"task": "i2b2", "strategy": "fedavg", "sites": 4}, tmp_path)
    with pytest.raises(ClinfedError, match="no Flower form"):
        flower_run_config({"task": "i2b2", "strategy": "centralized"}, tmp_path)
    # A warm start on Flower is a saved model every node loads and pins.
    with pytest.raises(ClinfedError, match="public_data: on Flower, train the starting model"):
        flower_run_config({"task": "i2b2", "strategy": "fedavg", "public_data": "p"}, tmp_path)
    # Members set aside for an audit are a simulator's: a node audits nothing.
    with pytest.raises(ClinfedError, match="audit_holdout: not a Flower setting"):
        flower_run_config({"task": "i2b2", "strategy": "fedavg", "audit_holdout": 0.1}, tmp_path)
    # The server judges each round on public text from a folder where it runs.
    config = flower_run_config(
        {"task": "i2b2", "strategy": "fedavg", "public_check": "p"}, tmp_path
    )
    assert config.public_check == str(Path("p").resolve())
    # MIMIC-III needs no code list up front: the public one is the default.
    assert flower_run_config({"task": "mimic3", "strategy": "fedavg"}, tmp_path).labels is None
    with pytest.raises(ClinfedError, match="unknown setting"):
        flower_run_config({"task": "i2b2", "strategy": "fedavg", "colour": 1}, tmp_path)
    config = flower_run_config(
        {"task": "i2b2", "strategy": "fedfrozen", "freeze_from": 2}, tmp_path
    )
    assert config.options().freeze_from == "2" and config.batch_size == 16  # resolved defaults


def test_node_config_errors_name_the_key(tmp_path):
    with pytest.raises(ClinfedError, match="needs data"):
        NodeConfig.parse({"state": str(tmp_path)})
    with pytest.raises(ClinfedError, match="unknown key 'dta'"):
        NodeConfig.parse({"dta": str(tmp_path), "state": str(tmp_path)})
    with pytest.raises(ClinfedError, match="not a folder"):
        NodeConfig.parse({"data": str(tmp_path / "missing"), "state": str(tmp_path)})
    with pytest.raises(ClinfedError, match="dp-pass-units must be at least 0"):
        NodeConfig.parse({"data": str(tmp_path), "state": str(tmp_path), "dp-pass-units": -1})
    # Every key is read by its declared field: its type, then its bounds.
    folders = {"data": str(tmp_path), "state": str(tmp_path)}
    for key, value, words in [
        ("max-delta", 1.5, "max-delta must be in \\(0, 1\\)"),
        ("max-epsilon", -1, "max-epsilon must be positive"),
        ("max-grad-norm", "inf", "max-grad-norm must be a finite number"),
        ("privacy-unit", "sentence", "privacy-unit must be one of example, document, patient"),
        ("secure-min-sites", 1, "secure-min-sites must be at least 2"),
        ("threads", "two", "threads: expected int"),
    ]:
        with pytest.raises(ClinfedError, match=words):
            NodeConfig.parse(folders | {key: value})
    node = NodeConfig.parse(
        folders | {"max-epsilon": "8", "threads": 2, "annotated-types": "problem, test",
                   "model-sha256": "ABC", "allow-no-dp": "TRUE"}
    )  # fmt: skip
    assert (node.max_epsilon, node.threads, node.annotated_types) == (8.0, 2, ("problem", "test"))
    assert node.model_sha256 == "abc" and node.allow_no_dp is True and node.max_length == 512


def test_flower_commands_refuse_to_run_without_tls_or_insecure(tmp_path, capsys):
    assert main(["flower", "superlink"]) == 2
    assert "--insecure" in capsys.readouterr().err


def test_flower_processes_ask_for_work_often_and_an_operators_interval_wins(monkeypatch):
    # Flower's SuperExec waits this long between asks for a new message
    # (its default, 1 s, is half a second of every message on average);
    # Flower refuses values outside 0.01-60 s.
    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    interval = float(environment()["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"])
    assert 0.01 <= interval <= 0.2
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "2")
    assert environment()["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "2"


def test_summed_site_counts_give_the_pooled_mimic_metrics():
    rng = np.random.default_rng(0)
    task = Mimic3Task()
    task.labels = [f"c{i}" for i in range(6)]
    y_true = (rng.random((40, 6)) < 0.3).astype(int)
    scores = rng.random((40, 6))
    total = {"tp": [0] * 6, "fp": [0] * 6, "fn": [0] * 6}
    for part in (slice(0, 13), slice(13, 40)):
        examples = {"targets": y_true[part].tolist()}
        counts = task.evaluation_counts(None, examples, list(scores[part]))
        total = {k: [a + b for a, b in zip(total[k], counts[k])] for k in total}
    pooled = multilabel_metrics(y_true, scores)
    from_counts = task.metrics_from_counts(total)
    for key in ("micro_f1", "macro_f1", "macro_f1_mean"):
        assert from_counts[key] == pytest.approx(pooled[key], abs=1e-12)


# ------------------------------------------------------------- deployment
def _corpus(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    generate(data, sites=3, docs=6, seed=0)
    return data


def _settings(**extra) -> dict:
    """A small run; the strategy options it sets are those its strategy takes."""
    from clinfed.runners.sweep import options_for

    values = {
        "task": "i2b2",
        "model": "tiny",
        "strategy": "safl+fedfrozen",
        "rounds": 2,
        "max_length": 32,
        "batch_size": 8,
        "target_epsilon": 8.0,
        # Bit-for-bit comparisons need noise both runs can draw: not private.
        "reproducible_noise": True,
        "threads": 1,
    } | extra
    options = {"freeze_from": "2", "top_layers": 1} | {
        k: v for k, v in extra.items() if k in ("freeze_from", "top_layers", "prompt_depth")
    }
    values = {k: v for k, v in values.items() if k not in options}
    return values | options_for(values["strategy"], options)


def _epsilons(path: Path) -> list[tuple[int, float]]:
    return [(line["round"], line["epsilon"]) for line in read_jsonl(path) if "mechanism" in line]


def _node_policy(config: RunConfig) -> dict:
    """What a test node's operator allows for ``config``: reproducible noise
    (not private) and runs without DP only when asked, and a budget."""
    return {
        "allow_no_dp": not config.dp or config.reproducible_noise,
        "max_epsilon": 100.0 if config.dp else None,
    }


def _node_ledger(state: Path, site: str) -> Path:
    """A node's ledger (one per dataset, keyed by the data's fingerprint)."""
    (path,) = (state / site / "ledger").glob(f"{site}-*.jsonl")
    return path


def _simulate_then_deploy(config: RunConfig, data: Path, tmp_path: Path, certs) -> None:
    """The same run in the simulator (``tmp_path/sim``) and on a SuperLink
    with one SuperNode per site (state under ``tmp_path/deploy/state``)."""
    simulated = config.replace(data=str(data), out=str(tmp_path / "sim"))
    run_training(simulated)
    _deploy(config, data, tmp_path, certs)


def _deploy(config: RunConfig, data: Path, tmp_path: Path, certs) -> None:
    """``config`` on a SuperLink with one SuperNode per site (state under
    ``tmp_path/deploy/state``); it must finish."""
    (tmp_path / "deploy").mkdir()
    federation = LocalFederation(tmp_path / "deploy", certs=certs)
    try:
        federation.start_superlink()
        for site in SITES:
            federation.start_node(site, data, **_node_policy(config))
        process = federation.submit(config, min_sites=3, round_timeout=300)
    finally:
        federation.close()
    assert process.returncode == 0, "\n".join(federation.lines[-40:])


@pytest.mark.heavy
def test_flower_over_tls_with_node_keys_survives_a_killed_superlink_like_the_simulator(tmp_path):
    """The Flower runner end to end: TLS, node authentication, DP at each
    node, and a SuperLink SIGKILLed mid-run; against the same run in the
    simulator. (One federation for all of it: each of its ~30 Flower
    processes pays seconds of imports; two federations cost 217
    core-seconds, this one 142.)

    Three registered sites train a run; an unregistered node stands beside
    them. The SuperLink (and the ServerApp it runs) is killed in round 2 and
    started again on its database, which keeps the registered keys: the same
    nodes are let back in, the run resumes from its last commit and ends
    with the simulator's weights, records and ledgers: each site charged
    each round once, the interrupted one included. The intruder never
    received a message: it holds no copy of any model, and its node never
    logged one.

    The kill comes once every site has taken its round-2 message. A message
    of the killed run that a node pulls only after the restart trips a
    Flower 1.41 SuperNode fault (docs/deployment.md): the node starts a
    ClientApp for it although the SuperLink refused it, and from then on
    sends each reply one message late. CI hit that once in round 2 and the
    run stopped; this test is about the SuperLink's restart, not that fault.
    """
    data = _corpus(tmp_path)
    config = flower_run_config(_settings(rounds=3), tmp_path / "flower-run")
    run_training(config.replace(data=str(data), out=str(tmp_path / "sim")))
    certs = tmp_path / "certs"
    make_certificates(certs, ["127.0.0.1", "localhost"])
    keys = {name: make_node_key(tmp_path / "keys", name) for name in (*SITES, "intruder")}
    root = tmp_path / "deploy"
    root.mkdir()
    database = root / "superlink.db"
    federation = LocalFederation(root, certs=certs)
    round_two = threading.Event()

    def watch(line: str) -> None:
        if f"round 2/{config.rounds}: sending" in line:
            round_two.set()

    def taken_round_two() -> bool:
        # Round 1 and round 2 each send a site one message (the noisy count
        # rides on round 1's reply).
        logs = [(root / f"node-{site}.log").read_bytes() for site in SITES]
        return all(log.count(b"Received successfully") >= 2 for log in logs)

    try:
        federation.start_superlink(node_auth=True, database=database)
        for site in SITES:
            registered = federation.flwr(register_command(keys[site][1]))
            assert registered.returncode == 0, registered.stdout + registered.stderr
            federation.start_node(site, data, key=keys[site][0], **_node_policy(config))
        federation.start_node("intruder", data, key=keys["intruder"][0], allow_no_dp=True)
        first = federation.submit(config, min_sites=3, round_timeout=300, wait=False, on_line=watch)
        assert round_two.wait(timeout=600), "\n".join(federation.lines[-50:])
        deadline = time.monotonic() + 300
        while not taken_round_two() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert taken_round_two(), "a site never took its round-2 message"
        federation.kill_superlink()
        first.wait(timeout=120)
        state = json.loads((Path(config.out) / "state.json").read_text())
        assert state["round"] in (1, 2)  # killed before the run's end
        federation.start_superlink(node_auth=True, database=database)
        again = federation.submit(config.replace(resume=True), min_sites=3, round_timeout=300)
    finally:
        federation.close()
    assert again.returncode == 0, "\n".join(federation.lines[-40:])
    # Without the database the restarted SuperLink knows no registered key:
    # no site gets back in and the run stops short.
    run = Path(config.out)
    assert "stopped" not in json.loads((run / "summary.json").read_text())
    ours = load_file(str(run / "model" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "sim" / "model" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    worst = max((ours[k].double() - theirs[k].double()).abs().max().item() for k in ours)
    assert worst <= 1e-5

    # Each site's ledger, kept in its own state folder, matches the simulator's.
    for site in SITES:
        at_site = _node_ledger(root / "state", site)
        simulated_ledger = tmp_path / "sim" / "privacy" / f"{site}.jsonl"
        ours_ledger, sim_ledger = _epsilons(at_site), _epsilons(simulated_ledger)
        # Round 0: the noisy count (add/remove), charged once before round 1.
        assert [r for r, _ in ours_ledger] == [r for r, _ in sim_ledger] == [0, 1, 2, 3]
        assert [e for _, e in ours_ledger] == pytest.approx([e for _, e in sim_ledger], rel=1e-12)
        reported = read_jsonl(run / "privacy" / f"{site}.jsonl")
        assert all(line["reported_by_site"] for line in reported)
        assert list((root / "state" / site / run.name).glob("copy.*"))
        # One executor process answered every message the site got, in both
        # SuperLinks' lives: no process per message.
        answered = [x for x in federation.executor_log(site).splitlines() if "answered" in x]
        assert len(answered) >= config.rounds and len({x.split()[2] for x in answered}) == 1

    # The same metrics.jsonl, record for record: keys and values (timings aside).
    timing = {"wall_s", "eval_seconds"}

    def records(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(path)]

    assert records(run / "metrics.jsonl") == records(tmp_path / "sim" / "metrics.jsonl")

    # Nothing came down in round 1: every node built the starting model from
    # the run's seed, and its proof held (nothing rejected). Then only the
    # planned tensors (Q/K and embeddings stay put).
    down = {
        (r["round"], r["site"]): r["bytes_down"]
        for r in read_jsonl(run / "metrics.jsonl")
        if "site" in r
    }
    assert all(down[1, s] == 0 for s in SITES)
    whole = json.loads((run / "summary.json").read_text())["fedavg_mb_up"] * 1e6 / 3 / 3
    assert 0 < max(down[2, s] for s in SITES) < whole / 2

    assert main(["report", str(run)]) == 0
    report = (run / "report" / "report.md").read_text()
    assert "reported by the sites" in report

    intruder_state = root / "state" / "intruder"
    assert not intruder_state.exists() or not list(intruder_state.rglob("*.safetensors"))
    intruder_log = (root / "node-intruder.log").read_bytes()
    assert b"SuperNode ID" not in intruder_log
    assert b"Received successfully" not in intruder_log


@pytest.mark.slow
def test_flower_with_lora_adapters_matches_the_simulator(tmp_path):
    # The server holds only adapter factors and the head; each node builds
    # the frozen encoder and A itself from the run's seed.
    data = _corpus(tmp_path)
    config = flower_run_config(_settings(adapter="lora", lora_rank=4), tmp_path / "flower-run")
    _simulate_then_deploy(config, data, tmp_path, certs=None)
    ours = load_file(str(Path(config.out) / "model" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "sim" / "model" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and not any("lora" in k for k in ours)
    worst = max((ours[k].double() - theirs[k].double()).abs().max().item() for k in ours)
    assert worst <= 1e-5
    checkpoint = load_file(str(Path(config.out) / "checkpoints" / "round-0002.safetensors"))
    assert all(".lora_B." in k or k.startswith("head.") for k in checkpoint)


def _submit_until_round_two(
    federation, config, data, min_sites: int, timeout: float, retries: int = 0
):
    """Start a SuperLink and a SuperNode per site, submit ``config`` and
    return its ``flwr run`` process once round 2 is being sent."""
    federation.root.mkdir(parents=True, exist_ok=True)
    round_two = threading.Event()

    def watch(line: str) -> None:
        if f"round 2/{config.rounds}: sending" in line:
            round_two.set()

    federation.start_superlink()
    for site in SITES:
        federation.start_node(site, data, **_node_policy(config))
    process = federation.submit(
        config, min_sites, timeout, wait=False, on_line=watch, retries=retries
    )
    assert round_two.wait(timeout=600), "\n".join(federation.lines[-50:])
    return process


@pytest.mark.slow
def test_a_killed_node_is_tolerated_and_rejoins_with_its_ledger(tmp_path):
    data = _corpus(tmp_path)
    config = flower_run_config(_settings(rounds=3, freeze_from="3"), tmp_path / "flower-run")
    federation = LocalFederation(tmp_path / "deploy", certs=None)
    try:
        process = _submit_until_round_two(federation, config, data, min_sites=2, timeout=90)
        ledger = _node_ledger(tmp_path / "deploy" / "state", "site3")
        before = _epsilons(ledger)
        federation.kill_node("site3")
        # comes back with the same state folder
        federation.start_node("site3", data, **_node_policy(config))
        process.wait(timeout=900)
    finally:
        federation.close()
    log = "\n".join(federation.lines)
    assert process.returncode == 0, log[-3000:]
    records = read_jsonl(Path(config.out) / "metrics.jsonl")
    trained = {
        r["round"]: sorted(
            x["site"] for x in records if x["round"] == r["round"] and "examples" in x
        )
        for r in records
    }
    assert trained[2] == ["beth", "partners"]  # the round finished without site3
    assert trained[3] == list(SITES)  # and site3 came back for round 3
    assert any(r.get("site") == "site3" and "failed" in r for r in records if r["round"] == 2)

    after = [line for line in read_jsonl(ledger) if "mechanism" in line]
    assert [(r["round"], r["epsilon"]) for r in after[: len(before)]] == before  # kept
    assert after[-1]["round"] == 3
    mechanisms = [Mechanism.from_line(r) for r in after]  # the noisy count's line too
    # The last epsilon accounts for everything recorded before the kill too.
    composed = epsilon(mechanisms, config.delta, config.neighbours)
    assert after[-1]["epsilon"] == pytest.approx(composed, rel=1e-9)
    assert json.loads((Path(config.out) / "summary.json").read_text())["f1"] >= 0.0


@pytest.mark.slow
def test_a_killed_executor_is_replaced_and_its_round_charged_once(tmp_path):
    """SIGKILL a node's executor once it has charged round 2: the node
    command starts another, the server retries the round, and the site
    answers it on the same charge (its ledger: one charge a round). The
    SuperNode waits for the killed task's reply until Flower's task
    heartbeat lapses (about a minute), then replies with an error: the
    round's timeout must outlast that for the retry to come after it."""
    data = _corpus(tmp_path)
    config = flower_run_config(_settings(rounds=3, freeze_from="3"), tmp_path / "flower-run")
    federation = LocalFederation(tmp_path / "deploy", certs=None)
    try:
        process = _submit_until_round_two(
            federation, config, data, min_sites=3, timeout=200, retries=1
        )
        ledger = _node_ledger(tmp_path / "deploy" / "state", "beth")
        deadline = time.monotonic() + 300
        while 2 not in dict(_epsilons(ledger)) and time.monotonic() < deadline:
            time.sleep(0.01)
        (first,) = {x.split()[2] for x in federation.executor_log("beth").splitlines()}
        os.kill(int(first.rstrip(":")), signal.SIGKILL)
        process.wait(timeout=900)
    finally:
        federation.close()
    assert process.returncode == 0, "\n".join(federation.lines[-40:])
    assert [r for r, _ in _epsilons(ledger)] == [0, 1, 2, 3]  # round 2 charged once
    pids = {x.split()[2] for x in federation.executor_log("beth").splitlines()}
    assert len(pids) == 2 and first in pids  # replaced once
    summary = json.loads((Path(config.out) / "summary.json").read_text())
    assert "stopped" not in summary
    records = read_jsonl(Path(config.out) / "metrics.jsonl")
    trained = {r["round"] for r in records if r.get("site") == "beth" and "examples" in r}
    assert trained == {1, 2, 3}


def _site(i2b2_corpus, tmp_path, max_epsilon, run_name="run", node_options=None, **settings):
    # One local epoch: these check what a node allows and charges.
    base = {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32}
    config = flower_run_config(base | {"local_epochs": 1} | settings, tmp_path / "run")
    node = NodeConfig(
        i2b2_corpus,
        tmp_path / "state",
        site="beth",
        max_epsilon=max_epsilon,
        **(node_options or {}),
    )
    return NodeSite(config, node, run_name)


def test_a_node_refuses_rounds_past_its_own_budget_whatever_the_server_asks(i2b2_corpus, tmp_path):
    site = _site(i2b2_corpus, tmp_path, max_epsilon=0.5, target_epsilon=8.0)
    try:
        upload, record = site.runner.train_round(1, {})
        assert upload == {} and record["refused"] == "privacy budget"
        assert record["epsilon_if_trained"] > 0.5
        # Nothing trained, nothing charged but the noisy count every reply carries.
        (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
        charged = {x["mechanism"] for x in read_jsonl(ledger) if "mechanism" in x}
        assert charged == {"unit-count"}
    finally:
        site.close()


def test_a_node_sets_its_own_pass_cap_and_the_server_cannot(i2b2_corpus, tmp_path):
    # The cap fits the node's GPU memory: the node's setting, never the server's.
    values = {"data": str(i2b2_corpus), "state": str(tmp_path / "state"), "dp-pass-units": 16}
    assert NodeConfig.parse(values).dp_pass_units == 16
    with pytest.raises(ClinfedError, match="dp_pass_units: not a Flower setting"):
        _site(i2b2_corpus, tmp_path, 8.0, dp_pass_units=512)
    site = _site(i2b2_corpus, tmp_path, 8.0, node_options={"dp_pass_units": 16}, target_epsilon=8.0)
    try:
        assert site.runner.settings.dp_pass_units == 16
    finally:
        site.close()


def _train_and_release(site: NodeSite, round_number: int) -> dict:
    try:
        _, record = site.runner.train_round(round_number, {})
        site.runner.release(round_number)
        return record
    finally:
        site.close()


def test_every_run_at_a_node_charges_one_ledger_per_dataset(i2b2_corpus, tmp_path):
    # One round calibrated to epsilon 8; the node allows 10 over every run.
    first = _site(i2b2_corpus, tmp_path, 10.0, run_name="run-a", target_epsilon=8.0, rounds=1)
    assert "refused" not in _train_and_release(first, 1)
    # A new run name does not open a fresh ledger: the data's does not afford it.
    second = _site(i2b2_corpus, tmp_path, 10.0, run_name="run-b", target_epsilon=8.0, rounds=1)
    record = _train_and_release(second, 1)
    # Its epsilon is the dataset's count it rests on (charged under run-a), no training.
    from clinfed.privacy.accountants import epsilon
    from clinfed.privacy.count import count_mechanism

    count_only = epsilon([count_mechanism()], 1e-5, "add-remove")
    assert record["refused"] == "privacy budget"
    assert record["epsilon"] == pytest.approx(count_only)
    (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
    charges = [line for line in read_jsonl(ledger) if line.get("mechanism") == "dp-sgd"]
    assert [line["run"] for line in charges] == ["run-a"]
    # Other data (a note changed) is another dataset, with a ledger of its own.
    other = tmp_path / "other"
    shutil.copytree(i2b2_corpus, other)
    note = sorted(other.rglob("*.txt"))[0]
    note.write_bytes(note.read_bytes() + b"\n")
    config = flower_run_config(
        {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32}
        | {"target_epsilon": 8.0, "rounds": 1, "local_epochs": 1},
        tmp_path / "run",
    )
    third = NodeSite(config, NodeConfig(other, tmp_path / "state", "beth", 10.0), "run-b")
    assert "refused" not in _train_and_release(third, 1)
    assert len(list((tmp_path / "state" / "ledger").glob("beth-*.jsonl"))) == 2


def test_a_node_refuses_a_deleted_or_shortened_ledger(i2b2_corpus, tmp_path):
    for round_number in (1, 2):
        site = _site(i2b2_corpus, tmp_path, 100.0, target_epsilon=8.0, rounds=3)
        _train_and_release(site, round_number)
    (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
    whole = ledger.read_bytes()
    ledger.write_bytes(whole[: whole.index(b"\n") + 1])  # cut back to round 1
    with pytest.raises(USER_ERRORS, match="shortened"):
        _train_and_release(_site(i2b2_corpus, tmp_path, 100.0, target_epsilon=8.0, rounds=3), 3)
    ledger.unlink()
    with pytest.raises(USER_ERRORS, match="deleted"):
        _train_and_release(_site(i2b2_corpus, tmp_path, 100.0, target_epsilon=8.0, rounds=3), 3)


@pytest.mark.parametrize(
    ("settings", "node", "message"),
    [
        ({"target_epsilon": 8.0}, {"max_epsilon": None}, "no privacy budget of its own"),
        ({"target_epsilon": 8.0, "reproducible_noise": True}, {}, "reproducible noise"),
        ({"target_epsilon": 8.0, "max_grad_norm": 5.0}, {"max_grad_norm": 1.0}, "clipping norm"),
        ({"target_epsilon": 8.0, "max_length": 64}, {"max_length": 32}, "windows of 64"),
        ({"target_epsilon": 8.0, "lr": float("nan")}, {}, "lr"),
        ({"target_epsilon": 8.0}, {"privacy_unit": "document"}, "at least one document"),
        (
            {"target_epsilon": 8.0},
            {"require_secure_aggregation": True},
            "only through secure aggregation",
        ),
    ],
)
def test_a_node_validates_every_setting_against_its_policy(
    i2b2_corpus, tmp_path, settings, node, message
):
    node = {"max_epsilon": 8.0} | node
    max_epsilon = node.pop("max_epsilon")
    with pytest.raises(ClinfedError, match=message):
        _site(i2b2_corpus, tmp_path, max_epsilon, node_options=node, **settings)
    assert not (tmp_path / "state").exists()


def test_a_node_with_a_budget_refuses_a_run_without_dp(i2b2_corpus, tmp_path):
    with pytest.raises(ClinfedError, match="without DP"):
        _site(i2b2_corpus, tmp_path, max_epsilon=2.0)


def test_a_node_refuses_training_without_dp_unless_its_operator_allows_it(i2b2_corpus, tmp_path):
    with pytest.raises(ClinfedError, match="trains under DP only"):
        _site(i2b2_corpus, tmp_path, max_epsilon=None)
    site = _site(i2b2_corpus, tmp_path, max_epsilon=None, node_options={"allow_no_dp": True})
    site.close()


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", "", "x" * 101, "/abs"])
def test_a_node_refuses_run_names_that_would_leave_its_state_folder(i2b2_corpus, tmp_path, name):
    with pytest.raises(ClinfedError, match="run name .* refused"):
        _site(i2b2_corpus, tmp_path, max_epsilon=1.0, run_name=name, target_epsilon=1.0)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "state").exists()


def test_a_node_refuses_a_delta_above_its_cap(i2b2_corpus, tmp_path):
    # The server asks for delta 0.5 (a far smaller noise "within" a budget):
    # the site's default cap is 1/(10 n).
    with pytest.raises(ClinfedError, match="above this site's cap"):
        _site(i2b2_corpus, tmp_path, max_epsilon=8.0, target_epsilon=8.0, delta=0.5)
    with pytest.raises(ClinfedError, match="above this site's cap 1e-06"):
        _site(i2b2_corpus, tmp_path, 8.0, node_options={"max_delta": 1e-6}, target_epsilon=8.0)
    assert NodeConfig.parse(
        {"data": str(i2b2_corpus), "state": str(tmp_path), "max-delta": 1e-4, "allow-no-dp": True}
    ).allow_no_dp


def test_key_files_are_created_readable_by_their_owner_only(tmp_path):
    written = make_certificates(tmp_path / "pki", ["127.0.0.1"])
    private, public = make_node_key(tmp_path / "keys", "beth")
    for path in (written["ca.key"], written["server.key"], private):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert public.stat().st_mode & 0o077 != 0  # the public half is meant to be shared


@pytest.mark.slow
def test_supernode_authentication_lets_only_registered_keys_in(i2b2_corpus, tmp_path):
    certs = tmp_path / "certs"
    make_certificates(certs, ["127.0.0.1"])
    beth_key, beth_pub = make_node_key(tmp_path / "keys", "beth")
    intruder_key, _ = make_node_key(tmp_path / "keys", "intruder")
    (tmp_path / "deploy").mkdir()
    federation = LocalFederation(tmp_path / "deploy", certs=certs)
    try:
        federation.start_superlink(node_auth=True)
        registered = federation.flwr(register_command(beth_pub))
        assert registered.returncode == 0, registered.stdout + registered.stderr
        federation.start_node("beth", i2b2_corpus, key=beth_key)
        federation.start_node("intruder", i2b2_corpus, key=intruder_key)
        beth_log = tmp_path / "deploy" / "node-beth.log"
        deadline = time.monotonic() + 120
        while b"SuperNode ID" not in beth_log.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.5)  # the node command starts the SuperNode, which connects
        shown = federation.flwr(["flwr", "supernode", "list", "clinfed", "--format", "json"])
        listed = [n for n in json.loads(shown.stdout).get("nodes", []) if "online" in str(n)]
        time.sleep(5)  # give the intruder time to try
    finally:
        federation.close()
    assert len(listed) == 1
    beth_log = (tmp_path / "deploy" / "node-beth.log").read_bytes()
    intruder_log = (tmp_path / "deploy" / "node-intruder.log").read_bytes()
    assert b"SuperNode ID" in beth_log and b"SuperNode ID" not in intruder_log


@pytest.mark.slow
def test_pfeddc_over_flower_keeps_local_state_at_the_sites_like_the_simulator(tmp_path):
    data = _corpus(tmp_path)
    settings = _settings(strategy="pfeddc", prompt_depth=2, target_epsilon=None)
    config = flower_run_config(settings, tmp_path / "flower-run")
    _simulate_then_deploy(config, data, tmp_path, certs=None)
    run = Path(config.out)
    for site in SITES:
        # The copy each site kept after the final evaluation (it received round 2).
        name = "copy.r0002.safetensors"
        at_site = load_file(str(tmp_path / "deploy" / "state" / site / run.name / name))
        simulated_site = load_file(str(tmp_path / "sim" / "sites" / site / name))
        assert all(torch.equal(at_site[k], simulated_site[k]) for k in simulated_site)
    # Only P_g travelled, both ways.
    shared = [r for r in read_jsonl(run / "metrics.jsonl") if "site" in r]
    assert all(r["uploaded_params"] == 2 * 8 * 32 for r in shared)
    assert all(r["bytes_down"] == r["bytes_up"] for r in shared)


def test_mimic3_on_flower_takes_a_fixed_code_list(mimic_corpus, tmp_path):
    (tmp_path / "codes.txt").write_text("401.9\n427.31\n")
    codes = read_labels(tmp_path / "codes.txt")
    (tmp_path / "labels.json").write_text(json.dumps({"labels": codes}))
    assert read_labels(tmp_path / "labels.json") == codes
    (tmp_path / "twice.txt").write_text("401.9\n401.9\n")
    with pytest.raises(ClinfedError, match="twice"):
        read_labels(tmp_path / "twice.txt")
    config = flower_run_config(
        {"task": "mimic3", "strategy": "fedavg", "labels": codes}, tmp_path / "run"
    )
    task = Mimic3Task(labels=config.labels, cache_dir=str(tmp_path))
    assert task.labels == sorted(codes)  # known before any data: the server builds the model
    task.load(mimic_corpus, ProblemLog())
    assert task.labels == sorted(codes)  # a site's own code frequencies do not change it


def _serverapp_pids() -> list[int]:
    """Processes running a ServerApp (``flwr-serverapp``), found in /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"flwr-serverapp" in command:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_a_killed_serverapp_resumes_from_its_run_folder(tmp_path):
    data = _corpus(tmp_path)
    settings = _settings(strategy="fedfrozen", rounds=3, target_epsilon=None)
    config = flower_run_config(settings, tmp_path / "flower-run")
    reference = config.replace(data=str(data), out=str(tmp_path / "sim"))
    run_training(reference)
    federation = LocalFederation(tmp_path / "deploy", certs=None)
    try:
        first = _submit_until_round_two(federation, config, data, min_sites=3, timeout=300)
        pids = _serverapp_pids()
        assert pids, "no ServerApp process found"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        first.wait(timeout=120)
        state = json.loads((Path(config.out) / "state.json").read_text())
        assert state["round"] in (1, 2)  # killed before the run's end
        again = federation.submit(config.replace(resume=True), min_sites=3, round_timeout=300)
    finally:
        federation.close()
    assert again.returncode == 0, "\n".join(federation.lines[-40:])
    ours = load_file(str(Path(config.out) / "model" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "sim" / "model" / "model.safetensors"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    rounds = [r["round"] for r in read_jsonl(Path(config.out) / "metrics.jsonl") if "site" not in r]
    assert rounds == [1, 2, 3]  # the interrupted round's records were cut back, not doubled


@pytest.mark.slow
def test_a_serverapp_killed_after_its_dp_sites_replied_charges_each_round_once(tmp_path):
    data = _corpus(tmp_path)
    # A budget of exactly 3 rounds: a round charged twice stops round 3.
    settings = _settings(strategy="fedavg", rounds=3, target_epsilon=4.0)
    config = flower_run_config(settings, tmp_path / "flower-run")
    reference = config.replace(data=str(data), out=str(tmp_path / "sim"))
    run_training(reference)
    state = tmp_path / "deploy" / "state"
    federation = LocalFederation(tmp_path / "deploy", certs=None)
    try:
        first = _submit_until_round_two(federation, config, data, min_sites=3, timeout=300)
        deadline = time.time() + 300
        while time.time() < deadline:  # every node released round 2: it replied
            released = [
                any(x.get("released") and x["round"] == 2 for x in read_jsonl(path))
                for path in state.glob("*/ledger/*.jsonl")
            ]
            if len(released) == len(SITES) and all(released):
                break
            time.sleep(0.02)
        for pid in _serverapp_pids():
            os.kill(pid, signal.SIGKILL)
        first.wait(timeout=120)
        committed = json.loads((Path(config.out) / "state.json").read_text())["round"]
        again = federation.submit(config.replace(resume=True), min_sites=3, round_timeout=300)
    finally:
        federation.close()
    assert committed == 1, "the ServerApp committed round 2 before it could be killed"
    assert again.returncode == 0, "\n".join(federation.lines[-40:])
    for site in SITES:
        charged = [x["round"] for x in read_jsonl(_node_ledger(state, site)) if "mechanism" in x]
        # Round 0: the noisy count (add/remove); the replayed round was
        # answered, not retrained.
        assert charged == [0, 1, 2, 3], site
    ours = load_file(str(Path(config.out) / "model" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "sim" / "model" / "model.safetensors"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_node_evaluates_each_round_of_the_run_once(i2b2_corpus, tmp_path):
    site = _site(i2b2_corpus, tmp_path, 8.0, target_epsilon=8.0, rounds=3)
    try:
        runner = site.runner
        weights = {k: v.clone() for k, v in runner.model.state_dict().items()}
        other = {k: v + 0.01 if v.is_floating_point() else v for k, v in weights.items()}

        def evaluate(round_number: int, tensors: dict) -> dict | None:
            message = Message("evaluate", round_number, tensors, full=True, evaluate=True)
            return runner.handle(message).evaluation

        assert evaluate(2, weights) is not None  # the global model of round 1
        assert evaluate(2, weights) is not None  # the same weights again: same counts
        assert evaluate(2, other) is None  # other weights as round 1: refused
        assert evaluate(4, other) is not None  # round 3
        assert evaluate(3, weights) is None  # round 2, older than one evaluated
        assert evaluate(5, other) is None  # past the run's 3 rounds
    finally:
        site.close()


# Slow: real SuperLink and SuperNode processes. The same protocol through
# Flower's message path (records, the node's handler and site) runs in the
# default suite: tests/test_transports.py (dp-secure).
@pytest.mark.slow
def test_secure_aggregation_on_flower_equals_plain_aggregation(tmp_path, monkeypatch):
    """SecAgg over Flower (TLS, three SuperNodes, DP at each site): the final
    weights equal the simulator's plain aggregation, and no site's upload is
    in the server's run folder or any log."""
    from clinfed.federated.site import SiteRunner

    data = _corpus(tmp_path)
    settings = _settings(strategy="fedavg", secure_aggregation=True)
    config = flower_run_config(settings, tmp_path / "flower-run")
    # The reference: the same run in the simulator, aggregated in the clear;
    # its round-1 uploads are the ones the sites keep back on Flower.
    uploads = []
    original = SiteRunner.train_round

    def keep(self, round_number, strategy_state):
        upload, record = original(self, round_number, strategy_state)
        if round_number == 1:
            uploads.append(upload)
        return upload, record

    monkeypatch.setattr(SiteRunner, "train_round", keep)
    certs = tmp_path / "certs"
    make_certificates(certs, ["127.0.0.1", "localhost"])
    plain = config.replace(secure_aggregation=False, data=str(data), out=str(tmp_path / "sim"))
    run_training(plain)
    monkeypatch.setattr(SiteRunner, "train_round", original)
    _deploy(config, data, tmp_path, certs)

    run = Path(config.out)
    ours = load_file(str(run / "model" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "sim" / "model" / "model.safetensors"))
    worst = max((ours[k].double() - theirs[k].double()).abs().max().item() for k in ours)
    assert worst <= 1e-5
    records = [r for r in read_jsonl(run / "metrics.jsonl") if "bytes_up" in r]
    assert len(records) == 6 and all(r["secure"] for r in records)

    # Each site's round-1 upload, as float32 bytes: in no file of the run
    # folder and in no log of the server, the SuperLink or a node.
    assert len(uploads) == 3
    needles = [value.numpy().tobytes()[:64] for upload in uploads for value in upload.values()]
    files = [p for p in run.rglob("*") if p.is_file()]
    files += list((tmp_path / "deploy").glob("*.log"))
    for path in files:
        content = path.read_bytes()
        assert not any(needle in content for needle in needles), path


def test_a_node_refuses_a_plain_upload_in_a_run_that_promised_secure_aggregation(
    i2b2_corpus, tmp_path
):
    from clinfed.flower.handler import answer

    config = flower_run_config(
        {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32}
        | {"secure_aggregation": True, "target_epsilon": 8.0},
        tmp_path / "run",
    )
    run = {"name": "run", "config": config.to_dict()}
    node = {"data": str(i2b2_corpus), "state": str(tmp_path / "state"), "site": "beth"}
    node |= {"max-epsilon": 8.0}
    plain = Message("train", 1, {}, True, False)
    with pytest.raises(ClinfedError, match="asks for a plain upload"):
        answer(message_records(plain, run), node)
    assert not (tmp_path / "state").exists()
