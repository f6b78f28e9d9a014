"""Progress events are typed: one dataclass per event, reported by every
runner; the Python API hands them on as (name, info)."""

from __future__ import annotations

from clinfed.core import events
from clinfed.core.runs import read_jsonl
from clinfed.runners.pipeline import run_training


def test_a_run_reports_typed_events_that_carry_its_records(tiny_config, tmp_path):
    seen: list[events.Event] = []
    run_training(tiny_config(rounds=2, target_epsilon=8.0), seen.append)
    kinds = [type(e) for e in seen]
    assert kinds[0] is events.Loaded and seen[0].sites == ["beth", "partners", "site3"]
    assert {events.SiteStart, events.SiteStep, events.SiteEnd, events.RoundEnd} <= set(kinds)
    # A round's event is its record of metrics.jsonl, as the file holds it.
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    rounds = [e.info() for e in seen if isinstance(e, events.RoundEnd)]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r in records for r in rounds)
    ends = [e for e in seen if isinstance(e, events.SiteEnd)]
    assert {e["site"] for e in ends} == {"beth", "partners", "site3"}
    # The API's form: each event as its name and its fields.
    pairs: list[tuple[str, dict]] = []
    for event in seen:
        events.as_pairs(lambda name, info: pairs.append((name, info)))(event)
    assert pairs[0] == ("loaded", seen[0].info()) and ("round_end", rounds[0]) in pairs
    assert len({type(e).name for e in seen}) == len(set(kinds))  # one name per kind
