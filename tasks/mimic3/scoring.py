"""Score a MIMIC-III ``predictions.csv`` against a gold corpus (``clinfed score``)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.tasks.mimic3.metrics import multilabel_metrics


def score_mimic3(
    gold_codes: dict[Any, list[str]], pred_file: Path, problems: ProblemLog
) -> dict[str, Any]:
    """CAML metrics of a ``predictions.csv`` (HADM_ID, CODES, P_<code>...)
    against ``gold_codes`` (each admission's gold codes, read by the task).

    The label set is the file's ``P_`` columns; without them, the codes that
    appear in the gold admissions or the predictions (AUC then uses 0/1).
    """
    pred_file = Path(pred_file)
    if not pred_file.is_file():
        raise ClinfedError(f"`pred` {pred_file}: not a file")
    rows = []
    with open(pred_file, encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if not header or header[0].strip().upper() != "HADM_ID" or len(header) < 2:
            raise ClinfedError(f"{pred_file}:1: header must start with HADM_ID,CODES")
        labels = [h[2:] for h in header[2:] if h.startswith("P_")]
        for values in reader:
            line = reader.line_num
            if not values:
                continue
            if not values[0].strip().isdigit():
                problems.add(pred_file, line, "HADM_ID is not an integer")
                continue
            hadm = int(values[0])
            if hadm not in gold_codes:
                problems.add(pred_file, line, "HADM_ID not among the gold admissions")
                continue
            try:
                probs = [float(v) for v in values[2 : 2 + len(labels)]]
            except ValueError:
                problems.add(pred_file, line, "a probability is not a number")
                continue
            predicted = [c for c in values[1].split(";") if c]
            rows.append((hadm, predicted, probs))
    problems.raise_if_any()
    if not rows:
        raise ClinfedError(f"{pred_file}: no predictions")
    if not labels:
        labels = sorted(
            {c for h, p, _ in rows for c in p} | {c for h, _, _ in rows for c in gold_codes[h]}
        )
    index = {c: i for i, c in enumerate(labels)}
    y_true = np.zeros((len(rows), len(labels)), dtype=int)
    scores = np.zeros((len(rows), len(labels)))
    for i, (hadm, predicted, probs) in enumerate(rows):
        for code in gold_codes[hadm]:
            if code in index:
                y_true[i, index[code]] = 1
        if probs:
            scores[i, :] = probs
        else:
            for code in predicted:
                scores[i, index[code]] = 1.0
    ks = (5,) if len(labels) <= 50 else (8, 15)
    result = multilabel_metrics(y_true, scores, ks=ks)
    result["admissions"] = len(rows)
    result["labels"] = len(labels)
    return result
