"""The DP-SGD recipe: a site's batch and rate derived from its size.

Non-private fine-tuning takes small batches and many steps; under DP every
step pays noise of a fixed size (``noise_multiplier * max_grad_norm`` on the
sum of the batch's clipped gradients), so the noise on the *mean* gradient
shrinks as ``1 / batch``, and fewer, larger steps need little more noise
for the same epsilon (Li et al. 2021, "Large language models can be strong
differentially private learners"; Yu et al. 2021, "Differentially private
fine-tuning of language models"). Each step's fixed cost (noise for every
trainable parameter) is also spread over more examples.

Without ``--batch-size``, a site under DP therefore takes

* an expected Poisson batch of ``units / STEPS_PER_EPOCH`` privacy units,
  at least ``MIN_BATCH`` and at most ``MAX_BATCH`` (never more than the
  site holds): a few large steps per local epoch, enough that AdamW moves
  in every round;
* its rates (``--lr``, ``--head-lr``) scaled by ``sqrt(batch / task batch)``,
  the square-root rule for Adam (Malladi et al. 2022, "On the SDEs and
  scaling rules for adaptive gradient algorithms"), so a rate given for the
  task's non-private batch means the same at the site's batch.

A site derives both from its own number of units, which it releases anyway
(the aggregation weight), so the recipe costs no privacy. The clip norm is
not derived: AdamW divides out the gradient's scale, so ``--max-grad-norm``
only decides which examples are clipped, and the default 1.0 clips most of
them (per-example gradient norms of MiniLM on these tasks start above 1).
"""

from __future__ import annotations

import math

STEPS_PER_EPOCH = 16
MIN_BATCH = 64
MAX_BATCH = 1024


def dp_batch_size(units: int) -> int:
    """The expected Poisson batch of a site with ``units`` privacy units."""
    derived = min(MAX_BATCH, max(MIN_BATCH, units // STEPS_PER_EPOCH))
    return max(1, min(units, derived))


def lr_scale(batch_size: int, reference_batch: int) -> float:
    """How much the rates grow from ``reference_batch`` to ``batch_size``
    (Adam's square-root rule)."""
    return math.sqrt(batch_size / reference_batch)
