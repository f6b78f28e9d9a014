"""The plural rule that ``benchmarks/terminology.py --inflect`` adds to the
public name lists a gazetteer reads, and the name endings its
``name_suffixes`` finds (pure string rules, no terminology package
needed)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from terminology import (  # noqa: E402
    hpo_definitions,
    hpo_phenotypic_abnormalities,
    name_suffixes,
    plural,
    suffix_kind,
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("breast tumor", "breast tumors"),
        ("neuropathy", "neuropathies"),
        ("psychosis", "psychoses"),
        ("rash", "rashes"),
        ("thorax", "thoraxes"),
        ("anthracycline", "anthracyclines"),
        ("delay", "delays"),  # a vowel before the y: only an s
    ],
)
def test_plural_of_the_last_word(name, expected):
    assert plural(name) == expected


@pytest.mark.parametrize("name", ["diabetes", "herpes", "vitamin b12", "5-fu", "flu", "l-dopa"])
def test_no_plural_where_it_would_be_guesswork(name):
    # Words ending in s, numbers, symbols and words under 4 letters keep one form.
    assert plural(name) is None


def _lists(stems_per_list: int = 25) -> dict[str, set[str]]:
    # 25 chemical names ending "-azole", 25 disease names ending "-itis", and
    # 25 of each ending "-ment", which both lists share.
    letters = "abcdefghijklmnopqrstuvwxy"
    chemicals = {f"ox{a}{b}azole" for a, b in zip(letters, letters[::-1])}
    diseases = {f"acute ar{a}{b}itis" for a, b in zip(letters, letters[::-1])}
    shared = {f"tre{a}{b}ment" for a, b in zip(letters, letters[::-1])}
    return {"Chemical": chemicals | shared, "Disease": diseases | shared}


def test_an_ending_many_names_of_one_list_share_is_that_lists():
    endings = name_suffixes(_lists(), background=set(), whole=set())
    assert {"azole", "zole"} <= endings["Chemical"]
    assert {"itis", "ritis"} & endings["Disease"]
    # Both lists end names in "-ment": it says nothing about the kind.
    assert not {"ment", "tment"} & (endings["Chemical"] | endings["Disease"])
    assert suffix_kind("fluconazole", endings, whole=set()) == "Chemical"
    assert suffix_kind("gastritis", endings, whole=set()) == "Disease"
    assert suffix_kind("payment", endings, whole=set()) is None


def test_common_words_neither_set_an_ending_nor_take_a_mark():
    lists = _lists()
    # Three words outside the names end in "-azole": the ending is not kept.
    background = {"notazole", "paraazole", "metaazole"}
    assert not {"azole", "zole"} & name_suffixes(lists, background, set())["Chemical"]
    # A word the encoder's vocabulary holds whole is never marked.
    endings = name_suffixes(lists, set(), set())
    assert suffix_kind("fluconazole", endings, whole={"fluconazole"}) is None
    # Nor is a short word or one that is not letters only.
    assert suffix_kind("azole", endings, whole=set()) is None
    assert suffix_kind("5-azole", endings, whole=set()) is None


_OBO = """format-version: 1.2

[Term]
id: HP:0000001
name: All

[Term]
id: HP:0000118
name: Phenotypic abnormality
def: "A phenotypic abnormality." [HPO:probinson]
is_a: HP:0000001 ! All

[Term]
id: HP:0000005
name: Mode of inheritance
def: "The pattern in which a trait is inherited." [HPO:probinson]
is_a: HP:0000001 ! All

[Term]
id: HP:0000006
name: Autosomal dominant inheritance
def: "A mode of inheritance seen in heterozygotes." [HPO:probinson]
is_a: HP:0000005 ! Mode of inheritance

[Term]
id: HP:0001627
name: Abnormal heart morphology
def: "Any structural anomaly of the heart." [HPO:probinson]
is_a: HP:0000118 ! Phenotypic abnormality

[Term]
id: HP:0001638
name: Cardiomyopathy
def: "A disease of the heart muscle, "often" with arrhythmia." [PMID:1, HPO:x]
is_a: HP:0001627 ! Abnormal heart morphology

[Term]
id: HP:0009999
name: Retired term
def: "Obsolete." [HPO:x]
is_obsolete: true
is_a: HP:0001627 ! Abnormal heart morphology

[Typedef]
id: part_of
name: part of
"""


def test_hpo_terms_under_phenotypic_abnormality_only(tmp_path):
    obo = tmp_path / "hp.obo"
    obo.write_text(_OBO)
    # Not the root itself, not another branch (inheritance), not an obsolete term.
    assert hpo_phenotypic_abnormalities(obo) == {"HP:0001627", "HP:0001638"}


def test_hpo_definitions_of_phenotypic_abnormalities_citations_cut(tmp_path):
    obo = tmp_path / "hp.obo"
    obo.write_text(_OBO)
    assert hpo_definitions(obo) == [
        "Any structural anomaly of the heart.",
        'A disease of the heart muscle, "often" with arrhythmia.',
    ]
