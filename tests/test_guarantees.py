"""What one privacy unit may move, and what a site releases about its size.

Each test here fails when its guard is removed (the closing notes list the
mutation tried for each)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from scipy.stats import norm

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.runs import read_jsonl
from clinfed.federated.engine import Reply
from clinfed.federated.replies import MAX_UNITS, check_record
from clinfed.modeling.models import load_tokenizer
from clinfed.privacy.accountants import ACCOUNTANTS, Mechanism
from clinfed.runners.pipeline import RunConfig
from clinfed.tasks.i2b2.adapter import I2b2Task

# Site a annotates chemicals in one sentence only; site b annotates both.
SENTENCES_A = [
    "Aspirin\tB-Chemical\neased\tO\nthe\tO\nmigraine\tB-Disease\n.\tO\n",
    "Rest\tO\neased\tO\nthe\tO\nheadache\tB-Disease\n.\tO\n",
    "The\tO\nfever\tB-Disease\npersisted\tO\n.\tO\n",
    "No\tO\nnausea\tB-Disease\ntoday\tO\n.\tO\n",
]
SITE_B = "Ibuprofen\tB-Chemical\neased\tO\nthe\tO\nheadache\tB-Disease\n.\tO\n"


def _conll(tmp_path: Path, name: str, first: str) -> Path:
    data = tmp_path / name
    for split in ("train", "test"):
        for site, text in (("a", "\n".join([first, *SENTENCES_A[1:]])), ("b", SITE_B * 2)):
            path = data / split / site / f"{site}.conll"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
    return data


def _targets(task: I2b2Task, data: Path, tmp_path: Path) -> list[tuple]:
    """Per training row: (site, line, labels, what its O tokens may be)."""
    corpus = task.load(data, ProblemLog())
    rows = task.encode(corpus.train, load_tokenizer("tiny"), 32, str(tmp_path / "cache"))
    return [
        (r["site"], r["doc"], r["line"], tuple(r["labels"]), tuple(r["outside_may_be"]))
        for r in rows
    ]


def test_one_annotation_moves_only_its_own_sentence_under_dp(tmp_path):
    # Two datasets that differ in one annotation of one sentence: site a's
    # only Chemical mention is there or not.
    with_it = _conll(tmp_path, "with", SENTENCES_A[0])
    without = _conll(tmp_path, "without", SENTENCES_A[0].replace("B-Chemical", "O"))
    types = "Disease,Chemical"

    def differing(private: bool) -> list[tuple]:
        one = _targets(I2b2Task(types=types, private=private), with_it, tmp_path)
        two = _targets(I2b2Task(types=types, private=private), without, tmp_path)
        assert len(one) == len(two)
        return [a[:3] for a, b in zip(one, two) if a != b]

    # Without DP the site's type set comes from its data: every sentence of
    # site a changes its loss target (the hole a privacy unit must not have).
    assert len(differing(private=False)) == len(SENTENCES_A)
    # Under DP only the changed sentence itself differs.
    moved = differing(private=True)
    assert len(moved) == 1 and moved[0][0] == "a"


def test_declared_annotated_types_open_partial_labels_under_dp(tmp_path):
    data = _conll(tmp_path, "data", SENTENCES_A[0].replace("B-Chemical", "O"))
    task = I2b2Task(types="Disease,Chemical", private=True, annotated_types="a=Disease")
    task.load(data, ProblemLog())
    assert task.site_types == {"a": {"Disease"}}  # b declared nothing: plain O
    chemical = [task.labels.index("B-Chemical"), task.labels.index("I-Chemical")]
    assert task._open_labels() == {"a": chemical}
    with pytest.raises(ClinfedError, match="not a type of this run"):
        I2b2Task(types="Disease,Chemical", private=True, annotated_types="a=Drug").load(
            data, ProblemLog()
        )


def test_dp_refuses_entity_types_read_from_the_data(tmp_path):
    data = _conll(tmp_path, "data", SENTENCES_A[0])
    with pytest.raises(ClinfedError, match="must be declared with `types`"):
        I2b2Task(private=True).load(data, ProblemLog())
    I2b2Task(private=False).load(data, ProblemLog())  # without DP they may


def _gaussian_epsilon(sigma: float, sensitivity: float, delta: float) -> float:
    """Epsilon of one Gaussian mechanism by the exact condition (Balle and
    Wang 2018, Theorem 8), solved by bisection: the brute-force reference."""
    ratio = sensitivity / sigma

    def delta_at(eps: float) -> float:
        return norm.cdf(ratio / 2 - eps / ratio) - math.exp(eps) * norm.cdf(
            -ratio / 2 - eps / ratio
        )

    low, high = 0.0, 100.0
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if delta_at(mid) > delta else (low, mid)
    return high


def test_safl_private_selection_is_charged_at_its_tight_sensitivity():
    from clinfed.federated.strategies.safl import SAFL, SAFLOptions

    layers, noise, delta = 4, 3.0, 1e-5
    # Brute force over the box's corners: the largest L2 distance between two
    # per-unit score vectors in [0, 1]^L (replace-one), and the largest norm
    # of one (add/remove), are both sqrt(L).
    corners = torch.cartesian_prod(*[torch.tensor([0.0, 1.0])] * layers)
    replace = torch.cdist(corners, corners).max().item()
    add_remove = corners.norm(dim=1).max().item()
    assert replace == pytest.approx(math.sqrt(layers)) == add_remove
    sigma = noise * math.sqrt(layers)  # what SAFL.select adds
    exact = _gaussian_epsilon(sigma, replace, delta)
    strategy = SAFL(SAFLOptions(selection="private", selection_noise=noise), None, 0)
    mechanism = strategy.selection_mechanism()
    for relation in ("replace-one", "add-remove"):
        charged = ACCOUNTANTS["pld"](relation).epsilon([mechanism], delta)
        assert exact <= charged <= exact * 1.01 + 1e-3
    # A clipped-gradient sum under replace-one is twice as sensitive.
    sgd = Mechanism("dp-sgd", noise, 1.0, 1)
    assert ACCOUNTANTS["pld"]("replace-one").epsilon([sgd], delta) == pytest.approx(
        _gaussian_epsilon(noise, 2.0, delta), rel=0.01
    )


def _count_sentences(data: Path) -> dict[str, int]:
    task = I2b2Task()
    corpus = task.load(data, ProblemLog())
    counts: dict[str, int] = {}
    for doc in corpus.train:
        counts[doc.site] = counts.get(doc.site, 0) + len(doc.lines)
    return counts


@pytest.mark.parametrize("target_epsilon", [None, 8.0])
def test_a_site_weighs_its_update_by_units_whatever_the_window(
    i2b2_corpus, tmp_path, tiny_run, target_epsilon
):
    sentences = _count_sentences(i2b2_corpus)
    released = {}
    for max_length in (8, 64):
        out = tmp_path / f"run-{max_length}"
        # The bias plan keeps the runs short; the weight is the same for any plan.
        tiny_run(
            out, max_length=max_length, target_epsilon=target_epsilon, adapter="bias",
            neighbours="replace-one",  # the exact count is the weight released
        )  # fmt: skip
        records = [r for r in read_jsonl(out / "metrics.jsonl") if "bytes_up" in r]
        released[max_length] = {r["site"]: r["examples"] for r in records}
    # Windows of 8 tokens cut many sentences into several rows; the weight
    # released is the number of sentences (privacy units) all the same.
    assert released[8] == released[64] == sentences


def test_the_server_bounds_a_site_s_claimed_weight():
    def reply(examples: int, declared: int | None = None) -> Reply:
        ledger = {"site": {"examples": declared}} if declared is not None else None
        return Reply(site="beth", record={"examples": examples}, ledger=ledger)

    assert check_record(reply(100)) is None
    assert check_record(reply(100, declared=100)) is None
    assert "above" in check_record(reply(MAX_UNITS + 1))
    assert "privacy policy counts 100" in check_record(reply(10_000, declared=100))
    assert "positive" in check_record(reply(0))


def test_the_held_out_split_is_the_site_s_never_the_run_seed(tmp_path):
    from clinfed.runners.factories import make_task
    from clinfed.tasks.i2b2.synth import generate

    data = tmp_path / "flat"
    generate(data, sites=2, docs=10, seed=2)
    flat = tmp_path / "one"
    for kind in ("txt", "concept"):
        (flat / kind).mkdir(parents=True)
        for path in (data / "train").rglob(f"{kind}/*"):
            (flat / kind / path.name).write_bytes(path.read_bytes())

    def held_out(**settings) -> set[str]:
        config = RunConfig.of(task="i2b2", data=str(flat), out=str(tmp_path / "x"), **settings)
        corpus = make_task(config, str(tmp_path / "cache")).load(flat, ProblemLog())
        return {d.doc_id for d in corpus.test}

    first = held_out(seed=0)
    assert first and all(held_out(seed=seed) == first for seed in range(1, 6))
    # The site's own key moves it (a node's split-key), and only that.
    moved = {d.doc_id for d in I2b2Task(split_key="other").load(flat, ProblemLog()).test}
    assert moved != first


def test_one_evaluation_meter_per_dataset_caps_evaluations_across_runs(tmp_path):
    from clinfed.federated.client import LocalSettings
    from clinfed.federated.site import SiteRunner
    from clinfed.federated.strategies.fedavg import FedAvg

    model = torch.nn.Linear(2, 2)
    meter = tmp_path / "node" / "beth.evaluations.json"

    def runner(run: str) -> SiteRunner:
        return SiteRunner(
            "beth", I2b2Task(), model, {}, FedAvg(), [], [], [], LocalSettings(), 0,
            tmp_path / run, meter_path=meter, max_evaluations=3, run_name=run,
        )  # fmt: skip

    # Runs under new names never reset the dataset's count.
    assert runner("a")._meter(1) and runner("a")._meter(2)
    assert runner("b")._meter(1)
    assert not runner("c")._meter(1)
    assert not runner("a")._meter(3)
    # Within a run: the same weights again are free (nothing new), other
    # weights as an evaluated round are refused.
    assert runner("a")._meter(2)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not runner("a")._meter(2)


def _node_site(i2b2_corpus, tmp_path, node_options=None, **settings):
    from clinfed.flower.deploy import flower_run_config
    from clinfed.runners.node import NodeConfig, NodeSite

    # One local epoch: these check what a node does, not what training reaches.
    base = {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32}
    config = flower_run_config(base | {"local_epochs": 1} | settings, tmp_path / "run")
    options = {"site": "beth", "max_epsilon": 10.0} | (node_options or {})
    return NodeSite(config, NodeConfig(i2b2_corpus, tmp_path / "state", **options), "run")


def test_a_node_trains_only_the_model_its_own_config_pins(i2b2_corpus, tmp_path):
    from clinfed.core.provenance import data_fingerprint
    from clinfed.modeling.models import checkpoint_dir

    # The server names a folder at the node (a local checkpoint trained
    # without DP, say): refused, without saying whether it exists.
    for folder in (str(checkpoint_dir("tiny")), str(tmp_path / "nowhere")):
        with pytest.raises(ClinfedError) as refused:
            _node_site(i2b2_corpus, tmp_path, model=folder, target_epsilon=8.0)
        assert "model folder" in str(refused.value) and folder not in str(refused.value)
    # A folder the node config pins by SHA-256 is used, whatever the run names.
    pinned = str(checkpoint_dir("minilm"))
    digest = data_fingerprint(Path(pinned))
    with pytest.raises(ClinfedError, match="does not match its model-sha256"):
        _node_site(
            i2b2_corpus, tmp_path, {"model": pinned, "model_sha256": "0" * 64},
            model="/server/path", target_epsilon=8.0,
        )  # fmt: skip
    with pytest.raises(ClinfedError, match="trains only the model its node config names"):
        _node_site(i2b2_corpus, tmp_path, {"model": "minilm"}, target_epsilon=8.0)
    # A --types file the server names is never read at the node.
    with pytest.raises(ClinfedError, match="reads no file a server names"):
        _node_site(i2b2_corpus, tmp_path, types="/etc/clinfed-types.toml", target_epsilon=8.0)
    assert len(digest) == 64


def test_a_site_trains_nothing_the_server_did_not_name_by_digest(i2b2_corpus, tmp_path):
    from clinfed.federated.engine import Message

    site = _node_site(i2b2_corpus, tmp_path, target_epsilon=8.0)
    try:
        message = Message("train", 1, {}, full=False, evaluate=False, base=0, expect=None)
        reply = site.runner.handle(message)
        assert reply.record is None and reply.upload == {}
        # Nothing trained, nothing charged (under add/remove the noisy count
        # is charged once, on the node's first message: every reply carries it).
        (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
        assert {x.get("mechanism") for x in read_jsonl(ledger) if "mechanism" in x} == {
            "unit-count"
        }
    finally:
        site.close()


def test_a_refusal_tells_the_server_no_path_at_the_site():
    from clinfed.flower.client import redact_paths

    error = ClinfedError("/srv/notes/beth/record-12.con:3: bad line; see ./state/ledger/x.jsonl")
    assert redact_paths(error) == "<path>:3: bad line; see <path>"


def _record_draws(monkeypatch) -> list:
    """Every Poisson batch DP-SGD draws, as index tuples, in order."""
    from clinfed.privacy.sampler import PoissonSampler

    draws: list = []
    original = PoissonSampler.draw

    def draw(self):
        idx = original(self)
        draws.append(tuple(idx.tolist()))
        return idx

    monkeypatch.setattr(PoissonSampler, "draw", draw)
    return draws


def test_poisson_batches_are_secret_never_the_public_stream(i2b2_corpus, tmp_path, monkeypatch):
    draws = _record_draws(monkeypatch)
    batches = []
    for attempt in ("a", "b"):
        # The same public settings (seed, round, site, model, data) twice.
        site = _node_site(i2b2_corpus, tmp_path / attempt, target_epsilon=8.0)
        try:
            draws.clear()
            _, record = site.runner.train_round(1, {})
            assert "refused" not in record and draws
            batches.append(list(draws))
        finally:
            site.close()
    assert batches[0] != batches[1]


def test_the_charge_is_on_disk_before_any_batch_is_drawn(i2b2_corpus, tmp_path, monkeypatch):
    from clinfed.privacy.sampler import PoissonSampler

    seen: list[int] = []
    original = PoissonSampler.draw

    def draw(self):
        (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
        seen.append(sum(1 for line in read_jsonl(ledger) if line.get("mechanism") == "dp-sgd"))
        return original(self)

    monkeypatch.setattr(PoissonSampler, "draw", draw)
    site = _node_site(i2b2_corpus, tmp_path, target_epsilon=8.0)
    try:
        site.runner.train_round(1, {})
    finally:
        site.close()
    assert seen and min(seen) == 1


def test_in_process_sites_release_before_the_round_is_written(tmp_path, monkeypatch, tiny_run):
    from clinfed.federated.engine import RoundEngine

    out = tmp_path / "run"
    written: list[tuple[str, int, bool]] = []
    original = RoundEngine._metrics

    def metrics(self, record):
        if "bytes_up" in record:
            lines = read_jsonl(
                out / "sites" / record["site"] / "privacy" / f"{record['site']}.jsonl"
            )
            released = any(x.get("released") and x["round"] == record["round"] for x in lines)
            written.append((record["site"], record["round"], released))
        return original(self, record)

    monkeypatch.setattr(RoundEngine, "_metrics", metrics)
    tiny_run(out, rounds=2, target_epsilon=8.0)
    assert len(written) == 6 and all(released for _, _, released in written)
    for site in {site for site, _, _ in written}:
        lines = read_jsonl(out / "sites" / site / "privacy" / f"{site}.jsonl")
        charged = {(x["round"], x["attempt"]) for x in lines if x.get("state") == "charged"}
        released = {(x["round"], x["attempt"]) for x in lines if x.get("released")}
        # Two rounds, and round 0: the noisy count, charged and released once.
        assert charged == released and sorted(r for r, _ in charged) == [0, 1, 2]


@pytest.mark.parametrize("target_epsilon", [None, 8.0])
def test_the_release_table_covers_every_field_a_site_sends(tmp_path, tiny_run, target_epsilon):
    from clinfed.reporting.report import build, record_row

    out = tmp_path / "run"
    tiny_run(out, strategy="safl", top_layers=1, selection="private", target_epsilon=target_epsilon)
    sent = set()
    for record in read_jsonl(out / "metrics.jsonl"):
        if "site" in record:
            sent |= set(record)
    assert sent and all(record_row(field) for field in sent), [
        field for field in sent if not record_row(field)
    ]
    table = [row[0] for row in build(out)["released"]]
    for field in sent:
        assert record_row(field) in table, field
    if target_epsilon is not None:
        kept = next(row for row in build(out)["released"] if "evaluation time" in row[0])
        assert kept[1] == "never under DP"


def test_the_audit_s_rank_auc_is_scikit_learn_s_auc_ties_included():
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from clinfed.runners.audit import rank_auc

    rng = np.random.default_rng(3)
    for size in (1, 7, 200):
        # Rounded scores: many ties, within and across the two groups.
        members = np.round(rng.normal(0.3, 1, size), 1)
        non_members = np.round(rng.normal(0, 1, size + 5), 1)
        labels = np.r_[np.ones(size), np.zeros(size + 5)]
        expected = roc_auc_score(labels, np.r_[members, non_members])
        assert rank_auc(members, non_members) == pytest.approx(expected, abs=1e-12)
    assert rank_auc(np.array([1.0, 2.0]), np.array([0.0, 0.5])) == 1.0
    assert rank_auc(np.array([0.0]), np.array([0.0])) == 0.5


def test_the_audit_interval_resamples_whole_units():
    import numpy as np

    from clinfed.runners.audit import auc_with_interval

    scores = np.random.default_rng(0)
    members, non_members = scores.normal(0.2, 1, 40), scores.normal(0, 1, 40)
    # Every unit as 10 identical rows (the windows of one long sentence).
    rows_m, rows_n = np.repeat(members, 10), np.repeat(non_members, 10)
    units_m, units_n = np.repeat(np.arange(40), 10), np.repeat(np.arange(40, 80), 10)

    def width(result):
        return result["ci_high"] - result["ci_low"]

    one_row_each = width(auc_with_interval(members, non_members, np.random.default_rng(1)))
    by_row = width(auc_with_interval(rows_m, rows_n, np.random.default_rng(1)))
    by_unit = width(
        auc_with_interval(
            rows_m,
            rows_n,
            np.random.default_rng(1),
            member_units=units_m,
            non_member_units=units_n,
        )  # fmt: skip
    )
    # Rows resampled one by one pretend to 10x the evidence; whole units
    # give exactly the interval of one row per unit (AUC does not change
    # when every score is repeated alike, and the draws are the same).
    assert by_row < 0.5 * one_row_each
    assert by_unit == pytest.approx(one_row_each, abs=1e-12)


def test_the_audit_copy_of_an_update_is_written_after_its_release(tmp_path, monkeypatch, tiny_run):
    import clinfed.federated.site as site_module

    out = tmp_path / "run"
    checked: list[bool] = []
    original = site_module.save_tensors

    def save_tensors(path, tensors):
        if path.parent.name == "updates":
            site = path.stem
            lines = read_jsonl(out / "sites" / site / "privacy" / f"{site}.jsonl")
            checked.append(any(x.get("released") for x in lines))
        return original(path, tensors)

    monkeypatch.setattr(site_module, "save_tensors", save_tensors)
    tiny_run(out, target_epsilon=8.0, audit_holdout=0.25)
    assert len(checked) == 3 and all(checked)


KILLER = """
import os, signal, sys
from clinfed.commands import main
from clinfed.federated.engine import RoundEngine
from clinfed.privacy.ledger import Ledger

