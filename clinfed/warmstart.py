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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clinfed.device import device_of, to_device
from clinfed.errors import ClinfedError, ProblemLog
from clinfed.federated.public_check import PublicCheck, Scored, micro_f1
from clinfed.models import gazetteer_of
from clinfed.privacy.clipping import layer_hooks, per_example_gradients
from clinfed.privacy.subspace import (
    GradientSubspace,
    label_feature_basis,
    stack_blocks,
    top_directions,
)
from clinfed.tasks import get_task
from clinfed.tasks.base import Task
from clinfed.training import make_optimizer, predict, train_epoch

# The site name public documents carry while they are encoded.
PUBLIC_SITE = "(public)"


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
    if task.head == "multilabel":  # ICD coding: admissions with their codes
        if config.public_types:
            raise ClinfedError(
                f"--public-types maps entity types; task {task.name} reads ICD-9 codes, "
                "which keep their names"
            )
        records, codes = task.public_admissions(folder, flag, problems)
        records = records.map(lambda _: {"site": PUBLIC_SITE}, input_columns="site")
        return records, task.encode(records, tokenizer, config.max_length, cache_dir), codes, {}
    if task.head != "token":
        raise ClinfedError(f"{flag}: task {task.name} reads no public text")
    reader = get_task(config.task, types=config.public_types, format="auto", cache_dir=cache_dir)
    corpus = reader.load(folder, problems)
    documents = [d for d in (*corpus.train, *corpus.test) if d.concepts or d.annotated]
    labelled: dict[str, int] = {}
    if name_lists is not None:
        labelled = reader.distant_labels(documents, name_lists, task.entity_types)
    annotated = sorted({c.type for d in documents for c in d.concepts})
    unknown = [t for t in annotated if t not in task.entity_types]
    if unknown:
        raise ClinfedError(
            f"{flag} {folder}: type {unknown[0]} is not one of the run's "
            f"({', '.join(task.entity_types)}); map it with --public-types"
        )
    for document in documents:
        document.site = PUBLIC_SITE
    task.site_types[PUBLIC_SITE] = set(annotated)
    try:
        examples = task.encode(documents, tokenizer, config.max_length, cache_dir)
    finally:
        del task.site_types[PUBLIC_SITE]
    return documents, examples, annotated, labelled


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
        folder, "--public-data", config, task, tokenizer, cache_dir, problems, name_lists
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
    from clinfed.adapters import load_shared
    from clinfed.provenance import data_fingerprint

    folder = Path(config.public_check)
    records, examples, annotated, _ = read_public(
        folder, "--public-check", config, task, tokenizer, cache_dir, problems
    )
    if task.head == "token":
        missing = [t for t in task.entity_types if t not in annotated]
        if not records or missing:
            raise ClinfedError(
                f"--public-check {folder}: "
                + (f"no span of type {missing[0]}" if records else "no annotated documents")
                + ": its F1 scores every type of the run, so it needs text that annotates them all"
            )
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
    report=lambda event, info: None,
) -> dict[str, Any]:
    """Train ``model`` (every parameter) on ``config.public_data`` for
    ``config.public_epochs``; returns what ``config.json`` and the report
    say of it. ``task`` is the run's, its labels already fixed."""
    from clinfed.provenance import data_fingerprint

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
        report("public_epoch", {"epoch": epoch, "examples": len(examples)})
        loss = train_epoch(
            model, task, examples, optimizer, batch_size, order, precision=config.precision
        ).loss
    return {
        "folder": str(folder.resolve()),
        "data_fingerprint": data_fingerprint(folder),
        "examples": len(examples),
        "types": annotated,
        **({"label_kind": "codes"} if task.head == "multilabel" else {}),
        **({"labels_from_lists": labelled} if name_lists else {}),
        "epochs": config.public_epochs,
        "lr": lr,
        "batch_size": batch_size,
        "final_loss": loss,
        "seconds": round(time.perf_counter() - started, 1),
    }


