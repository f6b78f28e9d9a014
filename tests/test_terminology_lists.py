"""The plural rule that ``benchmarks/terminology.py --inflect`` adds to the
public name lists a gazetteer reads, and the name endings its
``name_suffixes`` finds (pure string rules, no terminology package
needed)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from terminology import name_suffixes, plural, suffix_kind  # noqa: E402


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
