"""Encoders, heads, the block map and saving/loading a model."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    DistilBertConfig,
    DistilBertModel,
    RobertaConfig,
    RobertaModel,
)

from clinfed.core.errors import ClinfedError
from clinfed.modeling.blocks import EMBEDDINGS, HEAD, Block, block_of, num_layers, parameter_blocks
from clinfed.modeling.heads import ChunkedLabelAttentionClassifier, LabelAttention, TokenTagger
from clinfed.modeling.models import (
    build_model,
    load_saved_model,
    load_tokenizer,
    save_model,
    special_tokens,
)

SMALL = {
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "intermediate_size": 32,
}


def encoders():
    return {
        "bert": BertModel(BertConfig(vocab_size=50, **SMALL), add_pooling_layer=False),
        "roberta": RobertaModel(RobertaConfig(vocab_size=50, **SMALL), add_pooling_layer=False),
        "distilbert": DistilBertModel(
            DistilBertConfig(vocab_size=50, dim=16, n_layers=3, n_heads=2, hidden_dim=32)
        ),
    }


@pytest.mark.parametrize("arch", ["bert", "roberta", "distilbert"])
def test_block_map_covers_every_parameter(arch):
    model = TokenTagger(encoders()[arch], num_labels=5)
    blocks = parameter_blocks([name for name, _ in model.named_parameters()])
    kinds = Counter((b.kind, b.layer) for b in blocks.values())
    assert num_layers(blocks) == 3
    for layer in range(3):
        # query and key: weight + bias each; value: weight + bias
        assert kinds[("query_key", layer)] == 4
        assert kinds[("value", layer)] == 2
        assert kinds[("rest", layer)] > 0
    assert kinds[("head", None)] == 2 and kinds[("embeddings", None)] > 0


def test_block_of_names():
    assert block_of("encoder.encoder.layer.4.attention.self.key.bias") == Block("query_key", 4)
    assert block_of("encoder.encoder.layer.0.attention.self.value.weight") == Block("value", 0)
    assert block_of("encoder.encoder.layer.2.output.dense.weight") == Block("rest", 2)
    assert block_of("encoder.transformer.layer.1.attention.q_lin.weight") == Block("query_key", 1)
    assert block_of("encoder.transformer.layer.1.attention.out_lin.weight") == Block("rest", 1)
    assert block_of("encoder.embeddings.word_embeddings.weight") == EMBEDDINGS
    assert block_of("head.weight") == HEAD
    with pytest.raises(ValueError, match="no known block"):
        block_of("encoder.mystery.weight")


def test_minilm_loads_offline_with_six_layers():
    model = build_model("token", "minilm", num_labels=7)
    blocks = parameter_blocks([n for n, _ in model.named_parameters()])
    assert num_layers(blocks) == 6
    assert model.encoder.config.hidden_size == 384
    # no pooler: it would be untrained dead weight in every plan
    assert not any("pooler" in n for n, _ in model.named_parameters())


def test_special_tokens_of_the_bundled_tokenizer():
    tokenizer = load_tokenizer("tiny")
    assert special_tokens(tokenizer) == ([tokenizer.cls_token_id], [tokenizer.sep_token_id])


def test_label_attention_ignores_padding_chunks_and_sees_every_chunk():
    torch.manual_seed(0)
    model = ChunkedLabelAttentionClassifier(encoders()["bert"], num_labels=4).eval()
    ids = torch.randint(1, 50, (1, 2, 6))
    mask = torch.ones_like(ids)
    one = model(ids[:, :1], mask[:, :1], torch.ones(1, 1, dtype=torch.long))
    padded = torch.cat([ids[:, :1], torch.zeros_like(ids[:, :1])], dim=1)
    two = model(
        padded, torch.cat([mask[:, :1], torch.zeros_like(mask[:, :1])], 1), torch.tensor([[1, 0]])
    )
    assert torch.allclose(one, two, atol=1e-5)
    both = model(ids, mask, torch.ones(1, 2, dtype=torch.long))
    assert not torch.allclose(one, both, atol=1e-4)  # the second chunk counts


def test_label_attention_matches_a_direct_computation():
    torch.manual_seed(1)
    head = LabelAttention(hidden=8, num_labels=3)
    hidden = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    logits = head(hidden, mask)
    for b in range(2):
        n = int(mask[b].sum())
        h = hidden[b, :n]
        a = (head.query(torch.tanh(head.project(h)))).softmax(0)  # (n, L)
        for label in range(3):
            v = (a[:, label : label + 1] * h).sum(0)
            expected = v @ head.output.weight[label] + head.output.bias[label]
            assert torch.allclose(logits[b, label], expected, atol=1e-5)


def test_save_and_load_reproduce_outputs(tmp_path):
    model = build_model("token", "tiny", num_labels=7, seed=3).eval()
    tokenizer = load_tokenizer("tiny")
    save_model(
        model, tmp_path, {"task": "i2b2", "head": "token", "labels": list("abcdefg")}, tokenizer
    )
    loaded, tok2, meta = load_saved_model(tmp_path)
    loaded.eval()
    ids = torch.tensor([[101, 2000, 2001, 102]])
    assert torch.equal(model(ids, torch.ones_like(ids)), loaded(ids, torch.ones_like(ids)))
    assert meta["labels"] == list("abcdefg") and tok2.vocab_size == tokenizer.vocab_size


def test_bad_model_spec_is_a_clear_error(tmp_path):
    with pytest.raises(ClinfedError, match="not 'minilm', 'tiny', a folder"):
        build_model("token", str(tmp_path / "nope"), num_labels=3)


class _WordHead(TokenTagger):
    """A head kind of a task's own (here a token tagger under another name)."""


class SpanTask:
    """What clinfed reads of a task that brings its own head."""

    head = "spans"
    head_class = _WordHead


def test_a_task_brings_a_head_kind_of_its_own(tmp_path, monkeypatch):
    from clinfed.tasks import REGISTRY, task_head

    with pytest.raises(ValueError, match="unknown head 'spans'"):
        build_model("spans", "tiny", num_labels=3)
    monkeypatch.setitem(REGISTRY, "spans", ("tests.test_models:SpanTask", ""))
    model = build_model("spans", "tiny", num_labels=3, seed=1, head_lookup=task_head).eval()
    assert type(model) is _WordHead
    meta = {"task": "spans", "head": "spans", "labels": ["O", "B-x", "I-x"]}
    save_model(model, tmp_path, meta, load_tokenizer("tiny"))
    loaded, _, _ = load_saved_model(tmp_path, task_head)  # rebuilt by the task's class, not HEADS
    ids = torch.tensor([[101, 2000, 102]])
    assert type(loaded) is _WordHead
    assert torch.equal(model(ids, torch.ones_like(ids)), loaded.eval()(ids, torch.ones_like(ids)))
