"""The report's content as plain data (``privacy.json``): read from the run
folder's own records after :mod:`clinfed.reporting.verify` checked them,
never from the data."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.core.runs import REPAIRS, cell_name
from clinfed.federated.strategies import STRATEGIES
from clinfed.privacy import releases
from clinfed.privacy.accountants import ACCOUNTANT, RELATION, Mechanism, reference_epsilon
from clinfed.privacy.policy import GROUP_SIZES, PATIENT_CAVEAT, UNIT, group_bound
from clinfed.reporting.plots import make_plots, relation_of
from clinfed.reporting.verify import load_run, read_json, read_records, verify_run


def _starting_model(raw: dict[str, Any]) -> str:
    """Where the starting model came from, in words."""
    if raw.get("public_start"):
        from clinfed.core.provenance import describe_warm_start

        words = describe_warm_start(raw["public_start"])
    else:
        words = "the encoder as given, with a new task head (no public warm start)"
    listed = raw.get("gazetteer_list")
    if listed:
        kinds = listed.get("lists")
        marks = f", a mark per list: {', '.join(kinds)}" if kinds else ""
        words += (
            f"; it marks the names of a public list in each unit's own words (gazetteer: "
            f"{listed['names']:,} names{marks}, SHA-256 {listed['sha256'][:16]}…; public "
            "input, no privacy spent)"
        )
    return words


def _public_check(text: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """--public-check in words: what the server scored, and which rounds it kept."""
    checks = {r["round"]: r["public_check"] for r in records if "public_check" in r}
    kept = [str(n) for n, c in sorted(checks.items()) if c["kept"]]
    refused = [str(n) for n, c in sorted(checks.items()) if not c["kept"]]
    return (
        f"the server scored each round's model on public text {Path(text['folder']).name} "
        f"({text['examples']:,} examples) and kept it only when it was better there than "
        f"chance (F1 rose and a sign test on the decisions it changed passed; no site's "
        f"data, no privacy spent): kept round {', '.join(kept) or 'none'}; "
        f"kept the last model instead in round {', '.join(refused) or 'none'}"
    )


def _pooled(strategy: Any) -> bool:
    """Whether the run pooled every site's data (no federation)."""
    return strategy in STRATEGIES and STRATEGIES[strategy].pooled


def _task_words(name: str) -> str:
    """The task in words, as the task describes itself."""
    from clinfed.tasks import TASKS

    task = TASKS.get(name)
    return task.description if task is not None and task.description else name


def _sent_grid(run_data: dict[str, Any]) -> dict[str, Any] | None:
    """What each site sent, by round, over every block of the model:
    embeddings, each encoder layer (whole, or without its frozen Q/K), head.
    Cells: 2 whole layer (or block) sent, 1 sent without Q/K, 3 a small part
    of its numbers (adapters, bias terms), 0 not sent."""
    sent = [r for r in run_data["records"] if "sent_blocks" in r]
    if not sent:
        return None
    layers = max(int(r.get("num_layers", 0)) for r in sent)
    columns = ["embeddings"] + [f"layer {i}" for i in range(layers)] + ["head"]
    rows = []
    for record in sorted(sent, key=lambda r: (r["round"], r["site"])):
        blocks, share = set(record["sent_blocks"]), record.get("sent_share")
        cells = [_sent_cell(["embeddings"], blocks, share)]
        for i in range(layers):
            kinds = [f"layer{i}.{k}" for k in ("query_key", "value", "rest")]
            cells.append(_sent_cell(kinds, blocks, share))
        cells.append(_sent_cell(["head"], blocks, share))
        rows.append({"label": f"round {record['round']}, {record['site']}", "cells": cells})
    return {"columns": columns, "rows": rows}


# A block counts as sent whole when the upload holds this share of its numbers.
WHOLE = 0.999


