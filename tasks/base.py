"""What a task adapter provides; the training code knows tasks only through this.

A task turns a data folder into split records (``load``), records into model
examples held in an Arrow dataset (``encode``), batches of examples into
tensors (``collate``, ``model_inputs``, ``loss``), model outputs back into
task predictions, scores (``evaluate``) and files in the task's own format
(``write_predictions``). To add a task, implement this class in
``tasks/<name>/adapter.py`` and register it in ``tasks/__init__.py``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import datasets
import numpy as np
import torch

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.scratch import cache_folder

PROBLEMS_FILE = "clinfed-problems.json"

# What keys a site's held-out split when its data folder has none of its own
# (i2b2: documents by file stem; MIMIC-III: patients), unless the site sets
# another (node config split-key). Never a run setting: a server that chose
# the key could move any document into the evaluated split and query it.
# "0" keeps the split clinfed used before the key was the site's.
SPLIT_KEY = "0"


# Beside a corpus ``clinfed data synth`` wrote: it holds no patient's data.
# A run records it (config.json ``synthetic_data``) and its model card says so.
SYNTHETIC_MARK = "clinfed-synthetic.json"


def mark_synthetic(out: Path, generator: str, seed: int) -> None:
    """Mark ``out`` as a synthetic corpus (what made it, with which seed)."""
    (Path(out) / SYNTHETIC_MARK).write_text(
        json.dumps({"synthetic": True, "generator": generator, "seed": seed}) + "\n"
    )


def _tracked(generator, **kwargs):
    """Run ``generator``, marking its ProblemLog as really read (not cached)."""
    kwargs["problems"].generated = True
    yield from generator(**kwargs)


def tokenizing_fingerprint(dataset: datasets.Dataset, function, tokenizer) -> str | None:
    """The fingerprint ``dataset.map(function)`` would get, for a ``function``
    that closes over ``tokenizer``, without pickling the tokenizer.

    ``datasets`` names a mapped dataset (its cache entry under ``--cache-dir``)
    by hashing the function with everything it closes over; a tokenizer in
    the closure is pickled whole each time (about a second a call, most of a
    small run's encoding). The tokenizer stands in here as its class and its
    backend's serialised state, which fix what it produces; the function's
    code, globals and other captured values are hashed as ``datasets`` would.
    None (``datasets`` hashes it all) for a tokenizer without a backend.
    """
    import types

    from datasets.fingerprint import Hasher

    backend = getattr(tokenizer, "backend_tokenizer", None)
    closure = function.__closure__ or ()
    if backend is None or not closure:
        return None
    key = Hasher.hash(
        (
            type(tokenizer).__qualname__,
            backend.to_str(),
            tokenizer.unk_token_id,
            tokenizer.pad_token_id,
        )
    )
    try:
        cells = tuple(
            types.CellType(key if cell.cell_contents is tokenizer else cell.cell_contents)
            for cell in closure
        )
    except ValueError:  # a name it closes over, not yet assigned: datasets decides
        return None
    stand_in = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, cells
    )
    return Hasher.hash((dataset._fingerprint, stand_in))


def rows_to_dataset(
    generator, gen_kwargs: dict[str, Any], features: datasets.Features, cache_dir: str | None
) -> datasets.Dataset:
    """An Arrow dataset (on disk, memory-mapped) of the rows ``generator``
    yields; empty, with ``features``, when it yields none (``datasets``
    itself refuses to build an empty dataset from a generator).

    A reader's problems (``gen_kwargs["problems"]``) are kept with the
    cached rows (``clinfed-problems.json`` beside the Arrow files), so a
    cache hit reports the same problems as the read that made it.
    """
    problems: ProblemLog | None = gen_kwargs.get("problems")
    before = len(problems.problems) if problems is not None else 0
    if problems is not None:
        problems.generated = False
        gen_kwargs = {"generator": generator, **gen_kwargs}
        generator = _tracked
    try:
        dataset = datasets.Dataset.from_generator(
            generator, gen_kwargs=gen_kwargs, features=features, cache_dir=cache_folder(cache_dir)
        )
    except ValueError as exc:
        if "corresponds to no data" not in str(exc):
            raise
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    if problems is None or not dataset.cache_files:
        return dataset
    record = Path(dataset.cache_files[0]["filename"]).parent / PROBLEMS_FILE
    if problems.generated:
        found = [
            {"path": str(p.path), "line": p.line, "reason": p.reason}
            for p in problems.problems[before:]
        ]
        record.write_text(json.dumps(found))
    else:
        try:
            cached = json.loads(record.read_text())
        except (OSError, ValueError):
            raise ClinfedError(
                f"{record.parent}: a cached read without its problem record (an older "
                "clinfed's cache); use a new `cache_dir`"
            ) from None
        for p in cached:
            problems.add(p["path"], p["line"], p["reason"])
    return dataset


# The site name public documents carry while they are encoded.
PUBLIC_SITE = "(public)"


@dataclass
class Corpus:
    """Records of one task, split. ``train``/``test`` are task-specific
    containers (a list of documents, an Arrow dataset of admissions); every
    record knows its site."""

    train: Any
    test: Any
    sites: list[str]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreTable:
    """A table of scores for a person (``clinfed score`` prints it)."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]


class Task(ABC):
    """A clinical task: formats in, examples, metrics and formats out."""

    name: ClassVar[str]
    head: ClassVar[str]  # which model head it needs: "token", "multilabel" or its own
    # A head of the task's own: a model class taking (encoder, num_labels)
    # with the encoder as ``.encoder`` and the head as ``.head``, for a
    # ``head`` kind clinfed.modeling.heads.HEADS does not hold.
    head_class: ClassVar[type | None] = None
    labels: list[str]
    # Local-training defaults for settings the user leaves unset
    # (max_length, batch_size, lr, head_lr).
    defaults: ClassVar[dict[str, Any]] = {}
    # Rates (at ``defaults["batch_size"]``, scaled to a site's batch by
    # clinfed.privacy.recipe) for every weight under DP, where measured.
    dp_rates: ClassVar[dict[str, float]] = {}
    # Which parameters train under DP when ``--adapter`` is not given: the
    # plan measured best for the task at epsilon 8 (``none``: every weight).
    dp_adapter: ClassVar[str] = "none"
    # Whether the label set may be fixed up front (``labels`` setting); a
    # task whose labels otherwise come from the data needs one on Flower,
    # where no server sees the data.
    accepts_fixed_labels: ClassVar[bool] = False
    labels_from_data: ClassVar[bool] = False
    # Where the label set comes from, in words (the report states it).
    label_source: str = "fixed by the task"
    # Its settings (a dataclass of ``clinfed.core.schema.setting`` fields, in
    # ``tasks/<name>/options.py``; composed into the run's schema).
    options: ClassVar[type | None] = None
    # The task in words (the report's header).
    description: ClassVar[str] = ""
    # The share of a site's data it holds out (when its folder has no test
    # split): the forecast sizes the sites' own scoring error from it.
    held_out_share: ClassVar[float] = 0.2
    # What one record of its corpus is, plural (``clinfed data synth``).
    records: ClassVar[str] = "documents"
    # The model-free baselines it offers (``clinfed baseline --kind``).
    baselines: ClassVar[tuple[str, ...]] = ()

    # The parts of the command line a task owns: the CLI and the Python API
    # dispatch to these through :data:`clinfed.tasks.TASKS`, never by name.
    @classmethod
    def synthesize(cls, out: Path, *, sites: int, docs: int, seed: int, **options) -> dict:
        """Write a synthetic multi-site corpus in the task's real format
        (``options``: the generator's own, such as ``heterogeneity``);
        returns ``{"train": n, "test": m}`` records written."""
        raise ClinfedError(f"task {cls.name} has no synthetic corpus")

    @classmethod
    def score(cls, gold: Path, pred: Path, problems: ProblemLog, **options) -> dict[str, Any]:
        """Score prediction files in the task's format against a gold corpus
        (``options``: the task's settings, such as ``types`` or ``codes``)."""
        raise ClinfedError(f"task {cls.name} cannot score prediction files")

    @classmethod
    def score_tables(cls, result: dict[str, Any]) -> tuple[list[ScoreTable], list[str]]:
        """``result`` of :meth:`score` as tables for a person, and warnings."""
        rows = [(k, f"{v:.4f}") for k, v in result.items() if isinstance(v, float)]
        return [ScoreTable(f"{cls.name} scores", ("metric", "value"), rows)], []

    @classmethod
    def convert(
        cls, source: Path, target: str, out: Path, problems: ProblemLog, **options: Any
    ) -> int:
        """``clinfed data convert``: write the corpus in ``source`` under
        ``out`` in another of this task's file formats; returns the
        documents written. A task with one format refuses."""
        raise ClinfedError(f"task {cls.name} reads one file format: nothing to convert to")

    def baseline(self, kind: str, corpus: Corpus) -> dict[str, Any]:
        """Score model-free baseline ``kind`` (one of :attr:`baselines`) on
        ``corpus``'s held-out split."""
        raise ClinfedError(f"baseline {kind} does not apply to {self.name}")

    @classmethod
    def check_deployment(cls, config: Any) -> None:
        """Refuse settings a Flower run cannot honour (no server sees the
        sites' data); ``config`` is the run's resolved settings."""
        if cls.labels_from_data and not config.labels:
            raise ClinfedError(
                f"`task` {cls.name} on Flower needs `labels` FILE (the labels to predict): "
                "otherwise they come from pooled training data, which no server sees"
            )

    @abstractmethod
    def load(self, data: Path, problems: ProblemLog) -> Corpus:
        """Read and validate ``data``; fix ``self.labels``."""

    @abstractmethod
    def read_documents(self, folder: Path, problems: ProblemLog) -> Any:
        """Every record of one folder, unsplit (for scoring and prediction)."""

    @abstractmethod
    def summarize(self, data: Path, problems: ProblemLog) -> dict[str, Any]:
        """Counts for ``clinfed data check``."""

    @abstractmethod
    def encode(
        self, records: Any, tokenizer, max_length: int, cache_dir: str | None
    ) -> datasets.Dataset:
        """Model examples. Every example has ``site`` and ``n_tokens`` columns."""

    @abstractmethod
    def collate(self, batch: dict[str, list]) -> dict[str, torch.Tensor]:
        """Tensors for a columnar batch of examples."""

    @abstractmethod
    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward."""

    @abstractmethod
    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss of a batch."""

    @abstractmethod
    def example_losses(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Loss of each example, shape ``(batch,)``, each depending on its own
        example only (DP-SGD clips per example, so no example may scale
        another's loss, as a mean over the batch's tokens would)."""

    @abstractmethod
    def outputs(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[Any]:
        """Per-example predictions (plain Python / numpy), in batch order."""

    @abstractmethod
    def evaluate(
        self, records: Any, examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, Any]:
        """Metrics of ``outputs`` against the gold ``records``; includes ``f1``."""

    @abstractmethod
    def evaluation_counts(
        self, records: Any, examples: datasets.Dataset, outputs: list[Any]
    ) -> dict[str, list[float]]:
        """Summable counts behind the headline metrics (evaluation spread over
        sites: the server adds the sites' counts and calls
        :meth:`metrics_from_counts`). Counts, never examples: no text leaves."""

    @abstractmethod
    def metrics_from_counts(self, counts: dict[str, list[float]]) -> dict[str, float]:
        """Metrics (with ``f1``) from :meth:`evaluation_counts`, possibly summed."""

    @abstractmethod
    def write_predictions(
        self, records: Any, examples: datasets.Dataset, outputs: list[Any], folder: Path
    ) -> None:
        """Predictions in the task's real file format."""

    @abstractmethod
    def decisions(
        self, records: Any, examples: datasets.Dataset, outputs: list[Any] | None = None
    ) -> frozenset[Hashable]:
        """What a model decided on the annotated ``records``, one hashable key
        per decision, so that two models (and the gold) compare as sets:
        micro F1 is twice the shared decisions over the two sets' sizes.
        ``outputs`` None: the gold decisions. ``--public-check`` judges each
        round by these."""

    @abstractmethod
    def relevant_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """0/1 mask, shaped like ``batch["attention_mask"]``, of the tokens
        SAFL's attention profile counts as task-relevant."""

    @abstractmethod
    def partition_keys(self, records: Any, examples: datasets.Dataset) -> tuple[Any, Any]:
        """For partitioning: the group of each example (the document or
        admission it comes from) and a label per group (for label skew)."""

    @abstractmethod
    def public_probe(self, tokenizer, max_length: int, cache_dir: str) -> datasets.Dataset:
        """Encoded examples of a small public corpus of this task (the
        project's own synthetic generator, fixed seed): SAFL's free layer
        choice profiles on these, so no private example shapes it."""

    # Whether one dataset row is one whole example (token tasks: a sentence
    # window) rather than a part of one (a note cut into chunks): DP's ghost
    # clipping needs it.
    one_row_per_example: ClassVar[bool] = True
    # What the public text's labels are called in a warm start's record.
    public_label_kind: ClassVar[str] = "types"

    def check_public_judge(self, folder: Path, records: Any, annotated: list[str]) -> None:
        """Refuse ``--public-check`` text (read by :meth:`read_public`) that
        cannot judge every label the run scores (by default: any is)."""
        del folder, records, annotated

    def at_node(self, split_key: str, annotated_types: Any) -> None:
        """What a Flower node declares of its own data, over the server's
        settings: the key its held-out split is drawn with, and the types it
        annotates (``None``: not declared; a task whose labels need no
        declaration ignores it)."""
        del annotated_types
        self.split_key = split_key

    def loaded_state(self) -> dict[str, Any]:
        """What :meth:`load` set from the data, JSON-ready (a node caches it
        with the encoded data and :meth:`restore_loaded_state` puts it back)."""
        return {"labels": list(self.labels), "label_source": self.label_source}

    def restore_loaded_state(self, state: dict[str, Any]) -> None:
        self.labels, self.label_source = list(state["labels"]), state["label_source"]

    def read_public(
        self,
        folder: Path,
        flag: str,
        public_types: Any,
        tokenizer: Any,
        max_length: int,
        cache_dir: str,
        problems: ProblemLog,
        name_lists: Any = None,
    ) -> tuple[Any, Any, list[str], dict[str, int]]:
        """Public annotated text in ``folder`` (named by ``flag``) for a warm
        start or the server's check: its records, encoded with this task's
        labels, the labels it annotates, and the spans name lists labelled
        (:meth:`distant_labels`). A task without public text refuses."""
        raise ClinfedError(f"{flag}: task {self.name} reads no public text")

    def distant_labels(
        self, documents: Any, gazetteer: Any, run_types: tuple[str, ...]
    ) -> dict[str, int]:
        """Label the public ``documents`` in place where one of the
        ``gazetteer``'s lists (a mark per list) names words their gold leaves
        unlabelled (distant supervision for the warm start): each list's
        names take the type the list is named for, mapped as the text's own
        types are, where that is one of ``run_types``. Returns the spans
        labelled per run type. A task without spans to label refuses."""
        raise ClinfedError(f"task {self.name}: public text takes no labels from name lists")

    def public_units(self, folder: Path, public_types: Any, problems: ProblemLog) -> list[Any]:
        """The privacy units of annotated public text, to deal out to the
        sites of a forecast (``clinfed privacy plan``). A task without a
        forecast refuses."""
        raise ClinfedError(f"task {self.name}: no F1 forecast on public text yet")

    def public_mentions(self, units: list[Any]) -> dict[str, int]:
        """Gold mentions per type in :meth:`public_units`' ``units``: what
        a forecast checks the public text annotates and scores on."""
        raise ClinfedError(f"task {self.name}: no F1 forecast on public text yet")

    def write_public_sites(self, sites: dict[str, list[Any]], test: list[Any], out: Path) -> None:
        """Write :meth:`public_units` dealt out to ``sites`` (and ``test``)
        as a corpus under ``out`` that :meth:`forecast_settings` reads."""
        raise ClinfedError(f"task {self.name}: no F1 forecast on public text yet")

    def forecast_settings(self) -> dict[str, Any]:
        """The settings that read :meth:`write_public_sites`'s corpus with
        this task's labels."""
        raise ClinfedError(f"task {self.name}: no F1 forecast on public text yet")

    # ---------------------------------------------------- privacy units
    # What one DP unit is at each level, in words (the report states it).
    units: ClassVar[dict[str, str]] = {"example": "one training example"}

    def unit_keys(self, examples: datasets.Dataset, unit: str) -> list[Any]:
        """The privacy unit each encoded row belongs to: DP-SGD samples
        units and clips the summed gradient of all a unit's rows jointly.
        ``unit`` is one of :attr:`units`."""
        if unit not in self.units:
            raise ClinfedError(f"`privacy_unit` {unit}: {self.name} offers {', '.join(self.units)}")
        return list(range(len(examples)))

    def unit_rows(self, examples: datasets.Dataset, unit: str) -> list[np.ndarray]:
        """The rows of each privacy unit of ``examples`` (in first-seen order):
        what DP-SGD samples and clips, and what a site's weight counts."""
        index: dict[Any, int] = {}
        rows: list[list[int]] = []
        for row, key in enumerate(self.unit_keys(examples, unit)):
            if key not in index:
                index[key] = len(rows)
                rows.append([])
            rows[index[key]].append(row)
        return [np.asarray(r, dtype=np.int64) for r in rows]

    def count_units(self, examples: datasets.Dataset, unit: str) -> int:
        """How many privacy units ``examples`` holds (what a site's sampling
        rate and accounting are over, and its update's weight)."""
        return len(self.unit_rows(examples, unit))

    def meta(self) -> dict[str, Any]:
        """What a saved model needs to be used again (labels, options)."""
        return {"task": self.name, "head": self.head, "labels": list(self.labels)}
