"""What ``--resume`` may do with a run folder, decided before anything is written.

Every check of a resume runs here, reading only: the run's settings against
the command's, the commit point (``state.json``) against the run's records,
outputs and settings, ``metrics.jsonl`` against the commit, each in-process
site's ledger against its seal and the commit's digest, and for a finished
run everything ``clinfed report`` verifies. A refusal (exit 2, naming the
file) therefore leaves the folder as it found it. Only then are the repairs
a resume may make carried out, each stated in one line and kept in
``repairs.jsonl`` for the report:

* records appended after the last commit (a round that was never
  committed) are dropped, a torn last line with them;
* nothing else: anything damaged that the commit point covers is refused.

A finished run (every planned round committed, its summary written) is
verified and left as it is: ``--resume`` never trains, predicts or writes
it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clinfed.core.errors import USER_ERRORS, ClinfedError
from clinfed.core.runs import REPAIRS, RUN_LOCK, append_jsonl
from clinfed.settings import RunConfig, load_file

log = logging.getLogger("clinfed")
# What a finished or committed run wrote beside its commit point.
OUTPUTS = ("summary.json", "model", "predictions", "checkpoints")


@dataclass
class ResumePlan:
    """What a resume of ``out`` will do (see the module docstring)."""

    out: Path
    finished: bool = False
    committed: int = 0  # the last committed round (0: none)
    metrics_bytes: int = 0  # what of metrics.jsonl the commit counts
    repairs: list[str] = field(default_factory=list)

    def carry_out(self) -> None:
        """Make the stated repairs, each said in one line and recorded."""
        metrics = self.out / "metrics.jsonl"
        if self.repairs and metrics.exists() and metrics.stat().st_size > self.metrics_bytes:
            with open(metrics, "r+b") as fh:
                fh.truncate(self.metrics_bytes)
                fh.flush()
                os.fsync(fh.fileno())
        for repair in self.repairs:
            log.warning("%s: repaired: %s", self.out, repair)
            append_jsonl(self.out / REPAIRS, {"round": self.committed, "repair": repair})


def _hint(out: Path) -> str:
    config = out / "config.json"
    return f"start a new run with its settings: clinfed train --config {config} --out NEW"


def never_started(out: Path) -> bool:
    """Only the claim of a run that was killed before it wrote anything."""
    return out.is_dir() and all(p.name == RUN_LOCK for p in out.iterdir())


def refuse_unstarted(out: Path) -> None:
    """A resume of a run that never started: say so, and how to start it."""
    if never_started(out):
        raise ClinfedError(
            f"{out}: the run never started (it was stopped right after claiming its folder): "
            "run the same command without `resume`; it takes the folder over"
        )


def metrics_digest(path: Path, size: int) -> str:
    """SHA-256 of the first ``size`` bytes of ``metrics.jsonl`` (what a commit counts)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        digest.update(fh.read(size))
    return digest.hexdigest()


def _records_after(path: Path, committed: int, state: dict[str, Any] | None) -> list[str]:
    """Check ``metrics.jsonl`` against the commit (read only) and say what a
    resume drops: records after the commit point, a torn line among them."""
    if not path.exists():
        if committed:
            raise ClinfedError(f"{path}: missing, but the last commit records {committed} bytes")
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1] if not data.endswith(b"\n") else data
    for number, raw in enumerate(complete.splitlines(), start=1):
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise ClinfedError(
                f"{path}:{number}: not a JSON record ({exc.msg}); cannot resume"
            ) from None
        if not isinstance(record, dict):
            raise ClinfedError(f"{path}:{number}: not a JSON object; cannot resume")
    if len(data) < committed:
        raise ClinfedError(
            f"{path}: {len(data)} bytes, but the last commit records {committed}: records were "
            "lost; cannot resume"
        )
    if complete != data and len(complete) < committed:
        raise ClinfedError(f"{path}: a torn line inside what the last commit counts")
    sealed = (state or {}).get("metrics_sha256")
    if sealed and metrics_digest(path, committed) != sealed:
        raise ClinfedError(
            f"{path}: the records the last commit counts were changed; cannot resume"
        )
    extra = data[committed:]
    if not extra:
        return []
    lines = extra.count(b"\n") + (0 if extra.endswith(b"\n") else 1)
    torn = "" if extra.endswith(b"\n") else " (the last one torn)"
    after = int((state or {}).get("round", 0))
    if state is not None and after >= int(state.get("planned_rounds", after + 1)):
        what = f"the final evaluation of round {after}, which runs again"
    else:
        what = f"round {after + 1} was never committed"
    return [
        f"{path.name}: {lines} record line(s) written after the last commit ({what}) dropped{torn}"
    ]


def _check_site_ledgers(out: Path, state: dict[str, Any], config: dict[str, Any]) -> None:
    """In process, each site's own ledger against its seal and the commit."""
    from clinfed.privacy.errors import PrivacyError
    from clinfed.privacy.ledger import Ledger

    if config.get("runner") == "flower":
        return  # the ledgers that bind stay at the nodes
    for site, digest in sorted((state.get("ledgers") or {}).items()):
        path = out / "sites" / site / "privacy" / f"{site}.jsonl"
        try:
            Ledger(path, site, float(config.get("delta") or 1e-5)).verify(
                digest, str(out / "state.json")
            )
        except PrivacyError as exc:
            raise ClinfedError(str(exc)) from None


