"""Public warm start: the starting model trains on public text before
round 1, costs no privacy, and the run says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from .test_cli import run_cli

# Public-looking text in CoNLL columns: Disease and Chemical mentions.
SENTENCES = [
    [("Aspirin", "B-Chemical"), ("reduced", "O"), ("the", "O"), ("fever", "B-Disease")],
    [("Chronic", "B-Disease"), ("pain", "I-Disease"), ("was", "O"), ("treated", "O")],
    [("with", "O"), ("ibuprofen", "B-Chemical"), ("and", "O"), ("rest", "O")],
]


def _public(folder: Path, copies: int = 20) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for _ in range(copies):
        for sentence in SENTENCES:
            lines += [f"{token}\t{tag}" for token, tag in sentence] + [""]
    (folder / "train.tsv").write_text("\n".join(lines) + "\n")
    return folder


# On the CPU: these tests compare starting models by digest, and a warm start
# trained on a GPU is not bit for bit repeatable (its sums run in no fixed
# order; the first GPU run, H200 2026-11-25, found the digests apart).
def _train(corpus: Path, out: Path, *extra: str):
    return run_cli(
        "train", "--task", "i2b2", "--data", str(corpus), "--model", "tiny", "--strategy",
        "fedavg", "--rounds", "1", "--max-length", "32", "--threads", "1",
        "--target-epsilon", "8", "--device", "cpu", "--neighbours", "replace-one",
        "--local-epochs", "1", "--out", str(out), *extra,
    )  # fmt: skip


def test_a_public_warm_start_changes_the_starting_model_at_no_privacy_cost(i2b2_corpus, tmp_path):
    public = _public(tmp_path / "public")
    mapped = ("--public-data", str(public), "--public-types", "Disease=problem,Chemical=treatment")
    assert _train(i2b2_corpus, tmp_path / "warm", *mapped).returncode == 0
    assert _train(i2b2_corpus, tmp_path / "cold").returncode == 0

    record = json.loads((tmp_path / "warm" / "config.json").read_text())["public_start"]
    assert record["examples"] == 60 and record["types"] == ["problem", "treatment"]
    assert record["epochs"] == 1 and len(record["data_fingerprint"]) == 64

    def start(run: str) -> str:  # the digest of global round 0: the starting model
        return json.loads((tmp_path / run / "state.json").read_text())["digests"]["0"]

    assert start("warm") != start("cold")

    def spent(run: str) -> dict:
        return json.loads((tmp_path / run / "summary.json").read_text())["epsilon"]

    assert spent("warm") == spent("cold")  # the public text costs no privacy
    assert run_cli("report", str(tmp_path / "warm")).returncode == 0
    page = (tmp_path / "warm" / "report" / "report.md").read_text()
    assert "trained on public text public (60 examples" in page


def test_public_types_that_are_not_the_run_s_are_refused_on_one_line(i2b2_corpus, tmp_path):
    public = _public(tmp_path / "public")
    result = _train(i2b2_corpus, tmp_path / "run", "--public-data", str(public))
    assert result.returncode == 2
    assert "map it with --public-types" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_warm_start_trains_the_encoder_at_the_whole_model_rate_under_an_adapter(
    i2b2_corpus, tmp_path
):
    # An adapter run's --lr (1e-3) trained the whole encoder into collapse
    # (F1 0.0 with --adapter bias); the warm start takes the task's rate.
    public = _public(tmp_path / "public")
    mapped = ("--public-data", str(public), "--public-types", "Disease=problem,Chemical=treatment")
    result = _train(i2b2_corpus, tmp_path / "run", *mapped, "--adapter", "bias")
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["public_start"]["lr"] == 1e-4  # i2b2's whole-model rate
    assert config["training"]["lr"] == 1e-3  # the private rounds keep the adapter's


@pytest.mark.slow
def test_a_run_s_batch_size_does_not_change_its_warm_start(i2b2_corpus, tmp_path):
    # --batch-size is the private rounds' batch; the public phase keeps the
    # task's, so runs that differ only in batch start from the same model.
    public = _public(tmp_path / "public")
    mapped = ("--public-data", str(public), "--public-types", "Disease=problem,Chemical=treatment")
    for run, batch in (("small", "4"), ("large", "24")):
        # The bias plan keeps the private round short; it is not what is compared.
        result = _train(
            i2b2_corpus, tmp_path / run, *mapped, "--batch-size", batch, "--adapter", "bias"
        )
        assert result.returncode == 0, result.stderr

    def start(run: str) -> tuple[str, dict]:
        config = json.loads((tmp_path / run / "config.json").read_text())
        digest = json.loads((tmp_path / run / "state.json").read_text())["digests"]["0"]
        return digest, config["public_start"]

    (small, small_record), (large, large_record) = start("small"), start("large")
    assert small == large
    assert small_record["batch_size"] == large_record["batch_size"] == 16  # i2b2's


def test_a_warm_start_leaves_lora_factors_at_their_seeded_start(tiny_config, tmp_path):
    import tempfile

    from clinfed.core.errors import ProblemLog
    from clinfed.modeling.models import load_tokenizer
    from clinfed.runners.factories import make_model, make_task
    from clinfed.runners.warmstart import warm_start

    config = tiny_config(
        adapter="lora",
        public_data=str(_public(tmp_path / "public")),
        public_types="Disease=problem,Chemical=treatment",
    ).resolved()
    with tempfile.TemporaryDirectory() as cache:
        task = make_task(config, cache)
        task.load(Path(config.data), ProblemLog())  # fixes the run's labels
        model = make_model(config, task)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        warm_start(config, task, model, load_tokenizer(config.model), cache, ProblemLog())
    after = dict(model.named_parameters())
    lora = [n for n in before if ".lora_" in n]
    assert lora and all(torch.equal(before[n], after[n]) for n in lora)
    # Every party rebuilds A from the seed and B from zero: only the base moved.
    assert any(not torch.equal(before[n], after[n]) for n in before if ".lora_" not in n)


def test_a_model_an_earlier_run_saved_is_a_starting_model(tiny_run, tiny_config, tmp_path):
    # Warm-start once, then start any number of runs (a private one and its
    # reference) from the saved model: its encoder, and its head for the same labels.
    import tempfile

    from clinfed.core.errors import ProblemLog
    from clinfed.federated.state import load_tensors
    from clinfed.runners.factories import make_model, make_task

    tiny_run(out=tmp_path / "first")
    saved = load_tensors(tmp_path / "first" / "model" / "model.safetensors")
    for spec in (tmp_path / "first", tmp_path / "first" / "model"):
        config = tiny_config(out=tmp_path / "second", model=str(spec)).resolved()
        with tempfile.TemporaryDirectory() as cache:
            task = make_task(config, cache)
            task.load(Path(config.data), ProblemLog())
            start = make_model(config, task).state_dict()
            assert set(start) == set(saved)
            assert all(torch.equal(start[k], saved[k]) for k in saved)
            task.labels = list(reversed(task.labels))  # other labels: a fresh head
            fresh = make_model(config, task).state_dict()
        assert not torch.equal(fresh["head.weight"], saved["head.weight"])
        assert all(torch.equal(fresh[k], saved[k]) for k in saved if k.startswith("encoder."))
    summary = tiny_run(out=tmp_path / "second", model=str(tmp_path / "first"))
    assert summary["f1"] is not None


def test_a_warm_start_saved_once_starts_runs_that_record_it(i2b2_corpus, tmp_path):
    public = _public(tmp_path / "public")
    mapped = ("--public-data", str(public), "--public-types", "Disease=problem,Chemical=treatment")
    start = tmp_path / "start"
    made = run_cli(
        "warm-start", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--max-length", "32", "--threads", "1", "--device", "cpu", "--out", str(start),
        *mapped,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert _train(i2b2_corpus, tmp_path / "inline", *mapped).returncode == 0
    assert _train(i2b2_corpus, tmp_path / "shared", "--model", str(start)).returncode == 0

    def record(run: str) -> tuple[dict, str]:
        config = json.loads((tmp_path / run / "config.json").read_text())
        digest = json.loads((tmp_path / run / "state.json").read_text())["digests"]["0"]
        return config["public_start"], digest

    (inline, inline_start), (shared, shared_start) = record("inline"), record("shared")
    assert shared_start == inline_start  # the same starting model, paid for once
    assert shared["model"] == str(start.resolve()) and shared["examples"] == inline["examples"]
    # The starting model alone is scored like any run's (what the private rounds add).
    scored = run_cli("evaluate", str(start), "--data", str(i2b2_corpus / "test"), "--json")
    assert scored.returncode == 0 and 0 <= json.loads(scored.stdout)["f1"] <= 1
    again = run_cli(
        "warm-start", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--out", str(start), *mapped,
    )  # fmt: skip
    assert again.returncode == 2 and "already exists" in again.stderr


def test_the_audit_measures_from_the_warm_started_model(i2b2_corpus, tmp_path):
    # A run that warm-starts inline is audited against the model it started
    # from (the warm-started one), not the bundled encoder.
    import tempfile

    from clinfed.core import payload
    from clinfed.core.seal import seal_run
    from clinfed.modeling.models import load_saved_model
    from clinfed.runners.audit import starting_model
    from clinfed.settings import RunConfig, read_run_config

    public = _public(tmp_path / "public")
    mapped = ("--public-data", str(public), "--public-types", "Disease=problem,Chemical=treatment")
    run = tmp_path / "run"
    assert _train(i2b2_corpus, run, *mapped, "--audit-holdout", "0.25").returncode == 0
    config = RunConfig.from_values(read_run_config(run), "config").resolved()
    _, tokenizer, meta = load_saved_model(run / "model")
    with tempfile.TemporaryDirectory() as cache:
        from clinfed.runners.factories import make_task

        task = make_task(config, cache)
        task.labels = list(meta["labels"])
        recorded = json.loads((run / "config.json").read_text())["public_start"]
        initial = starting_model(config, task, tokenizer, cache, recorded)
    state = json.loads((run / "state.json").read_text())
    started = state["digests"]["0"]
    assert payload.digest(initial.state_dict()) == started
    # The audit checks that by digest, and says when it cannot rebuild the start.
    audited = run_cli("audit", str(run), "--max-examples", "20")
    assert audited.returncode == 0 and "warning" not in audited.stdout, audited.stderr
    assert json.loads((run / "audit.json").read_text())["starting_model"]["matches_run"] is True
    state["digests"]["0"] = "0" * 64  # as if the run had started from another model
    (run / "state.json").write_text(json.dumps(state))
    seal_run(run)  # ... and had sealed its folder so
    audited = run_cli("audit", str(run), "--max-examples", "20")
    assert audited.returncode == 0 and "not the run's by digest" in audited.stdout
    assert json.loads((run / "audit.json").read_text())["starting_model"]["matches_run"] is False


def test_a_warm_start_made_on_an_earlier_one_names_both_texts(i2b2_corpus, tmp_path):
    # General public text first, then text annotated to the sites' own
    # guidelines (what moved BC5CDR most, docs/results.md): the run's record
    # and report must name both, first to last.
    general = _public(tmp_path / "general")
    ours = _public(tmp_path / "ours", copies=5)
    mapped = ("--public-types", "Disease=problem,Chemical=treatment")
    common = ("--task", "i2b2", "--data", str(i2b2_corpus), "--max-length", "32", "--threads", "1")
    first = run_cli(
        "warm-start", *common, "--model", "tiny", "--public-data", str(general), *mapped,
        "--out", str(tmp_path / "s1"),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    second = run_cli(
        "warm-start", *common, "--model", str(tmp_path / "s1"), "--public-data", str(ours),
        *mapped, "--public-epochs", "3", "--out", str(tmp_path / "s2"),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert _train(i2b2_corpus, tmp_path / "run", "--model", str(tmp_path / "s2")).returncode == 0

    record = json.loads((tmp_path / "run" / "config.json").read_text())["public_start"]
    assert (record["examples"], record["epochs"], Path(record["folder"]).name) == (15, 3, "ours")
    assert (record["after"]["examples"], Path(record["after"]["folder"]).name) == (60, "general")
    assert run_cli("report", str(tmp_path / "run")).returncode == 0
    page = (tmp_path / "run" / "report" / "report.md").read_text()
    assert "public text general (60 examples" in page
    assert "then ours (15 examples, types problem, treatment, 3 epochs) before round 1" in page


# ICD coding: public admissions of other patients (the generator at another
# seed), in MIMIC-III's own CSVs, warm-start the encoder and the code head.
def _train_mimic3(corpus: Path, out: Path, *extra: str):
    return run_cli(
        "train", "--task", "mimic3", "--data", str(corpus), "--model", "tiny", "--strategy",
        "fedavg", "--rounds", "1", "--top-k", "10", "--max-length", "32", "--max-chunks", "2",
        "--threads", "1", "--target-epsilon", "8", "--device", "cpu", "--local-epochs", "1",
        "--out", str(out), *extra,
    )  # fmt: skip


def test_icd_coding_warm_starts_on_public_admissions_at_no_privacy_cost(mimic_corpus, tmp_path):
    from clinfed.tasks.mimic3.synth import generate

    public = tmp_path / "public"
    generate(public, sites=1, docs=16, seed=5)
    warm = _train_mimic3(mimic_corpus, tmp_path / "warm", "--public-data", str(public))
    assert warm.returncode == 0, warm.stderr
    assert _train_mimic3(mimic_corpus, tmp_path / "cold").returncode == 0

    config = json.loads((tmp_path / "warm" / "config.json").read_text())
    record = config["public_start"]
    labels = json.loads((tmp_path / "warm" / "model" / "model.json").read_text())["labels"]
    assert record["label_kind"] == "codes" and record["types"]
    assert set(record["types"]) <= set(labels)
    assert 0 < record["examples"] <= 16 and len(record["data_fingerprint"]) == 64

    def start(run: str) -> str:
        return json.loads((tmp_path / run / "state.json").read_text())["digests"]["0"]

    def spent(run: str) -> dict:
        return json.loads((tmp_path / run / "summary.json").read_text())["epsilon"]

    assert start("warm") != start("cold") and spent("warm") == spent("cold")
    assert run_cli("report", str(tmp_path / "warm")).returncode == 0
    page = (tmp_path / "warm" / "report" / "report.md").read_text()
    assert f"trained on public text public ({record['examples']} examples, codes " in page


def test_icd_coding_refuses_public_types_on_one_line(mimic_corpus, tmp_path):
    from clinfed.tasks.mimic3.synth import generate

    public = tmp_path / "public"
    generate(public, sites=1, docs=8, seed=5)
    typed = _train_mimic3(
        mimic_corpus, tmp_path / "typed", "--public-data", str(public), "--public-types", "A=B"
    )
    assert typed.returncode == 2 and "--public-types maps entity types" in typed.stderr
    errors = [line for line in typed.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in typed.stderr and len(errors) == 1


def test_a_start_warm_started_on_the_run_s_own_notes_is_refused(i2b2_corpus, tmp_path):
    # `cp -r corpus pub; clinfed warm-start --public-data pub` (no --data to
    # compare with), then a private run on corpus from that start: its notes
    # trained the start without DP. The whole corpus and one site's folder.
    shutil.copytree(i2b2_corpus, tmp_path / "copy")
    shutil.copytree(i2b2_corpus / "train" / "beth", tmp_path / "one-site" / "beth")
    for name in ("copy", "one-site"):
        start = tmp_path / f"start-{name}"
        made = run_cli(
            "warm-start", "--task", "i2b2", "--model", "tiny", "--max-length", "32",
            "--threads", "1", "--public-data", str(tmp_path / name), "--out", str(start),
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        run = tmp_path / f"run-{name}"
        refused = _train(i2b2_corpus, run, "--model", str(start))
        assert refused.returncode == 2, (name, refused.stdout)
        assert "warm-started on text with the bytes of the private data" in refused.stderr
        assert str(i2b2_corpus) in refused.stderr and not run.exists()
