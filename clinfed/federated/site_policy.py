"""A site's privacy policy, the same in every transport: its DP-SGD
settings calibrated from the unit count it released (under add/remove, a
noisy count drawn once per dataset and kept beside its ledger)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from clinfed.privacy.count import count_path
from clinfed.privacy.policy import PrivacyPolicy


def privacy_policy(
    config: Any,
    task: Any,
    train: dict[str, Any],
    folder: Path,
    strategy: Any,
    memo: Path | None = None,
    ledger_paths: dict[str, Path] | None = None,
    ledger_budget: float | None = None,
    ledger_mark: Path | None = None,
    run: str | None = None,
) -> PrivacyPolicy:
    """Each site's DP-SGD settings and ledger (``train``: each site's encoded
    training examples). A site calibrates from its own number of privacy
    units only, so it gets the same noise in every transport.
    ``ledger_paths``: ledgers that outlive the run (a node's, one per
    dataset; default ``folder/<site>.jsonl``); a released count is kept
    beside its ledger. ``ledger_budget``, ``ledger_mark``, ``run``: a
    node's cap over every run, its ledgers' high-water mark and the run
    charging them (:class:`~clinfed.federated.assembly.SitePlace`)."""
    from clinfed.privacy.recipe import steps_per_epoch

    target = config.target_epsilon
    unit = config.privacy_unit
    ledger_paths = dict(ledger_paths or {})
    sites_units = {site: task.unit_rows(data, unit) for site, data in train.items()}
    sizes = {site: len(units) for site, units in sites_units.items()}
    if config.neighbours == "add-remove":
        sizes = {
            site: released_count(
                config, site, n, count_path(ledger_paths.get(site, folder / f"{site}.jsonl"))
            )
            for site, n in sizes.items()
        }
    policy = PrivacyPolicy.build(
        folder,
        sizes,
        config.batch_size,
        config.local_epochs,
        config.rounds,
        config.delta,
        None if target is None or math.isinf(target) else target,
        config.noise_multiplier,
        config.max_grad_norm,
        config.clipping,
        strategy.selection_mechanism(),
        strategy.trainings_per_round,
        config.reproducible_noise,
        reference_batch=task.defaults["batch_size"],
        memo=memo,
        relation=config.neighbours,
        steps_per_epoch=steps_per_epoch(config.adapter),
    )
    policy.ledger_paths = ledger_paths
    policy.ledger_budget, policy.ledger_mark, policy.run = ledger_budget, ledger_mark, run
    policy.unit, policy.unit_text = unit, task.units[unit]
    if unit == "example":
        # What groups the units, for the group bound; never how many a
        # group holds (one note's length, exact).
        policy.group_of = next((g for g in ("patient", "document") if g in task.units), None)
    return policy


def released_count(config: Any, site: str, units: int, kept_at: Path) -> int:
    """Under add/remove neighbours, the unit count ``site`` releases: the one
    kept at ``kept_at`` (beside its ledger: one per dataset), or a fresh
    noisy draw from its secret randomness (clinfed.privacy.count; kept before
    anything covering it leaves)."""
    from clinfed.federated.client import site_generator
    from clinfed.privacy.count import kept_count, noisy_count
    from clinfed.privacy.randomness import reproducible, secret

    kept = kept_count(kept_at)
    if kept is not None:
        return kept
    if config.reproducible_noise:
        randomness = reproducible(site_generator(config.seed, 0, site))
    else:
        randomness = secret()
    return noisy_count(units, randomness.noise)
