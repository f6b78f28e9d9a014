"""clinfed privacy plan: what each budget buys, from the sites' sizes alone,
and an F1 forecast measured on public text dealt into sites of those sizes."""

from __future__ import annotations

import json

import pytest

from clinfed.runners.forecast import noise_plan, parse_units

from .test_cli import run_cli


def test_the_plan_says_what_a_run_of_those_sizes_takes_and_spends(tiny_config, tiny_run, tmp_path):
    # replace-one: the run's sizes are the exact counts, which the plan is given.
    settings = {"target_epsilon": 8.0, "neighbours": "replace-one", "rounds": 2}
    tiny_run(**settings)
    policy = json.loads((tmp_path / "run" / "privacy" / "policy.json").read_text())
    sizes = {site: described["examples"] for site, described in policy["sites"].items()}
    rows = noise_plan(tiny_config(**settings), sizes, [8.0])
    assert [row["site"] for row in rows] == list(sizes)
    for row in rows:
        described = policy["sites"][row["site"]]
        assert row["batch_size"] == described["batch_size"]
        assert row["steps_per_round"] == described["steps_per_round"]
        assert row["noise_multiplier"] == pytest.approx(described["noise_multiplier"])
        assert row["epsilon_by_round"][-1] == pytest.approx(described["planned_epsilon"])
        assert row["epsilon_by_round"][0] < row["epsilon_by_round"][1] <= 8.0


def test_units_are_read_strictly():
    assert parse_units("1520, 1400") == {"site1": 1520, "site2": 1400}
    for bad in ("1520,x", "0", "1.5"):
        done = run_cli("privacy", "plan", "--units", bad)
        assert done.returncode == 2 and "--units" in done.stderr


def test_the_forecast_runs_the_plan_on_public_text_in_sites_of_those_sizes(tmp_path):
    from clinfed.tasks.i2b2.synth import generate

    generate(tmp_path / "public", sites=2, docs=8, seed=3)
    folder = tmp_path / "forecast"
    done = run_cli(
        "privacy", "plan", "--units", "40,30", "--epsilons", "8", "--task", "i2b2",
        "--model", "tiny", "--rounds", "1", "--max-length", "32", "--threads", "1",
        "--public-data", str(tmp_path / "public"), "--forecast", str(folder), "--json",
        "--forecast-draws", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)["forecast"]
    # Each draw deals its own sites of the units asked for, from the public text alone.
    dealt = []
    for draw in (0, 1):
        for site, units in (("site1", 40), ("site2", 30)):
            path = folder / f"public-sites-{draw}" / "train" / site / f"{site}.conll"
            conll = path.read_text()
            assert conll.count("\n\n") + 1 - conll.count("-DOCSTART-") == units
            dealt.append(conll)
    assert dealt[:2] != dealt[2:]
    # Two draws at epsilon 8, one run without DP: the point is the draws'
    # mean, the interval holds every draw, and the cost is against no DP.
    at8, reference = made["forecasts"]["8"], made["forecasts"]["inf"]
    assert len(at8["draws"]) == 2 and len(reference["draws"]) == 1
    assert at8["f1"] == pytest.approx(sum(at8["draws"]) / 2)
    assert at8["low"] < min(at8["draws"]) <= max(at8["draws"]) < at8["high"]
    assert made["site_mentions_estimate"] > 0  # the sites' own scoring error counts too
    assert made["cost_points"]["8"] == pytest.approx(100 * (reference["f1"] - at8["f1"]))
    for draw in (0, 1):
        dp = json.loads((folder / f"runs-{draw}" / "fedavg-eps8-seed0" / "config.json").read_text())
        assert dp["privacy"]["target_epsilon"] == 8.0 and dp["model"]["model"] == "tiny"
    assert not (folder / "runs-1" / "fedavg-epsinf-seed0").exists()
    # A folder in use is refused before anything runs.
    again = run_cli("privacy", "plan", "--units", "40", "--forecast", str(folder),
                    "--public-data", str(tmp_path / "public"))  # fmt: skip
    assert again.returncode == 2 and "already exists" in again.stderr


def test_public_text_missing_a_run_type_is_refused_before_any_folder_is_made(tmp_path):
    # The BC5CDR case: chemicals alone as public text for a run scoring
    # problems and treatments overstated DP's cost by 50 points.
    public = tmp_path / "public"
    public.mkdir()
    sentence = "He\tO\nwas\tO\ngiven\tO\ncisplatin\tB-Chemical\n.\tO\n"
    (public / "chem.conll").write_text("\n".join([sentence] * 200))
    folder = tmp_path / "forecast"
    done = run_cli(
        "privacy", "plan", "--units", "40,30", "--task", "i2b2", "--model", "tiny",
        "--public-data", str(public), "--public-types", "Chemical=treatment",
        "--types", "problem,treatment", "--forecast", str(folder),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "annotates no mention of problem" in done.stderr and "Traceback" not in done.stderr
    assert not folder.exists()
    too_few = run_cli(
        "privacy", "plan", "--units", "4000", "--task", "i2b2", "--model", "tiny",
        "--public-data", str(public), "--public-types", "Chemical=treatment",
        "--types", "treatment", "--forecast", str(folder),
    )  # fmt: skip
    assert too_few.returncode == 2 and "plus at least 50" in too_few.stderr
    assert not folder.exists()
