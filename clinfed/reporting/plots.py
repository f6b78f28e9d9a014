"""The report's plots (PNG): epsilon spent per site by round, PLD and the
RDP bound; held-out F1 by round against the run without DP; what each
site sent, by round and block."""

from __future__ import annotations

import io
from typing import Any

import matplotlib

from clinfed.privacy.accountants import RELATION, Mechanism, reference_epsilon

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _integer_rounds(ax, rounds: list[int]) -> None:
    """Round axes show whole rounds only."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if rounds:
        ax.set_xlim(min(rounds) - 0.3, max(rounds) + 0.3)


def _epsilon_curves(lines: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float]]:
    """Per round: the ledger's epsilon (PLD) and the RDP bound of the same
    mechanisms, cumulative."""
    rounds, pld, rdp, mechanisms = [], [], [], []
    by_round: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        by_round.setdefault(line["round"], []).append(line)
    for rnd in sorted(by_round):
        for line in by_round[rnd]:
            mechanisms.append(Mechanism.from_line(line))
        delta = by_round[rnd][-1].get("delta", 1e-5)
        rounds.append(rnd)
        pld.append(by_round[rnd][-1]["epsilon"])
        rdp.append(reference_epsilon(mechanisms, delta, relation_of(lines)))
    return rounds, pld, rdp


def relation_of(lines: list[dict[str, Any]]) -> str:
    """The neighbouring relation a ledger's lines were accounted under."""
    return str(lines[-1].get("relation", RELATION)) if lines else RELATION


# The sent grid's values and their colours' names, as its legend says them.
SENT_COLOURS = {
    0: "grey: not",
    1: "light: without Q/K",
    2: "dark: whole",
    3: "orange: a small part",
}


def sent_legend(values: list[list[int]]) -> str:
    """The sent grid's legend: the colours the map uses, no others."""
    used = {int(v) for row in values for v in row}
    return "; ".join(SENT_COLOURS[v] for v in (2, 1, 3, 0) if v in used)


def epsilon_series(ledgers: dict[str, list[dict[str, Any]]]) -> list[tuple]:
    """(who, rounds, PLD, RDP) per distinct curve: sites whose curves
    coincide are drawn once and named together (three identical lines on
    top of each other would read as one site)."""
    curves: dict[tuple, list[str]] = {}
    for site, lines in ledgers.items():
        rounds, pld, rdp = _epsilon_curves(lines)
        key = (tuple(rounds), tuple(round(e, 6) for e in pld), tuple(round(e, 6) for e in rdp))
        curves.setdefault(key, []).append(site)
    return [
        (", ".join(sites) + (" (identical)" if len(sites) > 1 else ""), *key)
        for key, sites in curves.items()
    ]


def make_plots(
    run_data: dict[str, Any], reference_f1: float | None, grid: dict[str, Any] | None
) -> dict[str, bytes]:
    """Each plot by name (``epsilon``, ``f1``, ``layers``) as PNG bytes, from
    a run folder's records (``grid``: what each site sent, as the report's
    content holds it)."""
    records = run_data["records"]
    plots: dict[str, bytes] = {}
    if run_data["ledgers"]:
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        all_rounds: list[int] = []
        for index, (who, rounds, pld, rdp) in enumerate(epsilon_series(run_data["ledgers"])):
            all_rounds += list(rounds)
            color = f"C{index}"
            ax.plot(rounds, pld, marker="o", color=color, label=f"{who}: PLD, the budget's")
            ax.plot(rounds, rdp, linestyle=":", color=color, label=f"{who}: RDP bound")
        target = (run_data["policy"] or {}).get("target_epsilon")
        if target:
            ax.axhline(target, color="red", linestyle="--", label=f"budget {target:g}")
        ax.set_ylim(bottom=0)
        _integer_rounds(ax, all_rounds)
        ax.set(xlabel="round", ylabel="epsilon spent (cumulative)", title="Privacy spent per site")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        plots["epsilon"] = _png(fig)
    global_records = [r for r in records if "site" not in r and "f1" in r]
    key = "round" if any("round" in r for r in global_records) else "epoch"
    if global_records:
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        xs = [r[key] for r in global_records]
        ax.plot(xs, [r["f1"] for r in global_records], marker="o", label="this run")
        if reference_f1 is not None:
            ax.axhline(reference_f1, color="grey", linestyle="--", label="same run without DP")
            ax.legend(fontsize=8)
        _integer_rounds(ax, xs)
        ax.set(xlabel=key, ylabel="held-out F1", title="Model quality", ylim=(0, 1))
        plots["f1"] = _png(fig)
    values = [row["cells"] for row in grid["rows"]] if grid else []
    # A grid of one colour (FedAvg: everything, every round) says nothing
    # the table's first row does not: no picture of it.
    if len({v for row in values for v in row}) > 1:
        from matplotlib.colors import ListedColormap

        fig, ax = plt.subplots(
            figsize=(max(4.5, len(grid["columns"]) * 0.7), max(2.2, len(values) * 0.24))
        )
        cmap = ListedColormap(["#f0f0f0", "#9ecae1", "#08519c", "#fdd0a2"])
        ax.imshow(values, aspect="auto", cmap=cmap, vmin=0, vmax=3)
        ax.set_yticks(range(len(values)), [row["label"] for row in grid["rows"]], fontsize=7)
        ax.set_xticks(range(len(grid["columns"])), grid["columns"], fontsize=7, rotation=45)
        ax.set_title(f"What each site sent ({sent_legend(values)})", fontsize=8)
        plots["layers"] = _png(fig)
    return plots
