"""The DP recipe: without --batch-size a private site trains at a batch
derived from its own size, with its rates scaled to match, and accounts
exactly that batch."""

from __future__ import annotations

import json
import math

import pytest

import clinfed.federated.client as client
from clinfed.privacy.recipe import (
    MAX_BATCH,
    MIN_BATCH,
    WHOLE_MODEL_LOCAL_EPOCHS,
    dp_batch_size,
    dp_local_epochs,
    lr_scale,
    steps_per_epoch,
)
from clinfed.tasks.i2b2.adapter import I2b2Task


def test_the_batch_grows_with_the_site_and_stays_in_bounds():
    assert dp_batch_size(30) == 30  # never more than the site holds
    assert dp_batch_size(500) == MIN_BATCH
    assert dp_batch_size(3200) == 200
    assert dp_batch_size(10**7) == MAX_BATCH
    assert lr_scale(64, 16) == 2.0
    # Every weight under DP: half the site a step, six passes (BC5CDR's best).
    assert steps_per_epoch("none") == 2 and dp_batch_size(1520, steps_per_epoch("none")) == 760
    assert dp_local_epochs("none") == 6 and dp_local_epochs("bias") == 3
    assert steps_per_epoch("bias") == steps_per_epoch("lora") == 16


@pytest.fixture
def trained(monkeypatch):
    """What each DP-SGD training was given: its batch and encoder rate."""
    seen = []
    real = client.make_private

    def spy(model, optimizer, units, row_lengths, dp, batch_size, *args, **kwargs):
        seen.append((len(units), batch_size, optimizer.param_groups[0]["lr"]))
        return real(model, optimizer, units, row_lengths, dp, batch_size, *args, **kwargs)

    monkeypatch.setattr(client, "make_private", spy)
    return seen


@pytest.mark.parametrize("adapter", ["none", "bias"])
def test_a_private_site_trains_and_accounts_at_its_derived_batch(
    tmp_path, trained, tiny_run, adapter
):
    tiny_run(noise_multiplier=5.0, adapter=adapter, local_epochs=1)
    base = I2b2Task.defaults | (I2b2Task.dp_rates if adapter == "none" else {"lr": 1e-3})
    policy = json.loads((tmp_path / "run" / "privacy" / "policy.json").read_text())
    assert len(trained) == len(policy["sites"]) == 3
    expected = []
    for described in policy["sites"].values():
        units = described["examples"]
        batch = dp_batch_size(units, steps_per_epoch(adapter))
        scale = math.sqrt(batch / base["batch_size"])
        assert (described["batch_size"], described["lr_scale"]) == (batch, pytest.approx(scale))
        assert described["sample_rate"] == pytest.approx(batch / units)
        expected.append((batch, pytest.approx(base["lr"] * scale)))
    # Each site's training ran at the batch and rate its policy describes.
    assert sorted((batch, lr) for _, batch, lr in trained) == sorted(expected, key=lambda e: e[0])


def test_a_given_batch_size_is_used_as_is(tmp_path, trained, tiny_run):
    tiny_run(noise_multiplier=5.0, batch_size=8, lr=3e-4)
    policy = json.loads((tmp_path / "run" / "privacy" / "policy.json").read_text())
    assert [(b, lr) for _, b, lr in trained] == [(8, pytest.approx(3e-4))] * 3
    assert all(
        site["batch_size"] == 8 and site["lr_scale"] == 1.0 for site in policy["sites"].values()
    )


