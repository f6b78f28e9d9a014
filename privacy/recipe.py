"""The DP-SGD recipe: a site's batch and rate derived from its size.

Non-private fine-tuning takes small batches and many steps; under DP every
step pays noise of a fixed size (``noise_multiplier * max_grad_norm`` on the
sum of the batch's clipped gradients), so the noise on the *mean* gradient
shrinks as ``1 / batch``, and fewer, larger steps need little more noise
for the same epsilon (Li et al. 2021, "Large language models can be strong
differentially private learners"; Yu et al. 2021, "Differentially private
fine-tuning of language models"). Each step's fixed cost (noise for every
trainable parameter) is also spread over more examples.

Which parameters train is the run's plan (``--adapter``); the default is
the task's (``Task.dp_adapter``). For concept extraction it is every
weight: on BC5CDR (1,520 sentences a site, a public warm start with name
marks) +2.3 F1 over the bias terms at epsilon 8 and +0.3 at 1, and level
with them (0.957 both, ahead in round 1, 0.955 against 0.946) on the
README's first run (~230 sentences a site, epsilon 8), for three times the
wall time on 2 CPU cores. For ICD coding it is the head alone: 0.806
against every weight's 0.787 (under the start's 0.796) at epsilon 8, one
round, ~1,270 admissions a site.

Without ``--batch-size``, a site under DP therefore takes

* an expected Poisson batch of ``units / steps`` privacy units, at least
  ``MIN_BATCH`` and at most ``MAX_BATCH`` (never more than the site holds),
  where ``steps`` is 2 when every weight trains and 16 for an adapter
  plan: a few large steps per local epoch, enough that AdamW moves in
  every round;
* its rates (``--lr``, ``--head-lr``) scaled by ``sqrt(batch / task batch)``,
  the square-root rule for Adam (Malladi et al. 2022, "On the SDEs and
  scaling rules for adaptive gradient algorithms"), so a rate given for the
  task's non-private batch means the same at the site's batch.

Without ``--local-epochs``, a private run takes 6 passes over each site's
data per round when every weight trains and ``DP_LOCAL_EPOCHS`` (3) for an
adapter plan (without DP: 1), and without
``--lr-decay`` its rates stay constant (``DP_LR_DECAY``, as without DP).
Measured on synthetic and public text only (benchmarks/results/NOTEBOOK.md, "Private
models"): three local epochs beat one by 10.7 F1 points at 3,300 sentences
a site (epsilon 8, bias terms), five beat three by 1 point at 600
sentences for 1.5 times the time, and at the same epsilon 6 rounds moved
nothing against 3. The schedule (benchmarks/results/NOTEBOOK.md, "The rate schedule";
epsilon 8, bias terms, add/remove, the demo's corpus): from a PubMed
start, far from the notes, constant rates end at 0.641 on the mean of two
draws, a cooldown over the last round at 0.622 and rates falling linearly
to zero over the run at 0.598; from public notes of the sites' kind the
three end within half a point of each other (0.955 constant and 0.958
linear over four draws, 0.953 cooldown over two). A start far from the
task needs every step at full rate, one close to it loses nothing
measurable, so the rates stay constant. Close to the task a constant
rate lets F1 wobble by up to a point between rounds (a fall in each of
the four draws); the linear decay rose in every round but one, which
fell by 0.05 points: ``--lr-decay linear`` where a start already scores near the task,
or ``--public-check`` (the demo's), which keeps a round's model only
when public notes say it is better.

A site derives its batch and rates from its own number of units, which it releases anyway
(the aggregation weight), so the recipe costs no privacy. The clip norm is
not derived: AdamW divides out the gradient's scale, so ``--max-grad-norm``
decides which units are clipped and how large the noise is next to the
signal. The default 1.0 clips two thirds of the units on the demo's corpus
from PubMed, but from a warm start on BC5CDR only a fifth of LoRA's (units'
median norm 0.43) and under half of bias terms' (median 0.77), so there
the noise is sized for gradients most units do not have; 0.4 gained 1.3
points in the public subspace (two draws) and 0.7 for bias terms (one) in
round 1, yet ended 0.7 under 1.0 after three rounds (docs/results.md), so
1.0 stays.
"""

from __future__ import annotations

import math

STEPS_PER_EPOCH = 16
DP_LOCAL_EPOCHS = 3
DP_LR_DECAY = "none"
MIN_BATCH = 64
MAX_BATCH = 1024
# Every weight under DP (``--adapter none``) takes fewer, larger steps and
# more passes: a batch of half a site's units, 6 local epochs (BC5CDR, 1,520
# sentences a site, epsilon 8: batch 760 beat 190, 380 and 1,520, and 6
# epochs beat 3 and 12; docs/results.md). Its rates are the task's
# ``Task.dp_rates``, given at the task's batch and scaled by the same rule.
WHOLE_MODEL_STEPS_PER_EPOCH = 2
WHOLE_MODEL_LOCAL_EPOCHS = 6


def steps_per_epoch(adapter: str) -> int:
    """Expected Poisson steps per local epoch under DP for a plan that trains
    ``adapter``'s parameters (``none``: every weight)."""
    return WHOLE_MODEL_STEPS_PER_EPOCH if adapter == "none" else STEPS_PER_EPOCH


def dp_local_epochs(adapter: str) -> int:
    """Local epochs a round under DP for a plan that trains ``adapter``'s
    parameters (``none``: every weight)."""
    return WHOLE_MODEL_LOCAL_EPOCHS if adapter == "none" else DP_LOCAL_EPOCHS


def dp_batch_size(units: int, steps: int = STEPS_PER_EPOCH) -> int:
    """The expected Poisson batch of a site with ``units`` privacy units that
    takes about ``steps`` steps a local epoch."""
    derived = min(MAX_BATCH, max(MIN_BATCH, units // steps))
    return max(1, min(units, derived))


def lr_scale(batch_size: int, reference_batch: int) -> float:
    """How much the rates grow from ``reference_batch`` to ``batch_size``
    (Adam's square-root rule)."""
    return math.sqrt(batch_size / reference_batch)
