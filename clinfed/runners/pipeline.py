"""One training run from a data folder to a finished run folder.

Run folder layout::

    RUN/config.json        the resolved configuration
    RUN/metrics.jsonl      pooled (centralized): one object per epoch (``epoch``, ``f1``...);
                           federated: per round and site (``round``, ``site``,
                           ``bytes_up``...) and per round (``round``, ``f1``...)
    RUN/state.json         federated: the last committed round (for --resume)
    RUN/checkpoints/       federated: global weights after that round
    RUN/sites/<site>/      federated: each site's copies of the model and its ledger
    RUN/model/             model.safetensors, model.json, tokenizer/
    RUN/predictions/       test-split predictions in the task's real format
    RUN/summary.json       final metrics (and, federated, communication totals)
    RUN/seal.json          written last: the digest of every file the report reads

A pooled strategy (``centralized``) trains on all sites' data in one place
(the upper reference); federated strategies run on the round engine over the
in-process transport (:func:`run_training`) or, with the sites elsewhere,
over Flower (:func:`run_federation`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clinfed.core.device import resolve_device, use_threads
from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.events import (
    EpochEnd,
    EpochStart,
    EvalStart,
    EvalStep,
    Loaded,
    Reporter,
    Step,
    silent,
)
from clinfed.core.runs import (
    append_jsonl,
    atomic_write_json,
    claimed_run_folder,
    create_run_folder,
)
from clinfed.core.scratch import temporary_folder
from clinfed.core.version import __version__
from clinfed.federated.assembly import SitePlace, build_site, site_privacy
from clinfed.federated.engine import RoundEngine
from clinfed.federated.inprocess import InProcessTransport
from clinfed.federated.partition import deal_sites
from clinfed.federated.public_check import PublicCheck
from clinfed.federated.secure_site import with_secure_aggregation
from clinfed.federated.strategies import STRATEGIES
from clinfed.modeling.adapters import (
    fedavg_bytes,
    load_shared,
    shared_names,
    shared_state,
)
from clinfed.modeling.gazetteer import Gazetteer
from clinfed.modeling.models import (
    gazetteer_of,
    load_tokenizer,
    save_model,
)
from clinfed.modeling.training import linear_schedule, make_optimizer, predict, train_epoch
from clinfed.privacy.policy import PrivacyPolicy
from clinfed.privacy.site import SitePrivacy
from clinfed.reporting.holdout import AUDIT_HOLDOUT, AUDIT_UPDATES, holdout_record, set_aside
from clinfed.runners.factories import (
    after_saved_start,
    make_model,
    make_strategy,
    make_task,
    saved_public_start,
    summation,
)
from clinfed.runners.resume import resume_finished
from clinfed.settings import RunConfig
from clinfed.tasks.base import SYNTHETIC_MARK, Corpus, Task

__all__ = ["RunConfig", "run_training", "make_model", "make_task", "make_strategy"]

# What an auditing run keeps for ``clinfed audit`` (clinfed.runners.audit).


def config_record(config: RunConfig, runner: str) -> dict[str, Any]:
    """What ``RUN/config.json`` holds: the settings by concern (accepted back
    by ``--config``) and, beside them, how the run was made."""
    from clinfed.core.provenance import provenance

    if config.data:
        # Absolute: the file read back from another folder names the same data.
        config = config.replace(data=str(Path(config.data).resolve()))
    return config.to_dict() | {"clinfed_version": __version__, "runner": runner} | provenance()


@dataclass
class _Prepared:
    task: Task
    corpus: Corpus
    tokenizer: Any
    model: nn.Module
    out: Path
    cache_dir: str
    # Under --public-check: the server's judge of each round's model (public).
    check: PublicCheck | None = None


def _finish(
    prep: _Prepared,
    config: RunConfig,
    test,
    outputs: list,
    record: dict,
    extra: dict | None = None,
) -> dict[str, Any]:
    meta = prep.task.meta() | {"max_length": config.max_length, "encoder": config.model}
    save_model(prep.model, prep.out / "model", meta, prep.tokenizer)
    prep.task.write_predictions(prep.corpus.test, test, outputs, prep.out / "predictions")
    from clinfed.core.provenance import provenance
    from clinfed.core.seal import seal_run

    summary = record | (extra or {}) | provenance()
    atomic_write_json(prep.out / "summary.json", summary)
    # Last: what the report and the model card will state, sealed.
    seal_run(prep.out)
    return summary


def run_training(config: RunConfig, report: Reporter = silent) -> dict[str, Any]:
    """Train, evaluate and write the run folder.

    Parameters
    ----------
    config
        The run's settings (:class:`~clinfed.settings.RunConfig`).
    report
        Called with progress events (``loaded``, ``epoch_start``, ``step``,
        ``eval_start``, ``epoch_end``, ``site_start``, ``site_end``,
        ``site_refused``, ``round_end``, ``stopped``); the CLI draws
        progress bars from them.

    Returns
    -------
    dict
        The final evaluation record (also in ``RUN/summary.json``).
    """
    config.validate()
    # The warm start is a public phase without DP: it takes the rates a run
    # without DP would, not the private rounds' (clinfed.privacy.recipe),
    # for the model the private rounds train (their plan's parameters).
    public_phase = replace(
        config, adapter=config.trained_parameters(), target_epsilon=None, noise_multiplier=None
    ).resolved()
    config = config.resolved()
    # One process per run folder, claimed before anything is read.
    with claimed_run_folder(config.out, config.resume):
        say = logging.getLogger("clinfed").warning
        if config.resume and (summary := resume_finished(config, say)) is not None:
            return summary
        from clinfed.core.tracking import Tracked

        reporter = Tracked(report, config.report_to, Path(config.out), asdict(config))
        try:
            return _train(config, reporter, public_phase)
        finally:
            reporter.close()


def _train(config: RunConfig, report: Reporter, public_phase: RunConfig) -> dict[str, Any]:
    strategy_cls = STRATEGIES[config.strategy]
    use_threads(config.threads)
    device = resolve_device(config.device)  # a device this machine lacks: exit 2 now
    problems = ProblemLog(config.on_error)
    # Tokenized notes are protected health information: unless the user names
    # a cache folder, they live in a temporary one removed after the run.
    with temporary_folder("cache") as tmp:
        cache_dir = config.cache_dir or tmp
        task = make_task(config, cache_dir)
        corpus = task.load(Path(config.data), problems)
        if len(corpus.train) == 0:
            raise ClinfedError(f"{config.data}: no annotated training examples")
        if len(corpus.test) == 0:
            raise ClinfedError(f"{config.data}: no held-out examples to evaluate on")
        # Everything that can fail on bad input happens before the run folder
        # exists, so a failed start leaves nothing behind.
        tokenizer = load_tokenizer(config.model)
        model = make_model(config, task).to(device)
        strategy_cls.check_model(config.options(), shared_names(model))
        public, check, check_record = _starting_model(
            config, public_phase, task, model, tokenizer, cache_dir, problems, report
        )
        train = task.encode(corpus.train, tokenizer, config.max_length, cache_dir)
        test = task.encode(corpus.test, tokenizer, config.max_length, cache_dir)
        prep = _Prepared(task, corpus, tokenizer, model, Path(config.out), cache_dir, check)
        if strategy_cls.pooled:
            out = create_run_folder(config.out)
            _write_start(out, config, task, corpus, "pooled", public, gazetteer=gazetteer_of(model))
            _loaded(report, train, test, corpus, None, problems)
            return _pooled(prep, config, train, test, report)
        return _federated_start(prep, config, train, test, report, problems, public, check_record)


def _starting_model(
    config: RunConfig,
    public_phase: RunConfig,
    task: Task,
    model: Any,
    tokenizer: Any,
    cache_dir: str,
    problems: ProblemLog,
    report: Reporter,
) -> tuple[dict[str, Any] | None, Any, dict[str, Any] | None]:
    """The model every site starts from, trained on public text first with
    ``--public-data`` (its record), and the server's public judge of each
    round with ``--public-check`` (and its record)."""
    if config.public_data and config.public_epochs:
        # Public text before round 1 (clinfed.runners.warmstart): every site, and
        # the no-DP reference given the same flag, start from this model.
        from clinfed.runners.warmstart import warm_start

        public = warm_start(public_phase, task, model, tokenizer, cache_dir, problems, report)
        public = after_saved_start(public, config.model)
    else:
        public = saved_public_start(config.model)
    check = check_record = None
    if config.public_check:
        # The server's judge of each round (clinfed.federated.public_check),
        # on a copy of the starting model: public text, no privacy spent.
        from clinfed.runners.warmstart import public_check

        check, check_record = public_check(config, task, model, tokenizer, cache_dir, problems)
    return public, check, check_record


def _federated_start(
    prep: _Prepared,
    config: RunConfig,
    train: Any,
    test: Any,
    report: Reporter,
    problems: ProblemLog,
    public: dict[str, Any] | None,
    check_record: dict[str, Any] | None,
) -> dict[str, Any]:
    """The sites dealt their data and their privacy checked, the run folder
    written (not on a resume), then the rounds."""
    task, corpus = prep.task, prep.corpus
    sites, test_parts = deal_sites(config, task, corpus, train, test)
    holdout = set_aside(config, task, train, sites)
    sites = {c: holdout[c]["members"] if holdout else idx for c, idx in sites.items()}
    strategy = make_strategy(config, task, prep.tokenizer, prep.cache_dir)
    privacy: dict[str, SitePrivacy] = {}
    for site, idx in sites.items():
        layer = site_privacy(config, task, site, train.select(idx), strategy, _place(config, site))
        if layer is not None:
            privacy[site] = layer
            problems.problems.extend(layer.policy.warnings)
    if privacy and not config.resume:
        _check_round_one({c: layer.policy for c, layer in privacy.items()})
    if not config.resume:
        out = create_run_folder(config.out)
        _write_start(
            out,
            config,
            task,
            corpus,
            "in-process",
            public,
            check_record,
            gazetteer_of(prep.model),
        )
        if holdout:
            atomic_write_json(out / AUDIT_HOLDOUT, holdout_record(config, holdout))
    _loaded(report, train, test, corpus, sites, problems)
    return _federated(prep, config, train, test, sites, test_parts, report, privacy)


def _check_round_one(policies: dict[str, PrivacyPolicy]) -> None:
    """Refuse, before anything is written, a run in which no site can afford
    its first round (it would train nothing and report a random model)."""
    costs = {}
    for site, policy in policies.items():
        mechanisms = policy.round_mechanisms(site)
        ledger = policy.ledger(site)
        if ledger.affords(mechanisms):
            return
        costs[site] = ledger.after(mechanisms)
    site = min(costs, key=costs.get)
    budget = policies[site].budget
    raise ClinfedError(
        f"no site can train round 1 within its privacy budget: one round costs epsilon "
        f"{costs[site]:.3g} at {site}, the cheapest site, against a budget of {budget:g}; "
        "raise `target_epsilon` or `noise_multiplier`, or lower `local_epochs`"
    )


def _site_dir(config: RunConfig, site: str) -> Path:
    """An in-process site's state folder (its model copies and ledger)."""
    return Path(config.out) / "sites" / site


