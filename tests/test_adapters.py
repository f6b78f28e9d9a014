"""Adapters (LoRA, bias-only, head-only): what trains and travels, composition with the
plans, saving."""

from __future__ import annotations

import json

import pytest
import torch

from clinfed.federated.strategies.fedfrozen import FedFrozen, FedFrozenOptions
from clinfed.federated.strategies.safl import SAFL, SAFLOptions
from clinfed.modeling.adapters import add_bias, add_lora, merged, shared_names, shared_state
from clinfed.modeling.blocks import Block, block_of
from clinfed.modeling.models import build_model
from clinfed.runners.pipeline import RunConfig, run_training


def _lora_model(factors: str = "b"):
    model = build_model("token", "tiny", 5, seed=0)
    return add_lora(model, 4, 8.0, factors, seed=0)


def _is_adapter_or_head(name: str, factors: str = "b") -> bool:
    kinds = (".lora_B.",) if factors == "b" else (".lora_A.", ".lora_B.")
    return name.startswith("head.") or any(k in name for k in kinds)


@pytest.mark.parametrize("factors", ["b", "ab"])
def test_only_adapter_factors_and_the_head_are_shared(factors):
    model = _lora_model(factors)
    names = shared_names(model)
    assert names and all(_is_adapter_or_head(n, factors) for n in names)
    assert set(shared_state(model)) == set(names)
    # every encoder layer's linear layers carry an adapter
    blocks = {block_of(n) for n in names}
    assert {Block("query_key", 0), Block("value", 1), Block("rest", 1)} <= blocks


def test_the_merged_model_computes_what_the_adapted_one_does():
    model = _lora_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.5)  # a trained-looking update
    model.eval()
    plain = merged(model).eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    ids = torch.randint(1000, 2000, (2, 9))
    mask = torch.ones_like(ids)
    torch.testing.assert_close(plain(ids, mask), model(ids, mask), rtol=1e-4, atol=1e-5)
    assert any("lora" in n for n, _ in model.named_parameters())  # the original is kept


def test_fedfrozen_stops_the_query_key_adapters_after_its_warm_up():
    names = shared_names(_lora_model())
    strategy = FedFrozen(FedFrozenOptions(freeze_from="2"))
    early, late = strategy.plan(1, "s", names), strategy.plan(3, "s", names)
    qk = {n for n in names if block_of(n).kind == "query_key"}
    assert qk and qk <= early.uploaded
    assert not qk & (late.trainable | late.uploaded | late.downloaded)
    assert all(_is_adapter_or_head(n) for n in early.uploaded | late.uploaded)


def test_safl_moves_the_selected_layers_adapters_only():
    names = shared_names(_lora_model())
    strategy = SAFL(SAFLOptions(top_layers=1, selection="global"))
    strategy._chosen["s"] = [1]  # what select() found (attention profile aside)
    plan = strategy.plan(2, "s", names)
    layers = {block_of(n).layer for n in plan.uploaded if not n.startswith("head.")}
    assert layers == {1}
    assert all(_is_adapter_or_head(n) for n in plan.uploaded)


def _federated(data, run, **settings) -> dict:
    """A tiny FedAvg run with ``settings`` (the adapter among them)."""
    base = {"task": "i2b2", "strategy": "fedavg", "model": "tiny", "max_length": 32}
    return run_training(RunConfig.of(data=str(data), out=str(run), **(base | settings)))


def test_a_federated_lora_run_sends_adapters_and_head_only(i2b2_corpus, tmp_path, traffic):
    run = tmp_path / "run"
    summary = _federated(i2b2_corpus, run, rounds=2, adapter="lora", lora_rank=4)
    assert all(len(traffic.of(r)) == 3 for r in (1, 2))
    for message in traffic.messages:
        assert bool(message["up"]) == (message["kind"] == "train")
        assert all(_is_adapter_or_head(n) for n in message["up"])
        assert all(_is_adapter_or_head(n) for n in message["down"])
    assert summary["ratio_to_fedavg_up"] < 0.05  # against FedAvg of the whole model
    # The saved model is a plain one (adapters merged) and scores as the run did.
    from clinfed.runners.inference import evaluate_run

    assert json.loads((run / "config.json").read_text())["model"]["adapter"] == "lora"
    again = evaluate_run(run, i2b2_corpus / "test")
    assert again["f1"] == pytest.approx(summary["f1"], abs=1e-9)


