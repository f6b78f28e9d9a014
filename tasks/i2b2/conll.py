"""CoNLL / IOB column files as concept-extraction documents.

The format of most public NER corpora (NCBI-disease, BC5CDR, CoNLL-2003) and
of many hospitals' annotation exports:

* one token per line, columns separated by tabs or spaces: the token in the
  first column, the tag in the last (columns between, such as POS tags, are
  ignored);
* a blank line between sentences (each sentence becomes one line of the
  document, as an i2b2 line does);
* a line whose first column is ``-DOCSTART-`` starts a new document; a file
  without one is one document;
* tags ``O``, ``B-T``, ``I-T``, ``E-T``, ``S-T`` (IOB1, IOB2 and IOBES are all
  read; an ``I-T`` that follows nothing of type T starts a span, as IOB1
  means it).

Files: ``*.conll``, ``*.iob``, ``*.bio``, ``*.tsv`` under the data folder. A
file's site is the folder right under the data folder that holds it (or,
for a file directly in it, the file's stem).

Entity type names are kept, or mapped by a declared ``--types`` (see
:mod:`clinfed.tasks.i2b2.schema`); a name a declaration does not list is a
problem (``path:line``), so nothing is dropped silently. Errors name the file
and line and never quote a token.
"""

from __future__ import annotations

from pathlib import Path

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.tasks.i2b2.format import Concept, Document, _files
from clinfed.tasks.i2b2.schema import TypeNames

SUFFIXES = (".conll", ".iob", ".bio", ".tsv")
PREFIXES = ("B", "I", "E", "S")


def conll_files(root: Path, problems: ProblemLog) -> list[Path]:
    """Every CoNLL file under ``root``, in a stable order."""
    found: list[Path] = []
    for suffix in SUFFIXES:
        found += _files(root, suffix, problems)
    return sorted(set(found))


def site_folder(path: Path, root: Path) -> str:
    """The folder right under ``root`` that holds ``path`` (else its stem)."""
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else path.stem


def read_conll(
    root: Path | str, problems: ProblemLog, names: TypeNames = TypeNames(open=True)
) -> list[Document]:
    """Every document of every CoNLL file under ``root`` (see the module
    docstring); entity type names resolved by ``names`` (kept as they are
    by default)."""
    root = Path(root)
    if not root.is_dir():
        raise ClinfedError(f"{root}: not a folder")
    files = conll_files(root, problems)
    if not files:
        problems.add(root, None, f"no CoNLL files ({', '.join('*' + s for s in SUFFIXES)})")
    documents: list[Document] = []
    for path in files:
        documents += _read_file(path, site_folder(path, root), problems, names)
    problems.raise_if_any()
    documents.sort(key=lambda d: (d.site, d.doc_id))
    return documents


def _read_file(path: Path, site: str, problems: ProblemLog, names: TypeNames) -> list[Document]:
    try:
        text = path.read_bytes().decode("utf-8").removeprefix("\ufeff")
    except OSError as exc:
        problems.add(path, None, f"cannot read ({exc.strerror})")
        return []
    except UnicodeDecodeError as exc:
        line = path.read_bytes().count(b"\n", 0, exc.start) + 1
        problems.add(path, line, f"bytes that are not UTF-8 (byte offset {exc.start})")
        return []
    reader = _Reader(path, site)
    for line_no, raw in enumerate(text.split("\n"), start=1):
        columns = raw.rstrip("\r").split()
        if not columns:
            reader.end_sentence()
        elif columns[0] == "-DOCSTART-":
            reader.end_document()
        elif len(columns) < 2:
            problems.add(path, line_no, "a token without a tag (need token ... tag columns)")
        else:
            reader.token(columns[0], columns[-1], line_no, problems, names)
    reader.end_document()
    if not reader.documents:
        problems.add(path, None, "no tokens")
    return reader.documents


class _Reader:
    """One CoNLL file's documents, token by token: sentences end at blank
    lines, documents at ``-DOCSTART-``, spans at their tags."""

    def __init__(self, path: Path, site: str):
        self.path, self.site = path, site
        self.documents: list[Document] = []
        self.lines: list[list[str]] = []
        self.concepts: list[Concept] = []
        self.sentence: list[str] = []
        self.open_span: tuple[str, int] | None = None  # (type, first token) in the sentence

    def token(
        self, token: str, tag: str, line_no: int, problems: ProblemLog, names: TypeNames
    ) -> None:
        position = len(self.sentence)
        self.sentence.append(token)
        if tag == "O":
            self.close_span(position - 1)
            return
        prefix, dash, name = tag.partition("-")
        if not dash or prefix not in PREFIXES or not name:
            problems.add(self.path, line_no, "a tag that is not O, B-, I-, E- or S- with a type")
            self.close_span(position - 1)
            return
        ctype = names.resolve(name, self.path, line_no, problems)
        if ctype is None:
            self.close_span(position - 1)
            return
        continues = self.open_span is not None and self.open_span[0] == ctype
        if prefix in ("B", "S") or not continues:
            self.close_span(position - 1)
            self.open_span = (ctype, position)
        if prefix in ("E", "S"):
            self.close_span(position)

    def close_span(self, end: int) -> None:
        if self.open_span is not None:
            ctype, first = self.open_span
            row = len(self.lines) + 1
            words = " ".join(t.lower() for t in self.sentence[first : end + 1])
            self.concepts.append(Concept((row, first), (row, end), ctype, words))
        self.open_span = None

    def end_sentence(self) -> None:
        if self.sentence:
            self.close_span(len(self.sentence) - 1)
            self.lines.append(self.sentence)
        self.sentence = []

    def end_document(self) -> None:
        self.end_sentence()
        if self.lines:
            number = len(self.documents) + 1
            self.documents.append(
                Document(
                    f"{self.site}-{self.path.stem}-{number}",
                    self.site,
                    self.lines,
                    sorted(self.concepts),
                    txt_path=self.path,
                    con_path=self.path,
                )
            )
        self.lines, self.concepts = [], []
