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

from clinfed.errors import ClinfedError, ProblemLog
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
    documents: list[Document] = []
    lines: list[list[str]] = []
    concepts: list[Concept] = []
    sentence: list[str] = []
    open_span: tuple[str, int] | None = None  # (type, first token) in the sentence

    def close_span(end: int) -> None:
        nonlocal open_span
        if open_span is not None:
            ctype, first = open_span
            row = len(lines) + 1
            words = " ".join(t.lower() for t in sentence[first : end + 1])
            concepts.append(Concept((row, first), (row, end), ctype, words))
        open_span = None

    def end_sentence() -> None:
        nonlocal sentence
        if sentence:
            close_span(len(sentence) - 1)
            lines.append(sentence)
        sentence = []

    def end_document() -> None:
        nonlocal lines, concepts
        end_sentence()
        if lines:
            number = len(documents) + 1
            documents.append(
                Document(
                    f"{site}-{path.stem}-{number}",
                    site,
                    lines,
                    sorted(concepts),
                    txt_path=path,
                    con_path=path,
                )
            )
        lines, concepts = [], []

    for line_no, raw in enumerate(text.split("\n"), start=1):
        columns = raw.rstrip("\r").split()
        if not columns:
            end_sentence()
            continue
        if columns[0] == "-DOCSTART-":
            end_document()
            continue
        if len(columns) < 2:
            problems.add(path, line_no, "a token without a tag (need token ... tag columns)")
            continue
        token, tag = columns[0], columns[-1]
        position = len(sentence)
        sentence.append(token)
        if tag == "O":
            close_span(position - 1)
            continue
        prefix, dash, name = tag.partition("-")
        if not dash or prefix not in PREFIXES or not name:
            problems.add(path, line_no, "a tag that is not O, B-, I-, E- or S- with a type")
            close_span(position - 1)
            continue
        ctype = names.resolve(name, path, line_no, problems)
        if ctype is None:
            close_span(position - 1)
            continue
        continues = open_span is not None and open_span[0] == ctype
        if prefix in ("B", "S") or not continues:
            close_span(position - 1)
            open_span = (ctype, position)
        if prefix in ("E", "S"):
            close_span(position)
    end_document()
    if not documents:
        problems.add(path, None, "no tokens")
    return documents
