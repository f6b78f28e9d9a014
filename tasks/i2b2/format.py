"""The i2b2 2010 concept format: read, validate and write ``.txt``/``.con`` corpora.

Semantics (DESIGN.md section 5):

* A document is a ``.txt`` file; one line = one sentence; tokens are split on
  whitespace. Lines are 1-based, tokens 0-based, spans inclusive.
* A ``.con`` line reads ``c="text" L:T L:T||t="problem|test|treatment"``. The
  text is the lowercased tokens of the span; it may itself contain quotes
  (``c=""leaky valve""``) and the span may run over several lines.
* Optional ``.ast`` files add ``||a="present|absent|..."`` to the same form.
* Layouts: release site folders (``beth/``, ``partners/``, each with ``txt/``
  and ``concept/``), the test layout (text flat or under ``txt/``, reference
  under ``concepts/``), or ``.txt`` and ``.con`` side by side. Documents pair
  with their annotation files by file stem, which must be unique in a corpus.

Nothing here prints note text: problems name the file, the line and what is
wrong, never what the line said.
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.runs import atomic_write_text
from clinfed.tasks.i2b2.schema import TypeNames

ASSERTION_VALUES: tuple[str, ...] = (
    "present",
    "absent",
    "possible",
    "conditional",
    "hypothetical",
    "associated_with_someone_else",
)

# The text group is greedy so that quotes inside the concept text are kept:
# the match backtracks to the last `" L:T L:T||t="`.
_SPAN = r'c="(?P<text>.*)" (?P<l1>\d+):(?P<t1>\d+) (?P<l2>\d+):(?P<t2>\d+)'
_CON_RE = re.compile(rf'^{_SPAN}\|\|t="(?P<type>[^"]*)"$')
_AST_RE = re.compile(rf'^{_SPAN}\|\|t="(?P<type>[^"]*)"\|\|a="(?P<assertion>[^"]*)"$')

# Folders of the release layout that never name a site.
_LAYOUT_DIRS = {"txt", "concept", "concepts", "ast", "rel"}
_RELEASE_SITES = {"beth", "partners"}
_BETH_STEM = re.compile(r"record-\d+")
_PARTNERS_STEM = re.compile(r"\d{9}(_[A-Za-z]+)?")

Position = tuple[int, int]  # (line 1-based, token 0-based)


@dataclass(frozen=True, order=True)
class Concept:
    """One annotated span. ``text`` is the lowercased span text (never logged)."""

    start: Position
    end: Position
    type: str
    text: str = field(default="", compare=False)
    # The annotation file's line it came from (for problems), if any.
    source_line: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Assertion:
    """An ``.ast`` entry: a problem concept and its assertion value."""

    concept: Concept
    value: str


@dataclass
class Document:
    """One note: its tokens per line and, if annotated, its concepts."""

    doc_id: str
    site: str
    lines: list[list[str]]
    concepts: list[Concept] = field(default_factory=list)
    assertions: list[Assertion] = field(default_factory=list)
    txt_path: Path | None = None
    con_path: Path | None = None

    @property
    def annotated(self) -> bool:
        return self.con_path is not None

    def span_text(self, start: Position, end: Position) -> str:
        """Lowercased tokens from ``start`` to ``end`` inclusive, space-joined."""
        return " ".join(tok.lower() for tok in iter_span_tokens(self.lines, start, end))


def iter_span_tokens(lines: list[list[str]], start: Position, end: Position) -> Iterator[str]:
    (l1, t1), (l2, t2) = start, end
    for line_no in range(l1, l2 + 1):
        tokens = lines[line_no - 1]
        lo = t1 if line_no == l1 else 0
        hi = t2 if line_no == l2 else len(tokens) - 1
        yield from tokens[lo : hi + 1]


def split_lines(text: str) -> list[list[str]]:
    """Tokens per line. Only ``\\n`` ends a line (``\\r`` before it is dropped),
    so line numbers match the i2b2 annotation tools, unlike ``str.splitlines``,
    which also breaks on form feeds and Unicode separators."""
    raw = text.split("\n")
    if raw and raw[-1] == "":
        raw.pop()
    return [line.rstrip("\r").split() for line in raw]


def site_from_stem(stem: str) -> str | None:
    """``record-N`` is Beth Israel, nine digits (``_DH``/``_WGH``) Partners."""
    if _BETH_STEM.fullmatch(stem):
        return "beth"
    if _PARTNERS_STEM.fullmatch(stem):
        return "partners"
    return None


def site_of(path: Path, root: Path) -> str:
    """Site of a document: its site folder, else its file stem, else ``unknown``.

    A site folder is one named ``beth``/``partners`` or one that holds the
    release's ``txt/`` folder (``<site>/txt/<stem>.txt``).
    """
    rel_dirs = path.relative_to(root).parts[:-1]
    for name in reversed(rel_dirs):
        if name.lower() in _RELEASE_SITES:
            return name.lower()
    if len(rel_dirs) >= 2 and rel_dirs[-1].lower() in _LAYOUT_DIRS:
        return rel_dirs[-2]
    return site_from_stem(path.stem) or "unknown"


def _files(root: Path, suffix: str, problems: ProblemLog | None = None) -> list[Path]:
    """Regular files named ``*suffix`` under ``root``; a folder that cannot be
    read, a broken or looping link and a FIFO or device are problems, never
    silently skipped (or waited on)."""
    found = []

    def unreadable(exc: OSError) -> None:
        if problems is not None:
            problems.add(exc.filename, None, f"cannot read this folder ({exc.strerror})")

    # Linked folders are followed (a site folder may be a link), each real
    # folder once, so a link loop cannot recurse forever.
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if (
                name.endswith(suffix)
                and not name.startswith(".")
                and not name.upper().startswith("README")
            ):
                path = Path(dirpath) / name
                try:
                    regular = stat.S_ISREG(path.stat().st_mode)
                except OSError as exc:
                    if problems is not None:
                        problems.add(path, None, f"cannot read ({exc.strerror}; a broken link?)")
                    continue
                if not regular:
                    if problems is not None:
                        problems.add(path, None, "not a regular file (a FIFO or device?)")
                    continue
                found.append(path)
    return found


def _by_stem(paths: Iterable[Path], problems: ProblemLog) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for path in paths:
        if path.stem in index:
            problems.add(path, None, f"duplicate document name (also {index[path.stem]})")
            continue
        index[path.stem] = path
    return index


def decode_utf8(path: Path, problems: ProblemLog) -> str | None:
    try:
        data = path.read_bytes()
    except OSError as exc:
        problems.add(path, None, f"cannot read ({exc.strerror})")
        return None
    try:
        # A UTF-8 byte order mark (Windows editors write one) is not text.
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        problems.add(path, line, f"bytes that are not UTF-8 (byte offset {exc.start})")
        return None


def parse_span(
    match: re.Match[str],
    lines: list[list[str]],
    path: Path,
    line_no: int,
    problems: ProblemLog,
    names: TypeNames | None = None,
) -> Concept | None:
    """Validate a matched span against the document; report and return None if bad."""
    l1, t1, l2, t2 = (int(match[g]) for g in ("l1", "t1", "l2", "t2"))
    ctype = match["type"]
    if l1 == 0 or l2 == 0:
        problems.add(path, line_no, "line 0 in a span (lines are 1-based)")
        return None
    if (l2, t2) < (l1, t1):
        problems.add(path, line_no, f"end {l2}:{t2} before start {l1}:{t1}")
        return None
    for ln, tok in ((l1, t1), (l2, t2)):
        if ln > len(lines):
            problems.add(
                path, line_no, f"line {ln} past the end of the document ({len(lines)} lines)"
            )
            return None
        if tok >= len(lines[ln - 1]):
            problems.add(
                path,
                line_no,
                f"token offset {tok} past the end of line {ln} ({len(lines[ln - 1])} tokens)",
            )
            return None
    ctype = (names or TypeNames()).resolve(ctype, path, line_no, problems)
    if ctype is None:
        return None
    expected = " ".join(tok.lower() for tok in iter_span_tokens(lines, (l1, t1), (l2, t2)))
    given = " ".join(match["text"].lower().split())
    if given != expected:
        problems.add(
            path, line_no, f"concept text does not match the tokens at {l1}:{t1}-{l2}:{t2}"
        )
        return None
    return Concept((l1, t1), (l2, t2), ctype, expected, line_no)


_CON_SHAPE = 'malformed concept line (expected c="..." L:T L:T||t="...")'
_AST_SHAPE = 'malformed assertion line (expected c="..." L:T L:T||t="..."||a="...")'


def _matched_lines(
    path: Path, pattern: re.Pattern[str], problems: ProblemLog, malformed: str
) -> Iterator[tuple[int, re.Match[str]]]:
    """(line number, match) for each non-blank line of an annotation file;
    lines that do not match are reported as ``malformed``."""
    text = decode_utf8(path, problems)
    if text is None:
        return
    for line_no, raw in enumerate(text.split("\n"), start=1):
        raw = raw.strip()
        if not raw:
            continue
        match = pattern.match(raw)
        if match is None:
            problems.add(path, line_no, malformed)
        else:
            yield line_no, match


def read_con(
    path: Path, lines: list[list[str]], problems: ProblemLog, names: TypeNames | None = None
) -> list[Concept]:
    """Concepts of one ``.con`` file, validated against the document's tokens
    (types: the i2b2 preset, or resolved by ``names``)."""
    concepts: list[Concept] = []
    for line_no, match in _matched_lines(path, _CON_RE, problems, _CON_SHAPE):
        concept = parse_span(match, lines, path, line_no, problems, names)
        if concept is not None:
            concepts.append(concept)
    return drop_overlaps(concepts, path, problems)


def drop_overlaps(concepts: list[Concept], path: Path, problems: ProblemLog) -> list[Concept]:
    """Concepts sorted; one that overlaps or repeats an earlier one is a
    problem (token tags cannot hold both), left out with ``--on-error skip``."""
    concepts = sorted(concepts)
    kept: list[Concept] = []
    for cur in concepts:
        prev = kept[-1] if kept else None
        if prev is not None and cur.start <= prev.end:
            same = (cur.start, cur.end) == (prev.start, prev.end)
            problems.add(
                path,
                cur.source_line,
                f"concept at {cur.start[0]}:{cur.start[1]} "
                + ("repeats" if same else "overlaps")
                + f" the concept at {prev.start[0]}:{prev.start[1]}"
                + (" (left out)" if problems.skipping else ""),
            )
            continue  # with --on-error skip the later one is left out
        kept.append(cur)
    return kept


def read_ast(
    path: Path, lines: list[list[str]], problems: ProblemLog, names: TypeNames | None = None
) -> list[Assertion]:
    """Assertions of one ``.ast`` file."""
    assertions = []
    for line_no, match in _matched_lines(path, _AST_RE, problems, _AST_SHAPE):
        if match["assertion"] not in ASSERTION_VALUES:
            problems.add(path, line_no, "unknown assertion value")
            continue
        concept = parse_span(match, lines, path, line_no, problems, names)
        if concept is not None:
            assertions.append(Assertion(concept, match["assertion"]))
    return assertions


def read_corpus(
    root: Path | str, problems: ProblemLog | None = None, names: TypeNames | None = None
) -> list[Document]:
    """Read every document under ``root`` in any of the release layouts.

    Parameters
    ----------
    root
        A folder holding ``.txt`` files and their ``.con`` (and ``.ast``) files.
    problems
        Where problems go. Strict by default: all problems are collected and
        raised together as :class:`~clinfed.core.errors.DataError`.
    names
        How ``t="..."`` type names resolve (:mod:`clinfed.tasks.i2b2.schema`);
        by default they must be i2b2 2010 types.

    Returns
    -------
    list of Document
        Sorted by site, then file stem. Documents without a ``.con`` file are
        returned unannotated (``doc.annotated`` is False).
    """
    root = Path(root)
    problems = problems if problems is not None else ProblemLog()
    if not root.is_dir():
        raise ClinfedError(f"{root}: not a folder")
    txts = _by_stem(_files(root, ".txt", problems), problems)
    cons = _by_stem(_files(root, ".con", problems), problems)
    asts = _by_stem(_files(root, ".ast", problems), problems)
    for stem, path in sorted(cons.items()):
        if stem not in txts:
            problems.add(path, None, ".con file without a matching .txt file")
    documents = []
    for stem, txt_path in txts.items():
        text = decode_utf8(txt_path, problems)
        if text is None:
            continue
        lines = split_lines(text)
        doc = Document(stem, site_of(txt_path, root), lines, txt_path=txt_path)
        if stem in cons:
            doc.con_path = cons[stem]
            doc.concepts = read_con(cons[stem], lines, problems, names)
        if stem in asts:
            doc.assertions = read_ast(asts[stem], lines, problems, names)
        documents.append(doc)
    if not txts:
        problems.add(root, None, "no documents (.txt files) found")
    problems.raise_if_any()
    documents.sort(key=lambda d: (d.site, d.doc_id))
    return documents


def format_concept(concept: Concept) -> str:
    (l1, t1), (l2, t2) = concept.start, concept.end
    return f'c="{concept.text}" {l1}:{t1} {l2}:{t2}||t="{concept.type}"'


def write_con(path: Path | str, concepts: Iterable[Concept]) -> None:
    """Write one ``.con`` file, one concept per line in document order."""
    body = "".join(format_concept(c) + "\n" for c in sorted(concepts))
    atomic_write_text(Path(path), body)


def check_annotated(docs: list[Document], problems: ProblemLog) -> None:
    """A document of an annotated split without its .con would train on
    nothing or be scored as having no concepts: never silently."""
    for doc in docs:
        if not doc.annotated:
            problems.add(
                doc.txt_path,
                None,
                "no .con file beside this .txt (an annotated split needs one per note; "
                "--on-error skip leaves the note out)",
            )


def summary_of(docs: list[Document], problems: ProblemLog) -> dict[str, Any]:
    """What ``clinfed data check`` prints of a corpus: counts, never text."""
    return {
        "documents": len(docs),
        "annotated_documents": sum(d.annotated for d in docs),
        "lines": sum(len(d.lines) for d in docs),
        "tokens": sum(len(t) for d in docs for t in d.lines),
        "concepts": dict(Counter(c.type for d in docs for c in d.concepts)),
        "multi_line_concepts": sum(c.start[0] != c.end[0] for d in docs for c in d.concepts),
        "assertions": dict(Counter(a.value for d in docs for a in d.assertions)),
        "sites": dict(Counter(d.site for d in docs)),
        "problems": [str(p) for p in problems.problems],
    }
