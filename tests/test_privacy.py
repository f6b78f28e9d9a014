"""Privacy: accountant, calibration, ledger, DP-SGD clipping and budgets."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from torch import nn

from clinfed.core.errors import ProblemLog
from clinfed.core.runs import read_jsonl
from clinfed.federated.client import apply_plan
from clinfed.federated.plan import Plan
from clinfed.federated.strategies.pfeddc import PFedDC
from clinfed.modeling.adapters import add_bias, add_lora, shared_names
from clinfed.modeling.models import add_prompts, build_model, load_tokenizer
from clinfed.modeling.training import run_epoch
from clinfed.privacy.accountants import (
    BUDGET,
    Mechanism,
    calibrate_noise,
    epsilon,
    reference_epsilon,
)
from clinfed.privacy.accountants.pld import PLDAccountant as PLD
from clinfed.privacy.accountants.rdp import RDPAccountant
from clinfed.privacy.clipping import CLIPPERS
from clinfed.privacy.dpsgd import (
    MICROBATCH_OVERHEAD_TOKENS,
    DPSettings,
    choose_clipping,
    make_private,
    microbatches,
)
from clinfed.privacy.ledger import Ledger
from clinfed.privacy.randomness import reproducible
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.tasks.mimic3.adapter import Mimic3Task

from .test_cli import run_cli


def train_tiny(data, out, *extra: str):
    """``clinfed train`` of FedAvg on the tiny model (later flags win)."""
    return run_cli(
        "train", "--task", "i2b2", "--model", "tiny", "--strategy", "fedavg",
        "--max-length", "32", "--threads", "1", "--data", str(data), "--out", str(out), *extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("q", "sigma", "steps", "delta"),
    [
        (0.01, 1.1, 1000, 1e-5),
        (0.05, 0.8, 300, 1e-5),
        (0.16, 3.1, 18, 1e-5),
        (0.5, 2.0, 40, 1e-6),
        (1.0, 5.0, 10, 1e-5),
    ],
)
def test_the_accountants_agree_with_dp_accounting(q, sigma, steps, delta):
    mechanisms = [Mechanism("dp-sgd", sigma, q, steps)]
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    rdp = RdpAccountant()
    rdp.compose(event, steps)
    add_remove = RDPAccountant("add-remove").epsilon(mechanisms, delta)
    assert add_remove == pytest.approx(rdp.get_epsilon(delta), rel=0.02)
    # The budget: dp-accounting's PLD under replace-one, an example count
    # being public. It costs more than add/remove would claim.
    pld = PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
        value_discretization_interval=1e-3,
    )
    pld.compose(event, steps)
    budget = epsilon(mechanisms, delta)
    assert BUDGET.relation == "replace-one"
    assert budget == pytest.approx(pld.get_epsilon(delta), rel=1e-6)
    assert budget > PLD("add-remove").epsilon(mechanisms, delta)
    # the reference (RDP through the weak triangle inequality) bounds it from above
    assert reference_epsilon(mechanisms, delta) >= budget * 0.99


def test_composition_and_calibration_end_just_under_the_target():
    def per_round(sigma):
        return [Mechanism("dp-sgd", sigma, 0.1, 10), Mechanism("safl-selection", 30.0, 1.0, 1)]

    sigma = calibrate_noise(1.0, 1e-5, per_round, rounds=5)
    planned = epsilon(per_round(sigma) * 5, 1e-5)
    assert 0.98 <= planned <= 1.0
    # the selection's cost is counted: without it the same noise spends less
    assert epsilon([per_round(sigma)[0]] * 5, 1e-5) < planned
    with pytest.raises(ValueError, match="out of reach"):
        calibrate_noise(0.01, 1e-5, lambda s: [Mechanism("x", 0.5, 1.0, 1)], rounds=3)


@pytest.mark.parametrize(
    ("target", "q", "steps", "rounds"),
    [(8.0, 0.0727, 30, 2), (1.0, 0.1, 10, 5), (4.0, 0.01, 500, 3), (0.5, 0.2, 50, 3)],
)
@pytest.mark.parametrize("accountant", ["pld-replace-one", "pld-add-remove", "rdp"])
def test_calibration_lands_in_the_window_under_every_accountant(
    target, q, steps, rounds, accountant
):
    # The secant search (coarse grid, then fine) against a plain check of
    # the answer: the planned epsilon lies in [target * (1 - tolerance),
    # target] by the accountant that was searched, from noise multipliers
    # near 1 (q 0.01, 500 steps) to ones in the tens (epsilon 0.5).
    from clinfed.privacy.accountants.rdp import RDPAccountant

    chosen = {
        "pld-replace-one": PLD("replace-one"),
        "pld-add-remove": PLD("add-remove"),
        "rdp": RDPAccountant("add-remove"),
    }[accountant]

    def per_round(sigma):
        return [Mechanism("dp-sgd", sigma, q, steps)]

    sigma = calibrate_noise(target, 1e-5, per_round, rounds, accountant=chosen, tolerance=0.005)
    planned = chosen.epsilon(per_round(sigma) * rounds, 1e-5)
    assert target * 0.995 <= planned <= target
    # and a little less noise would not meet it: the answer is the smallest
    assert chosen.epsilon(per_round(sigma * 0.98) * rounds, 1e-5) > target


def test_noise_below_the_floor_is_neither_searched_nor_accepted(tiny_config):
    from clinfed.core.errors import ClinfedError
    from clinfed.privacy.accountants import MIN_NOISE_MULTIPLIER

    tried = []

    def per_round(sigma):
        tried.append(sigma)
        return [Mechanism("dp-sgd", sigma, 0.01, 1)]

    # A budget so large that any noise meets it: the search stops at the floor
    # instead of driving sigma (and the accountant's memory) towards zero.
    sigma = calibrate_noise(1e4, 1e-5, per_round, rounds=1)
    assert MIN_NOISE_MULTIPLIER <= sigma <= MIN_NOISE_MULTIPLIER * 1.01
    assert min(tried) >= MIN_NOISE_MULTIPLIER
    with pytest.raises(ClinfedError, match="at least 0.1"):
        tiny_config(noise_multiplier=0.01)
    bad = run_cli("privacy", "epsilon", "--sample-rate", "0.1", "--noise-multiplier", "0.01",
                  "--steps", "30")  # fmt: skip
    assert bad.returncode == 2 and "--noise-multiplier must be at least 0.1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_ledger_is_append_only_reloads_and_enforces_its_budget(tmp_path):
    path = tmp_path / "site1.jsonl"
    round_cost = [Mechanism("dp-sgd", 4.0, 0.1, 10)]
    ledger = Ledger(path, "site1", 1e-5, budget=1.0)
    spent = []
    round_number = 0
    while ledger.affords(round_cost):
        round_number += 1
        spent.append(ledger.record(round_number, round_cost))
    assert spent == sorted(spent) and spent[-1] <= 1.0 < ledger.after(round_cost)
    lines = read_jsonl(path)
    assert [line["round"] for line in lines] == list(range(1, round_number + 1))
    assert set(lines[0]) >= {
        "site",
        "round",
        "epsilon",
        "delta",
        "noise_multiplier",
        "sample_rate",
        "steps",
        "mechanism",
    }
    again = Ledger(path, "site1", 1e-5, budget=1.0)  # a restarted site
    assert again.spent == pytest.approx(spent[-1]) and not again.affords(round_cost)


def _no_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if hasattr(module, "dropout_prob"):
            module.dropout_prob = 0.0


def _expected_update(model, task, examples, params, clip, unit="example"):
    """sum_u clip(g_u) / U, each g_u the gradient of unit u's rows alone
    (one backward pass per row, summed: no row sees another)."""
    total = [torch.zeros_like(p) for p in params]
    units = task.unit_rows(examples, unit)
    for rows in units:
        grads = [torch.zeros_like(p) for p in params]
        for i in rows.tolist():
            model.zero_grad(set_to_none=True)
            batch = task.collate(examples[[i]])
            task.example_losses(model(**task.model_inputs(batch)), batch).sum().backward()
            for g, p in zip(grads, params):
                g += p.grad.detach()
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for t, g in zip(total, grads):
            t += factor * g
    model.zero_grad(set_to_none=True)
    return [t / len(units) for t in total]


def test_microbatches_cover_the_batch_once_and_group_by_length():
    lengths = np.array([5, 40, 6, 38, 5, 41])
    groups = microbatches(lengths, overhead_tokens=8)
    assert sorted(np.concatenate(groups).tolist()) == list(range(6))
    assert [sorted(lengths[g].tolist()) for g in groups] == [[38, 40, 41], [5, 5, 6]]
    assert len(microbatches(lengths, overhead_tokens=10_000)) == 1  # passes too dear
    assert len(microbatches(lengths, overhead_tokens=0)) == 5  # one per distinct length


def test_microbatches_hold_at_most_the_cap_and_still_cover_the_batch():
    lengths = np.array([5, 40, 6, 38, 5, 41, 39])
    capped = microbatches(lengths, overhead_tokens=10_000, max_units=3)
    assert sorted(np.concatenate(capped).tolist()) == list(range(7))
    assert len(capped) == 3 and max(len(g) for g in capped) <= 3  # the fewest passes allowed
    # and within them the least padding: the long rows together, the short ones together
    assert [sorted(lengths[g].tolist()) for g in capped] == [[40, 41], [38, 39], [5, 5, 6]]
    assert [len(g) for g in microbatches(lengths, 10_000)] == [7]  # no cap: one pass


def test_a_run_s_pass_cap_reaches_every_private_pass(i2b2_corpus, tmp_path, monkeypatch):
    from clinfed.privacy import dpsgd

    widest, real = [], dpsgd.microbatches

    def recorded(lengths, overhead_tokens, max_units=0):
        groups = real(lengths, overhead_tokens, max_units)
        widest.extend(len(group) for group in groups)
        return groups

    monkeypatch.setattr(dpsgd, "microbatches", recorded)
    result = train_tiny(i2b2_corpus, tmp_path / "run", "--rounds", "1", "--local-epochs", "1",
                        "--target-epsilon", "8", "--dp-pass-units", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Uncapped, this run's passes hold up to 39 units; capped, none more than 2.
    assert widest and max(widest) == 2


# (0, 0): one pass per length; (overhead, 1): one unit per pass (the memory cap)
@pytest.mark.parametrize(
    ("overhead", "cap"), [(0, 0), (MICROBATCH_OVERHEAD_TOKENS, 0), (10_000, 1)]
)
@pytest.mark.parametrize(
    ("task_name", "trainable", "clipping", "unit", "auto"),
    [
        ("i2b2", "top", "hooks", "example", "bk"),  # a line folded from two windows
        ("i2b2", "top", "bk", "example", "bk"),
        ("i2b2", "all", "ghost", "example", "bk"),  # ghost: no folded line
        ("i2b2", "all", "bk", "example", "bk"),  # embeddings and LayerNorms too
        ("mimic3", "top", "hooks", "example", "bk"),  # chunks folded into admissions
        ("mimic3", "top", "bk", "example", "bk"),
        ("mimic3", "all", "bk", "example", "bk"),
        ("i2b2", "prompts", "hooks", "example", "bk"),  # pfeddc: P_g, P_l, fusion, head
        ("i2b2", "prompts", "bk", "example", "bk"),
        ("mimic3", "prompts", "hooks", "example", "bk"),
        ("mimic3", "prompts", "bk", "example", "bk"),
        ("i2b2", "top", "hooks", "document", "bk"),  # every sentence of a note, clipped once
        ("i2b2", "top", "bk", "document", "bk"),
        ("i2b2", "all", "bk", "document", "bk"),  # a note's embedding rows, end to end
        ("mimic3", "top", "hooks", "patient", "bk"),  # every admission of a patient
        ("mimic3", "all", "bk", "patient", "bk"),
        ("i2b2", "lora", "hooks", "example", "bk"),  # LoRA B factors and the head
        ("i2b2", "lora", "bk", "example", "bk"),
        ("i2b2", "lora-ab", "hooks", "document", "bk"),  # both factors, a note clipped once
        ("i2b2", "lora-ab", "bk", "document", "bk"),
        ("mimic3", "lora", "bk", "example", "bk"),
        ("i2b2", "bias", "bk", "example", "bk"),  # bias terms only (BitFit)
    ],
)
def test_dp_step_clips_each_unit_jointly(
    task_name, trainable, clipping, unit, auto, overhead, cap, i2b2_corpus, mimic_corpus, tmp_path
):
    tokenizer = load_tokenizer("tiny")
    if task_name == "i2b2":
        task = I2b2Task()
        records = task.read_documents(i2b2_corpus / "train", ProblemLog())
        encoded = task.encode(records, tokenizer, 32, str(tmp_path))
        # rows of two notes, with a line long enough to need several windows
        docs = encoded["doc"]
        first, second = docs[0], next(d for d in docs if d != docs[0])
        rows = [i for i, d in enumerate(docs) if d == first][:3]
        rows += [i for i, d in enumerate(docs) if d == second][:3]
        keys = list(zip(docs, encoded["line"]))
        split = next(i for i in range(1, len(keys)) if keys[i] == keys[i - 1])
        # ghost clipping needs one row per unit: no folded line there
        folded = [] if clipping == "ghost" else [split - 1, split]
        examples = encoded.select(rows + folded)
        if folded:
            assert len(task.unit_rows(examples, unit)) < len(examples)  # something folds
    else:
        task = Mimic3Task(top_k=5, max_chunks=3, cache_dir=str(tmp_path))
        corpus = task.load(mimic_corpus, ProblemLog())
        encoded = task.encode(corpus.train, tokenizer, 128, str(tmp_path))
        by_length = np.argsort(encoded["n_tokens"], kind="stable")
        # the two shortest and two longest admissions: several chunk counts
        examples = encoded.select([*by_length[:2], *by_length[-2:]])
        assert len(task.labels) == 5 and max(len(c) for c in examples["input_ids"]) > 1
        if unit == "patient":  # two patients with two admissions each
            examples = examples.map(lambda _, i: {"subject_id": i // 2}, with_indices=True)
    model = build_model(task.head, "tiny", len(task.labels), seed=0)
    if trainable == "prompts":
        add_prompts(model, 3, "attention", depth=2)  # deep: layer hooks, shared fusion
        with torch.no_grad():  # the fusion's output starts at zero: give P_l a gradient
            model.prompt.fusion.output.weight.normal_(std=0.1)
    if trainable.startswith("lora"):
        add_lora(model, 4, 8.0, "ab" if trainable == "lora-ab" else "b", seed=0)
        with torch.no_grad():  # B starts at zero: give A a gradient too
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    p.normal_(std=0.1)
    if trainable == "bias":
        add_bias(model)
    _no_dropout(model)
    names = [n for n, _ in model.named_parameters()]
    chosen = frozenset(
        n
        for n in names
        if trainable == "all" or n.startswith(("head.", "encoder.encoder.layer.1."))
    )
    if trainable.startswith("lora"):
        chosen = frozenset(shared_names(model))
        assert any(".lora_B." in n for n in chosen)
        assert any(".lora_A." in n for n in chosen) == (trainable == "lora-ab")
    if trainable == "bias":
        chosen = frozenset(shared_names(model))
        assert all(n.startswith("head.") or n.endswith(".bias") for n in chosen)
    if trainable == "prompts":
        chosen = PFedDC().plan(1, "s", names).trainable
        assert any(n.startswith("prompt.local_prompt.") for n in chosen)
    apply_plan(model, Plan(chosen, chosen, frozenset(names)))
    units = task.unit_rows(examples, unit)
    grouped = any(len(rows) > 1 for rows in units)
    assert choose_clipping(model, "auto", task.head == "token", grouped) == auto
    if overhead == 0:  # the step below really runs in several passes
        assert len(microbatches(np.asarray(examples["n_tokens"]), 0)) > 1
    params = [p for p in model.parameters() if p.requires_grad]
    clip = 0.05  # small enough that every example is clipped
    expected = _expected_update(model, task, examples, params, clip, unit)
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=1.0)
    # batch = units: every unit is sampled (q = 1) and one step makes the epoch
    steps, update = make_private(
        model,
        optimizer,
        units,
        np.asarray(examples["n_tokens"]),
        DPSettings(noise_multiplier=0.0, max_grad_norm=clip, clipping=clipping, unit=unit),
        batch_size=len(units),
        randomness=reproducible(np.random.default_rng(0)),
        one_row_per_example=task.head == "token",
        microbatch_overhead=overhead,
        max_pass_units=cap,
    )
    if cap:  # the step below really runs one unit a pass
        assert all(len(owner.unique()) == 1 for passes, _, _ in steps for _, owner, _ in passes)
    if clipping == "bk" and unit != "example" and not cap:
        # a note's rows run with the other note's rows of their length, and
        # only the step's last pass closes the notes
        (passes, _, _), *_ = steps
        spans = [sum(bool((owner == u).any()) for _, owner, _ in passes) for u in range(2)]
        assert max(spans) > 1 and [closes for *_, closes in passes][-1]
        assert not any(closes for *_, closes in passes[:-1])
    try:
        stats = [run_epoch(model, task, examples, steps, update)]
    finally:
        update.detach()
    mode = update.mode
    assert mode == clipping and stats[0].examples == len(examples)
    for b, p, e in zip(before, params, expected):
        torch.testing.assert_close(b - p.detach(), e, rtol=1e-3, atol=1e-6)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # hooks removed


def _weight_norm_paths(monkeypatch) -> list[str]:
    """The path each 8 x 8 linear layer's weight norm takes, as book-keeping runs."""
    from clinfed.privacy import bookkeeping

    taken = []

    class Recorded(bookkeeping.LinearRule):
        def __init__(self, module, pieces):
            super().__init__(module, pieces)
            if module.in_features == 8 and module.out_features == 8:
                taken.append(self.weight_norm or "kept")

    monkeypatch.setitem(bookkeeping.RULES, nn.Linear, Recorded)
    return taken


