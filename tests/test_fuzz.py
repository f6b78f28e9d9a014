"""Fuzzing the readers: random bytes and random mutations of valid files
must read cleanly or fail with a ClinfedError (exit 2 on the command line),
never a traceback, never a hang, and never with note text in the message.

A seeded loop (no extra dependency): every run tries the same inputs, and a
failure names the seed and the mutation to replay it.
"""

from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path

import pytest

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.tasks.i2b2.format import read_corpus
from clinfed.tasks.mimic3.adapter import Mimic3Task

FIXTURES = Path(__file__).parent / "fixtures"
SECRET = "Zorbquil"  # planted in every note: no message may ever show it
SECONDS_PER_INPUT = 10


def _mutate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(["flip", "insert", "delete", "truncate", "random", "duplicate", "splice"])
    data = bytearray(data)
    if kind == "random" or not data:
        return bytes(rng.randbytes(rng.randint(0, 300))), "random"
    at = rng.randrange(len(data))
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == "insert":
        data[at:at] = rng.choice([b"\n", b'"', b"||", b":", b"\xff", b"\x00", b",", b"\r"])
    elif kind == "delete":
        del data[at : at + rng.randint(1, 20)]
    elif kind == "truncate":
        del data[at:]
    elif kind == "duplicate":
        line_end = data.find(b"\n", at)
        data[at:at] = data[at : line_end if line_end > 0 else at + 10]
    else:
        data[at:at] = bytes(rng.randbytes(rng.randint(1, 30)))
    return bytes(data), kind


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def _must_read_or_refuse(read, where: str) -> None:
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_INPUT)
    try:
        read()
    except ClinfedError as exc:
        assert SECRET.lower() not in str(exc).lower(), f"{where}: note text in {exc}"
    except _Timeout:
        pytest.fail(f"{where}: no answer in {SECONDS_PER_INPUT} s (a hang)")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_mutated_i2b2_files_read_or_fail_cleanly(tmp_path):
    text = (FIXTURES / "i2b2_cliner" / "ex_doc.txt").read_bytes()
    con = (FIXTURES / "i2b2_cliner" / "ex_doc.con").read_bytes()
    first_word = text.split()[0]
    text, con = (
        text.replace(first_word, SECRET.encode(), 1),
        con.replace(first_word.lower(), SECRET.lower().encode()),
    )
    rng = random.Random(20261122)
    for case in range(300):
        folder = tmp_path / f"c{case}"
        folder.mkdir()
        target = rng.choice(["txt", "con", "both"])
        new_text, how_t = _mutate(text, rng) if target in ("txt", "both") else (text, "-")
        new_con, how_c = _mutate(con, rng) if target in ("con", "both") else (con, "-")
        (folder / "doc.txt").write_bytes(new_text)
        (folder / "doc.con").write_bytes(new_con)
        for on_error in ("strict", "skip"):
            _must_read_or_refuse(
                lambda f=folder, o=on_error: read_corpus(f, ProblemLog(o)),
                f"case {case} ({how_t} txt, {how_c} con, {on_error})",
            )
        shutil.rmtree(folder)


def test_mutated_mimic3_files_read_or_fail_cleanly(mimic_corpus, tmp_path):
    site = mimic_corpus / "site1"
    notes = (site / "NOTEEVENTS.csv").read_bytes()
    notes = notes.replace(b"Admission Date", SECRET.encode())
    diagnoses = (site / "DIAGNOSES_ICD.csv").read_bytes()
    rng = random.Random(11222026)
    for case in range(40):
        folder = tmp_path / f"m{case}"
        folder.mkdir()
        target = rng.choice(["notes", "codes"])
        new_notes, how_n = _mutate(notes, rng) if target == "notes" else (notes, "-")
        new_codes, how_c = _mutate(diagnoses, rng) if target == "codes" else (diagnoses, "-")
        (folder / "NOTEEVENTS.csv").write_bytes(new_notes)
        (folder / "DIAGNOSES_ICD.csv").write_bytes(new_codes)
        task = Mimic3Task(top_k=0, cache_dir=str(tmp_path / f"cache{case}"))
        _must_read_or_refuse(
            lambda f=folder, t=task: t.load(f, ProblemLog("skip")),
            f"case {case} ({how_n} notes, {how_c} codes)",
        )
        shutil.rmtree(folder)
        shutil.rmtree(tmp_path / f"cache{case}", ignore_errors=True)
