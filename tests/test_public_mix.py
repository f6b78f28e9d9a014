"""--dp-public-mix: the public text's gradient added to each private step,
at the site's local model, at no privacy cost."""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets
import pytest
import torch
from torch import nn

from clinfed.errors import ClinfedError
from clinfed.warmstart import PublicMix

from .test_cli import run_cli
from .test_warmstart import _public


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))).squeeze(-1)


class _Task:
    """The three things PublicMix asks of a task."""

    @staticmethod
    def collate(rows: dict) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor(rows["x"]), "y": torch.tensor(rows["y"])}

    @staticmethod
    def model_inputs(batch: dict) -> dict[str, torch.Tensor]:
        return {"x": batch["x"]}

    @staticmethod
    def example_losses(outputs: torch.Tensor, batch: dict) -> torch.Tensor:
        return (outputs - batch["y"]) ** 2


def _examples(n: int = 6) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_dict(
        {
            "input_ids": [[1] * (1 + i % 3) for i in range(n)],
            "x": torch.randn(n, 3, generator=generator).tolist(),
            "y": torch.randn(n, generator=generator).tolist(),
        }
    )


def test_the_public_gradient_is_added_at_its_weight_to_the_trainable_parameters_only():
    torch.manual_seed(0)
    model, examples = _Model(), _examples()
    model.body.weight.requires_grad_(False)  # not in this round's plan
    config = SimpleNamespace(dp_public_mix=0.5, dp_public_batch=100, seed=0)
    mix = PublicMix(config, _Task(), examples, model)
    assert mix.batch == len(examples)  # capped at the public examples there are
    # What the noised private step left on the gradients.
    noised = {n: torch.randn_like(p) for n, p in model.named_parameters() if p.requires_grad}
    for name, param in model.named_parameters():
        param.grad = noised[name].clone() if param.requires_grad else None
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}

    mix(model)

    # The expected public term: the mean loss over every public example.
    reference = _Model()
    reference.load_state_dict(before)
    batch = _Task.collate(examples[:])
    _Task.example_losses(reference(batch["x"]), batch).mean().backward()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert param.grad is None  # frozen: nothing added
            continue
        assert torch.allclose(param.grad, noised[name] + 0.5 * expected[name].grad, atol=1e-6)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])  # the model itself is not moved
    assert all(p.grad is None for p in mix.scratch.parameters())  # nothing left behind


def test_each_step_draws_a_public_batch_of_its_size_from_the_public_order():
    model, examples = _Model(), _examples(40)
    config = SimpleNamespace(dp_public_mix=1.0, dp_public_batch=8, seed=0)
    drawn = []
    mix = PublicMix(config, _Task(), examples, model)
    collate = mix.task.collate
    mix.task = SimpleNamespace(
        collate=lambda rows: drawn.append(rows["x"]) or collate(rows),
        model_inputs=_Task.model_inputs,
        example_losses=_Task.example_losses,
    )
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    mix(model)
    mix(model)
    assert [len(rows) for rows in drawn] == [8, 8]
    assert drawn[0] != drawn[1]  # a fresh batch each step
    again = PublicMix(config, _Task(), examples, model)
    first = again.order.choice(len(examples), 8, replace=False)
    assert sorted(map(tuple, drawn[0])) == sorted(tuple(examples[int(i)]["x"]) for i in first)


def test_a_private_run_adds_the_public_gradient_to_every_step_at_the_same_epsilon(
    tiny_run, tmp_path, monkeypatch
):
    import clinfed.warmstart as warmstart
    from clinfed.privacy.dpsgd import PrivateStep

    calls, steps = [], []
    mixing, stepping = warmstart.PublicMix.__call__, PrivateStep.step

    def mixed(self, model):
        calls.append(self.weight)
        return mixing(self, model)

    def step(self):
        steps.append(self.ready)  # a step that goes on to the optimizer
        return stepping(self)

    monkeypatch.setattr(warmstart.PublicMix, "__call__", mixed)
    monkeypatch.setattr(PrivateStep, "step", step)
    common = dict(
        adapter="bias", noise_multiplier=2.0, batch_size=8, local_epochs=1,
        public_data=str(_public(tmp_path / "public")),
        public_types="Disease=problem,Chemical=treatment", reproducible_noise=True,
        max_length=128,
    )  # fmt: skip
    mixed_run = tiny_run(out=tmp_path / "mix", dp_public_mix=0.7, dp_public_batch=5, **common)
    record = json.loads((tmp_path / "mix" / "config.json").read_text())["public_mix"]
    assert record["weight"] == 0.7 and record["batch"] == 5 and record["examples"] == 60
    assert record["types"] == ["problem", "treatment"]
    taken = sum(steps)
    assert taken and calls == [0.7] * taken  # every private step of every site
    calls.clear()
    plain = tiny_run(out=tmp_path / "plain", **common)
    assert calls == []
    assert mixed_run["epsilon"] == plain["epsilon"]  # the same accounting
    assert "public_mix" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_the_flag_reaches_the_run_and_its_privacy_report(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    trained = run_cli(
        "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--strategy", "fedavg", "--adapter", "bias", "--rounds", "1", "--max-length", "32",
        "--threads", "1", "--target-epsilon", "8", "--out", str(out),
        "--public-data", str(_public(tmp_path / "public")),
        "--public-types", "Disease=problem,Chemical=treatment",
        "--dp-public-mix", "0.25", "--dp-public-batch", "4",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    record = json.loads((out / "config.json").read_text())["public_mix"]
    assert (record["weight"], record["batch"]) == (0.25, 4)
    reported = run_cli("report", str(out))
    assert reported.returncode == 0, reported.stderr
    page = (out / "report" / "report.md").read_text()
    assert "each DP-SGD step also descended the loss on public text public" in page
    assert "(60 examples, 4 a step) at weight 0.25, without noise" in page


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dp_public_mix": 1.0, "public_data": "P"}, "needs DP"),
        ({"dp_public_mix": 1.0, "noise_multiplier": 1.0}, "needs --public-data"),
    ],
)
def test_a_public_mix_without_what_it_needs_is_refused(tiny_config, settings, message):
    with pytest.raises(ClinfedError, match=message):
        tiny_config(**settings).resolved().validate(check_data=False)


def test_the_public_text_alone_may_serve_the_mix(tiny_config):
    config = tiny_config(dp_public_mix=1.0, noise_multiplier=1.0, public_data="P", public_epochs=0)
    config.resolved().validate(check_data=False)  # no "leaves --public-data unused"
