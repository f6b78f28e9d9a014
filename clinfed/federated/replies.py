"""What the server takes from a site's reply: the checks every training
reply passes before it is summed (its record, then its tensors), and the
round's metrics from the sites' summed evaluation counts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from clinfed.federated.messages import Reply


def check_upload(
    upload: Mapping[str, torch.Tensor],
    allowed: frozenset[str],
    global_state: Mapping[str, torch.Tensor],
) -> str | None:
    """Why an upload must not be averaged in (``None``: it may).

    Rejected: names outside the round's envelope, shapes or dtypes other than
    the global model's, and any NaN or Inf.
    """
    unexpected = sorted(set(upload) - allowed)
    if unexpected:
        return f"unexpected parameter {unexpected[0]} ({len(unexpected)} in all)"
    for name, value in upload.items():
        reference = global_state[name]
        if tuple(value.shape) != tuple(reference.shape):
            return f"{name}: shape {tuple(value.shape)}, expected {tuple(reference.shape)}"
        if value.dtype != reference.dtype:
            return f"{name}: dtype {value.dtype}, expected {reference.dtype}"
        if not bool(torch.isfinite(value).all()):
            return f"{name}: NaN or Inf"
    return None


# The most privacy units (sentences, admissions, notes) one site may weigh
# its update by: far above any hospital's, and a bound a forged reply meets.
MAX_UNITS = 100_000_000


def check_record(reply: Reply) -> str | None:
    """Why a training reply's record must not be aggregated (``None``: it
    may): no record, or a weight that is not a positive count of units
    within :data:`MAX_UNITS` and, under DP, the count its policy states."""
    record = reply.record
    if not isinstance(record, dict):
        return "reply without a site record"
    if "refused" in record:
        return None
    examples = record.get("examples")
    if not isinstance(examples, int) or isinstance(examples, bool) or examples < 1:
        return "reply without a positive number of examples"
    if examples > MAX_UNITS:
        return f"reply weighs its update by {examples} units, above the {MAX_UNITS:,} a site may"
    # Under DP the site's policy states the units its accounting counts; its
    # weight is that count, never more (a larger weight would let one site
    # outweigh the others beyond what it trained on).
    declared = ((reply.ledger or {}).get("site") or {}).get("examples")
    if declared is not None and examples != declared:
        return f"reply weighs its update by {examples} units; its privacy policy counts {declared}"
    return None


def summed_evaluation(task: Any, evaluations: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """A round's metrics from each site's evaluation counts (``(site,
    evaluation)``), summed: the task's metrics per variant (exact, inexact,
    ...), each site's F1, the slowest site's seconds. Counts, never examples,
    leave a site."""
    totals: dict[str, dict[str, list[float]]] = {}
    per_site: dict[str, dict[str, float]] = {}
    seconds = 0.0
    for site, evaluation in sorted(evaluations):
        seconds = max(seconds, float(evaluation.get("seconds", 0.0)))
        for variant, counts in evaluation["counts"].items():
            per_site.setdefault(variant, {})[site] = task.metrics_from_counts(counts)["f1"]
            total = totals.setdefault(variant, {})
            for key, values in counts.items():
                total[key] = (
                    [a + b for a, b in zip(total[key], values)] if key in total else list(values)
                )
    record: dict[str, Any] = {}
    for variant in sorted(totals):
        metrics = task.metrics_from_counts(totals[variant])
        prefix = f"{variant}_" if variant else ""
        if variant:
            metrics = {"f1": metrics["f1"]}
        record |= {prefix + k: v for k, v in metrics.items()}
        record[prefix + "per_site_f1"] = per_site[variant]
    # A round nobody evaluated has no F1 (never 0): it says so instead.
    if not evaluations:
        record["not_evaluated"] = "no site evaluated this round's model"
    return record | {"eval_seconds": seconds, "evaluated_sites": len(evaluations)}