def _place(config: RunConfig, site: str) -> SitePlace:
    """An in-process site: its state folder in the run folder, the run's
    own caps (the node defaults), its count charged with round 1."""
    return SitePlace(_site_dir(config, site))


def _write_start(
    out: Path,
    config: RunConfig,
    task: Task,
    corpus: Corpus,
    runner: str,
    public=None,
    check=None,
    gazetteer: Gazetteer | None = None,
) -> None:
    from clinfed.core.provenance import data_fingerprint

    record = config_record(config, runner)
    if gazetteer is not None:
        record["gazetteer_list"] = gazetteer.describe()
    if public is not None:
        record["public_start"] = public
    if check is not None:
        record["public_check_text"] = check
    if config.data and Path(config.data).is_dir():
        # Which data the run read, without naming a note: SHA-256 over its files.
        record["data_fingerprint"] = data_fingerprint(Path(config.data))
        if (Path(config.data) / SYNTHETIC_MARK).is_file():
            record["synthetic_data"] = True  # clinfed data synth wrote it: no patient's data
    atomic_write_json(out / "config.json", record)
    atomic_write_json(
        out / "labels.json",
        {"labels": task.labels, "sites": corpus.sites, "source": task.label_source},
    )


def _loaded(report, train, test, corpus, sites, problems) -> None:
    report(
        Loaded(
            train=len(train),
            test=len(test),
            sites=sorted(sites) if sites else list(corpus.sites),
            warnings=[str(p) for p in problems.problems],
        )
    )


