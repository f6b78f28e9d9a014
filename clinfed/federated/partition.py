"""Which training examples each site holds.

* sites from data: one per hospital, as the corpus says (i2b2 site
  folders and file stems, MIMIC-III site folders);
* ``iid``: documents (i2b2) or admissions (MIMIC-III) dealt out at random;
* ``dirichlet``: label skew; for each label (a document's dominant concept
  type, an admission's most frequent code), site shares are drawn from
  Dirichlet(alpha): small alpha, very different sites.

Examples are partitioned by group (all lines of a document go together), so
a document never straddles two sites.
"""

from __future__ import annotations

import numpy as np

from clinfed.errors import ClinfedError

PARTITIONS = ("sites", "iid", "dirichlet")


def partition(
    groups: np.ndarray,
    group_labels: np.ndarray,
    sites: np.ndarray,
    mode: str,
    count: int,
    alpha: float,
    seed: int,
) -> dict[str, np.ndarray]:
    """Site name -> indices of its training examples (``count`` synthetic
    sites under ``iid`` and ``dirichlet``).

    Parameters
    ----------
    groups
        Group id of each example (document or admission).
    group_labels
        Label of each group id (indexed by group id).
    sites
        Site of each example (used by ``mode="sites"``).
    """
    if mode not in PARTITIONS:
        raise ClinfedError(f"`partition` must be one of {', '.join(PARTITIONS)}, not {mode!r}")
    if mode == "sites":
        return {str(s): np.flatnonzero(sites == s) for s in sorted(set(sites.tolist()))}
    unique = np.unique(groups)
    if count < 1:
        raise ClinfedError("`sites` must be at least 1")
    if count > len(unique):
        raise ClinfedError(
            f"`sites` {count} is more than the {len(unique)} training documents to share out"
        )
    rng = np.random.default_rng(seed)
    if mode == "iid":
        owner = dict(zip(rng.permutation(unique).tolist(), np.arange(len(unique)) % count))
    else:
        if alpha <= 0:
            raise ClinfedError("`alpha` must be positive")
        owner = _dirichlet_owners(unique, group_labels, count, alpha, rng)
    site_of = np.array([owner[g] for g in groups.tolist()])
    width = len(str(count))
    return {f"site{c:0{width}d}": np.flatnonzero(site_of == c) for c in range(count)}


def _dirichlet_owners(
    unique: np.ndarray,
    group_labels: np.ndarray,
    count: int,
    alpha: float,
    rng: np.random.Generator,
    tries: int = 100,
) -> dict[int, int]:
    """Deal each label's groups out by Dirichlet shares; redraw until every
    site holds at least one group."""
    labels = group_labels[unique]
    for _ in range(tries):
        owner: dict[int, int] = {}
        for label in np.unique(labels):
            members = rng.permutation(unique[labels == label])
            shares = rng.dirichlet(np.full(count, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for site, part in enumerate(np.split(members, cuts)):
                owner.update(dict.fromkeys(part.tolist(), site))
        if len(set(owner.values())) == count:
            return owner
    raise ClinfedError(
        f"`alpha` {alpha} leaves some of the {count} sites without data; "
        "use a larger `alpha` or fewer `sites`"
    )
