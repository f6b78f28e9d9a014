"""The accountant interface, and the mechanism every accountant composes."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

# Neighbouring datasets: one example added or removed, or one example
# replaced by another (the dataset size stays the same, so releasing it
# exactly costs nothing under this relation).
RELATIONS = ("add-remove", "replace-one")


@dataclass(frozen=True)
class Mechanism:
    """One accounted release: ``steps`` compositions of the Poisson-subsampled
    Gaussian mechanism.

    Attributes
    ----------
    name
        ``dp-sgd`` (local training) or ``safl-selection`` (noisy layer choice).
    noise_multiplier
        Gaussian noise standard deviation divided by the L2 bound on one
        example's contribution (the clipping norm).
    sample_rate
        Poisson sampling probability of each example (1.0: no subsampling).
    steps
        How many times the mechanism runs.
    replace_sensitivity
        How far replacing one example moves the release, in units of the
        bound on one example's contribution: 2 for a clipped sum (one
        example's clipped gradient can turn into its opposite), 1 for a sum
        of vectors in a box such as [0, 1]^L (two of them differ by at most
        the box's diagonal, the same bound as adding or removing one).
        Only mechanisms without subsampling may say 1.
    """

    name: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    replace_sensitivity: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.noise_multiplier < math.inf:
            raise ValueError("noise multiplier must be positive and finite")
        if not 0 < self.sample_rate <= 1:
            raise ValueError("sample rate must be in (0, 1]")
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if self.replace_sensitivity not in (1.0, 2.0):
            raise ValueError("replace_sensitivity must be 1 or 2")
        if self.replace_sensitivity == 1.0 and self.sample_rate != 1.0:
            raise ValueError("replace_sensitivity 1 is analysed without subsampling only")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_line(cls, line: dict) -> Mechanism:
        """From a ledger line (or any dict with the same keys)."""
        return cls(
            line["mechanism"],
            line["noise_multiplier"],
            line["sample_rate"],
            line["steps"],
            float(line.get("replace_sensitivity", 2.0)),
        )

    def line_fields(self) -> dict:
        """What a ledger line records of the mechanism (:meth:`from_line`'s keys)."""
        fields = {
            "mechanism": self.name,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
        }
        if self.replace_sensitivity != 2.0:
            fields["replace_sensitivity"] = self.replace_sensitivity
        return fields


def check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), not {delta}")


def grouped(
    mechanisms: Sequence[Mechanism], relation: str = "add-remove"
) -> tuple[tuple[float, float, int], ...]:
    """The composition as (noise multiplier, sample rate, total steps), one
    entry per distinct mechanism: composition is commutative, and composing
    identical steps at once is much faster (PLD self-composition).

    Under replace-one the analyses (dp-accounting's and Opacus's through the
    triangle inequality) take one replacement to move a clipped sum by twice
    the clipping bound. A mechanism whose replacement moves it by the bound
    itself (``replace_sensitivity`` 1, no subsampling) is the same Gaussian
    as one with twice the noise under that convention, so it enters with
    its noise multiplier doubled: exact, not a bound."""
    steps: Counter[tuple[float, float]] = Counter()
    for m in mechanisms:
        if m.steps > 0:
            sigma = m.noise_multiplier
            if relation == "replace-one" and m.replace_sensitivity == 1.0:
                sigma *= 2.0
            steps[(sigma, m.sample_rate)] += m.steps
    return tuple(sorted((sigma, q, n) for (sigma, q), n in steps.items()))


class Accountant(ABC):
    """Epsilon of a composition of mechanisms at a given delta, under one
    neighbouring relation.

    ``name`` is the registry key; ``description`` goes on every ledger line
    and into reports, so a reader knows which analysis produced a figure.
    """

    name: ClassVar[str]

    def __init__(self, relation: str = "add-remove"):
        if relation not in RELATIONS:
            raise ValueError(f"relation must be one of {', '.join(RELATIONS)}, not {relation!r}")
        self.relation = relation

    @property
    @abstractmethod
    def description(self) -> str:
        """The analysis and relation, in words."""

    @abstractmethod
    def epsilon(self, mechanisms: Sequence[Mechanism], delta: float) -> float:
        """Epsilon at ``delta`` of running every mechanism (their composition)."""
