"""Entity types: which a concept-extraction run predicts and how a file's
type names become them.

Three ways, one per situation:

* the **i2b2 2010 preset** (problem, test, treatment): ``.con`` files without
  ``--types``; a name outside it is an error, as in the 2010 release;
* **declared** with ``--types``: ``Disease=problem,Chemical=treatment``
  maps names, ``Disease,Chemical`` keeps them (``NAME`` is ``NAME=NAME``), or
  a TOML file of ``NAME = "TYPE"`` pairs (top level or a ``[types]``
  table). A name the declaration does not list is an error. When every
  target is an i2b2 type, the run predicts the whole preset, so its model is
  interchangeable with i2b2-trained ones;
* **from the data**: CoNLL and BRAT files without ``--types`` keep their own
  names and the run predicts the types of its training split (sorted). That
  needs someone who sees the data: on Flower, where no server does, the
  types must be declared.

A type name is one word (no whitespace, quotes or ``|``), since it is
written into ``.con``, CoNLL tags and BRAT lines.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError, ProblemLog

# The i2b2 2010 concept types (the preset).
CONCEPT_TYPES: tuple[str, ...] = ("problem", "test", "treatment")
OUTSIDE = "O"
_NAME = re.compile(r'[^\s"|=,]+')


def bio_labels(types: Iterable[str]) -> list[str]:
    """``O`` then ``B-T``, ``I-T`` for each type, in order."""
    return [OUTSIDE] + [f"{prefix}-{t}" for t in types for prefix in ("B", "I")]


def types_of(labels: Iterable[str]) -> tuple[str, ...]:
    """The entity types of a BIO label list, in order."""
    return tuple(dict.fromkeys(lab.partition("-")[2] for lab in labels if lab != OUTSIDE))


def run_types(found: Iterable[str]) -> tuple[str, ...]:
    """The types a run predicts given the names it maps to: the i2b2 preset
    when they all belong to it, else the names in order."""
    names = tuple(dict.fromkeys(found))
    return CONCEPT_TYPES if set(names) <= set(CONCEPT_TYPES) else names


@dataclass(frozen=True)
class TypeNames:
    """How a file's entity type names become the run's types.

    Parameters
    ----------
    mapping
        The declared map (``--types``); ``None`` when nothing was declared.
    open
        With no map: keep every name as a type of its own (CoNLL and BRAT;
        the run's types then come from the data). Closed, a name must be
        an i2b2 2010 type.
    """

    mapping: Mapping[str, str] | None = None
    open: bool = False

    def resolve(self, name: str, path: Path, line: int | None, problems: ProblemLog) -> str | None:
        """The run's type for ``name``, or ``None`` after reporting it."""
        if self.mapping is not None:
            if name in self.mapping:
                return self.mapping[name]
            # The line, never the value: an annotation file's text is the
            # note's neighbourhood, and errors reach logs and servers.
            problems.add(path, line, "the entity type on this line is not in --types")
            return None
        if self.open or name in CONCEPT_TYPES:
            return name
        problems.add(
            path,
            line,
            f"the entity type on this line is not one of {', '.join(CONCEPT_TYPES)}; declare it "
            "with --types (NAME=problem maps it, NAME keeps it)",
        )
        return None


PRESET = TypeNames()


def parse_types(spec: str | Mapping[str, str] | None) -> dict[str, str] | None:
    """``Disease=problem,Chemical`` or a ``.toml`` file path (or a mapping
    from a config file) -> ``{"Disease": "problem", "Chemical": "Chemical"}``."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, Mapping):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    elif str(spec).endswith(".toml"):
        import tomllib

        from clinfed.core.runs import read_user_file

        path = Path(spec)
        try:
            table = tomllib.loads(read_user_file(path, f"`types` {path}"))
        except tomllib.TOMLDecodeError as exc:
            raise ClinfedError(f"`types` {path}: not TOML ({exc})") from None
        table = table.get("types", table)
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise ClinfedError(f'`types` {path}: expected NAME = "TYPE" pairs')
        pairs = list(table.items())
    else:
        pairs = []
        for item in str(spec).split(","):
            source, eq, target = (part.strip() for part in item.partition("="))
            pairs.append((source, target if eq else source))
    mapped: dict[str, str] = {}
    for source, target in pairs:
        for name in (source, target):
            if not _NAME.fullmatch(name):
                raise ClinfedError(
                    f"`types` {spec}: {name!r} is not a type name (one word; expected "
                    "NAME=TYPE,NAME or a .toml file)"
                )
        if target == OUTSIDE:
            raise ClinfedError(f"`types` {spec}: 'O' is the outside tag, not a type")
        mapped[source] = target
    return mapped


def parse_annotated(value: Any) -> dict[str, list[str]]:
    """``{site: [type, ...]}`` from a mapping or ``beth=problem,test;partners=problem``."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return {str(k): [str(t) for t in v] for k, v in value.items()}
    parsed: dict[str, list[str]] = {}
    for part in str(value).split(";"):
        site, sep, types = part.partition("=")
        if not sep or not site.strip():
            raise ClinfedError(
                f"`annotated_types`: {part.strip()!r} is not SITE=TYPE,TYPE "
                "(e.g. beth=problem,test;partners=problem)"
            )
        parsed[site.strip()] = [t.strip() for t in types.split(",") if t.strip()]
    return parsed
