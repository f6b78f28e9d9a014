"""The federated round: aggregation, plans, partitions, payloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clinfed.core import payload
from clinfed.core.errors import ClinfedError
from clinfed.federated.aggregation import Aggregator
from clinfed.federated.client import apply_plan
from clinfed.federated.engine import sample_sites as sample_clients
from clinfed.federated.partition import partition
from clinfed.federated.plan import Plan
from clinfed.federated.strategies import get_strategy
from clinfed.modeling.models import build_model


def test_aggregation_is_a_per_parameter_weighted_mean_over_senders():
    current = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([5.0]), "c": torch.tensor([9.0])}
    agg = Aggregator()
    agg.add({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0])}, num_examples=1)
    agg.add({"a": torch.tensor([4.0, 8.0])}, num_examples=3)  # site 2 sends only "a"
    agg.add({"b": torch.tensor([3.0])}, num_examples=2)  # site 3 sends only "b"
    new = agg.result(current)
    # a: (1*[1,2] + 3*[4,8]) / 4 ; b: (1*1 + 2*3) / 3 ; c: nobody sent it
    assert torch.allclose(new["a"], torch.tensor([13 / 4, 26 / 4]))
    assert torch.allclose(new["b"], torch.tensor([7 / 3]))
    assert torch.equal(new["c"], current["c"])
    assert new["a"].dtype == current["a"].dtype


def test_aggregation_of_disjoint_layer_subsets_keeps_each_senders_value():
    current = {"layer0": torch.zeros(3), "layer1": torch.zeros(3), "head": torch.zeros(1)}
    agg = Aggregator()
    agg.add({"layer0": torch.ones(3), "head": torch.tensor([2.0])}, 10)
    agg.add({"layer1": torch.full((3,), 4.0), "head": torch.tensor([4.0])}, 30)
    new = agg.result(current)
    assert torch.equal(new["layer0"], torch.ones(3))
    assert torch.equal(new["layer1"], torch.full((3,), 4.0))
    assert torch.allclose(new["head"], torch.tensor([3.5]))


def test_aggregation_refuses_unknown_parameters_and_empty_updates():
    agg = Aggregator()
    with pytest.raises(ValueError):
        agg.add({"a": torch.zeros(1)}, 0)
    agg.add({"zzz": torch.zeros(1)}, 1)
    with pytest.raises(KeyError):
        agg.result({"a": torch.zeros(1)})


def test_payload_round_trip_and_measured_size():
    tensors = {"w": torch.randn(10, 4), "b": torch.zeros(4)}
    data = payload.encode(tensors)
    back = payload.decode(data)
    assert all(torch.equal(tensors[k], back[k]) for k in tensors)
    assert len(data) >= (40 + 4) * 4  # float32 values plus a header


def test_plan_freezes_what_it_does_not_train():
    model = build_model("token", "tiny", num_labels=3)
    names = [n for n, _ in model.named_parameters()]
    head = frozenset(n for n in names if n.startswith("head."))
    count = apply_plan(model, Plan(head, head, frozenset(names)))
    assert count == sum(p.numel() for p in model.head.parameters())
    assert all(p.requires_grad == n.startswith("head.") for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="does not train"):
        Plan(head, frozenset(names), frozenset())


def test_strategy_plans():
    names = ["encoder.embeddings.word_embeddings.weight", "head.weight"]
    assert get_strategy("fedavg").plan(1, "a", names).uploaded == frozenset(names)
    assert get_strategy("fedprox", {"mu": 0.5}).opts.mu == 0.5
    local = get_strategy("local").plan(1, "a", names)
    assert local.trainable == frozenset(names) and not local.uploaded and not local.downloaded
    with pytest.raises(ClinfedError):
        get_strategy("fedsomething")


def test_partitions():
    groups = np.repeat(np.arange(20), 3)  # 20 documents of 3 lines
    labels = np.arange(20) % 2
    sites = np.where(groups < 10, "beth", "partners")
    by_site = partition(groups, labels, sites, "sites", 0, 0.5, 0)
    assert {k: len(v) for k, v in by_site.items()} == {"beth": 30, "partners": 30}
    iid = partition(groups, labels, sites, "iid", 4, 0.5, 0)
    assert sorted(len(v) for v in iid.values()) == [15, 15, 15, 15]
    assert sorted(np.concatenate(list(iid.values())).tolist()) == list(range(60))
    for part in iid.values():  # a document never straddles two clients
        assert len(set(groups[part].tolist())) * 3 == len(part)
    skewed = partition(groups, labels, sites, "dirichlet", 3, 0.1, 0)
    assert all(len(v) > 0 for v in skewed.values())
    assert skewed.keys() == partition(groups, labels, sites, "dirichlet", 3, 0.1, 0).keys()
    with pytest.raises(ClinfedError, match="more than the 20 training documents"):
        partition(groups, labels, sites, "iid", 21, 0.5, 0)


def test_client_sampling_is_seeded_and_never_empty():
    names = [f"c{i}" for i in range(10)]
    first = sample_clients(names, 0.3, np.random.default_rng(0))
    assert len(first) == 3 and first == sample_clients(names, 0.3, np.random.default_rng(0))
    assert sample_clients(names, 0.01, np.random.default_rng(0)) != []
    assert sample_clients(names, 1.0, np.random.default_rng(0)) == names
