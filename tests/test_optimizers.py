"""--optimizer under DP: DP-AdamBC takes the noise's variance out of Adam's
second moment; SGD with momentum steps at Adam-equivalent rates; a run
builds the one it was asked for, with the site's own noise scale."""

from __future__ import annotations

import math

import pytest
import torch

from clinfed.errors import ClinfedError
from clinfed.privacy import optimizers
from clinfed.privacy.optimizers import ADAMBC_FLOOR, DPAdamBC, private_optimizer


def _one_step(optimizer_of, grad: float) -> float:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = optimizer_of([param])
    param.grad = torch.tensor([grad])
    optimizer.step()
    return float(param.detach())


def test_adambc_divides_by_the_signal_scale_not_the_noise():
    variance = 1e-4  # noise std 0.01 per coordinate
    # A first gradient with g^2 = 5 variance: Adam divides by |g| (a step
    # of lr), DP-AdamBC by sqrt(g^2 - variance) = 2 * noise std.
    grad = math.sqrt(5 * variance)
    adam = _one_step(lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0), grad)
    corrected = _one_step(lambda p: DPAdamBC(p, variance, lr=1e-3, weight_decay=0.0), grad)
    assert adam == pytest.approx(-1e-3, rel=1e-4)
    assert corrected == pytest.approx(-1e-3 * math.sqrt(5) / 2, rel=1e-4)
    # Where the gradient is below the noise, the floor bounds the step.
    small = _one_step(lambda p: DPAdamBC(p, variance, lr=1e-3, weight_decay=0.0), 0.001)
    assert small == pytest.approx(-1e-3 * 0.001 / math.sqrt(ADAMBC_FLOOR * variance), rel=1e-4)


def test_adambc_with_negligible_noise_is_adamw():
    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(4)]
    params = [torch.nn.Parameter(torch.ones(5)) for _ in range(2)]
    adamw = torch.optim.AdamW([params[0]], lr=1e-2, weight_decay=0.01)
    corrected = DPAdamBC([params[1]], 1e-30, lr=1e-2, weight_decay=0.01, floor=0.0)
    for grad in grads:
        for param, optimizer in zip(params, (adamw, corrected), strict=True):
            param.grad = grad.clone()
            optimizer.step()
    torch.testing.assert_close(params[0].detach(), params[1].detach())


def test_sgd_rates_are_adam_equivalent():
    body, head = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [body], "lr": 1e-3}, {"params": [head], "lr": 1e-2}]
    sgd = private_optimizer("sgd", groups, 0.01, noise=0.02)
    assert isinstance(sgd, torch.optim.SGD)
    # (1 - momentum) / noise std: a gradient of pure noise moves by about lr.
    assert [g["lr"] for g in sgd.param_groups] == pytest.approx([5e-3, 5e-2])
    assert {g["momentum"] for g in sgd.param_groups} == {0.9}
    with pytest.raises(ValueError):
        private_optimizer("adagrad", groups, 0.01, noise=0.02)


@pytest.mark.parametrize("kind", ["adambc", "sgd"])
def test_a_private_run_trains_with_the_chosen_optimizer_at_its_noise_scale(
    kind, tiny_run, tmp_path, monkeypatch
):
    built = []
    original = optimizers.private_optimizer

    def spy(kind_, groups, weight_decay, noise):
        optimizer = original(kind_, groups, weight_decay, noise)
        built.append((kind_, noise, optimizer))
        return optimizer

    monkeypatch.setattr(optimizers, "private_optimizer", spy)
    summary = tiny_run(
        out=tmp_path / kind, optimizer=kind, noise_multiplier=1.5, rounds=1,
        max_grad_norm=0.5, batch_size=8, reproducible_noise=True,
    )  # fmt: skip
    assert summary["f1"] is not None
    assert len(built) == len(summary["epsilon"])  # one per site and round
    for kind_, noise, optimizer in built:
        assert kind_ == kind
        assert noise == pytest.approx(1.5 * 0.5 / 8)
        expected = DPAdamBC if kind == "adambc" else torch.optim.SGD
        assert isinstance(optimizer, expected)


def test_a_dp_optimizer_without_dp_is_refused(tiny_config):
    with pytest.raises(ClinfedError, match="--optimizer sgd needs DP"):
        tiny_config(optimizer="sgd").resolved().validate(check_data=False)
