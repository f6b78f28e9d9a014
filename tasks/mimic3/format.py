"""MIMIC-III CSVs: ``NOTEEVENTS``, ``DIAGNOSES_ICD``, ``PROCEDURES_ICD``.

Read as the release ships them (DESIGN.md section 5): quoted upper-case
headers in the full release, unquoted lower-case ones in the demo, so column
names match case-insensitively; ``TEXT`` runs over many lines inside quotes;
``ICD9_CODE`` is a string (leading zeros matter) and is dotted the CAML way.
Files may be gzipped (``NOTEEVENTS.csv.gz``, as PhysioNet ships them).

The CSV is streamed row by row (NOTEEVENTS is about 4 GB). Discharge summaries
(reports and addenda, concatenated per ``HADM_ID``) are written to an Arrow
dataset on disk, sorted there, and grouped into one admission per row, so the
notes never have to fit in memory.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import io
import os
import re
import sys
import zlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.scratch import cache_folder
from clinfed.tasks.base import rows_to_dataset

CODE_KINDS = ("diagnoses", "procedures", "both")
DISCHARGE = "discharge summary"

NOTE_COLUMNS = ("subject_id", "hadm_id", "category", "text")
CODE_COLUMNS = ("subject_id", "hadm_id", "icd9_code")
NOTE_FEATURES = datasets.Features(
    {
        "hadm_id": datasets.Value("int64"),
        "subject_id": datasets.Value("int64"),
        "addendum": datasets.Value("bool"),
        "chartdate": datasets.Value("string"),
        "order": datasets.Value("int64"),
        "text": datasets.Value("string"),
    }
)
ADMISSION_FEATURES = datasets.Features(
    {
        "hadm_id": datasets.Value("int64"),
        "subject_id": datasets.Value("int64"),
        "text": datasets.Value("string"),
        "n_notes": datasets.Value("int64"),
    }
)

# NOTEEVENTS TEXT fields reach hundreds of kilobytes.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


# ICD-9-CM codes without their dot: diagnoses (3-5 digits, V + 2-4 digits,
# E + 3-4 digits) and procedures (2-4 digits).
ICD9 = {
    "diagnoses": re.compile(r"^(?:\d{3,5}|[Vv]\d{2,4}|[Ee]\d{3,4})$"),
    "procedures": re.compile(r"^\d{2,4}$"),
}
# NOTEEVENTS.ISERROR: 1 marks a note the physician flagged as an error.
ISERROR_VALUES = ("", "0", "1", "0.0", "1.0")


def caml_dot(code: str, kind: str) -> str:
    """Dot an ICD-9 code as CAML does.

    Diagnoses: after 3 characters (E-codes after 4); codes of 3 characters
    (4 for E-codes) take no dot. Procedures: after 2 characters. Leading
    zeros are kept: ``0389`` becomes ``038.9``.
    """
    code = code.strip().replace(".", "")
    if kind == "procedures":
        return code[:2] + "." + code[2:] if len(code) > 2 else code
    cut = 4 if code.upper().startswith("E") else 3
    return code[:cut] + "." + code[cut:] if len(code) > cut else code


def find_file(folder: Path, name: str) -> Path | None:
    """``NAME.csv`` or ``NAME.csv.gz`` in ``folder``, any letter case."""
    wanted = {f"{name}.csv".lower(), f"{name}.csv.gz".lower()}
    for entry in sorted(folder.iterdir()):
        # Whatever stands under the name (a folder or a pipe too): the reader
        # refuses what is not a file, so a site never vanishes unnoticed.
        if entry.name.lower() in wanted:
            return entry
    return None


def _open_binary(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


class NotUtf8(Exception):
    """Bytes that are not UTF-8 on physical line ``line`` of a file."""

    def __init__(self, line: int):
        super().__init__(line)
        self.line = line


def _text_lines(raw: io.BufferedIOBase) -> Iterator[str]:
    """The file's lines, decoded one at a time (a bad byte is reported on its
    own line, not on the first line of a block decoded ahead), line endings
    kept so csv sees the line breaks inside quoted TEXT fields; a byte order
    mark is dropped."""
    for number, chunk in enumerate(raw, start=1):
        if number == 1 and chunk.startswith(codecs.BOM_UTF8):
            chunk = chunk[len(codecs.BOM_UTF8) :]
        try:
            yield chunk.decode("utf-8")
        except UnicodeDecodeError:
            raise NotUtf8(number) from None


# A damaged .gz: not gzip at all, truncated, or corrupt inside.
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


def iter_rows(
    path: Path, required: tuple[str, ...], problems: ProblemLog
) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(first line of the record, row)`` with lower-cased column names.

    A missing or repeated column, an unterminated quote or bytes that are not
    UTF-8 stop the file (reported with its line); the caller reports bad
    values. What is not a regular file (a folder, a pipe: opening one would
    wait forever) is reported, never opened.
    """
    if not path.is_file():
        problems.add(path, None, "not a regular file (a folder, a pipe or a device)")
        return
    try:
        fh = _open_binary(path)
    except OSError as exc:
        problems.add(path, None, f"cannot read ({exc.strerror})")
        return
    with fh:
        reader = csv.reader(_text_lines(fh), strict=True)
        try:
            header = next(reader)
        except StopIteration:
            problems.add(path, 1, "empty file (no header)")
            return
        except GZIP_ERRORS:
            problems.add(path, 1, "not gzip data, or truncated or corrupt gzip data")
            return
        except NotUtf8 as exc:
            problems.add(path, exc.line, "bytes that are not UTF-8")
            return
        except (csv.Error, OSError) as exc:
            problems.add(path, 1, f"unreadable header ({type(exc).__name__})")
            return
        columns = [name.strip().lower() for name in header]
        repeated = sorted({name for name in columns if columns.count(name) > 1})
        if repeated:
            problems.add(path, 1, f"column {repeated[0].upper()} appears more than once")
            return
        for name in required:
            if name not in columns:
                problems.add(path, 1, f"missing column {name.upper()}")
        if any(name not in columns for name in required):
            return
        line = reader.line_num + 1
        while True:
            try:
                values = next(reader)
            except StopIteration:
                return
            except csv.Error:
                problems.add(path, line, "unterminated quote or malformed CSV record")
                return
            except NotUtf8 as exc:
                problems.add(path, exc.line, "bytes that are not UTF-8")
                return
            except GZIP_ERRORS:
                problems.add(path, line, "truncated or corrupt gzip data")
                return
            except OSError as exc:
                problems.add(path, line, f"cannot read ({exc.strerror})")
                return
            if values:
                if len(values) != len(columns):
                    problems.add(
                        path, line, f"{len(values)} fields where the header has {len(columns)}"
                    )
                else:
                    yield line, dict(zip(columns, values))
            line = reader.line_num + 1


