"""The randomness that protects privacy, and where it comes from.

DP-SGD's guarantee assumes the adversary cannot predict the noise or the
Poisson coin flips. Anyone who can (the server, or anyone holding the run's
public seed) can replay training with and without one example and compare
with the upload. So at a site under DP:

* Poisson sampling and SAFL's private-selection noise come from a numpy
  PCG64 generator seeded by ``SeedSequence()`` (128 bits of OS entropy);
* the DP-SGD noise comes from a torch generator seeded from 64 bits of OS
  entropy (``secrets``), drawn by Opacus's sampler in ``secure_mode``: each
  noise value is the normalised sum of 2n = 4 Gaussian draws, which
  defeats the floating-point attacks on Gaussian sampling (Mironov 2012;
  Holohan and Braghin 2021, the fix Opacus implements). With book-keeping
  clipping clinfed draws it itself, in fixed chunks each from a generator
  seeded by a draw of the site's generator (so the chunks fill every core;
  :func:`clinfed.privacy.noise.secure_gaussian`).

Neither seed is written to disk, logged or sent; each round draws new ones.
What this protects against: the server, other sites and readers of the run
folder replaying the noise. What it does not: an attacker on the site's own
machine who reads its memory. Torch's CPU generator is a Mersenne Twister,
not a cryptographic generator: its 64-bit seed is secret and fresh every
round, and the noise values themselves are never released (only their sum
with the clipped gradients).

``reproducible=True`` (``--reproducible-noise``) derives both from the
public seed, for tests and for comparing transports; such runs are marked
not private in the ledger, the policy, the summary and the report.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch

NOT_PRIVATE = (
    "reproducible noise (--reproducible-noise): the DP noise and sampling are derived from "
    "the public seed, so anyone holding it can replay them; this run is NOT private"
)


@dataclass
class SiteRandomness:
    """One site's privacy-protecting randomness for one round."""

    sampling: np.random.Generator  # Poisson batches, private selection noise
    noise: torch.Generator  # DP-SGD noise
    reproducible: bool


def secret() -> SiteRandomness:
    """Fresh randomness from OS entropy; nothing about it is kept."""
    noise = torch.Generator()
    noise.manual_seed(secrets.randbits(63))
    return SiteRandomness(np.random.default_rng(np.random.SeedSequence()), noise, False)


def reproducible(public: np.random.Generator) -> SiteRandomness:
    """Randomness derived from a public generator (tests only: not private)."""
    noise = torch.Generator()
    noise.manual_seed(int(public.integers(2**62)))
    return SiteRandomness(public, noise, True)
