"""Reading settings: a value checked against its field, a settings file
(TOML or a run's ``config.json``) with the line each key stands on."""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.settings.concerns import CONCERNS, METADATA_KEYS

# Per settings file read, the line each key stands on (errors name it).
_KEY_LINES: dict[str, dict[str, int]] = {}
_KEY = re.compile(r"""^\s*["']?([A-Za-z0-9_-]+)["']?\s*=""")


def where(source: str, key: str) -> str:
    """``source`` with the line ``key`` stands on, when ``source`` is a
    settings file that holds it (``run.toml:7``)."""
    line = _KEY_LINES.get(source, {}).get(key.replace("-", "_"))
    return f"{source}:{line}" if line else source


def unknown_key(key: str, source: str, names: list[str]) -> ClinfedError:
    """An unknown setting's one line, with the closest of ``names``."""
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ClinfedError(f"{where(source, key)}: unknown setting {key!r}{hint}")


# Settings renamed since a run folder may have been written: read as today's.
RENAMED = {"clients": "sites"}


def flatten(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Concern tables merged into one level; metadata keys dropped; a
    renamed setting (:data:`RENAMED`) read under its name today."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in METADATA_KEYS:
            continue
        if key in CONCERNS and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                inner = RENAMED.get(inner, inner)
                if inner in flat:
                    raise ClinfedError(f"{source}: setting {inner!r} given twice")
                flat[inner] = inner_value
        elif key == "strategy_options":
            if not isinstance(value, Mapping):
                raise ClinfedError(f"{source}: strategy_options must be a table")
            flat.setdefault("strategy_options", {}).update(value)
        else:
            key = RENAMED.get(key, key)
            if key in flat:
                raise ClinfedError(f"{source}: setting {key!r} given twice")
            flat[key] = value
    return flat


def field_type(f: Field) -> tuple[type, bool]:
    """The base type of a field and whether ``None`` is allowed."""
    hint = typing.get_type_hints(_owner(f))[f.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    return (origin or hint), optional


def _owner(f: Field) -> type:
    from clinfed.federated.strategies import STRATEGIES

    for cls in (*CONCERNS.values(), *(s.options for s in STRATEGIES.values())):
        if any(g is f for g in fields(cls)):
            return cls
    raise KeyError(f.name)


def check_value(f: Field, value: Any, source: str) -> Any:
    """``value`` checked against the field's type (strictly: no bool for an
    int, no float for an int) and bounds; returned normalised."""
    kind, optional = field_type(f)
    named = (
        f"`{f.name}`" if source in ("flags", "settings") else f"{where(source, f.name)}: {f.name}"
    )
    if value is None:
        if optional:
            return None
        raise ClinfedError(f"{named}: a value is required")
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
            value = math.inf
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        if isinstance(value, int) and not isinstance(value, bool) and f.metadata.get("int_ok"):
            value = str(value)
        ok = isinstance(value, str)
    elif kind is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:  # pragma: no cover - the schema has no other types
        ok = True
    if not ok:
        expected = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "text",
            list: "a list of text",
        }[kind]
        raise ClinfedError(f"{named}: expected {expected}, got {value!r}")
    check_bounds(f, value, named)
    return value


def check_bounds(f: Field, value: Any, where: str | None = None) -> None:
    if value is None:
        return
    meta = f.metadata
    where = where or f"`{f.name}`"
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not meta.get("allow_inf")):
            raise ClinfedError(f"{where} must be a finite number, not {value}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ClinfedError(f"{where} must be one of {', '.join(map(str, choices))}, not {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in meta and value < meta["minimum"]:
            raise ClinfedError(f"{where} must be at least {meta['minimum']}, not {value}")
        if "maximum" in meta and "above" in meta and not meta["above"] < value <= meta["maximum"]:
            raise ClinfedError(
                f"{where} must be in ({meta['above']:g}, {meta['maximum']:g}], not {value}"
            )
        if "below" in meta and "above" in meta and not meta["above"] < value < meta["below"]:
            raise ClinfedError(
                f"{where} must be in ({meta['above']:g}, {meta['below']:g}), not {value}"
            )
        if "maximum" in meta and value > meta["maximum"]:
            raise ClinfedError(f"{where} must be at most {meta['maximum']}, not {value}")
        if "above" in meta and not value > meta["above"]:
            if meta["above"] == 0:
                raise ClinfedError(f"{where} must be positive, not {value}")
            raise ClinfedError(f"{where} must be above {meta['above']}, not {value}")
        if "below" in meta and not value < meta["below"]:
            raise ClinfedError(f"{where} must be below {meta['below']}, not {value}")


def load_file(path: Path) -> dict[str, Any]:
    """Settings from a TOML file or a run's ``config.json``."""
    import json

    import tomllib

    from clinfed.core.runs import read_user_file

    path = Path(path)
    # utf-8-sig: a byte-order mark (some Windows editors write one) is not a
    # setting, as data files accept it too.
    text = read_user_file(path, str(path), encoding="utf-8-sig")
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise ClinfedError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except tomllib.TOMLDecodeError as exc:
        # Python 3.11's message ends "(at line L, column C)": the line leads.
        found = re.search(r"\(at line (\d+), column \d+\)$", str(exc))
        at = f":{found.group(1)}" if found else ""
        reason = str(exc)[: found.start()].strip() if found else str(exc)
        raise ClinfedError(f"{path}{at}: not valid TOML ({reason})") from None
    if path.suffix != ".json":
        lines: dict[str, int] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            found = _KEY.match(raw)
            if found:
                lines.setdefault(found.group(1).replace("-", "_"), number)
        _KEY_LINES[str(path)] = lines
    if not isinstance(data, dict):
        raise ClinfedError(f"{path}: expected a table of settings")
    return data


def default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None
