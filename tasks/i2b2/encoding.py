"""i2b2 examples as the encoder sees them: one row per line (sentence),
cut into windows at word boundaries, the first sub-word of each word
carrying its BIO label; and a batch of them padded into tensors."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import datasets
import numpy as np
import torch

from clinfed.modeling.models import special_tokens
from clinfed.tasks.base import rows_to_dataset, tokenizing_fingerprint
from clinfed.tasks.i2b2.bio import decode_tags, encode_tags
from clinfed.tasks.i2b2.format import Document
from clinfed.tasks.i2b2.schema import OUTSIDE

IGNORE = -100
OUTSIDE_ID = 0  # bio_labels puts O first
LINE_FEATURES = datasets.Features(
    {
        "doc": datasets.Value("int32"),
        "line": datasets.Value("int32"),
        "site": datasets.Value("string"),
        "words": datasets.Sequence(datasets.Value("string")),
        "tags": datasets.Sequence(datasets.Value("int16")),
        # 1 for a word inside any gold span, whether or not its type is one
        # the run predicts (SAFL's relevance mask on the public probe)
        "inside": datasets.Sequence(datasets.Value("int8")),
    }
)


def window_words(word_lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """Cut a line into [start, end) word ranges of at most ``capacity`` sub-words."""
    windows, start, used = [], 0, 0
    for i, length in enumerate(word_lengths):
        length = min(length, capacity)
        if used + length > capacity and i > start:
            windows.append((start, i))
            start, used = i, 0
        used += length
    windows.append((start, len(word_lengths)))
    return windows


def encode_lines(
    records: list[Document],
    label_names: list[str],
    may_be: dict[str, list[int]],
    tokenizer: Any,
    max_length: int,
    cache_dir: str | None,
) -> datasets.Dataset:
    """The documents' lines as encoder windows (``may_be``: per site, the
    labels an O token may really be, under partial labels)."""
    # datasets shards list-valued gen_kwargs, so each document travels
    # with its index rather than relying on enumeration order.
    label_ids = {label: i for i, label in enumerate(label_names)}
    rows = rows_to_dataset(
        line_rows,
        {"indexed_docs": list(enumerate(records)), "label_ids": label_ids},
        LINE_FEATURES,
        cache_dir,
    )
    only_outside = [1] + [0] * (len(label_names) - 1)
    prefix, suffix = special_tokens(tokenizer)
    before, after = len(prefix), len(suffix)
    capacity = max_length - before - after

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(batch["words"], is_split_into_words=True, add_special_tokens=False)
        out = defaultdict(list)
        for i, words in enumerate(batch["words"]):
            ids, word_ids = enc["input_ids"][i], enc.word_ids(i)
            pieces: list[list[int]] = [[] for _ in words]
            for token_id, w in zip(ids, word_ids):
                pieces[w].append(token_id)
            for start, end in window_words([len(p) for p in pieces], capacity):
                input_ids, labels, positions, in_concept = [], [], [], []
                for w in range(start, end):
                    kept = pieces[w][:capacity] or [tokenizer.unk_token_id]
                    tag = int(batch["tags"][i][w])
                    labels += [tag] + [IGNORE] * (len(kept) - 1)
                    positions += [w - start] + [-1] * (len(kept) - 1)
                    in_concept += [int(batch["inside"][i][w])] * len(kept)
                    input_ids += kept
                input_ids = prefix + input_ids + suffix
                out["input_ids"].append(input_ids)
                out["labels"].append([IGNORE] * before + labels + [IGNORE] * after)
                out["word_index"].append([-1] * before + positions + [-1] * after)
                out["concept_mask"].append([0] * before + in_concept + [0] * after)
                out["word_start"].append(start)
                out["n_tokens"].append(len(input_ids))
                out["outside_may_be"].append(may_be.get(batch["site"][i], only_outside))
                for key in ("doc", "line", "site"):
                    out[key].append(batch[key][i])
        return dict(out)

    return rows.map(
        tokenize,
        batched=True,
        batch_size=256,
        remove_columns=rows.column_names,
        desc=None,
        new_fingerprint=tokenizing_fingerprint(rows, tokenize, tokenizer),
    )


def collate_lines(batch: dict[str, list], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch of encoded lines padded into the model's tensors."""
    width = max(len(ids) for ids in batch["input_ids"])
    n = len(batch["input_ids"])
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    relevant = torch.zeros((n, width), dtype=torch.long)
    for i, (ids, lab) in enumerate(zip(batch["input_ids"], batch["labels"])):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
        relevant[i, : len(ids)] = torch.tensor(batch["concept_mask"][i])
    relevant[:, 0] = 1  # [CLS]
    tensors = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "relevant": relevant,
    }
    may_be = torch.tensor(batch["outside_may_be"], dtype=torch.bool)
    if may_be.sum(dim=1).gt(1).any():  # some example's site leaves a type out
        tensors["outside_may_be"] = may_be
    return tensors


def line_rows(indexed_docs: list[tuple[int, Document]], label_ids: dict[str, int]):
    """One row per non-empty line of each (index, document)."""
    # A gold type the run does not predict (a model used on data with other
    # types) is O for the model; scoring still counts the span.
    for index, doc in indexed_docs:
        tags = encode_tags(doc)
        for line_no, (words, line_tags) in enumerate(zip(doc.lines, tags), start=1):
            if words:
                yield {
                    "doc": index,
                    "line": line_no,
                    "site": doc.site,
                    "words": words,
                    "tags": [label_ids.get(t, OUTSIDE_ID) for t in line_tags],
                    "inside": [int(t != OUTSIDE) for t in line_tags],
                }


def concepts_from_outputs(
    records: list[Document], examples: datasets.Dataset, outputs: list[Any], labels: list[str]
) -> dict[str, list]:
    """Concepts per document id from per-example label ids (the inverse of
    :func:`encode_lines`: each window's words back on their line)."""
    tags = [[[OUTSIDE] * len(t) for t in doc.lines] for doc in records]
    columns = examples.select_columns(["doc", "line", "word_start", "word_index"])
    for example, predicted in zip(columns, outputs):
        line_tags = tags[example["doc"]][example["line"] - 1]
        index = np.asarray(example["word_index"])
        for pos in np.flatnonzero(index >= 0):
            line_tags[example["word_start"] + index[pos]] = labels[int(predicted[pos])]
    return {doc.doc_id: decode_tags(doc.lines, t) for doc, t in zip(records, tags)}