def _sent_cell(keys: list[str], blocks: set[str], share: dict[str, float] | None) -> int:
    """One grid cell over ``keys`` (a layer's blocks, or one block): 2 all
    sent whole, 1 some sent whole (a layer without its frozen Q/K), 3 a
    small part of their numbers, 0 none (records before shares were kept
    count every named block as whole)."""
    there = [k for k in keys if k in blocks]
    if not there:
        return 0
    if share is not None and any(share.get(k, 0.0) < WHOLE for k in there):
        return 3
    return 2 if len(there) == len(keys) else 1


def _site_rows(run_data: dict[str, Any]) -> list[dict[str, Any]]:
    policy = run_data["policy"] or {}
    rows = []
    for site, lines in run_data["ledgers"].items():
        mechanisms = [Mechanism.from_line(x) for x in lines]
        delta = lines[0]["delta"] if lines else policy.get("delta", 1e-5)
        sgd = [x for x in lines if x["mechanism"] == "dp-sgd"]
        sent = [r for r in run_data["records"] if r.get("site") == site and "bytes_up" in r]
        rows.append(
            {
                "site": site,
                "examples": policy.get("sites", {}).get(site, {}).get("examples"),
                "noise_multiplier": sgd[-1]["noise_multiplier"] if sgd else None,
                "sample_rate": sgd[-1]["sample_rate"] if sgd else None,
                "steps_per_round": sgd[-1]["steps"] if sgd else None,
                # Round 0 holds a release made once per dataset (its count).
                "rounds_accounted": len({x["round"] for x in lines if x["round"] > 0}),
                "epsilon": lines[-1]["epsilon"] if lines else 0.0,
                "epsilon_rdp": (
                    reference_epsilon(mechanisms, delta, relation_of(lines)) if mechanisms else 0.0
                ),
                "delta": delta,
                "mb_sent": sum(r["bytes_up"] for r in sent) / 1e6,
                "refused_rounds": [
                    r["round"]
                    for r in run_data["records"]
                    if r.get("site") == site and r.get("refused")
                ],
            }
        )
    return rows


def _selection_text(config: dict[str, Any], policy: dict[str, Any] | None) -> str:
    strategy = config.get("strategy", "")
    if not (strategy in STRATEGIES and STRATEGIES[strategy].selects_layers):
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


def _reference_f1(run: Path, config: dict[str, Any], reference: Path | None) -> float | None:
    """The F1 of the same run without DP: ``reference`` (a run folder), or
    the sweep cell beside ``run`` with epsilon inf and the same seed."""
    if reference is None:
        guess = run.parent / cell_name(str(config.get("strategy")), math.inf, int(config["seed"]))
        if guess.resolve() == run.resolve() or not (guess / "summary.json").is_file():
            return None
        reference = guess
    elif Path(reference).resolve() == run.resolve():
        raise ClinfedError(
            f"`reference` {reference}: names the run itself; give the same run without DP"
        )
    path = Path(reference) / "summary.json"
    summary = read_json(path)
    if summary is None:
        raise ClinfedError(f"{reference}: no summary.json (not a finished run folder?)")
    value = summary.get("f1")
    return float(value) if isinstance(value, (int, float)) else None