def test_a_private_run_takes_the_recipes_epochs_and_schedule_unless_given(
    tmp_path, tiny_run, monkeypatch
):
    from clinfed.core.runs import read_jsonl
    from clinfed.privacy.recipe import DP_LR_DECAY

    schedules = []
    real = client.decay_rates

    def spy(optimizer, settings, round_number, steps):
        schedules.append(settings.lr_decay)
        return real(optimizer, settings, round_number, steps)

    monkeypatch.setattr(client, "decay_rates", spy)

    def steps(run) -> list[int]:
        return [line["steps"] for line in read_jsonl(run / "privacy" / "beth.jsonl")
                if line.get("mechanism") == "dp-sgd"]  # fmt: skip

    # replace-one: both runs' steps derive from the same exact count.
    tiny_run(
        out=tmp_path / "recipe", noise_multiplier=5.0, batch_size=32, neighbours="replace-one",
        local_epochs=None,
    )  # fmt: skip
    assert schedules == [DP_LR_DECAY] * 3  # each site trains on the recipe's schedule
    tiny_run(
        out=tmp_path / "given", noise_multiplier=5.0, batch_size=32, local_epochs=1,
        neighbours="replace-one",
    )  # fmt: skip
    recorded = json.loads((tmp_path / "recipe" / "config.json").read_text())
    # Every weight under DP (the default plan): six passes.
    assert recorded["training"]["local_epochs"] == WHOLE_MODEL_LOCAL_EPOCHS == 6
    assert recorded["training"]["lr_decay"] == DP_LR_DECAY == "none"  # constant under DP
    # Accounted (and trained) for six passes: six times the steps of one.
    assert steps(tmp_path / "recipe") == [6 * s for s in steps(tmp_path / "given")]
    plain = tiny_run(out=tmp_path / "plain", local_epochs=None)
    assert plain["f1"] is not None
    assert (
        json.loads((tmp_path / "plain" / "config.json").read_text())["training"]["local_epochs"]
        == 1
    )


def test_only_a_target_epsilon_gives_the_measured_private_plan(i2b2_corpus, tmp_path):
    """What a hospital gets from ``clinfed train --target-epsilon 8``: federated,
    add/remove, every weight at half a site's units a step, six passes, the
    task's private rates."""
    from .test_cli import run_cli

    out = tmp_path / "run"
    done = run_cli(
        "train", "--data", str(i2b2_corpus), "--model", "tiny", "--target-epsilon", "8",
        "--rounds", "1", "--max-length", "32", "--threads", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["federation"]["strategy"] == "fedavg"
    assert config["privacy"]["neighbours"] == "add-remove"
    assert config["model"]["adapter"] == "none"
    assert config["training"]["local_epochs"] == 6
    assert config["training"]["lr"] == I2b2Task.dp_rates["lr"]
    assert config["training"]["head_lr"] == I2b2Task.dp_rates["head_lr"]
    policy = json.loads((out / "privacy" / "policy.json").read_text())
    assert policy["relation"] == "add-remove"
    for site in policy["sites"].values():
        assert site["batch_size"] == dp_batch_size(site["examples"], 2)


def test_icd_coding_under_dp_trains_its_measured_plan_unless_told_otherwise():
    """ICD coding's private default is the head alone (measured over every
    weight); a given --adapter wins, and without DP every weight trains."""
    from clinfed.settings import RunConfig
    from clinfed.tasks.mimic3.adapter import Mimic3Task

    private = RunConfig.of(task="mimic3", strategy="fedavg", target_epsilon=8.0).resolved()
    assert Mimic3Task.dp_adapter == "head"
    assert private.adapter == "head"
    assert private.local_epochs == dp_local_epochs("head")
    told = RunConfig.of(task="mimic3", strategy="fedavg", target_epsilon=8.0, adapter="none")
    assert told.resolved().adapter == "none"
    assert told.resolved().local_epochs == WHOLE_MODEL_LOCAL_EPOCHS
    assert RunConfig.of(task="mimic3", strategy="fedavg").resolved().adapter == "none"
    # Strategies that choose what trains (their prompts, encoder layers) keep
    # their own plan.
    for strategy in ("pfeddc", "safl", "fedfrozen", "safl+fedfrozen"):
        chosen = RunConfig.of(task="mimic3", strategy=strategy, target_epsilon=8.0).resolved()
        assert chosen.adapter == "none", strategy
    # Concept extraction's private plan stays every weight.
    assert RunConfig.of(task="i2b2", strategy="fedavg", target_epsilon=8.0).resolved().adapter == (
        "none"
    )
