"""i2b2 2010 concept extraction as token classification.

One example per line (= sentence). Words are split into sub-words; the first
sub-word of each word carries its BIO label and the rest are ignored (-100).
A line longer than the encoder's window is cut at word boundaries into
several examples, so no word (and no label) is dropped; a single word longer
than the window keeps its first sub-words, which include the labelled one.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.nn import functional as F

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.models import special_tokens
from clinfed.tasks.base import Corpus, Task, rows_to_dataset
from clinfed.tasks.i2b2.bio import LABEL_TO_ID, LABELS, OUTSIDE, decode_tags, encode_tags
from clinfed.tasks.i2b2.brat import read_brat
from clinfed.tasks.i2b2.conll import conll_files, parse_types, read_conll
from clinfed.tasks.i2b2.format import Document, read_corpus, write_con
from clinfed.tasks.i2b2.metrics import prf, score_concepts

IGNORE = -100
OUTSIDE_ID = LABEL_TO_ID[OUTSIDE]
LINE_FEATURES = datasets.Features(
    {
        "doc": datasets.Value("int32"),
        "line": datasets.Value("int32"),
        "site": datasets.Value("string"),
        "words": datasets.Sequence(datasets.Value("string")),
        "tags": datasets.Sequence(datasets.Value("int8")),
    }
)
TEST_FRACTION = 0.2
FORMATS = ("auto", "i2b2", "conll", "brat")
PROBE_SEED = 20_101


def _held_out(doc_id: str, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < TEST_FRACTION


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


class I2b2Task(Task):
    """Concept extraction over i2b2 2010 ``.txt``/``.con`` corpora.

    Parameters
    ----------
    seed
        Seeds the held-out split when the data folder has no ``train/`` and
        ``test/`` folders (20% of documents, by a hash of the file stem).
    """

    name = "i2b2"
    head = "token"
    defaults = {"max_length": 128, "batch_size": 16, "lr": 1e-4, "head_lr": 1e-3}

    def __init__(self, seed: int = 0, format: str = "auto", types: Any = None):  # noqa: A002
        if format not in FORMATS:
            raise ClinfedError(f"--format must be one of {', '.join(FORMATS)}, not {format!r}")
        self.seed, self.format, self.types = seed, format, parse_types(types)
        self.labels = list(LABELS)
        self.pad_id = 0  # set from the tokenizer by encode()

    # ---------------------------------------------------------------- reading
    def _read(self, folder: Path, problems: ProblemLog) -> list[Document]:
        """Every document of ``folder`` in the run's format."""
        found = self.format
        if found == "auto":
            present = {
                "conll": bool(conll_files(Path(folder), ProblemLog("skip"))),
                "brat": any(Path(folder).rglob("*.ann")),
                "i2b2": any(Path(folder).rglob("*.con")),
            }
            seen = [name for name, there in present.items() if there]
            if len(seen) > 1:
                raise ClinfedError(
                    f"{folder}: holds {' and '.join(seen)} files; say which with --format"
                )
            found = seen[0] if seen else "i2b2"
        if found == "conll":
            return read_conll(folder, problems, self.types)
        if found == "brat":
            return read_brat(folder, problems, self.types)
        if self.types:
            raise ClinfedError(
                "--types maps CoNLL or BRAT entity types; i2b2 .con files use i2b2's own"
            )
        return read_corpus(folder, problems)

    def load(self, data: Path, problems: ProblemLog) -> Corpus:
        data = Path(data)
        if (data / "train").is_dir() and (data / "test").is_dir():
            train = self._read(data / "train", problems)
            test = self._read(data / "test", problems)
        else:
            docs = self._read(data, problems)
            train = [d for d in docs if not _held_out(d.doc_id, self.seed)]
            test = [d for d in docs if _held_out(d.doc_id, self.seed)]
        # A document of an annotated split without its .con would train on
        # nothing or be scored as having no concepts: never silently.
        for doc in train + test:
            if not doc.annotated:
                problems.add(
                    doc.txt_path,
                    None,
                    "no .con file beside this .txt (an annotated split needs one per note; "
                    "--on-error skip leaves the note out)",
                )
        problems.raise_if_any()
        train = [d for d in train if d.annotated]
        test = [d for d in test if d.annotated]
        sites = sorted({d.site for d in train} | {d.site for d in test})
        return Corpus(
            train, test, sites, {"train_documents": len(train), "test_documents": len(test)}
        )

    def read_documents(self, folder: Path, problems: ProblemLog) -> list[Document]:
        """All documents of one folder (for ``evaluate`` and ``predict``)."""
        return self._read(folder, problems)

    def summarize(self, data: Path, problems: ProblemLog) -> dict[str, Any]:
        docs = self._read(Path(data), problems)
        return {
            "documents": len(docs),
            "annotated_documents": sum(d.annotated for d in docs),
            "lines": sum(len(d.lines) for d in docs),
            "tokens": sum(len(t) for d in docs for t in d.lines),
            "concepts": dict(Counter(c.type for d in docs for c in d.concepts)),
            "multi_line_concepts": sum(c.start[0] != c.end[0] for d in docs for c in d.concepts),
            "assertions": dict(Counter(a.value for d in docs for a in d.assertions)),
            "sites": dict(Counter(d.site for d in docs)),
            "problems": [str(p) for p in problems.problems],
        }

    # --------------------------------------------------------------- encoding
    def encode(
        self, records: list[Document], tokenizer, max_length: int, cache_dir: str | None
    ) -> datasets.Dataset:
        # datasets shards list-valued gen_kwargs, so each document travels
        # with its index rather than relying on enumeration order.
        rows = rows_to_dataset(
            _line_rows, {"indexed_docs": list(enumerate(records))}, LINE_FEATURES, cache_dir
        )
        self.pad_id = tokenizer.pad_token_id
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
                        in_concept += [int(tag != OUTSIDE_ID)] * len(kept)
                        input_ids += kept
                    input_ids = prefix + input_ids + suffix
                    out["input_ids"].append(input_ids)
                    out["labels"].append([IGNORE] * before + labels + [IGNORE] * after)
                    out["word_index"].append([-1] * before + positions + [-1] * after)
                    out["concept_mask"].append([0] * before + in_concept + [0] * after)
                    out["word_start"].append(start)
                    out["n_tokens"].append(len(input_ids))
                    for key in ("doc", "line", "site"):
                        out[key].append(batch[key][i])
            return dict(out)

        return rows.map(
            tokenize, batched=True, batch_size=256, remove_columns=rows.column_names, desc=None
        )

    units = {
        "example": "one sentence (a line of a note; the windows of a long line folded into one)",
        "document": "one note (every sentence of it, sampled and clipped together)",
    }

    def unit_keys(self, examples: datasets.Dataset, unit: str) -> list[Any]:
        super().unit_keys(examples, unit)
        if unit == "document":
            return list(examples["doc"])
        return list(zip(examples["doc"], examples["line"]))

    def group_keys(self, examples: datasets.Dataset) -> list[Any] | None:
        return list(examples["doc"])

    def collate(self, batch: dict[str, list]) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids in batch["input_ids"])
        n = len(batch["input_ids"])
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        relevant = torch.zeros((n, width), dtype=torch.long)
        for i, (ids, lab) in enumerate(zip(batch["input_ids"], batch["labels"])):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
            relevant[i, : len(ids)] = torch.tensor(batch["concept_mask"][i])
        relevant[:, 0] = 1  # [CLS]
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "labels": labels,
            "relevant": relevant,
        }

    def meta(self) -> dict[str, Any]:
        return super().meta() | {"format": self.format, "types": self.types}

    def relevant_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sub-words of words inside a gold concept span, and [CLS]."""
        return batch["relevant"]

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)

    def example_losses(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        per_token = F.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none"
        )
        labelled = (labels != IGNORE).sum(dim=1).clamp(min=1)
        return per_token.sum(dim=1) / labelled

    def outputs(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[Any]:
        predicted = logits.argmax(-1).cpu().numpy()
        return [predicted[i] for i in range(predicted.shape[0])]

    def partition_keys(self, records: list[Document], examples: datasets.Dataset):
        """Groups are documents; a document's label is its most frequent
        concept type (0 problem, 1 test, 2 treatment; 3 when it has none)."""
        labels = []
        for doc in records:
            counts = Counter(c.type for c in doc.concepts)
            kinds = ("problem", "test", "treatment")
            labels.append(max(range(3), key=lambda i: counts[kinds[i]]) if counts else 3)
        return np.asarray(examples["doc"]), np.asarray(labels)

    # ------------------------------------------------------------- decoding
    def predicted_concepts(
        self, records: list[Document], examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, list]:
        """Concepts per document id from per-example label predictions."""
        tags = [[[OUTSIDE] * len(t) for t in doc.lines] for doc in records]
        columns = examples.select_columns(["doc", "line", "word_start", "word_index"])
        for example, predicted in zip(columns, outputs):
            line_tags = tags[example["doc"]][example["line"] - 1]
            index = np.asarray(example["word_index"])
            for pos in np.flatnonzero(index >= 0):
                line_tags[example["word_start"] + index[pos]] = self.labels[int(predicted[pos])]
        return {doc.doc_id: decode_tags(doc.lines, t) for doc, t in zip(records, tags)}

    def evaluate(
        self, records: list[Document], examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, Any]:
        predicted = self.predicted_concepts(records, examples, outputs)
        gold = {d.doc_id: d.concepts for d in records if d.annotated}
        scores = score_concepts(gold, {k: v for k, v in predicted.items() if k in gold})
        per_site = {}
        for site in sorted({d.site for d in records}):
            ids = [d.doc_id for d in records if d.site == site and d.annotated]
            site_scores = score_concepts({k: gold[k] for k in ids}, {k: predicted[k] for k in ids})
            per_site[site] = site_scores["exact"]["micro"]["f1"]
        return {
            "f1": scores["exact"]["micro"]["f1"],
            "inexact_f1": scores["inexact"]["micro"]["f1"],
            "scores": scores,
            "per_site_f1": per_site,
        }

    def evaluation_counts(
        self, records: list[Document], examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, list[float]]:
        """Per mode: [correct predictions, predictions, found gold, gold].

        Only the documents ``examples`` come from count, so a site may pass
        the pooled records with its own examples.
        """
        predicted = self.predicted_concepts(records, examples, outputs)
        present = set(np.asarray(examples["doc"]).tolist()) if len(examples) else set()
        gold = {d.doc_id: d.concepts for i, d in enumerate(records) if d.annotated and i in present}
        scores = score_concepts(gold, {k: v for k, v in predicted.items() if k in gold})
        counts = {}
        for mode in ("exact", "inexact"):
            micro = scores[mode]["micro"]
            n_pred, n_gold = micro["n_pred"], micro["n_gold"]
            counts[mode] = [
                round(micro["precision"] * n_pred),
                n_pred,
                round(micro["recall"] * n_gold),
                n_gold,
            ]
        return counts

    def metrics_from_counts(self, counts: dict[str, list[float]]) -> dict[str, float]:
        return {
            "f1": prf(*counts["exact"])["f1"],
            "inexact_f1": prf(*counts["inexact"])["f1"],
        }

    def public_probe(self, tokenizer, max_length: int, cache_dir: str) -> datasets.Dataset:
        from clinfed.tasks.i2b2.synth import generate

        folder = Path(cache_dir) / "probe"
        generate(folder, sites=3, docs=4, seed=PROBE_SEED)
        records = read_corpus(folder / "train", ProblemLog())  # the generator writes i2b2
        return self.encode(records, tokenizer, max_length, cache_dir).shuffle(seed=PROBE_SEED)

    def write_predictions(
        self, records: list[Document], examples: datasets.Dataset, outputs: list[Any], folder: Path
    ) -> None:
        predicted = self.predicted_concepts(records, examples, outputs)
        for doc in records:
            write_con(Path(folder) / f"{doc.doc_id}.con", predicted[doc.doc_id])


def _line_rows(indexed_docs: list[tuple[int, Document]]):
    for index, doc in indexed_docs:
        tags = encode_tags(doc)
        for line_no, (words, line_tags) in enumerate(zip(doc.lines, tags), start=1):
            if words:
                yield {
                    "doc": index,
                    "line": line_no,
                    "site": doc.site,
                    "words": words,
                    "tags": [LABEL_TO_ID[t] for t in line_tags],
                }