# The most numbers (examples x projected dimension) the matrix of public
# per-example gradients that spans --dp-subspace may hold (2 GB in float32).
SUBSPACE_MAX_NUMBERS = 500_000_000
# Public examples per backward pass while their per-example gradients are
# taken (one pass each was the cost of a refresh).
SUBSPACE_BATCH = 32
# Feature directions of the head's basis (each paired with every label).
HEAD_FEATURE_RANK = 32


class PublicSubspaces:
    """``--dp-subspace``'s basis for the model a round starts from.

    Found once at the starting model, or, under ``--dp-subspace-refresh``,
    again at each global model a site starts a round from: the gradients
    move away from the start's public directions as the model trains, and
    the global model is a DP release (post-processing, no privacy spent).
    The latest basis is kept, by the digest of the model's trainable
    tensors, so in-process sites that start from the same global model
    find it once.

    Call it with a site's model (the global weights loaded) to get the
    round's :class:`~clinfed.privacy.subspace.GradientSubspace`;
    :meth:`at_local_model` finds it at a site's model within a round
    (``--dp-subspace-refresh-epochs``).
    """

    def __init__(
        self,
        config: Any,
        task: Task,
        tokenizer: Any,
        cache_dir: str,
        problems: ProblemLog,
        start: nn.Module,
        first: GradientSubspace,
        report=lambda event, info: None,
    ):
        self.config, self.task, self.tokenizer = config, task, tokenizer
        self.cache_dir, self.problems, self.report = cache_dir, problems, report
        self.refresh = bool(config.dp_subspace_refresh)
        self.latest = (self._digest(start), first)
        # Within a round the site's model carries DP-SGD's hooks: the public
        # gradients are taken on a copy of it that has none.
        self.scratch = copy.deepcopy(start) if config.dp_subspace_refresh_epochs else None

    @staticmethod
    def _digest(model: nn.Module) -> str:
        from clinfed.adapters import shared_names
        from clinfed.federated.payload import digest

        params = dict(model.named_parameters())
        return digest({n: params[n] for n in shared_names(model)})

    def __call__(self, model: nn.Module) -> GradientSubspace:
        if not self.refresh:
            return self.latest[1]
        key = self._digest(model)
        if key != self.latest[0]:
            # A log of its own: the public text was read once already, and
            # the run's log holds its warnings since.
            problems = ProblemLog(self.problems.on_error)
            space, record = public_subspace(
                self.config, self.task, model, self.tokenizer, self.cache_dir, problems
            )
            self.latest = (key, space)
            self.report("public_subspace_found", record | {"at": "global model"})
        return self.latest[1]

    def at_local_model(self, model: nn.Module) -> GradientSubspace:
        """The subspace at a site's ``model`` within a round: a function of
        public text and of the site's own noised steps (post-processing)."""
        if self.scratch is None:
            raise ValueError("the subspace within a round needs --dp-subspace-refresh-epochs")
        self.scratch.load_state_dict(model.state_dict())
        space, record = public_subspace(
            self.config,
            self.task,
            self.scratch,
            self.tokenizer,
            self.cache_dir,
            ProblemLog(self.problems.on_error),
        )
        self.report("public_subspace_found", record | {"at": "local model"})
        return space


