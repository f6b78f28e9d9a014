"""One door for what a site sends (clinfed.privacy.releases), and the
neighbour test that proves it: a site's replies to the same messages, from
a dataset and from the same dataset with one unit removed (add/remove) or
replaced (replace-one), the randomness that protects privacy pinned to the
same draws, differ only in fields the declaration calls accounted."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import shutil
from pathlib import Path

import pytest

from clinfed.federated import inprocess, messages
from clinfed.federated.inprocess import InProcessTransport
from clinfed.federated.messages import Reply, encode_reply
from clinfed.privacy import releases
from clinfed.privacy.errors import PrivacyError
from clinfed.tasks.i2b2.synth import generate

SITE = "beth"
# Fresh randomness independent of the data (secure aggregation's keys and
# the shares of them): declared public, they differ between any two runs.
NONCES = ("secure.encrypt", "secure.mask", "secure.shares")


# ------------------------------------------------------------ neighbours
def _longest_note(folder: Path) -> Path:
    """The longest note of a site folder (so that its length is the largest)."""
    notes = sorted((folder / "txt").glob("*.txt"))
    return max(notes, key=lambda t: (len(t.read_text().splitlines()), t.name))


def _last_line_changed(folder: Path, replacement: str | None) -> None:
    """One unit of a site folder removed (``replacement`` None) or replaced:
    the last line of its longest note, and the annotations on it (concepts,
    assertions)."""
    txt = _longest_note(folder)
    lines = txt.read_text().splitlines()
    last = len(lines)
    lines = lines[:-1] + ([replacement] if replacement is not None else [])
    txt.write_text("\n".join(lines) + "\n")
    for notes in folder.iterdir():
        for marks in notes.glob(f"{txt.stem}.*"):
            if marks.suffix == ".txt":
                continue
            kept = [
                a for a in marks.read_text().splitlines()
                if f" {last}:" not in a.split("||")[0]
            ]  # fmt: skip
            marks.write_text("\n".join(kept) + "\n")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Two sites' notes, and the neighbours of ``SITE``'s."""
    root = tmp_path_factory.mktemp("neighbours")
    base = root / "base"
    generate(base, sites=2, docs=5, seed=5)  # beth's longest note is one of a kind
    made = {"base": base}
    for name, change in {
        "removed": lambda d: _last_line_changed(d / "train" / SITE, None),
        "replaced": lambda d: _last_line_changed(
            d / "train" / SITE, "the patient denies zqx pain today ."
        ),
        "held-out": lambda d: _last_line_changed(d / "test" / SITE, None),
    }.items():
        made[name] = root / name
        shutil.copytree(base, made[name])
        change(made[name])
    return made