# A linear layer's weight norm takes one of three paths: each example's
# gradient kept (one example per unit, long rows), Gram matrices over a
# unit's tokens end to end (few tokens), or each unit's gradient built once
# (a unit's rows together are long). In 8 x 8, Gram matrices win below 4 tokens.
@pytest.mark.parametrize(
    ("tokens", "owner", "path"),
    [
        (8, [0, 1, 2], "kept"),
        (2, [0, 1, 2], "ghost"),
        (1, [1, 0, 1, 2], "ghost"),  # units of two rows and one, out of order
        (2, [0, 0, 1, 1, 1, 2], "unit"),
    ],
)
def test_bookkeeping_clips_each_unit_of_several_rows_as_one(tokens, owner, path, monkeypatch):
    from clinfed.privacy import bookkeeping

    taken = _weight_norm_paths(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    owner = torch.tensor(owner)
    x = torch.randn(len(owner), tokens, 8)
    clip = 0.1  # every unit clipped

    def losses(rows):
        return model(rows).pow(2).sum((1, 2))

    expected = [torch.zeros_like(p) for p in model.parameters()]
    for unit in owner.unique():
        grads = torch.autograd.grad(losses(x[owner == unit]).sum(), list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for e, g in zip(expected, grads):
            e += min(1.0, clip / (float(norm) + 1e-6)) * g
    clipper = bookkeeping.BookKeepingClipping(model, clip)
    try:
        clipper.backward(losses(x), None, owner)
    finally:
        clipper.cleanup()
    assert taken == [path]
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)


# A note's rows in two passes of different lengths, closed by the second:
# each unit's norm covers its tokens in both (the Gram path needs the
# cross-pass terms, the unit path sums the passes' gradients first).
@pytest.mark.parametrize(("lengths", "path"), [((1, 1), "ghost"), ((3, 4), "unit")])
def test_bookkeeping_carries_a_unit_across_passes(lengths, path, monkeypatch):
    from clinfed.privacy import bookkeeping

    taken = _weight_norm_paths(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(5, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)
    )
    owners = [torch.tensor([0, 1, 1]), torch.tensor([1, 2, 0])]
    ids = [torch.randint(5, (3, n)) for n in lengths]
    clip = 0.1  # every unit clipped

    def losses(rows):
        return model(rows).pow(2).sum((1, 2))

    expected = [torch.zeros_like(p) for p in model.parameters()]
    for unit in range(3):
        total = sum(losses(x[owner == unit]).sum() for x, owner in zip(ids, owners))
        grads = torch.autograd.grad(total, list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for e, g in zip(expected, grads):
            e += min(1.0, clip / (float(norm) + 1e-6)) * g
    clipper = bookkeeping.BookKeepingClipping(model, clip)
    try:
        clipper.backward(losses(ids[0]), None, owners[0], closes=False)
        assert all(p.grad is None for p in model.parameters())  # nothing clipped yet
        clipper.backward(losses(ids[1]), None, owners[1], closes=True)
    finally:
        clipper.cleanup()
    assert taken == [path]
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_opacus_clipping_refuses_a_unit_left_open_across_passes(mode):
    # Opacus clips what one pass computed: a pass that does not close its
    # units would have them clipped in parts.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    clipper = CLIPPERS[mode](model, 1.0)
    try:
        assert not clipper.carries_units
        with pytest.raises(ValueError, match="each unit's rows in one pass"):
            clipper.backward(model(torch.randn(3, 4)).sum(1), None, torch.arange(3), False)
    finally:
        clipper.cleanup()


def test_bookkeeping_leaves_the_trainable_parameters_trainable_after_a_failed_pass():
    from clinfed.privacy.bookkeeping import BookKeepingClipping

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    clipper = BookKeepingClipping(model, 1.0)

    def fail(module, inputs):
        raise RuntimeError("boom")

    handle = model[2].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(3, 4))
    handle.remove()
    assert not any(p.requires_grad for p in model.parameters())  # marked off mid-forward
    clipper.cleanup()
    assert all(p.requires_grad for p in model.parameters())


def test_ghost_clipping_is_refused_for_chunked_examples():
    from clinfed.privacy.errors import SettingError

    model = build_model("multilabel", "tiny", 3)
    with pytest.raises(SettingError, match="ghost"):
        choose_clipping(model, "ghost", one_row_per_example=False)


def test_target_epsilon_run_ends_just_under_it_at_every_site(i2b2_corpus, tmp_path):
    config = RunConfig.of(
        task="i2b2",
        data=str(i2b2_corpus),
        out=str(tmp_path / "run"),
        strategy="safl+fedfrozen",
        model="tiny",
        rounds=3,
        max_length=32,
        freeze_from="1",
        top_layers=1,
        target_epsilon=1.0,
        delta=1e-5,
        threads=1,
    )
    summary = run_training(config)
    for site, spent in summary["epsilon"].items():
        lines = read_jsonl(tmp_path / "run" / "privacy" / f"{site}.jsonl")
        # (the noisy count's release rides with round 1 under add/remove)
        assert [line["round"] for line in lines if line["mechanism"] == "dp-sgd"] == [1, 2, 3]
        assert all(line["epsilon"] <= 1.0 for line in lines)
        assert 0.98 <= spent <= 1.0 and lines[-1]["epsilon"] == pytest.approx(spent)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    sites = [r for r in records if "bytes_up" in r]
    assert sites and all("train_loss" not in r and "epsilon" in r for r in sites)
    policy = json.loads((tmp_path / "run" / "privacy" / "policy.json").read_text())
    assert policy["target_epsilon"] == 1.0 and "patient" in policy["patient_caveat"]


def test_sites_refuse_rounds_past_the_budget_and_the_run_stops_cleanly(i2b2_corpus, tmp_path):
    result = run_cli(
        "train",
        "--task",
        "i2b2",
        "--strategy",
        "fedavg",
        "--model",
        "tiny",
        "--max-length",
        "32",
        "--rounds",
        "4",
        "--threads",
        "1",
        "--local-epochs",
        "1",
        "--noise-multiplier",
        "0.9",  # round 1 (one local epoch) costs about 7.8 of the 8: round 2 is refused
        "--target-epsilon",
        "8",
        "--data",
        str(i2b2_corpus),
        "--out",
        str(tmp_path / "run"),
    )
    # It stopped before its last round: exit 1, as clinfed flower run.
    assert result.returncode == 1, result.stderr
    assert "no site can train within its privacy budget" in result.stdout + result.stderr
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    refused = [r for r in records if r.get("refused")]
    assert refused and all(r["epsilon_if_trained"] > 8 for r in refused)
    for ledger in (tmp_path / "run" / "privacy").glob("*.jsonl"):
        assert all(line["epsilon"] <= 8 for line in read_jsonl(ledger))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target-epsilon", "0"], "--target-epsilon must be positive"),
        (["--target-epsilon", "1", "--delta", "1"], "--delta must be in (0, 1)"),
        (["--noise-multiplier", "-1"], "--noise-multiplier must be at least 0.1"),
        (["--target-epsilon", "0.001", "--strategy", "safl", "--selection", "private"], "reach"),
        (["--target-epsilon", "1", "--strategy", "centralized"], "not --strategy centralized"),
    ],
)
def test_bad_privacy_settings_exit_2_and_write_nothing(i2b2_corpus, tmp_path, args, message):
    result = train_tiny(i2b2_corpus, tmp_path / "run", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_large_delta_is_refused_on_one_line(i2b2_corpus, tmp_path):
    # A delta near 1/n lets one unit out whole: above 1/(10 n) a site refuses
    # (a node's operator may allow more with max-delta; then it is warned).
    result = train_tiny(
        i2b2_corpus, tmp_path / "run", "--rounds", "1", "--noise-multiplier", "1", "--delta", "0.5"
    )
    assert result.returncode == 2
    assert "above this site's cap" in result.stderr and "Traceback" not in result.stderr


def test_privacy_calculator_commands():
    eps = run_cli(
        "privacy",
        "epsilon",
        "--sample-rate",
        "0.01",
        "--noise-multiplier",
        "1.1",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
        "--neighbours",
        "replace-one",
        "--json",
    )
    assert eps.returncode == 0, eps.stderr
    value = json.loads(eps.stdout)["epsilon"]
    assert value == pytest.approx(epsilon([Mechanism("dp-sgd", 1.1, 0.01, 1000)], 1e-5), rel=1e-9)
    noise = run_cli(
        "privacy",
        "noise",
        "--target-epsilon",
        str(value),
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.01",
        "--steps",
        "1000",
        "--neighbours",
        "replace-one",
        "--json",
    )
    assert noise.returncode == 0, noise.stderr
    result = json.loads(noise.stdout)
    assert result["noise_multiplier"] == pytest.approx(1.1, rel=0.02)
    assert result["epsilon"] <= value
    bad = run_cli("privacy", "epsilon", "--sample-rate", "0", "--noise-multiplier", "1",
                  "--steps", "1", "--delta", "1e-5")  # fmt: skip
    assert bad.returncode == 2 and "--sample-rate must be in (0, 1]" in bad.stderr


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_the_calculator_prints_a_finished_run_s_ledger_epsilon(tiny_run, tmp_path, relation):
    # The run's own settings (rate, noise, its steps over every round) give
    # the epsilon its ledger states, to the digits the command prints; the
    # default relation is the run's (add/remove, with its count).
    tiny_run(tmp_path / "run", adapter="bias", target_epsilon=8.0, rounds=2, neighbours=relation)
    ledger = read_jsonl(tmp_path / "run" / "sites" / "beth" / "privacy" / "beth.jsonl")
    sgd = [line for line in ledger if line.get("mechanism") == "dp-sgd"]
    args = ["privacy", "epsilon", "--sample-rate", repr(sgd[0]["sample_rate"]),
            "--noise-multiplier", repr(sgd[0]["noise_multiplier"]),
            "--steps", str(sum(line["steps"] for line in sgd))]  # fmt: skip
    if relation == "replace-one":
        args += ["--neighbours", relation]
    printed = run_cli(*args)
    assert printed.returncode == 0, printed.stderr
    assert f"epsilon {sgd[-1]['epsilon']:.4f} " in printed.stdout
    assert f"{relation} neighbours" in printed.stdout


def test_dp_run_report_and_audit_never_contain_note_text(mimic_corpus, tmp_path):
    from .conftest import CANARY

    run = tmp_path / "run"
    trained = run_cli(
        "train",
        "--task",
        "mimic3",
        "--strategy",
        "safl",
        "--selection",
        "private",
        "--selection-noise",
        "5",
        "--top-layers",
        "1",
        "--model",
        "tiny",
        "--rounds",
        "2",
        "--top-k",
        "20",
        "--max-length",
        "32",
        "--max-chunks",
        "2",
        "--threads",
        "1",
        "--target-epsilon",
        "4",
        "--audit-holdout",
        "0.25",
        "--data",
        str(mimic_corpus),
        "--out",
        str(run),
    )
    assert trained.returncode == 0, trained.stderr
    audited = run_cli("audit", str(run))
    assert audited.returncode == 0, audited.stderr
    reported = run_cli("report", str(run))
    assert reported.returncode == 0, reported.stderr
    audit = json.loads((run / "audit.json").read_text())
    assert 0 <= audit["auc"] <= 1 and audit["members"] > 0 and audit["non_members"] > 0
    content = json.loads((run / "report" / "privacy.json").read_text())
    assert content["differential_privacy"] and len(content["sites"]) == 2
    for row in content["sites"]:
        assert 0 < row["epsilon"] <= 4 and row["epsilon_rdp"] >= row["epsilon"]
    ledger = read_jsonl(run / "privacy" / "site1.jsonl")
    assert {line["mechanism"] for line in ledger} == {"dp-sgd", "safl-selection", "unit-count"}
    page = (run / "report" / "report.html").read_text()
    assert "data:image/png;base64," in page and "safl-selection" in page
    outputs = [trained, audited, reported]
    assert not any(CANARY in r.stdout + r.stderr for r in outputs)
    for path in run.rglob("*"):
        if path.is_file() and path.suffix != ".safetensors":
            assert CANARY.encode() not in path.read_bytes(), path


def test_sweep_writes_a_table_and_skips_finished_cells(i2b2_corpus, tmp_path):
    args = [
        "sweep",
        "--task",
        "i2b2",
        "--data",
        str(i2b2_corpus),
        "--out",
        str(tmp_path / "sweep"),
        "--strategies",
        "fedavg,safl",
        "--epsilons",
        "2,inf",
        "--model",
        "tiny",
        "--rounds",
        "1",
        "--max-length",
        "32",
        "--top-layers",
        "1",
        "--threads",
        "1",
    ]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    rows = (tmp_path / "sweep" / "sweep.csv").read_text().splitlines()
    assert len(rows) == 1 + 4
    import csv

    timed = list(csv.DictReader(rows))
    assert all(float(r["wall_min"]) >= 0 for r in timed)  # each cell's wall time
    table = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "eps 2" in table and "eps inf" in table and "| safl |" in table
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0
    dp_cell = json.loads((tmp_path / "sweep" / "fedavg-eps2-seed0" / "summary.json").read_text())
    assert max(dp_cell["epsilon"].values()) <= 2
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "sweep").glob("*/summary.json")}
    # never overwritten: a second sweep into the folder is refused ...
    refused = run_cli(*args)
    assert refused.returncode == 2 and "--resume continues it" in refused.stderr
    # ... and --resume skips the finished cells, leaving a user's file alone
    (tmp_path / "sweep" / "notes.txt").write_text("mine")
    again = run_cli(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing rerun
    assert (tmp_path / "sweep" / "notes.txt").read_text() == "mine"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    elsewhere = [a if a != str(tmp_path / "sweep") else str(tmp_path / "other") for a in args]
    not_a_sweep = run_cli(*elsewhere, "--resume")
    assert not_a_sweep.returncode == 2 and "not a sweep folder" in not_a_sweep.stderr
    bad = run_cli(*args[:-2], "--epsilons", "0,1")
    assert bad.returncode == 2 and "not positive" in bad.stderr


def test_units_are_what_sampling_and_accounting_count(i2b2_corpus, tmp_path):

    from clinfed.federated.site_policy import privacy_policy
    from clinfed.runners.factories import make_strategy

    task = I2b2Task()
    tokenizer = load_tokenizer("tiny")
    records = task.read_documents(i2b2_corpus / "train", ProblemLog())
    data = task.encode(records, tokenizer, 16, str(tmp_path))  # short windows: lines split
    rows = list(zip(data["doc"], data["line"]))
    sentences, notes = len(set(rows)), len(set(data["doc"]))
    assert len(data) > sentences > notes  # some lines span several windows

    def policy(unit: str):
        config = RunConfig.of(
            task="i2b2", model="tiny", strategy="fedavg", data=str(i2b2_corpus),
            target_epsilon=4.0, privacy_unit=unit, max_length=16, neighbours="replace-one",
        ).resolved()  # fmt: skip
        strategy = make_strategy(config, task, tokenizer, str(tmp_path))
        return privacy_policy(config, task, {"beth": data}, tmp_path / unit, strategy)

    sentence_level, note_level = policy("example"), policy("document")
    # the sampling rate (and so the noise) is over sentences, or over notes
    assert sentence_level.sizes == {"beth": sentences}
    assert note_level.sizes == {"beth": notes}
    assert note_level.round_mechanisms("beth")[0].sample_rate > (
        sentence_level.round_mechanisms("beth")[0].sample_rate
    )
    # at the sentence level the report gets what groups the units (notes),
    # never how many units a note holds (one note's exact length)
    described = sentence_level.describe()
    assert described["group_of"] == "document" and described["patient_caveat"]
    assert not any("k_" in key or "group" in key for key in described["sites"]["beth"])
    assert note_level.describe()["group_of"] is None
    assert note_level.describe()["patient_caveat"] is None
    with pytest.raises(Exception, match="offers example, document"):
        RunConfig.of(task="i2b2", data=str(i2b2_corpus), privacy_unit="patient").validate()


def test_the_audit_compares_members_with_training_rows_set_aside(i2b2_corpus, tmp_path):
    plain = tmp_path / "plain"
    args = ["train", "--task", "i2b2", "--strategy", "fedavg", "--model", "tiny",
            "--rounds", "2", "--max-length", "32", "--threads", "1",
            "--data", str(i2b2_corpus)]  # fmt: skip
    assert run_cli(*args, "--out", str(plain)).returncode == 0
    refused = run_cli("audit", str(plain))
    assert refused.returncode == 2 and "--audit-holdout" in refused.stderr

    run = tmp_path / "audited"
    assert run_cli(*args, "--audit-holdout", "0.25", "--out", str(run)).returncode == 0
    holdout = json.loads((run / "audit" / "holdout.json").read_text())
    task = I2b2Task()
    encoded = task.encode(
        task.read_documents(i2b2_corpus / "train", ProblemLog()), load_tokenizer("tiny"), 32,
        str(tmp_path / "cache"),
    )  # fmt: skip
    trained = {r["site"]: r["examples"] for r in read_jsonl(run / "metrics.jsonl")
               if r.get("round") == 1 and "examples" in r}  # fmt: skip
    for site, parts in holdout["sites"].items():
        members, non_members = set(parts["members"]), set(parts["non_members"])
        assert members and non_members and not members & non_members
        # both from the site's own training rows, whole sentences set aside ...
        assert {encoded[i]["site"] for i in members | non_members} == {site}
        held = {(encoded[i]["doc"], encoded[i]["line"]) for i in non_members}
        assert not held & {(encoded[i]["doc"], encoded[i]["line"]) for i in members}
        # ... and the site trained on the members only (its weight counts
        # their sentences, the privacy units, not their rows)
        assert trained[site] == len({(encoded[i]["doc"], encoded[i]["line"]) for i in members})
        assert (run / "audit" / "updates" / f"{site}.safetensors").is_file()

    audited = run_cli("audit", str(run), "--json")
    assert audited.returncode == 0, audited.stderr
    result = json.loads(audited.stdout)
    targets = [result["final_model"], *result["site_updates"].values()]
    assert len(targets) == 1 + len(holdout["sites"])
    for target in targets:
        for attack in ("loss_threshold", "calibrated_loss"):
            found = target[attack]
            assert found["ci_low"] <= found["auc"] <= found["ci_high"]
            assert "chance" in found["reading"] and "bound" not in found["reading"]
    assert run_cli("report", str(run)).returncode == 0
    report = (run / "report" / "report.md").read_text()
    assert "set aside at random before training" in report and "95% CI" in report


def test_resume_refuses_a_site_ledger_that_was_deleted_or_shortened(i2b2_corpus, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--task", "i2b2", "--strategy", "fedavg", "--model", "tiny",
            "--rounds", "2", "--max-length", "32", "--threads", "1", "--target-epsilon", "8",
            "--data", str(i2b2_corpus), "--out", str(run)]  # fmt: skip
    assert run_cli(*args).returncode == 0
    ledger = run / "sites" / "beth" / "privacy" / "beth.jsonl"
    whole = ledger.read_bytes()
    ledger.write_bytes(whole[: whole.index(b"\n") + 1])  # one line left
    shortened = run_cli(*args, "--resume")
    assert shortened.returncode == 2 and "shortened" in shortened.stderr
    # ledger and seal both gone: the commit (state.json) still knows
    ledger.unlink()
    ledger.with_name("beth.jsonl.seal").unlink()
    deleted = run_cli(*args, "--resume")
    assert deleted.returncode == 2 and "deleted" in deleted.stderr
    assert "state.json" in deleted.stderr


def test_the_privacy_package_is_a_leaf_library():
    """clinfed.privacy imports the standard library, numpy, torch, Opacus,
    dp-accounting and its own modules only: never the pipeline, tasks,
    models or run folders (so it can be read, tested and reused alone)."""
    import ast
    import sys

    allowed = {"numpy", "torch", "opacus", "dp_accounting"} | set(sys.stdlib_module_names)
    root = Path(__file__).resolve().parents[1] / "privacy"
    outside = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if not (name.startswith("clinfed.privacy") or top in allowed):
                    outside.append(f"{path.name}: {name}")
    assert not outside, outside


class _TiedLM(nn.Module):
    """Word embeddings reused as the output layer's weight (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 12, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


def _clipped_sum(model: nn.Module, tokens: torch.Tensor, mode: str, clip: float) -> dict:
    from clinfed.privacy.dpsgd import DPSettings, PrivateStep

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = PrivateStep(model, optimizer, mode, DPSettings(0.0, clip, mode), 1, torch.Generator())
    try:
        step.zero_grad()
        logits = model(tokens[:, :-1])
        losses = nn.functional.cross_entropy(
            logits.transpose(1, 2), tokens[:, 1:], reduction="none"
        ).sum(1)
        step.backward(losses, torch.arange(len(tokens)), last=True)
        step.step()
    finally:
        step.detach()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def test_a_tied_weight_is_clipped_as_the_sum_of_its_uses(monkeypatch):
    from clinfed.privacy import bookkeeping
    from clinfed.privacy.clipping import choose_clipping
    from clinfed.privacy.errors import SettingError

    torch.manual_seed(0)
    model, tokens, clip = _TiedLM(), torch.randint(0, 12, (5, 7)), 0.05
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    # The exact per-unit clipped sum: each example's whole gradient (both
    # uses of the tied weight added), clipped, then summed.
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for row in tokens:
        model.zero_grad()
        logits = model(row[None, :-1])
        nn.functional.cross_entropy(logits[0], row[1:], reduction="sum").backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for n in grads:
            expected[n] += factor * grads[n]
    assert bookkeeping.shared_parameters(model) == {"embed.weight": ["embed", "out"]}
    assert choose_clipping(model, "auto") == "hooks"
    model.load_state_dict(start)
    got = _clipped_sum(model, tokens, "hooks", clip)
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-6), name
    # Book-keeping and ghost norms are per module: both refuse the tied weight by name.
    for mode in ("bk", "ghost"):
        with pytest.raises(SettingError, match="embed.weight"):
            choose_clipping(model, mode)
    with pytest.raises(SettingError, match="embed.weight"):
        bookkeeping.BookKeepingClipping(model, clip)
