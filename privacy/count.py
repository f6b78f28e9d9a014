"""A site's unit count, released once under its own noise, so that the
rest of its releases are accounted under add/remove neighbours.

Under replace-one (the default) a site releases its exact number of privacy
units: the aggregation weight, and through the sampling rate and the number
of steps, everything it trains. Neighbouring datasets then have the same
size and differ in one replaced unit, which costs about twice the
sensitivity of adding or removing one.

With ``--neighbours add-remove`` a site instead releases ``n + N(0, s^2)``
(``s`` = :data:`COUNT_NOISE`), rounded, once per run, from its secret
randomness, and derives everything from that: its sampling rate
``batch / n_released``, its steps, its noise calibration and its
aggregation weight. The exact count is then released nowhere, and the
whole run is a fixed mechanism of the dataset: the count (a Gaussian
mechanism of sensitivity 1) composed with DP-SGD's subsampled Gaussian
steps, each accounted under add/remove. The count costs little: its
Renyi divergence at order ``a`` is ``a / (2 s^2)``, about 0.03 at the
orders that decide epsilon 1-8.

The released count is kept beside the site's ledger before the first
charge that covers it, so a resumed run releases the same one (a second
draw would be a second release).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clinfed.privacy.accountants import Mechanism
from clinfed.privacy.durable import atomic_write_json

# Standard deviation of the noise on a released count (in units).
COUNT_NOISE = 20.0
COUNT_MECHANISM = "unit-count"


def count_mechanism() -> Mechanism:
    """The release of one noisy count: a Gaussian mechanism of sensitivity 1."""
    return Mechanism(COUNT_MECHANISM, COUNT_NOISE, 1.0, 1, replace_sensitivity=1.0)


def noisy_count(units: int, generator: torch.Generator) -> int:
    """``units + N(0, COUNT_NOISE^2)``, rounded, at least 1 (Opacus's secure sampler)."""
    from clinfed.privacy.noise import secure_gaussian

    noise = float(secure_gaussian(COUNT_NOISE, 1, generator)[0])
    return max(1, round(units + noise))


def count_path(folder: Path, site: str) -> Path:
    return Path(folder) / f"{site}.count.json"


def kept_count(folder: Path, site: str) -> int | None:
    """The count this site released in this run before, if any."""
    path = count_path(folder, site)
    if not path.is_file():
        return None
    return int(json.loads(path.read_text())["released_units"])


def keep_count(folder: Path, site: str, released: int) -> None:
    """Keep the released count (durably) before anything covering it leaves."""
    path = count_path(folder, site)
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"released_units": released, "noise_std": COUNT_NOISE})
