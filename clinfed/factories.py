"""What a run is built from, the same way in every runner: its task, model,
strategy, each site's privacy policy (from the count it released), and the
server's summation. The in-process runner, the Flower server and every
Flower node call these, so a site gets the same noise and the same model in
every transport."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import nn

from clinfed.adapters import add_bias, add_head, add_labels, add_lora
from clinfed.errors import ClinfedError
from clinfed.families import family_of
from clinfed.federated.strategies import STRATEGIES, Strategy, StrategyContext
from clinfed.federated.summation import PlainSummation, Summation
from clinfed.gazetteer import Gazetteer
from clinfed.models import (
    attach_gazetteer,
    build_model,
    gazetteer_of,
    load_tokenizer,
    model_window,
)
from clinfed.privacy.count import count_path
from clinfed.privacy.policy import PrivacyPolicy
from clinfed.settings import RunConfig
from clinfed.tasks import TASKS, get_task
from clinfed.tasks.base import Task


def make_model(config: RunConfig, task: Task) -> nn.Module:
    """The run's starting model (with the modules its strategy adds): the
    same weights wherever it is built from the same config."""
    model = build_model(
        task.head, config.model, len(task.labels), seed=config.seed, labels=task.labels
    )
    window = model_window(model)
    if config.max_length is not None and config.max_length > window:
        raise ClinfedError(
            f"`max_length` {config.max_length}: `model` {config.model} reads at most {window} "
            "tokens at once"
        )
    if config.gazetteer:
        gazetteer = Gazetteer.read(config.gazetteer, per_list=config.gazetteer_marks == "per-list")
        earlier = gazetteer_of(model)
        if earlier is not None and earlier.sha256 != gazetteer.sha256:
            raise ClinfedError(
                f"`gazetteer` {config.gazetteer}: `model` {config.model} was trained to read "
                f"another name list (SHA-256 {earlier.sha256[:12]}…, {len(earlier.names):,} "
                "names, kept in its folder): leave `gazetteer` out to use that one"
            )
        attach_gazetteer(model, gazetteer, load_tokenizer(config.model))
    family = family_of(getattr(model.encoder.config, "model_type", ""))
    if config.dp and family is not None and family.dp_refusal:
        # The family says why no clipping mode can bound one example's
        # influence (DeBERTa: relative attention over a shared table).
        raise ClinfedError(
            f"`model` {config.model}: DP-SGD does not support {family.name} "
            f"({model.encoder.config.model_type}): {family.dp_refusal}; use a BERT or "
            "RoBERTa encoder under DP"
        )
    STRATEGIES[config.strategy].prepare_model(
        model, config.options(), config.seed, config.max_length
    )
    if config.adapter == "lora":
        add_lora(model, config.lora_rank, config.lora_alpha, config.lora_factors, config.seed)
    elif config.adapter == "bias":
        add_bias(model)
    elif config.adapter == "head":
        add_head(model)
    elif config.adapter == "labels":
        add_labels(model)
    return model


def after_saved_start(public: dict[str, Any], spec: str) -> dict[str, Any]:
    """A warm start on a model that was itself warm-started (``--model
    START``) keeps the earlier one in its record (``after``), so the run's
    config and report name every public text its start saw."""
    earlier = saved_public_start(spec)
    return public if earlier is None else public | {"after": earlier}


def saved_public_start(spec: str) -> dict[str, Any] | None:
    """The public warm start a saved starting model (``--model RUN/model``)
    went through, if any: the run records it as its own, with the model's
    folder."""
    from clinfed.models import saved_run_model

    folder = saved_run_model(spec)
    if folder is None:
        return None
    start = json.loads((folder / "model.json").read_text()).get("public_start")
    return None if start is None else dict(start, model=str(folder.resolve()))


def make_task(config: RunConfig, cache_dir: str) -> Task:
    """The run's task adapter, with its options."""
    options = TASKS[config.task].options
    values = {f.name: getattr(config, f.name) for f in fields(options)} if options else {}
    return get_task(config.task, cache_dir=cache_dir, private=config.dp, **values)


