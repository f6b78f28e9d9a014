"""clinfed as a library: train, evaluate, predict and report from Python.

The same work as the ``clinfed`` command, without its printing: each
function returns what the command would show. Library progress bars and
chatter stay quiet, temporary files (tokenized notes) live in a private
folder removed when the call returns, and errors name settings as
keyword arguments (``target_epsilon``), not flags.

Examples
--------
>>> import clinfed
>>> clinfed.synthesize("data", sites=3, docs=8)                  # doctest: +SKIP
>>> summary = clinfed.train("data", "run", strategy="safl", top_layers=2,
...                         rounds=3, target_epsilon=8.0)        # doctest: +SKIP
>>> summary["f1"], summary["epsilon"]                            # doctest: +SKIP
>>> clinfed.report("run")                                        # doctest: +SKIP
PosixPath('run/report/report.html')
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.core.events import as_pairs, silent
from clinfed.privacy.errors import PrivacyError


@contextlib.contextmanager
def _library_call() -> Iterator[None]:
    """Quiet libraries, a private scratch folder, one error type."""
    from clinfed.core.quiet import quiet_libraries
    from clinfed.core.scratch import private_scratch

    quiet_libraries()
    try:
        with private_scratch():
            yield
    except PrivacyError as exc:
        # One error type for a caller to catch; the words unchanged (library
        # errors name settings as keywords already: `target_epsilon`).
        raise ClinfedError(str(exc)) from None


def train(
    data: str | Path,
    out: str | Path,
    *,
    task: str = "i2b2",
    strategy: str = "fedavg",
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """Train on a data folder and write a new run folder.

    Parameters
    ----------
    data
        The data folder (i2b2 text/concept folders, CoNLL, BRAT, or MIMIC-III
        CSVs), with one folder per site for a federated run.
    out
        The new run folder.
    task, strategy
        As ``--task`` and ``--strategy``.
    on_event
        Called with each progress event as ``(name, info)`` (``round_end`` and
        its record, ``site_end``, ...; :mod:`clinfed.core.events` lists them).
    **settings
        Any other setting of ``clinfed train``, by its name with underscores
        (``rounds=5``, ``target_epsilon=8.0``, ``top_layers=2``,
        ``secure_aggregation=True``).

    Returns
    -------
    dict
        The run's summary (also ``out/summary.json``): ``f1``, and for a
        federated run the MB sent, ``epsilon`` per site, ``stopped`` when it
        stopped early.
    """
    with _library_call():
        from clinfed.runners.pipeline import RunConfig, run_training

        config = RunConfig.of(
            data=str(data), out=str(out), task=task, strategy=strategy, **settings
        )
        return run_training(config, as_pairs(on_event) if on_event else silent)


def evaluate(run: str | Path, data: str | Path) -> dict[str, Any]:
    """Score a finished run's model on a folder of annotated data; the
    metrics (``f1`` and the task's others)."""
    with _library_call():
        from clinfed.runners.inference import evaluate_run

        return evaluate_run(Path(run), Path(data))


def predict(run: str | Path, data: str | Path, out: str | Path) -> int:
    """Write a finished run's predictions for ``data`` to the new folder
    ``out`` in the task's format (i2b2 ``.con``, MIMIC-III CSV); returns how
    many records were predicted."""
    with _library_call():
        from clinfed.runners.inference import predict_run

        return predict_run(Path(run), Path(data), Path(out))


def report(run: str | Path, reference: str | Path | None = None) -> Path:
    """Write ``run/report/`` (HTML, Markdown, JSON) and return the HTML
    page's path. ``reference``: the same run without DP, for the F1 plot."""
    with _library_call():
        from clinfed.reporting.report import write_report

        folder = write_report(Path(run), Path(reference) if reference else None)
        return folder / "report.html"


def synthesize(
    out: str | Path, task: str = "i2b2", sites: int = 3, docs: int = 40, seed: int = 0
) -> Path:
    """Write a synthetic multi-site corpus in the task's real format
    (never real patients); returns ``out``."""
    from clinfed.tasks import TASKS

    with _library_call():
        if task not in TASKS:
            raise ClinfedError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
        TASKS[task].synthesize(Path(out), sites=sites, docs=docs, seed=seed)
        return Path(out)


def warm_start(
    public_data: str | Path, out: str | Path, *, task: str = "i2b2", **settings: Any
) -> dict[str, Any]:
    """Train a starting model on public text alone and save it to the new
    folder ``out`` (no site's data, no privacy spent); runs start from it
    with ``model=out``. Returns the warm start's record. ``settings``: as
    ``clinfed warm-start``'s (``model``, ``public_types``, ``gazetteer``,
    ``public_epochs``, ``data`` to check the public text is not private)."""
    with _library_call():
        from clinfed.runners.warmstart import warm_start_model
        from clinfed.settings import RunConfig

        config = RunConfig.of(
            public_data=str(public_data), out=str(out), task=task,
            data=str(settings.pop("data", "") or ""), **settings,
        )  # fmt: skip
        return warm_start_model(config)


def export(run: str | Path, out: str | Path) -> dict[str, Any]:
    """Write a finished concept-extraction run's model to the new folder
    ``out`` as a plain transformers model, with its model card and privacy
    report; returns what ``out/clinfed-export.json`` says."""
    with _library_call():
        from clinfed.runners.exporter import export_run

        return export_run(Path(run), Path(out))


def audit(
    run: str | Path, max_examples: int = 400, threads: int | None = None, device: str = "auto"
) -> dict[str, Any]:
    """Membership inference against a finished run trained with
    ``audit_holdout``; writes and returns ``run/audit.json`` (``threads``
    default the run's own, ``device`` as ``train``'s)."""
    with _library_call():
        from clinfed.runners.audit import audit as run_audit

        return run_audit(Path(run), max_examples, threads=threads, device=device)


def plan(
    units: list[int] | dict[str, int],
    epsilons: tuple[float, ...] = (1.0, 4.0, 8.0),
    **settings: Any,
) -> list[dict[str, Any]]:
    """What each budget buys before any is spent: per budget and site, the
    batch, steps, noise multiplier and epsilon after each round, from the
    sites' sizes alone (``units``: a count per site) and the run's
    ``settings`` (``rounds``, ``neighbours``, ``privacy_unit`` ...)."""
    with _library_call():
        from clinfed.runners.forecast import noise_plan
        from clinfed.settings import RunConfig

        sizes = units if isinstance(units, dict) else {
            f"site{i}": int(n) for i, n in enumerate(units, start=1)
        }  # fmt: skip
        config = RunConfig.of(data="(none)", out="plan", **settings)
        return noise_plan(config, dict(sizes), list(epsilons))
