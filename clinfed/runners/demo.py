"""``clinfed demo``: the product's main job on synthetic data, in one call.

Several hospitals (a synthetic i2b2 corpus, one folder of notes per
site) train one model federated, each keeping its notes, under DP with a
target epsilon a privacy officer would accept; each site keeps a ledger;
the run is audited (membership inference) and reported. The same run
without DP is the reference its F1 is compared with.

The recipe (:data:`PLAN`) was chosen by measurement (benchmarks/results/NOTEBOOK.md, "The demo"
and "Private models"): a public warm start (on public notes of the same
kind, :data:`PUBLIC`), then bias terms and the head only, under add/remove
accounting, against SAFL + FedFrozen and LoRA.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.core.events import Reporter, silent

# The private run's settings (the reference run differs only in having no
# DP), common to every plan, then each plan's own. See the module docstring.
COMMON: dict[str, Any] = {
    "task": "i2b2",
    "rounds": 3,
    "max_length": 64,
    "target_epsilon": 8.0,
    "delta": 1e-5,
    "audit_holdout": 0.1,
    # The head's rate. Set when the head started random (before the warm
    # start): at 1e-3 the private F1 fell round over round, at 1e-2 it rose.
    # From the public notes' start the head comes trained and 1e-3 measured
    # the same (two draws each, within a few spans); from PubMed the head
    # still has to learn `test`, so 1e-2 stays. benchmarks/results/NOTEBOOK.md, "The demo".
    "head_lr": 1e-2,
    # Public warm start (clinfed.runners.warmstart): before round 1 the starting
    # model trains on 2,000 sentences of public annotated text (PUBLIC). No
    # hospital's data, no privacy spent; the reference run starts from the
    # same model.
    "public_examples": 2000,
    # Each hospital releases its sentence count once, under accounted noise,
    # and is accounted under add/remove neighbours (clinfed.privacy.count):
    # 23% less noise at epsilon 8 here, private F1 0.593 -> 0.636.
    "neighbours": "add-remove",
    # The synthetic hospitals annotate every type, and say so: under DP a
    # site's annotated types are declared, never read from its data.
    "annotated_types": "*=problem,treatment,test",
}
PLANS: dict[str, dict[str, Any]] = {
    # SAFL's two best layers, their attention query/key frozen from round 2.
    "safl+fedfrozen": {
        "strategy": "safl+fedfrozen",
        "top_layers": 2,
        "freeze_from": "2",
        "local_epochs": 1,
    },
    # FedAvg of the encoder's bias terms and the head only (BitFit), three
    # local epochs. After the warm start, the best private model measured on
    # the demo's corpus (0.593 against 0.487 for SAFL + FedFrozen at epsilon
    # 8, replace-one; benchmarks/results/NOTEBOOK.md, "Private models").
    "bias": {"strategy": "fedavg", "adapter": "bias", "local_epochs": 3},
}
DEFAULT_PLAN = "bias"
# The public text the starting model trains on. notes: synthetic notes from
# the generator at another seed (other patients, the same kind of notes):
# what a hospital has in a public annotated clinical corpus such as the
# i2b2/n2c2 releases; measured private F1 0.953 against 0.959 without DP
# (the start alone 0.925). pubmed: the PubMed text shipped in clinfed/public
# (NCBI disease; BioNLP's ID, CG and PC chemicals: public/SOURCES.md),
# diseases as problems and chemicals as treatments, text unlike the notes
# and no test spans. Measured when it held BC5CDR and NCBI disease instead:
# private F1 0.620 against 0.797 (benchmarks/results/NOTEBOOK.md, "The demo").
PUBLIC: dict[str, dict[str, Any]] = {
    "notes": {"public_types": None},
    "pubmed": {
        "public_data": str(Path(__file__).resolve().parents[1] / "public"),
        "public_types": "Disease=problem,Chemical=treatment,Simple_chemical=treatment",
    },
}
DEFAULT_PUBLIC = "notes"
PUBLIC_SEED = 7
# With public notes the server also scores each round's proposed model on
# public notes of yet other patients (the generator at this seed, as many
# hospitals and notes as the sites: every hospital's style, about 2,500
# sentences) and keeps the last model unless the proposal is better there than
# chance (--public-check, clinfed.federated.public_check): after round 1 the
# noise outweighs what is left to learn. Not falling in twelve of twelve draws
# of the private run; three of eleven without the check, twelve of fourteen
# with F1 alone on one hospital's notes (benchmarks/results/NOTEBOOK.md, "The demo").
CHECK_SEED = 8
PLAN = COMMON | PLANS[DEFAULT_PLAN]
SITES, DOCS, SEED = 3, 30, 0


def _train_beside(config: Any, results: Any) -> None:
    """One run in a process of its own, its outcome sent back on ``results``
    (no progress events cross over)."""
    from clinfed.core.quiet import quiet_libraries
    from clinfed.runners.pipeline import run_training

    # A spawned process starts with the libraries' defaults: without this the
    # reference run prints datasets' per-map progress bars into the demo's output.
    quiet_libraries()
    try:
        results.send(("done", run_training(config)))
    except BaseException as error:  # the parent raises it
        results.send(("failed", error))


def private_and_reference(
    private: Any,
    reference: Any,
    threads: int,
    on_step: Callable[[str], None],
    on_event: Reporter,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The private run and its reference, side by side where there are two
    cores or more (half the threads each, the reference in a second process:
    small batches keep a second thread half idle, so two runs on one thread
    each finish sooner than one after the other on two), else in turn."""
    import os
    import signal
    import threading
    from dataclasses import replace

    from clinfed.runners.pipeline import run_training

    cores = threads or os.cpu_count() or 1
    title = (
        f"training {private.strategy} under DP (epsilon {private.target_epsilon:g} per "
        f"hospital), {private.rounds} rounds"
    )
    if cores < 2:
        on_step(title)
        done = run_training(private, on_event)
        on_step("training the same run without DP (the reference)")
        return done, run_training(reference, on_event)
    import multiprocessing

    each = cores // 2
    # spawn, not fork: a forked copy of a process that already ran torch's
    # thread pools can hang.
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    beside = context.Process(
        target=_train_beside, args=(replace(reference, threads=each), sender), daemon=True
    )
    # The second process ignores Ctrl-C (a spawned process keeps an ignored
    # SIGINT) and this one stops it: one clean interrupt, not two tracebacks.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        beside.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    sender.close()
    try:
        on_step(f"{title}; beside it the same run without DP (the reference)")
        done = run_training(replace(private, threads=each), on_event)
        if not receiver.poll():
            on_step("waiting for the reference run")
        try:
            outcome, value = receiver.recv()
        except EOFError:
            beside.join()
            raise RuntimeError(
                f"the reference run's process ended without a result (exit {beside.exitcode})"
            ) from None
    finally:
        if beside.is_alive():
            beside.terminate()
        beside.join()
    if outcome == "failed":
        raise value
    return done, value


