"""Multi-label metrics for ICD-9 coding, as in CAML (Mullenbach et al., 2018).

* micro F1 over all (admission, code) decisions;
* macro F1 two ways: CAML's harmonic mean of macro-precision and
  macro-recall (``macro_f1``), and the mean of per-label F1
  (``macro_f1_mean``), which is what scikit-learn calls macro;
* micro AUC over all decisions, macro AUC averaged over the labels that have
  both a positive and a negative example in the evaluation set;
* P@k: the share of the k highest-scored codes per admission that are right.
"""

from __future__ import annotations

import numpy as np


def precision_at_k(y_true: np.ndarray, scores: np.ndarray, k: int) -> float:
    """Mean over admissions of (true codes among the top k scores) / k."""
    k = min(k, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    hits = np.take_along_axis(y_true, top, axis=1).sum(axis=1)
    return float(np.mean(hits / k))


# A code is predicted when its probability is at least this.
THRESHOLD = 0.5


def multilabel_metrics(
    y_true: np.ndarray, scores: np.ndarray, threshold: float = THRESHOLD, ks: tuple[int, ...] = (5,)
) -> dict[str, float]:
    """All CAML metrics for binary targets ``y_true`` and scores in [0, 1].

    Parameters
    ----------
    y_true
        ``(n_admissions, n_labels)`` array of 0/1.
    scores
        Same shape; probabilities. A code is predicted when its score is at
        least ``threshold``.
    ks
        The k of each P@k to report (5 for top-50; 8 and 15 for the full set).
    """
    # Imported here: scikit-learn adds over half a second to the start of
    # every process that imports the tasks (each Flower message's).
    from sklearn.metrics import f1_score, precision_score, recall_score, roc_auc_score

    y_true = np.asarray(y_true, dtype=int)
    scores = np.asarray(scores, dtype=float)
    y_pred = (scores >= threshold).astype(int)
    kw = {"zero_division": 0}
    macro_p = precision_score(y_true, y_pred, average="macro", **kw)
    macro_r = recall_score(y_true, y_pred, average="macro", **kw)
    out = {
        "micro_precision": float(precision_score(y_true, y_pred, average="micro", **kw)),
        "micro_recall": float(recall_score(y_true, y_pred, average="micro", **kw)),
        "micro_f1": float(f1_score(y_true, y_pred, average="micro", **kw)),
        "macro_precision": float(macro_p),
        "macro_recall": float(macro_r),
        "macro_f1": float(2 * macro_p * macro_r / (macro_p + macro_r))
        if macro_p + macro_r
        else 0.0,
        "macro_f1_mean": float(f1_score(y_true, y_pred, average="macro", **kw)),
    }
    flat_true = y_true.ravel()
    out["micro_auc"] = (
        float(roc_auc_score(flat_true, scores.ravel()))
        if 0 < flat_true.sum() < flat_true.size
        else 0.0
    )
    per_label = [
        roc_auc_score(y_true[:, j], scores[:, j])
        for j in range(y_true.shape[1])
        if 0 < y_true[:, j].sum() < y_true.shape[0]
    ]
    out["macro_auc"] = float(np.mean(per_label)) if per_label else 0.0
    for k in ks:
        out[f"p_at_{k}"] = precision_at_k(y_true, scores, k)
    out["f1"] = out["micro_f1"]
    return out
