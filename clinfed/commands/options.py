"""Command-line options generated from the settings schema.

``clinfed train``, ``sweep`` and ``flower run`` take their settings flags
from :mod:`clinfed.settings` (one flag per field, named like it, grouped into
``--help`` panels by concern), so a setting is declared once. Every
generated option defaults to ``None`` (not given); the schema's default is
shown in ``--help`` and applied by :class:`~clinfed.settings.RunConfig`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field
from pathlib import Path
from typing import Any

import click
import typer

from clinfed.core.errors import ClinfedError
from clinfed.settings import (
    PANELS,
    concern_of,
    default_of,
    field_type,
    flatten,
    load_file,
    option_owners,
    schema_fields,
    strategy_option_fields,
    where,
)

# What a newcomer needs to train: shown first by --help; every other setting
# under --help-all (and each is a key of --config all the same).
ESSENTIAL = (
    "task", "data", "model", "strategy", "target_epsilon", "rounds", "out", "resume", "threads",
)  # fmt: skip

# What clinfed warm-start reads: its --help shows these and nothing of train's.
WARM_START = (
    "task", "data", "model", "out", "public_data", "public_types", "public_epochs",
    "public_examples", "public_lr", "types", "format", "max_length", "on_error", "gazetteer",
    "gazetteer_marks", "seed", "threads", "device", "codes", "top_k", "max_chunks", "labels",
)  # fmt: skip


def _help_all(ctx: typer.Context, value: bool) -> None:
    """``--help-all``: the command's help with every setting shown."""
    if not value or ctx.resilient_parsing:
        return
    for param in ctx.command.params:
        param.hidden = False
    typer.echo(ctx.get_help())
    raise typer.Exit()


HELP_ALL = inspect.Parameter(
    "help_all",
    inspect.Parameter.KEYWORD_ONLY,
    default=typer.Option(
        False,
        "--help-all",
        callback=_help_all,
        is_eager=True,
        expose_value=False,
        help="Show every setting, grouped by concern (--help shows the essentials).",
    ),
    annotation=bool,
)


def _registered(name: str) -> list[str] | None:
    """The choices of a setting whose values are a registry's names (the
    strategies, the tasks): real choices for the shell to complete."""
    if name == "strategy":
        from clinfed.federated.strategies import STRATEGIES

        return list(STRATEGIES)
    if name == "task":
        from clinfed.tasks import TASKS

        return list(TASKS)
    return None


def _option(
    name: str, f: Field, panel: str, owners: list[str] | None, hidden: bool = False
) -> inspect.Parameter:
    kind, _ = field_type(f)
    flag = "--" + name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    if kind is int and "maximum" in f.metadata:
        help_text += f" (at most {f.metadata['maximum']:,})"
    elif kind is float and "maximum" in f.metadata:
        help_text += f" (at most {f.metadata['maximum']:g})"
    if owners:
        help_text += f" [{', '.join(owners)}]"
    default = default_of(f)
    show = None if default is None else ("inf" if default == float("inf") else str(default))
    extra: dict[str, Any] = {}
    if name == "labels":
        annotation: Any = Path | None
        extra = {"exists": True, "dir_okay": False}
    elif kind is bool:
        # One flag a setting, never a --x/--no-x pair: it names the change
        # from the default (and fits 80 columns in --help).
        annotation = bool | None
        if default_of(f):
            flag = f"--no-{name.replace('_', '-')}"
            extra = {"flag_value": False}
            show = None
    else:
        annotation = kind | None
        choices = f.metadata.get("choices") or _registered(name)
        # Short metavars leave the flag names their full width at 80 columns
        # (a choice's values go to the end of its help).
        extra["metavar"] = {int: "N", float: "X"}.get(kind, "TEXT")
        if choices is not None:
            help_text += f" (one of: {', '.join(map(str, choices))})"
        if choices is not None:
            extra["click_type"] = click.Choice([str(c) for c in choices])
            annotation = str | None
    option = typer.Option(
        None,
        flag,
        help=help_text,
        rich_help_panel=panel,
        show_default=show or False,
        hidden=hidden,
        **extra,
    )
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
    )


def settings_parameters(
    exclude: Iterable[str] = (),
    simulator: bool = True,
    shown: Iterable[str] | None = None,
    only: Iterable[str] | None = None,
) -> list[inspect.Parameter]:
    """One keyword parameter per setting (``simulator=False``: leave out the
    settings that have no Flower form). ``shown``: the settings ``--help``
    lists, the rest hidden until ``--help-all`` (which is added); ``only``:
    the command takes these settings alone."""
    skip = set(exclude)
    keep = set(only) if only is not None else None
    visible = set(shown) if shown is not None else None
    params = []

    def wanted(name: str) -> bool:
        return name not in skip and (keep is None or name in keep)

    def hidden(name: str) -> bool:
        return visible is not None and name not in visible

    for name, f in schema_fields().items():
        if not wanted(name):
            continue
        if not simulator and f.metadata.get("simulator_only"):
            continue
        params.append(_option(name, f, PANELS[concern_of(name)], None, hidden(name)))
    owners = option_owners()
    for name, f in strategy_option_fields().items():
        if wanted(name):
            panel = PANELS["strategy_options"]
            params.append(_option(name, f, panel, owners[name], hidden(name)))
    return params + ([HELP_ALL] if visible is not None else [])


def with_parameters(
    func: Callable[..., Any], params: list[inspect.Parameter]
) -> Callable[..., Any]:
    """``func`` (taking ``**settings``) with ``params`` appended to its own
    signature, for Typer to read."""
    own = [
        p
        for p in inspect.signature(func).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    hints = dict(getattr(func, "__annotations__", {}))
    func.__signature__ = inspect.Signature(own + params)  # type: ignore[attr-defined]
    func.__annotations__ = hints | {p.name: p.annotation for p in params}
    return func


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings given on the command line (generated options are
    ``None`` when not given)."""
    from clinfed.flower.deploy import read_labels

    found = {}
    for key, value in values.items():
        if value is None or key == HELP_ALL.name:  # --help-all is not a setting
            continue
        if key == "labels":
            value = read_labels(Path(value))
        elif isinstance(value, Path):
            value = str(value)
        found[key] = value
    return found


def merge(config_file: Path | None, flags: dict[str, Any]) -> dict[str, Any]:
    """Settings from ``--config FILE`` with the flags over them. Options the
    file gives for another strategy than the one the flags choose are
    dropped (a run's config.json carries its own strategy's options)."""
    if config_file is None:
        return dict(flags)
    values = flatten(load_file(config_file), str(config_file))
    options = dict(values.pop("strategy_options", {}) or {})
    owners = option_owners()
    chosen = flags.get("strategy")
    if chosen is not None and chosen != values.get("strategy"):
        if Path(config_file).suffix != ".json":
            # A settings file the user wrote: an option it gives for another
            # strategy would silently mean nothing; a run's own config.json
            # carries its strategy's options, dropped when another is chosen.
            for key in options:
                if chosen not in owners.get(key.replace("-", "_"), [chosen]):
                    raise ClinfedError(
                        f"{where(str(config_file), key)}: {key} is an option of "
                        f"{', '.join(owners[key.replace('-', '_')])}, not of --strategy {chosen}"
                    )
        options = {k: v for k, v in options.items() if chosen in owners.get(k, [])}
        values = {k: v for k, v in values.items() if k not in owners or chosen in owners.get(k, [])}
    values = values | flags
    if options:
        values["strategy_options"] = {k: v for k, v in options.items() if k not in flags}
    return values
