"""A site's privacy ledger: append-only JSON lines, written before release.

One line per accounted mechanism per round, with the site's cumulative
epsilon after it::

    {"client": "site1", "round": 3, "mechanism": "dp-sgd", "epsilon": 0.62,
     "delta": 1e-05, "noise_multiplier": 1.1, "sample_rate": 0.05, "steps": 20,
     "accountant": "RDP ..."}

The line is fsynced before the site trains, so a crash can only leave a
line for a round whose update never left the site (over-counting), never
an update without a line. Resume reads every line back: a round that is
re-run after a crash is counted again, which is the safe direction.

Surviving crashes and neighbours:

* a torn last line (a crash mid-append) is cut back to the last complete
  line, with a warning; a complete line is never dropped, and a complete
  line that does not parse is an error naming the file and line;
* the ledger's folder is fsynced when the file is created, so the file
  itself survives a crash;
* :meth:`Ledger.charge` holds an exclusive lock (``fcntl``) on
  ``<ledger>.lock`` while it re-reads the file, checks the budget and
  appends, so two processes can never both charge within one budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from clinfed.errors import ClinfedError
from clinfed.privacy.accountants import BUDGET, Accountant, Mechanism
from clinfed.runs import append_jsonl

log = logging.getLogger("clinfed.privacy")

# Budget checks allow for float noise in the accountant, nothing more.
SLACK = 1e-9


class Ledger:
    """The accounted history of one site.

    Parameters
    ----------
    path
        The ledger file (created on the first record).
    client
        The site's name, written on every line.
    delta
        The delta every epsilon is reported at.
    budget
        Epsilon the site may not exceed (``None``: unlimited, still recorded).
    not_private
        Why the figures do not protect anyone (reproducible noise), written
        on every line; ``None`` for a private run.
    accountant
        The accountant budgets are checked with (RDP).
    """

    def __init__(
        self,
        path: Path,
        client: str,
        delta: float,
        budget: float | None = None,
        accountant: Accountant = BUDGET,
        not_private: str | None = None,
    ):
        self.path, self.client, self.delta, self.budget = Path(path), client, delta, budget
        self.accountant, self.not_private = accountant, not_private
        self.repaired_bytes = 0  # what a torn last line cost, if one was cut back
        self._load()

    # ---------------------------------------------------------------- file
    def _load(self) -> None:
        """Read every complete line; cut a torn last line back."""
        self.lines = []
        if not self.path.exists():
            self.history = []
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as fh:
                fh.truncate(keep)
                fh.flush()
                os.fsync(fh.fileno())
            self.repaired_bytes += len(data) - keep
            log.warning(
                "%s: torn last line (%d bytes, a crash mid-write) cut back to the last "
                "complete line",
                self.path,
                len(data) - keep,
            )
            data = data[:keep]
        for number, raw in enumerate(data.decode("utf-8").splitlines(), start=1):
            try:
                line = json.loads(raw)
                Mechanism(
                    line["mechanism"], line["noise_multiplier"], line["sample_rate"], line["steps"]
                )
            except (ValueError, KeyError, TypeError):
                raise ClinfedError(
                    f"{self.path}:{number}: not a ledger line; the ledger cannot be trusted"
                ) from None
            self.lines.append(line)
        self.history = [
            Mechanism(r["mechanism"], r["noise_multiplier"], r["sample_rate"], r["steps"])
            for r in self.lines
        ]

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

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ClinfedError(
                    f"{self.path}: another process is charging this ledger now; one site, "
                    "one run at a time"
                ) from None
            yield
        finally:
            os.close(fd)  # releases the lock

    def charge(self, round_number: int, mechanisms: Sequence[Mechanism]) -> float | None:
        """Check the budget and record ``mechanisms`` as one step under the
        ledger's lock (re-reading the file first); the new epsilon, or
        ``None`` when the budget does not afford them."""
        with self._locked():
            self._load()
            if not self.affords(mechanisms):
                return None
            return self.record(round_number, mechanisms)

    @property
    def spent(self) -> float:
        """Epsilon spent so far."""
        return self.accountant.epsilon(self.history, self.delta)

    def after(self, mechanisms: Sequence[Mechanism]) -> float:
        """Epsilon the site would have spent after ``mechanisms`` too."""
        return self.accountant.epsilon([*self.history, *mechanisms], self.delta)

    def affords(self, mechanisms: Sequence[Mechanism]) -> bool:
        return self.budget is None or self.after(mechanisms) <= self.budget * (1 + SLACK)

    def record(self, round_number: int, mechanisms: Sequence[Mechanism]) -> float:
        """Append (and fsync) one line per mechanism; return the new epsilon.
        Use :meth:`charge` to check and record under the lock."""
        if not self.path.exists():
            self._create()
        eps = 0.0
        for mechanism in mechanisms:
            self.history.append(mechanism)
            eps = self.accountant.epsilon(self.history, self.delta)
            line = {
                "client": self.client,
                "round": round_number,
                "mechanism": mechanism.name,
                "epsilon": eps,
                "delta": self.delta,
                "noise_multiplier": mechanism.noise_multiplier,
                "sample_rate": mechanism.sample_rate,
                "steps": mechanism.steps,
                "accountant": self.accountant.description,
                "relation": self.accountant.relation,
            }
            if self.not_private:
                line["not_private"] = self.not_private
            append_jsonl(self.path, line)
            self.lines.append(line)
        return eps

    def rounds(self) -> list[int]:
        return sorted({r["round"] for r in self.lines})
