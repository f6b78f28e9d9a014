"""A site's privacy ledger: append-only JSON lines, written before release.

Two kinds of line. A *charge*, one per accounted mechanism per round,
with the site's cumulative epsilon after it::

    {"site": "site1", "run": "...", "round": 3, "state": "charged",
     "mechanism": "dp-sgd", "epsilon": 0.62, "run_epsilon": 0.62,
     "delta": 1e-05, "noise_multiplier": 1.1, "sample_rate": 0.05,
     "steps": 20, "accountant": "PLD, replace-one ...", "relation": "replace-one"}

and a *release*, written (and fsynced) just before anything computed in
that round leaves the site::

    {"site": "site1", "run": "...", "round": 3, "released": true}

Write-ahead: a charge is fsynced before the site trains, a release before
it replies. A crash between the two left nothing outside the site, so when
the same run re-runs that round with the same mechanisms the charge is
*reused*, never dropped and never doubled; any other crash can only
over-count. ``epsilon`` is the whole ledger's spend (every run this site's
data took part in), ``run_epsilon`` this run's.

A charge belongs to one *attempt* (a random id on its lines and on its
release). The attempt holds an ``fcntl`` lock on ``<ledger>.<attempt>.claim``
from its charge until its release, so a charge is reused only by a re-run
after the attempt that made it ended without releasing (a crash: the
operating system drops the lock; an error: :meth:`Ledger.abandon`). Two
handlers of the same round at once get two charges, never one charge and
two releases.

Surviving crashes, neighbours and tampering:

* a torn last line (a crash mid-append) is cut back to the last complete
  line, with a warning; a complete line is never dropped, and a complete
  line that does not parse is an error naming the file and line;
* the ledger's folder is fsynced when the file is created, so the file
  itself survives a crash;
* :meth:`Ledger.charge` holds an exclusive lock (``fcntl``) on
  ``<ledger>.lock`` while it re-reads the file, checks the budget and
  appends, so two processes can never both charge within one budget;
* after every append the ledger's length and SHA-256 go to
  ``<ledger>.seal``; a ledger shorter than its seal, with another prefix,
  or deleted while its seal remains is refused, never trusted. The run's
  commit keeps the same digest (:meth:`Ledger.digest`,
  :meth:`Ledger.verify`), so a resume notices a ledger deleted together
  with its seal;
* a node keeps a high-water mark of each of its ledgers outside the ledger
  folder (``mark``): a ledger restored from an older backup, or deleted
  together with its seal, is refused while the mark remains;
* a dataset that took part in a run without DP, or with reproducible (not
  private) noise, gets an ``unprotected`` line: its spend is infinite from
  then on, so no later run can claim a guarantee for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from clinfed.privacy.accountants import BUDGET, Accountant, Mechanism
from clinfed.privacy.durable import append_jsonl, atomic_write_json, exclusive_lock
from clinfed.privacy.errors import PrivacyError

log = logging.getLogger("clinfed.privacy")

# The round a once-per-dataset charge is written under (rounds count from 1).
ONCE_ROUND = 0

# Budget checks allow for float noise in the accountant, nothing more.
SLACK = 1e-9


def _prefix_sha256(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        left = size
        while left > 0:
            chunk = fh.read(min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _mechanism(line: dict) -> Mechanism:
    return Mechanism.from_line(line)


class Ledger:
    """The accounted history of one site (one dataset).

    Parameters
    ----------
    path
        The ledger file (created on the first charge).
    site
        The site's name, written on every line (``site``; a line written
        before was keyed ``client``, read the same).
    delta
        The delta every epsilon is reported at.
    budget
        Epsilon the whole ledger may not exceed (``None``: unlimited, still
        recorded).
    accountant
        The accountant budgets are checked with.
    not_private
        Why the figures do not protect anyone (reproducible noise), written
        on every line; ``None`` for a private run.
    run
        The run charging now (``None``: a ledger that serves one run).
    run_budget
        Epsilon this run may not exceed on top of ``budget``.
    """

    def __init__(
        self,
        path: Path,
        site: str,
        delta: float,
        budget: float | None = None,
        accountant: Accountant = BUDGET,
        not_private: str | None = None,
        run: str | None = None,
        run_budget: float | None = None,
        mark: Path | None = None,
    ):
        self.path, self.site, self.delta, self.budget = Path(path), site, delta, budget
        self.accountant, self.not_private = accountant, not_private
        self.run, self.run_budget = run, run_budget
        self.seal_path = self.path.with_name(self.path.name + ".seal")
        self.mark_path = Path(mark) if mark is not None else None
        self.repaired_bytes = 0  # what a torn last line cost, if one was cut back
        # This object's attempts by round: [attempt id, claim fd, in flight].
        self._claims: dict[int, list[list]] = {}
        self._load()

    # ---------------------------------------------------------------- file
    def _load(self) -> None:
        """Read every complete line; cut a torn last line back; check the seal."""
        self.lines: list[dict] = []  # charges
        self.torn_bytes = 0  # a torn last line's bytes, cut back before the next append
        self.unprotected: list[dict] = []  # runs that gave no guarantee
        # (run, round, attempt) of every release line (attempt None: a line
        # written before attempts existed, releasing the whole round).
        self.released: set[tuple[str | None, int, str | None]] = set()
        marked = self._marked()
        if not self.path.exists():
            if marked is not None and marked["bytes"] > 0:
                raise PrivacyError(
                    f"{self.path}: the ledger is missing but the node's high-water mark "
                    f"({self.mark_path}) records {marked['bytes']} bytes of it: it was deleted; "
                    "it cannot be trusted"
                )
            if self.seal_path.exists():
                raise PrivacyError(
                    f"{self.path}: the ledger is missing but its seal "
                    f"({self.seal_path.name}) remains: it was deleted; it cannot be trusted"
                )
            self.history = []
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            # A crash mid-append: read up to the last complete line. The file
            # is cut back only under the lock, just before the next append
            # (:meth:`_cut_torn_tail`): reading a ledger never writes it.
            keep = data.rfind(b"\n") + 1
            self.torn_bytes = len(data) - keep
            data = data[:keep]
        if self.seal_path.exists():
            try:
                seal = json.loads(self.seal_path.read_text())
                self._check(data, int(seal["bytes"]), str(seal["sha256"]), self.seal_path.name)
            except (ValueError, KeyError, TypeError):
                raise PrivacyError(
                    f"{self.seal_path}: not a ledger seal; the ledger cannot be trusted"
                ) from None
        if marked is not None:
            self._check(data, int(marked["bytes"]), str(marked["sha256"]), str(self.mark_path))
        for number, raw in enumerate(data.decode("utf-8").splitlines(), start=1):
            try:
                line = json.loads(raw)
                if line.get("state") == "unprotected":
                    self.unprotected.append(line)
                    continue
                if line.get("released") is True:
                    self.released.add((line.get("run"), int(line["round"]), line.get("attempt")))
                    continue
                _mechanism(line)
            except (ValueError, KeyError, TypeError, AttributeError):
                raise PrivacyError(
                    f"{self.path}:{number}: not a ledger line; the ledger cannot be trusted"
                ) from None
            self.lines.append(line)
        self.history = [_mechanism(line) for line in self.lines]

    def _check(self, data: bytes, size: int, sha256: str, source: str) -> None:
        if len(data) < size:
            raise PrivacyError(
                f"{self.path}: {len(data)} bytes, but {source} records {size}: the ledger was "
                "shortened; it cannot be trusted"
            )
        if hashlib.sha256(data[:size]).hexdigest() != sha256:
            raise PrivacyError(
                f"{self.path}: its first {size} bytes differ from what {source} records: the "
                "ledger was altered; it cannot be trusted"
            )

    def digest(self) -> dict[str, int | str]:
        """The ledger's length and SHA-256 now (what a commit records)."""
        size = self.path.stat().st_size if self.path.exists() else 0
        return {"bytes": size, "sha256": _prefix_sha256(self.path, size) if size else ""}

    def verify(self, digest: dict[str, int | str], source: str) -> None:
        """Refuse a ledger that lost what ``digest`` (from ``source``) recorded."""
        size = int(digest.get("bytes", 0))
        if size == 0:
            return
        if not self.path.exists():
            raise PrivacyError(
                f"{self.path}: the ledger is missing but {source} records {size} bytes of it: "
                "it was deleted; it cannot be trusted"
            )
        with open(self.path, "rb") as fh:
            data = fh.read(size)
        self._check(data, size, str(digest["sha256"]), source)

    def _marked(self) -> dict | None:
        """This ledger's entry in the node's high-water mark, if any."""
        if self.mark_path is None or not self.mark_path.exists():
            return None
        try:
            entry = json.loads(self.mark_path.read_text()).get(self.path.name)
            if entry is not None:
                entry = {"bytes": int(entry["bytes"]), "sha256": str(entry["sha256"])}
            return entry
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PrivacyError(
                f"{self.mark_path}: not a high-water mark; the ledgers cannot be trusted"
            ) from None

    def _seal(self) -> None:
        digest = self.digest()
        atomic_write_json(self.seal_path, digest)
        if self.mark_path is not None:
            # Never lowered: the mark only follows the ledger's growth.
            try:
                marks = json.loads(self.mark_path.read_text())
            except FileNotFoundError:
                marks = {}
            marks[self.path.name] = digest
            atomic_write_json(self.mark_path, marks)

    def mark_unprotected(self, reason: str) -> None:
        """Record that this dataset took part in this run without a
        guarantee (no DP, or reproducible noise): from now on its spend is
        infinite and every budget refuses it."""
        with self._locked():
            self._load()
            if any(line.get("run") == self.run for line in self.unprotected):
                return
            if not self.path.exists():
                self._create()
            line = {"site": self.site, "run": self.run, "state": "unprotected"}
            line["reason"] = reason
            append_jsonl(self.path, line)
            self.unprotected.append(line)
            self._seal()

    def _cut_torn_tail(self) -> None:
        """Cut a torn last line back before appending (under the lock)."""
        if not self.torn_bytes:
            return
        keep = self.path.stat().st_size - self.torn_bytes
        with open(self.path, "r+b") as fh:
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())
        self.repaired_bytes += self.torn_bytes
        log.warning(
            "%s: torn last line (%d bytes, a crash mid-write) cut back to the last complete line",
            self.path,
            self.torn_bytes,
        )
        self.torn_bytes = 0

    def _create(self) -> None:
        """Create the file and fsync its folder, so the file survives a crash."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return exclusive_lock(
            self.path.with_name(self.path.name + ".lock"),
            f"{self.path}: another process is charging this ledger now; one site, one run at "
            "a time",
        )

    # ------------------------------------------------------------- charges
    def _is_released(self, line: dict) -> bool:
        key = (line.get("run"), line["round"])
        return (*key, None) in self.released or (*key, line.get("attempt")) in self.released

    def unreleased(self, round_number: int) -> list[dict]:
        """This run's charges of ``round_number`` that were never released."""
        return [
            line
            for line in self.lines
            if line.get("run") == self.run
            and line["round"] == round_number
            and line.get("state") == "charged"
            and not self._is_released(line)
        ]

    def _claim_path(self, attempt: str) -> Path:
        return self.path.with_name(f"{self.path.name}.{attempt}.claim")

    def _try_claim(self, attempt: str) -> int | None:
        """The claim's locked descriptor, or ``None`` while a live attempt holds it."""
        fd = os.open(self._claim_path(attempt), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _drop_claims(self, round_number: int, remove: bool) -> None:
        for attempt, fd, _ in self._claims.pop(round_number, []):
            if remove:
                self._claim_path(attempt).unlink(missing_ok=True)
            os.close(fd)  # releases the lock

    def _reusable(self, round_number: int, mechanisms: Sequence[Mechanism]) -> dict | None:
        """The last line of an unreleased attempt of this round with these
        mechanisms that no live attempt holds (claimed for this object now)."""
        attempts: dict[str | None, list[dict]] = {}
        for line in self.unreleased(round_number):
            attempts.setdefault(line.get("attempt"), []).append(line)
        for attempt, lines in attempts.items():
            if [_mechanism(line) for line in lines] != list(mechanisms) or attempt is None:
                continue
            held = [c for c in self._claims.get(round_number, []) if c[0] == attempt]
            if held:
                if held[0][2]:
                    continue  # in flight in this process: another handler's
                held[0][2] = True
                return lines[-1]
            fd = self._try_claim(attempt)
            if fd is not None:
                self._claims.setdefault(round_number, []).append([attempt, fd, True])
                return lines[-1]
        return None

    def charge(self, round_number: int, mechanisms: Sequence[Mechanism]) -> float | None:
        """Check the budget and record ``mechanisms`` as one round under the
        ledger's lock (re-reading the file first); the epsilon after it, or
        ``None`` when the budget does not afford them.

        A charge of the same run and round with the same mechanisms that was
        never released, and whose attempt ended (a crash before the reply
        left, or :meth:`abandon`), is reused; one still in flight never is.
        The charge stays claimed by this object until :meth:`release` or
        :meth:`abandon`.
        """
        with self._locked():
            self._load()
            reused = self._reusable(round_number, mechanisms)
            if reused is not None:
                log.info(
                    "%s: round %d was charged and never released (interrupted); the charge is "
                    "reused",
                    self.path,
                    round_number,
                )
                return reused["epsilon"]
            if not self.affords(mechanisms):
                return None
            attempt = secrets.token_hex(8)
            fd = self._try_claim(attempt)
            if fd is None:  # 64 random bits: never expected
                raise PrivacyError(f"{self._claim_path(attempt)}: claimed by another process")
            self._claims.setdefault(round_number, []).append([attempt, fd, True])
            return self.record(round_number, mechanisms, attempt)

    def charge_once(self, mechanism: Mechanism) -> bool:
        """Charge ``mechanism`` once over the ledger's whole life (a release
        made once per dataset, such as its noisy unit count): under the lock,
        nothing if a line of that mechanism is on the ledger already, else
        a charge (round 0 of this run) released at once, since what it covers
        may leave with any reply from now on. False when the budget does not
        afford it (nothing written)."""
        with self._locked():
            self._load()
            if any(line["mechanism"] == mechanism.name for line in self.lines):
                return True
            if not self.affords([mechanism]):
                return False
            attempt = secrets.token_hex(8)
            self.record(ONCE_ROUND, [mechanism], attempt)
            self._append_release(ONCE_ROUND, attempt)
            self._seal()
            return True

    def settle(self, round_number: int) -> None:
        """The attempt's computation ended and waits for its release: a
        later re-run of the round by this object (a retried round) may reuse
        the charge, since nothing of it left the site."""
        for claim in self._claims.get(round_number, []):
            claim[2] = False

    def abandon(self, round_number: int) -> None:
        """Give up this object's attempt of ``round_number`` without
        releasing it (its computation failed; nothing left the site): a
        re-run reuses its charge, as after a crash."""
        self._drop_claims(round_number, remove=False)

    def release(self, round_number: int) -> None:
        """Record (fsynced) that this object's attempts of ``round_number``
        leave the site now; a re-run of the round is charged again."""
        held = self._claims.get(round_number, [])
        if not held:
            return  # no attempt of this object's: nothing of it to release
        with self._locked():
            self._load()
            self._cut_torn_tail()
            pending = {line.get("attempt") for line in self.unreleased(round_number)}
            for attempt, _, _ in held:
                if attempt not in pending:
                    continue
                self._append_release(round_number, attempt)
            self._seal()
            self._drop_claims(round_number, remove=True)

    def _append_release(self, round_number: int, attempt: str) -> None:
        """Append (fsynced) the release line of one attempt (under the lock)."""
        line = {
            "site": self.site,
            "run": self.run,
            "round": round_number,
            "attempt": attempt,
            "released": True,
        }
        append_jsonl(self.path, line)
        self.released.add((self.run, round_number, attempt))

    def _run_history(self) -> list[Mechanism]:
        """This run's charges, and what every run of the dataset rests on:
        the releases made once per dataset (the noisy unit count), charged
        under whichever run came first, are part of each run's epsilon."""
        return [
            _mechanism(line)
            for line in self.lines
            if line.get("run") == self.run or line["round"] == ONCE_ROUND
        ]

    @property
    def spent(self) -> float:
        """Epsilon the ledger has spent (every run); infinite once a run
        without a guarantee touched the dataset (for a private run; a run
        that is itself not private is held to its budget as before)."""
        if self.unprotected and not self.not_private:
            return math.inf
        return self.accountant.epsilon(self.history, self.delta)

    @property
    def run_spent(self) -> float:
        """Epsilon this run has spent."""
        return self.accountant.epsilon(self._run_history(), self.delta)

    def after(self, mechanisms: Sequence[Mechanism]) -> float:
        """Epsilon the ledger would have spent after ``mechanisms`` too."""
        if self.unprotected and not self.not_private:
            return math.inf
        return self.accountant.epsilon([*self.history, *mechanisms], self.delta)

    def affords(self, mechanisms: Sequence[Mechanism]) -> bool:
        within = self.budget is None or self.after(mechanisms) <= self.budget * (1 + SLACK)
        if within and self.run_budget is not None:
            run_after = self.accountant.epsilon([*self._run_history(), *mechanisms], self.delta)
            within = run_after <= self.run_budget * (1 + SLACK)
        return within

    def record(
        self, round_number: int, mechanisms: Sequence[Mechanism], attempt: str | None = None
    ) -> float:
        """Append (and fsync) one charge per mechanism; return the new epsilon.
        Use :meth:`charge` to check, claim and record under the lock."""
        if not self.path.exists():
            self._create()
        self._cut_torn_tail()
        eps = 0.0
        run_history = self._run_history()
        for mechanism in mechanisms:
            self.history.append(mechanism)
            run_history.append(mechanism)
            eps = self.accountant.epsilon(self.history, self.delta)
            line = {
                "site": self.site,
                "run": self.run,
                "round": round_number,
                "attempt": attempt,
                "state": "charged",
                "mechanism": mechanism.name,
                "epsilon": eps,
                "run_epsilon": self.accountant.epsilon(run_history, self.delta),
                "delta": self.delta,
                **{k: v for k, v in mechanism.line_fields().items() if k != "mechanism"},
                "accountant": self.accountant.description,
                "relation": self.accountant.relation,
            }
            if self.not_private:
                line["not_private"] = self.not_private
            append_jsonl(self.path, line)
            self.lines.append(line)
        self._seal()
        return eps

    def run_lines(self) -> list[dict]:
        """This run's charges (what a site reports for a run), with the
        once-per-dataset releases it rests on (:meth:`_run_history`)."""
        return [
            line
            for line in self.lines
            if line.get("run") == self.run or line["round"] == ONCE_ROUND
        ]

    def rounds(self) -> list[int]:
        return sorted({r["round"] for r in self.lines})
