"""MIMIC-III diagnosis coding as multi-label classification of admissions.

A data folder is one site (it holds ``NOTEEVENTS.csv``) or several (each
sub-folder holding one is a site, named after the folder). An admission's
discharge summary is cut into chunks of the encoder's window, at most
``max_chunks`` of them (later text is dropped, like CAML's truncation at
2,500 tokens); the model pools the chunks per admission with label-wise
attention (``clinfed.modeling.heads.ChunkedLabelAttentionClassifier``).

The label set is public, never chosen from the sites' codes: the published
MIMIC-III-50 list of CAML (Mullenbach et al. 2018, bundled as
``mimic3-50.txt``; its diagnoses or procedures for ``--codes``), its first
``top_k`` codes (the list is in frequency order), or a list the user gives
(``--labels FILE``). A label set counted from the sites' private codes
would be a release no ledger accounts: it names the run's labels, sizes
the head and filters every site's data.
"""

from __future__ import annotations

import csv
import io
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.nn import functional as F

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.runs import atomic_write_text
from clinfed.modeling.models import pad_token_id, special_tokens
from clinfed.tasks.base import (
    SPLIT_KEY,
    Corpus,
    ScoreTable,
    Task,
    tokenizing_fingerprint,
)
from clinfed.tasks.mimic3.format import (
    find_file,
    patient_split,
    read_admissions,
    read_codes,
    read_split_files,
)
from clinfed.tasks.mimic3.metrics import THRESHOLD, multilabel_metrics
from clinfed.tasks.mimic3.options import BASELINES, Mimic3Options
from clinfed.tasks.mimic3.public_text import PublicAdmissions

log = logging.getLogger("clinfed.tasks")

TEST_FRACTION = 0.2
PUBLIC_LIST = Path(__file__).with_name("mimic3-50.txt")
PUBLIC_SOURCE = "public: the MIMIC-III-50 list of CAML (Mullenbach et al. 2018)"


def code_kind(code: str) -> str:
    """``diagnoses`` or ``procedures`` of a CAML-dotted ICD-9 code:
    procedures have 2 digits before the dot, diagnoses 3 (or start V/E)."""
    if code[:1] in ("V", "E"):
        return "diagnoses"
    return "procedures" if len(code.split(".")[0]) == 2 else "diagnoses"


def public_labels(codes: str, top_k: int) -> list[str]:
    """The public list's codes of kind ``codes`` (``both``: all), the first
    ``top_k`` of them in its frequency order (0: all)."""
    listed = [c for c in PUBLIC_LIST.read_text().split() if c]
    kept = [c for c in listed if codes == "both" or code_kind(c) == codes]
    return kept[:top_k] if top_k else kept


def site_folders(data: Path) -> dict[str, Path]:
    """Site name -> folder holding that site's CSVs."""
    data = Path(data)
    if not data.is_dir():
        raise ClinfedError(f"{data}: not a folder")

    def notes_in(folder: Path) -> bool:
        try:
            return find_file(folder, "NOTEEVENTS") is not None
        except OSError as exc:  # an unreadable site is an error, never dropped
            raise ClinfedError(f"{folder}: cannot read this folder ({exc.strerror})") from None

    if notes_in(data):
        return {data.resolve().name: data}
    sites = {
        sub.name: sub
        for sub in sorted(data.iterdir())
        if sub.is_dir() and not sub.name.startswith(".") and notes_in(sub)
    }
    if not sites:
        raise ClinfedError(f"{data}: no NOTEEVENTS.csv here or in its sub-folders")
    return sites


