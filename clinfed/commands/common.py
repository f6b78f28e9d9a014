"""Shared pieces of the ``clinfed`` command groups: the app, consoles, enums."""

from __future__ import annotations

import json
import logging
import math
import sys
from enum import Enum
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape

from clinfed.settings import schema_fields
from clinfed.tasks import TASKS, task_baselines

app = typer.Typer(
    help="Federated training of clinical NLP models with privacy accounting.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)

# Lines are never wrapped by clinfed (a terminal wraps them itself; a log
# file keeps one line per event). Tables still fit the width.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
MAX_PROBLEMS_SHOWN = 50
log = logging.getLogger("clinfed")


class _PlainFormatter(logging.Formatter):
    """One line per event for logs that are not a terminal: a timestamp,
    the level when it is not INFO, no markup, never wrapped."""

    def format(self, record: logging.LogRecord) -> str:
        from rich.text import Text

        message = Text.from_markup(record.getMessage()).plain.replace("\n", " ")
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"{self.formatTime(record, '%Y-%m-%d %H:%M:%S')} {level}{message}"


class _TerminalFormatter(logging.Formatter):
    """Warnings and errors say so in colour; rich adds the time."""

    def format(self, record: logging.LogRecord) -> str:
        message = escape(record.getMessage())  # brackets in a path are text
        if record.levelno >= logging.ERROR:
            return f"[red]error:[/] {message}"
        if record.levelno >= logging.WARNING:
            return f"[yellow]warning:[/] {message}"
        return message


def setup_logging(verbosity: int) -> None:
    """clinfed's event lines through ``logging``: ``-1`` quiet (warnings and
    errors only), ``0`` events, ``1`` also debug lines and library logs.
    In a terminal they print above the progress bars; otherwise one
    timestamped line per event."""
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    for handler in list(log.handlers):
        log.removeHandler(handler)
    if err.is_terminal:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(
            console=err,
            show_path=False,
            show_level=False,
            markup=True,
            log_time_format="[%X]",
        )
        handler.setFormatter(_TerminalFormatter())
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PlainFormatter())
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    if verbosity > 0:
        logging.basicConfig(level=logging.DEBUG)


def progress_disabled() -> bool:
    """No live bars when quiet or when stderr is not a terminal."""
    return log.getEffectiveLevel() > logging.INFO or not err.is_terminal


# The task names and baselines, from the task registry (clinfed.tasks.TASKS).
TaskName = Enum("TaskName", {name: name for name in TASKS}, type=str)
TASK_HELP = f"The task: {', '.join(TASKS)}."


class OnError(str, Enum):
    strict = "strict"
    skip = "skip"


class CodeKind(str, Enum):
    diagnoses = "diagnoses"
    procedures = "procedures"
    both = "both"


class Heterogeneity(str, Enum):
    normal = "normal"
    strong = "strong"


BaselineKind = Enum(
    "BaselineKind",
    {kind: kind for kinds in task_baselines().values() for kind in kinds},
    type=str,
)
BASELINE_HELP = "; ".join(
    f"{name}: {' or '.join(kinds)}" for name, kinds in task_baselines().items() if kinds
)


ON_ERROR = typer.Option(
    OnError.strict,
    "--on-error",
    help="strict: report every problem and stop (exit 2); skip: report and leave the bad item out.",
)
CODES = typer.Option(CodeKind.diagnoses, "--codes", help="mimic3: which ICD-9 codes are labels.")
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")
# --config on the commands that take run settings (train's own says more).
SETTINGS_FILE = typer.Option(
    None,
    "--config",
    help="Settings file (as for clinfed train); the flags override it.",
    exists=True,
    dir_okay=False,
)


def _finite(obj: Any) -> Any:
    """JSON has no infinity: inf and NaN print as the strings "inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _print_json(obj: Any) -> None:
    text = json.dumps(_finite(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
    sys.stdout.write(text + "\n")


def _warn(problems: list) -> None:
    from rich.markup import escape

    for problem in problems[:MAX_PROBLEMS_SHOWN]:
        log.warning(escape(str(problem)))
    if len(problems) > MAX_PROBLEMS_SHOWN:
        log.warning(f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more")


# Declared once in clinfed.settings; the data commands share the wording.
FORMAT = typer.Option(
    "auto",
    "--format",
    help=schema_fields()["format"].metadata["help"],
    click_type=click.Choice(["auto", "i2b2", "conll", "brat"]),
)
TYPES = typer.Option(None, "--types", help=schema_fields()["types"].metadata["help"])


def _version(value: bool) -> None:
    if value:
        from clinfed.core.provenance import versions

        found = versions()
        libraries = ", ".join(f"{k} {found[k]}" for k in ("torch", "opacus", "flwr", "python"))
        out.print(f"clinfed {found['clinfed']} ({libraries})", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print clinfed's version (and torch, opacus, flwr, python) and exit.",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Warnings and errors only: no progress, no event lines."
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Debug lines too, and the libraries' own logs."
    ),
) -> None:
    """Federated training of clinical NLP models with privacy accounting."""
    del version
    setup_logging(-1 if quiet else 1 if verbose else 0)
