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
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from clinfed.privacy.accountants import BUDGET, Accountant, Mechanism
from clinfed.runs import append_jsonl, read_jsonl

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
        self.lines = read_jsonl(self.path) if self.path.exists() else []
        self.history = [
            Mechanism(r["mechanism"], r["noise_multiplier"], r["sample_rate"], r["steps"])
            for r in self.lines
        ]

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
        """Append (and fsync) one line per mechanism; return the new epsilon."""
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
            }
            if self.not_private:
                line["not_private"] = self.not_private
            append_jsonl(self.path, line)
            self.lines.append(line)
        return eps

    def rounds(self) -> list[int]:
        return sorted({r["round"] for r in self.lines})
