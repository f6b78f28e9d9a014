"""The schema's building block: one declared setting.

Every setting of a run (``clinfed.settings``), of a strategy (its options
dataclass) and of a task (``tasks/<name>/options.py``) is a dataclass field
made by :func:`setting`; the command line, the config file, ``config.json``
and Flower's run config are all generated from those fields.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def setting(default: Any = None, help: str = "", **meta: Any) -> Any:  # noqa: A002
    """A field of the schema.

    ``meta`` may hold ``choices`` (allowed values), ``minimum`` / ``maximum``
    (inclusive bounds), ``above`` (exclusive lower bound), ``allow_inf``
    (``inf`` is a meaningful value), ``simulator_only`` (no Flower form) and
    ``resumable`` (``--resume`` may change it: it does not change results).
    """
    if isinstance(default, (list, dict)):
        return field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **meta}
        )
    return field(default=default, metadata={"help": help, **meta})


def strict_bool(value: Any, where: str) -> bool:
    """A boolean setting read strictly: a boolean, 1 or 0, or the words
    true/false/1/0 in any case; anything else (an empty value included) is
    refused by ``where``'s name, never read as truthy or as the default."""
    from clinfed.core.errors import ClinfedError

    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    raise ClinfedError(f"{where} must be true or false (or 1 or 0), not {value!r}")