def _parse_id(value: str, name: str, path: Path, line: int, problems: ProblemLog) -> int | None:
    """Integer id, None when empty; a non-integer is reported."""
    value = value.strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        problems.add(path, line, f"{name} is not an integer")
        return None
    if not -(2**63) <= number < 2**63:
        problems.add(path, line, f"{name} is out of range (more than 18 digits)")
        return None
    if number < 0:
        problems.add(path, line, f"{name} is negative")
        return None
    return number


@dataclass
class CodeTable:
    """Codes and patient of every admission seen in the code files."""

    codes: dict[int, set[str]]
    subject: dict[int, int]


def read_codes(folder: Path, kind: str, problems: ProblemLog) -> CodeTable:
    """Dotted codes per HADM_ID from DIAGNOSES_ICD and/or PROCEDURES_ICD."""
    if kind not in CODE_KINDS:
        raise ClinfedError(f"`codes` must be one of {', '.join(CODE_KINDS)}, not {kind!r}")
    table = CodeTable(defaultdict(set), {})
    sources = ("diagnoses", "procedures") if kind == "both" else (kind,)
    for source in sources:
        name = "DIAGNOSES_ICD" if source == "diagnoses" else "PROCEDURES_ICD"
        path = find_file(folder, name)
        if path is None:
            problems.add(folder, None, f"no {name}.csv found")
            continue
        for line, row in iter_rows(path, CODE_COLUMNS, problems):
            hadm = _parse_id(row["hadm_id"], "HADM_ID", path, line, problems)
            subject = _parse_id(row["subject_id"], "SUBJECT_ID", path, line, problems)
            code = row["icd9_code"].strip()
            if code and not ICD9[source].match(code.replace(".", "")):
                kind = "diagnosis" if source == "diagnoses" else "procedure"
                problems.add(path, line, f"ICD9_CODE is not an ICD-9 {kind} code")
                continue
            if hadm is None or subject is None or not code:
                continue  # the release has a few rows without a code
            table.codes[hadm].add(caml_dot(code, source))
            table.subject[hadm] = subject
    return table


