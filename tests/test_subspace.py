"""--dp-subspace: DP-SGD's noise in a public gradient subspace, at the same
noise multiplier and accounting."""

from __future__ import annotations

import json

import pytest
import torch

from clinfed.errors import ClinfedError
from clinfed.privacy import subspace as subspace_module
from clinfed.privacy.subspace import (
    GradientSubspace,
    label_feature_basis,
    stack_blocks,
    top_directions,
)
from clinfed.warmstart import HEAD_FEATURE_RANK

from .test_warmstart import _public


def _space(rank: int = 3, seed: int = 0) -> tuple[GradientSubspace, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gradients = torch.randn(20, 5, generator=generator) @ torch.randn(5, 12, generator=generator)
    basis, held = top_directions(gradients, rank)
    blocks = basis.split([8, 4], dim=1)
    return GradientSubspace({"a": blocks[0], "b": blocks[1]}, frozenset({"head"}), held), basis


def test_the_basis_is_orthonormal_and_holds_the_gradients_it_came_from():
    generator = torch.Generator().manual_seed(1)
    low_rank = torch.randn(30, 4, generator=generator) @ torch.randn(4, 50, generator=generator)
    basis, held = top_directions(low_rank, 4)
    torch.testing.assert_close(basis @ basis.T, torch.eye(4), atol=1e-5, rtol=0)
    assert held == pytest.approx(1.0)  # rank-4 gradients lie in 4 directions
    _, partial = top_directions(low_rank, 2)
    assert 0 < partial < 1
    with pytest.raises(ValueError):
        top_directions(low_rank, 31)


def test_a_unit_moves_the_released_coordinates_by_at_most_the_clip_norm():
    _, basis = _space()
    generator = torch.Generator().manual_seed(2)
    for _ in range(200):
        g = torch.randn(12, generator=generator)
        g = g / g.norm()  # a clipped unit at the bound C = 1
        assert float((basis @ g).norm()) <= 1.0 + 1e-6


def test_the_noise_lies_in_the_subspace_and_the_head_is_noised_whole():
    space, basis = _space()
    sums = {"a": torch.zeros(2, 4), "b": torch.zeros(4), "head": torch.zeros(3)}
    drawn = []

    def noise(n):
        drawn.append(n)
        return torch.arange(1.0, n + 1.0)

    out = space.noisy_gradients(sums, noise)
    assert drawn == [3 + 3]  # rank coordinates, then the head's three numbers
    flat = torch.cat([out["a"].reshape(-1), out["b"]])
    torch.testing.assert_close(flat, torch.tensor([1.0, 2.0, 3.0]) @ basis)
    torch.testing.assert_close(out["head"], torch.tensor([4.0, 5.0, 6.0]))
    assert space.noised_numbers({n: s.shape for n, s in sums.items()}) == 6


def test_without_noise_the_step_is_the_sum_projected_onto_the_subspace():
    space, basis = _space()
    generator = torch.Generator().manual_seed(3)
    sums = {"a": torch.randn(2, 4, generator=generator), "b": torch.randn(4, generator=generator)}
    sums["head"] = torch.randn(3, generator=generator)
    out = space.noisy_gradients(sums, torch.zeros)
    full = torch.cat([sums["a"].reshape(-1), sums["b"]])
    projected = (basis @ full) @ basis
    torch.testing.assert_close(torch.cat([out["a"].reshape(-1), out["b"]]), projected)
    torch.testing.assert_close(out["head"], sums["head"])


def _residual_space(residual: float) -> tuple[GradientSubspace, torch.Tensor]:
    space, basis = _space()
    return GradientSubspace(space.basis, space.kept, space.held, residual=residual), basis


def test_the_residual_keeps_its_share_of_the_noised_gradient_outside_the_subspace():
    generator = torch.Generator().manual_seed(6)
    sums = {"a": torch.randn(2, 4, generator=generator), "b": torch.randn(4, generator=generator)}
    sums["head"] = torch.randn(3, generator=generator)
    z = torch.randn(12 + 3, generator=generator)
    drawn = []

    def noise(n):
        drawn.append(n)
        return z[:n]

    space, basis = _residual_space(0.25)
    out = space.noisy_gradients(sums, noise)
    assert drawn == [12 + 3]  # every projected number is noised, then the head's
    released = torch.cat([sums["a"].reshape(-1), sums["b"]]) + z[:12]  # plain DP-SGD's y
    inside = (basis @ released) @ basis
    step = torch.cat([out["a"].reshape(-1), out["b"]])
    torch.testing.assert_close(step, inside + 0.25 * (released - inside))
    torch.testing.assert_close(out["head"], sums["head"] + z[12:])
    shapes = {n: t.shape for n, t in sums.items()}
    assert space.noised_numbers(shapes) == 15
    assert space.noise_dimensions(shapes) == pytest.approx(3 + 3 + 0.25**2 * (12 - 3))


def test_a_residual_of_one_is_plain_dp_sgd():
    generator = torch.Generator().manual_seed(7)
    sums = {"a": torch.randn(2, 4, generator=generator), "b": torch.randn(4, generator=generator)}
    sums["head"] = torch.randn(3, generator=generator)
    z = torch.randn(15, generator=generator)
    out = _residual_space(1.0)[0].noisy_gradients(sums, lambda n: z[:n])
    flat = torch.cat([out[n].reshape(-1) for n in ("a", "b", "head")])
    plain = torch.cat([sums[n].reshape(-1) for n in ("a", "b", "head")]) + z
    torch.testing.assert_close(flat, plain)


def test_a_residual_outside_zero_to_one_is_refused(tiny_config):
    with pytest.raises(ValueError, match="residual"):
        _residual_space(1.5)
    with pytest.raises(ClinfedError, match="needs --dp-subspace"):
        tiny_config(dp_residual=0.1, noise_multiplier=1.0).resolved().validate(check_data=False)


def test_a_trainable_tensor_outside_the_subspace_is_refused():
    space, _ = _space()
    with pytest.raises(ValueError, match="outside the public gradient subspace"):
        space.noisy_gradients({"a": torch.zeros(2, 4), "other": torch.zeros(2)}, torch.zeros)


@pytest.mark.parametrize("clipping", ["bk", "hooks"])
def test_a_private_run_noises_in_the_public_subspace_at_the_same_epsilon(
    clipping, tiny_run, tmp_path, monkeypatch
):
    calls = []
    original = subspace_module.GradientSubspace.noisy_gradients

    def spy(self, sums, noise):
        calls.append(self.noised_numbers({n: t.shape for n, t in sums.items()}))
        return original(self, sums, noise)

    monkeypatch.setattr(subspace_module.GradientSubspace, "noisy_gradients", spy)
    common = dict(
        adapter="bias", noise_multiplier=2.0, batch_size=8, local_epochs=1,
        public_data=str(_public(tmp_path / "public")),
        public_types="Disease=problem,Chemical=treatment", reproducible_noise=True,
        clipping=clipping, max_length=128,
    )  # fmt: skip
    projected = tiny_run(out=tmp_path / "sub", dp_subspace=4, **common)
    found = json.loads((tmp_path / "sub" / "config.json").read_text())["public_subspace"]
    assert found["rank"] == 4 and found["public_examples"] == 60
    (labels, hidden), _ = _head_shapes(tmp_path / "sub")
    assert found["head_feature_rank"] == min(HEAD_FEATURE_RANK, hidden)
    # K encoder directions, every label with each feature direction, the head's bias.
    assert found["noised_numbers"] == 4 + labels * found["head_feature_rank"] + labels
    assert found["noised_numbers"] < found["trainable_numbers"]
    assert calls and set(calls) == {found["noised_numbers"]}  # every step, every site
    whole = tiny_run(out=tmp_path / "whole", **common)
    assert projected["epsilon"] == whole["epsilon"]  # the same accounting
    assert projected["f1"] is not None


def test_a_run_keeps_the_residual_and_the_public_examples_it_is_given(
    tiny_run, tmp_path, monkeypatch
):
    residuals = []
    original = subspace_module.GradientSubspace.noisy_gradients

    def spy(self, sums, noise):
        residuals.append(self.residual)
        return original(self, sums, noise)

    monkeypatch.setattr(subspace_module.GradientSubspace, "noisy_gradients", spy)
    tiny_run(
        out=tmp_path / "res", adapter="bias", noise_multiplier=2.0, batch_size=8,
        local_epochs=1, public_data=str(_public(tmp_path / "public")),
        public_types="Disease=problem,Chemical=treatment", reproducible_noise=True,
        max_length=128, dp_subspace=4, dp_residual=0.5, dp_subspace_examples=30,
    )  # fmt: skip
    found = json.loads((tmp_path / "res" / "config.json").read_text())["public_subspace"]
    assert found["residual"] == 0.5
    assert found["public_examples"] == 30  # of the 60 public sentences
    assert residuals and set(residuals) == {0.5}  # every step, every site


@pytest.mark.parametrize("refresh", [False, True])
def test_the_subspace_is_found_again_at_each_global_model_when_asked(
    refresh, tiny_run, tmp_path, monkeypatch
):
    import clinfed.warmstart as warmstart
    from clinfed.federated.site import SiteRunner

    found, used, starts = [], [], {}
    find, original = warmstart.public_subspace, subspace_module.GradientSubspace.noisy_gradients
    train_round = SiteRunner.train_round

    def training(runner, round_number, *rest):
        starts[(round_number, runner.name)] = runner.model.head.weight.detach().clone()
        return train_round(runner, round_number, *rest)

    def finding(config, task, model, *rest, **kw):
        params = dict(model.named_parameters())
        found.append(params["head.weight"].detach().clone())  # the model it was found at
        return find(config, task, model, *rest, **kw)

    def spy(self, sums, noise):
        used.append(id(self))
        return original(self, sums, noise)

    monkeypatch.setattr(warmstart, "public_subspace", finding)
    monkeypatch.setattr(subspace_module.GradientSubspace, "noisy_gradients", spy)
    monkeypatch.setattr(SiteRunner, "train_round", training)
    summary = tiny_run(
        out=tmp_path / "run", adapter="bias", noise_multiplier=2.0, batch_size=8,
        local_epochs=1, public_data=str(_public(tmp_path / "public")), rounds=2,
        public_types="Disease=problem,Chemical=treatment", reproducible_noise=True,
        max_length=128, dp_subspace=4, dp_subspace_refresh=refresh,
    )  # fmt: skip
    record = json.loads((tmp_path / "run" / "config.json").read_text())["public_subspace"]
    assert record["refresh"] is refresh
    if not refresh:
        assert len(found) == 1 and len(set(used)) == 1  # the start's basis, every round
        return
    # Once at the start, once at round 1's global model: every site of
    # round 2 starts from it, so it is found once for all of them.
    assert len(found) == 2 and len(set(used)) == 2
    assert not torch.equal(found[0], found[1])  # the second at a trained model
    second = [weight for (number, _), weight in starts.items() if number == 2]
    assert second and all(torch.equal(found[1], w) for w in second)  # round 2's start
    assert summary["epsilon"]


@pytest.mark.parametrize("every", [1, 2])
def test_the_subspace_is_found_again_at_the_local_model_within_a_round(
    every, tiny_run, tmp_path, monkeypatch
):
    import clinfed.warmstart as warmstart

    found, used = [], []
    find, original = warmstart.public_subspace, subspace_module.GradientSubspace.noisy_gradients
    at_local = warmstart.PublicSubspaces.at_local_model

    def finding(config, task, model, *rest, **kw):
        params = dict(model.named_parameters())
        found[-1].append(params["head.weight"].detach().clone())  # the model it was found at
        return find(config, task, model, *rest, **kw)

    def locally(self, model):
        found.append([model.get_parameter("head.weight").detach().clone()])  # the site's model
        return at_local(self, model)

    def spy(self, sums, noise):
        used.append(self)
        return original(self, sums, noise)

    monkeypatch.setattr(warmstart, "public_subspace", finding)
    monkeypatch.setattr(warmstart.PublicSubspaces, "at_local_model", locally)
    monkeypatch.setattr(subspace_module.GradientSubspace, "noisy_gradients", spy)
    found.append([])  # the start's
    summary = tiny_run(
        out=tmp_path / "run", adapter="bias", noise_multiplier=2.0, batch_size=8,
        local_epochs=3, public_data=str(_public(tmp_path / "public")), rounds=1,
        public_types="Disease=problem,Chemical=treatment", reproducible_noise=True,
        max_length=128, dp_subspace=4, dp_subspace_refresh_epochs=every,
    )  # fmt: skip
    record = json.loads((tmp_path / "run" / "config.json").read_text())["public_subspace"]
    assert record["refresh_epochs"] == every
    sites = len(summary["epsilon"])
    start, local = found[0], found[1:]
    # After each `every` local epochs but the last, at each site's own model.
    assert len(start) == 1 and len(local) == sites * (2 if every == 1 else 1)
    for site_model, public_model in local:
        assert torch.equal(site_model, public_model)
        assert not torch.equal(site_model, start[0])  # trained since the round began
    # The steps after each refresh noise in the basis found there.
    bases = []
    for space in used:
        if not bases or bases[-1] is not space:
            bases.append(space)
    assert len(bases) == sites * (3 if every == 1 else 2)
    assert summary["epsilon"]


def test_a_private_step_noises_in_the_subspace_it_is_handed_within_a_round():
    from torch import nn

    from clinfed.privacy.dpsgd import DPSettings, PrivateStep
    from clinfed.privacy.randomness import secret

    def space(rank: int, seed: int) -> GradientSubspace:
        generator = torch.Generator().manual_seed(seed)
        basis, held = top_directions(torch.randn(20, 12, generator=generator), rank)
        return GradientSubspace({"weight": basis}, frozenset({"bias"}), held)

    model = nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    first, second = space(3, 0), space(3, 1)
    step = PrivateStep(
        model, optimizer, "bk", DPSettings(1.7, 0.5, "bk"), 8, secret().noise, None, first
    )
    plain = PrivateStep(model, optimizer, "hooks", DPSettings(1.7, 0.5, "hooks"), 8, secret().noise)
    try:
        with pytest.raises(ValueError, match="began without a subspace"):
            plain.use_subspace(first)  # Opacus would go on noising every number
    finally:
        plain.detach()
    try:
        with pytest.raises(ValueError, match="rank 2 cannot replace one of rank 3"):
            step.use_subspace(space(2, 2))  # the optimizer was sized for rank 3
        step.use_subspace(second)
        before = model.weight.detach().clone().reshape(-1)
        step.noise_only()
        moved = model.weight.detach().reshape(-1) - before
    finally:
        step.detach()
    inside = second.basis["weight"].T @ (second.basis["weight"] @ moved)
    assert float(moved.norm()) > 0
    assert torch.allclose(moved, inside, atol=1e-6)  # in the new basis's span
    outside_first = moved - first.basis["weight"].T @ (first.basis["weight"] @ moved)
    assert float(outside_first.norm()) > 0.1 * float(moved.norm())  # not the first's


def test_per_example_gradients_are_each_examples_own():
    from torch import nn

    from clinfed.privacy.clipping import layer_hooks, per_example_gradients

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 4), nn.LayerNorm(4), nn.Tanh(), nn.Dropout(0.5), nn.Linear(4, 3)
    ).eval()  # the dropout stays off
    model[0].weight.requires_grad_(False)  # only what is asked for
    targets = [model[0].bias, model[1].weight, model[4].weight]
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    with layer_hooks(model):
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        grads = per_example_gradients(model, targets, losses)
    for i in range(6):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        for got, want in zip(grads, torch.autograd.grad(loss, targets), strict=True):
            assert torch.allclose(got[i], want, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # .grad left untouched
    assert not any(m.training for m in model.modules())  # the modes put back


def test_the_public_gradients_do_not_depend_on_how_they_are_batched(
    tiny_run, tmp_path, monkeypatch
):
    import clinfed.warmstart as warmstart

    matrices = []
    find = warmstart.top_directions

    def spy(gradients, rank):
        if gradients.shape[1] != HEAD_FEATURE_RANK:  # the encoder's, not token features
            matrices.append(gradients.clone())
        return find(gradients, rank)

    monkeypatch.setattr(warmstart, "top_directions", spy)
    public = str(_public(tmp_path / "public"))
    for batch in (1, 7):  # one example a pass (the reference); 7, padded, not dividing 30
        monkeypatch.setattr(warmstart, "SUBSPACE_BATCH", batch)
        tiny_run(
            out=tmp_path / f"b{batch}", adapter="bias", noise_multiplier=2.0, batch_size=8,
            local_epochs=1, public_data=public, public_types="Disease=problem,Chemical=treatment",
            reproducible_noise=True, max_length=128, dp_subspace=4, dp_subspace_examples=30,
            public_epochs=0,
        )  # fmt: skip
    one, batched = matrices[0], matrices[-1]
    assert one.shape == batched.shape and one.shape[0] == 30
    assert float(one.abs().max()) > 0
    assert torch.allclose(one, batched, atol=1e-5, rtol=1e-4)


def test_the_share_held_is_the_projected_sums_share_of_its_squared_norm():
    space, basis = _space()
    inside = 2.0 * basis[0] - basis[2]  # in the basis
    outside = torch.randn(12, generator=torch.Generator().manual_seed(8))
    outside -= basis.T @ (basis @ outside)  # orthogonal to it
    as_sums = lambda v: {"a": v[:8].view(2, 4), "b": v[8:], "head": torch.ones(3)}  # noqa: E731
    assert space.held_share(as_sums(inside)) == pytest.approx(1.0, abs=1e-5)
    assert space.held_share(as_sums(outside)) == pytest.approx(0.0, abs=1e-5)
    mixed = inside / inside.norm() + outside / outside.norm()  # half of each
    assert space.held_share(as_sums(mixed)) == pytest.approx(0.5, abs=1e-5)


def test_the_noise_on_one_number_is_the_subspaces_share_of_the_full_noise():
    space, _ = _space()  # rank 3 over "a" (8 numbers) and "b" (4); "head" (3) whole
    shapes = {"a": torch.Size([2, 4]), "b": torch.Size([4]), "head": torch.Size([3])}
    assert space.coordinate_noise(shapes) == pytest.approx(((3 + 3) / 15) ** 0.5)
    residual, _ = _residual_space(0.5)
    assert residual.coordinate_noise(shapes) == pytest.approx(((6 + 0.25 * 9) / 15) ** 0.5)


def test_a_private_optimizer_is_sized_by_the_noise_in_the_subspace(tiny_run, tmp_path, monkeypatch):
    from clinfed.privacy import optimizers

    sized = []
    original = optimizers.private_optimizer

    def spy(kind, groups, weight_decay, noise):
        sized.append(noise)
        return original(kind, groups, weight_decay, noise)

    monkeypatch.setattr(optimizers, "private_optimizer", spy)
    tiny_run(
        out=tmp_path / "run", adapter="bias", noise_multiplier=2.0, batch_size=8,
        local_epochs=1, public_data=str(_public(tmp_path / "public")), optimizer="sgd",
        public_types="Disease=problem,Chemical=treatment", reproducible_noise=True,
        max_length=128, dp_subspace=4,
    )  # fmt: skip
    found = json.loads((tmp_path / "run" / "config.json").read_text())["public_subspace"]
    share = (found["noised_numbers"] / found["trainable_numbers"]) ** 0.5
    assert sized and sized == pytest.approx([2.0 * 1.0 / 8 * share] * len(sized))


def _head_shapes(run):
    from safetensors import safe_open

    with safe_open(str(run / "model" / "model.safetensors"), "pt") as f:
        return [f.get_slice(k).get_shape() for k in ("head.weight", "head.bias")]


def test_the_head_basis_keeps_every_label_and_public_feature_directions():
    generator = torch.Generator().manual_seed(4)
    features, _ = top_directions(torch.randn(40, 6, generator=generator), 2)  # (2, 6)
    basis = label_feature_basis(features, labels=3)
    assert basis.shape == (6, 18)
    torch.testing.assert_close(basis @ basis.T, torch.eye(6), atol=1e-5, rtol=0)
    # A token's head gradient e h^T with h among the public directions is kept
    # whole, whichever label it is for (one the public text never labels too).
    h = 0.7 * features[0] - 0.2 * features[1]
    e = torch.tensor([0.0, 0.0, 1.5])
    gradient = torch.outer(e, h).reshape(-1)
    torch.testing.assert_close((basis @ gradient) @ basis, gradient, atol=1e-5, rtol=0)
    # Feature directions outside the public ones are dropped.
    outside = torch.randn(6, generator=generator)
    outside -= features.T @ (features @ outside)
    assert float((basis @ torch.outer(e, outside).reshape(-1)).norm()) < 1e-5


def test_bases_over_disjoint_tensors_stack_into_one_orthonormal_basis():
    first, _ = top_directions(torch.randn(10, 5), 2)
    second, _ = top_directions(torch.randn(10, 3), 3)
    stacked = stack_blocks([{"a": first}, {"b": second}])
    full = torch.cat([stacked["a"], stacked["b"]], dim=1)
    assert full.shape == (5, 8)
    torch.testing.assert_close(full @ full.T, torch.eye(5), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="two groups"):
        stack_blocks([{"a": first}, {"a": first}])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dp_subspace": 4, "adapter": "bias", "public_data": "P"}, "needs DP"),
        ({"dp_subspace": 4, "adapter": "bias", "noise_multiplier": 1.0}, "needs --public-data"),
        ({"dp_subspace": 4, "public_data": "P", "noise_multiplier": 1.0}, "needs an adapter"),
        ({"public_epochs": 0, "public_data": "P"}, "leaves --public-data unused"),
        ({"dp_subspace_refresh": True, "noise_multiplier": 1.0}, "needs --dp-subspace"),
        ({"dp_subspace_refresh_epochs": 1, "noise_multiplier": 1.0}, "needs --dp-subspace"),
    ],
)
def test_a_subspace_without_what_it_needs_is_refused(tiny_config, settings, message):
    with pytest.raises(ClinfedError, match=message):
        tiny_config(**settings).resolved().validate(check_data=False)


@pytest.mark.parametrize("shape", [(40, 6), (6, 40)])
def test_both_ways_of_finding_the_basis_agree_with_the_svd(shape):
    generator = torch.Generator().manual_seed(5)
    gradients = torch.randn(*shape, generator=generator, dtype=torch.float64).float()
    basis, held = top_directions(gradients, 3)
    _, singular, vh = torch.linalg.svd(gradients.double(), full_matrices=False)
    # The same subspace (the projectors agree) and the same share held.
    torch.testing.assert_close((basis.T @ basis).double(), vh[:3].T @ vh[:3], atol=1e-4, rtol=0)
    assert held == pytest.approx(float(singular[:3].square().sum() / singular.square().sum()))
