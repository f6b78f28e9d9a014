"""What a run is built from, the same way in every runner: its task, model,
strategy and the server's summation (each site's privacy policy:
:mod:`clinfed.federated.site_policy`). The in-process runner, the Flower server and every
Flower node call these, so a site gets the same noise and the same model in
every transport."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from torch import nn

from clinfed.core.errors import ClinfedError
from clinfed.federated.strategies import STRATEGIES, Strategy, StrategyContext
from clinfed.federated.summation import PlainSummation, Summation
from clinfed.modeling.adapters import add_bias, add_head, add_labels, add_lora
from clinfed.modeling.families import family_of
from clinfed.modeling.gazetteer import Gazetteer
from clinfed.modeling.models import (
    attach_gazetteer,
    build_model,
    gazetteer_of,
    load_tokenizer,
    model_window,
)
from clinfed.settings import RunConfig
from clinfed.tasks import TASKS, get_task, task_head
from clinfed.tasks.base import Task


def make_model(config: RunConfig, task: Task) -> nn.Module:
    """The run's starting model (with the modules its strategy adds): the
    same weights wherever it is built from the same config."""
    model = build_model(
        task.head,
        config.model,
        len(task.labels),
        seed=config.seed,
        labels=task.labels,
        head_lookup=task_head,
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
    from clinfed.modeling.models import saved_run_model

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


def summation(config: RunConfig) -> Summation:
    """How the server sums each round's uploads: in the clear, or under
    secure aggregation at the run's threshold."""
    if config.secure_aggregation:
        from clinfed.federated.secure_summation import SecureSummation

        return SecureSummation(config.secure_threshold)
    return PlainSummation()
