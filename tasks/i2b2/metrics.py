"""i2b2 2010 concept scoring: exact and inexact, micro and per type.

* exact: a predicted concept is correct when its span (start and end, in
  line:token positions) and its type equal a gold concept's.
* inexact: a gold concept is found when some predicted concept of the same
  type overlaps it (recall); a predicted concept is correct when it overlaps
  some gold concept of the same type (precision). This is the i2b2 2010
  "inexact" definition, so one boundary error costs a whole concept under
  exact scoring and nothing under inexact.

seqeval scores BIO sequences line by line; it cannot see concepts that run
over a line break and has no overlap mode, so spans are scored here directly
(tests check the two agree on single-line concepts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clinfed.tasks.i2b2.format import Concept


def prf(correct_pred: int, n_pred: int, found_gold: int, n_gold: int) -> dict[str, float]:
    """Precision, recall, F1 from counts (0 where undefined)."""
    precision = correct_pred / n_pred if n_pred else 0.0
    recall = found_gold / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "n_gold": n_gold, "n_pred": n_pred}


def _overlaps(a: Concept, b: Concept) -> bool:
    return a.start <= b.end and b.start <= a.end


def _counts(gold: Sequence[Concept], pred: Sequence[Concept], exact: bool) -> tuple[int, int]:
    """(correct predictions, found gold concepts) within one document and type."""
    if exact:
        hits = len({(c.start, c.end) for c in gold} & {(c.start, c.end) for c in pred})
        return hits, hits
    correct = sum(any(_overlaps(p, g) for g in gold) for p in pred)
    found = sum(any(_overlaps(g, p) for p in pred) for g in gold)
    return correct, found


def score_concepts(
    gold: Mapping[str, Sequence[Concept]],
    pred: Mapping[str, Sequence[Concept]],
    types: Sequence[str] = (),
) -> dict[str, dict[str, dict[str, float]]]:
    """Score predicted against gold concepts, keyed by document id.

    Per-type scores cover ``types`` (the run's, in order, each present even
    with no concept) and then any other type found in ``gold`` or ``pred``.

    Returns
    -------
    dict
        ``{"exact": {"micro": {...}, "problem": {...}, ...}, "inexact": {...}}``
        where each leaf holds ``precision``, ``recall``, ``f1``, ``n_gold`` and
        ``n_pred``. Documents missing from ``pred`` count as predicting nothing.
    """
    result: dict[str, dict[str, dict[str, float]]] = {}
    found = {c.type for concepts in (*gold.values(), *pred.values()) for c in concepts}
    all_types = list(dict.fromkeys(types)) + sorted(found - set(types))
    for mode in ("exact", "inexact"):
        totals = dict.fromkeys(("correct", "pred", "found", "gold"), 0)
        per_type = {}
        for ctype in all_types:
            correct = n_pred = found = n_gold = 0
            for doc_id in set(gold) | set(pred):
                g = [c for c in gold.get(doc_id, ()) if c.type == ctype]
                p = [c for c in pred.get(doc_id, ()) if c.type == ctype]
                c_pred, c_gold = _counts(g, p, exact=mode == "exact")
                correct, found = correct + c_pred, found + c_gold
                n_pred, n_gold = n_pred + len(p), n_gold + len(g)
            per_type[ctype] = prf(correct, n_pred, found, n_gold)
            for key, value in zip(
                ("correct", "pred", "found", "gold"), (correct, n_pred, found, n_gold)
            ):
                totals[key] += value
        micro = prf(totals["correct"], totals["pred"], totals["found"], totals["gold"])
        result[mode] = {"micro": micro, **per_type}
    return result


def summable_counts(scores: dict[str, Any]) -> dict[str, list[float]]:
    """Per mode (exact, inexact): [correct predictions, predictions, found
    gold, gold], from :func:`score_concepts`'s scores: what sums over sites."""
    counts = {}
    for mode in ("exact", "inexact"):
        micro = scores[mode]["micro"]
        n_pred, n_gold = micro["n_pred"], micro["n_gold"]
        counts[mode] = [
            round(micro["precision"] * n_pred),
            n_pred,
            round(micro["recall"] * n_gold),
            n_gold,
        ]
    return counts


def f1_by_site(
    records: list[Any], gold: dict[str, list], predicted: dict[str, list], types: Any
) -> dict[str, float]:
    """Exact micro F1 of each site's annotated documents."""
    per_site = {}
    for site in sorted({d.site for d in records}):
        ids = [d.doc_id for d in records if d.site == site and d.annotated]
        site_scores = score_concepts(
            {k: gold[k] for k in ids}, {k: predicted[k] for k in ids}, types
        )
        per_site[site] = site_scores["exact"]["micro"]["f1"]
    return per_site
