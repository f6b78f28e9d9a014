"""The i2b2 reader: real samples, layouts, sites, and every validation error."""

from __future__ import annotations

from pathlib import Path

import pytest

from clinfed.core.errors import DataError, ProblemLog
from clinfed.tasks.i2b2.bio import decode_tags, encode_tags
from clinfed.tasks.i2b2.format import (
    Concept,
    format_concept,
    read_corpus,
    site_from_stem,
    write_con,
)

SECRET = "Pneumothorax"  # stands for note text: must never appear in an error


def write_doc(folder: Path, stem: str, text: str, con: str | bytes | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.txt").write_text(text)
    if con is not None:
        path = folder / f"{stem}.con"
        path.write_bytes(con if isinstance(con, bytes) else con.encode())


def test_cliner_samples_parse_with_every_concept_checked(cliner_dir):
    docs = {d.doc_id: d for d in read_corpus(cliner_dir)}
    assert {k: len(d.concepts) for k, d in docs.items()} == {
        "ex_doc": 58,
        "pretend": 6,
        "multi": 2,
        "single": 1,
    }
    for doc in docs.values():
        for concept in doc.concepts:
            assert concept.text == doc.span_text(concept.start, concept.end)
    first = docs["ex_doc"].concepts[0]
    assert (first.start, first.end, first.type, first.text) == (
        (4, 2),
        (4, 3),
        "problem",
        "vasovagal syncope",
    )


def test_cliner_samples_round_trip_through_bio(cliner_dir):
    for doc in read_corpus(cliner_dir):
        assert decode_tags(doc.lines, encode_tags(doc)) == doc.concepts


def test_quotes_inside_concept_text_and_multi_line_concepts(tmp_path):
    text = (
        'She calls it "leaky valve" today .\nHistory of chronic obstructive\npulmonary disease .\n'
    )
    con = (
        'c=""leaky valve"" 1:3 1:4||t="problem"\n'
        'c="chronic obstructive pulmonary disease" 2:2 3:1||t="problem"\n'
    )
    write_doc(tmp_path, "record-1", text, con)
    (doc,) = read_corpus(tmp_path)
    assert [c.text for c in doc.concepts] == [
        '"leaky valve"',
        "chronic obstructive pulmonary disease",
    ]
    tags = encode_tags(doc)
    assert tags[1][2:] == ["B-problem", "I-problem"]
    assert tags[2][:3] == ["I-problem", "I-problem", "O"]
    assert decode_tags(doc.lines, tags) == doc.concepts
    assert format_concept(doc.concepts[0]) == 'c=""leaky valve"" 1:3 1:4||t="problem"'


def test_release_site_layout_and_stems(tmp_path):
    write_doc(tmp_path / "beth" / "txt", "record-13", "Fever .\n", None)
    (tmp_path / "beth" / "concept").mkdir()
    (tmp_path / "beth" / "concept" / "record-13.con").write_text('c="fever" 1:0 1:0||t="problem"\n')
    write_doc(tmp_path / "partners" / "txt", "018636330_DH", "Cough .\n", None)
    (tmp_path / "partners" / "concept").mkdir()
    (tmp_path / "partners" / "concept" / "018636330_DH.con").write_text(
        'c="cough" 1:0 1:0||t="problem"\n'
    )
    docs = read_corpus(tmp_path)
    assert [(d.site, d.doc_id, len(d.concepts)) for d in docs] == [
        ("beth", "record-13", 1),
        ("partners", "018636330_DH", 1),
    ]


def test_test_layout_flat_text_with_concepts_folder(tmp_path):
    write_doc(tmp_path, "0001", "Fever .\n", None)
    (tmp_path / "concepts").mkdir()
    (tmp_path / "concepts" / "0001.con").write_text('c="fever" 1:0 1:0||t="problem"\n')
    write_doc(tmp_path / "txt", "123456789_WGH", "Cough .\n", None)
    docs = {d.doc_id: d for d in read_corpus(tmp_path)}
    assert docs["0001"].annotated and len(docs["0001"].concepts) == 1
    assert docs["0001"].site == "unknown"
    assert docs["123456789_WGH"].site == "partners" and not docs["123456789_WGH"].annotated


def test_site_from_stem():
    assert site_from_stem("record-105") == "beth"
    assert site_from_stem("018636330_DH") == "partners"
    assert site_from_stem("123456789") == "partners"
    assert site_from_stem("0001") is None


def test_assertion_files_are_read(tmp_path):
    write_doc(tmp_path, "record-1", "No fever .\n", 'c="fever" 1:1 1:1||t="problem"\n')
    (tmp_path / "record-1.ast").write_text('c="fever" 1:1 1:1||t="problem"||a="absent"\n')
    (doc,) = read_corpus(tmp_path)
    assert [(a.concept.text, a.value) for a in doc.assertions] == [("fever", "absent")]


BAD_CON_CASES = [
    ('c="pneumothorax" 1:9 1:9||t="problem"', "token offset 9 past the end of line 1"),
    ('c="pneumothorax" 1:1 1:1||t="diagnosis"', "is not one of problem, test, treatment"),
    ('c="pneumonia" 1:1 1:1||t="problem"', "concept text does not match the tokens at 1:1-1:1"),
    ('c="pneumothorax" 1:1||t="problem"', "malformed concept line"),
    ('c="pneumothorax" 0:1 0:1||t="problem"', "line 0 in a span"),
    ('c="left pneumothorax" 1:1 1:0||t="problem"', "end 1:0 before start 1:1"),
    ('c="pneumothorax" 7:1 7:1||t="problem"', "line 7 past the end of the document"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_CON_CASES)
def test_each_bad_concept_line_is_reported_with_file_and_line(tmp_path, line, reason):
    con = 'c="left" 1:0 1:0||t="problem"\n' + line + "\n"
    write_doc(tmp_path, "record-1", f"Left {SECRET} .\n", con)
    with pytest.raises(DataError) as info:
        read_corpus(tmp_path)
    (problem,) = info.value.problems
    assert str(problem).startswith(f"{tmp_path / 'record-1.con'}:2: ")
    assert reason in str(problem)
    assert SECRET.lower() not in str(problem).lower()
    assert "diagnosis" not in str(problem)  # a type's value is the note's, never echoed


def test_overlapping_concepts_are_reported(tmp_path):
    con = 'c="left pneumothorax" 1:0 1:1||t="problem"\nc="pneumothorax" 1:1 1:1||t="problem"\n'
    write_doc(tmp_path, "record-1", f"Left {SECRET} .\n", con)
    with pytest.raises(DataError, match="overlaps"):
        read_corpus(tmp_path)


def test_con_without_txt(tmp_path):
    write_doc(tmp_path, "record-1", "Fever .\n", 'c="fever" 1:0 1:0||t="problem"\n')
    (tmp_path / "record-2.con").write_text('c="fever" 1:0 1:0||t="problem"\n')
    with pytest.raises(DataError, match=r"record-2\.con: \.con file without a matching \.txt"):
        read_corpus(tmp_path)


def test_bytes_that_are_not_utf8(tmp_path):
    (tmp_path / "record-1.txt").write_bytes(b"Fever .\nCough \xff\xfe .\n")
    with pytest.raises(DataError) as info:
        read_corpus(tmp_path)
    assert str(info.value.problems[0]).startswith(f"{tmp_path / 'record-1.txt'}:2: bytes that")


def test_no_documents(tmp_path):
    with pytest.raises(DataError, match="no documents"):
        read_corpus(tmp_path)


def test_strict_mode_collects_every_problem_before_failing(tmp_path):
    con = "\n".join(line for line, _ in BAD_CON_CASES) + "\n"
    write_doc(tmp_path, "record-1", f"Left {SECRET} .\n", con)
    with pytest.raises(DataError) as info:
        read_corpus(tmp_path)
    assert [p.line for p in info.value.problems] == list(range(1, len(BAD_CON_CASES) + 1))


def test_skip_mode_reports_and_leaves_the_bad_concept_out(tmp_path):
    con = 'c="left" 1:0 1:0||t="problem"\nc="pneumothorax" 1:9 1:9||t="problem"\n'
    write_doc(tmp_path, "record-1", f"Left {SECRET} .\n", con)
    (tmp_path / "record-2.txt").write_bytes(b"\xff\n")
    problems = ProblemLog("skip")
    docs = read_corpus(tmp_path, problems)
    assert [d.doc_id for d in docs] == ["record-1"]
    assert [c.text for c in docs[0].concepts] == ["left"]
    assert len(problems.problems) == 2


def test_write_con_round_trips(tmp_path):
    concepts = [
        Concept((2, 0), (2, 1), "test", "a cbc"),
        Concept((1, 3), (1, 3), "problem", "fever"),
    ]
    write_con(tmp_path / "x.con", concepts)
    assert (tmp_path / "x.con").read_text().splitlines() == [
        'c="fever" 1:3 1:3||t="problem"',
        'c="a cbc" 2:0 2:1||t="test"',
    ]
