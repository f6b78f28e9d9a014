"""Decoder language models (Llama, Qwen2) as the shared model: tiny random
checkpoints with what real ones bring (a byte-level BPE tokenizer without a
pad token, grouped-query attention, RMSNorm, rotary positions, bf16 weights
on disk), under DP and the plans that select what a site sends."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clinfed.core.errors import ProblemLog
from clinfed.core.runs import read_jsonl
from clinfed.federated.client import apply_plan
from clinfed.federated.plan import Plan
from clinfed.federated.strategies.pfeddc import PFedDC
from clinfed.modeling.adapters import add_lora, shared_names
from clinfed.modeling.blocks import block_of
from clinfed.modeling.models import add_prompts, build_model, load_tokenizer, pad_token_id
from clinfed.modeling.training import run_epoch
from clinfed.privacy.dpsgd import make_private
from clinfed.privacy.randomness import reproducible
from clinfed.privacy.site import DPSettings
from clinfed.tasks.i2b2.adapter import I2b2Task

from .test_privacy import _expected_update, _no_dropout

WORDS = (
    "The patient was given aspirin for chest pain and a CT scan of the head showed no "
    "bleeding ; metformin was held for renal failure ."
)


def _tokenizer(folder):
    """A byte-level BPE tokenizer trained here, without a pad token (as Llama
    ships), saved as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([WORDS] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def make_decoder(folder, family: str) -> None:
    """A tiny random checkpoint of ``family``: 2 layers, 4 query heads over
    2 key/value heads; Qwen2's weights written in bf16."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel, Qwen2Config, Qwen2Model

    config_class, model_class = (
        (LlamaConfig, LlamaModel) if family == "llama" else (Qwen2Config, Qwen2Model)
    )
    _tokenizer(folder)
    shape = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=family != "llama",
    )  # fmt: skip
    # The family's tokenizer class may add tokens of its own (Qwen2's pad):
    # the table holds every id the tokenizer the model loads with gives.
    config_class(**shape).save_pretrained(folder)
    vocab = len(AutoTokenizer.from_pretrained(folder))
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=vocab, **shape))
    if family == "qwen2":
        model.to(torch.bfloat16)
    model.save_pretrained(folder)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def decoder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_decoder(folder, request.param)
    return str(folder)


def test_a_decoder_loads_in_fp32_with_its_pad_and_blocks(decoder):
    tokenizer = load_tokenizer(decoder)
    if "llama" in decoder:  # Llama ships no pad token: its end of text pads
        assert tokenizer.pad_token_id is None and pad_token_id(tokenizer) == tokenizer.eos_token_id
    model = build_model("token", decoder, num_labels=5)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # bf16 on disk
    attention = model.encoder.layers[0].self_attn
    assert attention.k_proj.out_features < attention.q_proj.out_features  # GQA
    blocks = {name: str(block_of(name)) for name, _ in model.named_parameters()}
    assert blocks["encoder.embed_tokens.weight"] == "embeddings"
    assert blocks["encoder.layers.1.self_attn.k_proj.weight"] == "layer1.query_key"
    assert blocks["encoder.layers.1.self_attn.v_proj.weight"] == "layer1.value"
    assert blocks["encoder.layers.0.input_layernorm.weight"] == "layer0.rest"
    assert blocks["encoder.norm.weight"] == "head"  # the top layer's output norm


@pytest.mark.parametrize(
    ("trainable", "clipping"),
    [("all", "bk"), ("all", "hooks"), ("lora", "bk"), ("prompts", "hooks")],
)
def test_a_decoder_s_dp_step_clips_each_unit_exactly(
    decoder, trainable, clipping, i2b2_corpus, tmp_path
):
    """Every trainable parameter (token table, RMSNorms, GQA projections,
    LoRA factors) gets sum_u clip(g_u) / U, each g_u computed alone."""
    tokenizer = load_tokenizer(decoder)
    task = I2b2Task()
    records = task.read_documents(i2b2_corpus / "train", ProblemLog())
    examples = task.encode(records, tokenizer, 24, str(tmp_path)).select(range(5))
    model = build_model(task.head, decoder, len(task.labels), seed=0)
    if trainable == "lora":
        add_lora(model, 4, 8.0, "ab", seed=0)
        with torch.no_grad():  # B starts at zero: give A a gradient too
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(std=0.1)
    if trainable == "prompts":  # pfeddc's deep prompts through the decoder's layers
        add_prompts(model, 3, "attention", depth=2)
        with torch.no_grad():  # the fusion's output starts at zero: give P_l a gradient
            model.prompt.fusion.output.weight.normal_(std=0.1)
    _no_dropout(model)
    names = [n for n, _ in model.named_parameters()]
    chosen = frozenset(shared_names(model) if trainable == "lora" else names)
    if trainable == "prompts":
        chosen = PFedDC().plan(1, "s", names).trainable
        assert any(n.startswith("prompt.local_prompt.") for n in chosen)
    apply_plan(model, Plan(chosen, chosen, frozenset(names)))
    units = task.unit_rows(examples, "example")
    params = [p for p in model.parameters() if p.requires_grad]
    clip = 0.05
    expected = _expected_update(model, task, examples, params, clip)
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=1.0)
    steps, update = make_private(
        model, optimizer, units, np.asarray(examples["n_tokens"]),
        DPSettings(noise_multiplier=0.0, max_grad_norm=clip, clipping=clipping),
        batch_size=len(units), randomness=reproducible(np.random.default_rng(0)),
        one_row_per_example=True,
    )  # fmt: skip
    try:
        run_epoch(model, task, examples, steps, update)
    finally:
        update.detach()
    assert update.mode == clipping
    for b, p, e in zip(before, params, expected):
        torch.testing.assert_close(b - p.detach(), e, rtol=1e-3, atol=1e-6)


def _train(corpus, out, model, *flags):
    from .test_cli import run_cli

    return run_cli(
        "train", "--data", str(corpus), "--out", str(out), "--model", model, "--rounds", "2",
        "--max-length", "32", "--threads", "1", "--local-epochs", "1", *flags,
    )  # fmt: skip


@pytest.mark.parametrize(
    "plan",
    [
        ("--strategy", "fedavg"),
        ("--strategy", "safl", "--adapter", "lora", "--top-layers", "1"),
        ("--strategy", "pfeddc"),  # deep prompts through the decoder's layers
    ],
)
def test_a_decoder_trains_under_dp_predicts_and_scores(decoder, plan, i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    result = _train(i2b2_corpus, out, decoder, "--target-epsilon", "8", *plan)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["f1"] <= 1.0 and max(summary["epsilon"].values()) <= 8.0
    assert any((out / "predictions").rglob("*.con"))  # the task's own format
    config = json.loads((out / "config.json").read_text())
    assert config["privacy"]["neighbours"] == "add-remove"


def test_safl_on_a_decoder_sends_its_selected_layers_and_fedfrozen_never_query_or_key(
    decoder, i2b2_corpus, tmp_path
):
    safl = _train(i2b2_corpus, tmp_path / "safl", decoder, "--strategy", "safl",
                  "--top-layers", "1")  # fmt: skip
    assert safl.returncode == 0, safl.stderr[-2000:]
    for record in read_jsonl(tmp_path / "safl" / "metrics.jsonl"):
        if "sent_blocks" in record:
            layers = {b.split(".")[0] for b in record["sent_blocks"] if b.startswith("layer")}
            assert len(layers) == 1 and "embeddings" not in record["sent_blocks"]
    frozen = _train(i2b2_corpus, tmp_path / "frozen", decoder, "--strategy", "fedfrozen",
                    "--freeze-from", "2")  # fmt: skip
    assert frozen.returncode == 0, frozen.stderr[-2000:]
    sent = [r for r in read_jsonl(tmp_path / "frozen" / "metrics.jsonl") if "sent_blocks" in r]
    late = [r for r in sent if r["round"] > 1]
    assert late and all(not any("query_key" in b for b in r["sent_blocks"]) for r in late)


@pytest.mark.parametrize("plan", [(), ("--strategy", "safl", "--adapter", "lora")])
def test_icd_coding_reads_a_note_past_512_tokens_whole_on_a_decoder(
    decoder, plan, mimic_corpus, tmp_path
):
    from clinfed.tasks.mimic3.adapter import Mimic3Task

    task = Mimic3Task(top_k=5, max_chunks=1, cache_dir=str(tmp_path))
    corpus = task.load(mimic_corpus, ProblemLog())
    encoded = task.encode(corpus.train, load_tokenizer(decoder), 2048, str(tmp_path))
    longest = max(range(len(encoded)), key=lambda i: encoded[i]["n_tokens"])
    assert encoded[longest]["n_tokens"] > 512 and len(encoded[longest]["input_ids"]) == 1
    out = tmp_path / "run"
    result = _train(mimic_corpus, out, decoder, "--task", "mimic3", "--max-length", "2048",
                    "--target-epsilon", "8", "--rounds", "1", *plan)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "f1" in json.loads((out / "summary.json").read_text())
    assert json.loads((out / "config.json").read_text())["data"]["max_length"] == 2048
    # An encoder reads 512 tokens at most: asking it for more is refused by name.
    refused = _train(mimic_corpus, tmp_path / "bert", "tiny", "--task", "mimic3",
                     "--max-length", "2048")  # fmt: skip
    assert refused.returncode == 2 and "reads at most 512 tokens" in refused.stderr
