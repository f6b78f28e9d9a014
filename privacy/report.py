"""``clinfed report RUN``: what a run released and what it cost, for a
privacy officer.

Reads only the run folder's own records (config, policy, ledgers, metrics,
summary, audit), never the data, so no note text can reach the report.
Writes ``RUN/report/report.html`` (one self-contained page, plots inlined),
``report.md`` (same text, plots beside it as PNG) and ``privacy.json``.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import matplotlib

from clinfed.errors import ClinfedError
from clinfed.privacy.accountant import (
    ACCOUNTANT,
    REFERENCE_ACCOUNTANT,
    Mechanism,
    reference_epsilon,
)
from clinfed.privacy.policy import PATIENT_CAVEAT, UNIT
from clinfed.runs import atomic_write_json, atomic_write_text, read_jsonl
from clinfed.settings import read_run_config

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _load(run: Path) -> dict[str, Any]:
    for name in ("config.json", "metrics.jsonl"):
        if not (run / name).is_file():
            raise ClinfedError(f"{run}: no {name} (not a clinfed run folder?)")
    records = read_jsonl(run / "metrics.jsonl")
    policy_path = run / "privacy" / "policy.json"
    ledgers = {path.stem: read_jsonl(path) for path in sorted((run / "privacy").glob("*.jsonl"))}
    summary_path, audit_path = run / "summary.json", run / "audit.json"
    labels_path = run / "labels.json"
    return {
        "labels": json.loads(labels_path.read_text()) if labels_path.is_file() else {},
        "config": read_run_config(run),
        "records": records,
        "policy": json.loads(policy_path.read_text()) if policy_path.is_file() else None,
        "ledgers": ledgers,
        "summary": json.loads(summary_path.read_text()) if summary_path.is_file() else {},
        "audit": json.loads(audit_path.read_text()) if audit_path.is_file() else None,
    }


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _plots(run_data: dict[str, Any]) -> dict[str, bytes]:
    records = run_data["records"]
    plots: dict[str, bytes] = {}
    if run_data["ledgers"]:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for site, lines in run_data["ledgers"].items():
            by_round: dict[int, float] = {}
            for line in lines:
                by_round[line["round"]] = line["epsilon"]
            ax.plot(list(by_round), list(by_round.values()), marker="o", label=site)
        target = (run_data["policy"] or {}).get("target_epsilon")
        if target:
            ax.axhline(target, color="red", linestyle="--", label=f"budget {target:g}")
        ax.set(xlabel="round", ylabel="epsilon spent", title="Privacy spent per site")
        ax.legend(fontsize=8)
        plots["epsilon"] = _png(fig)
    global_records = [r for r in records if "client" not in r and "f1" in r]
    key = "round" if any("round" in r for r in global_records) else "epoch"
    if global_records:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot([r[key] for r in global_records], [r["f1"] for r in global_records], marker="o")
        ax.set(xlabel=key, ylabel="held-out F1", title="Model quality", ylim=(0, 1))
        plots["f1"] = _png(fig)
    sent = [r for r in records if "bytes_up" in r]
    layered = [r for r in sent if "layers" in r]
    if layered:
        sites = sorted({r["client"] for r in layered})
        rounds = sorted({r["round"] for r in layered})
        width = 1 + max(max(r["layers"]) for r in layered)
        grid = [[0.0] * width for _ in range(len(sites) * len(rounds))]
        labels = []
        for i, (rnd, site) in enumerate((rnd, site) for rnd in rounds for site in sites):
            labels.append(f"r{rnd} {site}")
            for r in layered:
                if r["round"] == rnd and r["client"] == site:
                    for layer in r["layers"]:
                        grid[i][layer] = 1.0
        fig, ax = plt.subplots(figsize=(max(4, width * 0.6), max(2.5, len(labels) * 0.22)))
        ax.imshow(grid, aspect="auto", cmap="Blues", vmin=0, vmax=1)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xticks(range(width), [f"layer {i}" for i in range(width)], fontsize=7)
        ax.set_title("Encoder layers each site sent (dark: sent)")
        plots["layers"] = _png(fig)
    return plots


def _site_rows(run_data: dict[str, Any]) -> list[dict[str, Any]]:
    policy = run_data["policy"] or {}
    rows = []
    for site, lines in run_data["ledgers"].items():
        mechanisms = [
            Mechanism(x["mechanism"], x["noise_multiplier"], x["sample_rate"], x["steps"])
            for x in lines
        ]
        delta = lines[0]["delta"] if lines else policy.get("delta", 1e-5)
        sgd = [x for x in lines if x["mechanism"] == "dp-sgd"]
        sent = [r for r in run_data["records"] if r.get("client") == site and "bytes_up" in r]
        rows.append(
            {
                "site": site,
                "examples": policy.get("sites", {}).get(site, {}).get("examples"),
                "noise_multiplier": sgd[-1]["noise_multiplier"] if sgd else None,
                "sample_rate": sgd[-1]["sample_rate"] if sgd else None,
                "steps_per_round": sgd[-1]["steps"] if sgd else None,
                "rounds_accounted": len({x["round"] for x in lines}),
                "epsilon": lines[-1]["epsilon"] if lines else 0.0,
                "epsilon_rdp": reference_epsilon(mechanisms, delta) if mechanisms else 0.0,
                "group": policy.get("sites", {}).get(site, {}).get("group"),
                "delta": delta,
                "mb_sent": sum(r["bytes_up"] for r in sent) / 1e6,
                "refused_rounds": [
                    r["round"]
                    for r in run_data["records"]
                    if r.get("client") == site and r.get("refused")
                ],
            }
        )
    return rows


def _selection_text(config: dict[str, Any], policy: dict[str, Any] | None) -> str:
    strategy = config.get("strategy", "")
    if not strategy.startswith("safl"):
        return (
            f"{strategy}: what each site sends is fixed by the strategy; no data-dependent choice."
        )
    mode = config.get("selection", "global")
    if mode == "private":
        sel = (policy or {}).get("selection") or {}
        return (
            "SAFL layer choice computed from each site's own data with Gaussian noise "
            f"(noise multiplier {sel.get('noise_multiplier', config.get('selection_noise'))}, "
            "sensitivity sqrt(layers)), charged to every site's ledger each round as "
            "'safl-selection'."
        )
    where = "the released global model" if mode == "global" else "each site's current model"
    return (
        f"SAFL layer choice ({mode}) computed on {where} with a public synthetic probe set, "
        "never on site data: it costs no privacy."
    )


def build(run: Path) -> dict[str, Any]:
    """The report's content as plain data (also ``privacy.json``)."""
    run_data = _load(run)
    config, policy, summary = run_data["config"], run_data["policy"], run_data["summary"]
    private = policy is not None
    not_private = summary.get("not_private") or next(
        (
            line["not_private"]
            for lines in run_data["ledgers"].values()
            for line in lines
            if line.get("not_private")
        ),
        None,
    )
    label_source = run_data["labels"].get("source", "fixed by the task")
    releases = [
        "the model updates listed per round (parameters of the planned layers only)",
        "each site's number of training examples (the weight of its update in the average)",
        "evaluation counts, once per round per site (metered at the site: each round's global "
        "model once, never an older round, never other weights for the same round): summed "
        "true/false positive counts on the site's held-out examples. Those examples are not "
        "training examples and are not covered by the DP guarantee; the counts are not "
        "accounted",
        f"the label set: {label_source}",
    ]
    if private:
        releases.append(
            "the number of training examples per site is released exactly (the weight of its "
            "update, and implied by the ledger's sampling rate); the accounting is therefore "
            "under the replace-one relation, where the count is public"
        )
        releases.append(
            "not released under DP: the training loss, the number of tokens trained on and "
            "the site's wall time (kept out of the records)"
        )
    else:
        releases.append("per-site training loss (computed on private training data, no DP)")
    return {
        "run": str(run),
        "strategy": config.get("strategy"),
        "task": config.get("task"),
        "differential_privacy": private,
        "not_private": not_private,
        "unit": (policy or {}).get("unit", UNIT),
        "patient_caveat": (policy or {}).get("patient_caveat", PATIENT_CAVEAT),
        "accountant": ACCOUNTANT if private else None,
        "target_epsilon": (policy or {}).get("target_epsilon"),
        "delta": (policy or {}).get("delta"),
        "max_grad_norm": (policy or {}).get("max_grad_norm"),
        "sites": _site_rows(run_data),
        "ledger_source": (
            "Ledgers as reported by the sites over Flower (the ledgers that bind, and the "
            "budgets they enforce, stay at the sites)."
            if (policy or {}).get("reported_by_sites")
            else "Ledgers as written by the sites during the run (in-process simulation)."
        ),
        "selection": _selection_text(config, policy),
        "releases": releases,
        "final_f1": summary.get("f1"),
        "stopped": summary.get("stopped"),
        "audit": run_data["audit"],
        "_plots": _plots(run_data),
    }


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _markdown(content: dict[str, Any], images: dict[str, str]) -> str:
    lines = [f"# Privacy report: {content['run']}", ""]
    if content.get("not_private"):
        lines += [f"**NOT PRIVATE.** {content['not_private']}.", ""]
    if content["differential_privacy"]:
        lines += [
            f"Every site trained with DP-SGD. Privacy unit: {content['unit']}.",
            "",
        ]
        if content["patient_caveat"]:
            lines += [f"**Caveat.** {content['patient_caveat']}", ""]
            groups = [row for row in content["sites"] if row.get("group")]
            if groups:
                lines += [
                    "| site | units per | k max | k median | planned epsilon for k max "
                    "| delta for k max |",
                    "|---|---|---|---|---|---|",
                ]
                for row in groups:
                    group = row["group"]
                    lines.append(
                        f"| {row['site']} | {group['of']} | {group['k_max']} "
                        f"| {group['k_median']:g} | {group['planned_epsilon_for_k_max']:.3g} "
                        f"| {group['delta_for_k_max']:.3g} |"
                    )
                lines.append("")
        lines += [
            f"Budget: epsilon {_fmt(content['target_epsilon'], 'g')} at delta "
            f"{_fmt(content['delta'], 'g')}; per-unit clipping norm "
            f"{_fmt(content['max_grad_norm'], 'g')}. Accountant: {content['accountant']} "
            "(budget checks use it). Neighbouring relation: replace-one (each site's unit "
            "count is released, so the guarantee is stated for datasets of the same size that "
            "differ in one unit). The RDP column is a looser bound by another analysis "
            f"({REFERENCE_ACCOUNTANT}), for comparison.",
        ]
    else:
        lines += [
            "**This run did not use differential privacy**: the updates carry no formal "
            "guarantee (epsilon is infinite)."
        ]
    lines += ["", "## Per site", "", content["ledger_source"], ""]
    if content["sites"]:
        lines += [
            "| site | units | noise multiplier | sample rate | steps / round | rounds "
            "| epsilon | epsilon (RDP bound) | MB sent | refused rounds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in content["sites"]:
            lines.append(
                f"| {row['site']} | {_fmt(row['examples'])} | {_fmt(row['noise_multiplier'])} "
                f"| {_fmt(row['sample_rate'], '.4f')} | {_fmt(row['steps_per_round'])} "
                f"| {row['rounds_accounted']} | {row['epsilon']:.3f} | {row['epsilon_rdp']:.3f} "
                f"| {row['mb_sent']:.1f} | {', '.join(map(str, row['refused_rounds'])) or '-'} |"
            )
    else:
        lines.append("No privacy ledger: nothing was accounted.")
    for key, title in (
        ("epsilon", "Epsilon per round"),
        ("layers", "What each site sent"),
        ("f1", "Model quality"),
    ):
        if key in images:
            lines += ["", f"### {title}", "", images[key]]
    lines += ["", "## Layer choice", "", content["selection"], "", "## Everything released", ""]
    lines += [f"- {item}" for item in content["releases"]]
    lines += ["", "## Result", "", f"Final held-out F1: {_fmt(content['final_f1'], '.4f')}."]
    if content["stopped"]:
        lines.append(f"The run {content['stopped']}.")
    audit = content["audit"]
    lines += ["", "## Empirical check (membership inference)", ""]
    if audit and "final_model" in audit:
        final = audit["final_model"]
        lines += [
            f"Members: training rows; non-members: {_fmt(audit.get('holdout_share'), 'g')} of "
            "each site's training units, set aside at random before training (the same "
            f"distribution). {final['members']} members against {final['non_members']} "
            "non-members per target. 0.5 means the attack cannot tell them apart.",
            "",
            "| target | attack | AUC | 95% CI |",
            "|---|---|---|---|",
        ]
        targets = [("final model", final)] + [
            (f"{site}'s last update", attack)
            for site, attack in sorted(audit.get("site_updates", {}).items())
        ]
        for name, attack in targets:
            for key, label in (
                ("loss_threshold", "loss threshold"),
                ("calibrated_loss", "loss calibrated by the initial model"),
            ):
                result = attack[key]
                lines.append(
                    f"| {name} | {label} | {result['auc']:.3f} "
                    f"| {result['ci_low']:.3f}-{result['ci_high']:.3f} |"
                )
        lines += [
            "",
            f"In plain words: {final['loss_threshold']['reading']}.",
        ]
    else:
        lines.append("Not run. Train with `--audit-holdout 0.1`, then `clinfed audit RUN` adds it.")
    return "\n".join(lines) + "\n"


def write_report(run: Path) -> Path:
    """Write ``RUN/report/``; return that folder."""
    run = Path(run)
    content = build(run)
    plots = content.pop("_plots")
    folder = run / "report"
    folder.mkdir(exist_ok=True)
    for name, png in plots.items():
        (folder / f"{name}.png").write_bytes(png)
    md = _markdown(content, {k: f"![{k}]({k}.png)" for k in plots})
    atomic_write_text(folder / "report.md", md)
    inline = {
        k: f'<img alt="{k}" src="data:image/png;base64,{base64.b64encode(v).decode()}">'
        for k, v in plots.items()
    }
    body = _markdown(content, {k: f"@@{k}@@" for k in plots})
    page = _html(body, inline)
    atomic_write_text(folder / "report.html", page)
    atomic_write_json(folder / "privacy.json", content)
    return folder


def _html(markdown: str, images: dict[str, str]) -> str:
    """A minimal Markdown-to-HTML rendering of the report's own text."""
    out, table = [], []

    def flush_table() -> None:
        if table:
            rows = [r for r in table if not set(r.replace("|", "").strip()) <= {"-"}]
            cells = [[html.escape(c.strip()) for c in r.strip("|").split("|")] for r in rows]
            head = "".join(f"<th>{c}</th>" for c in cells[0])
            body = "".join(
                "<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in cells[1:]
            )
            out.append(f"<table><tr>{head}</tr>{body}</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("@@") and line.endswith("@@"):
            out.append(images[line.strip("@")])
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("- "):
            out.append(f"<li>{html.escape(line[2:])}</li>")
        elif line:
            text = html.escape(line).replace("**", "")
            out.append(f"<p>{text}</p>")
    flush_table()
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em}"
        "img{max-width:100%}"
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>clinfed privacy report</title>"
        f"<style>{style}</style></head><body>{''.join(out)}</body></html>\n"
    )
