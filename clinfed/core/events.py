"""The progress events every runner reports: one dataclass per event.

A runner (the in-process pipeline, the round engine, a site, the warm
start, a sweep) calls ``report(event)`` as it goes: the CLI draws progress
bars and log lines from it (:mod:`clinfed.commands.progress`),
``--report-to`` logs from it (:mod:`clinfed.core.tracking`), and a library
caller may pass its own. Each event names itself (``event.name``) and
gives its fields as a dictionary (:meth:`Event.info`): the Python API's
``on_event(name, info)`` takes that form.

Events carry what a run already records or shows: counts, rounds, sites,
the records ``metrics.jsonl`` holds. Never note text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    """Something a run did; :attr:`name` says what, :meth:`info` its fields."""

    name: ClassVar[str] = "event"

    def info(self) -> dict[str, Any]:
        """The event's fields (a record-carrying event: the record itself)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class _Recorded(Event):
    """An event whose fields are a record of ``metrics.jsonl``."""

    record: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        return dict(self.record)

    def __getitem__(self, key: str) -> Any:
        return self.record[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.record.get(key, default)


@dataclass(frozen=True)
class Loaded(Event):
    """The data is read and dealt: example counts, the sites that train."""

    name: ClassVar[str] = "loaded"
    train: int = 0
    test: int = 0
    sites: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PublicEpoch(Event):
    """An epoch of the warm start on public text begins."""

    name: ClassVar[str] = "public_epoch"
    epoch: int = 0
    examples: int = 0


@dataclass(frozen=True)
class EpochStart(Event):
    """A pooled (centralized) epoch begins."""

    name: ClassVar[str] = "epoch_start"
    epoch: int = 0
    examples: int = 0


@dataclass(frozen=True)
class Step(Event):
    """A pooled epoch's step: this many examples done."""

    name: ClassVar[str] = "step"
    examples: int = 0


@dataclass(frozen=True)
class EvalStart(Event):
    """A pooled epoch's evaluation begins."""

    name: ClassVar[str] = "eval_start"
    epoch: int = 0
    examples: int = 0


@dataclass(frozen=True)
class EvalStep(Event):
    """An evaluation step: this many examples done."""

    name: ClassVar[str] = "eval_step"
    examples: int = 0


@dataclass(frozen=True)
class EpochEnd(_Recorded):
    """A pooled epoch ended: its record (F1, loss, tokens a second)."""

    name: ClassVar[str] = "epoch_end"


@dataclass(frozen=True)
class SiteStart(Event):
    """A site starts a round's work."""

    name: ClassVar[str] = "site_start"
    round: int = 0
    site: str = ""


@dataclass(frozen=True)
class SiteStep(Event):
    """A site's local training: ``done`` more of ``total`` steps."""

    name: ClassVar[str] = "site_step"
    site: str = ""
    done: int = 0
    total: int = 0


@dataclass(frozen=True)
class SiteEvalStart(Event):
    """A site starts evaluating the model it received."""

    name: ClassVar[str] = "site_eval_start"
    site: str = ""
    total: int = 0


@dataclass(frozen=True)
class SiteEvalStep(Event):
    """A site's evaluation: ``done`` more of ``total`` batches."""

    name: ClassVar[str] = "site_eval_step"
    site: str = ""
    done: int = 0
    total: int = 0


@dataclass(frozen=True)
class SiteEnd(_Recorded):
    """A site's reply was summed: its record (bytes, epsilon...)."""

    name: ClassVar[str] = "site_end"


@dataclass(frozen=True)
class SiteRefused(_Recorded):
    """A site refused the round (its budget): its record."""

    name: ClassVar[str] = "site_refused"


@dataclass(frozen=True)
class RoundEnd(_Recorded):
    """A round was committed and evaluated: its record (F1...)."""

    name: ClassVar[str] = "round_end"


@dataclass(frozen=True)
class Stopped(Event):
    """The run stopped early, and why."""

    name: ClassVar[str] = "stopped"
    round: int = 0
    reason: str = ""


@dataclass(frozen=True)
class SweepStart(Event):
    """A sweep begins: its cells, and those finished already."""

    name: ClassVar[str] = "sweep_start"
    cells: int = 0
    finished: int = 0


@dataclass(frozen=True)
class CellStart(Event):
    """A sweep's cell (one run) begins."""

    name: ClassVar[str] = "cell_start"
    cell: str = ""


@dataclass(frozen=True)
class CellEnd(Event):
    """A sweep's cell ended, in so many seconds."""

    name: ClassVar[str] = "cell_end"
    cell: str = ""
    seconds: float = 0.0


Reporter = Callable[[Event], None]


def silent(event: Event) -> None:
    """The reporter that drops every event (the default)."""
    del event


def as_pairs(on_event: Callable[[str, dict[str, Any]], None]) -> Reporter:
    """A reporter that hands ``on_event`` each event as ``(name, info)``
    (the Python API's documented form)."""
    return lambda event: on_event(event.name, event.info())
