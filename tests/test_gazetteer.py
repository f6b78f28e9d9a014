"""--gazetteer: public names marked as token-type ids, computed from the
unit's own words, kept with the model and recorded by digest."""

from __future__ import annotations

import json
from copy import deepcopy
from pathlib import Path

import pytest
import torch

from clinfed.core.errors import ClinfedError
from clinfed.modeling.adapters import TYPE_TABLE, add_bias, shared_names, shared_state
from clinfed.modeling.gazetteer import Gazetteer, PieceMarker, name_key
from clinfed.modeling.models import (
    add_prompts,
    attach_gazetteer,
    build_model,
    gazetteer_of,
    load_saved_model,
    load_tokenizer,
    save_model,
)

from .test_cli import run_cli
from .test_warmstart import _public

WORDS = "Patients given 5 - fluorouracil and Cisplatin developed acute renal failure .".split()


def _ids(tokenizer, *sentences: list[str]) -> torch.Tensor:
    rows = [tokenizer(s, is_split_into_words=True)["input_ids"] for s in sentences]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])


def _lists(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Chemical.txt").write_text("# drugs\n5-fluorouracil\ncisplatin\n\n")
    (folder / "Disease.txt").write_text("acute renal failure\nfever\n")
    return folder


def _train(corpus: Path, lists: Path, out: Path, *more: str):
    """``clinfed train`` with the lists: tiny, one round, DP at epsilon 8."""
    return run_cli(
        "train", "--task", "i2b2", "--data", str(corpus), "--model", "tiny",
        "--strategy", "fedavg", "--rounds", "1", "--max-length", "32", "--threads", "1",
        "--target-epsilon", "8", "--device", "cpu", "--gazetteer", str(lists),
        "--out", str(out), *more,
    )  # fmt: skip


def test_names_are_matched_whole_longest_first_across_punctuation_and_case():
    gazetteer = Gazetteer.of(["5-Fluorouracil", "acute renal failure", "renal failure"])
    assert name_key("5 - FU") == "5-fu"
    marked = gazetteer.mark_words(WORDS)
    assert [w for w, m in zip(WORDS, marked) if m] == [
        "5", "-", "fluorouracil", "acute", "renal", "failure",
    ]  # fmt: skip
    # A listed name inside a longer word sequence is found; a part of a name is not.
    assert gazetteer.mark_words(["renal", "failure"]) == [True, True]
    assert gazetteer.mark_words(["acute", "renal"]) == [False, False]


def test_word_pieces_of_listed_names_get_type_one_and_nothing_else_does(tmp_path):
    tokenizer = load_tokenizer("tiny")
    marker = PieceMarker(Gazetteer.read(_lists(tmp_path)), tokenizer)
    ids = _ids(tokenizer, WORDS, ["fever", "again"])
    marks = marker(ids)
    pieces = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    marked = [p for p, m in zip(pieces, marks[0].tolist()) if m]
    assert (
        "".join(p.removeprefix("##") for p in marked) == "5-fluorouracilcisplatinacuterenalfailure"
    )
    assert marks[0, 0] == 0 and marks[0, len(pieces) - 1] == 0  # [CLS], [SEP]
    assert marks[1].tolist()[:3] == [0, 1, 0] and marks[1, 3:].sum() == 0  # padding unmarked
    # A window's marks come from its own tokens alone: the same whatever
    # other windows share its batch (no other unit shapes its input).
    assert torch.equal(marker(ids[1:]), marks[1:])
    assert torch.equal(marker(_ids(tokenizer, WORDS)), marks[:1])


def test_the_marks_reach_the_encoder_and_a_list_that_names_nothing_changes_nothing():
    tokenizer = load_tokenizer("tiny")
    model = build_model("token", "tiny", 3).eval()
    ids = _ids(tokenizer, WORDS)
    mask = torch.ones_like(ids)
    plain = model(ids, mask)
    attach_gazetteer(model, Gazetteer.of(["no such name here"]), tokenizer)
    assert torch.equal(model(ids, mask), plain)
    attach_gazetteer(model, Gazetteer.of(["cisplatin"]), tokenizer)
    assert not torch.allclose(model(ids, mask), plain)
    # A site's copy of the model marks the same names and shares the list
    # (it can hold a million names) instead of copying it.
    copy = deepcopy(model)
    assert copy.gazetteer is model.gazetteer and torch.equal(copy(ids, mask), model(ids, mask))


def test_personal_prompts_keep_the_marks_of_the_real_tokens():
    tokenizer = load_tokenizer("tiny")
    ids = _ids(tokenizer, WORDS)
    mask = torch.ones_like(ids)
    model = add_prompts(build_model("token", "tiny", 3), length=4, fusion="concat").eval()
    plain = model(ids, mask)
    attach_gazetteer(model, Gazetteer.of(["cisplatin"]), tokenizer)
    assert not torch.allclose(model(ids, mask), plain)


def test_a_saved_model_keeps_its_list_and_refuses_a_changed_one(tmp_path):
    tokenizer = load_tokenizer("tiny")
    gazetteer = Gazetteer.read(_lists(tmp_path / "lists"))
    model = attach_gazetteer(build_model("token", "tiny", 3), gazetteer, tokenizer).eval()
    folder = tmp_path / "model"
    save_model(model, folder, {"head": "token", "labels": ["O", "B-x", "I-x"]}, tokenizer)
    meta = json.loads((folder / "model.json").read_text())
    assert meta["gazetteer"] == {"names": 4, "sha256": gazetteer.sha256}
    loaded, _, _ = load_saved_model(folder)
    assert gazetteer_of(loaded).sha256 == gazetteer.sha256
    ids = _ids(tokenizer, WORDS)
    assert torch.equal(loaded.eval()(ids, torch.ones_like(ids)), model(ids, torch.ones_like(ids)))
    # A run started from it (--model) reads the same marks.
    started = build_model("token", str(folder), 3, labels=["O", "B-x", "I-x"])
    assert gazetteer_of(started).sha256 == gazetteer.sha256
    (folder / "gazetteer.txt").write_text("cisplatin\n")
    with pytest.raises(ClinfedError, match="not the name list this model was trained with"):
        load_saved_model(folder)


def test_a_mark_per_list_numbers_the_lists_in_file_name_order(tmp_path):
    lists = _lists(tmp_path / "lists")
    one = Gazetteer.read(lists)
    per_list = Gazetteer.read(lists, per_list=True)
    # One mark for all: the list, its digest and what is recorded are as before.
    assert one.kinds == () and one.describe() == {"names": 4, "sha256": one.sha256}
    assert one.sha256 == Gazetteer.of(["5-fluorouracil", "cisplatin", "acute renal failure",
                                       "fever"]).sha256  # fmt: skip
    assert set(one.mark_ids(WORDS)) == {0, 1}
    # Per list: Chemical.txt before Disease.txt, so chemicals 1 and diseases 2.
    assert per_list.kinds == ("Chemical", "Disease") and per_list.marks == 2
    assert [(w, m) for w, m in zip(WORDS, per_list.mark_ids(WORDS)) if m] == [
        ("5", 1), ("-", 1), ("fluorouracil", 1), ("Cisplatin", 1),
        ("acute", 2), ("renal", 2), ("failure", 2),
    ]  # fmt: skip
    assert per_list.mark_words(WORDS) == one.mark_words(WORDS)
    # The names themselves, (first word, words, mark): two names side by side
    # stay two, which the marks alone cannot say.
    assert per_list.name_spans(WORDS) == [(2, 3, 1), (6, 1, 1), (8, 3, 2)]
    assert per_list.name_spans(["cisplatin", "Cisplatin"]) == [(0, 1, 1), (1, 1, 1)]
    assert per_list.sha256 != one.sha256
    assert per_list.describe()["lists"] == ["Chemical", "Disease"]
    # What a saved model keeps reads back as the same lists, flag or not.
    kept = tmp_path / "gazetteer.txt"
    kept.write_text(per_list.text())
    assert kept.read_text().startswith("#list Chemical\n")
    again = Gazetteer.read(kept)
    assert again.kinds == per_list.kinds and again.sha256 == per_list.sha256
    # A name in two lists takes the first list's mark.
    (lists / "Disease.txt").write_text("cisplatin\nfever\n")
    assert Gazetteer.read(lists, per_list=True).mark_ids(["cisplatin"]) == [1]
    (tmp_path / "bad.txt").write_text("#list Chemical\naspirin\n#list \nfever\n")
    with pytest.raises(ClinfedError, match=rf"{tmp_path / 'bad.txt'}:3: a #list line names no"):
        Gazetteer.read(tmp_path / "bad.txt")


def test_a_mark_per_list_grows_the_type_table_and_is_kept_with_the_model(tmp_path):
    tokenizer = load_tokenizer("tiny")
    gazetteer = Gazetteer.read(_lists(tmp_path / "lists"), per_list=True)
    model = build_model("token", "tiny", 3).eval()
    before = model.encoder.embeddings.token_type_embeddings.weight.detach().clone()
    attach_gazetteer(model, gazetteer, tokenizer)
    table = model.encoder.embeddings.token_type_embeddings.weight
    # A row for the second list, a copy of the single mark's row: at the
    # start every list reads as the single mark did.
    assert table.shape[0] == 3 and model.encoder.config.type_vocab_size == 3
    assert torch.equal(table[:2], before) and torch.equal(table[2], before[1])
    ids = _ids(tokenizer, WORDS)
    mask = torch.ones_like(ids)
    types = model._inputs(ids, mask)["token_type_ids"]
    assert set(types[0].tolist()) == {0, 1, 2}
    single = attach_gazetteer(build_model("token", "tiny", 3).eval(), Gazetteer.read(
        tmp_path / "lists"), tokenizer)  # fmt: skip
    assert torch.allclose(model(ids, mask), single(ids, mask), atol=1e-6)
    with torch.no_grad():
        table[2] += 0.5  # training tells the lists apart
    assert not torch.allclose(model(ids, mask), single(ids, mask))
    folder = tmp_path / "model"
    save_model(model, folder, {"head": "token", "labels": ["O", "B-x", "I-x"]}, tokenizer)
    assert json.loads((folder / "model.json").read_text())["gazetteer"]["lists"] == [
        "Chemical", "Disease",
    ]  # fmt: skip
    loaded, _, _ = load_saved_model(folder)
    assert gazetteer_of(loaded).kinds == ("Chemical", "Disease")
    assert torch.equal(loaded.eval()(ids, mask), model(ids, mask))
    # A run started from it (--model) reads the same marks with the same rows.
    started = build_model("token", str(folder), 3, labels=["O", "B-x", "I-x"])
    assert started.encoder.embeddings.token_type_embeddings.weight.shape[0] == 3
    assert gazetteer_of(started).sha256 == gazetteer.sha256


def test_the_bias_plan_trains_the_marks_rows_only_where_names_are_marked(tmp_path):
    tokenizer = load_tokenizer("tiny")
    gazetteer = Gazetteer.read(_lists(tmp_path / "lists"), per_list=True)
    plain = shared_names(add_bias(build_model("token", "tiny", 3)))
    assert TYPE_TABLE not in plain  # no gazetteer: the table is BERT's, left alone
    marked = add_bias(attach_gazetteer(build_model("token", "tiny", 3), gazetteer, tokenizer))
    assert set(shared_names(marked)) - set(plain) == {TYPE_TABLE}
    assert TYPE_TABLE in shared_state(marked)


def test_a_private_bias_run_with_marks_trains_and_keeps_their_rows(i2b2_corpus, tmp_path):
    lists = _lists(tmp_path / "lists")
    out = tmp_path / "run"
    done = _train(i2b2_corpus, lists, out, "--adapter", "bias", "--gazetteer-marks", "per-list")
    assert done.returncode == 0, done.stderr
    marks = Gazetteer.read(lists, per_list=True)
    start = attach_gazetteer(build_model("token", "tiny", 3), marks, load_tokenizer("tiny"))
    saved, _, _ = load_saved_model(out / "model")
    table = saved.encoder.embeddings.token_type_embeddings.weight
    assert table.shape == start.encoder.embeddings.token_type_embeddings.weight.shape
    assert not torch.allclose(table, start.encoder.embeddings.token_type_embeddings.weight)
    # The rest of the embeddings stay the start's: only the bias plan's numbers moved.
    assert torch.equal(
        saved.encoder.embeddings.word_embeddings.weight,
        start.encoder.embeddings.word_embeddings.weight,
    )


def test_train_with_a_mark_per_list_records_and_reports_the_lists(i2b2_corpus, tmp_path):
    out = tmp_path / "run"
    done = _train(i2b2_corpus, _lists(tmp_path / "lists"), out, "--gazetteer-marks", "per-list")
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["gazetteer_list"]["lists"] == ["Chemical", "Disease"]
    assert (out / "model" / "gazetteer.txt").read_text().startswith("#list Chemical\n")
    assert run_cli("report", str(out)).returncode == 0
    assert "a mark per list: Chemical, Disease" in (out / "report" / "report.md").read_text()


def test_a_list_the_tokenizer_or_encoder_cannot_mark_is_refused(tmp_path):
    bad = tmp_path / "names.txt"
    bad.write_bytes(b"cisplatin\nna\xefve\n")
    with pytest.raises(ClinfedError, match=rf"{bad}:2: not UTF-8 text"):
        Gazetteer.read(bad)
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(ClinfedError, match="lists no name"):
        Gazetteer.read(tmp_path / "empty.txt")
    with pytest.raises(ClinfedError, match="no such file or folder"):
        Gazetteer.read(tmp_path / "missing")


def test_train_with_a_gazetteer_records_it_keeps_it_and_reports_it(i2b2_corpus, tmp_path):
    lists = _lists(tmp_path / "lists")
    out = tmp_path / "run"
    done = _train(i2b2_corpus, lists, out, "--gazetteer-marks", "one")
    assert done.returncode == 0, done.stderr
    digest = Gazetteer.read(lists).sha256
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["gazetteer"] == str(lists)
    assert config["gazetteer_list"] == {"names": 4, "sha256": digest}
    assert (out / "model" / "gazetteer.txt").read_text() == Gazetteer.read(lists).text()
    assert run_cli("report", str(out)).returncode == 0
    assert (
        f"gazetteer: 4 names, SHA-256 {digest[:16]}" in (out / "report" / "report.md").read_text()
    )
    # Predictions from the saved run read the marks it was trained with.
    scored = run_cli("evaluate", str(out), "--data", str(i2b2_corpus / "test"), "--json")
    assert scored.returncode == 0, scored.stderr


def test_bad_gazetteer_input_is_one_line_and_exit_two(i2b2_corpus, tmp_path):
    bad = tmp_path / "names.txt"
    bad.write_bytes(b"cisplatin\n\xff\n")
    done = run_cli(
        "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--strategy", "fedavg", "--rounds", "1", "--gazetteer", str(bad),
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert done.returncode == 2 and f"{bad}:2: not UTF-8 text" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


def test_a_warm_start_keeps_its_list_and_a_different_one_is_refused(i2b2_corpus, tmp_path):
    lists = _lists(tmp_path / "lists")
    start = tmp_path / "start"
    made = run_cli(
        "warm-start", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", "tiny",
        "--max-length", "32", "--threads", "1", "--device", "cpu", "--out", str(start),
        "--public-data", str(_public(tmp_path / "public")),
        "--public-types", "Disease=problem,Chemical=treatment", "--gazetteer", str(lists),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (start / "gazetteer.txt").is_file()
    other = tmp_path / "other.txt"
    other.write_text("aspirin\n")
    refused = run_cli(
        "train", "--task", "i2b2", "--data", str(i2b2_corpus), "--model", str(start),
        "--strategy", "fedavg", "--rounds", "1", "--gazetteer", str(other),
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert refused.returncode == 2 and "was trained to read another name list" in refused.stderr


def test_on_flower_the_list_travels_inside_the_pinned_model_folder(tmp_path):
    from clinfed.core.provenance import data_fingerprint
    from clinfed.flower.deploy import flower_run_config

    with pytest.raises(ClinfedError, match="gazetteer: on Flower, make the starting model"):
        flower_run_config({"task": "i2b2", "strategy": "fedavg", "gazetteer": "g"}, tmp_path)
    with pytest.raises(ClinfedError, match="gazetteer-marks: on Flower, make the starting"):
        flower_run_config(
            {"task": "i2b2", "strategy": "fedavg", "gazetteer-marks": "per-list"}, tmp_path
        )
    # A node pins the model folder by its files' digest: the list is one of them.
    tokenizer = load_tokenizer("tiny")
    model = attach_gazetteer(build_model("token", "tiny", 3), Gazetteer.of(["fever"]), tokenizer)
    folder = tmp_path / "model"
    save_model(model, folder, {"head": "token", "labels": ["O", "B-x", "I-x"]}, tokenizer)
    pinned = data_fingerprint(folder)
    (folder / "gazetteer.txt").write_text("aspirin\n")
    assert data_fingerprint(folder) != pinned


def test_a_flower_node_marks_the_names_of_the_model_folder_it_pins(
    i2b2_corpus, tiny_config, tmp_path
):
    from clinfed.core.provenance import data_fingerprint
    from clinfed.runners.warmstart import warm_start_model

    from .test_guarantees import _node_site

    start = tmp_path / "start"
    warm_start_model(
        tiny_config(
            out=start,
            public_data=str(_public(tmp_path / "public")),
            public_types="Disease=problem,Chemical=treatment",
            gazetteer=str(_lists(tmp_path / "lists")),
        )
    )
    pinned = {"model": str(start), "model_sha256": data_fingerprint(start)}
    site = _node_site(i2b2_corpus, tmp_path, pinned, model=str(start), target_epsilon=8.0)
    held = site.runner.model
    assert gazetteer_of(held).sha256 == Gazetteer.read(tmp_path / "lists", per_list=True).sha256
    ids = _ids(load_tokenizer("tiny"), WORDS)
    assert held._inputs(ids, torch.ones_like(ids))["token_type_ids"].sum() > 0


def test_a_folder_of_lists_gets_a_mark_per_list_unless_one_is_asked_for(i2b2_corpus, tmp_path):
    lists = _lists(tmp_path / "lists")
    done = _train(i2b2_corpus, lists, tmp_path / "run")
    assert done.returncode == 0, done.stderr
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["gazetteer_list"]
    assert recorded["lists"] == ["Chemical", "Disease"]
    assert recorded["sha256"] == Gazetteer.read(lists, per_list=True).sha256


def test_a_warm_start_labels_the_public_text_s_unlabelled_names_from_the_lists(
    i2b2_corpus, tmp_path
):
    # The public text annotates Disease alone: its chemicals are O until the
    # Chemical list labels them (as treatment, through --public-types).
    public = tmp_path / "public"
    public.mkdir()
    rows = ["Cisplatin\tO", "caused\tO", "acute\tB-Disease", "renal\tI-Disease",
            "failure\tI-Disease", "and\tO", "fever\tO", ""]  # fmt: skip
    (public / "train.tsv").write_text("\n".join(rows * 10) + "\n")
    start = tmp_path / "start"
    made = run_cli(
        "warm-start", "--task", "i2b2", "--model", "tiny", "--max-length", "32",
        "--threads", "1", "--device", "cpu", "--out", str(start), "--public-data", str(public),
        "--public-types", "Disease=problem,Chemical=treatment",
        "--gazetteer", str(_lists(tmp_path / "lists")),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    record = json.loads((start / "model.json").read_text())["public_start"]
    # Ten cisplatins and ten fevers (a Disease name the gold left O); the
    # listed "acute renal failure" is gold already and is not labelled twice.
    assert record["labels_from_lists"] == {"treatment": 10, "problem": 10}
    assert record["types"] == ["problem", "treatment"]


def test_distant_labels_never_touch_a_gold_span_and_take_the_longest_name():
    from clinfed.tasks.i2b2.adapter import I2b2Task
    from clinfed.tasks.i2b2.format import Concept, Document

    gazetteer = Gazetteer.of_lists([("Chemical", ["cisplatin"]), ("Disease", ["renal failure"])])
    gold = Concept((1, 2), (1, 4), "problem", "acute renal failure")
    words = ["cisplatin", "and", "acute", "renal", "failure", "renal", "failure"]
    document = Document("d", "(public)", [words], [gold])
    task = I2b2Task(types="Chemical=treatment,Disease=problem")
    found = task.distant_labels([document], gazetteer, ("problem", "treatment"))
    assert found == {"treatment": 1, "problem": 1}
    spans = [(c.start, c.end, c.type) for c in document.concepts]
    assert spans == [((1, 0), (1, 0), "treatment"), ((1, 2), (1, 4), "problem"),
                     ((1, 5), (1, 6), "problem")]  # fmt: skip
    # A list whose type the run lacks labels nothing.
    other = Document("e", "(public)", [["cisplatin"]], [])
    assert task.distant_labels([other], gazetteer, ("problem",)) == {}
