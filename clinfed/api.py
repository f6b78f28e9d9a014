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
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clinfed.errors import USER_ERRORS, ClinfedError, worded

_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")


def _as_setting(match: re.Match) -> str:
    return match.group(1).replace("-", "_")


@contextlib.contextmanager
def _library_call() -> Iterator[None]:
    """Quiet libraries, a private scratch folder, errors in settings' names."""
    from clinfed.quiet import quiet_libraries
    from clinfed.scratch import private_scratch

    quiet_libraries()
    try:
        with private_scratch():
            yield
    except USER_ERRORS as exc:
        raise ClinfedError(_FLAG.sub(_as_setting, worded(exc, flags=False))) from None


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
        Called with each progress event (``round_end``, ``site_end``, ...).
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
        from clinfed.pipeline import RunConfig, run_training

        config = RunConfig.of(
            data=str(data), out=str(out), task=task, strategy=strategy, **settings
        )
        return run_training(config, on_event or (lambda event, info: None))


def evaluate(run: str | Path, data: str | Path) -> dict[str, Any]:
    """Score a finished run's model on a folder of annotated data; the
    metrics (``f1`` and the task's others)."""
    with _library_call():
        from clinfed.inference import evaluate_run

        return evaluate_run(Path(run), Path(data))


def predict(run: str | Path, data: str | Path, out: str | Path) -> int:
    """Write a finished run's predictions for ``data`` to the new folder
    ``out`` in the task's format (i2b2 ``.con``, MIMIC-III CSV); returns how
    many records were predicted."""
    with _library_call():
        from clinfed.inference import predict_run

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
