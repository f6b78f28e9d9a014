"""The server of a federation whose sites are elsewhere (Flower): the same
round engine as the in-process runner, over another transport. Writes the
run folder (or continues it) as ``clinfed train`` does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from clinfed.core.errors import ProblemLog
from clinfed.core.runs import atomic_write_json, claimed_run_folder, create_run_folder
from clinfed.core.scratch import temporary_folder
from clinfed.modeling.adapters import fedavg_bytes, load_shared, shared_names, shared_state
from clinfed.modeling.models import gazetteer_of, load_tokenizer, save_model
from clinfed.runners.factories import make_model, make_strategy, make_task, summation
from clinfed.runners.pipeline import config_record
from clinfed.runners.resume import resume_finished
from clinfed.settings import RunConfig


def run_federation(
    config: RunConfig,
    deployment: Any,
    transport: Any,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The server's side of a federation whose sites are elsewhere (Flower):
    the same round engine as in-process, over ``transport``. Writes the run
    folder (or continues it with ``config.resume``) and returns the summary.
    """

    deployment.validate()
    config = config.resolved()
    with claimed_run_folder(config.out, config.resume):
        if config.resume and (summary := resume_finished(config, log)) is not None:
            return summary
        return _serve(config, deployment, transport, log)


def _serve(
    config: RunConfig, deployment: Any, transport: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    # The cache lives as long as the run: --public-check scores each round
    # on public text encoded into it.
    with temporary_folder("server") as cache:
        return _serve_in(config, deployment, transport, log, cache)


def _serve_in(
    config: RunConfig,
    deployment: Any,
    transport: Any,
    log: Callable[[str], None],
    cache: str,
) -> dict[str, Any]:
    from clinfed.federated.engine import RoundEngine

    out = Path(config.out)
    task = make_task(config, cache)
    tokenizer = load_tokenizer(config.model)
    model = make_model(config, task)
    # (SAFL's strategy object carries the public probe set; the server
    # never profiles with it.)
    strategy = make_strategy(config, task, tokenizer, cache)
    check = check_record = None
    if config.public_check:
        # The server's judge of each round, as in-process: public text read
        # where the ServerApp runs, scored on a copy of the starting model.
        from clinfed.runners.warmstart import public_check

        problems = ProblemLog(config.on_error)
        check, check_record = public_check(config, task, model, tokenizer, cache, problems)
    if not config.resume:
        create_run_folder(out)
        record = config_record(config, "flower") | {"deployment": asdict(deployment)}
        if gazetteer_of(model) is not None:  # kept in the --model folder the nodes pin
            record["gazetteer_list"] = gazetteer_of(model).describe()
        if check_record is not None:
            record["public_check_text"] = check_record
        atomic_write_json(out / "config.json", record)
        atomic_write_json(out / "labels.json", {"labels": task.labels, "source": task.label_source})
    engine = RoundEngine(
        task,
        strategy,
        {k: v.detach().clone() for k, v in shared_state(model).items()},
        shared_names(model),
        out,
        config.rounds,
        config.fraction,
        config.seed,
        deployment,
        log=log,
        full_bytes=fedavg_bytes(model),
        summation=summation(config),
        public_check=check,
    )
    if config.resume:
        engine.resume()
    from clinfed.core.tracking import Tracked

    engine.report = Tracked(engine.report, config.report_to, out, asdict(config))
    try:
        summary = engine.run(transport)
    finally:
        engine.report.close()
    load_shared(model, engine.global_state)
    meta = task.meta() | {"max_length": config.max_length, "encoder": config.model}
    save_model(model, out / "model", meta, tokenizer)
    return summary
