"""What a federated run writes when it ends: ``RUN/summary.json`` (the
last record, communication totals, each site's epsilon as its ledger
reported it) and ``RUN/privacy/`` (the ledgers and policy the sites
reported)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clinfed.core.runs import atomic_write_json, atomic_write_text


def write_summary(
    out: Path,
    last_record: dict[str, Any],
    full_bytes: int,
    ledgers: dict[str, dict[str, Any]],
    stopped: str | None,
) -> dict[str, Any]:
    """Write and return ``RUN/summary.json``: the last evaluation record,
    the bytes every site sent and received against FedAvg's, and under DP
    each site's epsilon as its ledger reported it."""
    from clinfed.core.runs import read_jsonl

    sites = [r for r in read_jsonl(out / "metrics.jsonl") if "bytes_up" in r]
    up = sum(r["bytes_up"] for r in sites)
    down = sum(r["bytes_down"] for r in sites)
    fedavg = full_bytes * len(sites)
    summary = dict(last_record) | {
        "mb_up": up / 1e6,
        "mb_down": down / 1e6,
        "fedavg_mb_up": fedavg / 1e6,
        "ratio_to_fedavg_up": up / fedavg if fedavg else 0.0,
    }
    if stopped:
        summary["stopped"] = stopped
    if ledgers:
        summary["epsilon"] = {
            site: (ledger["lines"][-1]["epsilon"] if ledger["lines"] else 0.0)
            for site, ledger in sorted(ledgers.items())
        }
        summary["epsilon_reported_by_sites"] = True
        summary["delta"] = next(iter(ledgers.values()))["policy"]["delta"]
        reproducible = [
            line["not_private"]
            for ledger in ledgers.values()
            for line in ledger["lines"]
            if line.get("not_private")
        ]
        if reproducible:
            summary["not_private"] = reproducible[0]
    from clinfed.core.provenance import provenance

    summary |= provenance()
    atomic_write_json(out / "summary.json", summary)
    return summary


def write_privacy(out: Path, ledgers: dict[str, dict[str, Any]]) -> None:
    """``RUN/privacy/``: the sites' ledgers as they reported them (each site
    keeps its own), marked so, and the policy as the sites described it."""
    if not ledgers:
        return
    folder = out / "privacy"
    folder.mkdir(parents=True, exist_ok=True)
    sites = {}
    common: dict[str, Any] = {}
    for site, ledger in sorted(ledgers.items()):
        lines = [line | {"reported_by_site": True} for line in ledger["lines"]]
        text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
        atomic_write_text(folder / f"{site}.jsonl", text)
        sites[site] = ledger["site"] | {"budget": ledger.get("budget")}
        common = ledger["policy"]
    atomic_write_json(folder / "policy.json", common | {"sites": sites, "reported_by_sites": True})
