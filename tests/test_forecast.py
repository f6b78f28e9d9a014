"""clinfed privacy plan: what each budget buys, from the sites' sizes alone,
and an F1 forecast measured on public text dealt into sites of those sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clinfed.forecast import noise_plan, parse_units

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
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)["forecast"]
    # Each site holds the units asked for, drawn from the public text alone.
    for site, units in (("site1", 40), ("site2", 30)):
        conll = (folder / "public-sites" / "train" / site / f"{site}.conll").read_text()
        assert conll.count("\n\n") + 1 - conll.count("-DOCSTART-") == units
    assert set(made["f1"]) == {"8", "inf"} and all(f is not None for f in made["f1"].values())
    assert made["cost_points"]["8"] == pytest.approx(100 * (made["f1"]["inf"] - made["f1"]["8"]))
    dp = json.loads((folder / "runs" / "fedavg-eps8-seed0" / "config.json").read_text())
    assert dp["privacy"]["target_epsilon"] == 8.0 and dp["model"]["model"] == "tiny"
    # A folder in use is refused before anything runs.
    again = run_cli("privacy", "plan", "--units", "40", "--forecast", str(folder),
                    "--public-data", str(tmp_path / "public"))  # fmt: skip
    assert again.returncode == 2 and "already exists" in again.stderr
    assert Path(folder / "runs" / "sweep.csv").is_file()
