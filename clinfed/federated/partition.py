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

from typing import Any

import numpy as np

from clinfed.core.errors import ClinfedError

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


def deal_sites(config: Any, task: Any, corpus: Any, train: Any, test: Any):
    """Training and held-out example indices per site. With sites from
    the data each hospital evaluates on its own held-out examples; with
    synthetic sites the held-out set is dealt out the same way."""
    groups, labels = task.partition_keys(corpus.train, train)
    sites = partition(
        groups,
        labels,
        np.asarray(train["site"]),
        config.partition,
        config.sites,
        config.alpha,
        config.seed,
    )
    test_groups, test_labels = task.partition_keys(corpus.test, test)
    try:
        test_parts = partition(
            test_groups,
            test_labels,
            np.asarray(test["site"]),
            config.partition,
            config.sites,
            config.alpha,
            config.seed,
        )
    except ClinfedError:
        # Fewer held-out documents than sites: deal them out in turn.
        order = np.arange(len(test))
        test_parts = {c: order[i :: len(sites)] for i, c in enumerate(sorted(sites))}
    parts = {c: test_parts.get(c, np.array([], dtype=int)) for c in sites}
    if config.partition == "sites":
        # A site with held-out documents and no training documents is an
        # evaluation site (external validation): it evaluates every round,
        # never trains.
        for site, idx in test_parts.items():
            if site not in sites and len(idx):
                sites[site] = np.array([], dtype=int)
                parts[site] = idx
    return sites, parts
