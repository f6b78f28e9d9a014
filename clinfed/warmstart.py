"""Public warm start: the starting model trains on public text before round 1.

DP fine-tuning keeps close to non-private training when the private phase
only adapts a model that already knows the task (Li et al. 2022; Yu et al.
2022). Public annotated text exists for concept extraction (NCBI-disease,
BC5CDR: PubMed abstracts, CC BY 4.0), so the run's starting model first
trains on it, whole, without DP: no site's data is read, so it costs no
privacy. Every site then starts from that model, and so does the run's
no-DP reference when it is given the same ``--public-data``.

The public text is read by the run's task in any format it accepts; its
entity types are mapped onto the run's with ``--public-types`` (the
``--types`` syntax: ``Disease=problem,Chemical=treatment``). Under partial
labels an ``O`` token of the public text is not evidence against a run type
the public text never annotates (as for a site that does not annotate it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.tasks import get_task
from clinfed.tasks.base import Task
from clinfed.training import make_optimizer, train_epoch

# The site name public documents carry while they are encoded.
PUBLIC_SITE = "(public)"


def warm_start(
    config: Any,
    task: Task,
    model: nn.Module,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
    report=lambda event, info: None,
) -> dict[str, Any]:
    """Train ``model`` (every parameter) on ``config.public_data`` for
    ``config.public_epochs``; returns what ``config.json`` and the report
    say of it. ``task`` is the run's, its labels already fixed."""
    from clinfed.provenance import data_fingerprint

    folder = Path(config.public_data)
    if not folder.is_dir():
        raise ClinfedError(f"--public-data {folder}: not a folder")
    if task.head != "token":
        raise ClinfedError(f"--public-data: task {task.name} has no public text to start from")
    reader = get_task(config.task, types=config.public_types, format="auto", cache_dir=cache_dir)
    corpus = reader.load(folder, problems)
    documents = [d for d in (*corpus.train, *corpus.test) if d.concepts or d.annotated]
    annotated = sorted({c.type for d in documents for c in d.concepts})
    unknown = [t for t in annotated if t not in task.entity_types]
    if unknown:
        raise ClinfedError(
            f"--public-data {folder}: type {unknown[0]} is not one of the run's "
            f"({', '.join(task.entity_types)}); map it with --public-types"
        )
    for document in documents:
        document.site = PUBLIC_SITE
    task.site_types[PUBLIC_SITE] = set(annotated)
    try:
        examples = task.encode(documents, tokenizer, config.max_length, cache_dir)
    finally:
        del task.site_types[PUBLIC_SITE]
    order = np.random.default_rng([config.seed, 11])
    if config.public_examples and config.public_examples < len(examples):
        keep = np.sort(order.choice(len(examples), config.public_examples, replace=False))
        examples = examples.select(keep.tolist())
    # The whole encoder trains; LoRA factors stay at their seeded start (every
    # party rebuilds A from the seed, and B starts at zero).
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" not in name)
    # This phase trains whole layers without DP, so it takes the task's
    # whole-model rates, not the run's: an adapter run's --lr (1e-3, for
    # low-rank updates that start at zero) trains a whole encoder into
    # collapse (measured: F1 0.0 after a warm start at 1e-3 with --adapter
    # bias). The batch is the task's non-private one (under DP the run's is
    # derived per site).
    defaults = task.defaults
    batch_size = config.batch_size or defaults.get("batch_size", 16)
    lr = config.public_lr or defaults.get("lr", 1e-4)
    head_lr = config.head_lr or defaults.get("head_lr")
    optimizer = make_optimizer(model, lr, config.weight_decay, head_lr)
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    loss = None
    for epoch in range(1, config.public_epochs + 1):
        report("public_epoch", {"epoch": epoch, "examples": len(examples)})
        loss = train_epoch(
            model, task, examples, optimizer, batch_size, order, precision=config.precision
        ).loss
    return {
        "folder": str(folder.resolve()),
        "data_fingerprint": data_fingerprint(folder),
        "examples": len(examples),
        "types": annotated,
        "epochs": config.public_epochs,
        "lr": lr,
        "final_loss": loss,
        "seconds": round(time.perf_counter() - started, 1),
    }


def describe(record: dict[str, Any]) -> str:
    """The warm start in one line for a person (the report's header)."""
    return (
        f"trained on public text {Path(record['folder']).name} "
        f"({record['examples']:,} examples, types {', '.join(record['types']) or 'none'}, "
        f"{record['epochs']} epoch{'s' if record['epochs'] != 1 else ''}) before round 1, "
        "without DP: no site's data, no privacy spent"
    )