stage, target = sys.argv[1], int(sys.argv[2])


def die():
    os.kill(os.getpid(), signal.SIGKILL)


charge, release, commit = Ledger.charge, Ledger.release, RoundEngine._commit


def charging(self, round_number, mechanisms):
    if round_number == target and stage == "before-charge":
        die()
    spent = charge(self, round_number, mechanisms)
    if round_number == target and stage == "after-charge":
        die()
    return spent


def releasing(self, round_number):
    release(self, round_number)
    if round_number == target and stage == "after-release":
        die()


def committing(self, round_number):
    if round_number == target and stage == "after-records":
        die()
    commit(self, round_number)
    if round_number == target and stage == "after-commit":
        die()


Ledger.charge, Ledger.release, RoundEngine._commit = charging, releasing, committing
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def uninterrupted(i2b2_corpus, tmp_path_factory):
    from .test_cli import run_cli

    out = tmp_path_factory.mktemp("whole") / "run"
    assert run_cli(*KILL_ARGS, "--data", str(i2b2_corpus), "--out", str(out)).returncode == 0
    return out


# A budget that affords exactly the 3 planned rounds: a round charged twice
# makes the sites refuse round 3. Reproducible noise (tests only) so the
# resumed run can be compared with the uninterrupted one bit for bit. The
# bias plan: charging and resuming do not depend on what trains, and one
# whole-model run spends 37 of its 55 s in per-example gradients (the
# embedding matrix's, with hooks clipping): 19 s with the bias plan.
KILL_ARGS = ("train", "--task", "i2b2", "--strategy", "fedavg", "--model", "tiny",
             "--adapter", "bias", "--rounds", "3", "--max-length", "32", "--threads", "1",
             "--target-epsilon", "4", "--reproducible-noise", "--local-epochs", "1")  # fmt: skip


