"""One training run from a data folder to a finished run folder.

Run folder layout::

    RUN/config.json        the resolved configuration
    RUN/metrics.jsonl      one JSON object per epoch (``epoch``, ``f1``, ...)
    RUN/model/             model.safetensors, model.json, tokenizer/
    RUN/predictions/       test-split predictions in the task's real format
    RUN/summary.json       final metrics

Only ``--strategy centralized`` (all sites' data pooled: the upper reference)
is built so far; the federated strategies plug in beside it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.models import build_model, load_tokenizer, save_model
from clinfed.runs import (
    append_jsonl,
    atomic_write_json,
    create_run_folder,
    ensure_new_run_folder,
)
from clinfed.tasks import TASKS, get_task
from clinfed.training import linear_schedule, make_optimizer, predict, train_epoch

STRATEGIES = ("centralized",)
# Per-task defaults for settings left unset. MIMIC-III has few, long examples
# and a 50-way sigmoid head: smaller batches (more steps) and a fast head.
TASK_DEFAULTS = {
    "i2b2": {"max_length": 128, "batch_size": 16, "lr": 1e-4, "head_lr": 1e-3},
    "mimic3": {"max_length": 256, "batch_size": 8, "lr": 5e-5, "head_lr": 1e-2},
}


@dataclass
class RunConfig:
    """Everything that decides a run; written to ``RUN/config.json``."""

    task: str
    data: str
    out: str
    strategy: str = "centralized"
    model: str = "minilm"
    epochs: int = 3
    batch_size: int | None = None
    lr: float | None = None
    head_lr: float | None = None
    weight_decay: float = 0.01
    warmup: float = 0.1
    max_length: int | None = None
    seed: int = 0
    on_error: str = "strict"
    codes: str = "diagnoses"
    top_k: int = 50
    max_chunks: int = 8
    threads: int = 0
    cache_dir: str | None = None
    eval_batch_size: int = 64
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Reject impossible settings before anything is read or written."""
        if self.task not in TASKS:
            raise ClinfedError(f"--task must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.strategy not in STRATEGIES:
            raise ClinfedError(
                f"--strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}"
            )
        for name in ("epochs", "batch_size", "eval_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ClinfedError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("lr", "head_lr"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ClinfedError(f"--{name.replace('_', '-')} must be positive")
        if self.max_length is not None and not 8 <= self.max_length <= 512:
            raise ClinfedError("--max-length must be between 8 and 512")
        if not Path(self.data).is_dir():
            raise ClinfedError(f"--data {self.data}: not a folder")

    def resolved(self) -> RunConfig:
        """A copy with every unset setting filled from the task's defaults."""
        values = asdict(self)
        for name, default in TASK_DEFAULTS[self.task].items():
            if values[name] is None:
                values[name] = default
        return RunConfig(**values)


Reporter = Callable[[str, dict[str, Any]], None]


def _quiet(event: str, info: dict[str, Any]) -> None:
    del event, info


def run_training(config: RunConfig, report: Reporter = _quiet) -> dict[str, Any]:
    """Train, evaluate each epoch and write the run folder.

    Parameters
    ----------
    report
        Called with progress events (``loaded``, ``epoch_start``, ``step``,
        ``eval_start``, ``epoch_end``); the CLI draws progress bars from them.

    Returns
    -------
    dict
        The final evaluation record (also in ``RUN/summary.json``).
    """
    config.validate()
    config = config.resolved()
    ensure_new_run_folder(config.out)
    torch.set_num_threads(config.threads or os.cpu_count() or 1)
    problems = ProblemLog(config.on_error)
    # Tokenized notes are protected health information: unless the user names
    # a cache folder, they live in a temporary one removed after the run.
    with tempfile.TemporaryDirectory(prefix="clinfed-cache-") as tmp:
        cache_dir = config.cache_dir or tmp
        task = get_task(
            config.task,
            seed=config.seed,
            codes=config.codes,
            top_k=config.top_k,
            max_chunks=config.max_chunks,
            cache_dir=cache_dir,
        )
        corpus = task.load(Path(config.data), problems)
        if len(corpus.train) == 0:
            raise ClinfedError(f"{config.data}: no annotated training examples")
        if len(corpus.test) == 0:
            raise ClinfedError(f"{config.data}: no held-out examples to evaluate on")
        # Everything that can fail on bad input happens before the run folder
        # exists, so a failed start leaves nothing behind.
        tokenizer = load_tokenizer(config.model)
        model = build_model(task.head, config.model, len(task.labels), seed=config.seed)
        out = create_run_folder(config.out)
        atomic_write_json(
            out / "config.json", asdict(config) | {"labels": task.labels, "sites": corpus.sites}
        )
        train = task.encode(corpus.train, tokenizer, config.max_length, cache_dir)
        test = task.encode(corpus.test, tokenizer, config.max_length, cache_dir)
        report(
            "loaded",
            {
                "train": len(train),
                "test": len(test),
                "sites": corpus.sites,
                "warnings": [str(p) for p in problems.problems],
            },
        )

        optimizer = make_optimizer(model, config.lr, config.weight_decay, config.head_lr)
        steps = config.epochs * -(-len(train) // config.batch_size)
        scheduler = linear_schedule(optimizer, steps, config.warmup)
        order = np.random.default_rng(config.seed)
        torch.manual_seed(config.seed)
        record: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        outputs: list = []
        for epoch in range(1, config.epochs + 1):
            report("epoch_start", {"epoch": epoch, "examples": len(train)})
            stats = train_epoch(
                model,
                task,
                train,
                optimizer,
                config.batch_size,
                order,
                scheduler,
                on_step=lambda n: report("step", {"examples": n}),
            )
            report("eval_start", {"epoch": epoch, "examples": len(test)})
            started = time.perf_counter()
            outputs = predict(
                model,
                task,
                test,
                config.eval_batch_size,
                on_step=lambda n: report("eval_step", {"examples": n}),
            )
            metrics = task.evaluate(corpus.test, test, outputs)
            record = {
                "epoch": epoch,
                "f1": metrics["f1"],
                "train_loss": stats.loss,
                "train_tokens": stats.tokens,
                "train_seconds": round(stats.seconds, 3),
                "tokens_per_s": round(stats.tokens_per_s, 1),
                "eval_seconds": round(time.perf_counter() - started, 3),
            } | {k: v for k, v in metrics.items() if k not in ("f1", "scores")}
            append_jsonl(out / "metrics.jsonl", record)
            report("epoch_end", record)

        save_model(
            model,
            out / "model",
            task.meta() | {"max_length": config.max_length, "encoder": config.model},
            tokenizer,
        )
        task.write_predictions(corpus.test, test, outputs, out / "predictions")
        summary = record | {"detail": metrics.get("scores")}
        atomic_write_json(out / "summary.json", summary)
        return summary
