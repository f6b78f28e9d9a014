"""MIMIC-III model-free baselines: the floor a trained model must clear.

* ``frequency``: every admission gets the training set's most frequent
  codes, as many as an average admission has.
* ``keyword``: word n-grams (1 to 3) mined from training notes that predict
  a code with precision >= 0.5 in at least 3 admissions; a code is predicted
  when any of its n-grams occurs in the note.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

from clinfed.tasks.mimic3.metrics import multilabel_metrics

_WORD = re.compile(r"[a-z0-9][a-z0-9\-/]*")


def _targets(code_lists: Iterable[list[str]], labels: list[str]) -> np.ndarray:
    index = {c: i for i, c in enumerate(labels)}
    rows = []
    for codes in code_lists:
        row = np.zeros(len(labels), dtype=int)
        for code in codes:
            if code in index:
                row[index[code]] = 1
        rows.append(row)
    return np.stack(rows) if rows else np.zeros((0, len(labels)), dtype=int)


def mimic3_frequency(
    train_codes: list[list[str]],
    test_codes: list[list[str]],
    labels: list[str],
    ks: tuple[int, ...] = (5,),
) -> dict:
    """Scores of predicting the most frequent codes for every admission."""
    y_train, y_test = _targets(train_codes, labels), _targets(test_codes, labels)
    prevalence = y_train.mean(axis=0)
    m = max(1, round(float(y_train.sum(axis=1).mean())))
    top = np.argsort(-prevalence, kind="stable")[:m]
    # Scores keep the prevalence ranking (for AUC and P@k); the top m sit
    # above the 0.5 threshold, the rest below.
    row = prevalence / 2
    row[top] += 0.5
    return multilabel_metrics(y_test, np.tile(row, (len(y_test), 1)), ks=ks)


def _ngrams(text: str, n_max: int = 3) -> set[str]:
    words = _WORD.findall(text.lower())
    return {
        " ".join(words[i : i + n]) for n in range(1, n_max + 1) for i in range(len(words) - n + 1)
    }


def mimic3_keyword(
    train_texts: list[str],
    train_codes: list[list[str]],
    test_texts: list[str],
    test_codes: list[list[str]],
    labels: list[str],
    ks: tuple[int, ...] = (5,),
    min_precision: float = 0.5,
    min_support: int = 3,
) -> dict:
    """Scores of mined keyword lookup (see module docstring)."""
    y_train, y_test = _targets(train_codes, labels), _targets(test_codes, labels)
    seen: Counter = Counter()
    together: dict[str, Counter] = defaultdict(Counter)
    for text, row in zip(train_texts, y_train):
        grams = _ngrams(text)
        seen.update(grams)
        for j in np.flatnonzero(row):
            together[labels[j]].update(grams)
    keywords: dict[str, dict[str, float]] = {}
    for code in labels:
        keywords[code] = {
            g: hits / seen[g]
            for g, hits in together[code].items()
            if hits >= min_support and hits / seen[g] >= min_precision
        }
    scores = np.zeros(y_test.shape, dtype=float)
    for i, text in enumerate(test_texts):
        grams = _ngrams(text)
        for j, code in enumerate(labels):
            matched = [p for g, p in keywords[code].items() if g in grams]
            # A match predicts the code (score >= 0.5); the best precision
            # ranks codes for AUC and P@k.
            scores[i, j] = max(matched) if matched else 0.0
    return multilabel_metrics(y_test, scores, ks=ks)
