"""``--public-check DIR``: the server keeps a round's update only when the
new global model is better on public annotated text by more than chance.

The task says what a model decides on a record (:meth:`Task.decisions`):
concept spans for concept extraction, (admission, code) pairs at the
probability threshold for ICD coding. Everything here works on those sets,
whatever they hold.

Under DP, once a model is close to what its sites' data can teach, the
noise on each averaged step dwarfs the signal left, and a round moves the
model by a random step: measured on the demo, private F1 after round 1 went
up or down by up to six spans a round (benchmarks/results/NOTEBOOK.md, "The demo"). The
server can see such a step coming without any site's data: it scores the
proposed global model on public text of the same kind and keeps the last
one unless the proposal is better there.

"Better" is a sign test on the decisions the step changed, not a rise in
F1 alone. A random step fixes some spans and breaks others, so F1 on the
public text rises about half the time by a span or two, and the hospitals'
own notes then fall about half the time (measured: two of fourteen demo
draws fell after a round whose public F1 rose by one to three spans). A
decision is *better* when the proposal newly makes a gold one or drops a
spurious one, *worse* the other way round; under a step that learns
nothing, each changed decision is as likely to be either, so the proposal
is kept only when F1 rises and so many of the changed decisions are better
that a fair coin would give that many or more with probability at most
:data:`LEVEL` (the binomial tail).

Privacy: nothing is spent. The choice reads only what the sites released
(already noised and accounted) and public text, so it is post-processing;
the sites still spent their budget on the round, and the round's record in
``metrics.jsonl`` says whether the server kept it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

# One-sided significance level of the sign test a proposal must pass.
LEVEL = 0.05


@dataclass(frozen=True)
class Scored:
    """A global model on the public text: its F1 and the decisions it makes
    (any hashable key per decision: a span's document, start, end and type;
    an admission and a code)."""

    f1: float
    predicted: frozenset[Hashable]


Score = Callable[[dict[str, torch.Tensor]], Scored]


def micro_f1(predicted: frozenset[Hashable], gold: frozenset[Hashable]) -> float:
    """Micro-averaged F1 of a set of decisions against the gold set (exact
    match): twice the hits over the two sets' sizes."""
    total = len(predicted) + len(gold)
    return 2 * len(predicted & gold) / total if total else 0.0


def changed_decisions(
    before: frozenset[Hashable], after: frozenset[Hashable], gold: frozenset[Hashable]
) -> tuple[int, int]:
    """How many decisions a step from ``before`` to ``after`` made better (a
    gold one newly made, a spurious one dropped) and worse (a gold one
    lost, a spurious one added), scored against ``gold``."""
    better = len((after - before) & gold) + len((before - after) - gold)
    worse = len((before - after) & gold) + len((after - before) - gold)
    return better, worse


def significant(better: int, worse: int, level: float = LEVEL) -> bool:
    """Whether ``better`` of ``better + worse`` changed decisions is more than
    a fair coin gives with probability ``level`` (one-sided sign test)."""
    if better <= worse:
        return False
    # Imported here: scipy.stats costs a quarter second in every process
    # that imports the round engine, and only the public check uses it.
    from scipy.stats import binomtest

    tail = binomtest(better, better + worse, 0.5, alternative="greater").pvalue
    return bool(tail <= level)  # a Python bool: records are written as JSON


class PublicCheck:
    """Chooses between the last global model and a round's proposal.

    Parameters
    ----------
    score
        A global model (its shared state) on the public text: F1 and the
        decisions it makes.
    gold
        The public text's gold decisions, keyed as ``score`` keys them.
    """

    def __init__(self, score: Score, gold: frozenset[Hashable]):
        self.score = score
        self.gold = gold
        # The kept model on the public text; None until first needed (and
        # after a resume, when it is scored again from the resumed model).
        self.last: Scored | None = None

    def choose(
        self, previous: dict[str, torch.Tensor], proposed: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``proposed`` if it is better than ``previous`` on the public text
        (F1 rises and the sign test passes), else ``previous``: a step that
        gains nothing beyond chance is noise. Returns the model and the
        record of the choice."""
        if self.last is None:
            self.last = self.score(previous)
        before, after = self.last, self.score(proposed)
        better, worse = changed_decisions(before.predicted, after.predicted, self.gold)
        kept = after.f1 > before.f1 and significant(better, worse)
        if kept:
            self.last = after
        record = {
            "f1_before": round(before.f1, 6),
            "f1_proposed": round(after.f1, 6),
            "decisions_better": better,
            "decisions_worse": worse,
            "kept": kept,
        }
        return (proposed if kept else previous), record
