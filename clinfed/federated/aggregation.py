"""Server-side averaging: per parameter, over the sites that sent it.

The mean is accumulated as updates arrive, so the server holds one running
sum per parameter whatever the number of sites. A parameter no site sent
keeps its value.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class Aggregator:
    """Sample-weighted mean of each parameter over the sites that sent it."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._weights: dict[str, float] = {}

    def add(self, tensors: Mapping[str, torch.Tensor], num_examples: int) -> None:
        """Fold in one site's upload, weighted by its number of examples."""
        if num_examples <= 0:
            raise ValueError("an update must come from at least one example")
        for name, value in tensors.items():
            weighted = value.detach().to(torch.float64) * num_examples
            if name in self._sums:
                self._sums[name] += weighted
                self._weights[name] += num_examples
            else:
                self._sums[name] = weighted
                self._weights[name] = float(num_examples)

    def result(self, current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new global state: averaged where sent, ``current`` elsewhere.

        Sums are kept in float64 so the mean does not depend on the order in
        which sites arrive beyond rounding of the final cast.
        """
        new = {}
        for name, value in current.items():
            if name in self._sums:
                new[name] = (self._sums[name] / self._weights[name]).to(value.dtype)
            else:
                new[name] = value.clone()
        unknown = set(self._sums) - set(current)
        if unknown:
            raise KeyError(
                f"updates name parameters the model does not have: {sorted(unknown)[:3]}"
            )
        return new
