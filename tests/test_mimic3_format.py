"""The MIMIC-III reader: real demo files, CAML conventions, filtering, errors."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from clinfed.core.errors import ClinfedError, DataError, ProblemLog
from clinfed.tasks.mimic3.adapter import PUBLIC_LIST, Mimic3Task, public_labels
from clinfed.tasks.mimic3.format import caml_dot, patient_split, read_admissions, read_codes

SECRET = "Pneumothorax"
NOTE_HEADER_FULL = (
    '"ROW_ID","SUBJECT_ID","HADM_ID","CHARTDATE","CHARTTIME","STORETIME","CATEGORY",'
    '"DESCRIPTION","CGID","ISERROR","TEXT"\n'
)


@pytest.mark.parametrize(
    ("code", "kind", "dotted"),
    [
        ("4019", "diagnoses", "401.9"),
        ("0389", "diagnoses", "038.9"),  # leading zero kept
        ("486", "diagnoses", "486"),  # three characters: no dot
        ("V5861", "diagnoses", "V58.61"),
        ("E8782", "diagnoses", "E878.2"),  # E-codes: after four
        ("E849", "diagnoses", "E849"),
        ("9604", "procedures", "96.04"),
        ("0045", "procedures", "00.45"),
        ("401.9", "diagnoses", "401.9"),  # already dotted
    ],
)
def test_caml_dotting(code, kind, dotted):
    assert caml_dot(code, kind) == dotted


def test_demo_code_files_keep_leading_zeros(mimic_demo_dir):
    diagnoses = read_codes(mimic_demo_dir, "diagnoses", ProblemLog())
    assert len(diagnoses.codes) == 129
    assert len(set(diagnoses.subject.values())) == 100
    codes = {c for cs in diagnoses.codes.values() for c in cs}
    assert "038.9" in codes  # 0389 septicemia, read as a string
    assert any(c.startswith("0") for c in codes)
    procedures = read_codes(mimic_demo_dir, "procedures", ProblemLog())
    assert len(procedures.codes) == 113
    assert any(c.startswith("0") for cs in procedures.codes.values() for c in cs)
    both = read_codes(mimic_demo_dir, "both", ProblemLog())
    assert len(both.codes) >= 129


def test_demo_noteevents_has_no_notes(mimic_demo_dir, tmp_path):
    admissions = read_admissions(mimic_demo_dir, ProblemLog(), str(tmp_path))
    assert len(admissions) == 0


def make_site(folder: Path, notes: str, diagnoses: str, header: str = NOTE_HEADER_FULL) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "NOTEEVENTS.csv").write_text(header + notes)
    (folder / "DIAGNOSES_ICD.csv").write_text(
        '"ROW_ID","SUBJECT_ID","HADM_ID","SEQ_NUM","ICD9_CODE"\n' + diagnoses
    )
    return folder


NOTES = (
    '"1","7","100","2150-01-02","","","Discharge summary","Report","","",'
    '"Admission Date: [**2150-1-1**]\nHistory of chf.\n"\n'
    '"2","7","100","2150-01-03","","","Discharge summary","Addendum","","","Addendum: afib."\n'
    '"3","7","100","2150-01-01","","","Nursing/other","Report","","","ignore me"\n'
    '"4","7","100","2150-01-02","","","Discharge summary","Report","","1","erroneous"\n'
    '"5","7","","2150-01-02","","","Discharge summary","Report","","","no admission"\n'
    '"6","8","101","2150-02-02","","","DISCHARGE SUMMARY","Report","","","Sepsis."\n'
)
CODES = '"1","7","100","1","4280"\n"2","7","100","2","42731"\n"3","8","101","1","0389"\n'


def test_discharge_summaries_grouped_filtered_and_ordered(tmp_path):
    make_site(tmp_path, NOTES, CODES)
    admissions = read_admissions(tmp_path, ProblemLog(), str(tmp_path / "cache"))
    rows = {r["hadm_id"]: r for r in admissions}
    assert sorted(rows) == [100, 101]
    # report then addendum; nursing note, ISERROR row and the note without
    # HADM_ID are gone; the multi-line quoted TEXT is intact
    assert (
        rows[100]["text"] == "Admission Date: [**2150-1-1**]\nHistory of chf.\n\n\nAddendum: afib."
    )
    assert rows[100]["n_notes"] == 2
    assert rows[101]["text"] == "Sepsis."


def test_lower_case_unquoted_headers_match(tmp_path):
    header = (
        "row_id,subject_id,hadm_id,chartdate,charttime,storetime,category,description,"
        "cgid,iserror,text\n"
    )
    notes = '1,7,100,2150-01-02,,,Discharge summary,Report,,,"Multi\nline"\n'
    make_site(tmp_path, notes, CODES, header=header)
    (admission,) = read_admissions(tmp_path, ProblemLog(), str(tmp_path / "c"))
    assert admission["text"] == "Multi\nline"


def test_gzipped_files_are_read(tmp_path):
    site = make_site(tmp_path / "raw", NOTES, CODES)
    gz = tmp_path / "gz"
    gz.mkdir()
    for name in ("NOTEEVENTS.csv", "DIAGNOSES_ICD.csv"):
        with open(site / name, "rb") as src, gzip.open(gz / f"{name}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    assert len(read_admissions(gz, ProblemLog(), str(tmp_path / "c"))) == 2
    assert read_codes(gz, "diagnoses", ProblemLog()).codes[101] == {"038.9"}


def _problems(folder: Path, tmp_path: Path) -> list[str]:
    problems = ProblemLog()
    with pytest.raises(DataError):
        Mimic3Task(top_k=0, cache_dir=str(tmp_path / "cache")).load(folder, problems)
    return [str(p) for p in problems.problems]


def test_missing_column_names_file_and_line(tmp_path):
    header = '"ROW_ID","SUBJECT_ID","HADM_ID","CATEGORY","DESCRIPTION","ISERROR"\n'
    make_site(tmp_path / "s", '"1","7","100","Discharge summary","Report",""\n', CODES, header)
    (problem,) = _problems(tmp_path / "s", tmp_path)
    assert problem == f"{tmp_path / 's' / 'NOTEEVENTS.csv'}:1: missing column TEXT"


def test_bad_hadm_id_names_file_and_line(tmp_path):
    notes = NOTES + f'"9","9","10x","","","","Discharge summary","Report","","","{SECRET}"\n'
    make_site(tmp_path / "s", notes, CODES)
    (problem,) = _problems(tmp_path / "s", tmp_path)
    # the bad record starts on line 10 (TEXT of row 1 spans two lines)
    assert problem == f"{tmp_path / 's' / 'NOTEEVENTS.csv'}:10: HADM_ID is not an integer"
    assert SECRET not in problem


def test_unterminated_quote_names_the_record_start(tmp_path):
    notes = NOTES + f'"9","9","102","","","","Discharge summary","Report","","","{SECRET}\nmore\n'
    make_site(tmp_path / "s", notes, CODES)
    (problem,) = _problems(tmp_path / "s", tmp_path)
    assert problem.startswith(f"{tmp_path / 's' / 'NOTEEVENTS.csv'}:10: unterminated quote")
    assert SECRET not in problem


def test_bad_hadm_id_in_diagnoses(tmp_path):
    make_site(tmp_path / "s", NOTES, CODES + '"4","8","abc","2","4019"\n')
    (problem,) = _problems(tmp_path / "s", tmp_path)
    assert problem == f"{tmp_path / 's' / 'DIAGNOSES_ICD.csv'}:5: HADM_ID is not an integer"


def test_missing_notes_file_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ClinfedError, match="no NOTEEVENTS.csv"):
        Mimic3Task().load(tmp_path / "empty", ProblemLog())


def test_patient_split_is_seeded_and_by_patient():
    sides = [patient_split(s, key=3, test_fraction=0.3) for s in range(2000)]
    assert sides == [patient_split(s, key=3, test_fraction=0.3) for s in range(2000)]
    assert 0.25 < sides.count("test") / len(sides) < 0.35
    assert sides != [patient_split(s, key=4, test_fraction=0.3) for s in range(2000)]


def test_load_keeps_patients_on_one_side_and_top_k(tmp_path, mimic_corpus):
    task = Mimic3Task(top_k=10, cache_dir=str(tmp_path))
    corpus = task.load(mimic_corpus, ProblemLog())
    assert task.labels == public_labels("diagnoses", 10)
    train_patients, test_patients = set(corpus.train["subject_id"]), set(corpus.test["subject_id"])
    assert train_patients and test_patients and not train_patients & test_patients
    kept = set(task.labels)
    assert all(set(codes) & kept for codes in corpus.train["codes"])
    assert corpus.sites == ["site1", "site2"]


def test_caml_split_files_decide_the_split(tmp_path):
    # 101 also carries 428.0, so it keeps a label known from training
    make_site(tmp_path / "s", NOTES, CODES + '"4","8","101","2","4280"\n')
    (tmp_path / "s" / "train_50_hadm_ids.csv").write_text("100\n")
    (tmp_path / "s" / "test_50_hadm_ids.csv").write_text("101\n")
    corpus = Mimic3Task(top_k=0, cache_dir=str(tmp_path / "c")).load(tmp_path / "s", ProblemLog())
    assert corpus.train["hadm_id"] == [100] and corpus.test["hadm_id"] == [101]


def test_balanced_chunks_cover_every_token_within_the_window():
    from clinfed.tasks.mimic3.adapter import balanced_chunks

    for n in (0, 1, 253, 254, 255, 300, 1000):
        ids = list(range(n))
        chunks = balanced_chunks(ids, 254)
        assert [t for c in chunks for t in c] == ids
        assert all(len(c) <= 254 for c in chunks)
        assert len(chunks) == max(1, -(-n // 254))
        assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


def test_the_label_set_is_public_never_counted_from_the_sites_codes(tmp_path):
    public = [c for c in PUBLIC_LIST.read_text().split() if c]
    assert len(public) == 50
    assert public_labels("both", 0) == public  # the list, in its order
    diagnoses, procedures = public_labels("diagnoses", 0), public_labels("procedures", 0)
    assert "401.9" in diagnoses and "V58.61" in diagnoses and "38.93" in procedures
    assert sorted(diagnoses + procedures) == sorted(public)
    # Two sites whose codes differ in frequency get the same labels: none
    # comes from their data, and a code off the list (a rare one that one
    # admission carries) never becomes a label.
    rare = '"4","8","101","2","V9999"\n'

    def site(folder: Path, codes: str) -> Path:
        make_site(folder, NOTES, codes)
        (folder / "train_50_hadm_ids.csv").write_text("100\n101\n")
        return folder

    first = Mimic3Task(top_k=5, cache_dir=str(tmp_path / "c1"))
    first.load(site(tmp_path / "a", CODES + rare), ProblemLog())
    skewed = CODES + "".join(f'"{9 + i}","7","100","{3 + i}","0389"\n' for i in range(5))
    second = Mimic3Task(top_k=5, cache_dir=str(tmp_path / "c2"))
    second.load(site(tmp_path / "b", skewed), ProblemLog())
    assert first.labels == second.labels == public_labels("diagnoses", 5)
    assert "V99.99" not in first.labels and first.label_source.startswith("public")
    given = Mimic3Task(labels=["428.0", "038.9"], cache_dir=str(tmp_path / "c3"))
    assert given.labels == ["038.9", "428.0"] and "--labels" in given.label_source


def test_a_byte_that_is_not_utf8_is_reported_on_its_own_line(tmp_path):
    # 120 good notes (the reader decodes ahead in blocks: the bad byte must
    # still be reported where it is, not at the header).
    good = "".join(
        f'"{i}","{i}","{1000 + i}","","","","Discharge summary","Report","","","fine note"\n'
        for i in range(1, 121)
    )
    site = make_site(tmp_path / "s", good, CODES)
    with open(site / "NOTEEVENTS.csv", "ab") as fh:
        fh.write(b'"999","9","999","","","","Discharge summary","Report","","","caf\xe9"\n')
    (problem,) = _problems(site, tmp_path)
    assert problem == f"{site / 'NOTEEVENTS.csv'}:122: bytes that are not UTF-8"


def test_unpaired_and_negative_ids_are_counted_or_refused_never_silent(tmp_path):
    # Admission 101 has a summary and no codes; 555 has codes and no summary.
    codes = '"1","7","100","1","4280"\n"2","9","555","1","0389"\n'
    make_site(tmp_path / "s", NOTES, codes)
    summary = Mimic3Task(top_k=0, cache_dir=str(tmp_path / "c")).summarize(
        tmp_path / "s", ProblemLog()
    )
    assert summary["summaries_without_codes"] == 1
    assert summary["coded_admissions_without_a_summary"] == 1
    # A header-only NOTEEVENTS: the site has nothing usable, and says so by
    # the file's name (it never vanishes from the run).
    make_site(tmp_path / "h", "", codes)
    (problem,) = _problems(tmp_path / "h", tmp_path)
    assert problem.startswith(f"{tmp_path / 'h' / 'NOTEEVENTS.csv'}: no discharge summary")
    make_site(tmp_path / "n", NOTES, '"1","7","-100","1","4280"\n')
    (problem,) = _problems(tmp_path / "n", tmp_path)
    assert problem == f"{tmp_path / 'n' / 'DIAGNOSES_ICD.csv'}:2: HADM_ID is negative"


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_notes_file_that_is_not_a_file_is_an_error_never_a_vanished_site(tmp_path, kind):
    import os

    site = make_site(tmp_path / "s", NOTES, CODES)
    (site / "NOTEEVENTS.csv").unlink()
    if kind == "folder":
        (site / "NOTEEVENTS.csv").mkdir()
    else:
        os.mkfifo(site / "NOTEEVENTS.csv")  # opening it would wait forever
    problems = _problems(site, tmp_path)
    assert f"{site / 'NOTEEVENTS.csv'}: not a regular file" in problems[0]


@pytest.mark.parametrize(
    ("notes", "codes", "header", "said"),
    [
        (NOTES, CODES, NOTE_HEADER_FULL.replace('"CGID"', '"TEXT"'),
         "NOTEEVENTS.csv:1: column TEXT"),
        (NOTES.replace('"","1","erroneous"', '"","ZEBRA","erroneous"'), CODES, NOTE_HEADER_FULL,
         "NOTEEVENTS.csv:7: ISERROR is not 1, 0 or empty"),
        (NOTES, CODES + '"4","8","101","2","42X31"\n', NOTE_HEADER_FULL,
         "DIAGNOSES_ICD.csv:5: ICD9_CODE is not an ICD-9 diagnosis code"),
    ],
)  # fmt: skip
def test_malformed_fields_are_named_by_file_and_line(tmp_path, notes, codes, header, said):
    site = make_site(tmp_path / "s", notes, codes, header)
    problems = _problems(site, tmp_path)
    assert any(said in p for p in problems), problems
    assert not any("erroneous" in p or "42X31" in p for p in problems)  # never the value
