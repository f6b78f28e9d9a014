"""Any local Hugging Face encoder checkpoint: tiny random RoBERTa and
DeBERTa-v2 checkpoints (built from configs, with the bundled tokenizer)
train under every plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from .test_cli import run_cli

PLANS = {
    "centralized": ("--strategy", "centralized", "--epochs", "1"),
    "fedavg": ("--strategy", "fedavg"),
    "fedprox": ("--strategy", "fedprox"),
    "fedadam": ("--strategy", "fedadam"),
    "ditto": ("--strategy", "ditto"),
    "local": ("--strategy", "local"),
    "fedfrozen": ("--strategy", "fedfrozen", "--freeze-from", "2"),
    "safl": ("--strategy", "safl", "--top-layers", "1"),
    "safl+fedfrozen": ("--strategy", "safl+fedfrozen", "--top-layers", "1", "--freeze-from", "2"),
    "pfeddc": ("--strategy", "pfeddc"),
    "lora": ("--strategy", "fedavg", "--adapter", "lora"),
    "bias": ("--strategy", "fedavg", "--adapter", "bias"),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    from transformers import (
        AutoTokenizer,
        DebertaV2Config,
        DebertaV2Model,
        RobertaConfig,
        RobertaModel,
    )

    from clinfed.modeling.models import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir("tiny"), local_files_only=True)
    size = dict(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=37, max_position_embeddings=160,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    models = {
        "roberta": RobertaModel(RobertaConfig(**size), add_pooling_layer=False),
        "deberta-v2": DebertaV2Model(
            DebertaV2Config(
                **size,
                relative_attention=True,
                position_buckets=16,
                pos_att_type=["p2c", "c2p"],
                type_vocab_size=0,
            )  # fmt: skip
        ),
    }
    folders = {}
    for name, model in models.items():
        folders[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


def _train(checkpoint, data, out, *extra):
    return run_cli("train", "--task", "i2b2", "--model", str(checkpoint), "--rounds", "2",
                   "--max-length", "32", "--threads", "1", "--data", str(data),
                   "--out", str(out), *extra)  # fmt: skip


@pytest.mark.parametrize("family", ["roberta", "deberta-v2"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_every_plan_trains_a_roberta_and_a_deberta_v2_checkpoint(
    checkpoints, i2b2_corpus, tmp_path, family, plan
):
    result = _train(checkpoints[family], i2b2_corpus, tmp_path / "run", *PLANS[plan])
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def test_roberta_trains_under_dp_and_deberta_v2_is_refused_with_the_reason(
    checkpoints, i2b2_corpus, tmp_path
):
    dp = ("--strategy", "safl+fedfrozen", "--top-layers", "1", "--freeze-from", "2",
          "--target-epsilon", "8")  # fmt: skip
    trained = _train(checkpoints["roberta"], i2b2_corpus, tmp_path / "roberta", *dp)
    assert trained.returncode == 0, trained.stderr[-2000:]
    refused = _train(checkpoints["deberta-v2"], i2b2_corpus, tmp_path / "deberta", *dp)
    assert refused.returncode == 2 and "DP-SGD does not support DeBERTa-v2" in (refused.stderr)
    assert not (tmp_path / "deberta").exists()


@pytest.mark.parametrize("family", ["roberta", "deberta-v2"])
def test_every_parameter_has_its_block_and_each_layer_its_query_key(checkpoints, family):
    from clinfed.modeling.blocks import parameter_blocks
    from clinfed.modeling.models import load_encoder

    names = [f"encoder.{n}" for n, _ in load_encoder(str(checkpoints[family])).named_parameters()]
    blocks = parameter_blocks(names)  # raises for a name no rule knows
    kinds = {(b.kind, b.layer) for b in blocks.values()}
    assert {("query_key", 0), ("query_key", 1), ("value", 0), ("value", 1)} <= kinds
    if family == "deberta-v2":  # the relative-position table is an embedding
        assert str(blocks["encoder.encoder.rel_embeddings.weight"]) == "embeddings"


def test_an_unsupported_family_and_broken_checkpoints_are_refused_before_any_charge(
    i2b2_corpus, tmp_path
):
    from transformers import AutoTokenizer, BertConfig, BertModel, GPT2Config, GPT2Model

    from clinfed.modeling.models import checkpoint_dir

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir("tiny"), local_files_only=True)
    # GPT-2: no registered family knows its names (h.0.attn.c_attn).
    gpt2 = tmp_path / "gpt2"
    GPT2Model(
        GPT2Config(vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=2,
                   n_positions=160)
    ).save_pretrained(gpt2)  # fmt: skip
    tokenizer.save_pretrained(gpt2)
    # The broken checkpoints are of a supported family: each failure its own.
    bert = tmp_path / "bert"
    BertModel(
        BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=2, intermediate_size=37, max_position_embeddings=160)
    ).save_pretrained(bert)  # fmt: skip
    tokenizer.save_pretrained(bert)

    def broken(name: str, damage) -> Path:
        folder = tmp_path / name
        shutil.copytree(bert, folder)
        damage(folder)
        return folder

    cases = {
        "gpt2": (gpt2, "the gpt2 family is not supported"),
        "bad config": (
            broken("config", lambda f: (f / "config.json").write_text("{not json")),
            "config.json",
        ),
        "unknown kind": (
            broken("kind", lambda f: (f / "config.json").write_text('{"model_type": "zzz"}')),
            "zzz",
        ),
        "no weights": (
            broken("weights", lambda f: (f / "model.safetensors").unlink()),
            "weights cannot be loaded",
        ),
        "truncated weights": (
            broken(
                "cut",
                lambda f: (f / "model.safetensors").write_bytes(
                    (f / "model.safetensors").read_bytes()[:1000]
                ),
            ),
            "weights cannot be loaded",
        ),  # fmt: skip
        "no tokenizer": (
            broken(
                "tok",
                lambda f: [
                    p.unlink()
                    for p in f.iterdir()
                    if p.suffix != ".safetensors" and p.name != "config.json"
                ],
            ),
            "tokenizer cannot be loaded",
        ),
    }
    for case, (folder, said) in cases.items():
        out = tmp_path / f"run-{case.replace(' ', '-')}"
        result = _train(folder, i2b2_corpus, out, "--target-epsilon", "8")
        assert result.returncode == 2, (case, result.stdout, result.stderr)
        assert said in result.stderr and str(folder) in result.stderr, (case, result.stderr)
        assert "cannot be loaded" in result.stderr or case == "gpt2"
        assert "Traceback" not in result.stderr
        # Nothing charged: no ledger line anywhere.
        assert not [p for p in out.rglob("*.jsonl") if "privacy" in p.parts], case


def test_a_family_added_in_one_file_trains_under_dp_and_safl(i2b2_corpus, tmp_path):
    # Phi came as clinfed/modeling/families/phi.py alone: its final LayerNorm, plain
    # feed-forward and attention output are read from there by the blocks,
    # LoRA and prompts, and DP-SGD clips it like any decoder.
    from transformers import AutoTokenizer, PhiConfig, PhiModel

    from clinfed.modeling.families import family_of
    from clinfed.modeling.models import checkpoint_dir

    assert family_of("phi").name == "Phi"
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir("tiny"), local_files_only=True)
    phi = tmp_path / "phi"
    torch.manual_seed(0)
    PhiModel(
        PhiConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=37, max_position_embeddings=160,
                  pad_token_id=tokenizer.pad_token_id)
    ).save_pretrained(phi)  # fmt: skip
    tokenizer.save_pretrained(phi)
    out = tmp_path / "run"
    result = _train(phi, i2b2_corpus, out, "--strategy", "safl", "--top-layers", "1",
                    "--target-epsilon", "8", "--adapter", "lora")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert all(0 < eps <= 8.0 for eps in summary["epsilon"].values())
    sent = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("layers") for r in sent if "bytes_up" in r)  # SAFL chose its layers
