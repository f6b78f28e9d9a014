"""Downloads carry exactly what changed since a site last synced: nothing
in round 1 (every site builds the starting model from the run's seed), the
envelope's worth no longer, a lagging site everything it missed, and a
site whose copy does not rebuild the global model the whole model."""

from __future__ import annotations

import torch

from clinfed.core import payload
from clinfed.core.runs import read_jsonl
from clinfed.federated.engine import Deployment, Reply, RoundEngine
from clinfed.federated.messages import ReleasedAsReplies
from clinfed.federated.strategies import get_strategy

NAMES = ["a.weight", "b.weight", "c.weight"]


class CountsTask:
    def metrics_from_counts(self, counts):
        hits, total = counts["hits"]
        return {"f1": hits / total if total else 0.0}


class MirrorSites(ReleasedAsReplies):
    """Sites that keep a copy per received round, rebuild the global model
    from it as a real site does, prove it with a digest, and upload the
    names ``uploads(site, round)`` with values of their own."""

    def __init__(self, sites, uploads, fail=lambda site, round_number: False):
        self.sites, self.uploads, self.fail = list(sites), uploads, fail
        # Each builds the starting model (global round 0) itself.
        self.copies: dict[str, dict[int, dict[str, torch.Tensor]]] = {
            s: {0: {n: torch.zeros(2) for n in NAMES}} for s in sites
        }
        self.sent: list[tuple[str, object]] = []

    def addresses(self):
        return list(self.sites)

    def exchange(self, messages, timeout):
        for site in sorted(messages):
            message = messages[site]
            self.sent.append((site, message))
            if self.fail(site, message.round):
                yield site, "error 0: down"
                continue
            copies = self.copies[site]
            if message.full:
                model = {k: v.clone() for k, v in message.download.items()}
            else:
                model = {k: v.clone() for k, v in copies[message.base].items()}
                model.update({k: v.clone() for k, v in message.download.items()})
            received = payload.digest(model)
            evaluation = {"counts": {"": {"hits": [1, 2]}}, "examples": 2, "seconds": 0.0}
            upload, record = {}, None
            if message.kind == "train":
                upload = {
                    n: torch.full((2,), float(message.round * 10 + self.sites.index(site)))
                    for n in self.uploads(site, message.round)
                }
                model.update(upload)  # its own training stays in its copy
                record = {"round": message.round, "site": site, "examples": 5, "bytes_up": 8}
            copies[message.round - 1] = model
            yield (
                site,
                Reply(
                    site=site,
                    upload=upload,
                    record=record,
                    evaluation=evaluation if message.evaluate else None,
                    received=received,
                ),
            )


def _safl_global(corpus, tmp_path, **extra):
    """SAFL K=1 with global selection on the tiny model, in process."""
    from clinfed.runners.pipeline import RunConfig

    return RunConfig.of(
        data=str(corpus),
        out=str(tmp_path / "run"),
        task="i2b2",
        model="tiny",
        max_length=32,
        threads=1,
        strategy="safl",
        top_layers=1,
        selection="global",
        **extra,
    )


def _engine(tmp_path, rounds=3):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return RoundEngine(
        CountsTask(),
        get_strategy("fedavg"),
        {n: torch.zeros(2) for n in NAMES},
        NAMES,
        tmp_path,
        rounds,
        deployment=Deployment(wait_for_sites=0.0, round_retries=0),
    )


def test_a_site_gets_what_changed_since_it_last_synced(tmp_path):
    # Round 1 changes a, round 2 changes b; c never changes.
    def uploads(site, round_number):
        return {1: ["a.weight"], 2: ["b.weight"]}.get(round_number, [])

    sites = MirrorSites(
        ["in-sync", "late"], uploads, fail=lambda site, r: site == "late" and r == 2
    )
    run = _engine(tmp_path / "run")
    run.run(sites)
    # Round 1: nothing to send; each site builds global round 0 itself.
    first = {site: m for site, m in sites.sent if m.round == 1}
    assert all(not m.full and m.download == {} and m.base == 0 for m in first.values())
    third = {site: m for site, m in sites.sent if m.round == 3}
    # In sync since round 1 (it holds global 1): what changed in round 2.
    assert not third["in-sync"].full and set(third["in-sync"].download) == {"b.weight"}
    assert third["in-sync"].base == 1
    # Missed round 2 (it holds global 0): everything that changed in both rounds.
    assert not third["late"].full and set(third["late"].download) == {"a.weight", "b.weight"}
    assert third["late"].base == 0
    # Both rebuilt global round 2 exactly (their proofs matched): nothing rejected.
    assert not [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "rejected" in r]
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "bytes_down" in r]
    assert all(r["bytes_down"] == 0 for r in records if r["round"] == 1)
    round3 = {r["site"]: r["bytes_down"] for r in records if r["round"] == 3}
    assert round3["late"] > round3["in-sync"]  # measured on what was sent


