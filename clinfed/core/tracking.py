"""Experiment tracking (``--report-to``): a run's per-round figures in
TensorBoard or MLflow, through those libraries (optional extras:
``pip install clinfed[tensorboard]`` or ``clinfed[mlflow]``).

A tracker listens to the same events as the progress bars and logs what a
run already records in ``metrics.jsonl``: the global F1 per round (or
epoch), each site's MB sent and epsilon. Nothing else, so no note text.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.core.events import EpochEnd, Event, Reporter, RoundEnd, SiteEnd


class Tracker(ABC):
    """Logs scalars by name and step; :meth:`close` flushes."""

    @abstractmethod
    def scalar(self, name: str, value: float, step: int) -> None:
        """One scalar of the run at ``step`` (a round, or an epoch)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release the backend."""

    def listen(self, event: Event) -> None:
        """One pipeline event (:mod:`clinfed.core.events`)."""
        info = event.info()
        if isinstance(event, (RoundEnd, EpochEnd)):
            step = int(info.get("round", info.get("epoch", 0)))
            for key in ("f1", "micro_f1", "macro_f1", "train_loss"):
                value = info.get(key)
                if isinstance(value, (int, float)):
                    self.scalar(f"global/{key}", float(value), step)
        elif isinstance(event, SiteEnd):
            step, site = int(info["round"]), info["site"]
            self.scalar(f"{site}/mb_up", info["bytes_up"] / 1e6, step)
            if "bytes_down" in info:
                self.scalar(f"{site}/mb_down", info["bytes_down"] / 1e6, step)
            if isinstance(info.get("epsilon"), (int, float)):
                self.scalar(f"{site}/epsilon", float(info["epsilon"]), step)


class TensorBoardTracker(Tracker):
    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ClinfedError(
                "`report_to` tensorboard needs TensorBoard: pip install 'clinfed[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(folder))

    def scalar(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class MLflowTracker(Tracker):
    def __init__(self, run_folder: Path, settings: dict[str, Any]):
        try:
            import mlflow
        except ImportError:
            raise ClinfedError(
                "`report_to` mlflow needs MLflow: pip install 'clinfed[mlflow]'"
            ) from None
        self.mlflow = mlflow
        if not mlflow.get_tracking_uri() or mlflow.get_tracking_uri().startswith("file:"):
            # Never a server nobody configured: the run folder's own store.
            mlflow.set_tracking_uri((run_folder / "mlruns").resolve().as_uri())
        self.run = mlflow.start_run(run_name=run_folder.name)
        mlflow.log_params({k: str(v) for k, v in settings.items()})

    def scalar(self, name: str, value: float, step: int) -> None:
        self.mlflow.log_metric(name.replace("/", "."), value, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def make_tracker(kind: str, run_folder: Path, settings: dict[str, Any]) -> Tracker | None:
    """The tracker ``--report-to`` names, or ``None``."""
    if kind == "none":
        return None
    if kind == "tensorboard":
        return TensorBoardTracker(run_folder / "tensorboard")
    if kind == "mlflow":
        return MLflowTracker(run_folder, settings)
    raise ClinfedError(f"`report_to` must be none, tensorboard or mlflow, not {kind!r}")


class Tracked:
    """A reporter that also feeds a tracker, made at the first event (the
    pipeline reports its first event once the run folder holds the run's
    own files, so a refused start leaves no tracker files behind)."""

    def __init__(self, report: Reporter, kind: str, run_folder: Path, settings: dict[str, Any]):
        self.report, self.kind = report, kind
        self.run_folder, self.settings = run_folder, settings
        self.tracker: Tracker | None = None
        needed = {"tensorboard": "tensorboard", "mlflow": "mlflow"}.get(kind)
        if needed is not None and importlib.util.find_spec(needed) is None:
            raise ClinfedError(
                f"`report_to` {kind} needs {needed}: pip install 'clinfed[{needed}]'"
            )

    def __call__(self, event: Event) -> None:
        if self.tracker is None and self.kind != "none":
            self.tracker = make_tracker(self.kind, self.run_folder, self.settings)
        if self.tracker is not None:
            self.tracker.listen(event)
        self.report(event)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
