"""A run's model loads in plain transformers with its real labels."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

from clinfed.modeling.models import load_saved_model

from .test_cli import run_cli


def test_an_exported_model_loads_in_transformers_with_its_labels(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    trained = run_cli("train", "--task", "i2b2", "--strategy", "fedavg", "--model", "tiny",
                      "--rounds", "1", "--max-length", "32", "--threads", "1",
                      "--data", str(i2b2_corpus), "--out", str(run))  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    out = tmp_path / "hf"
    exported = run_cli("export", str(run), "--out", str(out), "--json")
    assert exported.returncode == 0, exported.stderr
    record = json.loads(exported.stdout)
    assert set(record["versions"]) == {"clinfed", "torch", "transformers"}

    model = AutoModelForTokenClassification.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    labels = json.loads((run / "labels.json").read_text())["labels"]
    assert [model.config.id2label[i] for i in range(len(labels))] == labels
    assert model.config.label2id["B-problem"] == labels.index("B-problem")
    ours, _, _ = load_saved_model(run / "model")
    batch = tokenizer(["Patient denies chest pain ."], return_tensors="pt")
    model.eval()
    ours.eval()
    with torch.no_grad():
        theirs = model(**batch).logits
        mine = ours(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=1e-4)

    again = run_cli("export", str(run), "--out", str(out))
    assert again.returncode == 2  # never overwrites


def test_a_label_attention_model_is_not_exported_and_says_how_to_load_it(mimic_corpus, tmp_path):
    run = tmp_path / "run"
    trained = run_cli("train", "--task", "mimic3", "--model", "tiny", "--epochs", "1",
                      "--max-length", "32", "--max-chunks", "2", "--threads", "1",
                      "--data", str(mimic_corpus), "--out", str(run))  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    refused = run_cli("export", str(run), "--out", str(tmp_path / "hf"))
    assert refused.returncode == 2 and "load_saved_model" in refused.stderr
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def private_run(i2b2_corpus, tmp_path_factory):
    """A finished private run of the synthetic hospitals (the tiny model)."""
    run = tmp_path_factory.mktemp("export") / "run"
    trained = run_cli("train", "--task", "i2b2", "--model", "tiny", "--adapter", "bias",
                      "--rounds", "1", "--max-length", "32", "--threads", "1",
                      "--target-epsilon", "8", "--data", str(i2b2_corpus),
                      "--out", str(run))  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    return run


def test_the_exported_model_carries_its_privacy_guarantee_as_a_model_card(private_run, tmp_path):
    from huggingface_hub import ModelCard

    run = private_run
    # --target-epsilon alone: federated, under add/remove (the measured default).
    config = json.loads((run / "config.json").read_text())
    assert config["federation"]["strategy"] == "fedavg"
    assert config["privacy"]["neighbours"] == "add-remove"
    exported = run_cli("export", str(run), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    card = ModelCard.load(tmp_path / "hf" / "README.md")
    assert "differential-privacy" in card.data.tags
    summary = json.loads((run / "summary.json").read_text())
    for site, epsilon in summary["epsilon"].items():
        assert f"| {site} | {epsilon:.3f} |" in card.text
    assert "add-remove" in card.text and "outside epsilon" in card.text


def test_the_card_names_base_licence_use_and_provenance_and_its_example_gives_whole_words(
    private_run, tmp_path
):
    import re

    from huggingface_hub import ModelCard
    from transformers import pipeline

    run = private_run
    out = tmp_path / "hf"
    assert run_cli("export", str(run), "--out", str(out)).returncode == 0
    card = ModelCard.load(out / "README.md")
    text = card.text
    assert "Base model and licence" in text and "tiny randomly initialised BERT" in text
    assert "Intended use and limits" in text and "synthetic-data" in card.data.tags
    assert "Trained on synthetic data" in text  # the corpus came from clinfed data synth
    assert (out / "privacy-report" / "report.html").is_file()
    assert not (run / "report").exists()  # the run is only read
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 32
    # The card's example, as written, on this model with every word made a
    # problem: whole words and whole entities, never word pieces.
    example = re.search(r'tagger\("([^"]+)"\)', text).group(1)
    model = AutoModelForTokenClassification.from_pretrained(out)
    with torch.no_grad():
        model.classifier.bias[model.config.label2id["B-problem"]] = 100.0
    tokenizer = AutoTokenizer.from_pretrained(out)
    tagger = pipeline("token-classification", model=model, tokenizer=tokenizer,
                      aggregation_strategy="first")  # fmt: skip
    entities = tagger(example)
    assert [e["word"] for e in entities] == example.lower().split()
    assert {e["entity_group"] for e in entities} == {"problem"}
    pieces = pipeline("token-classification", model=model, tokenizer=tokenizer)(example)
    assert any(p["word"].startswith("##") for p in pieces)  # what the card warns of
