"""BRAT standoff (``.txt`` + ``.ann``) as concept-extraction documents.

The format most hospital annotation projects export. A document is a
``.txt`` and the ``.ann`` beside it with the same stem. Only text-bound
annotations become concepts::

    T1<TAB>Disease 10 25<TAB>renal failure
    T2<TAB>Chemical 0 7;12 20<TAB>aspirin ... (a discontinuous span)

* Offsets are character offsets into the ``.txt`` (end exclusive). Each line
  of the text is a sentence and its whitespace-separated words its tokens,
  as in i2b2.
* A span covers the tokens it touches: an offset inside a word extends the
  span to that word's edge (BRAT annotators often mark part of a token such
  as ``Parkinson's``).
* A discontinuous span (``start end;start end``) becomes one concept per
  fragment, each of the annotation's type: token tagging cannot express a
  gap, and scoring then credits each piece found.
* Relations, events, attributes, normalizations and notes (``R``, ``E``,
  ``A``/``M``, ``N``, ``#``) are skipped and counted (:data:`SKIPPED`
  holds the counts of the last read; ``data check`` shows them).
* Problems name the ``.ann`` file and line and never quote text: an offset
  past the text or reversed, a span whose text field does not match the
  ``.txt`` at its offsets, a type a declared ``--types``
  does not list, bytes that are not UTF-8, a ``.ann`` without its ``.txt``.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.tasks.i2b2.conll import site_folder
from clinfed.tasks.i2b2.format import (
    Concept,
    Document,
    _by_stem,
    _files,
    decode_utf8,
    drop_overlaps,
    split_lines,
)
from clinfed.tasks.i2b2.schema import TypeNames

_TEXT_BOUND = re.compile(r"^(T\d+)\t(\S+) (\d+ \d+(?:;\d+ \d+)*)\t(.*)$")
KINDS = {"R": "relations", "E": "events", "A": "attributes", "M": "attributes",
         "N": "normalizations", "#": "notes", "*": "equivalences"}  # fmt: skip
SKIPPED: Counter[str] = Counter()


def _token_offsets(text: str) -> list[list[tuple[int, int]]]:
    """(start, end) character offsets of every token, per line."""
    offsets, position = [], 0
    for raw in text.split("\n"):
        line = [(m.start() + position, m.end() + position) for m in re.finditer(r"\S+", raw)]
        offsets.append(line)
        position += len(raw) + 1
    return offsets


def _locate(
    offsets: list[list[tuple[int, int]]], start: int, end: int
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(line, token) of the first and last tokens the span [start, end) touches."""
    touched = [
        (line_no, tok)
        for line_no, line in enumerate(offsets, start=1)
        for tok, (lo, hi) in enumerate(line)
        if lo < end and start < hi
    ]
    return (touched[0], touched[-1]) if touched else None


def read_brat(
    root: Path | str, problems: ProblemLog, names: TypeNames = TypeNames(open=True)
) -> list[Document]:
    """Every ``.txt`` + ``.ann`` document under ``root`` (see the module
    docstring); entity type names resolved by ``names`` (kept by default)."""
    root = Path(root)
    if not root.is_dir():
        raise ClinfedError(f"{root}: not a folder")
    SKIPPED.clear()
    txts = _by_stem(_files(root, ".txt", problems), problems)
    anns = _by_stem(_files(root, ".ann", problems), problems)
    for stem, path in sorted(anns.items()):
        if stem not in txts:
            problems.add(path, None, ".ann file without a matching .txt file")
    if not anns:
        problems.add(root, None, "no BRAT annotation files (.ann) found")
    documents = []
    for stem, txt_path in sorted(txts.items()):
        text = decode_utf8(txt_path, problems)
        if text is None:
            continue
        doc = Document(stem, site_folder(txt_path, root), split_lines(text), txt_path=txt_path)
        if stem in anns:
            doc.con_path = anns[stem]
            doc.concepts = _read_ann(anns[stem], text, doc, problems, names)
        documents.append(doc)
    problems.raise_if_any()
    documents.sort(key=lambda d: (d.site, d.doc_id))
    return documents


def _read_ann(
    path: Path,
    text: str,
    doc: Document,
    problems: ProblemLog,
    names: TypeNames,
) -> list[Concept]:
    ann = decode_utf8(path, problems)
    if ann is None:
        return []
    offsets = _token_offsets(text.replace("\r", " "))
    concepts: list[Concept] = []
    for line_no, raw in enumerate(ann.split("\n"), start=1):
        raw = raw.rstrip("\r")
        if not raw.strip():
            continue
        if not raw.startswith("T"):
            kind = KINDS.get(raw[:1])
            if kind is None:
                problems.add(path, line_no, "not a BRAT annotation line")
            else:
                SKIPPED[kind] += 1
            continue
        match = _TEXT_BOUND.match(raw)
        if match is None:
            problems.add(path, line_no, "malformed text-bound annotation (T<n> TYPE START END)")
            continue
        fragments = [tuple(map(int, pair.split())) for pair in match[3].split(";")]
        if any(not 0 <= lo < hi <= len(text) for lo, hi in fragments):
            problems.add(path, line_no, f"offsets outside the text (0-{len(text)}) or reversed")
            continue
        # (a line break inside a span is written as a space in the text field)
        if " ".join(text[lo:hi] for lo, hi in fragments).replace("\n", " ") != match[4]:
            problems.add(path, line_no, "the span text does not match the .txt at these offsets")
            continue
        ctype = names.resolve(match[2], path, line_no, problems)
        if ctype is None:
            continue
        for lo, hi in fragments:
            located = _locate(offsets, lo, hi)
            if located is None:
                problems.add(path, line_no, "a span with no word in it (only whitespace)")
                continue
            start, end = located
            concepts.append(Concept(start, end, ctype, doc.span_text(start, end), line_no))
    return drop_overlaps(concepts, path, problems)
