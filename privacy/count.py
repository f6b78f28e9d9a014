"""A site's unit count, released once under its own noise, so that the
rest of its releases are accounted under add/remove neighbours.

Under replace-one (``--neighbours replace-one``) a site releases its exact
number of privacy units: the aggregation weight, and through the sampling
rate and the number of steps, everything it trains. Neighbouring datasets
then have the same size and differ in one replaced unit, which costs about
twice the sensitivity of adding or removing one.

Under add/remove (the default) a site instead releases ``n + N(0, s^2)``
(``s`` = :data:`COUNT_NOISE`), rounded, drawn once per ledger from its
secret randomness, and derives everything from that: its sampling rate
``batch / n_released``, its steps, its noise calibration, its aggregation
weight and its default delta cap. Nothing derived from the exact count
leaves the site through those; the whole run is then a fixed mechanism of
the dataset: the count (a Gaussian mechanism of sensitivity 1) composed with
DP-SGD's subsampled Gaussian steps, each accounted under add/remove. The
count costs little: its Renyi divergence at order ``a`` is ``a / (2 s^2)``,
about 0.03 at the orders that decide epsilon 1-8.

One draw per ledger: the released count is kept beside the site's ledger
(``<ledger>.count.json``) and every later message reuses it, so a server
that asks many times gets the same value each time (fresh draws would
average away). A Flower node keeps one ledger per dataset over every run,
so it draws once per dataset; an in-process run keeps its ledgers in its
own run folder, so each run draws (and charges) its own count, which its
report shows. A Flower node charges it on its ledger the first time
it is drawn, before any message could carry it (:meth:`Ledger.charge_once`);
an in-process run, whose ledger is the run's, charges it with its first
round. What a site still releases exactly is declared in
:mod:`clinfed.privacy.releases` (its held-out size and evaluation counts,
declared and metered).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from clinfed.privacy.accountants import Mechanism
from clinfed.privacy.durable import atomic_write_json, fsync_folder

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


def count_path(ledger: Path) -> Path:
    """Where a ledger's dataset keeps its released count: beside the ledger."""
    ledger = Path(ledger)
    return ledger.with_name(f"{ledger.stem}.count.json")


def kept_count(path: Path) -> int | None:
    """The count kept at ``path`` (:func:`count_path`), if any."""
    path = Path(path)
    if not path.is_file():
        return None
    return int(json.loads(path.read_text())["released_units"])


def keep_count(path: Path, released: int) -> int:
    """Keep ``released`` at ``path`` durably unless a count is kept there
    already; the kept count either way (the first one kept wins, also when
    two processes draw at once: a kept count is never replaced)."""
    path = Path(path)
    kept = kept_count(path)
    if kept is not None:
        return kept
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.draft")
    atomic_write_json(draft, {"released_units": released, "noise_std": COUNT_NOISE})
    try:
        os.link(draft, path)  # fails if another process kept one first
    except FileExistsError:
        pass
    finally:
        draft.unlink(missing_ok=True)
    fsync_folder(path.parent)
    return int(kept_count(path))
