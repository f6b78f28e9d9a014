"""How much a DP release of the sites' frequent entity names could teach.

Usage (from the repository root, after ``benchmarks/dp_utility.py --corpus
bc5cdr --public lexicon`` has made the corpus folder)::

    .venv/bin/python benchmarks/name_release.py runs/bc5cdr-corpus \\
        --public runs/bc5cdr-corpus/public-lexicon \\
        --out benchmarks/results/name-release/bc5cdr-lexicon.json

The question: private models lose most on names that only the sites' text
holds (``benchmarks/seen_names.py``: 0.727 against 0.914 without DP from the
lexicon start). Could each site release, under DP, the names it holds often
enough, so that the warm start's public text could be tagged with them
before round 1? The mechanism is Gaussian partition selection, per site
(Gopi et al. 2020, "Differentially private set union"; Desfontaines et al.
2022, "Differentially private partition selection"):

* each sentence (the privacy unit) contributes at most ``k`` distinct
  (type, name) pairs, each with weight 1: L2 sensitivity sqrt(k), L-infinity 1;
* Gaussian noise of standard deviation ``z * sqrt(k)`` on each name's count,
  ``z`` calibrated by dp-accounting's PLD under add/remove so that the
  counts cost ``epsilon`` at delta 5e-6;
* a name is released when its noised count passes ``T = 1 + sigma *
  Phi^-1(1 - 5e-6 / k)``: a name that one sentence alone holds is released
  with probability at most 5e-6 (total delta 1e-5).

For each ``epsilon`` and ``k`` it prints the threshold, the names a site
releases (expected count), how many of them the public text does not
already hold, and the share of the test split's mentions whose name is
"only the sites'" and would be released (each mention weighted by the
probability its name is released at some site). That share bounds the
lever: if every such mention were then found as well as public names are
without DP, F1 would rise by at most ``share x (0.953 - 0.727)``.

Only counts are printed and saved, never a name.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from statistics import NormalDist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from seen_names import conll_spans, names  # noqa: E402

from clinfed.privacy.accountant import epsilon as pld_epsilon  # noqa: E402
from clinfed.privacy.accountants import Mechanism  # noqa: E402

DELTA_GAUSS = 5e-6
DELTA_THRESHOLD = 5e-6
# From benchmarks/results/seen-names/bc5cdr-lexicon.json: strict F1 on names
# the public text holds (no DP) and on names only the sites hold (private).
F1_PUBLIC_NO_DP, F1_SITES_ONLY_PRIVATE = 0.953, 0.727


def noise_multiplier(target: float) -> float:
    """``z`` such that one Gaussian release of sensitivity 1 costs ``target``
    at :data:`DELTA_GAUSS` under add/remove (PLD), by bisection."""

    def cost(z: float) -> float:
        return pld_epsilon([Mechanism("names", z, 1.0, 1)], DELTA_GAUSS, "add-remove")

    low, high = 0.3, 64.0
    for _ in range(40):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if cost(middle) > target else (low, middle)
    return high


def site_counts(folder: Path, k: int) -> dict[str, Counter]:
    """Per site: how many sentences hold each (type, name), at most ``k`` a sentence."""
    counts = {}
    for path in sorted(folder.rglob("*.tsv")):
        by_sentence: dict[int, list[tuple[str, str]]] = {}
        for line, _, _, kind, name in conll_spans(path):
            held = by_sentence.setdefault(line, [])
            if (kind, name) not in held:
                held.append((kind, name))
        counts[path.parent.name] = Counter(
            pair for held in by_sentence.values() for pair in held[:k]
        )
    return counts


def release_probability(
    pair: tuple[str, str], counts: dict[str, Counter], threshold: float, sigma: float
) -> float:
    """Probability that at least one site's noised count of ``pair`` passes ``threshold``."""
    missed = 1.0
    for site in counts.values():
        missed *= NormalDist().cdf((threshold - site[pair]) / sigma)
    return 1 - missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", type=Path, help="dp_utility.py's corpus folder")
    parser.add_argument("--public", type=Path, required=True, help="the public text (CoNLL)")
    parser.add_argument("--epsilon", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--per-sentence", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    public = names(args.public)
    test = [
        (kind, name)
        for path in sorted((args.corpus / "data" / "test").rglob("*.tsv"))
        for *_, kind, name in conll_spans(path)
    ]
    everything = site_counts(args.corpus / "data" / "train", k=10**6)
    held = set().union(*everything.values())
    sites_only = [pair for pair in test if pair not in public and pair in held]
    normal = NormalDist()
    rows = []
    for k in args.per_sentence:
        counts = site_counts(args.corpus / "data" / "train", k)
        for target in args.epsilon:
            z = noise_multiplier(target)
            sigma = z * math.sqrt(k)
            threshold = 1 + sigma * normal.inv_cdf(1 - DELTA_THRESHOLD / k)

            every = set().union(*counts.values())
            chance = {pair: release_probability(pair, counts, threshold, sigma) for pair in every}
            expected = sum(chance.values())
            new = sum(chance[pair] for pair in every - public)
            covered = sum(chance.get(pair, 0.0) for pair in sites_only)
            rows.append(
                {
                    "epsilon": target,
                    "names_per_sentence": k,
                    "noise_multiplier": round(z, 3),
                    "threshold": round(threshold, 1),
                    "names_released": round(expected, 1),
                    "not_in_public_text": round(new, 1),
                    "sites_only_test_mentions_covered": round(covered, 1),
                    "share_of_test_mentions": round(covered / len(test), 4),
                    "f1_points_at_most": round(
                        100 * covered / len(test) * (F1_PUBLIC_NO_DP - F1_SITES_ONLY_PRIVATE), 2
                    ),
                }
            )
            print(json.dumps(rows[-1]))
    top = max(max(site.values()) for site in everything.values())
    result = {
        "command": " ".join(["benchmarks/name_release.py", *sys.argv[1:]]),
        "test_mentions": len(test),
        "sites_only_test_mentions": len(sites_only),
        "most_sentences_one_name_holds_at_a_site": top,
        "rows": rows,
    }
    print(
        f"test mentions {len(test)}, names only the sites hold {len(sites_only)}, "
        f"the most sentences one name holds at one site {top}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
