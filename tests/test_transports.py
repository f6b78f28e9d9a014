"""The same run through both transports: in-process, and Flower's message
path (records, node config, the node's site builder) over a grid in this
process. Records and weights must be the same."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors.torch import load_file

from clinfed.core.runs import read_jsonl
from clinfed.federated.engine import Deployment
from clinfed.flower.deploy import flower_run_config
from clinfed.flower.handler import SiteCache, answer
from clinfed.flower.server import GridTransport, node_run
from clinfed.runners.federation import run_federation
from clinfed.runners.pipeline import run_training
from clinfed.tasks.i2b2.synth import generate

SITES = ("beth", "partners", "site3")


@dataclass
class _Metadata:
    reply_to_message_id: str


@dataclass
class _Reply:
    """What Grid.pull_messages gives back: a reply's content, or an error."""

    metadata: _Metadata
    content: object = None
    error: object = None

    def has_error(self) -> bool:
        return self.error is not None


@dataclass
class InProcessGrid:
    """Flower's Grid, as GridTransport uses it, over nodes in this process:
    each node answers with the ClientApp's own handler (``answer``), from
    its node config, a site cache of its own like a node's worker."""

    nodes: dict[int, dict]
    replies: dict[str, _Reply] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)
    caches: dict[int, SiteCache] = field(default_factory=dict)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def push_messages(self, messages) -> list[str]:
        ids = []
        for message in messages:
            node = message.metadata.dst_node_id
            mid = f"m{next(self.ids)}"
            cache = self.caches.setdefault(node, SiteCache())
            content = answer(message.content, self.nodes[node], cache)
            self.replies[mid] = _Reply(_Metadata(mid), content)
            ids.append(mid)
        return ids

    def pull_messages(self, ids) -> list[_Reply]:
        return [self.replies.pop(mid) for mid in ids if mid in self.replies]

    def close(self) -> None:
        for cache in self.caches.values():
            cache.drop()


def _run_both(tmp_path: Path, **settings):
    data = tmp_path / "data"
    generate(data, sites=3, docs=6, seed=0)
    if settings.get("public_check"):  # public notes of other patients, for the server
        generate(tmp_path / "public", sites=1, docs=6, seed=5)
        settings["public_check"] = str(tmp_path / "public")
    values = {
        "task": "i2b2",
        "model": "tiny",
        "strategy": "fedavg",
        "rounds": 2,
        "max_length": 32,
        "batch_size": 8,
        "threads": 1,
    } | settings
    config = flower_run_config(values, tmp_path / "flower")
    run_training(config.replace(data=str(data), out=str(tmp_path / "inprocess")))
    nodes = {
        index: {
            "data": str(data),
            "state": str(tmp_path / "state" / site),
            "site": site,
            "allow-no-dp": True,
            "max-epsilon": 100.0,
            "share-ledger": True,
            "threads": 1,
        }
        for index, site in enumerate(SITES, start=11)
    }
    grid = InProcessGrid(nodes)
    # The settings as the ServerApp reads them from its run config (JSON).
    run = node_run(json.loads(json.dumps(config.to_dict())), config.out)
    try:
        run_federation(
            config,
            Deployment(min_sites=3, wait_for_sites=0.0, round_retries=0),
            GridTransport(grid, run),
        )
    finally:
        grid.close()
    return tmp_path / "inprocess", tmp_path / "flower"


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="fedavg"),
        pytest.param(
            # The bias plan: the transports' equivalence does not depend on
            # what trains, and the whole model's secure noise and masks took
            # 31 of this case's 56 s.
            {
                "target_epsilon": 8.0,
                "reproducible_noise": True,
                "secure_aggregation": True,
                "adapter": "bias",
            },
            id="dp-secure",
        ),
        # The server judges each round on public notes: the rounds it does not
        # keep must reach every node again (the kept model, not their own).
        pytest.param({"public_check": True, "rounds": 3}, id="public-check"),
    ],
)
def test_a_run_gives_the_same_records_and_weights_through_either_transport(
    tmp_path, settings, monkeypatch
):
    from flwr.supercore.task_identity import TaskIdentity

    # Who builds Flower messages (a ServerApp's run, on the SuperLink's node).
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    inprocess, flower = _run_both(tmp_path, **settings)
    ours = load_file(str(flower / "model" / "model.safetensors"))
    theirs = load_file(str(inprocess / "model" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    worst = max((ours[k].double() - theirs[k].double()).abs().max().item() for k in ours)
    assert worst <= 1e-5

    timing = {"wall_s", "eval_seconds"}

    def records(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(path)]

    assert records(flower / "metrics.jsonl") == records(inprocess / "metrics.jsonl")
    if settings.get("public_check"):
        rows = read_jsonl(flower / "metrics.jsonl")
        checked = [r["public_check"] for r in rows if "public_check" in r]
        assert len(checked) == 3 and not all(c["kept"] for c in checked)
        config = json.loads((flower / "config.json").read_text())
        assert config["public_check_text"]["folder"] == str(tmp_path / "public")
    if settings.get("secure_aggregation"):
        trained = [r for r in read_jsonl(flower / "metrics.jsonl") if "bytes_up" in r]
        assert trained and all(r["secure"] for r in trained)


def test_the_in_process_transport_carries_the_wire_form_not_the_objects():
    # A site gets what a remote site would (a decoded copy), and the server
    # reads what a remote site would send: JSON values, fresh tensors.
    import torch

    from clinfed.federated.inprocess import InProcessTransport
    from clinfed.federated.messages import Message, Reply

    sent = {"w": torch.ones(2, 3)}
    received = []

    class Site:
        def handle(self, message, release=True):
            received.append(message)
            record = {"round": message.round, "layers": (1, 2)}
            return Reply(site="a", upload={"w": message.download["w"] * 2}, record=record)

    message = Message("train", 1, sent, full=True, evaluate=False, strategy_state={"k": (1,)})
    ((address, reply),) = list(InProcessTransport({"a": Site()}).exchange({"a": message}, 1.0))
    (got,) = received
    assert got is not message and got.download["w"] is not sent["w"]
    assert torch.equal(got.download["w"], sent["w"]) and got.strategy_state == {"k": [1]}
    assert reply.record == {"round": 1, "layers": [1, 2]}  # JSON: tuples come back as lists
    assert torch.equal(reply.upload["w"], 2 * sent["w"])
