"""Shared pieces of the ``clinfed`` command groups: the app, consoles, enums."""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Any

import click
import typer
from rich.console import Console

from clinfed.settings import schema_fields

app = typer.Typer(
    help="Federated training of clinical NLP models with privacy accounting.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

out = Console()
err = Console(stderr=True)
MAX_PROBLEMS_SHOWN = 50


class TaskName(str, Enum):
    i2b2 = "i2b2"
    mimic3 = "mimic3"


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


class BaselineKind(str, Enum):
    dictionary = "dictionary"
    frequency = "frequency"
    keyword = "keyword"


ON_ERROR = typer.Option(
    OnError.strict,
    "--on-error",
    help="strict: report every problem and stop (exit 2); skip: report and leave the bad item out.",
)
CODES = typer.Option(CodeKind.diagnoses, "--codes", help="mimic3: which ICD-9 codes are labels.")
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _warn(problems: list) -> None:
    for problem in problems[:MAX_PROBLEMS_SHOWN]:
        err.print(f"[yellow]warning:[/] {problem}", highlight=False, markup=True, soft_wrap=True)
    if len(problems) > MAX_PROBLEMS_SHOWN:
        err.print(f"[yellow]warning:[/] ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")


# Declared once in clinfed.settings; the data commands share the wording.
FORMAT = typer.Option(
    "auto",
    "--format",
    help=schema_fields()["format"].metadata["help"],
    click_type=click.Choice(["auto", "i2b2", "conll", "brat"]),
)
TYPES = typer.Option(None, "--types", help=schema_fields()["types"].metadata["help"])