def make_strategy(config: RunConfig, task: Task, tokenizer: Any, cache_dir: str) -> Strategy:
    """The run's strategy; the server and every site build it the same way
    from the same config."""
    context = StrategyContext(task, tokenizer, config.max_length, config.seed, cache_dir)
    cls = STRATEGIES[config.strategy]
    return cls.build(config.options(), context)


def privacy_policy(
    config: RunConfig,
    task: Task,
    train: dict[str, Any],
    folder: Path,
    strategy: Strategy,
    memo: Path | None = None,
    ledger_paths: dict[str, Path] | None = None,
    ledger_budget: float | None = None,
    ledger_mark: Path | None = None,
    run: str | None = None,
) -> PrivacyPolicy:
    """Each site's DP-SGD settings and ledger (``train``: each site's encoded
    training examples). A site calibrates from its own number of privacy
    units only, so it gets the same noise in every transport.
    ``ledger_paths``: ledgers that outlive the run (a node's, one per
    dataset; default ``folder/<site>.jsonl``); a released count is kept
    beside its ledger. ``ledger_budget``, ``ledger_mark``, ``run``: a
    node's cap over every run, its ledgers' high-water mark and the run
    charging them (:class:`~clinfed.federated.assembly.SitePlace`)."""
    from clinfed.privacy.recipe import steps_per_epoch

    target = config.target_epsilon
    unit = config.privacy_unit
    ledger_paths = dict(ledger_paths or {})
    sites_units = {site: task.unit_rows(data, unit) for site, data in train.items()}
    sizes = {site: len(units) for site, units in sites_units.items()}
    if config.neighbours == "add-remove":
        sizes = {
            site: released_count(
                config, site, n, count_path(ledger_paths.get(site, folder / f"{site}.jsonl"))
            )
            for site, n in sizes.items()
        }
    policy = PrivacyPolicy.build(
        folder,
        sizes,
        config.batch_size,
        config.local_epochs,
        config.rounds,
        config.delta,
        None if target is None or math.isinf(target) else target,
        config.noise_multiplier,
        config.max_grad_norm,
        config.clipping,
        strategy.selection_mechanism(),
        strategy.trainings_per_round,
        config.reproducible_noise,
        reference_batch=task.defaults["batch_size"],
        memo=memo,
        relation=config.neighbours,
        steps_per_epoch=steps_per_epoch(config.adapter),
    )
    policy.ledger_paths = ledger_paths
    policy.ledger_budget, policy.ledger_mark, policy.run = ledger_budget, ledger_mark, run
    policy.unit, policy.unit_text = unit, task.units[unit]
    if unit == "example":
        # What groups the units, for the group bound; never how many a
        # group holds (one note's length, exact).
        policy.group_of = next((g for g in ("patient", "document") if g in task.units), None)
    return policy


def released_count(config: RunConfig, site: str, units: int, kept_at: Path) -> int:
    """Under add/remove neighbours, the unit count ``site`` releases: the one
    kept at ``kept_at`` (beside its ledger: one per dataset), or a fresh
    noisy draw from its secret randomness (clinfed.privacy.count; kept before
    anything covering it leaves)."""
    from clinfed.federated.client import site_generator
    from clinfed.privacy.count import kept_count, noisy_count
    from clinfed.privacy.randomness import reproducible, secret

    kept = kept_count(kept_at)
    if kept is not None:
        return kept
    if config.reproducible_noise:
        randomness = reproducible(site_generator(config.seed, 0, site))
    else:
        randomness = secret()
    return noisy_count(units, randomness.noise)


def summation(config: RunConfig) -> Summation:
    """How the server sums each round's uploads: in the clear, or under
    secure aggregation at the run's threshold."""
    if config.secure_aggregation:
        from clinfed.federated.secure_summation import SecureSummation

        return SecureSummation(config.secure_threshold)
    return PlainSummation()
