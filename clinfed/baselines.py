"""Model-free baselines: the floor a trained model must clear.

* ``dictionary`` (i2b2): every concept string of the training documents with
  its most frequent type; test lines are tagged by longest match, left to
  right.
* ``frequency`` (mimic3): every admission gets the training set's most
  frequent codes, as many as an average admission has.
* ``keyword`` (mimic3): word n-grams (1 to 3) mined from training notes that
  predict a code with precision >= 0.5 in at least 3 admissions; a code is
  predicted when any of its n-grams occurs in the note.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from clinfed.tasks.i2b2.format import Concept, Document
from clinfed.tasks.i2b2.metrics import score_concepts
from clinfed.tasks.mimic3.metrics import multilabel_metrics

_WORD = re.compile(r"[a-z0-9][a-z0-9\-/]*")


def dictionary_concepts(
    train: Iterable[Document], test: Iterable[Document]
) -> dict[str, list[Concept]]:
    """Longest-match dictionary tagging of ``test`` with ``train``'s concepts."""
    types: dict[tuple[str, ...], Counter] = defaultdict(Counter)
    for doc in train:
        for concept in doc.concepts:
            types[tuple(concept.text.split())][concept.type] += 1
    lexicon = {key: counts.most_common(1)[0][0] for key, counts in types.items()}
    longest = max((len(k) for k in lexicon), default=0)
    predicted: dict[str, list[Concept]] = {}
    for doc in test:
        found = []
        for line_no, tokens in enumerate(doc.lines, start=1):
            lowered = [t.lower() for t in tokens]
            i = 0
            while i < len(lowered):
                for size in range(min(longest, len(lowered) - i), 0, -1):
                    key = tuple(lowered[i : i + size])
                    if key in lexicon:
                        found.append(
                            Concept(
                                (line_no, i), (line_no, i + size - 1), lexicon[key], " ".join(key)
                            )
                        )
                        i += size
                        break
                else:
                    i += 1
        predicted[doc.doc_id] = found
    return predicted


def i2b2_dictionary(train: list[Document], test: list[Document], types: Sequence[str] = ()) -> dict:
    """Scores of the dictionary baseline on ``test`` (same keys as ``clinfed
    score``; per type for ``types`` and any other type found)."""
    gold = {d.doc_id: d.concepts for d in test if d.annotated}
    predicted = dictionary_concepts(train, [d for d in test if d.annotated])
    scores = score_concepts(gold, predicted, types)
    return {
        "f1": scores["exact"]["micro"]["f1"],
        "inexact_f1": scores["inexact"]["micro"]["f1"],
        "scores": scores,
    }


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