def balanced_chunks(ids: list[int], window: int) -> list[list[int]]:
    """Cut ``ids`` into as few chunks of at most ``window`` as possible, of
    near-equal length: 300 tokens in windows of 254 become 150 + 150, not
    254 + 46, so a batch pads far less."""
    count = max(1, -(-len(ids) // window))
    size = -(-len(ids) // count) if ids else 0
    return [ids[i : i + size] for i in range(0, len(ids), size)] if ids else [[]]


class Mimic3Task(PublicAdmissions, Task):
    """ICD-9 coding of MIMIC-III discharge summaries.

    Parameters
    ----------
    codes
        ``diagnoses`` (default), ``procedures`` or ``both``.
    top_k
        Keep the first ``top_k`` codes of the public list (it is in
        MIMIC-III frequency order); 0 keeps all of them. Admissions with none
        of the label codes are left out, as in CAML's MIMIC-III-50.
    max_chunks
        Windows per admission kept for the model.
    split_key
        Keys the patient-level split when no CAML split files are given:
        the site's own (:data:`~clinfed.tasks.base.SPLIT_KEY` unless its
        node config sets one), never the run's seed.
    """

    name = "mimic3"
    held_out_share = TEST_FRACTION
    head = "multilabel"
    # Few, long examples and a sigmoid head over many codes: smaller batches
    # (more steps) and a fast head.
    defaults = {"max_length": 256, "batch_size": 8, "lr": 5e-5, "head_lr": 1e-2}
    # Under DP the head alone trains unless --adapter says otherwise: at
    # epsilon 8, ~1,270 admissions a site, one round from the public start,
    # it scored 0.806 against 0.787 for every weight (which ended under the
    # start's 0.796) and beat bias terms by 1.7 (docs/results.md, "ICD coding").
    dp_adapter = "head"
    accepts_fixed_labels = True
    options = Mimic3Options
    description = "MIMIC-III ICD-9 coding"
    records = "admissions"
    baselines = BASELINES

    @classmethod
    def synthesize(cls, out: Path, *, sites: int, docs: int, seed: int, **options) -> dict:
        from clinfed.tasks.mimic3.synth import generate

        return generate(
            out,
            sites=sites,
            docs=docs,
            seed=seed,
            canary=options.get("canary"),
            heterogeneity=options.get("heterogeneity", "normal"),
        )

    @classmethod
    def score(cls, gold: Path, pred: Path, problems: ProblemLog, **options) -> dict[str, Any]:
        from clinfed.tasks.mimic3.scoring import score_mimic3

        admissions = cls(codes=options.get("codes") or "diagnoses").read_documents(
            Path(gold), problems
        )
        return score_mimic3(dict(zip(admissions["hadm_id"], admissions["codes"])), pred, problems)

    @classmethod
    def score_tables(cls, result: dict[str, Any]) -> tuple[list[ScoreTable], list[str]]:
        rows = [
            (key, f"{value:.4f}")
            for key, value in result.items()
            if key not in ("admissions", "labels", "f1")
        ]
        title = f"ICD-9 coding ({result['admissions']} admissions, {result['labels']} codes)"
        return [ScoreTable(title, ("metric", "value"), rows)], []

    def baseline(self, kind: str, corpus: Corpus) -> dict[str, Any]:
        from clinfed.tasks.mimic3.baselines import mimic3_frequency, mimic3_keyword

        ks = (5,) if len(self.labels) <= 50 else (8, 15)
        train, test = corpus.train, corpus.test
        if kind == "frequency":
            return mimic3_frequency(train["codes"], test["codes"], self.labels, ks)
        if kind == "keyword":
            return mimic3_keyword(
                train["text"], train["codes"], test["text"], test["codes"], self.labels, ks
            )
        return super().baseline(kind, corpus)

    def __init__(
        self,
        codes: str = "diagnoses",
        top_k: int = 50,
        max_chunks: int = 8,
        split_key: str = SPLIT_KEY,
        cache_dir: str | None = None,
        labels: list[str] | None = None,
    ):
        if top_k < 0:
            raise ClinfedError("`top_k` must be 0 (all codes) or more")
        if max_chunks < 1:
            raise ClinfedError("`max_chunks` must be at least 1")
        self.codes, self.top_k, self.max_chunks = codes, top_k, max_chunks
        self.split_key = str(split_key)
        self.cache_dir = cache_dir
        # Public, whatever the data holds (see the module docstring).
        if labels:
            self.labels, self.label_source = sorted(labels), "given: --labels"
        else:
            self.labels, self.label_source = public_labels(codes, top_k), PUBLIC_SOURCE
        self.fixed_labels = self.labels
        self.pad_id = 0
        # Per site, what its files do not pair up (set by _read_site).
        self.unpaired: dict[str, dict[str, int]] = {}

    # ---------------------------------------------------------------- reading
    def _read_site(self, site: str, folder: Path, problems: ProblemLog) -> datasets.Dataset:
        table = read_codes(folder, self.codes, problems)
        admissions = read_admissions(folder, problems, self.cache_dir)
        problems.raise_if_any()
        has_split_files = any(folder.glob("*_hadm_ids.csv"))
        assignment = read_split_files(folder) if has_split_files else {}

        # What does not pair up is counted and reported, never dropped silently.
        summarized = set(admissions["hadm_id"]) if len(admissions) else set()
        self.unpaired[site] = {
            "summaries_without_codes": len(summarized - set(table.codes)),
            "coded_admissions_without_a_summary": len(set(table.codes) - summarized),
        }

        def annotate(batch: dict[str, list]) -> dict[str, list]:
            codes, splits = [], []
            for hadm, subject in zip(batch["hadm_id"], batch["subject_id"]):
                codes.append(sorted(table.codes.get(hadm, ())))
                if has_split_files:
                    splits.append(assignment.get(hadm, "unused"))
                else:
                    splits.append(patient_split(subject, self.split_key, TEST_FRACTION))
            return {"codes": codes, "split": splits, "site": [site] * len(codes)}

        if len(admissions) == 0:
            # No discharge summary (a header-only NOTEEVENTS): the same
            # columns, no rows; the caller says what is missing.
            columns = {name: admissions[name] for name in admissions.column_names}
            return datasets.Dataset.from_dict(columns | {"codes": [], "split": [], "site": []})
        return admissions.map(annotate, batched=True)

    def _read_sites(self, sites: dict[str, Path], problems: ProblemLog) -> list[datasets.Dataset]:
        """Every site's admissions; a site with none usable (a header-only
        notes file) is an error naming its file, never a site that vanishes."""
        parts = [self._read_site(site, folder, problems) for site, folder in sites.items()]
        for (site, folder), part in zip(sites.items(), parts):
            if len(part) == 0:
                problems.add(
                    find_file(folder, "NOTEEVENTS") or folder,
                    None,
                    f"no discharge summary with an admission: site {site} has no usable admissions",
                )
        problems.raise_if_any()
        return parts

    def load(self, data: Path, problems: ProblemLog) -> Corpus:
        sites = site_folders(data)
        parts = self._read_sites(sites, problems)
        for site, counts in sorted(self.unpaired.items()):
            if any(counts.values()):
                log.warning(
                    "%s: %d discharge summaries without codes, %d coded admissions without a "
                    "discharge summary (left out)",
                    sites[site],
                    counts["summaries_without_codes"],
                    counts["coded_admissions_without_a_summary"],
                )
        everything = datasets.concatenate_datasets(parts)
        train = everything.filter(lambda s: s == "train", input_columns="split")
        test = everything.filter(lambda s: s in ("test", "dev"), input_columns="split")
        kept = set(self.labels)

        def has_label(codes: list[str]) -> bool:
            return any(c in kept for c in codes)

        train = train.filter(has_label, input_columns="codes")
        test = test.filter(has_label, input_columns="codes")
        if len(train) == 0:
            raise ClinfedError(
                f"{data}: no training admission has a discharge summary and one of the "
                f"{len(self.labels)} label codes ({self.label_source})"
            )
        return Corpus(
            train,
            test,
            sorted(sites),
            {
                "train_admissions": len(train),
                "test_admissions": len(test),
                "labels": len(self.labels),
            },
        )

    def read_documents(self, folder: Path, problems: ProblemLog) -> datasets.Dataset:
        """Every admission of a folder, labels restricted to the model's codes."""
        parts = [self._read_site(s, f, problems) for s, f in site_folders(folder).items()]
        problems.raise_if_any()
        return datasets.concatenate_datasets(parts)

    public_label_kind = "codes"
    one_row_per_example = False  # a note's chunks are rows of one example

    def summarize(self, data: Path, problems: ProblemLog) -> dict[str, Any]:
        sites = site_folders(data)
        parts = self._read_sites(sites, problems)
        admissions = datasets.concatenate_datasets(parts)
        label_counts = Counter(code for codes in admissions["codes"] for code in codes)
        return {
            "admissions": len(admissions),
            "notes": sum(admissions["n_notes"]),
            "patients": len(set(admissions["subject_id"])),
            "label_counts": dict(sorted(label_counts.items(), key=lambda kv: (-kv[1], kv[0]))),
            "sites": dict(Counter(admissions["site"])),
            "splits": dict(Counter(admissions["split"])),
            "summaries_without_codes": sum(
                c["summaries_without_codes"] for c in self.unpaired.values()
            ),
            "coded_admissions_without_a_summary": sum(
                c["coded_admissions_without_a_summary"] for c in self.unpaired.values()
            ),
            "problems": [str(p) for p in problems.problems],
        }

    # --------------------------------------------------------------- encoding
    def encode(
        self, records: datasets.Dataset, tokenizer, max_length: int, cache_dir: str | None
    ) -> datasets.Dataset:
        self.pad_id = pad_token_id(tokenizer)
        prefix, suffix = special_tokens(tokenizer)
        window = max_length - len(prefix) - len(suffix)
        budget = window * self.max_chunks
        index = {code: i for i, code in enumerate(self.labels)}

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            enc = tokenizer(
                batch["text"], add_special_tokens=False, truncation=True, max_length=budget
            )
            chunks, targets, lengths = [], [], []
            for ids, codes in zip(enc["input_ids"], batch["codes"]):
                pieces = [prefix + piece + suffix for piece in balanced_chunks(ids, window)]
                chunks.append(pieces)
                lengths.append(sum(len(p) for p in pieces))
                target = [0.0] * len(self.labels)
                for code in codes:
                    if code in index:
                        target[index[code]] = 1.0
                targets.append(target)
            return {"input_ids": chunks, "targets": targets, "n_tokens": lengths}

        keep = {"hadm_id", "subject_id", "site"}
        return records.map(
            tokenize,
            batched=True,
            batch_size=64,
            remove_columns=[c for c in records.column_names if c not in keep],
            new_fingerprint=tokenizing_fingerprint(records, tokenize, tokenizer),
        )

    units = {
        "example": "one admission (its discharge summary, chunks folded into one example)",
        "document": "one admission (a discharge summary is one document)",
        "patient": "one patient (every admission of a SUBJECT_ID, sampled and clipped together)",
    }

    def unit_keys(self, examples: datasets.Dataset, unit: str) -> list[Any]:
        super().unit_keys(examples, unit)
        if unit == "patient":
            return list(examples["subject_id"])
        return list(range(len(examples)))

    def collate(self, batch: dict[str, list]) -> dict[str, torch.Tensor]:
        n = len(batch["input_ids"])
        n_chunks = max(len(chunks) for chunks in batch["input_ids"])
        width = max(len(piece) for chunks in batch["input_ids"] for piece in chunks)
        input_ids = torch.full((n, n_chunks, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, n_chunks, width), dtype=torch.long)
        chunk_mask = torch.zeros((n, n_chunks), dtype=torch.long)
        for i, chunks in enumerate(batch["input_ids"]):
            for j, piece in enumerate(chunks):
                input_ids[i, j, : len(piece)] = torch.tensor(piece)
                mask[i, j, : len(piece)] = 1
                chunk_mask[i, j] = 1
        targets = torch.tensor(batch["targets"], dtype=torch.float32)
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "chunk_mask": chunk_mask,
            "targets": targets,
        }

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in ("input_ids", "attention_mask", "chunk_mask")}

    def relevant_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[CLS] of every real chunk: the token a classifier reads from."""
        relevant = torch.zeros_like(batch["attention_mask"])
        relevant[..., 0] = batch["attention_mask"][..., 0]
        return relevant

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, batch["targets"])

    def example_losses(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses = F.binary_cross_entropy_with_logits(logits, batch["targets"], reduction="none")
        return losses.mean(dim=1)

    def outputs(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[Any]:
        probs = torch.sigmoid(logits).cpu().numpy()
        return [probs[i] for i in range(probs.shape[0])]

    def partition_keys(self, records: datasets.Dataset, examples: datasets.Dataset):
        """Groups are admissions; an admission's label is, among its codes,
        the one most frequent in ``examples`` (for label skew)."""
        targets = np.asarray(examples["targets"])
        frequency = targets.sum(axis=0)
        labels = np.argmax(targets * (frequency + 1), axis=1)
        return np.arange(len(examples)), labels

    # ------------------------------------------------------------- decoding
    def evaluate(
        self, records: datasets.Dataset, examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, Any]:
        y_true = np.asarray(examples["targets"], dtype=int)
        scores = np.stack(outputs) if outputs else np.zeros_like(y_true, dtype=float)
        ks = (5,) if len(self.labels) <= 50 else (8, 15)
        metrics = multilabel_metrics(y_true, scores, ks=ks)
        sites = np.asarray(examples["site"])
        metrics["per_site_f1"] = {
            site: multilabel_metrics(y_true[sites == site], scores[sites == site], ks=ks)[
                "micro_f1"
            ]
            for site in sorted(set(sites))
        }
        return metrics

    def evaluation_counts(
        self, records: datasets.Dataset, examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, list[float]]:
        """Per label: true positives, false positives, false negatives at the threshold."""
        y_true = np.asarray(examples["targets"], dtype=int).reshape(-1, len(self.labels))
        scores = np.stack(outputs) if outputs else np.zeros_like(y_true, dtype=float)
        y_pred = scores >= THRESHOLD
        return {
            "tp": (y_pred & (y_true == 1)).sum(axis=0).tolist(),
            "fp": (y_pred & (y_true == 0)).sum(axis=0).tolist(),
            "fn": (~y_pred & (y_true == 1)).sum(axis=0).tolist(),
        }

    def metrics_from_counts(self, counts: dict[str, list[float]]) -> dict[str, float]:
        """Micro and macro F1 as :func:`multilabel_metrics` computes them (AUC
        and P@k need every score, so they are not available from counts)."""
        tp, fp, fn = (np.asarray(counts[k], dtype=float) for k in ("tp", "fp", "fn"))

        def ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return np.divide(a, b, out=np.zeros_like(a), where=b > 0)

        micro_p = ratio(tp.sum(keepdims=True), (tp + fp).sum(keepdims=True))[0]
        micro_r = ratio(tp.sum(keepdims=True), (tp + fn).sum(keepdims=True))[0]
        macro_p, macro_r = ratio(tp, tp + fp).mean(), ratio(tp, tp + fn).mean()

        def harmonic(p: float, r: float) -> float:
            return float(2 * p * r / (p + r)) if p + r else 0.0

        micro_f1 = harmonic(micro_p, micro_r)
        return {
            "f1": micro_f1,
            "micro_f1": micro_f1,
            "macro_f1": harmonic(macro_p, macro_r),
            "macro_f1_mean": float(ratio(2 * tp, 2 * tp + fp + fn).mean()),
        }

    def decisions(
        self,
        records: datasets.Dataset,
        examples: datasets.Dataset,
        outputs: list[Any] | None = None,
    ) -> frozenset[tuple[Any, str]]:
        """(HADM_ID, code) for every label code an admission carries (gold)
        or that ``outputs`` give at least :data:`THRESHOLD`: the decisions
        micro F1 counts."""
        if outputs is None:
            outputs = examples["targets"]
        return frozenset(
            (hadm, code)
            for hadm, scores in zip(examples["hadm_id"], outputs)
            for code, score in zip(self.labels, scores)
            if score >= THRESHOLD
        )

    def write_predictions(
        self,
        records: datasets.Dataset,
        examples: datasets.Dataset,
        outputs: list[Any],
        folder: Path,
        threshold: float = THRESHOLD,
    ) -> None:
        """``predictions.csv``: HADM_ID, the predicted codes (``;``-separated)
        and one probability column per code, headed ``P_<code>``."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["HADM_ID", "CODES"] + [f"P_{code}" for code in self.labels])
        for hadm, probs in zip(examples["hadm_id"], outputs):
            codes = ";".join(code for code, p in zip(self.labels, probs) if p >= threshold)
            writer.writerow([hadm, codes] + [f"{p:.7g}" for p in probs])
        atomic_write_text(Path(folder) / "predictions.csv", buf.getvalue())

    def meta(self) -> dict[str, Any]:
        return super().meta() | {
            "codes": self.codes,
            "top_k": self.top_k,
            "max_chunks": self.max_chunks,
            "label_source": self.label_source,
        }
