"""Read -> examples -> gold labels decoded -> .con files -> score = 1.0."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clinfed.commands import main
from clinfed.core.errors import ProblemLog
from clinfed.modeling.models import load_tokenizer
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.tasks.i2b2.encoding import window_words


def gold_outputs(examples):
    """The labels of each example, as if a model had predicted them."""
    return [np.maximum(np.asarray(ex["labels"]), 0) for ex in examples]


@pytest.mark.parametrize("max_length", [128, 12])
def test_gold_labels_round_trip_to_perfect_exact_f1(i2b2_corpus, tmp_path, capsys, max_length):
    task = I2b2Task()
    docs = task.read_documents(i2b2_corpus / "test", ProblemLog())
    examples = task.encode(docs, load_tokenizer("tiny"), max_length, str(tmp_path / "cache"))
    if max_length == 12:  # short windows: lines must have been cut, not truncated
        assert len(examples) > sum(1 for d in docs for line in d.lines if line)
        assert max(len(ids) for ids in examples["input_ids"]) <= 12
    task.write_predictions(docs, examples, gold_outputs(examples), tmp_path / "pred")

    status = main(
        [
            "score",
            "--task",
            "i2b2",
            "--gold",
            str(i2b2_corpus / "test"),
            "--pred",
            str(tmp_path / "pred"),
            "--json",
        ]
    )
    assert status == 0
    result = json.loads(capsys.readouterr().out)
    assert result["exact"]["micro"]["f1"] == 1.0
    assert result["inexact"]["micro"]["f1"] == 1.0
    assert result["exact"]["micro"]["n_gold"] == sum(len(d.concepts) for d in docs)
    assert result["missing_predictions"] == []


def test_cliner_samples_round_trip(cliner_dir, tmp_path, capsys):
    task = I2b2Task()
    docs = task.read_documents(cliner_dir, ProblemLog())
    examples = task.encode(docs, load_tokenizer("tiny"), 16, str(tmp_path / "cache"))
    task.write_predictions(docs, examples, gold_outputs(examples), tmp_path / "pred")
    assert (
        main(
            [
                "score",
                "--task",
                "i2b2",
                "--gold",
                str(cliner_dir),
                "--pred",
                str(tmp_path / "pred"),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["exact"]["micro"]["f1"] == 1.0


def test_window_words_never_drops_a_word():
    lengths = [3, 1, 5, 2, 9, 1]
    windows = window_words(lengths, capacity=6)
    assert windows[0][0] == 0 and windows[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))
    for start, end in windows:  # a word longer than a window sits alone
        assert sum(min(n, 6) for n in lengths[start:end]) <= 6 or end - start == 1
