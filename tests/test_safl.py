"""SAFL: attention scores, top-K, what it sends, and each selection mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clinfed.core import payload
from clinfed.core.errors import ProblemLog
from clinfed.federated.attention import layer_scores, profile, top_k_layers
from clinfed.federated.plan import full_plan
from clinfed.federated.strategies import get_strategy
from clinfed.modeling.models import build_model, load_tokenizer
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.adapter import I2b2Task


def test_layer_score_matches_a_direct_computation_on_a_tiny_model(i2b2_corpus, tmp_path):
    task = I2b2Task()
    docs = task.read_documents(i2b2_corpus / "test", ProblemLog())
    examples = task.encode(docs, load_tokenizer("tiny"), 64, str(tmp_path))
    examples = examples.select(range(12))
    model = build_model("token", "tiny", len(task.labels), seed=0)
    scores = profile(model, task, examples, batch_size=5)  # batches pad differently
    model.eval()
    model.encoder.set_attn_implementation("eager")
    for row, example in enumerate(examples):
        ids = torch.tensor([example["input_ids"]])
        with torch.no_grad():
            attentions = model.encoder(
                **model._inputs(ids, torch.ones_like(ids)), output_attentions=True
            ).attentions
        relevant = set(np.flatnonzero(example["concept_mask"]).tolist()) | {0}
        for layer, alpha in enumerate(attentions):
            heads, length = alpha.shape[1], alpha.shape[2]
            total = sum(
                float(alpha[0, h, i, j])
                for h in range(heads)
                for i in range(length)
                for j in relevant
            )
            assert scores[row, layer] == pytest.approx(total / (heads * length), rel=1e-4)
    assert ((scores >= 0) & (scores <= 1)).all()


def test_layer_scores_ignore_padding():
    alpha = torch.softmax(torch.randn(1, 2, 4, 4), dim=-1)
    mask = torch.tensor([[1, 1, 1, 1]])
    relevant = torch.tensor([[1, 0, 1, 0]])
    full = layer_scores([alpha], mask, relevant)
    padded_alpha = torch.zeros(1, 2, 6, 6)
    padded_alpha[:, :, :4, :4] = alpha
    padded = layer_scores(
        [padded_alpha], torch.tensor([[1, 1, 1, 1, 0, 0]]), torch.tensor([[1, 0, 1, 0, 1, 1]])
    )
    assert torch.allclose(full, padded)


def test_top_k_ties_break_towards_lower_layers():
    assert top_k_layers([0.2, 0.5, 0.5, 0.1, 0.5, 0.0], 2) == [1, 2]
    assert top_k_layers([0.3, 0.3, 0.3], 1) == [0]
    assert top_k_layers([0.1, 0.9, 0.4], 2) == [1, 2]


def test_k2_of_6_uploads_at_most_40_percent_of_fedavg_on_minilm():
    model = build_model("token", "minilm", num_labels=7)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    strategy = get_strategy("safl", {"top_layers": 2, "selection": "private"})
    strategy._chosen["s"] = [1, 4]
    plan = strategy.plan(2, "s", names)
    safl_bytes = len(payload.encode({n: params[n] for n in plan.uploaded}))
    fedavg_bytes = len(payload.encode({n: params[n] for n in full_plan(names).uploaded}))
    assert any(n.startswith("head.") for n in plan.uploaded)
    assert not any(".layer.0." in n or "embeddings" in n for n in plan.uploaded)
    assert safl_bytes <= 0.40 * fedavg_bytes


@pytest.mark.parametrize("selection", ["global", "private"])
def test_safl_run_records_layers_scores_and_selection_cost(i2b2_corpus, tmp_path, selection):
    run = tmp_path / "run"
    summary = run_training(
        RunConfig.of(
            task="i2b2",
            data=str(i2b2_corpus),
            out=str(run),
            strategy="safl",
            model="tiny",
            rounds=2,
            top_layers=1,
            selection=selection,
            profile_examples=8,
        )
    )
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    sites = [r for r in records if "site" in r]
    assert all(len(r["layers"]) == 1 and len(r["scores"]) == 2 for r in sites)
    if selection == "global":  # one choice per round, shared by every site
        for round_number in (1, 2):
            assert len({tuple(r["layers"]) for r in sites if r["round"] == round_number}) == 1
        assert all("selection_mechanism" not in r for r in sites)
    else:
        mechanism = sites[0]["selection_mechanism"]
        assert mechanism["type"] == "gaussian" and mechanism["sigma"] > 0
    assert 0 < summary["ratio_to_fedavg_up"] < 1


def test_private_selection_counts_each_privacy_unit_once(i2b2_corpus, tmp_path):
    task = I2b2Task()
    records = task.read_documents(i2b2_corpus / "train", ProblemLog())
    rows = task.encode(records, load_tokenizer("tiny"), 16, str(tmp_path))  # lines split
    first_notes = sorted(set(rows["doc"]))[:3]
    local = rows.select([i for i, d in enumerate(rows["doc"]) if d in first_notes])
    model = build_model("token", "tiny", num_labels=7)
    strategy = get_strategy(
        "safl",
        {"top_layers": 1, "selection": "private", "selection_noise": 1e-9, "profile_examples": 99},
    )
    for unit in ("example", "document"):
        units = task.unit_rows(local, unit)
        assert any(len(r) > 1 for r in units)
        info = strategy.select(1, "s", model, task, local, np.random.default_rng(0), unit)
        clipped = np.clip(profile(model, task, local), 0.0, 1.0)
        # every unit weighs the same, whatever its number of rows
        # (scaled by the public profile size, 99, never by the site's count)
        expected = np.sum([clipped[r].mean(axis=0) for r in units], axis=0) / 99
        mechanism = info["selection_mechanism"]
        assert mechanism["profile_units"] == 99 and len(units) not in mechanism.values()
        np.testing.assert_allclose(info["scores"], expected, atol=1e-5)