def test_a_copy_that_does_not_rebuild_the_global_model_gets_the_whole_model(tmp_path):
    def uploads(site, round_number):
        return ["a.weight"]

    sites = MirrorSites(["good", "corrupt"], uploads)
    original = sites.exchange

    def exchange(messages, timeout):
        for site, reply in original(messages, timeout):
            if site == "corrupt" and messages[site].round == 2:
                # Its copy of round 0 was damaged on disk: it proves another model.
                reply.received = "0" * 64
            yield site, reply

    sites.exchange = exchange
    run = _engine(tmp_path / "run")
    run.run(sites)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    rejected = [r for r in records if "rejected" in r]
    assert [(r["site"], r["round"]) for r in rejected] == [("corrupt", 2)]
    assert "stale or corrupt" in rejected[0]["rejected"]
    third = {site: m for site, m in sites.sent if m.round == 3}
    assert third["corrupt"].full and set(third["corrupt"].download) == set(NAMES)
    assert not third["good"].full


def test_safl_downloads_only_the_layers_chosen_in_the_last_round(
    i2b2_corpus, tmp_path, traffic, monkeypatch
):
    from clinfed.runners.pipeline import run_training

    proofs = []
    original = RoundEngine._stale

    def stale(self, reply, round_number):
        proofs.append((reply.received, self.digests.get(str(round_number - 1))))
        return original(self, reply, round_number)

    monkeypatch.setattr(RoundEngine, "_stale", stale)

    summary = run_training(_safl_global(i2b2_corpus, tmp_path, rounds=3, audit_holdout=0.2))
    for round_number in (2, 3):
        sent_before = set().union(*(m["up"] for m in traffic.of(round_number - 1)))
        assert sent_before and all(
            n.startswith(("encoder.encoder.layer.", "head.")) for n in sent_before
        )
        layers = {n.split(".")[3] for n in sent_before if n.startswith("encoder.")}
        assert len(layers) == 1  # --top-layers 1
        for message in traffic.of(round_number):
            # The chosen layer and the head: what the last aggregation changed.
            assert message["down"] == sent_before
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "bytes_down" in r]
    later = [r for r in records if r["round"] > 1]
    assert all(r["bytes_down"] <= 1.1 * r["bytes_up"] for r in later)
    assert summary["mb_down"] < summary["fedavg_mb_up"]
    # Every reply proved the model it rebuilt, and every proof held (an
    # audited run keeps its sites' updates: the proof must survive that too).
    assert proofs and all(got == expected for got, expected in proofs)
    assert not [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "rejected" in r]


def test_a_site_whose_starting_model_differs_spends_nothing_and_gets_the_whole_model(
    i2b2_corpus, tmp_path, traffic, monkeypatch
):
    from clinfed.federated.site import SiteRunner
    from clinfed.runners.pipeline import run_training

    original = SiteRunner.__init__

    def init(self, name, task, model, initial_state, *args, **kwargs):
        if name == "partners":
            # Built from another checkpoint or seed: not the run's round 0.
            initial_state = {k: v + 0.5 for k, v in initial_state.items()}
        original(self, name, task, model, initial_state, *args, **kwargs)

    monkeypatch.setattr(SiteRunner, "__init__", init)
    run_training(_safl_global(i2b2_corpus, tmp_path, rounds=2, target_epsilon=4.0, delta=1e-5))
    first = {m["site"]: m for m in traffic.of(1)}
    assert first and all(m["down"] == set() for m in first.values())
    assert first["partners"]["up"] == set()  # it did not train on the wrong model
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    rejected = [r for r in records if "rejected" in r]
    assert [(r["site"], r["round"]) for r in rejected] == [("partners", 1)]
    # Round 2: the whole model for it, what changed for the others; it trains.
    second = {m["site"]: m for m in traffic.of(2)}
    whole = second["partners"]["down"]
    assert second["partners"]["full"] and second["partners"]["up"]
    assert all(not m["full"] and m["down"] < whole for s, m in second.items() if s != "partners")
    # Its ledger charges round 2 only: nothing was spent on round 1.
    ledger = read_jsonl(tmp_path / "run" / "privacy" / "partners.jsonl")
    assert [line["round"] for line in ledger if line["mechanism"] == "dp-sgd"] == [2]
    others = read_jsonl(tmp_path / "run" / "privacy" / "beth.jsonl")
    assert [line["round"] for line in others if line["mechanism"] == "dp-sgd"] == [1, 2]