class PublicMix:
    """``--dp-public-mix W``: each private step also descends the public
    text's loss at the site's current model, at weight ``W``.

    Under DP-SGD a site's step is its clipped, noised gradient; this adds
    ``W`` times the mean gradient of a batch of ``--dp-public-batch`` public
    examples, taken at the same local model, before the optimizer steps
    (public data-assisted DP training: Golatkar et al. 2022, "Mixed
    differential privacy in computer vision"; Amid et al. 2022, "Public
    data-assisted mirror descent for private model training"). The public
    term carries no noise, so the step keeps what the warm start taught
    instead of letting the noise walk it away, while the private sum
    adapts the model to the site's text.

    Privacy: the local model is a function of the global model (a DP
    release) and of the site's own noised steps; the public batch is public
    text drawn with a public generator. The added term is post-processing
    of what the accountant already covers, so epsilon does not change.

    Call it with a site's model (DP-SGD's hooks attached) after the noise
    is on its gradients: the public gradient is taken on a hook-free copy
    and added to the trainable parameters' ``.grad``.
    """

    def __init__(self, config: Any, task: Task, examples: Any, start: nn.Module) -> None:
        if not len(examples):
            raise ClinfedError("--dp-public-mix: the public text has no annotated examples")
        self.task, self.examples = task, examples
        self.weight = float(config.dp_public_mix)
        self.batch = min(int(config.dp_public_batch), len(examples))
        # Public text, public order: the draw protects nothing, so it comes
        # from the run's seed (and is the same wherever the site runs).
        self.order = np.random.default_rng([config.seed, 13])
        self.lengths = np.asarray([len(ids) for ids in examples["input_ids"]])
        # Within a round the site's model carries DP-SGD's hooks, which a
        # public backward pass must not feed: the gradient is taken on a copy.
        self.scratch = copy.deepcopy(start)

    def __call__(self, model: nn.Module) -> None:
        """Add ``W`` times the public batch's mean gradient to the ``.grad``
        of ``model``'s trainable parameters."""
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.scratch.load_state_dict(model.state_dict())
        for name, param in self.scratch.named_parameters():
            param.requires_grad_(name in params)
            param.grad = None
        self.scratch.train(model.training)
        rows = self.order.choice(len(self.examples), self.batch, replace=False)
        rows = rows[np.argsort(self.lengths[rows], kind="stable")].tolist()
        batch = to_device(self.task.collate(self.examples[rows]), device_of(model))
        losses = self.task.example_losses(self.scratch(**self.task.model_inputs(batch)), batch)
        losses.mean().backward()
        with torch.no_grad():
            for name, param in self.scratch.named_parameters():
                if name not in params or param.grad is None:
                    continue
                target = params[name]
                if target.grad is None:
                    target.grad = torch.zeros_like(target)
                target.grad.add_(param.grad, alpha=self.weight)
                param.grad = None


def public_mix(
    config: Any,
    task: Task,
    model: nn.Module,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
) -> tuple[PublicMix, dict[str, Any]]:
    """``--dp-public-mix``'s public gradient source, on the examples the
    warm start drew from ``config.public_data``; and what ``config.json``
    says of it."""
    from clinfed.provenance import data_fingerprint

    order = np.random.default_rng([config.seed, 11])  # the warm start's draw
    examples, annotated, _ = public_examples(config, task, tokenizer, cache_dir, problems, order)
    mix = PublicMix(config, task, examples, model)
    record = {
        "folder": str(Path(config.public_data).resolve()),
        "data_fingerprint": data_fingerprint(Path(config.public_data)),
        "examples": len(examples),
        "types": annotated,
        "weight": mix.weight,
        "batch": mix.batch,
    }
    return mix, record


