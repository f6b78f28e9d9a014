"""What a server (or anyone holding a run folder) can learn by probing a
site, tried as an attacker would: with the node's own classes, tiny models.
Each test here failed on the code before its guard was added."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from clinfed.core.errors import ClinfedError
from clinfed.core.runs import read_jsonl
from clinfed.flower.deploy import flower_run_config
from clinfed.privacy.count import COUNT_MECHANISM, COUNT_NOISE, count_mechanism, noisy_count
from clinfed.privacy.dpsgd import make_private
from clinfed.privacy.policy import PrivacyPolicy
from clinfed.privacy.randomness import secret
from clinfed.privacy.sampler import PoissonSampler
from clinfed.privacy.site import SitePrivacy
from clinfed.runners.node import NodeConfig, NodeSite
from clinfed.settings import RunConfig

# One local epoch: these probe what leaves a site, not what training reaches.
BASE = {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32, "local_epochs": 1}


def _run(tmp_path, **settings) -> RunConfig:
    return flower_run_config(BASE | settings, tmp_path / "run")


def _node(i2b2_corpus, tmp_path, **options) -> NodeConfig:
    return NodeConfig(
        i2b2_corpus, tmp_path / "state", **({"site": "beth", "max_epsilon": 50.0} | options)
    )


def _exact_units(i2b2_corpus, tmp_path) -> int:
    site = NodeSite(_run(tmp_path, target_epsilon=8.0), _node(i2b2_corpus, tmp_path / "exact"), "n")
    try:
        return site.runner.privacy.policy.sizes["beth"]  # replace-one: the exact count
    finally:
        site.close()


# ------------------------------------------------------- paths the server names
@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("gazetteer", "{data}/train/beth/txt"),  # the site's own notes as "names"
        ("gazetteer", "{data}/no/such/folder"),
        ("public_data", "{data}"),
        ("data", "{data}"),
        ("cache_dir", "{data}/cache"),
        ("audit_holdout", 0.1),
        ("types", "{data}/types.toml"),
        ("public_types", "{data}/types.toml"),
    ],
)
def test_a_node_refuses_every_setting_that_names_a_path_without_looking_at_it(
    i2b2_corpus, tmp_path, setting, value
):
    # A raw run config, as a server that skips clinfed's own checks sends it.
    raw = _run(tmp_path, target_epsilon=8.0)
    if isinstance(value, str):
        value = value.format(data=i2b2_corpus)
    raw = raw.replace(**{setting: value})
    with pytest.raises(ClinfedError) as refused:
        NodeSite(raw, _node(i2b2_corpus, tmp_path), "run")
    said = str(refused.value)
    assert setting in said and "refused" in said
    assert str(i2b2_corpus) not in said  # nothing of the path, whether it exists or not
    assert not (tmp_path / "state").exists()  # refused before anything was read or built


def test_the_same_refusal_whether_a_server_named_path_exists_or_not(i2b2_corpus, tmp_path):
    said = set()
    for path in (i2b2_corpus / "train" / "beth" / "txt", tmp_path / "missing"):
        raw = _run(tmp_path, target_epsilon=8.0).replace(gazetteer=str(path))
        with pytest.raises(ClinfedError) as refused:
            NodeSite(raw, _node(i2b2_corpus, tmp_path), "run")
        said.add(str(refused.value))
    assert len(said) == 1


def test_a_node_never_opens_the_server_s_own_paths(i2b2_corpus, tmp_path):
    # The run folder and the public check are the server's: a node drops
    # them unread, so naming a missing folder tells the server nothing.
    raw = _run(tmp_path, target_epsilon=8.0).replace(
        public_check=str(tmp_path / "no-such-folder"), out=str(tmp_path / "elsewhere")
    )
    site = NodeSite(raw, _node(i2b2_corpus, tmp_path), "run")
    site.close()
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("key", ["allow-no-dp", "share-ledger", "require-secure-aggregation"])
def test_node_booleans_are_read_strictly(tmp_path, key):
    base = {"data": str(tmp_path), "state": str(tmp_path / "state")}
    name = key.replace("-", "_")
    assert getattr(NodeConfig.parse(base | {key: "false"}), name) is False
    assert getattr(NodeConfig.parse(base | {key: "False"}), name) is False
    assert getattr(NodeConfig.parse(base | {key: "0"}), name) is False
    assert getattr(NodeConfig.parse(base | {key: "true"}), name) is True
    assert getattr(NodeConfig.parse(base | {key: True}), name) is True
    for unclear in ("no", "", " "):  # an empty value is no default: it says neither
        with pytest.raises(ClinfedError, match=f"{key} must be true or false"):
            NodeConfig.parse(base | {key: unclear})


# ---------------------------------------------- exact counts under add/remove
def test_every_message_carries_the_same_noisy_count_charged_once(i2b2_corpus, tmp_path):
    exact = _exact_units(i2b2_corpus, tmp_path)
    config = _run(tmp_path, target_epsilon=8.0, neighbours="add-remove")
    seen = []
    for probe in range(8):  # eight evaluate-only messages, each a new run name
        site = NodeSite(config, _node(i2b2_corpus, tmp_path), f"probe-{probe}")
        try:
            report = site.runner.privacy.report()  # what every reply carries
            seen.append(report["site"]["examples"])
            assert all(line["mechanism"] == COUNT_MECHANISM for line in report["lines"])
        finally:
            site.close()
    assert len(set(seen)) == 1, seen  # one draw per dataset: nothing to average
    (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
    counts = [line for line in read_jsonl(ledger) if line.get("mechanism") == COUNT_MECHANISM]
    assert len(counts) == 1 and counts[0]["run"] == "probe-0"  # charged once, before any reply
    kept = json.loads(ledger.with_name(ledger.stem + ".count.json").read_text())
    assert kept["released_units"] == seen[0]
    assert exact > 0


def test_a_delta_refusal_states_no_count_and_follows_the_released_one(i2b2_corpus, tmp_path):
    exact = _exact_units(i2b2_corpus, tmp_path)
    config = _run(tmp_path, target_epsilon=8.0, neighbours="add-remove")
    site = NodeSite(config, _node(i2b2_corpus, tmp_path), "first")
    released = site.runner.privacy.policy.sizes["beth"]
    site.close()
    for delta in (0.5, 1 / (10 * exact), 1 / (10 * min(exact, released)) * 1.01):
        try:
            NodeSite(config.replace(delta=delta), _node(i2b2_corpus, tmp_path), "probe").close()
            refused = None
        except ClinfedError as err:
            refused = str(err)
        # The cap follows the released count, never the exact one ...
        assert (refused is None) == (delta <= 1 / (10 * released))
        # ... and no refusal says a count, or a cap derived from one.
        if refused is not None:
            # (The delta the run asked for is the server's own setting; its
            # digits may hold a count's by chance, as 0.000716312 holds 163.)
            said = refused.replace(f"{delta:g}", "<delta>")
            assert str(exact) not in said and str(released) not in said
            assert "1/(10 n)" in refused


def test_safl_private_selection_releases_no_count(i2b2_corpus, tmp_path):
    exact = _exact_units(i2b2_corpus, tmp_path)
    config = _run(
        tmp_path, target_epsilon=8.0, neighbours="add-remove", strategy="safl", rounds=1,
        top_layers=1, selection="private", profile_examples=4 * exact,
    )  # fmt: skip
    site = NodeSite(config, _node(i2b2_corpus, tmp_path), "safl")
    try:
        _, record = site.runner.train_round(1, {})
    finally:
        site.close()
    mechanism = record["selection_mechanism"]
    # Fewer units than a profile takes: every one is profiled, and nothing
    # in the record is their number (the divisor is the public setting).
    assert "sample_size" not in mechanism and exact not in mechanism.values()
    assert mechanism["profile_units"] == 4 * exact
    assert record["examples"] == site.runner.privacy.policy.sizes["beth"]


# -------------------------------------------- the noise is the noise charged
def test_the_noise_added_has_the_std_the_ledger_line_charges(tmp_path):
    n, batch, clip = 1000, 50, 0.5
    policy = PrivacyPolicy.build(tmp_path, {"beth": n}, batch, 1, 1, 1e-5, 4.0, None, clip)
    site = SitePrivacy(policy, "beth")
    model = nn.Linear(64, 64)  # 4,160 numbers: the std is read to about 1%

    def update(dp):
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        units = [np.array([i]) for i in range(n)]
        _, step = make_private(
            model, optimizer, units, np.ones(n, int), dp, batch, secret()
        )  # fmt: skip
        before = [p.detach().clone() for p in model.parameters()]
        step.zero_grad()
        # Zero gradients: whatever moves the weights is the noise alone.
        losses = (model(torch.randn(8, 64)) * 0.0).sum(dim=1)
        step.backward(losses, None, last=True)
        step.step()
        step.detach()
        moved = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
        return {}, {"round": 1, "site": "beth", "moved_std": float(moved.std())}

    _, record = site.run(1, update)
    (line,) = [x for x in site.ledger.lines if x["mechanism"] == "dp-sgd"]
    # Opacus adds N(0, (sigma C)^2) to the clipped sum, then takes its mean
    # over the expected batch: the step moves each weight by that / batch.
    charged = line["noise_multiplier"] * clip / batch
    assert record["moved_std"] == pytest.approx(charged, rel=0.05)


def test_poisson_batches_have_a_binomial_size_and_can_be_empty():
    # Fixed-size draws would pass a mean check; the spread and the empty
    # batches are what subsampling's amplification needs.
    n, batch, draws = 400, 20, 4000
    sampler = PoissonSampler(n, batch, np.random.default_rng(7))
    sizes = np.array([len(sampler.draw()) for _ in range(draws)])
    q = batch / n
    assert sizes.mean() == pytest.approx(q * n, rel=0.02)
    assert sizes.var() == pytest.approx(q * (1 - q) * n, rel=0.1)
    small = PoissonSampler(20, 1, np.random.default_rng(8))
    empty = np.mean([len(small.draw()) == 0 for _ in range(draws)])
    assert empty == pytest.approx((1 - 1 / 20) ** 20, abs=0.03)


def test_the_released_count_has_the_std_the_ledger_charges():
    generator = torch.Generator().manual_seed(3)
    draws = np.array([noisy_count(10_000, generator) for _ in range(3000)]) - 10_000
    charged = count_mechanism()
    assert charged.noise_multiplier * 1.0 == COUNT_NOISE  # sensitivity 1 unit
    assert draws.std() == pytest.approx(COUNT_NOISE, rel=0.05)
    assert abs(draws.mean()) < 4 * COUNT_NOISE / math.sqrt(len(draws))


# ----------------------------------------------- public inputs are public
@pytest.mark.parametrize("kind", ["inside", "contains", "same-bytes"])
def test_a_public_folder_that_is_private_data_is_refused(i2b2_corpus, tmp_path, kind):
    from tests.test_cli import run_cli

    if kind == "inside":
        public = i2b2_corpus / "train"
    elif kind == "contains":
        public = i2b2_corpus.parent
    else:
        public = tmp_path / "public"
        shutil.copytree(i2b2_corpus / "train" / "beth", public / "train" / "beth")
    for flag in ("--public-check", "--gazetteer"):
        result = run_cli(
            "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
            "--strategy", "fedavg", "--rounds", "1", flag, str(public),
            "--out", str(tmp_path / "run"),
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and "private data" in result.stderr
        assert not (tmp_path / "run").exists()


def test_a_warm_start_reads_nothing_private(i2b2_corpus, public_i2b2, tmp_path):
    from tests.test_cli import run_cli

    # --data is only what the public text must not be: unreadable, it is
    # still not read (the label set comes from the task's declaration).
    result = run_cli(
        "warm-start", "--task", "i2b2", "--model", "tiny", "--max-length", "32",
        "--public-data", str(public_i2b2), "--out", str(tmp_path / "start"), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    refused = run_cli(
        "warm-start", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--public-data", str(i2b2_corpus / "train"), "--out", str(tmp_path / "again"),
    )  # fmt: skip
    assert refused.returncode == 2 and "private data" in refused.stderr


def test_the_report_s_first_screen_says_held_out_units_are_outside_epsilon(tiny_run, tmp_path):
    from clinfed.reporting.report import write_report

    out = tmp_path / "run"
    tiny_run(
        out=out, noise_multiplier=1.0, rounds=2, neighbours="add-remove", adapter="bias",
        reproducible_noise=True,
    )  # fmt: skip
    page = (write_report(out) / "report.md").read_text()
    verdict = page.split("## Verdict", 1)[1].split("\n## ", 1)[0]
    assert "Held-out notes are outside epsilon" in verdict
    assert "beth 2" in verdict  # a query per global round, counted per site
    weight = next(line for line in page.splitlines() if line.startswith("| its weight"))
    assert "noisy count" in weight and "released exactly" not in weight