def _pooled(prep: _Prepared, config: RunConfig, train, test, report: Reporter) -> dict:
    task, model = prep.task, prep.model
    optimizer = make_optimizer(model, config.lr, config.weight_decay, config.head_lr)
    steps = config.epochs * -(-len(train) // config.batch_size)
    scheduler = linear_schedule(optimizer, steps, config.lr_warmup)
    order = np.random.default_rng(config.seed)
    torch.manual_seed(config.seed)
    record: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    outputs: list = []
    for epoch in range(1, config.epochs + 1):
        report(EpochStart(epoch=epoch, examples=len(train)))
        stats = train_epoch(
            model,
            task,
            train,
            optimizer,
            config.batch_size,
            order,
            scheduler,
            on_step=lambda n: report(Step(examples=n)),
            precision=config.precision,
        )
        report(EvalStart(epoch=epoch, examples=len(test)))
        started = time.perf_counter()
        outputs = predict(
            model,
            task,
            test,
            config.eval_batch_size,
            on_step=lambda n: report(EvalStep(examples=n)),
        )
        metrics = task.evaluate(prep.corpus.test, test, outputs)
        record = {
            "epoch": epoch,
            "f1": metrics["f1"],
            "train_loss": stats.loss,
            "train_tokens": stats.tokens,
            "train_seconds": round(stats.seconds, 3),
            "tokens_per_s": round(stats.tokens_per_s, 1),
            "eval_seconds": round(time.perf_counter() - started, 3),
        } | {k: v for k, v in metrics.items() if k not in ("f1", "scores")}
        append_jsonl(prep.out / "metrics.jsonl", record)
        report(EpochEnd(record))
        if not math.isfinite(stats.loss):
            stopped = (
                f"stopped in epoch {epoch}: training diverged (the loss is not finite): lower "
                "--lr or --head-lr"
            )
            return _finish(prep, config, test, outputs, record, {"stopped": stopped})
    return _finish(prep, config, test, outputs, record, {"detail": metrics.get("scores")})


def _federated(
    prep: _Prepared,
    config: RunConfig,
    train,
    test,
    sites: dict[str, np.ndarray],
    test_parts: dict[str, np.ndarray],
    report: Reporter,
    privacy: dict[str, SitePrivacy],
) -> dict:
    """The federated run in this process: the round engine over the
    in-process transport, each site a :class:`SiteRunner`."""
    task, model = prep.task, prep.model
    server_strategy = make_strategy(config, task, prep.tokenizer, prep.cache_dir)
    site_strategy = make_strategy(config, task, prep.tokenizer, prep.cache_dir)
    # The server's state stays on the CPU, whatever device the sites use.
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    shared = {k: initial[k] for k in shared_state(model)}
    runners = {
        site: with_secure_aggregation(
            config,
            build_site(
                config,
                site,
                task,
                model,
                site_strategy,
                (train.select(idx), test.select(test_parts[site]), prep.corpus.test),
                _place(config, site),
                privacy.get(site),
                initial_state=initial,
                report=report,
                audit_dir=prep.out / AUDIT_UPDATES if config.audit_holdout else None,
            ),
            _site_dir(config, site),
        )
        for site, idx in sorted(sites.items())
    }
    engine = RoundEngine(
        task,
        server_strategy,
        shared,
        shared_names(model),
        prep.out,
        config.rounds,
        config.fraction,
        config.seed,
        report=report,
        full_bytes=fedavg_bytes(model),
        summation=summation(config),
        public_check=prep.check,
    )
    if config.resume:
        engine.resume()
        for site, runner in runners.items():
            digest = engine.ledger_digests.get(site)
            if runner.privacy is not None and digest:
                runner.privacy.ledger.verify(digest, f"{prep.out / 'state.json'}")
    torch.manual_seed(config.seed)
    summary = engine.run(InProcessTransport(runners))
    for runner in runners.values():
        runner.finish()
    # The user holds every site's data here: the predictions go in one folder.
    outputs: list = [None] * len(test)
    for site, runner in runners.items():
        for i, output in zip(test_parts[site].tolist(), runner.final_outputs or []):
            outputs[i] = output
    missing = [i for i, o in enumerate(outputs) if o is None]
    if missing:
        load_shared(model, engine.global_state)
        for i, output in zip(missing, predict(model, task, test.select(missing))):
            outputs[i] = output
    load_shared(model, engine.global_state)
    return _finish(prep, config, test, outputs, engine.last_record, summary)