def public_subspace(
    config: Any,
    task: Task,
    model: nn.Module,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
    report=lambda event, info: None,
) -> tuple[GradientSubspace, dict[str, Any]]:
    """Where DP-SGD's noise goes under ``--dp-subspace K``
    (:mod:`clinfed.privacy.subspace`), found at the starting ``model`` on
    up to ``--dp-subspace-examples`` public examples (drawn with the run's
    seed, from those the warm start drew): the top ``K`` principal
    directions of the per-example gradients of the encoder's trainable
    tensors; for the head's weight, every label paired with the top
    :data:`HEAD_FEATURE_RANK` principal directions of the public tokens'
    features; the head's bias whole. Reads public text and the public
    starting model only, so every site uses it at no privacy cost.
    Returns it and what ``config.json`` says of it."""
    from clinfed.adapters import shared_names
    from clinfed.tasks.i2b2.adapter import IGNORE

    started = time.perf_counter()
    order = np.random.default_rng([config.seed, 11])  # the warm start's draw
    examples, _, _ = public_examples(config, task, tokenizer, cache_dir, problems, order)
    trainable = shared_names(model)
    params = dict(model.named_parameters())
    head = model.get_submodule("head")
    if not isinstance(head, nn.Linear):
        raise ClinfedError("--dp-subspace needs a linear token head (concept extraction)")
    encoder = [n for n in trainable if not n.startswith("head.")]
    kept = [n for n in trainable if n.startswith("head.") and params[n] is not head.weight]
    dimension = sum(params[n].numel() for n in encoder)
    count = min(config.dp_subspace_examples, len(examples))
    if not 1 <= config.dp_subspace <= min(count, dimension):
        raise ClinfedError(
            f"--dp-subspace {config.dp_subspace}: must be between 1 and the public examples "
            f"used ({count}) and the encoder's trainable numbers ({dimension:,})"
        )
    if count * dimension > SUBSPACE_MAX_NUMBERS:
        raise ClinfedError(
            f"--dp-subspace: {count:,} public examples x {dimension:,} trainable numbers are "
            "too many to hold at once: lower --dp-subspace-examples or train a smaller "
            "adapter (--adapter bias)"
        )
    rows = order.choice(len(examples), count, replace=False)
    report("public_subspace", {"examples": count, "rank": config.dp_subspace})
    gradients = torch.empty(count, dimension)
    features: list[torch.Tensor] = []
    labelled: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, inputs, _o: features.append(inputs[0].detach()))
    # Per-example gradients of the encoder's trainable tensors alone,
    # SUBSPACE_BATCH examples a backward pass (Opacus's layer hooks).
    flags = {n: p.requires_grad for n, p in params.items()}
    for name, param in params.items():
        param.requires_grad_(name in encoder)
    targets = [params[n] for n in encoder]
    was_training = model.training
    model.eval()  # no dropout: the directions of the model itself
    try:
        with layer_hooks(model):
            # By length, so a pass pads little (the basis does not depend
            # on the order of the examples).
            lengths = np.asarray([len(examples[int(r)]["input_ids"]) for r in rows])
            ordered = rows[np.lexsort((rows, lengths))].tolist()
            for start in range(0, count, SUBSPACE_BATCH):
                chosen = ordered[start : start + SUBSPACE_BATCH]
                batch = to_device(task.collate(examples[chosen]), device_of(model))
                losses = task.example_losses(model(**task.model_inputs(batch)), batch)
                labelled.append(features.pop()[batch["labels"] != IGNORE].cpu())
                grads = per_example_gradients(model, targets, losses)
                gradients[start : start + len(chosen)] = torch.cat(
                    [g.reshape(len(chosen), -1).cpu() for g in grads], dim=1
                )
    finally:
        hook.remove()
        for name, param in params.items():
            param.requires_grad_(flags[name])
        model.train(was_training)
    basis, held = top_directions(gradients, config.dp_subspace)
    tokens = torch.cat(labelled)
    feature_rank = min(HEAD_FEATURE_RANK, *tokens.shape)
    directions, feature_held = top_directions(tokens, feature_rank)
    groups = [
        dict(zip(encoder, basis.split([params[n].numel() for n in encoder], dim=1), strict=True)),
        {"head.weight": label_feature_basis(directions, head.out_features)},
    ]
    space = GradientSubspace(
        {n: b.contiguous() for n, b in stack_blocks(groups).items()},
        frozenset(kept),
        held,
        residual=config.dp_residual,
    )
    shapes = {n: params[n].shape for n in trainable}
    record = {
        "rank": config.dp_subspace,
        "head_feature_rank": feature_rank,
        "public_examples": count,
        "public_tokens": len(tokens),
        "kept_whole": kept,
        "noised_numbers": space.noised_numbers(shapes),
        "residual": config.dp_residual,
        "trainable_numbers": sum(params[n].numel() for n in trainable),
        "public_gradient_share": round(held, 4),
        "public_feature_share": round(feature_held, 4),
        "seconds": round(time.perf_counter() - started, 1),
    }
    return space, record


def describe(record: dict[str, Any]) -> str:
    """The warm start in one line for a person (the report's header); a
    start made on an earlier start names every public text, first to last."""
    stages = []
    while record:
        stages.append(
            f"{Path(record['folder']).name} ({record['examples']:,} examples, "
            f"{record.get('label_kind', 'types')} {', '.join(record['types']) or 'none'}, "
            f"{record['epochs']} epoch{'s' if record['epochs'] != 1 else ''})"
        )
        record = record.get("after")
    return (
        f"trained on public text {', then '.join(reversed(stages))} before round 1, "
        "without DP: no site's data, no privacy spent"
    )
