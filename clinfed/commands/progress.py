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

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        p = self.progress
        if event == "loaded":
            _warn(info["warnings"])
            log.info(
                f"{info['train']} training and {info['test']} held-out examples "
                f"from sites {', '.join(info['sites'])}"
            )
        elif event in ("epoch_start", "eval_start"):
            label = "train" if event == "epoch_start" else "evaluate"
            self._work(f"epoch {info['epoch']}/{self.epochs} {label}", info["examples"])
        elif event in ("step", "eval_step"):
            p.advance(self.bar, info["examples"])
        elif event == "epoch_end":
            log.info(
                f"epoch {info['epoch']}: f1 {info['f1']:.4f}  loss {info['train_loss']:.4f}  "
                f"{info['tokens_per_s']:.0f} tokens/s"
            )
        elif event == "site_start":
            if info["round"] != self.current:
                self._round_starts(info["round"])
            if self.round_bar is None:
                self.round_bar = p.add_task("rounds", total=self.rounds)
                p.update(self.round_bar, completed=info["round"] - 1)
            self._work(f"round {info['round']} {info['site']} train", None)
        elif event in ("site_step", "site_eval_step"):
            p.update(self.bar, total=info["total"], advance=info["done"])
        elif event == "site_eval_start":
            self._work(f"{info['site']} evaluate", info["total"])
        elif event == "site_end":
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
        elif event == "site_refused":
            log.warning(
                f"round {info['round']} {info['site']}: refused, epsilon would reach "
                f"{info['epsilon_if_trained']:.3f} (spent {info['epsilon']:.3f})"
            )
        elif event == "stopped":
            log.warning(info["reason"])
        elif event == "round_end":
            if info["round"] == self.rounds and self.current == self.rounds:
                now = time.perf_counter()
                log.info(
                    f"round {self.rounds}/{self.rounds} trained and evaluated in "
                    f"{span(now - self.round_started)}"
                )
            log.info(f"round {info['round']}: f1 {f1_text(info)}")
            if self.round_bar is not None:
                p.update(self.round_bar, completed=info["round"])


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
