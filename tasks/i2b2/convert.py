"""``clinfed data convert``: any concept-extraction format as any other.

Documents are read with the task's readers (i2b2, CoNLL, BRAT) and written
in the target format under a new folder, one folder per site (and ``train/``
and ``test/`` kept when the source has them):

* ``i2b2``: the release layout, ``<site>/txt/<doc>.txt`` (one line per
  sentence, tokens joined by spaces) and ``<site>/concept/<doc>.con``;
* ``conll``: ``<site>/<site>.conll``, ``token<TAB>tag`` (IOB2), a blank line
  between sentences and ``-DOCSTART-`` before each document;
* ``brat``: ``<site>/<doc>.txt`` and ``<site>/<doc>.ann`` with one
  text-bound annotation per concept.

What survives a round trip: tokens, sentences, documents, concept spans and
types. What does not: a concept that runs over a line break becomes two in
CoNLL (a sentence boundary closes every span); original whitespace and
character offsets (text is rewritten as tokens joined by one space).
"""

from __future__ import annotations

from pathlib import Path

from clinfed.core.errors import ClinfedError
from clinfed.core.runs import atomic_write_text, create_run_folder
from clinfed.tasks.i2b2.bio import encode_tags
from clinfed.tasks.i2b2.format import Document, write_con

TARGETS = ("i2b2", "conll", "brat")


def _text(doc: Document) -> str:
    return "".join(" ".join(tokens) + "\n" for tokens in doc.lines)


def _char_offsets(doc: Document) -> list[list[tuple[int, int]]]:
    offsets, position = [], 0
    for tokens in doc.lines:
        line = []
        for token in tokens:
            line.append((position, position + len(token)))
            position += len(token) + 1
        if not tokens:
            position += 1
        offsets.append(line)
    return offsets


def write_documents(documents: list[Document], folder: Path, target: str) -> int:
    """Write ``documents`` under ``folder`` (which must not hold files yet)."""
    if target not in TARGETS:
        raise ClinfedError(f"`to` must be one of {', '.join(TARGETS)}, not {target!r}")
    create_run_folder(folder)
    by_site: dict[str, list[Document]] = {}
    for doc in documents:
        by_site.setdefault(doc.site, []).append(doc)
    for site, docs in sorted(by_site.items()):
        site_dir = folder / site
        if target == "conll":
            blocks = []
            for doc in docs:
                tags = encode_tags(doc)
                sentences = [
                    "".join(f"{tok}\t{tag}\n" for tok, tag in zip(tokens, line_tags))
                    for tokens, line_tags in zip(doc.lines, tags)
                    if tokens
                ]
                blocks.append("-DOCSTART-\tO\n\n" + "\n".join(sentences))
            atomic_write_text(site_dir / f"{site}.conll", "\n".join(blocks))
            continue
        for doc in docs:
            if target == "i2b2":
                atomic_write_text(site_dir / "txt" / f"{doc.doc_id}.txt", _text(doc))
                write_con(site_dir / "concept" / f"{doc.doc_id}.con", doc.concepts)
                continue
            atomic_write_text(site_dir / f"{doc.doc_id}.txt", _text(doc))
            offsets = _char_offsets(doc)
            text = _text(doc)
            lines = []
            for number, concept in enumerate(sorted(doc.concepts), start=1):
                (l1, t1), (l2, t2) = concept.start, concept.end
                start, end = offsets[l1 - 1][t1][0], offsets[l2 - 1][t2][1]
                # BRAT writes a line break inside a span's text as a space
                span = text[start:end].replace("\n", " ")
                lines.append(f"T{number}\t{concept.type} {start} {end}\t{span}\n")
            atomic_write_text(site_dir / f"{doc.doc_id}.ann", "".join(lines))
    return len(documents)