def _note_rows(path: str, problems: ProblemLog, stamp: str) -> Iterator[dict]:
    """Discharge-summary rows of NOTEEVENTS, streamed. ``stamp`` (size and
    mtime) is only here so the dataset cache notices a changed file."""
    del stamp
    for order, (line, row) in enumerate(iter_rows(Path(path), NOTE_COLUMNS, problems)):
        if row["category"].strip().lower() != DISCHARGE:
            continue
        flag = row.get("iserror", "").strip()
        if flag not in ISERROR_VALUES:
            problems.add(Path(path), line, "ISERROR is not 1, 0 or empty")
            continue
        if flag in ("1", "1.0"):
            continue
        hadm = _parse_id(row["hadm_id"], "HADM_ID", Path(path), line, problems)
        subject = _parse_id(row["subject_id"], "SUBJECT_ID", Path(path), line, problems)
        if hadm is None or subject is None:
            continue  # notes without an admission cannot be labelled
        addendum = row.get("description", "").strip().lower().startswith("addendum")
        yield {
            "hadm_id": hadm,
            "subject_id": subject,
            "addendum": addendum,
            "chartdate": row.get("chartdate", ""),
            "order": order,
            "text": row["text"],
        }


def _group_admissions(notes: datasets.Dataset) -> Iterator[dict]:
    """Concatenate the sorted note rows of each admission (reports, then addenda)."""
    current: dict | None = None
    for row in notes:
        if current is not None and row["hadm_id"] != current["hadm_id"]:
            yield current
            current = None
        if current is None:
            current = {"hadm_id": row["hadm_id"], "subject_id": row["subject_id"], "texts": []}
        current["texts"].append(row["text"])
    if current is not None:
        yield current


def _join_texts(batch: dict) -> dict:
    return {
        "text": ["\n\n".join(texts) for texts in batch["texts"]],
        "n_notes": [len(texts) for texts in batch["texts"]],
    }


def read_admissions(folder: Path, problems: ProblemLog, cache_dir: str | None) -> datasets.Dataset:
    """One row per admission with a discharge summary: hadm_id, subject_id,
    text (its reports, then addenda, joined) and n_notes."""
    path = find_file(folder, "NOTEEVENTS")
    if path is None:
        raise ClinfedError(f"{folder}: no NOTEEVENTS.csv found")
    stat = os.stat(path)
    stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
    notes = rows_to_dataset(
        _note_rows,
        {"path": str(path), "problems": problems, "stamp": stamp},
        NOTE_FEATURES,
        cache_dir,
    )
    if len(notes) == 0:
        empty = {name: [] for name in ADMISSION_FEATURES}
        return datasets.Dataset.from_dict(empty, features=ADMISSION_FEATURES)
    notes = notes.sort(["hadm_id", "addendum", "chartdate", "order"])
    grouped = datasets.Dataset.from_generator(
        _group_admissions, gen_kwargs={"notes": notes}, cache_dir=cache_folder(cache_dir)
    )  # not empty: every admission has at least one note
    return grouped.map(_join_texts, batched=True, remove_columns=["texts"])


def read_split_files(folder: Path) -> dict[int, str]:
    """HADM_ID -> split from CAML split files (``train_50_hadm_ids.csv`` ...)."""
    assignment: dict[int, str] = {}
    for split in ("train", "dev", "test"):
        for path in sorted(folder.glob(f"{split}_*hadm_ids.csv")):
            try:
                text = path.read_bytes().decode("utf-8-sig")
            except OSError as exc:
                raise ClinfedError(f"{path}: cannot read ({exc.strerror})") from None
            except UnicodeDecodeError as exc:
                line = path.read_bytes().count(b"\n", 0, exc.start) + 1
                raise ClinfedError(f"{path}:{line}: bytes that are not UTF-8") from None
            for line_no, raw in enumerate(text.splitlines(), 1):
                value = raw.strip().split(",")[0]
                if not value or not value.isdigit() or len(value) > 18:
                    if line_no == 1 and value.lower() == "hadm_id":
                        continue
                    raise ClinfedError(f"{path}:{line_no}: not a HADM_ID")
                assignment[int(value)] = split
    if not assignment:
        raise ClinfedError(
            f"{folder}: no CAML split files (train_*hadm_ids.csv, test_*hadm_ids.csv)"
        )
    return assignment


def patient_split(subject_id: int, key: str | int, test_fraction: float) -> str:
    """Keyed split by patient: every admission of a patient lands on one side.

    A hash of (key, patient) rather than a shuffled list, so the split of a
    patient does not depend on which other patients are in the corpus. The
    key is the site's (:data:`clinfed.tasks.base.SPLIT_KEY` by default),
    never a run setting: a server that chose it could move any patient
    into the evaluated split.
    """
    digest = hashlib.sha256(f"{key}:{subject_id}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2**64 < test_fraction else "train"
