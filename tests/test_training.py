"""The shared training loop: order, optimizer groups, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clinfed.errors import ProblemLog
from clinfed.models import build_model, load_tokenizer
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.training import length_grouped_batches, make_optimizer, predict, train_epoch


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
    from clinfed.training import linear_schedule

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


def test_iterate_average_weighs_in_each_step_with_a_warm_up():
    from clinfed.federated.client import IterateAverage

    model = torch.nn.Linear(1, 1, bias=True)
    with torch.no_grad():
        model.weight.fill_(0.0)
        model.bias.fill_(7.0)
    model.bias.requires_grad_(False)  # frozen: never averaged, never touched
    optimizer = torch.optim.SGD([model.weight], lr=1.0)
    average = IterateAverage(model, optimizer, decay=0.5)
    for _ in range(3):  # the weight walks 1, 2, 3
        model.weight.grad = torch.tensor([[-1.0]])
        optimizer.step()
    # d_t = min(0.5, (1 + t) / (10 + t)): 2/11, 3/12, 4/13.
    expected = 0.0
    for t, iterate in enumerate((1.0, 2.0, 3.0), start=1):
        d = min(0.5, (1 + t) / (10 + t))
        expected = d * expected + (1 - d) * iterate
    assert float(model.weight.detach()) == 3.0
    average.load()
    averaged = float(model.weight.detach())
    assert averaged == pytest.approx(expected) == pytest.approx(2.6014, abs=1e-4)
    assert float(model.bias) == 7.0
    with pytest.raises(ValueError):
        IterateAverage(model, optimizer, decay=1.0)


def test_a_private_site_sends_the_average_of_its_iterates(tiny_run, tmp_path, monkeypatch):
    import json

    from clinfed.federated import client

    built = []

    class Spy(client.IterateAverage):
        def load(self):
            super().load()
            built.append(self)
            # What the site is about to send is the average, not the last iterate.
            for name, param in self.params.items():
                torch.testing.assert_close(param.detach(), self.average[name])

    monkeypatch.setattr(client, "IterateAverage", Spy)
    summary = tiny_run(
        out=tmp_path / "ema", noise_multiplier=2.0, batch_size=8, rounds=1, local_epochs=1,
        ema_decay=0.9, reproducible_noise=True,
    )  # fmt: skip
    assert summary["f1"] is not None
    assert len(built) == len(summary["epsilon"])  # one per site
    assert all(a.decay == 0.9 and a.steps > 0 for a in built)
    recorded = json.loads((tmp_path / "ema" / "config.json").read_text())
    assert recorded["training"]["ema_decay"] == 0.9
    built.clear()
    tiny_run(out=tmp_path / "last", noise_multiplier=2.0, batch_size=8, rounds=1, local_epochs=1)
    assert built == []  # 0: the last iterate, as before