class _Pinned:
    """The server's messages to ``SITE``, and when it tells the site its
    round was released, pinned to the first run's; and the JSON part of
    every reply ``SITE`` sent through the door."""

    def __init__(self, monkeypatch):
        self.recorded: list = []
        self.replay: list | None = None
        self.releases: list = []
        self.sent: list[dict] = []
        self.done = False
        real_exchange, real_door = InProcessTransport.exchange, messages.check_reply
        real_release = InProcessTransport.release
        pinned = self

        def release(transport, round_number, sites):
            if pinned.replay is None:
                pinned.releases.append((round_number, list(sites)))
            else:  # the neighbour's server may judge the pinned replies otherwise
                sites = next((s for r, s in pinned.releases if r == round_number), [])
            return real_release(transport, round_number, sites)

        def exchange(transport, outgoing, timeout):
            outgoing = dict(outgoing)
            # Secure aggregation's stages relay this run's keys: not pinned.
            if SITE in outgoing and outgoing[SITE].kind != "secure":
                if pinned.replay is None:
                    pinned.recorded.append(outgoing[SITE])
                elif pinned.replay:
                    outgoing[SITE] = pinned.replay.pop(0)
                else:
                    # The neighbour's server asks more (it retries a round it
                    # judged otherwise): answers to messages of its own are
                    # not compared.
                    pinned.done = True
            return real_exchange(transport, outgoing, timeout)

        def door(info, private, site=""):
            real_door(info, private, site)
            if site == SITE and not pinned.done:
                pinned.sent.append(json.loads(json.dumps(info, default=str)))

        def encode(reply):
            wire = real_encode(reply)  # through the door, which kept the JSON part
            if reply.site == SITE and pinned.sent:
                # The update's numbers, not only its names.
                pinned.sent[-1]["upload"] = hashlib.sha256(wire[0]).hexdigest()
            return wire

        real_encode = inprocess.encode_reply
        monkeypatch.setattr(inprocess, "encode_reply", encode)
        monkeypatch.setattr(InProcessTransport, "exchange", exchange)
        monkeypatch.setattr(InProcessTransport, "release", release)
        monkeypatch.setattr(messages, "check_reply", door)
        # The ledger's attempt tokens are nonces: pinned (the same sequence
        # in every run), so its digest moves only with what the lines say.
        self.tokens = itertools.count()
        monkeypatch.setattr(
            "clinfed.privacy.ledger.secrets.token_hex", lambda n=8: f"{next(self.tokens):016x}"
        )

    def run(self, config) -> list[dict]:
        from clinfed.runners.pipeline import run_training

        self.sent, self.tokens, self.done = [], itertools.count(), False
        if self.recorded:
            self.replay = list(self.recorded)
        run_training(config)
        return self.sent


def _differing(first: list[dict], second: list[dict]) -> set[str]:
    assert len(first) == len(second), "the site answered a different number of messages"
    paths = set()
    for a, b in zip(first, second, strict=True):
        left, right = dict(releases.leaves(a)), dict(releases.leaves(b))
        paths |= {p for p in left.keys() | right.keys() if left.get(p) != right.get(p)}
    return {p for p in paths if not p.startswith(NONCES)}


def _neighbour_replies(tiny_config, monkeypatch, tmp_path, corpora, neighbour, **settings):
    pinned = _Pinned(monkeypatch)
    values = {"reproducible_noise": True, "rounds": 1, "local_epochs": 1} | settings

    def run(data: str) -> list[dict]:
        # The same run name (the folder's) for both: it is on every ledger line.
        out = tmp_path / data / "run"
        return pinned.run(tiny_config(out, corpora[data], **values))

    return run("base"), run(neighbour)


PLANS = {
    "fedavg-every-weight": {"strategy": "fedavg"},
    "fedavg-lora": {"strategy": "fedavg", "adapter": "lora"},
    "fedavg-bias": {"strategy": "fedavg", "adapter": "bias"},
    "fedavg-head": {"strategy": "fedavg", "adapter": "head"},
    "fedprox": {"strategy": "fedprox", "adapter": "bias"},
    "fedadam": {"strategy": "fedadam", "adapter": "bias"},
    "ditto": {"strategy": "ditto", "adapter": "bias", "rounds": 2},
    "local": {"strategy": "local", "adapter": "bias", "rounds": 2},
    # Two rounds where a plan changes in round 2 (FedFrozen freezes Q/K),
    # a site trains twice (ditto), keeps its model (local) or refuses round 2.
    "fedfrozen": {"strategy": "fedfrozen", "strategy_options": {"freeze_from": "2"}, "rounds": 2},
    "safl-private-selection": {
        "strategy": "safl",
        "strategy_options": {"top_layers": 1, "selection": "private"},
    },  # fmt: skip
    "safl+fedfrozen": {
        "strategy": "safl+fedfrozen",
        "strategy_options": {"top_layers": 1, "freeze_from": "2"},
    },  # fmt: skip
    "pfeddc": {"strategy": "pfeddc"},
    # One round: its stages relay this run's keys, and a second round's
    # pinned message would not be what the neighbour's server summed.
    "secure-aggregation": {
        "strategy": "fedavg",
        "adapter": "bias",
        "secure_aggregation": True,
        "rounds": 1,
    },  # fmt: skip
    # Round 2 is refused: the budget affords one round at this noise
    # (about 6.6 then 10.0 under replace-one, 5.1 then 7.1 under add/remove).
    "refusal": {"strategy": "fedavg", "adapter": "bias", "noise_multiplier": 1.0, "rounds": 2},
}
REFUSING_TARGET = {"replace-one": 8.0, "add-remove": 6.0}


