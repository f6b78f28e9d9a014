"""Strategies added as one file each (Ditto, FedAdam) run in every runner
unchanged, and evaluation by summed counts equals pooled evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clinfed.core.errors import ProblemLog
from clinfed.core.runs import read_jsonl
from clinfed.modeling.models import load_tokenizer
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.adapter import I2b2Task

SITES = ("beth", "partners", "site3")


def _run(i2b2_corpus, out, strategy, **settings):
    values = dict(
        task="i2b2",
        data=str(i2b2_corpus),
        out=str(out),
        strategy=strategy,
        model="tiny",
        rounds=2,
        max_length=32,
        batch_size=8,
        threads=1,
    )
    return run_training(RunConfig.of(**(values | settings)))


def test_ditto_keeps_a_personal_model_and_charges_both_trainings(i2b2_corpus, tmp_path):
    # Windows of 64 tokens hold every sentence whole: one row per unit, so
    # DP-SGD takes book-keeping clipping (hooks on the embedding matrix made
    # this test take 106 s).
    summary = _run(
        i2b2_corpus,
        tmp_path / "run",
        "ditto",
        ditto_lambda=0.5,
        target_epsilon=8.0,
        max_length=64,
        local_epochs=1,
    )
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    rounds = [r for r in records if "site" not in r]
    # Each site's own model is the headline; the global model is reported beside it.
    assert all({"f1", "per_site_f1", "global_f1", "global_per_site_f1"} <= set(r) for r in rounds)
    assert set(summary["per_site_f1"]) == set(SITES)
    for site in SITES:
        ledger = read_jsonl(tmp_path / "run" / "sites" / site / "privacy" / f"{site}.jsonl")
        charges = [line for line in ledger if line.get("mechanism") == "dp-sgd"]
        per_round = [sum(1 for line in charges if line["round"] == r) for r in (1, 2)]
        assert per_round == [2, 2]  # the global and the personal training, each charged
        copy = load_file(str(tmp_path / "run" / "sites" / site / "copy.r0002.safetensors"))
        personal = {k[len("personal/") :]: v for k, v in copy.items() if k.startswith("personal/")}
        assert personal and set(personal) == {k for k in copy if not k.startswith("personal/")}
        # The personal model is its own, not the global one the site holds.
        assert not all(torch.equal(personal[k], copy[k]) for k in personal)
    # Only the global model travels: uploads are whole models, as in FedAvg.
    sent = [r for r in records if "bytes_up" in r]
    assert sent and summary["ratio_to_fedavg_up"] == pytest.approx(1.0)


def test_fedadam_runs_in_process_and_keeps_its_moments_at_each_commit(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    _run(i2b2_corpus, run, "fedadam", server_lr=1e-3)
    state = json.loads((run / "state.json").read_text())
    moments = load_file(str(run / state["strategy_tensors"]))
    assert any(k.startswith("m.") for k in moments) and any(k.startswith("v.") for k in moments)
    fedavg = tmp_path / "fedavg"
    _run(i2b2_corpus, fedavg, "fedavg")
    a = load_file(str(run / "model" / "model.safetensors"))
    b = load_file(str(fedavg / "model" / "model.safetensors"))
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the server step changed the model


def test_summed_site_counts_give_the_pooled_i2b2_metrics(i2b2_corpus, tmp_path):
    task = I2b2Task()
    corpus = task.load(i2b2_corpus, ProblemLog())
    tokenizer = load_tokenizer("tiny")
    test = task.encode(corpus.test, tokenizer, 32, str(tmp_path))
    rng = np.random.default_rng(0)
    gold_like = []
    for tags in test["labels"]:
        tags = np.asarray(tags)
        noisy = np.where(rng.random(len(tags)) < 0.3, rng.integers(0, len(task.labels)), tags)
        gold_like.append(np.where(tags < 0, 0, noisy))
    pooled = task.evaluate(corpus.test, test, gold_like)
    sites = np.asarray(test["site"])
    total = None
    for site in sorted(set(sites.tolist())):
        idx = np.flatnonzero(sites == site)
        counts = task.evaluation_counts(corpus.test, test.select(idx), [gold_like[i] for i in idx])
        total = (
            counts
            if total is None
            else {k: [a + b for a, b in zip(total[k], counts[k])] for k in total}
        )
    from_counts = task.metrics_from_counts(total)
    assert from_counts["f1"] == pytest.approx(pooled["f1"], abs=1e-12)
    assert from_counts["inexact_f1"] == pytest.approx(pooled["inexact_f1"], abs=1e-12)
    assert 0 < pooled["f1"] < 1


def test_a_finished_run_keeps_no_copy_that_repeats_the_global_model(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    first = _run(i2b2_corpus, run, "fedavg", rounds=1)
    assert not list((run / "sites").glob("*/copy.*.safetensors"))  # each was the global model
    # Resuming the finished run only evaluates it again, from whole-model downloads.
    again = _run(i2b2_corpus, run, "fedavg", rounds=1, resume=True)
    assert again["f1"] == pytest.approx(first["f1"])
