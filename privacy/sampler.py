"""Poisson sampling of DP-SGD batches: every example joins each batch
independently with probability ``q = batch_size / n``, as the accountant's
subsampled Gaussian assumes. The coin flips come from the generator the site
passes in (its randomness, never the server's)."""

from __future__ import annotations

import numpy as np


def sample_rate(examples: int, batch_size: int) -> float:
    """Poisson sampling rate of a site with ``examples`` examples."""
    return min(1.0, batch_size / examples)


def steps_per_epoch(examples: int, batch_size: int) -> int:
    """Steps that make one expected pass over the site's data."""
    return max(1, round(examples / batch_size))


class PoissonSampler:
    """Draws one Poisson batch per step over ``n`` examples.

    ``population`` is the count the rate and steps derive from: ``n`` itself
    (replace-one: the exact count is public), or the site's noisy released
    count (add/remove: the exact count shapes nothing released)."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        generator: np.random.Generator,
        population: int | None = None,
    ):
        self.n, self.generator = n, generator
        counted = n if population is None else population
        self.rate = sample_rate(counted, batch_size)
        self.steps_per_epoch = steps_per_epoch(counted, batch_size)

    def draw(self) -> np.ndarray:
        """Indices of the next batch (possibly empty)."""
        return np.flatnonzero(self.generator.random(self.n) < self.rate)
