"""Score i2b2 ``.con`` predictions against a gold corpus (``clinfed score``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.tasks.base import ScoreTable
from clinfed.tasks.i2b2.format import read_con, read_corpus
from clinfed.tasks.i2b2.metrics import score_concepts
from clinfed.tasks.i2b2.schema import CONCEPT_TYPES, PRESET, TypeNames, parse_types, run_types


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
        raise ClinfedError(f"`pred` {pred_dir}: not a folder")
    declared = parse_types(types)
    names = TypeNames(declared) if declared else PRESET
    kinds = run_types(declared.values()) if declared else CONCEPT_TYPES
    gold_docs = [d for d in read_corpus(gold_dir, problems, names) if d.annotated]
    if not gold_docs:
        raise ClinfedError(f"`gold` {gold_dir}: no annotated documents (.con files)")
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


def score_tables(result: dict[str, Any]) -> tuple[list[ScoreTable], list[str]]:
    """``clinfed score``'s tables of :func:`score_i2b2`'s result, and its warnings."""
    rows = [
        (mode, kind, *(f"{s[k]:.4f}" for k in ("precision", "recall", "f1")))
        + (str(s["n_gold"]), str(s["n_pred"]))
        for mode in ("exact", "inexact")
        for kind, s in result[mode].items()
    ]
    columns = ("mode", "type", "precision", "recall", "f1", "gold", "predicted")
    table = ScoreTable(f"i2b2 concepts ({result['documents']} documents)", columns, rows)
    missing = len(result["missing_predictions"])
    warnings = [f"{missing} gold documents have no prediction file"] if missing else []
    return [table], warnings
