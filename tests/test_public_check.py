"""--public-check: the server keeps a round's update only when F1 on public
text rises; a round it does not keep leaves the global model as it was, and
the sites, whose copies hold their own training, get it whole again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clinfed.core.runs import read_jsonl
from clinfed.federated.public_check import (
    PublicCheck,
    Scored,
    changed_decisions,
    micro_f1,
    significant,
)

from .test_cli import run_cli


def _train(corpus: Path, out: Path, *extra: str):
    return run_cli(
        "train", "--task", "i2b2", "--data", str(corpus), "--model", "tiny", "--strategy",
        "fedavg", "--adapter", "bias", "--rounds", "3", "--max-length", "32", "--threads", "1",
        "--target-epsilon", "8", "--out", str(out), *extra,
    )  # fmt: skip


def test_a_proposal_is_kept_only_when_f1_rises_by_more_than_chance():
    gold = frozenset(range(20))
    start = frozenset(range(10))  # half the gold spans, nothing spurious
    proposals = [
        Scored(0.4, frozenset(range(9))),  # F1 falls
        Scored(0.6, frozenset(range(11))),  # one span better: a coin gives that half the time
        Scored(0.6, frozenset(range(4, 16))),  # six better, four worse
        Scored(0.7, frozenset(range(16))),  # six better, none worse: p = 1/64
    ]
    scores = iter([Scored(0.5, start), *proposals])
    check = PublicCheck(lambda state: next(scores), gold)
    old, new = {"w": 0}, {"w": 1}
    records = []
    for _ in proposals:
        chosen, record = check.choose(old, new)
        records.append(record)
        assert chosen is (new if record["kept"] else old)
    assert [r["kept"] for r in records] == [False, False, False, True]
    assert all(type(r["kept"]) is bool for r in records)  # written to metrics.jsonl
    assert [(r["decisions_better"], r["decisions_worse"]) for r in records] == [
        (0, 1), (1, 0), (6, 4), (6, 0)
    ]  # fmt: skip
    assert records[3]["f1_before"] == 0.5 and records[3]["f1_proposed"] == 0.7
    assert check.last.f1 == 0.7  # the next proposal is judged against the kept one


def test_changed_decisions_count_spurious_ones_too():
    gold = frozenset({"a", "b"})
    # "a" found, spurious "x" dropped: two better; "b" lost, spurious "y" added: two worse.
    assert changed_decisions(frozenset({"b", "x"}), frozenset({"a", "y"}), gold) == (2, 2)
    assert changed_decisions(frozenset({"a"}), frozenset({"a"}), gold) == (0, 0)
    assert micro_f1(frozenset({"a", "x"}), gold) == 0.5 and micro_f1(frozenset(), frozenset()) == 0


def test_the_sign_test_is_one_sided_at_five_percent():
    assert significant(5, 0) and not significant(4, 0)  # 1/32 and 1/16
    assert significant(10, 2) and not significant(9, 3)  # 0.019 and 0.073
    assert not significant(0, 0) and not significant(2, 9)


# Every round refused runs by default; every round kept (the path every
# run without the check also takes) with -m slow.
@pytest.mark.parametrize("rises", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_round_not_kept_leaves_the_global_model_and_the_sites_in_step(
    i2b2_corpus, public_i2b2, tmp_path, monkeypatch, rises
):
    # The judge is forced: public F1 that only falls (every round refused)
    # or only rises (every round kept).
    judged = iter(range(100))

    def judge(state):
        # Each proposal finds one more gold span (rises) or loses one (falls).
        n = next(judged)
        return Scored(n / 100, frozenset(range(n))) if rises else Scored(-n, frozenset())

    def forced(self, score, gold):
        self.last, self.gold, self.score = None, frozenset(range(100)), judge

    monkeypatch.setattr(PublicCheck, "__init__", forced)
    # One span a round is chance to the sign test: here it passes, so that
    # only the F1 decides.
    monkeypatch.setattr("clinfed.federated.public_check.significant", lambda b, w: True)
    out = tmp_path / "run"
    result = _train(i2b2_corpus, out, "--public-check", str(public_i2b2))
    assert result.returncode == 0, result.stderr
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "site" not in r]
    assert [r["public_check"]["kept"] for r in records] == [rises] * 3
    digests = json.loads((out / "state.json").read_text())["digests"]
    assert (digests["3"] == digests["0"]) is not rises
    # Every site evaluated every round's model: their copies, rebuilt from
    # what the server sent, were the global model each time.
    assert [r["evaluated_sites"] for r in records] == [3, 3, 3]
    config = json.loads((out / "config.json").read_text())
    assert config["public_check_text"]["types"] == ["problem", "test", "treatment"]
    assert config["model"]["public_check"] == str(public_i2b2)
    assert run_cli("report", str(out)).returncode == 0
    page = (out / "report" / "report.md").read_text()
    said = "kept round 1, 2, 3;" if rises else "kept the last model instead in round 1, 2, 3"
    assert said in page


def test_public_text_that_lacks_a_run_type_is_refused_on_one_line(i2b2_corpus, tmp_path):
    public = tmp_path / "public"
    public.mkdir()
    (public / "train.tsv").write_text("Aspirin\tB-Chemical\nhelped\tO\n")
    result = _train(
        i2b2_corpus, tmp_path / "run", "--public-check", str(public),
        "--public-types", "Chemical=treatment",
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no span of type problem" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_strategy_without_one_shared_model_is_refused(i2b2_corpus, tmp_path):
    result = run_cli(
        "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--strategy", "local", "--public-check", str(i2b2_corpus), "--out", str(tmp_path / "r"),
    )  # fmt: skip
    assert result.returncode == 2 and "--public-check needs a strategy" in result.stderr


def test_the_judge_scores_a_copy_and_leaves_the_run_s_model_alone(
    tiny_config, i2b2_corpus, public_i2b2
):
    # In one process the sites share the run's model object; the server's
    # judge loads each proposal into a copy of its own.
    import tempfile

    import torch

    from clinfed.core.errors import ProblemLog
    from clinfed.modeling.adapters import shared_state
    from clinfed.modeling.models import load_tokenizer
    from clinfed.runners.factories import make_model, make_task
    from clinfed.runners.warmstart import public_check

    config = tiny_config(public_check=str(public_i2b2)).resolved()
    with tempfile.TemporaryDirectory() as cache:
        task = make_task(config, cache)
        task.load(Path(config.data), ProblemLog())
        model = make_model(config, task)
        check, record = public_check(
            config, task, model, load_tokenizer(config.model), cache, ProblemLog()
        )
        before = {n: v.clone() for n, v in shared_state(model).items()}
        zeroed = {n: torch.zeros_like(v) for n, v in before.items()}
        assert 0.0 <= check.score(zeroed).f1 <= 1.0
        assert all(torch.equal(v, shared_state(model)[n]) for n, v in before.items())
        # The judge's spans and F1 are the run's own scoring of the public text.
        scored = check.score(before)
        assert scored.predicted and check.gold
        hits = len(scored.predicted & check.gold)
        assert scored.f1 == pytest.approx(2 * hits / (len(scored.predicted) + len(check.gold)))
    assert record["examples"] > 0 and record["types"] == ["problem", "test", "treatment"]


def test_icd_decisions_are_the_codes_micro_f1_counts(mimic_corpus):
    # The judge's F1 from (admission, code) pairs is the task's own micro F1.
    import tempfile

    import numpy as np

    from clinfed.core.errors import ProblemLog
    from clinfed.modeling.models import TINY, load_tokenizer
    from clinfed.tasks.mimic3.adapter import Mimic3Task

    task = Mimic3Task(top_k=10, max_chunks=2)
    with tempfile.TemporaryDirectory() as cache:
        records = task.read_documents(mimic_corpus, ProblemLog())
        examples = task.encode(records, load_tokenizer(TINY), 32, cache)
    rng = np.random.default_rng(0)
    outputs = list(rng.uniform(size=(len(examples), len(task.labels))))
    outputs[0][:] = 0.5  # at the threshold: every code predicted
    gold, found = task.decisions(records, examples), task.decisions(records, examples, outputs)
    targets = np.asarray(examples["targets"])
    assert len(gold) == targets.sum() and {hadm for hadm, _ in gold} <= set(records["hadm_id"])
    assert {code for hadm, code in found if hadm == examples[0]["hadm_id"]} == set(task.labels)
    expected = task.evaluate(records, examples, outputs)["micro_f1"]
    assert micro_f1(found, gold) == pytest.approx(expected)


def test_icd_coding_rounds_are_judged_on_public_admissions(mimic_corpus, tmp_path):
    from clinfed.tasks.mimic3.synth import generate

    public = tmp_path / "public"
    generate(public, sites=1, docs=16, seed=5)
    out = tmp_path / "run"
    result = run_cli(
        "train", "--task", "mimic3", "--data", str(mimic_corpus), "--model", "tiny",
        "--strategy", "fedavg", "--adapter", "head", "--rounds", "2", "--top-k", "10",
        "--max-length", "32", "--max-chunks", "2", "--threads", "1", "--target-epsilon", "8",
        "--public-check", str(public), "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "site" not in r]
    checks = [r["public_check"] for r in records]
    assert len(checks) == 2 and all(0.0 <= c["f1_proposed"] <= 1.0 for c in checks)
    # Each round is judged against the model kept before it.
    assert checks[1]["f1_before"] == (checks[0]["f1_proposed"] if checks[0]["kept"] else
                                      checks[0]["f1_before"])  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    labels = json.loads((out / "model" / "model.json").read_text())["labels"]
    codes = config["public_check_text"]["types"]
    assert codes and set(codes) <= set(labels)
    assert run_cli("report", str(out)).returncode == 0
    assert "the server scored each round's model on public text public" in (
        (out / "report" / "report.md").read_text()
    )
