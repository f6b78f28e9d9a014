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

import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clinfed.core.device import use_threads
from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.events import PublicEpoch, Reporter, silent
from clinfed.core.runs import ensure_outside
from clinfed.core.scratch import temporary_folder
from clinfed.federated.public_check import PublicCheck, Scored, micro_f1
from clinfed.modeling.models import gazetteer_of, load_tokenizer, save_model
from clinfed.modeling.training import make_optimizer, predict, train_epoch
from clinfed.tasks.base import Task


def read_public(
    folder: Path,
    flag: str,
    config: Any,
    task: Task,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
    name_lists: Any = None,
) -> tuple[list[Any], Any, list[str], dict[str, int]]:
    """The annotated documents of the public text in ``folder`` (given as
    ``flag``), read by the run's task (types mapped with ``--public-types``),
    encoded; and the run types the text annotates (for ICD coding, the run's
    label codes its admissions carry); and the spans labelled from name lists
    per run type. ``name_lists``, a gazetteer with a
    mark per list, labels the words its lists name where the text's gold
    says nothing (:meth:`Task.distant_labels`), each list as the type of its
    name, mapped by ``--public-types`` as the text's own types are."""
    if not folder.is_dir():
        raise ClinfedError(f"{flag} {folder}: not a folder")
    return task.read_public(
        folder, flag, config.public_types, tokenizer, config.max_length, cache_dir, problems,
        name_lists,
    )  # fmt: skip


def public_examples(
    config: Any,
    task: Task,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
    order: np.random.Generator,
    name_lists: Any = None,
) -> tuple[Any, list[str], dict[str, int]]:
    """``config.public_data`` read and encoded by the run's task (its types
    mapped with ``--public-types``), at most ``--public-examples`` of them
    drawn from ``order``; and the run types the public text annotates."""
    folder = Path(config.public_data)
    _, examples, annotated, labelled = read_public(
        folder, "`public_data`", config, task, tokenizer, cache_dir, problems, name_lists
    )
    if config.public_examples and config.public_examples < len(examples):
        keep = np.sort(order.choice(len(examples), config.public_examples, replace=False))
        examples = examples.select(keep.tolist())
    return examples, annotated, labelled


def public_check(
    config: Any,
    task: Task,
    model: nn.Module,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
) -> tuple[PublicCheck, dict[str, Any]]:
    """``--public-check``: the server's judge of each round's proposed
    model, micro F1 of its decisions (:meth:`Task.decisions`: concept spans,
    or ICD codes per admission) on the public text of ``config.public_check``,
    scored on a copy of ``model`` of its own; and what ``config.json`` says
    of it."""
    from clinfed.core.provenance import data_fingerprint
    from clinfed.modeling.adapters import load_shared

    folder = Path(config.public_check)
    records, examples, annotated, _ = read_public(
        folder, "`public_check`", config, task, tokenizer, cache_dir, problems
    )
    task.check_public_judge(folder, records, annotated)
    judge = copy.deepcopy(model)
    gold = task.decisions(records, examples)

    def score(state: dict[str, torch.Tensor]) -> Scored:
        load_shared(judge, state)
        found = task.decisions(records, examples, predict(judge, task, examples))
        return Scored(micro_f1(found, gold), found)

    record = {
        "folder": str(folder),
        "data_fingerprint": data_fingerprint(folder),
        "examples": len(examples),
        "types": annotated,
    }
    return PublicCheck(score, gold), record


