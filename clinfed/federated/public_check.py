"""``--public-check DIR``: the server keeps a round's update only when the
new global model's F1 on public annotated text rises.

Under DP, once a model is close to what its sites' data can teach, the
noise on each averaged step dwarfs the signal left, and a round moves the
model by a random step: measured on the demo, private F1 after round 1 went
up or down by up to six spans a round (docs/results.md, "The demo"). The
server can see such a step coming without any site's data: it scores the
proposed global model on public text of the same kind and keeps the last
one when the proposal scores lower.

Privacy: nothing is spent. The choice reads only what the sites released
(already noised and accounted) and public text, so it is post-processing;
the sites still spent their budget on the round, and the round's record in
``metrics.jsonl`` says whether the server kept it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Score = Callable[[dict[str, torch.Tensor]], float]


class PublicCheck:
    """Chooses between the last global model and a round's proposal.

    Parameters
    ----------
    score
        F1 of a global model (its shared state) on the public text.
    """

    def __init__(self, score: Score):
        self.score = score
        # The kept model's public F1; None until first needed (and after a
        # resume, when it is scored again from the resumed model).
        self.last: float | None = None

    def choose(
        self, previous: dict[str, torch.Tensor], proposed: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``proposed`` if its public F1 is higher than ``previous``'s, else
        ``previous`` (a tie keeps it: a step that gains nothing measurable is
        noise); and the record of the choice."""
        if self.last is None:
            self.last = self.score(previous)
        before, after = self.last, self.score(proposed)
        kept = after > before
        if kept:
            self.last = after
        record = {"f1_before": round(before, 6), "f1_proposed": round(after, 6), "kept": kept}
        return (proposed if kept else previous), record
