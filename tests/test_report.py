"""The privacy report as a reader sees it: the page's structure (header,
one verdict per site, a grid over every encoder layer), wording for runs
without DP or without sites, and the page Chromium renders, where one is
installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clinfed.reporting.report import page_outline, write_report
from clinfed.runners.pipeline import RunConfig, run_training
from tools.report_in_browser import model_layers, problems, render

BASE = {"task": "i2b2", "model": "tiny", "max_length": 32, "threads": 1}


def _run(data: Path, out: Path, **settings) -> Path:
    run_training(RunConfig.of(data=str(data), out=str(out), **(BASE | settings)))
    write_report(out)
    return out


@pytest.fixture(scope="module")
def dp_run(i2b2_corpus, tmp_path_factory) -> Path:
    # SAFL sends one layer of two: the grid must still show both.
    out = tmp_path_factory.mktemp("report") / "run"
    return _run(
        i2b2_corpus,
        out,
        strategy="safl+fedfrozen",
        rounds=2,
        target_epsilon=8.0,
        strategy_options={"top_layers": 1, "freeze_from": "2"},
    )


def test_the_page_has_a_header_a_verdict_per_site_and_every_layer(dp_run):
    outline = page_outline((dp_run / "report" / "report.html").read_text())
    sites = ["beth", "partners", "site3"]
    assert problems(outline, model_layers(dp_run), sites) == []
    assert outline["header"]["Strategy"] == "safl+fedfrozen"
    assert outline["header"]["Rounds"] == "2 of 2 planned"
    per_site = [line for line in outline["verdicts"] if "outside epsilon" not in line]
    assert len(per_site) == 3 and all("within budget" in line for line in per_site)
    assert any("Held-out notes are outside epsilon" in line for line in outline["verdicts"])
    assert outline["sent_columns"] == ["embeddings", "layer 0", "layer 1", "head"]
    assert outline["sent_rows"] == 6  # 2 rounds x 3 sites
    assert {"What epsilon means here", "What left each hospital"} <= set(outline["headings"])
    assert len(outline["images"]) == 3
    markdown = (dp_run / "report" / "report.md").read_text()
    # A real renderer: lists and bold survive into the page.
    page = (dp_run / "report" / "report.html").read_text()
    assert "<li><strong>beth: within budget.</strong>" in page
    assert "**" not in page and markdown.count("- **") == 4  # 3 sites + held-out notes


def test_a_page_that_drops_a_layer_is_caught(dp_run):
    outline = page_outline((dp_run / "report" / "report.html").read_text())
    cut = outline | {"sent_columns": ["embeddings", "layer 0", "head"]}
    assert problems(cut, model_layers(dp_run), ["beth"]) != []


def test_the_first_screen_says_in_plain_words_what_is_protected_and_what_to_add(dp_run):
    markdown = (dp_run / "report" / "report.md").read_text()
    short = markdown.split("## In short", 1)[1].split("## Verdict", 1)[0]
    assert markdown.index("## In short") < markdown.index("## Verdict")
    assert "protected unit by unit" in short and "epsilon 7." in short
    assert "A whole document is protected only by group privacy" in short
    assert "queries, on weights it chose" in short
    # what the run lacks, and the commands that add it
    assert "--target-epsilon inf" in short and "--reference" in short
    assert "--audit-holdout" in short and "clinfed audit RUN" in short


def test_epsilon_is_explained_in_words_with_a_per_document_bound(dp_run):
    content = json.loads((dp_run / "report" / "privacy.json").read_text())
    words = " ".join(content["meaning"])
    assert "e^epsilon" in words and "one chance in 100,000" in words
    # the group (per-document) reading, for several sizes: no site sends its k
    assert "A whole document is protected by group privacy only" in words
    assert "2 units: epsilon" in words and "30 units: no useful bound" in words
    assert all("group" not in row for row in content["sites"])
    # An add/remove run (the default): no word of replacing a unit anywhere.
    assert content["relation"] == "add-remove"
    assert "replaced" not in (dp_run / "report" / "report.md").read_text()


def test_versions_and_the_command_line_are_recorded(dp_run):
    config = json.loads((dp_run / "config.json").read_text())
    summary = json.loads((dp_run / "summary.json").read_text())
    for record in (config, summary):
        assert record["versions"]["clinfed"] and record["versions"]["torch"]
        assert "command" in record
    assert len(config["data_fingerprint"]) == 64


def test_a_centralized_run_report_speaks_of_pooled_data_not_sites(i2b2_corpus, tmp_path):
    out = _run(i2b2_corpus, tmp_path / "run", strategy="centralized", epochs=1)
    outline = page_outline((out / "report" / "report.html").read_text())
    assert len(outline["verdicts"]) == 1 and "pooled" in outline["verdicts"][0]
    assert "Per site" not in outline["headings"]
    assert "What left each hospital" not in outline["headings"]
    assert "Sites" not in outline["header"] and "Epochs" in outline["header"]


def test_a_federated_run_without_dp_says_it_has_no_guarantee(i2b2_corpus, tmp_path):
    out = _run(i2b2_corpus, tmp_path / "run", strategy="fedavg", rounds=1)
    outline = page_outline((out / "report" / "report.html").read_text())
    assert outline["verdicts"] == [
        "No formal privacy guarantee. The sites trained without differential privacy: each "
        "update they sent can reveal their training data (epsilon is infinite)."
    ]
    assert "What epsilon means here" not in outline["headings"]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no Chromium on this machine")
def test_chromium_renders_the_same_page(dp_run, tmp_path):
    dom = render(dp_run / "report" / "report.html", tmp_path / "shot.png")
    rendered = page_outline(dom)
    assert problems(rendered, model_layers(dp_run), ["beth", "partners", "site3"]) == []
    assert (
        rendered["verdicts"]
        == page_outline((dp_run / "report" / "report.html").read_text())["verdicts"]
    )
    assert (tmp_path / "shot.png").stat().st_size > 10_000


def test_same_curves_are_drawn_once_the_sent_legend_names_used_colours_and_one_colour_no_map():
    from clinfed.reporting.plots import epsilon_series, make_plots, sent_legend

    def ledger(sigma: float) -> list[dict]:
        return [{"round": r, "mechanism": "dp-sgd", "noise_multiplier": sigma,
                 "sample_rate": 0.1, "steps": 10, "epsilon": r * sigma, "delta": 1e-5}
                for r in (1, 2)]  # fmt: skip

    series = epsilon_series({"a": ledger(1.0), "b": ledger(1.0), "c": ledger(2.0)})
    assert [who for who, *_ in series] == ["a, b (identical)", "c"]
    assert sent_legend([[2, 0], [2, 0]]) == "dark: whole; grey: not"
    assert "orange" not in sent_legend([[1, 2]]) and "light" in sent_legend([[1, 2]])

    # One colour everywhere (FedAvg: every layer, every round) is no picture.
    def grid(cells: list[list[int]]) -> dict:
        rows = [{"label": f"round {i}", "cells": row} for i, row in enumerate(cells)]
        return {"columns": ["embeddings", "head"], "rows": rows}

    no_ledgers = {"records": [], "ledgers": {}}
    assert "layers" not in make_plots(no_ledgers, None, grid([[2, 2], [2, 2]]))
    assert "layers" in make_plots(no_ledgers, None, grid([[2, 1], [2, 2]]))
