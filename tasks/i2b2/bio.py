"""Concepts <-> word-level BIO tags, one tag sequence per line (= sentence).

A concept that runs over a line break is tagged ``B-`` on its first token and
``I-`` on every later one, the first token of the next line included. Decoding
reads ``I-X`` at the start of a line as the continuation of a type-``X`` span
that was still open at the end of the previous line, so multi-line concepts
survive the round trip. An ``I-X`` with nothing to continue starts a span (the
usual lenient reading of model output).

:func:`best_valid_tags` reads a model's scores as the best tag sequence that
is valid BIO within a window (``I-X`` only after ``B-X`` or ``I-X``): argmax
per word lets a noisy model break one concept into fragments (``B-X I-Y``,
``O I-X``), and every fragment costs a strict match.
"""

from __future__ import annotations

import numpy as np

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


def allowed_transitions(labels: list[str]) -> np.ndarray:
    """``allowed[i, j]``: may tag ``labels[j]`` follow tag ``labels[i]`` in BIO?

    ``I-X`` may follow only ``B-X`` or ``I-X``; everything else may follow
    anything.
    """
    n = len(labels)
    allowed = np.ones((n, n), dtype=bool)
    for j, label in enumerate(labels):
        prefix, _, ctype = label.partition("-")
        if prefix != "I":
            continue
        for i, previous in enumerate(labels):
            allowed[i, j] = previous in (f"B-{ctype}", f"I-{ctype}")
    return allowed


def best_valid_tags(log_probs: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The tag sequence of highest total log-probability whose transitions
    are all ``allowed`` (Viterbi over ``(words, labels)`` scores).

    The first word may take any tag: a window can open inside a span that
    the line before (or the window before) began, and :func:`decode_tags`
    continues it.
    """
    n_words, n_labels = log_probs.shape
    if n_words == 0:
        return np.zeros(0, dtype=np.int64)
    penalty = np.where(allowed, 0.0, -np.inf)
    best = log_probs[0].astype(np.float64)
    back = np.zeros((n_words, n_labels), dtype=np.int64)
    for w in range(1, n_words):
        candidates = best[:, None] + penalty  # previous x current
        back[w] = candidates.argmax(axis=0)
        best = candidates.max(axis=0) + log_probs[w]
    path = np.empty(n_words, dtype=np.int64)
    path[-1] = int(best.argmax())
    for w in range(n_words - 1, 0, -1):
        path[w - 1] = back[w, path[w]]
    return path
