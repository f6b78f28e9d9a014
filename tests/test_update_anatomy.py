"""``benchmarks/update_anatomy.py``: the groups it reads a model's update by,
and the spectrum that tells noise from a fine-tuning update."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from update_anatomy import group_of, layer_order, spectrum  # noqa: E402


def test_every_tensor_of_the_token_model_falls_in_a_named_group():
    from clinfed.modeling.models import build_model

    names = [name for name, _ in build_model("token", "tiny", 5, seed=0).named_parameters()]
    groups = {name: group_of(name) for name in names}
    assert "other" not in groups.values()
    layer = "encoder.encoder.layer.0."
    assert groups[layer + "attention.self.query.weight"] == "query and key"
    assert groups[layer + "attention.self.value.weight"] == "value and attention output"
    assert groups[layer + "attention.output.dense.weight"] == "value and attention output"
    assert groups[layer + "intermediate.dense.weight"] == "feed-forward"
    assert groups[layer + "output.dense.weight"] == "feed-forward"
    assert groups[layer + "output.LayerNorm.weight"] == "LayerNorm gains"
    assert groups[layer + "attention.self.query.bias"] == "other biases"
    assert groups["encoder.embeddings.token_type_embeddings.weight"] == "token-type table"


def test_the_spectrum_tells_a_noise_walk_from_a_low_rank_update():
    generator = torch.Generator().manual_seed(0)
    start = {"w": torch.zeros(64, 64)}
    noise = torch.randn(64, 64, generator=generator)
    low_rank = torch.outer(
        torch.randn(64, generator=generator), torch.randn(64, generator=generator)
    )
    (row,) = spectrum({"w": noise}, start, {"w": low_rank + 0.05 * noise})
    assert row["private_top_over_median"] < 4 < 20 < row["reference_top_over_median"]
    assert abs(row["cosine"]) < 0.2
    (same,) = spectrum({"w": low_rank}, start, {"w": low_rank + 0.05 * noise})
    assert same["cosine"] > 0.9


def test_by_layer_every_tensor_sits_in_the_embeddings_a_layer_or_the_head():
    from clinfed.modeling.models import build_model

    model = build_model("token", "tiny", 5, seed=0)
    groups = {name: group_of(name, "layer") for name, _ in model.named_parameters()}
    assert "other" not in groups.values()
    assert groups["encoder.encoder.layer.0.output.dense.weight"] == "layer 0"
    assert groups["encoder.embeddings.token_type_embeddings.weight"] == "embeddings"
    assert groups["head.weight"] == "head"
    layers = model.encoder.config.num_hidden_layers
    assert {g for g in groups.values() if g.startswith("layer ")} == {
        f"layer {i}" for i in range(layers)
    }


def test_layer_groups_sort_in_the_model_s_order():
    groups = ["head", "layer 10", "embeddings", "layer 2", "layer 0"]
    assert sorted(groups, key=layer_order) == [
        "embeddings",
        "layer 0",
        "layer 2",
        "layer 10",
        "head",
    ]
