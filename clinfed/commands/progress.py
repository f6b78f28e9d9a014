"""Progress a person can follow: the pipeline's events as rich bars in a
terminal and as timestamped log lines outside one (a round's start, its
time and the time left, each F1 with its own round)."""

from __future__ import annotations

import time
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from clinfed.commands.common import _warn, log
from clinfed.core.events import (
    EpochEnd,
    EpochStart,
    EvalStart,
    EvalStep,
    Event,
    Loaded,
    RoundEnd,
    SiteEnd,
    SiteEvalStart,
    SiteEvalStep,
    SiteRefused,
    SiteStart,
    SiteStep,
    Step,
    Stopped,
)


class ProgressReporter:
    """Turns the pipeline's events into log lines (``logging``: one
    timestamped line per event outside a terminal) and rich progress bars
    with ETA: rounds, the site at work (training, then evaluation), or a
    centralized epoch."""

    def __init__(self, progress: Progress, epochs: int, rounds: int):
        self.progress, self.epochs, self.rounds = progress, epochs, rounds
        self.bar: Any = None
        self.round_bar: Any = None
        # The round at work, when it and the first round seen started (for
        # each round's time and the time left, in logs as on the bars).
        self.current: int | None = None
        self.round_started = self.first_started = 0.0
        self.first_round = 1

    def _round_starts(self, round_number: int) -> None:
        """A line when a round starts, and one for the round it ends: its
        time and, from the mean round so far, the time left."""
        now = time.perf_counter()
        if self.current is not None:
            done = self.current - self.first_round + 1
            left = (now - self.first_started) / done * (self.rounds - self.current)
            log.info(
                f"round {self.current}/{self.rounds} trained in {span(now - self.round_started)}; "
                f"about {span(left)} left"
            )
        else:
            self.first_started, self.first_round = now, round_number
        self.current, self.round_started = round_number, now
        log.info(f"round {round_number}/{self.rounds} started")

    def _work(self, description: str, total: float | None) -> None:
        if self.bar is not None:
            self.progress.remove_task(self.bar)
        self.bar = self.progress.add_task(description, total=total)

    def __call__(self, event: Event) -> None:
        p = self.progress
        if isinstance(event, Loaded):
            _warn(event.warnings)
            log.info(
                f"{event.train} training and {event.test} held-out examples "
                f"from sites {', '.join(event.sites)}"
            )
        elif isinstance(event, (EpochStart, EvalStart)):
            label = "train" if isinstance(event, EpochStart) else "evaluate"
            self._work(f"epoch {event.epoch}/{self.epochs} {label}", event.examples)
        elif isinstance(event, (Step, EvalStep)):
            p.advance(self.bar, event.examples)
        elif isinstance(event, EpochEnd):
            log.info(
                f"epoch {event['epoch']}: f1 {event['f1']:.4f}  loss {event['train_loss']:.4f}  "
                f"{event['tokens_per_s']:.0f} tokens/s"
            )
        elif isinstance(event, SiteStart):
            if event.round != self.current:
                self._round_starts(event.round)
            if self.round_bar is None:
                self.round_bar = p.add_task("rounds", total=self.rounds)
                p.update(self.round_bar, completed=event.round - 1)
            self._work(f"round {event.round} {event.site} train", None)
        elif isinstance(event, (SiteStep, SiteEvalStep)):
            p.update(self.bar, total=event.total, advance=event.done)
        elif isinstance(event, SiteEvalStart):
            self._work(f"{event.site} evaluate", event.total)
        elif isinstance(event, SiteEnd):
            self._site_end(event.info())
        elif isinstance(event, SiteRefused):
            log.warning(
                f"round {event['round']} {event['site']}: refused, epsilon would reach "
                f"{event['epsilon_if_trained']:.3f} (spent {event['epsilon']:.3f})"
            )
        elif isinstance(event, Stopped):
            log.warning(event.reason)
        elif isinstance(event, RoundEnd):
            self._round_end(event.info())

    @staticmethod
    def _site_end(info: dict[str, Any]) -> None:
        # Under DP the training loss is not released; epsilon is shown instead.
        detail = (
            f"epsilon {info['epsilon']:.3f}"
            if "epsilon" in info
            else f"loss {info['train_loss']:.4f}"
        )
        log.info(
            f"round {info['round']} {info['site']}: {detail}  "
            f"up {info['bytes_up'] / 1e6:.1f} MB"
            + (f"  {info['wall_s']:.0f} s" if "wall_s" in info else "")
        )

    def _round_end(self, info: dict[str, Any]) -> None:
        if info["round"] == self.rounds and self.current == self.rounds:
            now = time.perf_counter()
            log.info(
                f"round {self.rounds}/{self.rounds} trained and evaluated in "
                f"{span(now - self.round_started)}"
            )
        log.info(f"round {info['round']}: f1 {f1_text(info)}")
        if self.round_bar is not None:
            self.progress.update(self.round_bar, completed=info["round"])


def f1_text(record: dict) -> str:
    """A record's F1, or why it has none (a round no site evaluated)."""
    return f"{record['f1']:.4f}" if "f1" in record else "none (no site evaluated)"


# A round takes minutes: the ETA averages over the whole run (rich's default
# window of 30 s holds no finished round, so it would show no estimate).
PROGRESS = {"speed_estimate_period": 24 * 3600.0}


def columns() -> list:
    return [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    ]


def span(seconds: float) -> str:
    """A short duration: 4.2 s, 3 min 05 s, 1 h 02 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    text = f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"
    return f"wall time {text}" if seconds >= 60 else f"wall time {seconds:.1f} s"