def run_demo(
    out: Path,
    model: str = "minilm",
    docs: int = DOCS,
    rounds: int | None = None,
    threads: int = 0,
    plan: str = DEFAULT_PLAN,
    public: str = DEFAULT_PUBLIC,
    on_step: Callable[[str], None] = lambda text: None,
    on_event: Reporter = silent,
) -> dict[str, Any]:
    """Corpus, private run, reference run, audit and report under ``out``
    (a new folder); returns the summary the command prints (also
    ``out/demo.json``)."""
    from clinfed.core.device import use_threads
    from clinfed.core.runs import atomic_write_json
    from clinfed.reporting.report import write_report
    from clinfed.runners.audit import audit
    from clinfed.runners.warmstart import warm_start_model
    from clinfed.settings import RunConfig

    out = Path(out)
    settings = _checked_settings(out, model, docs, rounds, threads, plan, public)
    started = time.perf_counter()
    data = out / "data"
    _write_corpora(out, data, docs, public, settings, on_step)
    private_dir, reference_dir = out / "private", out / "no-dp"
    # The warm start is paid once: both runs start from the saved model.
    start = out / "start"
    on_step(
        f"training the starting model on {settings['public_examples']:,} public examples "
        "(no hospital's data, no privacy spent)"
    )
    warm_start_model(RunConfig.of(data=str(data), out=str(start), **settings), on_event)
    # What the public text alone is worth: the private phase is measured against it.
    from clinfed.runners.inference import evaluate_run

    start_f1 = evaluate_run(start, data / "test")["f1"]
    settings = {k: v for k, v in settings.items() if not k.startswith("public_")}
    settings["model"] = str(start)
    if public == "notes":
        settings["public_check"] = str(out / "public-check")
    reference_settings = {k: v for k, v in settings.items() if k not in ("target_epsilon",)}
    private_config = RunConfig.of(data=str(data), out=str(private_dir), **settings)
    reference_config = RunConfig.of(data=str(data), out=str(reference_dir), **reference_settings)
    private, reference = private_and_reference(
        private_config, reference_config, threads, on_step, on_event
    )
    # The side-by-side runs left this process on half the threads.
    use_threads(threads)
    on_step("auditing the private model (membership inference)")
    attack = audit(private_dir)
    on_step("writing the privacy report")
    page = write_report(private_dir, reference_dir) / "report.html"
    summary = _summary(plan, model, docs, public, settings, str(start), start_f1)
    summary |= {
        "f1_private": private["f1"],
        "f1_no_dp": reference["f1"],
        "epsilon": private.get("epsilon", {}),
        "mb_up": private["mb_up"],
        "fedavg_mb_up": private["fedavg_mb_up"],
        "ratio_to_fedavg_up": private["ratio_to_fedavg_up"],
        "audit_auc": attack["final_model"]["loss_threshold"]["auc"],
        "report": str(page),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if private.get("stopped"):
        summary["stopped"] = private["stopped"]
    atomic_write_json(out / "demo.json", summary)
    (out / "README.txt").write_text(README)
    return summary


README = (
    "clinfed demo: data/ (synthetic notes of 3 hospitals), public/ (with --public notes: "
    "public synthetic notes of other patients; public-check/ more of them, which the server "
    "scores each round's model on), start/ (the starting model, "
    "trained on public text before round 1), private/ (the run under DP: "
    "model, ledgers in private/privacy/, report in private/report/report.html), no-dp/ "
    "(the same run without DP, for reference), demo.json (the summary).\n"
)


def _checked_settings(
    out: Path, model: str, docs: int, rounds: int | None, threads: int, plan: str, public: str
) -> dict[str, Any]:
    """The demo's run settings, every one checked before anything is written:
    a refused demo leaves no partial folder behind, so the same --out works
    next time."""
    from clinfed.core.runs import ensure_new_run_folder
    from clinfed.modeling.models import checkpoint_dir
    from clinfed.settings import RunConfig

    ensure_new_run_folder(out, "demo folder")
    if docs < 2:
        raise ClinfedError(f"`docs` must be at least 2, not {docs}")
    if plan not in PLANS:
        raise ClinfedError(f"`plan` must be one of {', '.join(PLANS)}, not {plan!r}")
    if public not in PUBLIC:
        raise ClinfedError(f"`public` must be one of {', '.join(PUBLIC)}, not {public!r}")
    checkpoint_dir(model)
    settings = COMMON | PLANS[plan] | PUBLIC[public]
    settings |= {"model": model, "threads": threads, "seed": SEED}
    if rounds is not None:
        settings["rounds"] = rounds
    RunConfig.of(**settings).validate(check_data=False)
    return settings


def _write_corpora(
    out: Path,
    data: Path,
    docs: int,
    public: str,
    settings: dict[str, Any],
    on_step: Callable[[str], None],
) -> None:
    """The hospitals' synthetic notes, and with ``--public notes`` public
    notes of other patients to start from and to check each round on."""
    from clinfed.tasks import TASKS

    generate = TASKS[COMMON["task"]].synthesize
    on_step(f"writing a synthetic corpus: {SITES} hospitals x {docs} notes")
    generate(data, sites=SITES, docs=docs, seed=SEED)
    if public == "notes":
        on_step(f"writing public notes: the generator at seed {PUBLIC_SEED} (other patients)")
        generate(out / "public", sites=SITES, docs=docs, seed=PUBLIC_SEED)
        settings["public_data"] = str(out / "public")
        on_step(f"writing public notes the server checks each round on: seed {CHECK_SEED}")
        generate(out / "public-check", sites=SITES, docs=docs, seed=CHECK_SEED)


def _summary(
    plan: str,
    model: str,
    docs: int,
    public: str,
    settings: dict[str, Any],
    start: str,
    start_f1: float,
) -> dict[str, Any]:
    """The demo's plan, as its summary begins."""
    return {
        "plan": plan,
        "strategy": settings["strategy"],
        "model": model,
        "starting_model": start,
        "sites": SITES,
        "docs_per_site": docs,
        "rounds": settings["rounds"],
        "target_epsilon": settings["target_epsilon"],
        "delta": settings["delta"],
        "public": public,
        "f1_start": start_f1,
    }
