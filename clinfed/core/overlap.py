"""Whether a public input holds private content, whatever its bytes.

Public inputs (warm-start text, public check notes, name lists) are spent
with no accounting, so private notes passed as public would leave with no
guarantee at all. Comparing bytes misses a converted copy (``clinfed data
convert`` of the private corpus to CoNLL), a copy with a byte added to each
file, notes concatenated, and a name list cut from the private annotations.
This compares content instead, the same way for every format:

* **Sentences**: every file is read as sentences of lowercased tokens (a
  line of text, or a blank-line-separated sentence of a CoNLL/IOB column
  file, its first column). Each private note (a file, a ``-DOCSTART-``
  document, or a run of at most :data:`CHUNK` sentences) is refused when
  :data:`PAIR_SHARE` or more of its pairs of consecutive sentences (of at
  least :data:`MIN_TOKENS` tokens each) appear, in order, in the public
  input. Pairs, not single sentences: templated notes (the synthetic
  corpora) share single sentences by chance (up to 48% of a note measured
  between two draws) but consecutive pairs rarely (at most 4%).
* **Names**: a public file of short lines (a name list) is refused when at
  least :data:`MIN_NAMES` of its entries, and :data:`NAME_SHARE` of them,
  are strings annotated in the private data (``.con`` concepts, BRAT text
  bound annotations, the entity spans of a column file).

What it cannot catch: a paraphrase, a note with its sentences reordered or
edited one by one, a private note split into single sentences mixed with
other text, a list of private names diluted below the share, and files
larger than :data:`MAX_BYTES` (compared by bytes only).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

MIN_TOKENS = 4
PAIR_SHARE = 0.3
MIN_PAIRS = 3
CHUNK = 50
NAME_SHARE = 0.8
MIN_NAMES = 20
MAX_BYTES = 256 << 20

_TAG = re.compile(r"^(O|[BIES]-\S+)$")
_CONCEPT = re.compile(r'^c="(.*)" \d+:\d+ \d+:\d+\|\|')

Sentence = tuple[str, ...]


def _text(path: Path) -> str | None:
    if not path.is_file() or path.stat().st_size > MAX_BYTES:
        return None
    return path.read_text(encoding="utf-8", errors="replace")


def _is_columns(lines: list[str]) -> bool:
    """A CoNLL/IOB column file: most lines end in a tag."""
    filled = [line.split() for line in lines if line.strip()]
    tagged = sum(1 for fields in filled if len(fields) >= 2 and _TAG.match(fields[-1]))
    return bool(filled) and tagged >= 0.8 * len(filled)


def documents(text: str) -> Iterator[list[Sentence]]:
    """The documents of one file, each as its sentences (see the module docstring)."""
    lines = text.splitlines()
    if not _is_columns(lines):
        yield [tuple(line.lower().split()) for line in lines if line.strip()]
        return
    document: list[Sentence] = []
    sentence: list[str] = []
    for line in [*lines, ""]:
        fields = line.split()
        if fields and fields[0] == "-DOCSTART-":
            if document:
                yield document
            document = []
        elif fields:
            sentence.append(fields[0].lower())
        elif sentence:
            document.append(tuple(sentence))
            sentence = []
    if document:
        yield document


def names(path: Path, text: str) -> set[Sentence]:
    """Strings annotated in one private file: ``.con`` concepts, BRAT text
    bound annotations, a column file's entity spans."""
    found: set[Sentence] = set()
    lines = text.splitlines()
    if path.suffix == ".con":
        for line in lines:
            match = _CONCEPT.match(line)
            if match:
                found.add(tuple(match.group(1).lower().split()))
    elif path.suffix == ".ann":
        for line in lines:
            fields = line.split("\t")
            if line.startswith("T") and len(fields) >= 3:
                found.add(tuple(fields[2].lower().split()))
    elif _is_columns(lines):
        span: list[str] = []
        for line in [*lines, ""]:
            fields = line.split()
            tag = fields[-1] if len(fields) >= 2 else "O"
            if span and not tag.startswith("I-"):
                found.add(tuple(span))
                span = []
            if tag[:2] in ("B-", "I-", "S-"):
                span.append(fields[0].lower())
    return {name for name in found if name}


def _pairs(sentences: list[Sentence]) -> list[tuple[Sentence, Sentence]]:
    kept = [s for s in sentences if len(s) >= MIN_TOKENS]
    return list(zip(kept, kept[1:], strict=False))


def _files(folder: Path) -> list[Path]:
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.rglob("*") if p.is_file())


def private_content(public: Path, data: Path) -> str | None:
    """Why ``public`` holds content of the private ``data`` (``None``: no
    sign of it). The reason names no file and quotes no text."""
    public_pairs: set[int] = set()
    public_lists: list[list[Sentence]] = []
    for path in _files(public):
        text = _text(path)
        if text is None:
            continue
        for document in documents(text):
            public_pairs.update(hash(pair) for pair in _pairs(document))
        lines = [line for line in text.splitlines() if line.strip() and line[0] != "#"]
        if lines and not _is_columns(lines) and all(len(line.split()) <= 8 for line in lines):
            public_lists.append([tuple(line.lower().split()) for line in lines])
    annotated: set[Sentence] = set()
    for path in _files(data):
        text = _text(path)
        if text is None:
            continue
        annotated |= names(path, text)
        for document in documents(text):
            for start in range(0, len(document), CHUNK):
                pairs = _pairs(document[start : start + CHUNK])
                if len(pairs) < MIN_PAIRS:
                    continue
                shared = sum(hash(pair) in public_pairs for pair in pairs)
                if shared >= PAIR_SHARE * len(pairs):
                    return "holds the sentences of a private note, in their order"
    for entries in public_lists:
        listed = set(entries)
        private = listed & annotated
        if len(private) >= MIN_NAMES and len(private) >= NAME_SHARE * len(listed):
            return "is a list of names annotated in the private data"
    return None
