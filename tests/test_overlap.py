"""Public means public by content: a public input that holds private notes
in another form, or names cut from the private annotations, is refused."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from clinfed.core.errors import ClinfedError
from clinfed.core.provenance import check_public_input
from clinfed.tasks.i2b2.synth import generate

from .test_cli import run_cli


@pytest.fixture(scope="module")
def private(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("overlap") / "private"
    generate(data, sites=3, docs=10, seed=1)
    return data


def _names(data: Path) -> list[str]:
    found = set()
    for con in (data / "train").rglob("*.con"):
        for line in con.read_text().splitlines():
            match = re.match(r'^c="(.*)" \d+:\d+ \d+:\d+\|\|', line)
            if match:
                found.add(match.group(1))
    return sorted(found)


def _refused(public: Path, data: Path, why: str) -> None:
    with pytest.raises(ClinfedError, match=why) as refused:
        check_public_input("--public-data", public, data)
    assert "ZQX" not in str(refused.value)  # names no note text


def test_a_converted_copy_of_the_private_notes_is_refused(private, tmp_path):
    # (BRAT's .txt files keep the notes' bytes; CoNLL's columns do not.)
    for to, why in (("conll", "sentences of a private note"), ("brat", "private data")):
        result = run_cli("data", "convert", str(private), "--to", to, "--out", str(tmp_path / to))
        assert result.returncode == 0, result.stderr
        _refused(tmp_path / to, private, why)


def test_a_copy_with_bytes_added_or_notes_concatenated_is_refused(private, tmp_path):
    edited = tmp_path / "edited"
    shutil.copytree(private / "train", edited)
    for path in edited.rglob("*"):
        if path.is_file():
            path.write_bytes(path.read_bytes() + b"x")
    _refused(edited, private, "sentences of a private note")
    joined = tmp_path / "joined.txt"
    notes = sorted((private / "train" / "beth" / "txt").glob("*.txt"))[:2]
    joined.write_text("".join(n.read_text() for n in notes))
    _refused(joined, private, "sentences of a private note")


def test_a_name_list_cut_from_the_private_annotations_is_refused(private, tmp_path):
    names = _names(private)
    assert len(names) > 100
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "problem.txt").write_text("\n".join(names) + "\n")
    _refused(lists, private, "list of names annotated in the private data")


def test_public_text_of_other_patients_and_a_public_list_pass(private, tmp_path):
    # Another draw of the same templates shares single sentences by chance,
    # rarely pairs in order; a real list shares a few names.
    other = tmp_path / "other"
    generate(other, sites=3, docs=30, seed=7)
    check_public_input("--public-data", other, private)
    repo = Path(__file__).resolve().parents[1]
    check_public_input("--gazetteer", repo / "clinfed" / "public" / "chemicals.txt", private)
    check_public_input("--public-data", repo / "clinfed" / "public", private)
    few = tmp_path / "few.txt"
    few.write_text("\n".join(_names(private)[:10]) + "\n")  # a short list of common names
    check_public_input("--gazetteer", few, private)
