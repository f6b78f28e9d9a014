"""The results page's DP table and plot, from ``benchmarks/dp_utility.py`` runs.

Usage::

    .venv/bin/python benchmarks/dp_results.py OUT_PREFIX RUN [RUN ...]

Each ``RUN`` is a folder ``dp_utility.py`` wrote (``RUN/dp_utility.json``)
or a copy of that file.
Rows are grouped by corpus and plan (the settings other than epsilon);
writes ``OUT_PREFIX.md`` (plan x epsilon x size: final strict F1, F1 by
round, epsilon spent, wall time, the command) and ``OUT_PREFIX.png`` (F1
against epsilon, one line per corpus and plan; no DP drawn at the right).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

PLAN_KEYS = (
    *("strategy", "adapter", "local_epochs", "lr", "head_lr", "lr_decay", "batch_size"),
    *("neighbours", "optimizer", "max_grad_norm", "dp_public_mix"),
)

# BC5CDR's train split as benchmarks/real_ner.py cuts it into sentences.
BC5CDR_TRAIN_SENTENCES = 4560


def public_name(result: dict) -> str:
    """Which public text the starting model trained on: the run's command says."""
    words = result["command"].split()
    given = words[words.index("--public") + 1] if "--public" in words else "auto"
    marks = ", names marked (--gazetteer)" if "--gazetteer" in words else ""
    if "--gazetteer-types" in words:
        marks = ", a mark per terminology (--gazetteer --gazetteer-types)"
    if given == "none":
        return "no warm start"
    if given == "terminology":
        text = "NCBI-disease"
        if "--public-definitions" in words:
            text += " and HPO's definitions"
        return f"warm start on {text} tagged by public terminologies{marks}"
    if given == "lexicon":
        text = "NCBI-disease and synthetic notes tagged by a public chemical lexicon"
        if "--held-out" in words:
            held = words[words.index("--held-out") + 1]
            text += f", then the {held} public train sentences"
        return f"warm start on {text}{marks}"
    if given != "auto":
        return "warm start on public synthetic notes"
    if result["corpus"] == "bc5cdr":
        return "warm start on NCBI-disease"
    return "warm start on PubMed"


def plan_name(result: dict) -> str:
    """The plan in a few words (the settings that are not the corpus or epsilon)."""
    settings = result["settings"]
    parts = [str(settings.get("strategy", "?"))]
    if settings.get("adapter") not in (None, "none"):
        parts.append(f"adapter {settings['adapter']}")
    for key in PLAN_KEYS[2:]:
        # Every row runs at a constant rate (the results page says so): the
        # rows made before the recipe's linear decay do not name it, later
        # ones pass lr_decay=none to run as they did; both are one plan.
        if key in settings and not (key == "lr_decay" and settings[key] == "none"):
            parts.append(f"{key.replace('_', ' ')} {settings[key]}")
    parts.append(public_name(result))
    return ", ".join(parts)


def corpus_name(result: dict) -> str:
    if result["corpus"] == "bc5cdr":
        words = result["command"].split()
        if "--held-out" in words:  # those sentences are public, no site's
            held = int(words[words.index("--held-out") + 1])
            per_site = (BC5CDR_TRAIN_SENTENCES - held) // 3
            return f"BC5CDR less {held} train sentences made public, 3 sites of ~{per_site:,}"
        return "BC5CDR, 3 sites of ~1,520 sentences"
    docs = (
        int(result["command"].split("--docs")[1].split()[0])
        if "--docs" in result["command"]
        else 160
    )
    return f"synthetic i2b2, 3 sites x {docs} notes"


def main(prefix: Path, runs: list[Path]) -> None:
    rows = []
    for run in runs:
        path = run if run.suffix == ".json" else run / "dp_utility.json"
        result = json.loads(path.read_text())
        settings = result["settings"]
        epsilon = settings.get("target_epsilon", math.inf)
        rows.append(
            {
                "corpus": corpus_name(result),
                "plan": plan_name(result),
                "epsilon": epsilon,
                "f1": result["f1"],
                "by_round": [r["f1"] for r in result["rounds"]],
                "spent": max((result.get("epsilon") or {}).values(), default=None),
                "wall_min": result["wall_s"] / 60,
                "command": result["command"],
            }
        )
    rows.sort(key=lambda r: (r["corpus"], r["plan"], r["epsilon"]))
    lines = [
        "| corpus | plan | target epsilon | strict F1 | F1 by round | epsilon spent | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "no DP" if math.isinf(r["epsilon"]) else f"{r['epsilon']:g}"
        spent = "-" if r["spent"] is None else f"{r['spent']:.2f}"
        rounds = ", ".join(f"{f:.3f}" for f in r["by_round"])
        lines.append(
            f"| {r['corpus']} | {r['plan']} | {eps} | **{r['f1']:.3f}** | {rounds} | {spent} "
            f"| {r['wall_min']:.1f} min |"
        )
    lines += ["", "Commands, in the table's order:", "", "```bash"]
    lines += [r["command"] for r in rows] + ["```", ""]
    prefix.with_suffix(".md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(list)
    for r in rows:
        groups[(r["corpus"], r["plan"])].append(r)
    finite = sorted({r["epsilon"] for r in rows if not math.isinf(r["epsilon"])})
    no_dp_x = (max(finite) * 2) if finite else 16
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colours = plt.get_cmap("tab20").colors
    for index, ((corpus, plan), members) in enumerate(sorted(groups.items())):
        xs = [no_dp_x if math.isinf(r["epsilon"]) else r["epsilon"] for r in members]
        ax.plot(
            xs,
            [r["f1"] for r in members],
            # tab20 has 20 colours: past them the marker tells the lines apart.
            marker="os^D"[index // len(colours) % 4],
            color=colours[index % len(colours)],
            linestyle="-" if "adapter" in plan else "--",
            # Wrapped: an unwrapped long label widens the saved figure past the axes.
            label=textwrap.fill(f"{corpus}: {plan.replace('fedavg, ', '')}", 130),
        )
    ax.set_xscale("log")
    ticks = finite + [no_dp_x]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in finite] + ["no DP"])
    ax.set_xlabel("epsilon per site (delta 1e-5)")
    ax.set_ylabel("strict span F1 (held-out)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title("F1 against epsilon (MiniLM, 3 rounds, seed 0)")
    fig.tight_layout()
    # Below the figure, anchored to it rather than to the axes: the labels are
    # long, and an axes-anchored legend grows up over the x-axis label.
    fig.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=1)
    fig.savefig(prefix.with_suffix(".png"), dpi=110, bbox_inches="tight")  # the whole legend
    print(prefix.with_suffix(".md").read_text())


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