def _header(run: Path, run_data: dict[str, Any], raw: dict[str, Any]) -> list[tuple[str, str]]:
    config, summary = run_data["config"], run_data["summary"]
    pooled = _pooled(config.get("strategy"))
    records = run_data["records"]
    done = max((r["round"] for r in records if "site" not in r and "round" in r), default=0)
    recorded = raw.get("versions") or {}
    versions = ", ".join(
        f"{name} {recorded.get(name, '?')}" for name in ("clinfed", "torch", "opacus", "flwr")
    )
    fingerprint = raw.get("data_fingerprint") or summary.get("data_fingerprint")
    rows = [
        ("Run folder", str(run.resolve())),
        ("Report written", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")),
        ("Run started", str(raw.get("written", "not recorded"))),
        ("Task", _task_words(str(config.get("task")))),
        ("Strategy", str(config.get("strategy"))),
        ("Model", f"{config.get('model')} (adapter: {config.get('adapter', 'none')})"),
        ("Starting model", _starting_model(raw)),
    ]
    if pooled:
        rows.append(("Epochs", str(config.get("epochs"))))
    else:
        rows.append(("Rounds", f"{done} of {config.get('rounds')} planned"))
        sites = sorted({r["site"] for r in records if "site" in r})
        rows.append(("Sites", f"{len(sites)}: {', '.join(sites)}"))
        rows.append(("Transport", "Flower" if raw.get("runner") == "flower" else "in-process"))
        rows.append(("Secure aggregation", "on" if config.get("secure_aggregation") else "off"))
        if raw.get("public_check_text"):
            rows.append(("Public check", _public_check(raw["public_check_text"], records)))
    rows.append(("Versions (at training)", versions if recorded else "not recorded"))
    rows.append(("Command", f"`{raw['command']}`" if raw.get("command") else "not recorded"))
    if fingerprint:
        rows.append(("Data fingerprint", str(fingerprint)))
    return rows


def _verdicts(content: dict[str, Any], pooled: bool) -> list[str]:
    if pooled:
        return [
            "**No privacy guarantee.** This run pooled all data in one place (centralized "
            "training): nothing was federated, and no differential privacy was used."
        ]
    if not content["differential_privacy"]:
        return [
            "**No formal privacy guarantee.** The sites trained without differential privacy: "
            "each update they sent can reveal their training data (epsilon is infinite)."
        ]
    lines = []
    target = content["target_epsilon"]
    for row in content["sites"]:
        within = target is None or row["epsilon"] <= target + 1e-9
        budget = f"of {target:g}" if target is not None else "(no target: fixed noise)"
        refused = (
            f"; refused rounds {', '.join(map(str, row['refused_rounds']))} to stay within it"
            if row["refused_rounds"]
            else ""
        )
        word = "within budget" if within else "OVER BUDGET"
        lines.append(
            f"**{row['site']}: {word}.** Epsilon {row['epsilon']:.3f} {budget} at delta "
            f"{row['delta']:g}, charged in {row['rounds_accounted']} rounds{refused}."
        )
    answered = content.get("evaluation_queries") or {}
    if answered:
        counts = ", ".join(f"{site} {n}" for site, n in sorted(answered.items()))
        lines.append(
            "**Held-out notes are outside epsilon.** The epsilon above covers the units the "
            "sites trained on. Their held-out units answered evaluation queries with exact "
            f"counts, not noised ({counts} queries in this run), of weights the server "
            "chose: a server can craft the weights it sends, so each answer is a query of its "
            "design. Declared and capped: one query per global round, on Flower at most the "
            "node's max-evaluations per dataset over every run."
        )
    if content.get("not_private"):
        lines.insert(0, f"**NOT PRIVATE.** {content['not_private']}.")
    return lines


def _meaning(content: dict[str, Any]) -> list[str]:
    """Epsilon and delta in plain words, under the run's relation and plan,
    with the unit and the group bound for several group sizes."""
    if not content["differential_privacy"] or not content["sites"]:
        return []
    worst = max(row["epsilon"] for row in content["sites"])
    delta = content["delta"]
    odds = math.exp(worst)
    covered = "the model updates"
    if content.get("private_selection"):
        covered += " and SAFL's private layer choice"
    if content.get("relation") == "add-remove":
        covered += ", and the noisy count of units each site released once"
        neighbours = "with that unit in the data as without it"
    else:
        neighbours = "with that unit in the data as with it replaced by another"
    paragraphs = [
        f"The unit of privacy is {content['unit']}. For any one such unit at a site, "
        f"what the accounting covers ({covered}) is at most e^epsilon times as likely "
        f"{neighbours}, except with probability delta. The other releases in the "
        "table of what left each hospital are declared or capped, not covered by epsilon. At the "
        f"largest epsilon spent here ({worst:.2f}), e^epsilon is {odds:,.1f}; delta is "
        f"{delta:g}, about one chance in {1 / delta:,.0f}.",
        "Smaller is stronger. Epsilon 1 or less is strong protection; up to 8 is common in "
        "published private deep learning and protects against realistic attacks far better "
        "than its worst-case meaning suggests; above 10 the worst-case guarantee is weak.",
    ]
    whole = content.get("group_of")
    if whole:
        bounds = []
        for k in GROUP_SIZES:
            eps_k, delta_k = group_bound(worst, delta, k)
            bounds.append(
                f"{k} units: no useful bound (delta reaches 1)"
                if delta_k >= 1.0
                else f"{k} units: epsilon {eps_k:.3g}, delta {delta_k:.3g}"
            )
        paragraphs.append(
            f"A whole {whole} is protected by group privacy only, by how many units it holds: "
            f"{'; '.join(bounds)}. No site sends how many units its {whole}s hold (one "
            f"{whole}'s length would leave the site exactly). `--privacy-unit {whole}` "
            f"protects whole {whole}s instead."
        )
    return paragraphs


def _summary(content: dict[str, Any]) -> list[str]:
    """The first screen in plain words, for the person who signs it: what is
    protected and at what epsilon, what is not, what the server could learn
    outside epsilon, and how to add the comparison and the audit."""
    if content["pooled"]:
        return ["The sites' data was pooled in one place, without DP: nothing is protected."]
    if not content["differential_privacy"] or not content["sites"]:
        return ["The sites trained without differential privacy: nothing they sent is protected."]
    worst = max(row["epsilon"] for row in content["sites"])
    relation = content.get("relation") or RELATION
    whole = content.get("group_of")
    queries = sum((content.get("evaluation_queries") or {}).values())
    said = [
        f"Each hospital's training data is protected unit by unit, the unit being "
        f"{content['unit']}: at epsilon {worst:.2f} or less (delta {content['delta']:g}), what "
        "the server received is nearly as likely with any one unit in a hospital's data as "
        + ("without it. " if relation == "add-remove" else "with it replaced by another. ")
        + (
            f"A whole {whole} is protected only by group privacy (a much weaker bound, below); "
            f"`--privacy-unit {whole}` protects whole {whole}s. "
            if whole
            else ""
        )
        + "Outside epsilon the server learned the exact evaluation counts of the held-out "
        f"notes ({queries} queries, on weights it chose) and when each reply came"
        + (", and each hospital's exact number of units" if relation == "replace-one" else "")
        + "."
    ]
    if content.get("not_private"):
        said[0] = f"**This run is not private.** {content['not_private']}. " + said[0]
    steps = []
    if content.get("reference_f1") is None:
        steps.append(
            "the cost of privacy: train the same run with `--target-epsilon inf`, then "
            "`clinfed report RUN --reference THAT_RUN`"
        )
    if not content.get("audit"):
        steps.append(
            "an empirical check: train with `--audit-holdout 0.1`, then `clinfed audit RUN`"
        )
    if steps:
        said.append("Not in this report yet: " + "; ".join(steps) + ".")
    return said


def record_row(field: str) -> str | None:
    """The release table's row (its first column) that covers ``field`` of a
    site's line in ``metrics.jsonl``: declared in :mod:`clinfed.privacy.releases`
    (a site's record field, or a figure the server adds)."""
    row = releases.row_of(f"record.{field}")
    key = row.key if row is not None else releases.SERVER_FIELDS.get(field)
    return releases.ROW[key].what if key is not None else None


def evaluation_queries(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many evaluation queries each site answered in the run (the global
    records whose per-site F1 names it)."""
    answered: dict[str, int] = {}
    for record in records:
        if "site" in record:
            continue
        for site in record.get("per_site_f1", {}):
            answered[site] = answered.get(site, 0) + 1
    return answered


def _released(content: dict[str, Any], config: dict[str, Any], pooled: bool) -> list[list[str]]:
    """What left each hospital: the rows of :mod:`clinfed.privacy.releases`."""
    if pooled:
        return []
    return releases.release_table(
        content["differential_privacy"],
        str(content.get("relation") or RELATION),
        secure=bool(config.get("secure_aggregation")),
        selection=content["selection"],
        label_source=content["label_source"],
    )


def _add_notices(content: dict[str, Any], run: Path) -> None:
    """What a reader must see before the verdicts' figures: a run not
    verified by its seal, an unfinished run, what a resume repaired."""
    repaired = run / REPAIRS
    if repaired.is_file():
        # What a resume repaired (clinfed.runners.resume), said where it is read first.
        said = "; ".join(
            f"round {r.get('round')}: {r.get('repair')}" for r in read_records(repaired)
        )
        content["verdicts"].append(f"**Repaired on resume.** {said}.")
    if content.get("unfinished"):
        content["verdicts"].insert(0, f"**UNFINISHED RUN.** {content['unfinished']}")
    if content["unverified"]:
        content["verdicts"].insert(0, f"**UNVERIFIED.** {content['unverified']}.")


def build(run: Path, reference: Path | None = None) -> dict[str, Any]:
    """The report's content as plain data (also ``privacy.json``)."""
    run_data = load_run(run)
    unverified = verify_run(run, run_data)
    config, policy, summary = run_data["config"], run_data["policy"], run_data["summary"]
    raw = read_json(run / "config.json") or {}
    pooled = _pooled(config.get("strategy"))
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
    reference_f1 = _reference_f1(run, config, reference)
    content: dict[str, Any] = {
        "run": str(run),
        "header": _header(run, run_data, raw),
        "strategy": config.get("strategy"),
        "task": config.get("task"),
        "pooled": pooled,
        "differential_privacy": private,
        "not_private": not_private,
        "unit": (policy or {}).get("unit", UNIT),
        "patient_caveat": (policy or {}).get("patient_caveat", PATIENT_CAVEAT),
        "accountant": (policy or {}).get("accountant", ACCOUNTANT) if private else None,
        "relation": (policy or {}).get("relation", RELATION),
        "target_epsilon": (policy or {}).get("target_epsilon"),
        "delta": (policy or {}).get("delta"),
        "max_grad_norm": (policy or {}).get("max_grad_norm"),
        "secure_aggregation": bool(config.get("secure_aggregation")),
        "sites": _site_rows(run_data),
        "ledger_source": (
            "Ledgers as reported by the sites over Flower (the ledgers that bind, and the "
            "budgets they enforce, stay at the sites)."
            if raw.get("runner") == "flower"
            else "Ledgers as written by the sites during the run (in-process simulation)."
        ),
        "selection": _selection_text(config, policy),
        "label_source": run_data["labels"].get("source", "fixed by the task"),
        "final_f1": summary.get("f1"),
        "reference_f1": reference_f1,
        "stopped": summary.get("stopped"),
        "audit": run_data["audit"],
        "sent": _sent_grid(run_data),
    }
    content["group_of"] = (policy or {}).get("group_of")
    content["private_selection"] = (
        private
        and config.get("selection") == "private"
        and (config.get("strategy") in STRATEGIES and STRATEGIES[config["strategy"]].selects_layers)
    )
    content["evaluation_queries"] = evaluation_queries(run_data["records"])
    if not summary and not pooled:
        done = (run_data["state"] or {}).get("round", 0)
        content["unfinished"] = (
            f"The run committed round {done} of {config.get('rounds')} planned and wrote no "
            "summary: every figure here is as of that round (charges may run a round ahead "
            "of the commit). Resume it with clinfed train --resume --out RUN."
        )
    content["unverified"] = unverified
    content["verdicts"] = _verdicts(content, pooled)
    _add_notices(content, run)
    content["meaning"] = _meaning(content)
    content["summary"] = _summary(content)
    content["released"] = _released(content, config, pooled)
    content["_plots"] = make_plots(run_data, reference_f1, content["sent"])
    return content