def plan_resume(out: Path, rounds: int) -> ResumePlan:
    """Every check of a resume of ``out`` (a run of ``rounds`` rounds), read
    only; the plan of what it will do, or a ClinfedError naming the file."""
    from clinfed.reporting.verify import load_run, read_json, verify_run

    refuse_unstarted(out)
    saved = read_json(out / "config.json")
    if saved is None:
        raise ClinfedError(f"{out}: no run to resume (no config.json)")
    plan = ResumePlan(out)
    state = read_json(out / "state.json")
    if state is None:
        written = [name for name in OUTPUTS if (out / name).exists()]
        if written:
            raise ClinfedError(
                f"{out / 'state.json'}: missing, but the run wrote {', '.join(written)}: a run "
                f"is never restarted over its own outputs; {_hint(out)}"
            )
        plan.repairs = _records_after(out / "metrics.jsonl", 0, None)
        return plan
    try:
        plan.committed, plan.metrics_bytes = int(state["round"]), int(state["metrics_bytes"])
    except (KeyError, TypeError, ValueError):
        raise ClinfedError(f"{out / 'state.json'}: not a run's commit") from None
    if not 0 < plan.committed <= rounds or not (out / str(state.get("checkpoint"))).is_file():
        raise ClinfedError(
            f"{out / 'state.json'}: commits round {plan.committed} of a run of {rounds} rounds "
            f"with checkpoint {state.get('checkpoint')!r}: inconsistent; {_hint(out)}"
        )
    sealed = state.get("config_sha256")
    if sealed and hashlib.sha256((out / "config.json").read_bytes()).hexdigest() != sealed:
        raise ClinfedError(
            f"{out / 'config.json'}: changed since the run's last commit; a run keeps the "
            f"settings it started with: {_hint(out)}"
        )
    plan.repairs = _records_after(
        out / "metrics.jsonl", plan.metrics_bytes, state | {"planned_rounds": rounds}
    )
    _check_site_ledgers(out, state, saved)
    plan.finished = plan.committed == rounds and (out / "summary.json").is_file()
    if plan.finished:
        # The final evaluation's record follows the last commit: the
        # summary, verified with everything else below, covers it. Only a
        # torn last line (a write that never finished) is cut back.
        data = (out / "metrics.jsonl").read_bytes()
        plan.metrics_bytes = data.rfind(b"\n") + 1
        torn = len(data) - plan.metrics_bytes
        plan.repairs = [f"metrics.jsonl: a torn last line ({torn} bytes) cut back"] if torn else []
        try:
            verify_run(out, load_run(out))
        except USER_ERRORS as exc:
            raise ClinfedError(str(exc)) from None
    return plan


# Machine settings --resume may change that still change floating-point
# rounding (the order of sums across threads, another device's kernels).
ROUNDING_SETTINGS = ("threads", "device")


def check_resume(config: RunConfig) -> ResumePlan:
    """A resumed run must be the same run: same settings, same data, its
    folder whole (:mod:`clinfed.runners.resume`: every check before any write)."""
    from clinfed.federated.strategies import STRATEGIES

    out = Path(config.out)
    if STRATEGIES[config.strategy].pooled:
        raise ClinfedError(
            f"`resume` applies to federated strategies (rounds), not {config.strategy}"
        )
    if (out / "config.json").is_file():
        check_same_settings(config, out, "`resume` of")
    return plan_resume(out, config.rounds)


def resume_finished(config: RunConfig, say: Callable[[str], Any]) -> dict[str, Any] | None:
    """Check and carry out ``--resume`` (:func:`check_resume`); for a run
    that had finished every round, say so and return its summary (marked
    ``finished_before``: verified, nothing trained or written again), else
    ``None`` (the caller continues the run)."""
    plan = check_resume(config)
    plan.carry_out()
    if not plan.finished:
        return None
    say(f"{config.out}: the run finished all {config.rounds} rounds; verified, nothing written")
    return json.loads((Path(config.out) / "summary.json").read_text()) | {"finished_before": True}


def check_same_settings(config: RunConfig, out: Path, doing: str) -> None:
    """Refuse ``config`` (resolved) unless the run in ``out`` was made with the
    same settings (those ``--resume`` may change aside): ``doing`` names
    what is refused (``--resume of``, ``sweep --resume: cell``)."""
    saved_path = Path(out) / "config.json"
    saved = RunConfig.from_values(load_file(saved_path), str(saved_path)).to_dict()
    ours = config.to_dict()
    from clinfed.settings import schema_fields

    resumable = {n for n, f in schema_fields().items() if f.metadata.get("resumable")}
    for concern, values in ours.items():
        for key, value in values.items():
            before = saved.get(concern, {}).get(key)
            if key in resumable:
                if key in ROUNDING_SETTINGS and before != value:
                    # Allowed (a run moved to another machine resumes), but the
                    # sums run in another order: not bit for bit the same run.
                    logging.getLogger("clinfed").warning(
                        f"{doing} {out}: {key} was {before!r}, now {value!r}; the "
                        "rounds from here are not bit-identical to an uninterrupted run"
                    )
                continue
            if concern == "data" and key == "data":
                same = Path(str(before)).resolve() == Path(str(value)).resolve()
            else:
                same = before == value
            if not same:
                raise ClinfedError(
                    f"{doing} {out} with a different config: `{key}` was {before!r}, now "
                    f"{value!r}; a run keeps its settings: to change `{key}`, start a new run: "
                    f"clinfed train `config` {Path(out) / 'config.json'} `{key}` VALUE `out` NEW"
                )
