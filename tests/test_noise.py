"""The privacy-protecting randomness: the noise has the calibrated standard
deviation, comes from a secret source by default, and a replay with the
public seed does not reproduce what a site released."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from clinfed.core.runs import read_jsonl
from clinfed.privacy.dpsgd import DPSettings, PrivateStep
from clinfed.privacy.randomness import NOT_PRIVATE, reproducible, secret


def one_noisy_step(randomness, sigma=1.7, clip=0.5, batch=8, mode="hooks") -> torch.Tensor:
    """One DP-SGD step of plain SGD (lr 1) on a loss with zero gradient: the
    update is minus the noise over the expected batch size."""
    torch.manual_seed(0)
    model = nn.Linear(200, 500)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = PrivateStep(
        model, optimizer, mode, DPSettings(sigma, clip, mode), batch, randomness.noise
    )
    try:
        step.zero_grad()
        x = torch.randn(batch, 200)
        losses = (model(x) * 0.0).sum(dim=1)
        step.backward(losses, torch.arange(batch), last=True)
        assert step.ready
        step.step()
    finally:
        step.detach()
    return (before - model.weight.detach()) * batch  # the noise added to the clipped sum


@pytest.mark.parametrize("mode", ["hooks", "bk"])  # Opacus's optimizer, and clinfed's own noise
def test_the_noise_has_the_calibrated_standard_deviation(mode):
    noise = one_noisy_step(secret(), sigma=1.7, clip=0.5, mode=mode)
    assert noise.numel() == 100_000
    assert float(noise.std()) == pytest.approx(1.7 * 0.5, rel=0.05)
    assert abs(float(noise.mean())) < 0.05


def test_an_empty_batch_still_releases_noise_of_the_calibrated_size():
    # Skipping an empty Poisson batch would reveal it was empty: the step
    # then adds the same noise as any other, over the expected batch size.
    torch.manual_seed(0)
    model = nn.Linear(200, 500)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = PrivateStep(model, optimizer, "hooks", DPSettings(1.7, 0.5, "hooks"), 8, secret().noise)
    try:
        step.noise_only()
    finally:
        step.detach()
    noise = (before - model.weight.detach()) * 8
    assert float(noise.std()) == pytest.approx(1.7 * 0.5, rel=0.05)
    assert abs(float(noise.mean())) < 0.05


def test_noise_is_secret_by_default_and_reproducible_only_when_asked():
    assert not torch.equal(one_noisy_step(secret()), one_noisy_step(secret()))
    replay = [one_noisy_step(reproducible(np.random.default_rng([0, 1]))) for _ in range(2)]
    assert torch.equal(*replay)


def test_a_replay_with_the_public_seed_does_not_reproduce_the_release(tmp_path, tiny_run):
    # The same public settings (seed included) twice: the model the server
    # built from the sites' uploads differs, so knowing the seed does not
    # let anyone regenerate a site's noise and subtract it. The bias plan:
    # where the noise comes from does not depend on what trains, and it
    # keeps these four runs short.
    noisy = {"batch_size": 8, "noise_multiplier": 50.0, "adapter": "bias"}
    tiny_run(tmp_path / "a", **noisy)
    tiny_run(tmp_path / "b", **noisy)
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert not all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert "not_private" not in summary
    # What a private site released: nothing computed on its data but the
    # accounted update (no loss, no token count, no timing).
    sites = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "bytes_up" in r]
    assert sites and not any({"train_loss", "train_tokens", "wall_s"} & set(r) for r in sites)

    # Only --reproducible-noise replays, and such a run says it is not private.
    tiny_run(tmp_path / "c", **noisy, reproducible_noise=True)
    summary = tiny_run(tmp_path / "d", **noisy, reproducible_noise=True)
    c = load_file(str(tmp_path / "c" / "model" / "model.safetensors"))
    d = load_file(str(tmp_path / "d" / "model" / "model.safetensors"))
    assert all(torch.equal(c[k], d[k]) for k in c)
    assert summary["not_private"] == NOT_PRIVATE
    ledger = read_jsonl(tmp_path / "d" / "privacy" / "beth.jsonl")
    assert ledger and all(line["not_private"] == NOT_PRIVATE for line in ledger)
    policy = json.loads((tmp_path / "d" / "privacy" / "policy.json").read_text())
    assert "NOT private" in policy["noise"] and NOT_PRIVATE in policy["warnings"]


def test_noise_is_secret_even_with_the_sampling_pinned(tmp_path, tiny_run, monkeypatch):
    # The Poisson batches pinned to the same draws in both runs, and the same
    # public settings and seed: only the DP noise can tell the runs apart,
    # so noise drawn from the public stream would give the same weights.
    from clinfed.federated import site as site_module
    from clinfed.privacy.randomness import SiteRandomness

    def pinned_sampling() -> SiteRandomness:
        drawn = secret()
        return SiteRandomness(np.random.default_rng(7), drawn.noise, drawn.reproducible)

    monkeypatch.setattr(site_module, "secret", pinned_sampling)
    noisy = {
        "batch_size": 8, "noise_multiplier": 50.0, "adapter": "bias",
        "neighbours": "replace-one",  # no count drawn: the sampling and the noise are all
    }  # fmt: skip
    tiny_run(tmp_path / "a", **noisy)
    tiny_run(tmp_path / "b", **noisy)
    a = load_file(str(tmp_path / "a" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model" / "model.safetensors"))
    assert not all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("size, std", [(1, 1.0), (1000, 0.37), (1 << 21, 2.5)])
def test_the_in_place_secure_sampler_gives_opacus_s_values_exactly(size, std):
    # clinfed draws Opacus's secure_mode noise in place for speed; the
    # values, and so --reproducible-noise runs, must not change with it.
    from opacus.optimizers.optimizer import _generate_noise

    from clinfed.privacy.noise import secure_fill

    ours, theirs = torch.Generator(), torch.Generator()
    ours.manual_seed(11)
    theirs.manual_seed(11)
    out = torch.empty(size)
    secure_fill(out, std, ours)
    assert torch.equal(out, _generate_noise(std, torch.empty(size), theirs, True))
    # and the generators end in the same state: the next draw agrees too
    assert torch.equal(torch.randn(3, generator=ours), torch.randn(3, generator=theirs))
