"""Synthetic corpora: deterministic, real formats, heterogeneous sites, not trivial."""

from __future__ import annotations

import filecmp
from collections import Counter

from clinfed.core.errors import ProblemLog
from clinfed.tasks.i2b2 import synth as i2b2_synth
from clinfed.tasks.i2b2.baselines import dictionary_concepts
from clinfed.tasks.i2b2.format import read_corpus
from clinfed.tasks.i2b2.metrics import score_concepts
from clinfed.tasks.mimic3 import synth as mimic_synth
from clinfed.tasks.mimic3.adapter import Mimic3Task


def same_tree(a, b) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    return all(same_tree(a / d, b / d) for d in cmp.common_dirs)


def test_i2b2_is_deterministic_for_a_seed(tmp_path):
    for name in ("a", "b"):
        i2b2_synth.generate(tmp_path / name, sites=2, docs=4, seed=5)
    i2b2_synth.generate(tmp_path / "c", sites=2, docs=4, seed=6)
    assert same_tree(tmp_path / "a", tmp_path / "b")
    assert not same_tree(tmp_path / "a", tmp_path / "c")


def test_mimic3_is_deterministic_for_a_seed(tmp_path):
    for name in ("a", "b"):
        mimic_synth.generate(tmp_path / name, sites=2, docs=6, seed=5)
    assert same_tree(tmp_path / "a", tmp_path / "b")


def test_i2b2_layout_sites_and_strict_validation(i2b2_corpus):
    train = read_corpus(i2b2_corpus / "train")  # strict: raises on any problem
    test = read_corpus(i2b2_corpus / "test")
    assert Counter(d.site for d in train) == {"beth": 6, "partners": 6, "site3": 6}
    assert {d.site for d in test} == {"beth", "partners", "site3"}
    assert all(d.doc_id.startswith("record-") for d in train if d.site == "beth")
    assert all(d.con_path.parent.name == "concept" for d in train)
    assert all(d.con_path.parent.name == "concepts" for d in test)
    assert all(d.assertions for d in train)


def test_i2b2_sites_differ_in_vocabulary_and_label_mix(tmp_path):
    i2b2_synth.generate(tmp_path, sites=3, docs=20, seed=2)
    docs = read_corpus(tmp_path / "train")
    words = {
        s: Counter(t.lower() for d in docs if d.site == s for line in d.lines for t in line)
        for s in ("beth", "partners", "site3")
    }
    assert words["beth"]["pt"] > 20 and words["partners"]["pt"] == 0  # abbreviating site
    mix = {s: Counter(c.type for d in docs if d.site == s for c in d.concepts) for s in words}
    share = {s: mix[s]["test"] / sum(mix[s].values()) for s in mix}
    assert share["partners"] > share["beth"] + 0.05  # a lab-heavy site


def test_i2b2_test_documents_hold_unseen_forms_and_context_typed_words(tmp_path):
    i2b2_synth.generate(tmp_path, sites=3, docs=20, seed=2)
    train, test = read_corpus(tmp_path / "train"), read_corpus(tmp_path / "test")
    seen = {c.text for d in train for c in d.concepts}
    unseen = [c for d in test for c in d.concepts if c.text not in seen]
    assert len(unseen) > 0.2 * sum(len(d.concepts) for d in test)
    types_of = {}
    for d in train:
        for c in d.concepts:
            types_of.setdefault(c.text, set()).add(c.type)
    assert types_of["potassium"] == {"test", "treatment"}
    # and the dictionary baseline pays for both
    gold = {d.doc_id: d.concepts for d in test}
    f1 = score_concepts(gold, dictionary_concepts(train, test))["exact"]["micro"]["f1"]
    assert f1 < 0.8


def test_mimic3_corpus_reads_back_with_everything_the_reader_must_drop(mimic_corpus, tmp_path):
    notes = (mimic_corpus / "site1" / "NOTEEVENTS.csv").read_text()
    assert notes.startswith('"ROW_ID","SUBJECT_ID"')  # full-release header style
    assert (mimic_corpus / "site2" / "NOTEEVENTS.csv").read_text().startswith("row_id,subject_id")
    for marker in ("[**", "Addendum", "Radiology"):
        assert marker in notes
    task = Mimic3Task(codes="both", top_k=0, cache_dir=str(tmp_path))
    summary = task.summarize(mimic_corpus, ProblemLog())
    assert summary["admissions"] == 48 and summary["problems"] == []
    assert summary["notes"] > summary["admissions"]  # addenda joined per admission
    assert any(code.startswith("0") for code in summary["label_counts"])
    assert any("." in code for code in summary["label_counts"])


def test_strong_heterogeneity_makes_each_i2b2_site_lean_to_its_own_concept_type(tmp_path):
    def shares(folder, heterogeneity):
        i2b2_synth.generate(folder, sites=3, docs=10, seed=3, heterogeneity=heterogeneity)
        docs = read_corpus(folder / "train")
        result = {}
        for site in ("beth", "partners", "site3"):
            mix = Counter(c.type for d in docs if d.site == site for c in d.concepts)
            result[site] = {t: mix[t] / sum(mix.values()) for t in ("problem", "test", "treatment")}
        return result

    normal, strong = shares(tmp_path / "normal", "normal"), shares(tmp_path / "strong", "strong")
    for site, dominant in (("beth", "problem"), ("partners", "test"), ("site3", "treatment")):
        assert strong[site][dominant] > normal[site][dominant] + 0.1
        assert strong[site][dominant] == max(strong[site].values())
