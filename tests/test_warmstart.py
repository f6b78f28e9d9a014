"""Public warm start: the starting model trains on public text before
round 1, costs no privacy, and the run says so."""

from __future__ import annotations

import json
from pathlib import Path

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


def _train(corpus: Path, out: Path, *extra: str):
    return run_cli(
        "train", "--task", "i2b2", "--data", str(corpus), "--model", "tiny", "--strategy",
        "fedavg", "--rounds", "1", "--max-length", "32", "--threads", "1",
        "--target-epsilon", "8", "--out", str(out), *extra,
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


def test_a_warm_start_with_an_adapter_plan_is_refused_until_it_works(i2b2_corpus, tmp_path):
    public = _public(tmp_path / "public")
    mapped = ("--public-data", str(public), "--public-types", "Disease=problem,Chemical=treatment")
    result = _train(i2b2_corpus, tmp_path / "run", *mapped, "--adapter", "bias")
    assert result.returncode == 2 and "not supported yet" in result.stderr
    assert not (tmp_path / "run").exists()
