"""``--audit-holdout``: training units each site sets aside before training,
so that ``clinfed audit`` can compare members with non-members of the same
distribution (:mod:`clinfed.runners.audit`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from clinfed.core.errors import ClinfedError

# Where a run keeps the rows set aside, and each site's last update as the
# server saw it (for the attack on updates).
AUDIT_HOLDOUT = Path("audit") / "holdout.json"
AUDIT_UPDATES = Path("audit") / "updates"


def set_aside(
    config: Any, task: Any, train: Any, sites: dict[str, np.ndarray]
) -> dict[str, dict[str, np.ndarray]]:
    """With ``--audit-holdout F``: per site, a random share F of its
    training units set aside before training (``non_members``, whole units)
    and the rest (``members``). Seeded by the run's seed, so a resume sets
    aside the same rows."""
    if not config.audit_holdout:
        return {}
    rng = np.random.default_rng([config.seed, 2718])
    parts = {}
    for site, idx in sorted(sites.items()):
        units = task.unit_rows(train.select(idx), config.privacy_unit)
        held = int(round(config.audit_holdout * len(units)))
        if held == 0 or held == len(units):
            raise ClinfedError(
                f"`audit_holdout` {config.audit_holdout}: {site} has {len(units)} units, "
                "too few to set some aside and train on the rest"
            )
        chosen = set(rng.choice(len(units), size=held, replace=False).tolist())
        out = np.sort(np.concatenate([units[u] for u in chosen]))
        kept = np.sort(np.concatenate([units[u] for u in range(len(units)) if u not in chosen]))
        parts[site] = {"members": idx[kept], "non_members": idx[out]}
    return parts


def holdout_record(config: Any, holdout: dict[str, dict[str, np.ndarray]]) -> dict:
    """``--audit-holdout``'s record of the rows each site set aside."""
    return {
        "share": config.audit_holdout,
        "unit": config.privacy_unit,
        "rows": "indices into the encoded training examples",
        "sites": {
            c: {k: v.tolist() for k, v in parts.items()} for c, parts in sorted(holdout.items())
        },
    }