def test_bias_only_shares_the_encoder_biases_and_the_head():
    model = add_bias(build_model("token", "tiny", 5, seed=0))
    names = shared_names(model)
    encoder = [n for n in names if n.startswith("encoder.")]
    assert encoder and all(n.endswith(".bias") for n in encoder)
    assert any("LayerNorm.bias" in n for n in encoder)  # BitFit trains every bias
    assert {n for n, _ in model.named_parameters() if n.startswith("head.")} <= set(names)
    assert set(shared_state(model)) == set(names)
    strategy = SAFL(SAFLOptions(top_layers=1, selection="global"))
    strategy._chosen["s"] = [0]
    plan = strategy.plan(2, "s", names)
    assert {block_of(n).layer for n in plan.uploaded if not n.startswith("head.")} == {0}
    assert merged(model) is not model and merged(model).adapter is None


def test_a_federated_bias_only_run_sends_biases_and_head_only(i2b2_corpus, tmp_path, traffic):
    run = tmp_path / "run"
    summary = _federated(i2b2_corpus, run, rounds=1, adapter="bias")
    uploads = [m["up"] for m in traffic.messages if m["kind"] == "train"]
    assert len(uploads) == 3
    for up in uploads:
        assert all(n.startswith("head.") or n.endswith(".bias") for n in up)
        assert any(n.startswith("encoder.") for n in up)
    assert summary["ratio_to_fedavg_up"] < 0.05
    from clinfed.runners.inference import evaluate_run

    again = evaluate_run(run, i2b2_corpus / "test")
    assert again["f1"] == pytest.approx(summary["f1"], abs=1e-9)


def test_a_head_only_run_trains_and_sends_the_head_alone(i2b2_corpus, tmp_path, traffic):
    run = tmp_path / "run"
    summary = _federated(i2b2_corpus, run, rounds=1, adapter="head")
    uploads = [m["up"] for m in traffic.messages if m["kind"] == "train"]
    assert len(uploads) == 3
    assert all(up and all(n.startswith("head.") for n in up) for up in uploads)
    # The saved encoder is the starting one: nothing but the head moved.
    from clinfed.modeling.models import load_saved_model

    start = build_model("token", "tiny", 7, seed=0)  # the run's seed; O + 3 types x B/I
    saved, _, _ = load_saved_model(run / "model")
    for name, value in saved.encoder.state_dict().items():
        torch.testing.assert_close(value, start.encoder.state_dict()[name])
    from clinfed.runners.inference import evaluate_run

    again = evaluate_run(run, i2b2_corpus / "test")
    assert again["f1"] == pytest.approx(summary["f1"], abs=1e-9)


def test_labels_trains_and_sends_the_heads_per_label_rows_alone(mimic_corpus, tmp_path, traffic):
    from clinfed.modeling.adapters import add_head, add_labels
    from clinfed.modeling.models import load_saved_model

    # Concept extraction: the head is one row per tag already, all of it.
    token = build_model("token", "tiny", 5, seed=0)
    assert shared_names(add_labels(token)) == shared_names(add_head(token)) == [
        "head.weight", "head.bias"
    ]  # fmt: skip
    # ICD coding: the label queries and outputs travel, the shared projection does not.
    run = tmp_path / "run"
    settings = {"task": "mimic3", "top_k": 10, "max_chunks": 2, "adapter": "labels"}
    settings["target_epsilon"] = 8.0  # DP-SGD clips the rows alone
    _federated(mimic_corpus, run, rounds=1, **settings)
    uploads = [set(m["up"]) for m in traffic.messages if m["kind"] == "train"]
    assert uploads and all(
        up == {"head.query.weight", "head.output.weight", "head.output.bias"} for up in uploads
    )
    start = build_model("multilabel", "tiny", 10, seed=0)
    saved, _, _ = load_saved_model(run / "model")
    for name in ("head.project.weight", "head.project.bias", "encoder.embeddings.word_embeddings"
                 ".weight"):  # fmt: skip
        torch.testing.assert_close(saved.state_dict()[name], start.state_dict()[name])
    assert not torch.equal(saved.head.output.weight, start.head.output.weight)
