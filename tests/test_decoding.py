"""Constrained BIO decoding: the model's scores read as the best valid tag
sequence, not argmax word by word."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from clinfed.tasks.i2b2.adapter import IGNORE, I2b2Task
from clinfed.tasks.i2b2.bio import allowed_transitions, best_valid_tags

LABELS = ["O", "B-problem", "I-problem", "B-test", "I-test"]


def _valid(path, allowed) -> bool:
    return all(allowed[a, b] for a, b in itertools.pairwise(path))


def test_transitions_allow_inside_only_after_its_own_type():
    allowed = allowed_transitions(LABELS)
    ids = {label: i for i, label in enumerate(LABELS)}
    assert allowed[ids["B-problem"], ids["I-problem"]]
    assert allowed[ids["I-problem"], ids["I-problem"]]
    assert not allowed[ids["O"], ids["I-problem"]]
    assert not allowed[ids["B-test"], ids["I-problem"]]
    assert not allowed[ids["I-test"], ids["I-problem"]]
    # Anything may follow anything into O or a B-.
    assert allowed[:, ids["O"]].all() and allowed[:, ids["B-test"]].all()


def test_the_path_is_the_best_valid_one_by_brute_force():
    allowed = allowed_transitions(LABELS)
    rng = np.random.default_rng(0)
    for n_words in (1, 2, 3, 4):
        for _ in range(20):
            scores = np.log(rng.dirichlet(np.ones(len(LABELS)), size=n_words))
            path = best_valid_tags(scores, allowed)
            assert _valid(path, allowed)
            best = max(
                (p for p in itertools.product(range(len(LABELS)), repeat=n_words)
                 if _valid(p, allowed)),
                key=lambda p: scores[np.arange(n_words), p].sum(),
            )  # fmt: skip
            assert scores[np.arange(n_words), path].sum() == scores[np.arange(n_words), best].sum()
    assert best_valid_tags(np.zeros((0, len(LABELS))), allowed).shape == (0,)


def test_a_fragmented_concept_is_read_as_one_span():
    # argmax: B-problem, I-test, I-problem: three fragments, none exact.
    probs = np.array(
        [
            [0.1, 0.6, 0.1, 0.1, 0.1],
            [0.1, 0.05, 0.35, 0.05, 0.45],
            [0.1, 0.1, 0.6, 0.1, 0.1],
        ]
    )
    path = best_valid_tags(np.log(probs), allowed_transitions(LABELS))
    assert [LABELS[i] for i in path] == ["B-problem", "I-problem", "I-problem"]


def test_a_window_may_open_inside_a_span():
    # A line (or window) that starts by continuing the span before it.
    probs = np.array([[0.1, 0.1, 0.7, 0.05, 0.05], [0.8, 0.05, 0.05, 0.05, 0.05]])
    path = best_valid_tags(np.log(probs), allowed_transitions(LABELS))
    assert [LABELS[i] for i in path] == ["I-problem", "O"]


def test_the_task_decodes_each_windows_words_under_the_constraint():
    task = I2b2Task()
    labels = task.labels
    ids = {label: i for i, label in enumerate(labels)}
    logits = torch.full((1, 5, len(labels)), -5.0)
    # [CLS] word1 word1-piece word2 [SEP]: word2's argmax is an I- of another type.
    logits[0, 1, ids["B-problem"]] = 3.0
    logits[0, 2, ids["I-treatment"]] = 4.0  # a sub-token: never read
    logits[0, 3, ids["I-treatment"]] = 2.0
    logits[0, 3, ids["I-problem"]] = 1.5
    batch = {"labels": torch.tensor([[IGNORE, 0, IGNORE, 0, IGNORE]])}
    (predicted,) = task.outputs(logits, batch)
    assert labels[predicted[1]] == "B-problem"
    assert labels[predicted[3]] == "I-problem"
