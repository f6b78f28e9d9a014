"""--public-check: the server keeps a round's update only when F1 on public
text rises; a round it does not keep leaves the global model as it was, and
the sites, whose copies hold their own training, get it whole again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clinfed.federated.public_check import PublicCheck
from clinfed.runs import read_jsonl

from .test_cli import run_cli


def _train(corpus: Path, out: Path, *extra: str):
    return run_cli(
        "train", "--task", "i2b2", "--data", str(corpus), "--model", "tiny", "--strategy",
        "fedavg", "--adapter", "bias", "--rounds", "3", "--max-length", "32", "--threads", "1",
        "--target-epsilon", "8", "--out", str(out), *extra,
    )  # fmt: skip


def test_the_last_model_is_kept_unless_public_f1_rises():
    scores = iter([0.5, 0.4, 0.5, 0.6])
    check = PublicCheck(lambda state: next(scores))
    old, new = {"w": 0}, {"w": 1}
    assert check.choose(old, new) == (old, {"f1_before": 0.5, "f1_proposed": 0.4, "kept": False})
    assert check.choose(old, new)[0] is old  # a tie keeps the last model
    kept, record = check.choose(old, new)
    assert kept is new and record == {"f1_before": 0.5, "f1_proposed": 0.6, "kept": True}


@pytest.mark.parametrize("rises", [False, True])
def test_a_round_not_kept_leaves_the_global_model_and_the_sites_in_step(
    i2b2_corpus, tmp_path, monkeypatch, rises
):
    # The judge is forced: public F1 that only falls (every round refused)
    # or only rises (every round kept).
    judged = iter(range(100))

    def forced(self, score):
        self.last = None
        self.score = lambda state: next(judged) if rises else -next(judged)

    monkeypatch.setattr(PublicCheck, "__init__", forced)
    out = tmp_path / "run"
    result = _train(i2b2_corpus, out, "--public-check", str(i2b2_corpus))
    assert result.returncode == 0, result.stderr
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "client" not in r]
    assert [r["public_check"]["kept"] for r in records] == [rises] * 3
    digests = json.loads((out / "state.json").read_text())["digests"]
    assert (digests["3"] == digests["0"]) is not rises
    # Every site evaluated every round's model: their copies, rebuilt from
    # what the server sent, were the global model each time.
    assert [r["evaluated_sites"] for r in records] == [3, 3, 3]
    config = json.loads((out / "config.json").read_text())
    assert config["public_check_text"]["types"] == ["problem", "test", "treatment"]
    assert config["model"]["public_check"] == str(i2b2_corpus)
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


def test_the_judge_scores_a_copy_and_leaves_the_run_s_model_alone(tiny_config, i2b2_corpus):
    # In one process the sites share the run's model object; the server's
    # judge loads each proposal into a copy of its own.
    import tempfile

    import torch

    from clinfed.adapters import shared_state
    from clinfed.errors import ProblemLog
    from clinfed.models import load_tokenizer
    from clinfed.pipeline import make_model, make_task
    from clinfed.warmstart import public_check

    config = tiny_config(public_check=str(i2b2_corpus)).resolved()
    with tempfile.TemporaryDirectory() as cache:
        task = make_task(config, cache)
        task.load(Path(config.data), ProblemLog())
        model = make_model(config, task)
        check, record = public_check(
            config, task, model, load_tokenizer(config.model), cache, ProblemLog()
        )
        before = {n: v.clone() for n, v in shared_state(model).items()}
        zeroed = {n: torch.zeros_like(v) for n, v in before.items()}
        assert 0.0 <= check.score(zeroed) <= 1.0
        assert all(torch.equal(v, shared_state(model)[n]) for n, v in before.items())
    assert record["examples"] > 0 and record["types"] == ["problem", "test", "treatment"]
