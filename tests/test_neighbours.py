"""--neighbours add-remove: a site releases its unit count once, under
accounted noise, derives everything from it, and is accounted under
add/remove neighbours (less epsilon at the same noise)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clinfed.core.runs import read_jsonl
from clinfed.privacy.count import COUNT_MECHANISM, count_path, kept_count
from clinfed.privacy.errors import PrivacyError
from clinfed.privacy.sampler import PoissonSampler


def _charges(run, site):
    return [line for line in read_jsonl(run / "sites" / site / "privacy" / f"{site}.jsonl")
            if "mechanism" in line]  # fmt: skip


def test_add_remove_releases_one_noisy_count_and_costs_less_at_equal_noise(tiny_run, tmp_path):
    # The bias plan: what is released and charged does not depend on what
    # trains, and it keeps the two runs short.
    private = {"noise_multiplier": 1.0, "rounds": 2, "reproducible_noise": True, "adapter": "bias"}
    before = tiny_run(out=tmp_path / "replace", neighbours="replace-one", **private)
    after = tiny_run(out=tmp_path / "add", neighbours="add-remove", **private)
    # The same noise on every step costs less epsilon at every site.
    assert set(after["epsilon"]) == set(before["epsilon"])
    assert all(after["epsilon"][s] < before["epsilon"][s] for s in before["epsilon"])

    run = tmp_path / "add"
    records = [r for r in read_jsonl(run / "metrics.jsonl") if "examples" in r]
    exact = {r["site"]: r["examples"] for r in read_jsonl(tmp_path / "replace" / "metrics.jsonl")
             if "examples" in r}  # fmt: skip
    for site in before["epsilon"]:
        charges = _charges(run, site)
        assert {line["relation"] for line in charges} == {"add-remove"}
        counts = [line for line in charges if line["mechanism"] == COUNT_MECHANISM]
        assert [line["round"] for line in counts] == [0]  # released once, before round 1
        released = kept_count(count_path(run / "sites" / site / "privacy" / f"{site}.jsonl"))
        # What the site sent as its weight is the released count, never the exact one.
        assert {r["examples"] for r in records if r["site"] == site} == {released}
        sgd = [line for line in charges if line["mechanism"] == "dp-sgd"]
        assert all(line["sample_rate"] == pytest.approx(64 / released) or released < 64
                   for line in sgd)  # fmt: skip
    kept = {s: kept_count(count_path(run / "sites" / s / "privacy" / f"{s}.jsonl")) for s in exact}
    assert any(kept[s] != exact[s] for s in exact)
    policy = json.loads((run / "privacy" / "policy.json").read_text())
    assert policy["relation"] == "add-remove"


def test_a_calibrated_add_remove_run_needs_less_noise(tiny_config, tmp_path):
    import tempfile
    from pathlib import Path

    from clinfed.core.errors import ProblemLog
    from clinfed.federated.site_policy import privacy_policy
    from clinfed.modeling.models import load_tokenizer
    from clinfed.runners.factories import make_strategy, make_task

    def sigma(relation: str) -> float:
        config = tiny_config(target_epsilon=8, rounds=3, neighbours=relation).resolved()
        with tempfile.TemporaryDirectory() as cache:
            task = make_task(config, cache)
            corpus = task.load(Path(config.data), ProblemLog())
            tokenizer = load_tokenizer("tiny")
            train = task.encode(corpus.train, tokenizer, 32, cache)
            strategy = make_strategy(config, task, tokenizer, cache)
            policy = privacy_policy(config, task, {"one": train}, tmp_path / relation, strategy)
        assert policy.planned_epsilon("one") <= 8.0  # the count's release included
        return policy.noise["one"]

    assert sigma("add-remove") < sigma("replace-one")


def test_a_kept_count_is_released_again_after_a_restart(tiny_config, tmp_path):
    from clinfed.federated.site_policy import released_count
    from clinfed.privacy.count import keep_count

    config = tiny_config(noise_multiplier=1.0, neighbours="add-remove")
    kept_at = count_path(tmp_path / "beth.jsonl")
    assert keep_count(kept_at, 117) == 117
    assert released_count(config, "beth", 100, kept_at) == 117  # never a second draw
    assert keep_count(kept_at, 90) == 117  # a kept count is never replaced
    assert kept_count(kept_at) == 117


def test_the_sampling_rate_derives_from_the_released_count():
    sampler = PoissonSampler(100, 10, np.random.default_rng(0), population=125)
    assert sampler.rate == pytest.approx(10 / 125) and sampler.steps_per_epoch == 12
    assert PoissonSampler(100, 10, np.random.default_rng(0)).rate == pytest.approx(0.1)


def test_a_ledger_charged_under_one_relation_refuses_the_other(tiny_run, tiny_config, tmp_path):
    from clinfed.privacy.policy import PrivacyPolicy

    tiny_run(out=tmp_path / "run", noise_multiplier=1.0, neighbours="replace-one")
    folder = tmp_path / "run" / "sites" / "beth" / "privacy"
    policy = PrivacyPolicy.build(
        folder, {"beth": 120}, None, 1, 1, 1e-5, None, 1.0, relation="add-remove"
    )
    with pytest.raises(PrivacyError, match="accounts under replace-one"):
        policy.ledger("beth")


def test_a_replayed_round_under_add_remove_is_charged_once(tmp_path):
    # A node re-sends round 2's kept update (a lost reply): the count was
    # released with round 1, so the replay's charge matches round 2's and
    # is reused, never a second line.
    from clinfed.privacy.policy import PrivacyPolicy
    from clinfed.privacy.site import SitePrivacy

    policy = PrivacyPolicy.build(
        tmp_path, {"beth": 120}, None, 1, 3, 1e-5, None, 1.0, relation="add-remove"
    )
    privacy = SitePrivacy(policy, "beth")

    def update(dp):
        return {}, {"round": 0, "site": "beth"}

    privacy.run(1, update)
    privacy.release(1)
    privacy.run(2, update)  # charged, its reply lost before the release line
    before = len(privacy.ledger.lines)
    privacy.resend(2)
    assert len(privacy.ledger.lines) == before
    assert [line["mechanism"] for line in privacy.ledger.lines].count(COUNT_MECHANISM) == 1
