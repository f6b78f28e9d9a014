"""The plural rule that ``benchmarks/terminology.py --inflect`` adds to the
public name lists a gazetteer reads (pure string rules, no terminology
package needed)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from terminology import plural  # noqa: E402


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
