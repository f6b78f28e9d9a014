"""FedFrozen: after the warm-up, Q/K never change, travel or train."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from clinfed.core.events import RoundEnd
from clinfed.federated.strategies.fedfrozen import FedFrozen, FedFrozenOptions, is_query_key
from clinfed.runners.pipeline import RunConfig, run_training


def test_plans_before_and_after_warmup():
    names = [
        "encoder.embeddings.word_embeddings.weight",
        "encoder.encoder.layer.0.attention.self.query.weight",
        "encoder.encoder.layer.0.attention.self.key.bias",
        "encoder.encoder.layer.0.attention.self.value.weight",
        "encoder.encoder.layer.0.output.dense.weight",
        "head.weight",
    ]
    strategy = FedFrozen(FedFrozenOptions(freeze_from="2"))
    early, first, late = (strategy.plan(r, "s", names) for r in (1, 2, 3))
    assert any(is_query_key(n) for n in early.uploaded)
    assert not any(is_query_key(n) for n in first.trainable | first.uploaded)
    # The first frozen round delivers the Q/K averaged at the end of the
    # warm-up (a site holding its own copy must take them); later rounds never.
    assert {n for n in first.downloaded if is_query_key(n)} == {n for n in names if is_query_key(n)}
    assert not any(is_query_key(n) for n in late.trainable | late.uploaded | late.downloaded)
    assert "encoder.embeddings.word_embeddings.weight" not in early.trainable
    assert early.downloaded == frozenset(names)  # round 1 syncs everything
    options = FedFrozenOptions(freeze_from="2", train_embeddings=True)
    with_embeddings = FedFrozen(options).plan(3, "s", names)
    assert "encoder.embeddings.word_embeddings.weight" in with_embeddings.uploaded


def test_auto_warmup_freezes_once_qk_settles():
    options = FedFrozenOptions(freeze_from="auto", freeze_threshold=0.05, freeze_patience=2)
    strategy = FedFrozen(options)
    state = {"encoder.encoder.layer.0.attention.self.query.weight": torch.ones(4)}
    steps = [1.0, 1.5, 1.52, 1.53, 1.531]  # change 0.5, ~0.013, ~0.007, ~0.0007
    infos = []
    for round_number, value in enumerate(steps, start=1):
        state = {k: torch.full((4,), value) for k in state}
        infos.append(strategy.observe(round_number, state))
    assert infos[0]["qk_change"] is None and infos[1]["qk_change"] > 0.05  # no earlier model
    assert infos[2]["qk_frozen_from"] is None and infos[3]["qk_frozen_from"] == 5
    assert strategy.frozen(5) and not strategy.frozen(4)


def test_qk_bit_identical_after_warmup_and_never_uploaded(i2b2_corpus, tmp_path, traffic):
    run = tmp_path / "run"
    checkpoints: dict[int, dict[str, torch.Tensor]] = {}

    def report(event):
        if isinstance(event, RoundEnd) and (run / "state.json").is_file():
            state = json.loads((run / "state.json").read_text())
            checkpoints[state["round"]] = load_file(str(run / state["checkpoint"]))

    run_training(
        RunConfig.of(
            task="i2b2",
            data=str(i2b2_corpus),
            out=str(run),
            strategy="fedfrozen",
            model="tiny",
            rounds=4,
            freeze_from="2",
            max_length=32,
            threads=1,  # beside the other test worker: one thread each
        ),
        report,
    )
    qk = [k for k in checkpoints[1] if is_query_key(k)]
    assert qk
    for later in (2, 3, 4):  # frozen from round 2: what round 1 produced stays, bit for bit
        assert all(torch.equal(checkpoints[1][k], checkpoints[later][k]) for k in qk)
    assert not all(torch.equal(checkpoints[1][k], checkpoints[4][k]) for k in checkpoints[1])
    checkpoints[4] = load_file(str(run / "checkpoints" / "round-0004.safetensors"))
    assert all(len(traffic.of(r)) == 3 for r in (1, 2, 3, 4))
    assert all(any(is_query_key(k) for k in m["up"]) for m in traffic.of(1))
    # Round 2 (the first frozen one) still delivers the Q/K averaged at the
    # end of round 1; no upload carries them, and from round 3 nothing does.
    assert all(any(is_query_key(k) for k in m["down"]) for m in traffic.of(2))
    assert not any(is_query_key(k) for m in traffic.of(2) for k in m["up"])
    for later in (3, 4):
        for m in traffic.of(later):
            assert not any(is_query_key(k) for k in m["down"] | m["up"])
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if "site" not in r]
    assert [r["qk_frozen_from"] for r in rounds] == [2, 2, 2, 2]
    assert rounds[0]["qk_change"] > 0  # round 1 moved Q/K away from the starting model
    assert rounds[2]["qk_change"] == 0.0
