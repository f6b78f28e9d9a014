"""Concepts <-> word-level BIO tags, one tag sequence per line (= sentence).

A concept that runs over a line break is tagged ``B-`` on its first token and
``I-`` on every later one, the first token of the next line included. Decoding
reads ``I-X`` at the start of a line as the continuation of a type-``X`` span
that was still open at the end of the previous line, so multi-line concepts
survive the round trip. An ``I-X`` with nothing to continue starts a span (the
usual lenient reading of model output).
"""

from __future__ import annotations

from clinfed.tasks.i2b2.format import Concept, Document, iter_span_tokens
from clinfed.tasks.i2b2.schema import OUTSIDE


def encode_tags(doc: Document) -> list[list[str]]:
    """BIO tags for every token of ``doc``, per line."""
    tags = [[OUTSIDE] * len(tokens) for tokens in doc.lines]
    for concept in doc.concepts:
        (l1, t1), (l2, t2) = concept.start, concept.end
        first = True
        for line_no in range(l1, l2 + 1):
            lo = t1 if line_no == l1 else 0
            hi = t2 if line_no == l2 else len(doc.lines[line_no - 1]) - 1
            for tok in range(lo, hi + 1):
                tags[line_no - 1][tok] = f"{'B' if first else 'I'}-{concept.type}"
                first = False
    return tags


def decode_tags(lines: list[list[str]], tags: list[list[str]]) -> list[Concept]:
    """Concepts from per-line BIO tags (see module docstring for line breaks)."""
    concepts: list[Concept] = []
    open_type: str | None = None
    start = end = (0, 0)

    def close() -> None:
        nonlocal open_type
        if open_type is not None:
            text = " ".join(t.lower() for t in iter_span_tokens(lines, start, end))
            concepts.append(Concept(start, end, open_type, text))
        open_type = None

    for line_no, line_tags in enumerate(tags, start=1):
        for tok, tag in enumerate(line_tags):
            prefix, _, ctype = tag.partition("-")
            if prefix == "I" and ctype == open_type:
                end = (line_no, tok)
                continue
            close()
            if prefix in ("B", "I") and ctype:
                open_type, start, end = ctype, (line_no, tok), (line_no, tok)
        # A span stays open across the line break only if the next line
        # continues it; the check happens at that line's first tag.
    close()
    return concepts
