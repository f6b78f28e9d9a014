"""Public text as sentences to deal out to forecast sites (``clinfed
privacy plan``): each unit a line with the spans on it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from clinfed.core.errors import ProblemLog
from clinfed.tasks.i2b2.convert import write_documents
from clinfed.tasks.i2b2.format import Concept, Document

# One public sentence: its words and its spans as (first, last, type).
Unit = tuple[list[str], list[tuple[int, int, str]]]


def read_units(reader, folder: Path, problems: ProblemLog) -> list[Unit]:
    """Every non-empty annotated line of ``folder`` (read by ``reader``,
    its types mapped), with the spans that lie on it."""
    corpus = reader.load(folder, problems)
    units = []
    for document in (*corpus.train, *corpus.test):
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for concept in document.concepts:
            if concept.start[0] == concept.end[0]:  # CoNLL closes a span at a line's end
                spans.setdefault(concept.start[0], []).append(
                    (concept.start[1], concept.end[1], concept.type)
                )
        for number, words in enumerate(document.lines, start=1):
            if words:
                units.append((list(words), spans.get(number, [])))
    return units


def mentions(units: list[Unit]) -> dict[str, int]:
    """Gold mentions per type in ``units``."""
    return dict(Counter(kind for _, spans in units for _, _, kind in spans))


def _document(site: str, units: list[Unit]) -> Document:
    lines = [words for words, _ in units]
    concepts = [
        Concept((number, first), (number, last), kind, " ".join(words[first : last + 1]).lower())
        for number, (words, spans) in enumerate(units, start=1)
        for first, last, kind in spans
    ]
    return Document(f"{site}-public", site, lines, concepts, con_path=Path("(public)"))


def write_units(sites: dict[str, list[Unit]], test: list[Unit], out: Path) -> None:
    """``out/train/<site>/`` with each site's units and ``out/test/<site>/``
    with an equal share of ``test`` each, as CoNLL."""
    names = list(sites)
    share = -(-len(test) // len(names))
    write_documents([_document(s, units) for s, units in sites.items()], out / "train", "conll")
    held = [_document(s, test[i * share : (i + 1) * share]) for i, s in enumerate(names)]
    write_documents([d for d in held if d.lines], out / "test", "conll")
