"""CoNLL / IOB column files as concept-extraction input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clinfed.core.errors import ClinfedError, DataError, ProblemLog
from clinfed.tasks.i2b2.conll import read_conll
from clinfed.tasks.i2b2.schema import TypeNames, parse_types

from .test_cli import run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "conll_bc5cdr"
TYPES = {"Disease": "problem", "Chemical": "treatment"}
MAPPED = TypeNames(TYPES)


def _write(tmp_path: Path, text: str, name: str = "site1/notes.conll") -> Path:
    path = tmp_path / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return tmp_path / "data"


def _spans(doc) -> list[tuple]:
    return [(c.start, c.end, c.type, c.text) for c in doc.concepts]


def test_docstart_sentences_and_every_tag_scheme(tmp_path):
    text = (
        "-DOCSTART- -X- O O\n\n"
        "Aspirin NN B-Chemical\ncaused VB O\nrenal JJ B-Disease\nfailure NN I-Disease\n\n"
        "-DOCSTART- -X- O O\n\n"
        # IOBES: S- single, B- .. E- span; IOB1: I- with nothing open starts one
        "cisplatin S-Chemical\nnephro B-Disease\ntoxicity E-Disease\nand O\n"
        "fever I-Disease\n"
    )
    docs = read_conll(_write(tmp_path, text), ProblemLog(), MAPPED)
    assert [d.doc_id for d in docs] == ["site1-notes-1", "site1-notes-2"]
    assert all(d.site == "site1" and d.annotated for d in docs)
    assert docs[0].lines == [["Aspirin", "caused", "renal", "failure"]]
    assert _spans(docs[0]) == [
        ((1, 0), (1, 0), "treatment", "aspirin"),
        ((1, 2), (1, 3), "problem", "renal failure"),
    ]
    assert _spans(docs[1]) == [
        ((1, 0), (1, 0), "treatment", "cisplatin"),
        ((1, 1), (1, 2), "problem", "nephro toxicity"),
        ((1, 4), (1, 4), "problem", "fever"),
    ]


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("a O\nb X-Disease\n", 2, "not O, B-, I-, E- or S-"),
        ("a O\nb\n", 2, "without a tag"),
        ("a O\n\nb B-Gene\n", 3, "entity type on this line is not in --types"),
        (b"a O\nb\xff O\n", 2, "not UTF-8"),
    ],
)
def test_bad_lines_are_named_by_file_and_line(tmp_path, text, line, reason):
    data = _write(tmp_path, text)
    with pytest.raises(DataError) as caught:
        read_conll(data, ProblemLog(), MAPPED)
    assert f"notes.conll:{line}: " in str(caught.value) and reason in str(caught.value)


def test_types_map_keep_or_come_from_a_toml_file(tmp_path):
    assert parse_types("Disease=problem, Chemical=treatment") == TYPES
    assert parse_types("Disease,Chemical=drug") == {"Disease": "Disease", "Chemical": "drug"}
    table = tmp_path / "types.toml"
    table.write_text('[types]\nDisease = "problem"\nChemical = "treatment"\n')
    assert parse_types(str(table)) == TYPES
    for bad in ("=problem", "Disease=", "Dis ease=problem", "Disease=O", "a=b=c"):
        with pytest.raises(ClinfedError, match="`types`"):
            parse_types(bad)
    table.write_text("Disease = 3\n")
    with pytest.raises(ClinfedError, match="types.toml"):
        parse_types(str(table))


def test_training_on_real_conll_text_with_a_type_map(tmp_path):
    # The documented command (docs/data-formats.md) on an excerpt of BC5CDR
    # (tests/fixtures/SOURCES.md).
    run = tmp_path / "run"
    trained = run_cli("train", "--task", "i2b2", "--format", "conll",
                      "--types", "Disease=problem,Chemical=treatment", "--data", str(FIXTURE),
                      "--model", "tiny", "--strategy", "fedavg", "--rounds", "1",
                      "--max-length", "64", "--threads", "1", "--out", str(run))  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    # Mapped onto i2b2 types: the i2b2 preset, so the model is interchangeable.
    labels = json.loads((run / "labels.json").read_text())
    assert labels["labels"] == ["O", "B-problem", "I-problem", "B-test", "I-test",
                                "B-treatment", "I-treatment"]  # fmt: skip
    # A declaration that leaves a type out is an error naming file and line.
    partial = run_cli("train", "--task", "i2b2", "--data", str(FIXTURE), "--model", "tiny",
                      "--types", "Disease", "--out", str(tmp_path / "partial"))  # fmt: skip
    assert partial.returncode == 2
    assert re.search(r"\.tsv:\d+: the entity type on this line is not in --types", partial.stderr)
    # Without --types the data's own types are the label set.
    own = tmp_path / "own"
    kept = run_cli("train", "--task", "i2b2", "--data", str(FIXTURE), "--model", "tiny",
                   "--strategy", "centralized", "--rounds", "1", "--max-length", "32",
                   "--threads", "1", "--out", str(own))  # fmt: skip
    assert kept.returncode == 0, kept.stderr
    labels = json.loads((own / "labels.json").read_text())
    assert labels["labels"] == ["O", "B-Chemical", "I-Chemical", "B-Disease", "I-Disease"]
    assert labels["source"].startswith("from the data")
    exact = json.loads((own / "summary.json").read_text())["detail"]["exact"]
    assert {"Chemical", "Disease"} <= set(exact) and "problem" not in exact
    checked = run_cli("data", "check", str(FIXTURE / "train"), "--task", "i2b2",
                      "--types", "Disease=problem,Chemical=treatment", "--json")  # fmt: skip
    assert checked.returncode == 0 and '"treatment"' in checked.stdout


def test_safl_profiles_its_public_probe_whatever_the_input_format(tmp_path):
    from clinfed.modeling.models import load_tokenizer
    from clinfed.tasks.i2b2.adapter import I2b2Task

    task = I2b2Task(format="conll", types=TYPES)
    probe = task.public_probe(load_tokenizer("tiny"), 32, str(tmp_path))
    assert len(probe) > 0  # the project's own generator writes i2b2 files


def test_every_shipped_public_file_is_recorded_with_its_hash_and_licence():
    # Text shipped in the wheel carries its provenance: each file's sha256
    # prefix in public/SOURCES.md, the GENIA licence text beside the BioNLP
    # corpora (their licence asks for it), and no file of BC5CDR, the
    # benchmark's private corpus (a public folder holding it could be the
    # sites' own text).
    import hashlib

    import clinfed

    public = Path(clinfed.__file__).parent / "public"
    sources = (public / "SOURCES.md").read_text()
    shipped = sorted(public.glob("*.tsv"))
    assert shipped
    for path in shipped:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        assert f"`{path.name}`" in sources and digest in sources, path.name
        assert "bc5cdr" not in path.name.lower()
    if any(p.name.startswith("bionlp") for p in shipped):
        assert "Corpus annotations (c) GENIA Project" in (public / "GENIA-LICENSE.txt").read_text()
