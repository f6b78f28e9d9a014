"""Public text labelled from public name lists (``clinfed warm-start
--gazetteer``): the unlabelled listed names of each document become spans
of the list's type; gold spans are never touched."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from clinfed.tasks.i2b2.format import Concept, Document


def label_listed_names(
    documents: list[Document], gazetteer: Any, types: dict[str, str]
) -> dict[str, int]:
    """Label, in place, every listed name of a list in ``types`` (list name
    -> run type) that no gold span covers (the longest name first); returns
    the spans added per run type."""
    from clinfed.lexicon.terminology import distant_spans

    found: Counter = Counter()
    for document in documents:
        taken: dict[int, set[int]] = defaultdict(set)
        for concept in document.concepts:
            (first_line, first), (last_line, last) = concept.start, concept.end
            for number in range(first_line, last_line + 1):
                width = len(document.lines[number - 1])
                low = first if number == first_line else 0
                high = last if number == last_line else width - 1
                taken[number].update(range(low, high + 1))
        for number, words in enumerate(document.lines, start=1):
            mask = [i in taken[number] for i in range(len(words))]
            for first, size, kind in distant_spans(words, mask, gazetteer):
                if kind in types:
                    end = first + size - 1
                    text = " ".join(w.lower() for w in words[first : end + 1])
                    document.concepts.append(
                        Concept((number, first), (number, end), types[kind], text)
                    )
                    found[types[kind]] += 1
        document.concepts.sort(key=lambda c: (c.start, c.end))
    return dict(found)
