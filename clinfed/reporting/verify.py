"""A run folder read and verified before anything is said about it.

``clinfed report`` states epsilon per site; it may state only what the run
folder proves. :func:`load_run` reads every record strictly (a damaged line
is ``path:line: reason``, never a traceback) and :func:`verify_run` cross-
checks them, so that a deleted, truncated, rolled-back or consistently
shortened file ends in a refusal naming it, never in a report that says less
(or more) than the run did:

* every site that trained, or that ``state.json`` or ``summary.json`` names,
  has its ledger (the run's copy, ``RUN/privacy/<site>.jsonl``; in process
  the site's own, checked against its seal and the commit's digest);
* every round a site trained in is charged, and the epsilon the records,
  the summary and the ledgers state is the same;
* ``metrics.jsonl`` is at least as long as the last commit says and covers
  its rounds; the summary's round is the commit's;
* every file the run sealed when it finished (``RUN/seal.json``:
  :mod:`clinfed.core.seal`) is there and unchanged, and none was added; a
  finished run without a seal has its figures stated as unverified;
* a site ledger the commit records in the run folder (in process) is there.

Nothing here writes: a read-only command never changes what it reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from clinfed.core.errors import USER_ERRORS, ClinfedError
from clinfed.core.runs import site_keyed
from clinfed.settings import read_run_config

# Epsilons written by two processes from the same lines: equal but for float
# formatting.
TOLERANCE = 1e-9


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or ``None`` when absent; damage is a one-line error."""
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ClinfedError(f"{path}: not UTF-8 text; the run folder is damaged") from None
    except json.JSONDecodeError as exc:
        raise ClinfedError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except OSError as exc:
        raise ClinfedError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(value, dict):
        raise ClinfedError(f"{path}: not a JSON object; the run folder is damaged")
    return value