# Every plan under add/remove (the default); under replace-one the plans
# whose releases differ in kind (a private choice, two trainings, a refusal,
# masked stages), where the exact count and what derives from it are declared.
CASES = [(plan, "add-remove") for plan in sorted(PLANS)] + [
    (plan, "replace-one")
    for plan in ("fedavg-every-weight", "safl-private-selection", "ditto", "refusal",
                 "secure-aggregation")
]  # fmt: skip


@pytest.mark.parametrize("plan, relation", CASES)
def test_only_accounted_fields_move_with_one_training_unit(
    plan, relation, tiny_config, monkeypatch, tmp_path, corpora
):
    # Every unit in every batch (sampling rate 1), so the changed one is
    # trained on; the refusal plan keeps the recipe's batches.
    settings = PLANS[plan] | (
        {"target_epsilon": REFUSING_TARGET[relation]}
        if plan == "refusal"
        else {"target_epsilon": 8.0, "batch_size": 1000}
    )
    neighbour = "removed" if relation == "add-remove" else "replaced"
    base, other = _neighbour_replies(
        tiny_config, monkeypatch, tmp_path, corpora, neighbour, neighbours=relation, **settings
    )
    assert base, "the site sent nothing"
    moved = _differing(base, other)
    # Every plan that sends an update shows the change in it (the refusal
    # plan's one round keeps the recipe's batches, which may miss the unit;
    # a local site sends only counts, which a tiny change may leave as they are).
    assert moved or plan in ("refusal", "local"), "the neighbour changed nothing the site sent"
    covers = {p: releases.cover_of(p, relation) for p in moved}
    uncovered = {p: c for p, c in covers.items() if c != releases.ACCOUNTED}
    assert not uncovered, uncovered
    if plan == "refusal":
        assert any("refused" in (r.get("record") or {}) for r in base)


def test_held_out_units_move_only_the_declared_evaluation(
    tiny_config, monkeypatch, tmp_path, corpora
):
    base, other = _neighbour_replies(
        tiny_config, monkeypatch, tmp_path, corpora, "held-out", strategy="fedavg",
        adapter="bias", target_epsilon=8.0,
    )  # fmt: skip
    moved = _differing(base, other)
    assert moved and all(p.startswith("evaluation.") for p in moved), moved
    assert {releases.row_of(p).held_out for p in moved} == {releases.DECLARED}


def test_the_neighbour_test_catches_an_exact_count_per_note(
    tiny_config, monkeypatch, tmp_path, corpora
):
    # The release 391678d made: units per note (the largest), exact, in
    # every reply, declared as "released exactly, not accounted".
    from collections import Counter

    from clinfed.federated import site_policy
    from clinfed.privacy.policy import PrivacyPolicy

    real_policy, real_describe, real_row_of = (
        site_policy.privacy_policy, PrivacyPolicy.describe_site, releases.row_of,
    )  # fmt: skip

    def policy_with_k(config, task, train, *args, **kwargs):
        made = real_policy(config, task, train, *args, **kwargs)
        made.k = {
            site: max(Counter(doc for doc, _ in set(zip(d["doc"], d["line"]))).values())
            for site, d in train.items()
        }
        return made

    units = releases.Row("units", "units per note", "each reply", releases.DECLARED, "exact")
    monkeypatch.setattr(site_policy, "privacy_policy", policy_with_k)
    monkeypatch.setattr(
        PrivacyPolicy, "describe_site", lambda p, s: real_describe(p, s) | {"k_max": p.k[s]}
    )
    monkeypatch.setattr(
        releases, "row_of", lambda path: units if path.endswith("k_max") else real_row_of(path)
    )
    base, other = _neighbour_replies(
        tiny_config, monkeypatch, tmp_path, corpora, "removed", strategy="fedavg",
        adapter="bias", target_epsilon=8.0, neighbours="add-remove",
    )  # fmt: skip
    moved = _differing(base, other)
    assert "ledger.site.k_max" in moved
    assert releases.cover_of("ledger.site.k_max", "add-remove") == releases.DECLARED


