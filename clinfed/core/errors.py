"""Errors a user can fix, and the collector that readers report problems to.

Every message names a file and a line (or column) and never quotes note text:
clinical text is protected health information, so readers describe *what* is
wrong (an offset past the line, a type nobody knows) and never *what it said*.
The CLI prints these on one line each and exits with status 2.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from clinfed.privacy.errors import PrivacyError, SettingError  # noqa: F401 (re-exported)

EXIT_USAGE = 2


class ClinfedError(Exception):
    """An error caused by input or flags; printed on one line, exit status 2."""


# Everything a user can fix: clinfed's own errors and the privacy library's.
USER_ERRORS = (ClinfedError, PrivacyError)


# A setting named in a library message: its Python name in backticks.
_SETTING = re.compile(r"`([a-z][a-z0-9_]*)`")
SURFACES = ("flag", "keyword", "key")


def name_settings(text: str, surface: str = "flag") -> str:
    """``text`` with each setting it names (```max_grad_norm```) worded for
    ``surface``: a command-line ``flag`` (``--max-grad-norm``), a Python
    ``keyword`` (``max_grad_norm``) or a node config ``key``
    (``max-grad-norm``)."""

    def word(match: re.Match) -> str:
        name = match.group(1)
        if surface == "flag":
            return "--" + name.replace("_", "-")
        return name if surface == "keyword" else name.replace("_", "-")

    return _SETTING.sub(word, text)


def worded(exc: BaseException, surface: str = "flag") -> str:
    """A user error's lines, the settings it names worded for ``surface``
    (:func:`name_settings`). Library errors name settings, never flags."""
    return name_settings(str(exc), surface)


@dataclass
class Problem:
    """One problem in one input file: ``path:line: reason``."""

    path: Path | str
    line: int | None
    reason: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else f"{self.path}"
        return f"{where}: {self.reason}"


class DataError(ClinfedError):
    """Input data failed validation; holds every problem found."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    @classmethod
    def single(cls, path: Path | str, line: int | None, reason: str) -> DataError:
        return cls([Problem(path, line, reason)])


ON_ERROR_CHOICES = ("strict", "skip")


@dataclass
class ProblemLog:
    """Collects reader problems.

    In ``strict`` mode (the default) a reader keeps going to find every problem,
    then :meth:`raise_if_any` raises them together, so a user fixes a corpus in
    one pass. In ``skip`` mode the offending item (a concept line, a document,
    a CSV row) is left out and the problem is kept as a warning.
    """

    on_error: str = "strict"
    problems: list[Problem] = field(default_factory=list)
    # Set by a reader that really ran (not a cache hit): see rows_to_dataset.
    generated: bool = field(default=False, repr=False, compare=False)
    _seen: set = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR_CHOICES:
            raise ClinfedError(
                f"`on_error` must be one of {', '.join(ON_ERROR_CHOICES)}, not {self.on_error!r}"
            )

    def add(self, path: Path | str, line: int | None, reason: str) -> None:
        # Once: readers that look at the same file (format detection, then
        # reading) must not report one problem several times.
        key = (str(path), line, reason)
        if key not in self._seen:
            self._seen.add(key)
            self.problems.append(Problem(path, line, reason))

    @property
    def skipping(self) -> bool:
        return self.on_error == "skip"

    def raise_if_any(self) -> None:
        if self.problems and not self.skipping:
            raise DataError(self.problems)