def warm_start(
    config: Any,
    task: Task,
    model: nn.Module,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
    report: Reporter = silent,
) -> dict[str, Any]:
    """Train ``model`` (every parameter) on ``config.public_data`` for
    ``config.public_epochs``; returns what ``config.json`` and the report
    say of it. ``task`` is the run's, its labels already fixed."""
    from clinfed.core.provenance import data_fingerprint, file_digests

    folder = Path(config.public_data)
    # Draws the kept public examples, then their order in every epoch.
    order = np.random.default_rng([config.seed, 11])
    # Name lists with a mark each label the public text's unlabelled words
    # they name (measured +1.3 to +1.9 F1 at epsilon 8 on BC5CDR).
    gazetteer = gazetteer_of(model)
    name_lists = gazetteer if gazetteer is not None and gazetteer.kinds else None
    examples, annotated, labelled = public_examples(
        config, task, tokenizer, cache_dir, problems, order, name_lists
    )
    # The whole encoder trains; LoRA factors stay at their seeded start (every
    # party rebuilds A from the seed, and B starts at zero).
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" not in name)
    # This phase trains whole layers without DP, so it takes the task's
    # whole-model rates, not the run's: an adapter run's --lr (1e-3, for
    # low-rank updates that start at zero) trains a whole encoder into
    # collapse (measured: F1 0.0 after a warm start at 1e-3 with --adapter
    # bias). The batch is always the task's non-private one: a run's
    # --batch-size is its private rounds' (under DP the Poisson batch), and
    # when it reached the warm start too, runs that differed only in batch
    # started from different models (measured: starts scoring 0.14 to 0.31
    # on the demo's corpus), so the private run and its reference, or two
    # runs compared, no longer started from the same model.
    defaults = task.defaults
    batch_size = defaults.get("batch_size", 16)
    lr = config.public_lr or defaults.get("lr", 1e-4)
    head_lr = config.head_lr or defaults.get("head_lr")
    optimizer = make_optimizer(model, lr, config.weight_decay, head_lr)
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    loss = None
    for epoch in range(1, config.public_epochs + 1):
        report(PublicEpoch(epoch=epoch, examples=len(examples)))
        loss = train_epoch(
            model, task, examples, optimizer, batch_size, order, precision=config.precision
        ).loss
    return {
        "folder": str(folder.resolve()),
        "data_fingerprint": data_fingerprint(folder),
        # Each public file's digest: a run refuses a start whose text has
        # the bytes of its private notes (clinfed.core.provenance).
        "file_sha256": sorted(set(file_digests(folder).values())),
        "examples": len(examples),
        "types": annotated,
        **({"label_kind": task.public_label_kind} if task.public_label_kind != "types" else {}),
        **({"labels_from_lists": labelled} if name_lists else {}),
        "epochs": config.public_epochs,
        "lr": lr,
        "head_lr": head_lr,
        "batch_size": batch_size,
        "final_loss": loss,
        "seconds": round(time.perf_counter() - started, 1),
    }


def warm_start_model(config: Any, report: Reporter = silent) -> dict[str, Any]:
    """``clinfed warm-start``: train the run's starting model on its public
    text (``config.public_data``) and save it to ``config.out``, for any
    number of runs to start from (``--model``) without paying for the warm
    start again. A public stage: it reads nothing private, not even the
    label set, which comes from the task's declared settings (``--types``,
    the i2b2 preset, the public code list). ``config.data``, when given, is
    only where the public inputs and ``--out`` must not be."""
    from clinfed.core.provenance import check_public_input
    from clinfed.runners.factories import after_saved_start, make_model, make_task
    from clinfed.settings import PUBLIC_INPUTS, flag

    # A public phase without DP: the rates of a run without DP.
    config = replace(config, target_epsilon=None, noise_multiplier=None).resolved()
    if not config.public_data:
        raise ClinfedError("clinfed warm-start needs `public_data`")
    out = Path(config.out)
    if out.exists():
        raise ClinfedError(f"`out` {out}: already exists; name a new folder")
    if config.data:
        for name in PUBLIC_INPUTS:
            if getattr(config, name):
                check_public_input(flag(name), getattr(config, name), config.data)
        ensure_outside(out, config.data)
    for name in PUBLIC_INPUTS:  # the model would be read back as public text
        if getattr(config, name) and Path(getattr(config, name)).is_dir():
            ensure_outside(out, getattr(config, name), flag(name))
    use_threads(config.threads)
    problems = ProblemLog(config.on_error)
    with temporary_folder("cache") as cache_dir:
        task = make_task(config, cache_dir)
        tokenizer = load_tokenizer(config.model)
        model = make_model(config, task)
        public = warm_start(config, task, model, tokenizer, cache_dir, problems, report)
        public = after_saved_start(public, config.model)
    meta = task.meta() | {
        "max_length": config.max_length,
        "encoder": config.model,
        "public_start": public,
    }
    save_model(model, out, meta, tokenizer)
    return public | {"model": str(out.resolve())}
