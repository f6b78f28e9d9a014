"""The shared training loop: order, optimizer groups, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clinfed.core.errors import ProblemLog
from clinfed.modeling.models import build_model, load_tokenizer
from clinfed.modeling.training import length_grouped_batches, make_optimizer, predict, train_epoch
from clinfed.tasks.i2b2.adapter import I2b2Task


def test_length_grouped_batches_are_a_seeded_permutation_with_little_padding():
    lengths = np.random.default_rng(0).integers(2, 60, size=1000)
    plan = length_grouped_batches(lengths, 16, np.random.default_rng(1))
    order = np.concatenate(plan)
    assert sorted(order.tolist()) == list(range(1000))
    again = length_grouped_batches(lengths, 16, np.random.default_rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(plan, again))
    assert all(len(b) <= 16 for b in plan)
    grouped = [lengths[b] for b in plan]
    shuffled = np.random.default_rng(1).permutation(1000)
    plain = [lengths[shuffled[i : i + 16]] for i in range(0, 1000, 16)]

    def padding(batches):
        return sum(b.max() * len(b) - b.sum() for b in batches)

    assert padding(grouped) < 0.1 * padding(plain)


def test_head_gets_its_own_learning_rate():
    model = build_model("token", "tiny", num_labels=3)
    optimizer = make_optimizer(model, lr=1e-4, weight_decay=0.0)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-4, 1e-3]
    head = {id(p) for p in model.head.parameters()}
    assert {id(p) for p in optimizer.param_groups[1]["params"]} == head


def train_once(i2b2_corpus, cache) -> tuple[dict, list]:
    task = I2b2Task()
    corpus = task.load(i2b2_corpus, ProblemLog())
    tokenizer = load_tokenizer("tiny")
    train = task.encode(corpus.train, tokenizer, 64, cache)
    model = build_model(task.head, "tiny", len(task.labels), seed=7)
    torch.manual_seed(7)
    train_epoch(model, task, train, make_optimizer(model, 1e-3, 0.0), 8, np.random.default_rng(7))
    test = task.encode(corpus.test, tokenizer, 64, cache)
    return model.state_dict(), predict(model, task, test)


def test_same_seed_same_weights_and_predictions(i2b2_corpus, tmp_path):
    first, out1 = train_once(i2b2_corpus, str(tmp_path / "a"))
    second, out2 = train_once(i2b2_corpus, str(tmp_path / "b"))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(np.array_equal(a, b) for a, b in zip(out1, out2))


def test_linear_schedule_rejects_a_warmup_that_is_not_a_share():
    from clinfed.modeling.training import linear_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for bad in ("3", 3, 1.0, -0.1):
        with pytest.raises(ValueError, match="warm-up"):
            linear_schedule(optimizer, 100, bad)
    schedule = linear_schedule(optimizer, 100, 0.1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # step 0 of a 10-step warm-up
    del schedule


def test_rate_decays_take_the_rates_to_zero_over_the_run():
    from clinfed.federated.client import LocalSettings, decay_rates

    def rates(round_number: int, decay: str) -> list[float]:
        weight = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([{"params": [weight], "lr": 1.0}])
        decay_rates(optimizer, LocalSettings(lr_decay=decay, rounds=2), round_number, steps=4)
        seen = []
        for _ in range(4):
            seen.append(optimizer.param_groups[0]["lr"])
            weight.grad = torch.ones(2)
            optimizer.step()
        return seen + [optimizer.param_groups[0]["lr"]]

    assert rates(1, "linear") == [1.0, 0.875, 0.75, 0.625, 0.5]
    assert rates(2, "linear") == [0.5, 0.375, 0.25, 0.125, 0.0]
    assert rates(2, "none") == [1.0] * 5
    # cooldown: the full rates until the last round, then linear to zero over it.
    assert rates(1, "cooldown") == [1.0] * 5
    assert rates(2, "cooldown") == [1.0, 0.75, 0.5, 0.25, 0.0]
