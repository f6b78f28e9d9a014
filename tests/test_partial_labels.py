"""Sites with different label sets: types from the data, partial-label loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.modeling.models import load_tokenizer
from clinfed.tasks.i2b2.adapter import I2b2Task

from .test_cli import run_cli

# Hospital A annotates diseases only; hospital B chemicals and diseases.
SITE_A = "Aspirin\tO\neased\tO\nthe\tO\nmigraine\tB-Disease\n.\tO\n"
SITE_B = "Aspirin\tB-Chemical\neased\tO\nthe\tO\nheadache\tB-Disease\n.\tO\n"


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    for split in ("train", "test"):
        for site, text in (("a", SITE_A), ("b", SITE_B)):
            path = data / split / site / f"{site}.conll"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text((text + "\n") * 3)
    return data


def _batch(task: I2b2Task, data: Path, tmp_path: Path):
    corpus = task.load(data, ProblemLog())
    examples = task.encode(corpus.train, load_tokenizer("tiny"), 32, str(tmp_path / "cache"))
    return examples, task.collate(examples[: len(examples)])


def test_labels_come_from_the_training_split_and_sites_keep_their_own_types(tmp_path):
    task = I2b2Task(format="conll")
    task.load(_data(tmp_path), ProblemLog())
    assert task.labels == ["O", "B-Chemical", "I-Chemical", "B-Disease", "I-Disease"]
    assert task.label_source.startswith("from the data")
    assert task.site_types == {"a": {"Disease"}, "b": {"Chemical", "Disease"}}


def test_an_o_token_at_a_site_without_a_type_may_be_that_type(tmp_path):
    task = I2b2Task(format="conll")
    examples, batch = _batch(task, _data(tmp_path), tmp_path)
    sites = list(examples["site"])
    may_be = batch["outside_may_be"]
    chemical = [task.labels.index("B-Chemical"), task.labels.index("I-Chemical")]
    for row, site in enumerate(sites):
        assert may_be[row, 0]  # O is always allowed
        assert bool(may_be[row, chemical].all()) == (site == "a")
        assert not may_be[row, task.labels.index("B-Disease")]

    # Logits that put an O token of site a at B-Chemical: plain cross-entropy
    # punishes it, the partial-label loss does not (site a never says).
    logits = torch.zeros(*batch["labels"].shape, len(task.labels))
    logits[..., chemical[0]] = 5.0
    partial = task.token_losses(logits, batch)
    plain = task.token_losses(logits, {k: v for k, v in batch.items() if k != "outside_may_be"})
    outside = batch["labels"] == 0
    for row, site in enumerate(sites):
        o = outside[row]
        if site == "a":
            # -log P(O or B-Chemical or I-Chemical)
            z = math.log(math.exp(5.0) + 4)
            expected = z - math.log(math.exp(5.0) + 2)
            assert torch.allclose(partial[row][o], torch.tensor(expected), atol=1e-5)
            assert (partial[row][o] < plain[row][o]).all()
        else:
            assert torch.equal(partial[row], plain[row])
    # Labelled (non-O) tokens keep plain cross-entropy everywhere.
    spans = batch["labels"] > 0
    assert torch.equal(partial[spans], plain[spans])


def test_a_type_only_in_the_preset_layout_is_never_open(tmp_path):
    # Mapped onto problem and treatment, the label set keeps the i2b2
    # preset's layout (with test), but nobody annotates test: an O token is
    # evidence against it at every site. Treatment stays open at site a.
    task = I2b2Task(format="conll", types="Disease=problem,Chemical=treatment")
    examples, batch = _batch(task, _data(tmp_path), tmp_path)
    assert task.labels == ["O", "B-problem", "I-problem", "B-test", "I-test",
                           "B-treatment", "I-treatment"]  # fmt: skip
    test = [task.labels.index("B-test"), task.labels.index("I-test")]
    treatment = [task.labels.index("B-treatment"), task.labels.index("I-treatment")]
    may_be = batch["outside_may_be"]
    for row, site in enumerate(examples["site"]):
        assert not may_be[row, test].any()
        assert bool(may_be[row, treatment].all()) == (site == "a")


def test_partial_labels_off_trains_every_o_as_o(tmp_path):
    task = I2b2Task(format="conll", partial_labels=False)
    _, batch = _batch(task, _data(tmp_path), tmp_path)
    assert "outside_may_be" not in batch


def test_a_declared_type_set_stays_put_whatever_the_data(tmp_path):
    task = I2b2Task(format="conll", types="Disease,Chemical")
    task.load(_data(tmp_path), ProblemLog())
    assert task.labels == ["O", "B-Disease", "I-Disease", "B-Chemical", "I-Chemical"]
    assert task.label_source == "declared with --types"


def test_flower_needs_declared_types_for_conll(tmp_path):
    from clinfed.flower.deploy import flower_run_config

    with pytest.raises(ClinfedError, match="needs `types`"):
        flower_run_config({"task": "i2b2", "format": "conll", "model": "tiny"}, tmp_path / "run")


def test_training_two_sites_with_different_label_sets_from_the_cli(tmp_path):
    data = _data(tmp_path)
    run = tmp_path / "run"
    done = run_cli("train", "--task", "i2b2", "--data", str(data), "--model", "tiny",
                   "--strategy", "fedavg", "--rounds", "1", "--max-length", "32",
                   "--threads", "1", "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_flower_node_refuses_types_the_run_did_not_declare(tmp_path):
    # The server built the model for the run's labels (i2b2's, as nothing
    # was declared); a node whose CoNLL data has other types must not train
    # a different head.
    from clinfed.flower.deploy import flower_run_config
    from clinfed.runners.node import NodeConfig, NodeSite

    config = flower_run_config(
        {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32},
        tmp_path / "run",
    )
    node = NodeConfig(_data(tmp_path) / "train", tmp_path / "state", site="a", allow_no_dp=True)
    with pytest.raises(ClinfedError, match="must declare them"):
        NodeSite(config, node, "run")