# ------------------------------------------------------------------ door
def test_the_door_refuses_an_undeclared_field_and_sends_nothing():
    reply = Reply(site="beth", record={"round": 1, "site": "beth", "k_median": 30.5})
    with pytest.raises(PrivacyError, match="record.k_median"):
        encode_reply(reply)
    loss = Reply(site="beth", record={"round": 1, "site": "beth", "train_loss": 0.3})
    with pytest.raises(PrivacyError, match="train_loss"):
        encode_reply(loss)  # a private site never sends its loss
    encode_reply(Reply(site="beth", record=dict(loss.record), private=False))


def test_a_site_that_adds_a_field_to_its_reply_sends_nothing(tiny_run, tmp_path, monkeypatch):
    from clinfed.federated.client import ClientResult

    real = ClientResult.record

    def with_extra(result, round_number, site, bytes_up):
        return real(result, round_number, site, bytes_up) | {"notes_seen": 2}

    monkeypatch.setattr(ClientResult, "record", with_extra)
    with pytest.raises(PrivacyError, match="record.notes_seen"):
        tiny_run(tmp_path / "run", adapter="bias", target_epsilon=8.0)
    assert not (tmp_path / "run" / "model" / "model.safetensors").exists()


def test_every_declared_field_has_a_row_and_the_rows_make_the_tables():
    assert set(releases.FIELDS.values()) | set(releases.SERVER_FIELDS.values()) <= set(releases.ROW)
    assert all(row.cover in releases.COVERS for row in releases.ROWS)
    for relation in ("add-remove", "replace-one"):
        table = releases.markdown(relation)
        for row in releases.ROWS:
            assert row.what in table
    # docs/privacy.md holds the tables as the declaration prints them.
    docs = (Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text()
    assert releases.tables() in docs, "python -m clinfed.privacy.releases docs/privacy.md"


# ---------------------------------------------------------- the words
@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_the_report_s_words_follow_the_relation_and_the_plan(relation):
    from clinfed.reporting.content import _meaning

    content = {
        "differential_privacy": True,
        "sites": [{"epsilon": 4.0}],
        "delta": 1e-5,
        "unit": "one sentence",
        "relation": relation,
        "group_of": "document",
        "private_selection": False,
    }
    words = " ".join(_meaning(content))
    assert ("replaced" in words) == (relation == "replace-one")
    assert "SAFL" not in words
    assert "SAFL" in " ".join(_meaning(content | {"private_selection": True}))
    assert "A whole document is protected by group privacy only" in words


def test_a_two_note_site_sends_nothing_its_exact_count_follows_from(tmp_path, tiny_config):
    # A site of two training notes, add/remove: nothing it sends holds its
    # exact unit count, half of it (a median of two), or a note's length.
    from clinfed.runners.pipeline import run_training

    data = tmp_path / "data"
    generate(data, sites=2, docs=4, seed=5)
    for site_dir in (data / "train").iterdir():
        for extra in sorted((site_dir / "txt").glob("*.txt"))[2:]:
            extra.unlink()
            (site_dir / "concept" / f"{extra.stem}.con").unlink()
    lengths = {
        site.name: [len(t.read_text().splitlines()) for t in sorted((site / "txt").glob("*.txt"))]
        for site in (data / "train").iterdir()
    }
    seen: list[dict] = []
    real_door = messages.check_reply

    def door(info, private, site=""):
        real_door(info, private, site)
        seen.append((site, json.loads(json.dumps(info, default=str))))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(messages, "check_reply", door)
        run_training(tiny_config(tmp_path / "run", data, adapter="bias", target_epsilon=8.0,
                                 neighbours="add-remove"))  # fmt: skip
    for site, info in seen:
        exact = sum(lengths[site])
        forbidden = {exact, exact / 2, *lengths[site], *(n / 2 for n in lengths[site])}
        sent = {k: v for k, v in info.items() if v is not None}
        for path, value in releases.leaves(copy.deepcopy(sent)):
            row = releases.row_of(path)
            if row.covered("add-remove")[0] == releases.ACCOUNTED or row.key == "evaluation":
                continue  # derived from the noisy count or the DP update; held-out notes
            values = value if isinstance(value, list) else [value]
            clash = [v for v in values if isinstance(v, int | float) and v in forbidden]
            assert not (clash and path != "record.round" and "round" not in path), (path, value)


# ------------------------------------------------------- at a Flower node
def _node_replies(data: Path, state: Path, relation: str, monkeypatch) -> list[dict]:
    """A node's replies to the same two training messages (the starting
    model, whole), through the ClientApp's own handler."""
    from clinfed.federated.engine import Message
    from clinfed.flower.deploy import flower_run_config
    from clinfed.flower.handler import SiteCache, answer
    from clinfed.flower.records import message_records
    from clinfed.runners.factories import make_model, make_task

    tokens = itertools.count()
    monkeypatch.setattr(
        "clinfed.privacy.ledger.secrets.token_hex", lambda n=8: f"{next(tokens):016x}"
    )
    values = {
        "task": "i2b2", "model": "tiny", "strategy": "fedavg", "adapter": "bias",
        "max_length": 32, "rounds": 2, "batch_size": 1000, "threads": 1, "local_epochs": 1,
        "target_epsilon": 8.0, "reproducible_noise": True, "neighbours": relation,
    }  # fmt: skip
    config = flower_run_config(values, state.parent / "run")
    start = make_model(config, make_task(config, "")).state_dict()
    node = {"data": str(data), "state": str(state), "site": SITE, "allow-no-dp": True,
            "max-epsilon": 20.0}  # fmt: skip
    cache, sent = SiteCache(), []
    try:
        for round_number in (1, 2):
            message = Message("train", round_number, start, full=True, evaluate=True)
            records = message_records(message, {"name": "run", "config": config.to_dict()})
            reply = answer(records, node, cache)
            info = json.loads(str(reply.config_records["info"]["json"]))
            arrays = reply.array_records["tensors"]
            info["upload"] = hashlib.sha256(
                b"".join(a.numpy().tobytes() for a in arrays.values())
            ).hexdigest()
            sent.append(info)
    finally:
        cache.drop()
    return sent


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_a_flower_node_s_replies_move_only_in_accounted_fields(
    relation, corpora, tmp_path, monkeypatch
):
    neighbour = "removed" if relation == "add-remove" else "replaced"
    base = _node_replies(corpora["base"], tmp_path / "a" / "state", relation, monkeypatch)
    other = _node_replies(corpora[neighbour], tmp_path / "b" / "state", relation, monkeypatch)
    assert base and all(info.get("ledger") for info in base)  # the node shares its ledger
    moved = _differing(base, other)
    assert moved
    uncovered = {p: releases.cover_of(p, relation) for p in moved}
    assert all(c == releases.ACCOUNTED for c in uncovered.values()), uncovered


def test_a_private_site_whose_filter_fails_sends_no_loss(tiny_run, tmp_path, monkeypatch):
    # Two guards, not one: with the privacy layer's record filter gone, the
    # door still knows the site trains under DP and refuses its loss.
    from clinfed.privacy import site as privacy_site

    monkeypatch.setattr(privacy_site, "release_filter", lambda record: dict(record))
    with pytest.raises(PrivacyError, match="record.train_loss"):
        tiny_run(tmp_path / "run", adapter="bias", target_epsilon=8.0)
