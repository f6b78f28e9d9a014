"""Scorers on hand-checked cases: i2b2 spans and CAML multi-label metrics."""

from __future__ import annotations

import numpy as np
import pytest
from seqeval.metrics import f1_score as seqeval_f1
from seqeval.scheme import IOB2

from clinfed.tasks.i2b2.bio import decode_tags
from clinfed.tasks.i2b2.format import Concept
from clinfed.tasks.i2b2.metrics import score_concepts
from clinfed.tasks.mimic3.metrics import multilabel_metrics, precision_at_k


def c(l1, t1, l2, t2, ctype):
    return Concept((l1, t1), (l2, t2), ctype)


def test_exact_and_inexact_differ_when_a_boundary_is_off():
    gold = {"d": [c(1, 0, 1, 1, "problem"), c(2, 3, 2, 3, "test")]}
    pred = {"d": [c(1, 1, 1, 1, "problem"), c(2, 3, 2, 3, "test")]}
    s = score_concepts(gold, pred)
    # exact: 1 of 2 right each way
    assert s["exact"]["micro"]["precision"] == pytest.approx(0.5)
    assert s["exact"]["micro"]["recall"] == pytest.approx(0.5)
    assert s["exact"]["micro"]["f1"] == pytest.approx(0.5)
    # inexact: the shortened problem still overlaps its gold concept
    assert s["inexact"]["micro"]["f1"] == pytest.approx(1.0)
    assert s["exact"]["problem"]["f1"] == 0.0
    assert s["exact"]["test"]["f1"] == 1.0


def test_type_must_match_even_inexactly():
    gold = {"d": [c(1, 0, 1, 1, "problem")]}
    pred = {"d": [c(1, 0, 1, 1, "treatment")]}
    s = score_concepts(gold, pred)
    assert s["exact"]["micro"]["f1"] == 0.0
    assert s["inexact"]["micro"]["f1"] == 0.0
    assert s["exact"]["treatment"]["n_pred"] == 1 and s["exact"]["problem"]["n_gold"] == 1


def test_inexact_counts_each_side_separately():
    # One long prediction overlaps two gold concepts: recall 2/2, precision 1/1.
    gold = {"d": [c(1, 0, 1, 0, "problem"), c(1, 2, 1, 2, "problem")]}
    pred = {"d": [c(1, 0, 1, 2, "problem")]}
    s = score_concepts(gold, pred)["inexact"]["micro"]
    assert (s["precision"], s["recall"]) == (1.0, 1.0)


def test_hand_computed_micro_over_documents():
    gold = {"a": [c(1, 0, 1, 0, "test"), c(1, 2, 1, 3, "test")], "b": [c(3, 1, 3, 1, "problem")]}
    pred = {"a": [c(1, 0, 1, 0, "test")], "b": [c(3, 1, 3, 1, "problem"), c(4, 0, 4, 0, "test")]}
    s = score_concepts(gold, pred)["exact"]["micro"]
    # tp = 2, pred = 3, gold = 3
    assert s["precision"] == pytest.approx(2 / 3)
    assert s["recall"] == pytest.approx(2 / 3)


def test_agrees_with_seqeval_on_single_line_concepts():
    rng = np.random.default_rng(0)
    labels = ["O", "B-problem", "I-problem", "B-test", "I-test", "B-treatment", "I-treatment"]
    gold_tags = [[labels[i] for i in rng.integers(0, 7, size=12)] for _ in range(40)]
    pred_tags = [
        [t if rng.random() < 0.7 else labels[rng.integers(0, 7)] for t in line]
        for line in gold_tags
    ]

    # Make both valid IOB2 (an I- after O or another type becomes B-), as
    # seqeval's strict mode expects.
    def fix(lines):
        out = []
        for line in lines:
            fixed, prev = [], "O"
            for tag in line:
                if tag.startswith("I-") and prev[2:] != tag[2:]:
                    tag = "B-" + tag[2:]
                fixed.append(tag)
                prev = tag
            out.append(fixed)
        return out

    gold_tags, pred_tags = fix(gold_tags), fix(pred_tags)
    # One document per line, so no span can run over a line break.
    tokens = [["w"] * 12]
    gold = {str(i): decode_tags(tokens, [g]) for i, g in enumerate(gold_tags)}
    pred = {str(i): decode_tags(tokens, [p]) for i, p in enumerate(pred_tags)}
    ours = score_concepts(gold, pred)["exact"]["micro"]["f1"]
    theirs = seqeval_f1(gold_tags, pred_tags, mode="strict", scheme=IOB2)
    assert ours == pytest.approx(theirs)


def test_precision_at_k_hand_computed():
    y = np.array([[1, 0, 1, 0], [0, 0, 0, 1]])
    s = np.array([[0.9, 0.8, 0.1, 0.0], [0.1, 0.2, 0.3, 0.4]])
    # row 0 top-2: labels 0 (true), 1 (false) -> 1/2; row 1 top-2: 3 (true), 2 -> 1/2
    assert precision_at_k(y, s, 2) == pytest.approx(0.5)
    assert precision_at_k(y, s, 1) == pytest.approx(1.0)


def test_macro_f1_two_definitions():
    y = np.array([[1, 0], [1, 0], [0, 1], [0, 0]])
    s = np.array([[0.9, 0.0], [0.1, 0.0], [0.0, 0.9], [0.0, 0.9]])
    m = multilabel_metrics(y, s, ks=(1,))
    # label 0: P 1, R 0.5; label 1: P 0.5, R 1
    assert m["macro_precision"] == pytest.approx(0.75)
    assert m["macro_recall"] == pytest.approx(0.75)
    assert m["macro_f1"] == pytest.approx(0.75)  # harmonic mean of macro P and R
    assert m["macro_f1_mean"] == pytest.approx(2 / 3)  # mean of per-label F1
    # micro: tp 2, fp 1, fn 1
    assert m["micro_f1"] == pytest.approx(2 / 3)
    assert 0.0 <= m["micro_auc"] <= 1.0 and m["f1"] == m["micro_f1"]
