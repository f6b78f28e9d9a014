"""Score prediction files against a gold corpus (``clinfed score``)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.tasks.i2b2.format import read_con, read_corpus
from clinfed.tasks.i2b2.metrics import score_concepts
from clinfed.tasks.i2b2.schema import CONCEPT_TYPES, PRESET, TypeNames, parse_types, run_types
from clinfed.tasks.mimic3.adapter import Mimic3Task
from clinfed.tasks.mimic3.metrics import multilabel_metrics


def score_i2b2(
    gold_dir: Path, pred_dir: Path, problems: ProblemLog, types: str | None = None
) -> dict[str, Any]:
    """Exact and inexact scores of the ``.con`` files under ``pred_dir``.

    Types are the i2b2 preset's unless ``types`` declares others (as
    ``--types`` does for training: ``Disease,Chemical``).

    Predicted files pair with gold documents by file stem and are validated
    against the gold text. Every gold document needs a predicted file (an
    empty one predicts no concept); a missing one is an error, or with
    ``--on-error skip`` scored as predicting nothing and reported
    (``missing_predictions``).
    """
    pred_dir = Path(pred_dir)
    if not pred_dir.is_dir():
        raise ClinfedError(f"--pred {pred_dir}: not a folder")
    declared = parse_types(types)
    names = TypeNames(declared) if declared else PRESET
    kinds = run_types(declared.values()) if declared else CONCEPT_TYPES
    gold_docs = [d for d in read_corpus(gold_dir, problems, names) if d.annotated]
    if not gold_docs:
        raise ClinfedError(f"--gold {gold_dir}: no annotated documents (.con files)")
    by_stem = {d.doc_id: d for d in gold_docs}
    predicted: dict[str, list] = {}
    for path in sorted(pred_dir.rglob("*.con")):
        doc = by_stem.get(path.stem)
        if doc is None:
            problems.add(path, None, "no gold document with this name")
            continue
        if path.stem in predicted:
            problems.add(path, None, "second prediction file for the same document")
            continue
        predicted[path.stem] = read_con(path, doc.lines, problems, names)
    for stem in sorted(set(by_stem) - set(predicted)):
        problems.add(
            by_stem[stem].con_path,
            None,
            f"no prediction ({stem}.con) under --pred {pred_dir} for this gold document",
        )
    problems.raise_if_any()
    gold = {d.doc_id: d.concepts for d in gold_docs}
    result: dict[str, Any] = dict(score_concepts(gold, predicted, kinds))
    result["documents"] = len(gold)
    result["missing_predictions"] = sorted(set(gold) - set(predicted))
    return result


def score_mimic3(
    gold_dir: Path, pred_file: Path, codes: str, problems: ProblemLog
) -> dict[str, Any]:
    """CAML metrics of a ``predictions.csv`` (HADM_ID, CODES, P_<code>...).

    The label set is the file's ``P_`` columns; without them, the codes that
    appear in the gold admissions or the predictions (AUC then uses 0/1).
    """
    pred_file = Path(pred_file)
    if not pred_file.is_file():
        raise ClinfedError(f"--pred {pred_file}: not a file")
    task = Mimic3Task(codes=codes)
    gold = task.read_documents(Path(gold_dir), problems)
    gold_codes = dict(zip(gold["hadm_id"], gold["codes"]))
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