def read_records(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records. A torn last line (a crash mid-append,
    which a resume cuts back) is left out; any other line that does not
    parse is ``path:line: reason``."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ClinfedError(f"{path}: cannot read ({exc.strerror})") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        lines.pop()  # torn: no newline at its end
    records = []
    for number, raw in enumerate(lines, start=1):
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ClinfedError(
                f"{path}:{number}: not a JSON record; the run folder is damaged"
            ) from None
        if not isinstance(record, dict):
            raise ClinfedError(f"{path}:{number}: not a JSON record; the run folder is damaged")
        records.append(record)
    return records


def load_run(run: Path) -> dict[str, Any]:
    """Every record of a run folder, read strictly (nothing verified yet)."""
    run = Path(run)
    for name in ("config.json", "metrics.jsonl"):
        if not (run / name).is_file():
            raise ClinfedError(f"{run}: no {name} (not a clinfed run folder?)")
    ledgers = {path.stem: read_records(path) for path in sorted((run / "privacy").glob("*.jsonl"))}
    return {
        "labels": read_json(run / "labels.json") or {},
        "config": read_run_config(run),
        "records": [site_keyed(r) for r in read_records(run / "metrics.jsonl")],
        "policy": read_json(run / "privacy" / "policy.json"),
        "ledgers": ledgers,
        "state": read_json(run / "state.json"),
        "summary": read_json(run / "summary.json") or {},
        "audit": read_json(run / "audit.json"),
    }


def _dp(config: dict[str, Any]) -> bool:
    target = config.get("target_epsilon")
    finite = target is not None and not (isinstance(target, float) and math.isinf(target))
    return finite or config.get("noise_multiplier") is not None


def _charges(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("state", "charged") == "charged"]


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(1.0, abs(a), abs(b))


def _rounds(records: list[dict[str, Any]]) -> list[int]:
    """Every round a record names (a round's site records come before its
    commit; its global record, the evaluation, with the next round's)."""
    return [int(r["round"]) for r in records if "round" in r]


def verify_run(run: Path, data: dict[str, Any]) -> str | None:
    """Refuse (ClinfedError naming the file) a run folder whose records do
    not agree, or whose sealed files changed (see the module docstring);
    return why its figures are unverified (a finished run without a seal:
    :func:`clinfed.core.seal.check_seal`), or ``None``."""
    from clinfed.core.seal import check_seal

    run = Path(run)
    unverified = check_seal(run)
    config, records = data["config"], data["records"]
    state, summary, policy = data["state"], data["summary"], data["policy"]
    _check_commit(run, config, records, state, summary)
    if not _dp(config) and policy is None and not data["ledgers"]:
        return unverified
    if policy is None:
        raise ClinfedError(
            f"{run / 'privacy' / 'policy.json'}: missing, though the run trained under DP: "
            "no epsilon can be stated"
        )
    named = {r["site"] for r in records if "site" in r and "bytes_up" in r}
    named |= set((state or {}).get("ledgers", {}))
    named |= {site for site, eps in summary.get("epsilon", {}).items() if eps}
    for site in sorted(named):
        if site not in data["ledgers"]:
            raise ClinfedError(
                f"{run / 'privacy' / f'{site}.jsonl'}: missing, though the run names {site} "
                "as a site that trained: its epsilon cannot be stated"
            )
    # Where the sites kept their ledgers: config.json's record of the runner.
    runner = (read_json(run / "config.json") or {}).get("runner")
    for site, lines in data["ledgers"].items():
        _check_ledger(run, site, lines, records, state, summary, runner)
    return unverified


def _check_commit(
    run: Path,
    config: dict[str, Any],
    records: list[dict[str, Any]],
    state: dict[str, Any] | None,
    summary: dict[str, Any],
) -> None:
    """The records cover the last commit; the summary is the commit's."""
    metrics = run / "metrics.jsonl"
    rounds = _rounds(records)
    last = max(rounds, default=0)
    if state is not None:
        try:
            committed, length = int(state["round"]), int(state.get("metrics_bytes", 0))
        except (KeyError, TypeError, ValueError):
            raise ClinfedError(f"{run / 'state.json'}: not a run's commit") from None
        if metrics.stat().st_size < length:
            raise ClinfedError(
                f"{metrics}: shorter than {run / 'state.json'} commits ({length} bytes): it was "
                "shortened; the run cannot be reported"
            )
        if last < committed:
            raise ClinfedError(
                f"{metrics}: records end at round {last}, but {run / 'state.json'} commits "
                f"round {committed}: they disagree; the run cannot be reported"
            )
    if summary:
        stated = summary.get("round")
        if stated is not None and state is not None and int(stated) != int(state["round"]):
            raise ClinfedError(
                f"{run / 'summary.json'}: says round {stated}, but {run / 'state.json'} commits "
                f"round {state['round']}: they disagree; the run cannot be reported"
            )
        evaluated = max(
            (int(r["round"]) for r in records if "site" not in r and "round" in r), default=0
        )
        if stated is not None and (int(stated) != last or evaluated != int(stated)):
            raise ClinfedError(
                f"{run / 'summary.json'}: says round {stated}, but {metrics} ends at round "
                f"{last}: they disagree; the run cannot be reported"
            )
    elif state is not None and int(state["round"]) >= int(config.get("rounds") or 0) > 0:
        if not _pooled(config):
            raise ClinfedError(
                f"{run / 'summary.json'}: missing, though {run / 'state.json'} commits the last "
                "round: finish the run with `resume`, or the file was deleted"
            )


def _pooled(config: dict[str, Any]) -> bool:
    from clinfed.federated.strategies import STRATEGIES

    strategy = STRATEGIES.get(config.get("strategy"))
    return strategy is not None and strategy.pooled


def _check_ledger(
    run: Path,
    site: str,
    lines: list[dict[str, Any]],
    records: list[dict[str, Any]],
    state: dict[str, Any] | None,
    summary: dict[str, Any],
    runner: str | None,
) -> None:
    from clinfed.privacy.ledger import Ledger

    path = run / "privacy" / f"{site}.jsonl"
    charges = _charges(lines)
    try:
        charged = {int(line["round"]) for line in charges}
        last_epsilon = float(charges[-1]["epsilon"]) if charges else 0.0
    except (KeyError, TypeError, ValueError):
        raise ClinfedError(f"{path}: not a ledger; it cannot be trusted") from None
    trained = [r for r in records if r.get("site") == site and "bytes_up" in r]
    missing = sorted({r["round"] for r in trained} - charged)
    if missing:
        raise ClinfedError(
            f"{path}: no charge for round {missing[0]}, in which metrics.jsonl says {site} "
            "trained: the ledger was shortened; no epsilon can be stated from it"
        )
    stated = [float(r["epsilon"]) for r in trained if "epsilon" in r]
    if stated and charges and not _same(last_epsilon, max(stated)):
        raise ClinfedError(
            f"{path}: ends at epsilon {last_epsilon:.6g}, but metrics.jsonl says {site} spent "
            f"{max(stated):.6g}: the ledger was altered; it cannot be trusted"
        )
    if "epsilon" in summary and site in summary["epsilon"]:
        if not _same(last_epsilon, float(summary["epsilon"][site])):
            raise ClinfedError(
                f"{path}: ends at epsilon {last_epsilon:.6g}, but {run / 'summary.json'} says "
                f"{float(summary['epsilon'][site]):.6g}: they disagree; the run cannot be "
                "reported"
            )
    # In process the site's own ledger is in the run folder: read (never
    # written), checked against its seal and against the commit's digest.
    own = run / "sites" / site / "privacy" / f"{site}.jsonl"
    digest = (state or {}).get("ledgers", {}).get(site)
    if not own.parent.is_dir():
        if digest is not None and runner != "flower":
            # The commit names the ledger the site kept in this folder.
            raise ClinfedError(
                f"{own.parent}: missing, though {run / 'state.json'} records {site}'s ledger "
                "there: no epsilon can be stated for it"
            )
        return
    delta = float(charges[0]["delta"]) if charges else 1e-5
    try:
        ledger = Ledger(own, site, delta)
        if digest is not None:
            ledger.verify(digest, str(run / "state.json"))
    except USER_ERRORS as exc:
        raise ClinfedError(str(exc)) from None
    key = ("round", "mechanism", "noise_multiplier", "sample_rate", "steps")
    if [tuple(x.get(k) for k in key) for x in ledger.run_lines()] != [
        tuple(x.get(k) for k in key) for x in charges
    ]:
        raise ClinfedError(
            f"{path}: differs from the site's own ledger {own}: it cannot be trusted"
        )