# The stages where a charge and its release are at stake run by default;
# the two after the round's records (the commit's own) with -m slow.
@pytest.mark.parametrize(
    "stage",
    [
        "before-charge",
        "after-charge",
        "after-release",
        pytest.param("after-records", marks=pytest.mark.slow),
        pytest.param("after-commit", marks=pytest.mark.slow),
    ],
)
def test_a_dp_run_killed_at_any_stage_resumes_charging_each_round_once(
    i2b2_corpus, tmp_path, uninterrupted, stage
):
    import subprocess
    import sys

    from safetensors.torch import load_file

    from clinfed.reporting.report import build

    from .test_cli import run_cli

    out = tmp_path / "run"
    args = (*KILL_ARGS, "--data", str(i2b2_corpus), "--out", str(out))
    killed = subprocess.run([sys.executable, "-c", KILLER, stage, "2", *args],
                            capture_output=True, timeout=600)  # fmt: skip
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    # A report on the killed run says it is unfinished at the top (or, where
    # the records run ahead of what it can verify, refuses naming a file).
    from clinfed.core.errors import USER_ERRORS

    try:
        verdicts = build(out)["verdicts"]
    except USER_ERRORS as err:
        assert stage != "after-commit" and str(out) in str(err)
    else:
        assert verdicts[0].startswith("**UNFINISHED RUN.**")
    resumed = run_cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole = json.loads((uninterrupted / "summary.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    for site in ("beth", "partners", "site3"):
        lines = read_jsonl(out / "sites" / site / "privacy" / f"{site}.jsonl")
        assert [x["round"] for x in lines if x.get("mechanism") == "dp-sgd"] == [1, 2, 3]
    assert summary["epsilon"] == whole["epsilon"]

    def rounds(run):
        return [r["round"] for r in read_jsonl(run / "metrics.jsonl") if "site" not in r]

    assert rounds(out) == rounds(uninterrupted)
    ours = load_file(str(out / "model" / "model.safetensors"))
    theirs = load_file(str(uninterrupted / "model" / "model.safetensors"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)

    def reported(run):
        return [(row["site"], row["epsilon"]) for row in build(run)["sites"]]

    assert reported(out) == reported(uninterrupted)


def test_a_node_answers_a_replayed_round_with_the_same_bytes_and_no_charge(i2b2_corpus, tmp_path):
    from clinfed.core import payload
    from clinfed.federated.engine import Message
    from clinfed.modeling.adapters import shared_state

    def ask(round_number: int, expect: str):
        site = _node_site(i2b2_corpus, tmp_path, target_epsilon=8.0, rounds=3)
        try:
            message = Message("train", round_number, {}, False, False, base=0, expect=expect)
            return site.runner.handle(message)  # replies as a node does: released
        finally:
            site.close()

    site = _node_site(i2b2_corpus, tmp_path, target_epsilon=8.0, rounds=3)
    start = payload.digest(shared_state(site.runner.model))
    site.close()
    first = ask(1, start)
    # The ServerApp died after the node replied; the restarted server asks
    # again (a fresh process at the node builds the site anew).
    again = ask(1, start)
    assert payload.encode(first.upload) == payload.encode(again.upload) and first.upload
    assert again.record == first.record
    (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
    charges = [x for x in read_jsonl(ledger) if x.get("mechanism") == "dp-sgd"]
    assert [x["round"] for x in charges] == [1]
    kept = list((tmp_path / "state" / "run").glob("released.r*.safetensors"))
    assert kept and all(p.stat().st_mode & 0o777 == 0o600 for p in kept)


NODE_KILLER = """
import os, signal, sys
from pathlib import Path
from clinfed.modeling.adapters import shared_state
from clinfed.core import payload
from clinfed.federated.engine import Message
from clinfed.flower.deploy import flower_run_config
from clinfed.runners.node import NodeConfig, NodeSite
from clinfed.privacy.ledger import Ledger

data, tmp, stage = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
charge = Ledger.charge


def charging(self, round_number, mechanisms):
    if stage == "before-charge":
        os.kill(os.getpid(), signal.SIGKILL)
    spent = charge(self, round_number, mechanisms)
    os.kill(os.getpid(), signal.SIGKILL)


Ledger.charge = charging
config = flower_run_config(
    {"task": "i2b2", "model": "tiny", "strategy": "fedavg", "max_length": 32,
     "target_epsilon": 8.0, "rounds": 3, "local_epochs": 1},
    tmp / "run",
)
site = NodeSite(config, NodeConfig(data, tmp / "state", site="beth", max_epsilon=10.0), "run")
expect = payload.digest(shared_state(site.runner.model))
site.runner.handle(Message("train", 1, {}, False, False, base=0, expect=expect))
"""


@pytest.mark.parametrize("stage", ["before-charge", "after-charge"])
def test_a_node_killed_around_its_charge_charges_the_round_once(i2b2_corpus, tmp_path, stage):
    import os
    import subprocess
    import sys

    from clinfed.core import payload
    from clinfed.core.scratch import remove_stale
    from clinfed.federated.engine import Message
    from clinfed.modeling.adapters import shared_state

    # Its own temporary folder, outside any scratch folder (library use).
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    killed = subprocess.run(
        [sys.executable, "-c", NODE_KILLER, str(i2b2_corpus), str(tmp_path), stage],
        capture_output=True, timeout=600, env=os.environ | {"TMPDIR": str(temporary)},
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    # The SIGKILL left the site's tokenized notes on disk; every folder it
    # left is named for the dead process, so the next clinfed process
    # removes them all.
    left = [p for p in temporary.iterdir() if p.name.startswith("clinfed")]
    assert left and list(next(iter(left)).rglob("*.arrow"))
    assert sorted(remove_stale(temporary)) == sorted(left)
    assert not [p for p in temporary.iterdir() if p.name.startswith("clinfed")]
    # The SuperNode restarts; the server sends round 1 again.
    site = _node_site(i2b2_corpus, tmp_path, target_epsilon=8.0, rounds=3)
    try:
        expect = payload.digest(shared_state(site.runner.model))
        reply = site.runner.handle(Message("train", 1, {}, False, False, base=0, expect=expect))
        assert reply.upload and "refused" not in reply.record
    finally:
        site.close()
    (ledger,) = (tmp_path / "state" / "ledger").glob("beth-*.jsonl")
    lines = read_jsonl(ledger)
    assert [x["round"] for x in lines if x.get("mechanism") == "dp-sgd"] == [1]
    # (round 0: the noisy count, charged and released once before round 1)
    assert [x["round"] for x in lines if x.get("released")] == [0, 1]


def test_an_in_process_site_caps_delta_as_a_node_does(tmp_path, tiny_run):
    # One site builder for both transports: the default cap 1/(10 n) that a
    # node applies holds in-process too (a delta near 1/n lets one unit out).
    from clinfed.core.errors import ClinfedError

    with pytest.raises(ClinfedError, match=r"above this site's cap"):
        tiny_run(target_epsilon=8.0, delta=0.01)
    assert not (tmp_path / "run").exists()


def test_a_node_can_start_from_a_public_warm_start_it_pins(i2b2_corpus, tiny_config, tmp_path):
    # Warm start on Flower: the operator makes the starting model once from
    # public text (clinfed warm-start), each node pins that folder by
    # SHA-256, and the round-0 digest proves every party holds the same.
    from clinfed.core.provenance import data_fingerprint
    from clinfed.federated.state import load_tensors
    from clinfed.runners.warmstart import warm_start_model

    public = tmp_path / "public"
    public.mkdir()
    (public / "train.tsv").write_text("Aspirin\tB-Chemical\nhelps\tO\n\nfever\tB-Disease\n\n" * 20)
    start = tmp_path / "start"
    warm_start_model(
        tiny_config(
            out=start, public_data=str(public), public_types="Disease=problem,Chemical=treatment"
        )
    )
    pinned = {"model": str(start), "model_sha256": data_fingerprint(start)}
    site = _node_site(i2b2_corpus, tmp_path, pinned, model=str(start), target_epsilon=8.0)
    saved = load_tensors(start / "model.safetensors")
    held = site.runner.model.state_dict()
    assert all(torch.equal(held[k].cpu(), saved[k]) for k in saved if k.startswith("encoder."))


def test_a_node_s_annotated_types_are_its_own_declaration_never_the_server_s(i2b2_corpus, tmp_path):
    # The server says every site annotates every type; the node declares
    # problem alone: the node's word is what its partial labels follow.
    server = {"target_epsilon": 8.0, "annotated_types": "*=problem,treatment,test"}
    site = _node_site(i2b2_corpus, tmp_path / "a", {"annotated_types": ("problem",)}, **server)
    declared = site.runner.task.site_types
    assert declared["beth"] == {"problem"} and all(t == {"problem"} for t in declared.values())
    # A node that declares nothing trains every O as plain O, whatever the server says.
    site = _node_site(i2b2_corpus, tmp_path / "b", **server)
    assert site.runner.task.site_types == {}
