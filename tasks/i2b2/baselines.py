"""The i2b2 model-free baseline: the floor a trained model must clear.

``dictionary``: every concept string of the training documents with its most
frequent type; test lines are tagged by longest match, left to right.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from clinfed.tasks.i2b2.format import Concept, Document
from clinfed.tasks.i2b2.metrics import score_concepts


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
