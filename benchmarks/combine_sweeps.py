"""One table and one plot from several ``clinfed sweep`` folders.

Each folder's own ``sweep.csv``/``sweep.md``/``sweep.png`` are rewritten
first (with the current code's labels and wall times). A plan that appears
in two folders with the same label (the same strategy and adapter under
other settings, e.g. more local epochs) is labelled with its folder's name.

    python benchmarks/combine_sweeps.py campaign-runs/sweep-i2b2-3k \\
        campaign-runs/sweep-i2b2-3k-fedavg campaign-runs/sweep-i2b2-3k-lora \\
        campaign-runs/sweep-i2b2-3k-bias campaign-runs/sweep-i2b2-3k-bias-e3 \\
        --out benchmarks/results/sweep-i2b2-3k \\
        --title "synthetic i2b2, 3 sites x ~3,300 sentences, 3 rounds"
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import matplotlib

from clinfed.runners.sweep import collect, write_table

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="prefix of the .csv/.md/.png")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    rows, owner = [], {}
    for folder in args.sweeps:
        found = collect(folder)
        write_table(folder, found)
        for row in found:
            label = row["strategy"]
            if owner.setdefault(label, folder.name) != folder.name:
                label = f"{label} ({folder.name})"
            rows.append(row | {"plan": label, "sweep": folder.name})
    if not rows:
        raise SystemExit("no finished cells in those folders")
    plans = list(dict.fromkeys(r["plan"] for r in rows))
    epsilons = sorted({r["target_epsilon"] for r in rows})
    lines = [
        "| plan | "
        + " | ".join("no DP" if math.isinf(e) else f"eps {e:g}" for e in epsilons)
        + " |",
        "|---" * (len(epsilons) + 1) + "|",
    ]
    for plan in plans:
        cells = {r["target_epsilon"]: r["f1"] for r in rows if r["plan"] == plan}
        values = [f"{cells[e]:.3f}" if e in cells else "-" for e in epsilons]
        lines.append(f"| {plan} | " + " | ".join(values) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    with open(args.out.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    finite = [e for e in epsilons if not math.isinf(e)]
    inf_x = max(finite) * 2.5 if finite else 1.0
    for plan in plans:
        points = sorted((r["target_epsilon"], r["f1"]) for r in rows if r["plan"] == plan)
        xs = [inf_x if math.isinf(e) else e for e, _ in points]
        style = {"marker": "o"} if len(points) > 1 else {"marker": "*", "markersize": 12}
        ax.plot(xs, [f for _, f in points], label=plan, **style)
    ax.set_xscale("log")
    ax.set_xticks(finite + [inf_x], [f"{e:g}" for e in finite] + ["no DP"])
    ax.set(
        xlabel="target epsilon per site (rightmost: no DP)",
        ylabel="held-out F1",
        ylim=(0, 1),
        title=args.title,
    )
    ax.legend(fontsize=8)
    fig.savefig(args.out.with_suffix(".png"), dpi=110, bbox_inches="tight")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
