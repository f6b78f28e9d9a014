"""clinfed privacy clip-norm: the public units' gradient norms DP-SGD would clip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from .test_cli import run_cli


@pytest.fixture(scope="module")
def start(tmp_path_factory, i2b2_corpus):
    """A finished tiny run: the model a private run would start from."""
    from clinfed.runners.pipeline import run_training
    from clinfed.settings import RunConfig

    from .conftest import TINY_RUN

    out = tmp_path_factory.mktemp("clip") / "run"
    run_training(RunConfig.of(data=str(i2b2_corpus), out=str(out), **TINY_RUN))
    return out


@pytest.mark.parametrize("adapter", ["none", "head"])
def test_unit_norms_are_those_of_the_per_unit_gradients_dp_sgd_clips(start, i2b2_corpus, adapter):
    from clinfed.core.errors import ProblemLog
    from clinfed.core.scratch import temporary_folder
    from clinfed.privacy.clipping import layer_hooks, per_example_gradients
    from clinfed.runners.clip_norm import PLANS, unit_gradient_norms
    from clinfed.runners.inference import saved_model_and_task

    with temporary_folder("cache") as cache:
        model, tokenizer, meta, task = saved_model_and_task(start, cache)
        records = task.read_documents(i2b2_corpus / "test" / "beth", ProblemLog("strict"))
        examples = task.encode(records, tokenizer, meta["max_length"], cache)
        model = PLANS[adapter](model)
        rows = list(range(6))
        # Two units of one row each, and one unit of four rows (a document, say).
        units = [np.array([0]), np.array([1]), np.array([2, 3, 4, 5])]
        norms, parameters = unit_gradient_norms(model, task, examples, units)

        # Opacus's per-example gradients, as DP-SGD's hooks clipping takes them.
        from clinfed.modeling.adapters import shared_names

        trained = set(shared_names(model))
        for name, param in model.named_parameters():
            param.requires_grad_(name in trained)
        targets = [p for n, p in model.named_parameters() if n in trained]
        model.eval()
        with layer_hooks(model):
            batch = task.collate(examples[rows])
            losses = task.example_losses(model(**task.model_inputs(batch)), batch)
            grads = per_example_gradients(model, targets, losses)
    flat = torch.cat([g.reshape(len(rows), -1) for g in grads], dim=1).double()
    want = [flat[0].norm(), flat[1].norm(), flat[2:6].sum(0).norm()]
    assert np.allclose(norms, [float(w) for w in want], rtol=1e-4)
    assert parameters == sum(p.numel() for p in targets)
    head = sum(p.numel() for n, p in model.named_parameters() if n.startswith("head."))
    assert (parameters == head) == (adapter == "head")


def test_the_command_proposes_the_percentile_of_the_public_units(start, i2b2_corpus):
    data = i2b2_corpus / "test"
    args = ("privacy", "clip-norm", str(start), "--data", str(data), "--json")
    result = run_cli(*args, "--adapter", "head")
    assert result.returncode == 0, result.stderr
    median = run_cli(*args, "--adapter", "head", "--percentile", "50")
    mid, high = json.loads(median.stdout), json.loads(result.stdout)
    assert high["clip_norm"] == pytest.approx(high["quantiles"]["0.75"])
    assert mid["clip_norm"] == pytest.approx(high["quantiles"]["0.5"])
    assert mid["clip_norm"] < high["clip_norm"]
    assert high["share_clipped"] == pytest.approx(0.25, abs=0.05)
    whole = json.loads(run_cli(*args).stdout)
    assert whole["parameters"] > high["parameters"] and whole["units"] == high["units"]

    # the privacy unit groups the rows: one unit a note
    notes = len(list(data.rglob("*.txt")))
    by_note = json.loads(run_cli(*args, "--privacy-unit", "document").stdout)
    assert by_note["units"] == notes < high["units"]
    few = json.loads(run_cli(*args, "--units", "3").stdout)
    assert few["units"] == 3
    again = json.loads(run_cli(*args, "--units", "3").stdout)
    assert again == few  # public units, drawn by --seed: the same at every call

    text = run_cli(*args[:-1], "--adapter", "head")
    assert text.returncode == 0 and "75th percentile" in text.stdout


@pytest.mark.parametrize(
    ("percentile", "words"),
    [
        (1, "1st"),
        (2, "2nd"),
        (3, "3rd"),
        (11, "11th"),
        (12, "12th"),
        (21, "21st"),
        (50, "50th"),
        (75, "75th"),
        (92, "92nd"),
        (100, "100th"),
        (12.5, "12.5th"),
    ],
)
def test_the_percentile_reads_as_an_ordinal(percentile, words):
    from clinfed.commands.privacy import _ordinal

    assert _ordinal(percentile) == words


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--adapter", "lora"], "--adapter lora: choose one of none, bias, head, labels"),
        (["--percentile", "101"], "--percentile 101: must be between 0 and 100"),
        (["--privacy-unit", "patient"], "--privacy-unit patient: --task i2b2 offers"),
    ],
)
def test_impossible_requests_exit_2_with_one_line(start, i2b2_corpus, extra, message):
    result = run_cli("privacy", "clip-norm", str(start), "--data", str(i2b2_corpus / "test"),
                     *extra)  # fmt: skip
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_folder_without_documents_or_a_model_exits_2(start, tmp_path):
    empty = run_cli("privacy", "clip-norm", str(start), "--data", str(tmp_path))
    assert empty.returncode == 2 and str(tmp_path) in empty.stderr
    no_model = run_cli("privacy", "clip-norm", str(tmp_path), "--data", str(tmp_path))
    assert no_model.returncode == 2 and "Traceback" not in no_model.stderr


def test_without_adapter_the_clip_norm_is_measured_over_the_task_s_private_plan(
    tmp_path, mimic_corpus
):
    """ICD coding trains the head alone under DP by default, so its clip norm
    is read off the head's gradients unless --adapter names another plan."""
    from clinfed.runners.clip_norm import clip_norm_from_public
    from clinfed.runners.pipeline import run_training
    from clinfed.settings import RunConfig

    from .conftest import TINY_RUN

    start = tmp_path / "run"
    settings = TINY_RUN | {"task": "mimic3", "top_k": 20, "max_chunks": 2}
    run_training(RunConfig.of(data=str(mimic_corpus), out=str(start), **settings))
    public = mimic_corpus / "site1"
    default = clip_norm_from_public(start, public, max_units=4)
    whole = clip_norm_from_public(start, public, adapter="none", max_units=4)
    head = clip_norm_from_public(start, public, adapter="head", max_units=4)
    assert default["adapter"] == "head"
    assert default["parameters"] == head["parameters"] < whole["parameters"]
