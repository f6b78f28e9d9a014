"""i2b2 2010 concept extraction as token classification.

One example per line (= sentence). Words are split into sub-words; the first
sub-word of each word carries its BIO label and the rest are ignored (-100).
A line longer than the encoder's window is cut at word boundaries into
several examples, so no word (and no label) is dropped; a single word longer
than the window keeps its first sub-words, which include the labelled one.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.nn import functional as F

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.modeling.models import pad_token_id
from clinfed.tasks.base import SPLIT_KEY, Corpus, ScoreTable, Task
from clinfed.tasks.i2b2.bio import allowed_transitions, best_valid_tags
from clinfed.tasks.i2b2.brat import read_brat
from clinfed.tasks.i2b2.conll import conll_files, read_conll
from clinfed.tasks.i2b2.encoding import (
    IGNORE,
    OUTSIDE_ID,
    collate_lines,
    concepts_from_outputs,
    encode_lines,
)
from clinfed.tasks.i2b2.format import Document, check_annotated, read_corpus, summary_of, write_con
from clinfed.tasks.i2b2.metrics import f1_by_site, prf, score_concepts, summable_counts
from clinfed.tasks.i2b2.options import BASELINES, I2b2Options
from clinfed.tasks.i2b2.public_text import PublicText
from clinfed.tasks.i2b2.schema import (
    CONCEPT_TYPES,
    PRESET,
    TypeNames,
    bio_labels,
    parse_annotated,
    parse_types,
    run_types,
    types_of,
)

log = logging.getLogger("clinfed.tasks")

TEST_FRACTION = 0.2
# The most whitespace tokens one line (one sentence) may hold.
MAX_LINE_TOKENS = 10_000
FORMATS = ("auto", "i2b2", "conll", "brat")


def _held_out(doc_id: str, key: str) -> bool:
    digest = hashlib.sha256(f"{key}:{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < TEST_FRACTION


class I2b2Task(PublicText, Task):
    """Concept extraction over i2b2 2010 ``.txt``/``.con`` corpora.

    Parameters
    ----------
    split_key
        Keys the held-out split when the data folder has no ``train/`` and
        ``test/`` folders (20% of documents, by a hash of the key and the
        file stem): the site's own (:data:`~clinfed.tasks.base.SPLIT_KEY`
        unless its node config sets one), never the run's seed.
    format
        ``auto``, ``i2b2``, ``conll`` or ``brat``.
    types
        The declared entity types (``--types``, see
        :mod:`clinfed.tasks.i2b2.schema`). Without it ``.con`` files use the
        i2b2 2010 preset and CoNLL/BRAT files the types of their training
        split.
    partial_labels
        A site's ``O`` tokens are not evidence against a type the site never
        annotates (none in its training split): their loss is that of
        ``O`` *or* that type (the marginal likelihood of the labels the token
        may really have). Without it they train as plain ``O``.
    private
        The run trains under DP. Then nothing that shapes one sentence's
        loss may come from the other sentences of the site's data: a site's
        annotated types are the declared ``annotated_types`` only (none
        declared: partial labels are off), and CoNLL/BRAT types must be
        declared with ``types``.
    annotated_types
        The types each site annotates, declared: ``{site: [type, ...]}``,
        or the text ``beth=problem,test;partners=problem`` (``*`` names
        every site).
    """

    name = "i2b2"
    held_out_share = TEST_FRACTION
    head = "token"
    defaults = {"max_length": 128, "batch_size": 16, "lr": 1e-4, "head_lr": 1e-3}
    # Every weight under DP: 2e-3 and 0.0345 at batch 760 were BC5CDR's best
    # at epsilon 8 (docs/results.md), here at batch 16 by the square-root rule.
    dp_rates = {"lr": 2.9e-4, "head_lr": 5e-3}
    options = I2b2Options
    description = "i2b2 2010 concept extraction"
    records = "documents"
    baselines = BASELINES

    @classmethod
    def synthesize(cls, out: Path, *, sites: int, docs: int, seed: int, **options) -> dict:
        from clinfed.tasks.i2b2.synth import generate

        heterogeneity = options.get("heterogeneity", "normal")
        return generate(out, sites=sites, docs=docs, seed=seed, heterogeneity=heterogeneity)

    @classmethod
    def score(cls, gold: Path, pred: Path, problems: ProblemLog, **options) -> dict[str, Any]:
        from clinfed.tasks.i2b2.scoring import score_i2b2

        return score_i2b2(gold, pred, problems, options.get("types"))

    @classmethod
    def score_tables(cls, result: dict[str, Any]) -> tuple[list[ScoreTable], list[str]]:
        from clinfed.tasks.i2b2.scoring import score_tables

        return score_tables(result)

    @classmethod
    def convert(
        cls, source: Path, target: str, out: Path, problems: ProblemLog, **options: Any
    ) -> int:
        from clinfed.tasks.i2b2.convert import write_documents

        task = cls(format=options.get("format", "auto"), types=options.get("types"))
        splits = [s for s in ("train", "test") if (source / s).is_dir()]
        parts = {s: task.read_documents(source / s, problems) for s in splits} or {
            "": task.read_documents(source, problems)
        }
        return sum(
            write_documents(docs, out / split if split else out, target)
            for split, docs in parts.items()
        )

    def baseline(self, kind: str, corpus: Corpus) -> dict[str, Any]:
        from clinfed.tasks.i2b2.baselines import i2b2_dictionary

        if kind not in self.baselines:
            return super().baseline(kind, corpus)
        return i2b2_dictionary(corpus.train, corpus.test, self.entity_types)

    @classmethod
    def check_deployment(cls, config: Any) -> None:
        super().check_deployment(config)
        if config.format in ("conll", "brat") and not config.types:
            raise ClinfedError(
                f"`format` {config.format} on Flower needs `types` (the entity types to "
                "predict): otherwise they come from pooled training data, which no server sees"
            )

    def __init__(
        self,
        split_key: str = SPLIT_KEY,
        format: str = "auto",  # noqa: A002
        types: Any = None,
        partial_labels: bool = True,
        private: bool = False,
        annotated_types: Any = None,
    ):
        if format not in FORMATS:
            raise ClinfedError(f"`format` must be one of {', '.join(FORMATS)}, not {format!r}")
        self.split_key, self.format, self.types = str(split_key), format, parse_types(types)
        self.partial_labels = partial_labels
        self.private = private
        self.annotated = parse_annotated(annotated_types)
        if self.types:
            self.labels = bio_labels(run_types(self.types.values()))
            self.label_source = "declared with --types"
            self.named_types = set(self.types.values())
        else:
            self.labels = bio_labels(CONCEPT_TYPES)
            self.label_source = "the i2b2 2010 preset (problem, test, treatment)"
            self.named_types = set(CONCEPT_TYPES)
        # The types each site annotates (its training split's), set by load():
        # local knowledge, never sent.
        self.site_types: dict[str, set[str]] = {}
        self.pad_id = 0  # set from the tokenizer by encode()

    @property
    def entity_types(self) -> tuple[str, ...]:
        """The types the run predicts, in label order."""
        return types_of(self.labels)

    # ---------------------------------------------------------------- reading
    def _read(self, folder: Path, problems: ProblemLog) -> list[Document]:
        """Every document of ``folder`` in the run's format."""
        return self._read_found(folder, problems)[0]

    def _read_found(self, folder: Path, problems: ProblemLog) -> tuple[list[Document], str]:
        """(documents, the format they were read as)."""
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
                    f"{folder}: holds {' and '.join(seen)} files; say which with `format`"
                )
            found = seen[0] if seen else "i2b2"
        if self.types:
            names = TypeNames(self.types)
        else:
            names = PRESET if found == "i2b2" else TypeNames(open=True)
        if found == "conll":
            return read_conll(folder, problems, names), found
        if found == "brat":
            return read_brat(folder, problems, names), found
        return read_corpus(folder, problems, names), found

    def load(self, data: Path, problems: ProblemLog) -> Corpus:
        data = Path(data)
        if (data / "train").is_dir() and (data / "test").is_dir():
            train, found = self._read_found(data / "train", problems)
            test = self._read(data / "test", problems)
        else:
            docs, found = self._read_found(data, problems)
            train = [d for d in docs if not _held_out(d.doc_id, self.split_key)]
            test = [d for d in docs if _held_out(d.doc_id, self.split_key)]
        # A line past the limit is a note without line breaks (or not text):
        # tens of thousands of windows from one line, never silently.
        too_long = set()
        for doc in train + test:
            for number, tokens in enumerate(doc.lines, start=1):
                if len(tokens) > MAX_LINE_TOKENS:
                    problems.add(
                        doc.txt_path,
                        number,
                        f"a line of {len(tokens):,} tokens; at most {MAX_LINE_TOKENS:,} "
                        "(a note without line breaks?); --on-error skip leaves the note out",
                    )
                    too_long.add(id(doc))
        train = [d for d in train if id(d) not in too_long]
        test = [d for d in test if id(d) not in too_long]
        check_annotated(train + test, problems)
        problems.raise_if_any()
        train = [d for d in train if d.annotated]
        test = [d for d in test if d.annotated]
        if not self.types and found != "i2b2" and self.private:
            raise ClinfedError(
                f"{data}: under DP the entity types of {found} files must be declared with "
                "`types` (types read from the training split would let one annotation change "
                "every sentence's labels)"
            )
        if not self.types and found != "i2b2":
            names = sorted({c.type for d in train for c in d.concepts})
            if not names:
                raise ClinfedError(
                    f"{data}: no entity annotated in the training documents, so no types to learn"
                )
            self.labels = bio_labels(run_types(names))
            self.named_types = set(names)
            self.label_source = (
                "from the data: the entity types annotated in the training split (type "
                "names only; on Flower they are declared)"
            )
        sites = sorted({d.site for d in train} | {d.site for d in test})
        self.site_types = self._annotated_by_site(sites, train)
        return Corpus(
            train, test, sites, {"train_documents": len(train), "test_documents": len(test)}
        )

    def _annotated_by_site(self, sites: list[str], train: list[Document]) -> dict[str, set[str]]:
        """The types each site annotates. Without DP: those of its training
        split. Under DP: only what was declared (a set read from the data
        is a statistic of every sentence; one annotation would move every
        sentence's loss target); a site that declared nothing gets no open
        types (plain ``O``)."""
        if not self.private:
            found: dict[str, set[str]] = {}
            for doc in train:
                found.setdefault(doc.site, set()).update(c.type for c in doc.concepts)
            return found
        named = set(self.entity_types)
        declared = {}
        for site, types in self.annotated.items():
            unknown = sorted(set(types) - named)
            if unknown:
                raise ClinfedError(
                    f"`annotated_types`: {site} names {unknown[0]!r}, not a type of this run "
                    f"({', '.join(self.entity_types)})"
                )
            if site != "*" and site not in sites:
                raise ClinfedError(
                    f"`annotated_types`: no site {site!r} (found {', '.join(sites)})"
                )
        for site in sites:
            if site in self.annotated or "*" in self.annotated:
                declared[site] = set(self.annotated.get(site, self.annotated.get("*", ())))
        # A site that declares nothing annotates every type of the run (its
        # O tokens are O), as i2b2's guideline and a --types map say. Said
        # only when some sites declared and others did not: likely an omission.
        if self.partial_labels and 0 < len(declared) < len(sites):
            log.warning(
                "--annotated-types names some sites but not %s: they are taken to annotate "
                "every type (O tokens trained as O); name them to say otherwise",
                ", ".join(s for s in sites if s not in declared),
            )
        return declared

    def read_documents(self, folder: Path, problems: ProblemLog) -> list[Document]:
        """All documents of one folder (for ``evaluate`` and ``predict``)."""
        return self._read(folder, problems)

    def at_node(self, split_key: str, annotated_types: Any) -> None:
        # What the site annotates is the site's declaration, never the
        # server's, and under DP never its data's.
        super().at_node(split_key, None)
        self.annotated = {"*": list(annotated_types)} if annotated_types is not None else {}

    def loaded_state(self) -> dict[str, Any]:
        state = super().loaded_state()
        state["site_types"] = {s: sorted(t) for s, t in self.site_types.items()}
        return state

    def restore_loaded_state(self, state: dict[str, Any]) -> None:
        super().restore_loaded_state(state)
        self.site_types = {s: set(t) for s, t in state.get("site_types", {}).items()}

    def summarize(self, data: Path, problems: ProblemLog) -> dict[str, Any]:
        docs = self._read(Path(data), problems)
        if any(d.annotated for d in docs):  # an annotated corpus: the rule train applies
            check_annotated(docs, problems)
            problems.raise_if_any()
        return summary_of(docs, problems)

    # --------------------------------------------------------------- encoding
    def encode(
        self, records: list[Document], tokenizer, max_length: int, cache_dir: str | None
    ) -> datasets.Dataset:
        # Per site, a 0/1 row over the labels: what an O token may really be.
        may_be = {
            site: [int(i == OUTSIDE_ID or i in ids) for i in range(len(self.labels))]
            for site, ids in self._open_labels().items()
        }
        self.pad_id = pad_token_id(tokenizer)
        return encode_lines(records, self.labels, may_be, tokenizer, max_length, cache_dir)

    def _open_labels(self) -> dict[str, list[int]]:
        """Per site, the labels an ``O`` token may really be under partial
        labels: ``B-``/``I-`` of every type the run names (declared, or
        found in the data) that the site never annotates. A type only in
        the label set to keep the i2b2 preset's layout (``test`` when
        ``--types`` maps onto problem and treatment) is never open: nobody
        annotates it, so every ``O`` is evidence against it; open, nothing
        would hold the model back from predicting it."""
        if not self.partial_labels:
            return {}
        ids = {label: i for i, label in enumerate(self.labels)}
        named = [t for t in self.entity_types if t in self.named_types]
        return {
            site: [ids[f"{p}-{t}"] for t in named if t not in seen for p in "BI"]
            for site, seen in self.site_types.items()
        }

    units = {
        "example": "one sentence (a line of a note; the windows of a long line folded into one)",
        "document": "one note (every sentence of it, sampled and clipped together)",
    }

    def unit_keys(self, examples: datasets.Dataset, unit: str) -> list[Any]:
        super().unit_keys(examples, unit)
        if unit == "document":
            return list(examples["doc"])
        return list(zip(examples["doc"], examples["line"]))

    def collate(self, batch: dict[str, list]) -> dict[str, torch.Tensor]:
        return collate_lines(batch, self.pad_id)

    def meta(self) -> dict[str, Any]:
        return super().meta() | {"format": self.format, "types": self.types}

    def relevant_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sub-words of words inside a gold concept span, and [CLS]."""
        return batch["relevant"]

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    @staticmethod
    def token_losses(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Loss of every token, ``(batch, width)``; 0 where unlabelled.

        An ``O`` token of an example whose site never annotates some types
        (``outside_may_be``: per example, the labels it may really have)
        costs ``-log P(O or any of those)``, so the site teaches nothing
        against the types it does not annotate.
        """
        labels = batch["labels"]
        per_token = F.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none"
        )
        may_be = batch.get("outside_may_be")
        if may_be is None:
            return per_token
        marginal = torch.logsumexp(logits, -1) - torch.logsumexp(
            logits.masked_fill(~may_be[:, None, :], float("-inf")), -1
        )
        return torch.where(labels == OUTSIDE_ID, marginal, per_token)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labelled = (batch["labels"] != IGNORE).sum().clamp(min=1)
        return self.token_losses(logits, batch).sum() / labelled

    def example_losses(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labelled = (batch["labels"] != IGNORE).sum(dim=1).clamp(min=1)
        return self.token_losses(logits, batch).sum(dim=1) / labelled

    def outputs(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[Any]:
        """Label ids per token: on each window's first sub-tokens (the words),
        the best valid BIO sequence (:func:`best_valid_tags`), not argmax
        word by word; other positions keep argmax and are never read."""
        log_probs = F.log_softmax(logits.float(), dim=-1).cpu().numpy()
        predicted = log_probs.argmax(-1)
        words = (batch["labels"] != IGNORE).cpu().numpy()
        allowed = allowed_transitions(self.labels)
        for i in range(predicted.shape[0]):
            positions = np.flatnonzero(words[i])
            predicted[i, positions] = best_valid_tags(log_probs[i, positions], allowed)
        return [predicted[i] for i in range(predicted.shape[0])]

    def partition_keys(self, records: list[Document], examples: datasets.Dataset):
        """Groups are documents; a document's label is the index of its most
        frequent concept type (one past the last type when it has none)."""
        kinds = self.entity_types
        labels = []
        for doc in records:
            counts = Counter(c.type for c in doc.concepts if c.type in kinds)
            labels.append(
                max(range(len(kinds)), key=lambda i: counts[kinds[i]]) if counts else len(kinds)
            )
        return np.asarray(examples["doc"]), np.asarray(labels)

    # ------------------------------------------------------------- decoding
    def predicted_concepts(
        self, records: list[Document], examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, list]:
        """Concepts per document id from per-example label predictions."""
        return concepts_from_outputs(records, examples, outputs, self.labels)

    def decisions(
        self,
        records: list[Document],
        examples: datasets.Dataset,
        outputs: list[Any] | None = None,
    ) -> frozenset[tuple[str, Any, Any, str]]:
        """(document, start, end, type) of every concept in the annotated
        ``records`` (gold) or decoded from ``outputs``: the spans exact
        micro F1 counts."""
        annotated = {d.doc_id: d.concepts for d in records if d.annotated}
        if outputs is None:
            found = annotated
        else:
            found = self.predicted_concepts(records, examples, outputs)
        return frozenset(
            (doc, c.start, c.end, c.type)
            for doc, concepts in found.items()
            if doc in annotated
            for c in concepts
        )

    def evaluate(
        self, records: list[Document], examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, Any]:
        predicted = self.predicted_concepts(records, examples, outputs)
        gold = {d.doc_id: d.concepts for d in records if d.annotated}
        scores = score_concepts(
            gold, {k: v for k, v in predicted.items() if k in gold}, self.entity_types
        )
        return {
            "f1": scores["exact"]["micro"]["f1"],
            "inexact_f1": scores["inexact"]["micro"]["f1"],
            "scores": scores,
            "per_site_f1": f1_by_site(records, gold, predicted, self.entity_types),
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
        scores = score_concepts(
            gold, {k: v for k, v in predicted.items() if k in gold}, self.entity_types
        )
        return summable_counts(scores)

    def metrics_from_counts(self, counts: dict[str, list[float]]) -> dict[str, float]:
        return {
            "f1": prf(*counts["exact"])["f1"],
            "inexact_f1": prf(*counts["inexact"])["f1"],
        }

    def write_predictions(
        self, records: list[Document], examples: datasets.Dataset, outputs: list[Any], folder: Path
    ) -> None:
        predicted = self.predicted_concepts(records, examples, outputs)
        for doc in records:
            write_con(Path(folder) / f"{doc.doc_id}.con", predicted[doc.doc_id])
