"""Real text: BC5CDR and NCBI-disease (PubMed abstracts, expert spans).

Table (a), ``--table a``: BC5CDR's train split (``../shared/corpora/bc5cdr/
train.tsv``) is cut into three sites of consecutive sentences (about 1,520
each; abstracts stay together except at the two cuts), its devel split
likewise into each site's held-out part, so the global F1 is over the whole
devel split. Chemical is mapped to ``treatment`` and Disease to ``problem``
(``--types``). Measured in one run, bundled MiniLM, seed 0:

* the dictionary baseline (training spans looked up in the test text);
* centralized (all sites pooled), FedAvg, SAFL K=2 (global selection, free)
  and FedFrozen (warm-up 2 rounds), each evaluated with ``clinfed
  evaluate`` on the devel split: strict span F1, micro and per type.

Table (b), ``--table b``: two hospitals with different annotation
guidelines. ``ncbi`` holds NCBI-disease sentences (diseases annotated, no
chemicals), ``bc5cdr`` BC5CDR sentences (chemicals and diseases); the label
set (Chemical, Disease) comes from the data. FedAvg and centralized, each
naive (``--no-partial-labels``: ncbi's O tokens teach "not a chemical") and
with the partial-label loss (the default: ncbi's O tokens may be chemicals).
Scored on each corpus's devel split: NCBI devel by Disease only (it does
not annotate chemicals, so chemical predictions there can be neither right
nor wrong), BC5CDR devel per type.

Writes ``RESULTS/real-ner-bc5cdr.json``/``.md`` (a) and
``RESULTS/real-ner-mixed.json``/``.md`` (b), the tables in docs/results.md.

    .venv/bin/python benchmarks/real_ner.py --table a    # about 35 minutes on 2 cores
    .venv/bin/python benchmarks/real_ner.py --table b    # about 30 minutes on 2 cores
    .venv/bin/python benchmarks/real_ner.py --quick      # tiny model, 300 sentences: a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from clinfed.core.errors import ProblemLog
from clinfed.core.runs import atomic_write_json, atomic_write_text
from clinfed.runners.inference import evaluate_run
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.tasks.i2b2.baselines import i2b2_dictionary

CORPORA = Path(__file__).resolve().parents[2] / "shared" / "corpora"
CORPUS = CORPORA / "bc5cdr"
TYPES = "Disease=problem,Chemical=treatment"
NAMES = {"problem": "Disease", "treatment": "Chemical"}
SITES = ("site1", "site2", "site3")


def sentences(path: Path) -> list[str]:
    blocks = path.read_text(encoding="utf-8").split("\n\n")
    return [b.strip("\n") for b in blocks if b.strip()]


def write_sites(source: list[str], folder: Path, name: str) -> None:
    third = -(-len(source) // len(SITES))
    for i, site in enumerate(SITES):
        part = source[i * third : (i + 1) * third]
        target = folder / site / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n\n".join(part) + "\n", encoding="utf-8")


def scores(metrics: dict) -> dict:
    exact = metrics["scores"]["exact"]
    return {
        "f1": exact["micro"]["f1"],
        **{NAMES[t] + "_f1": exact[t]["f1"] for t in NAMES},
    }


def run_settings(args: argparse.Namespace, data: Path, model: str) -> dict:
    """The settings every run of both tables shares (CoNLL data, seed 0)."""
    return {
        "task": "i2b2",
        "format": "conll",
        "data": str(data),
        "model": model,
        "max_length": args.max_length,
        "seed": 0,
        "threads": 0,
    }


def train_fresh(out: Path, settings: dict) -> tuple[dict, float]:
    """Train one run into a fresh ``out``: (summary, wall seconds)."""
    if out.exists():
        shutil.rmtree(out)
    started = time.perf_counter()
    summary = run_training(RunConfig.of(**settings, out=str(out)))
    return summary, time.perf_counter() - started


def record(args: argparse.Namespace, model: str, started: float, **fields) -> dict:
    """The results file's common fields (settings, machine, wall time) and ``fields``."""
    return {
        **fields,
        "model": model,
        "rounds": args.rounds,
        "max_length": args.max_length,
        "seed": 0,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "wall_min": round((time.perf_counter() - started) / 60, 1),
    }


def table_a(args: argparse.Namespace) -> None:
    limit = 300 if args.quick else None
    model = "tiny" if args.quick else args.model
    name = "real-ner-bc5cdr-quick" if args.quick else "real-ner-bc5cdr"
    started_all = time.perf_counter()

    data = args.out / "data"
    train_sentences = sentences(CORPUS / "train.tsv")[:limit]
    devel_sentences = sentences(CORPUS / "devel.tsv")[:limit]
    write_sites(train_sentences, data / "train", "train.tsv")
    write_sites(devel_sentences, data / "test", "devel.tsv")

    task = I2b2Task(format="conll", types=TYPES)
    corpus = task.load(data, ProblemLog())
    dictionary = i2b2_dictionary(corpus.train, corpus.test)
    rows = {"dictionary": scores(dictionary) | {"wall_s": 0.0}}

    common = run_settings(args, data, model) | {"types": TYPES}
    plans = {
        "centralized": {"strategy": "centralized", "epochs": args.rounds},
        "fedavg": {"strategy": "fedavg", "rounds": args.rounds},
        "safl K=2": {"strategy": "safl", "rounds": args.rounds, "top_layers": 2},
        "fedfrozen": {"strategy": "fedfrozen", "rounds": args.rounds, "freeze_from": "2"},
    }
    previous = {}
    if args.methods:
        # Rows not run now come from the last results file, marked so.
        chosen = {m.strip() for m in args.methods.split(",")}
        unknown = chosen - set(plans)
        if unknown:
            raise SystemExit(f"--methods: unknown {sorted(unknown)}; known {list(plans)}")
        last = args.results / f"{name}.json"
        if last.is_file():
            previous = json.loads(last.read_text())["rows"]
        for label in [p for p in plans if p not in chosen]:
            if label in previous:
                rows[label] = previous[label] | {"previous_run": True}
        plans = {k: v for k, v in plans.items() if k in chosen}
    for label, plan in plans.items():
        out = args.out / label.replace(" ", "-").replace("=", "")
        summary, wall = train_fresh(out, common | plan)
        metrics = evaluate_run(out, data / "test")
        rows[label] = scores(metrics) | {
            "wall_s": round(wall, 1),
            "mb_up": round(summary.get("mb_up", 0.0), 1),
            "mb_down": round(summary.get("mb_down", 0.0), 1),
        }
        print(label, rows[label], flush=True)

    result = record(
        args,
        model,
        started_all,
        corpus="BC5CDR train (3 sites of consecutive sentences) / devel",
        train_sentences=len(train_sentences),
        devel_sentences=len(devel_sentences),
        rows=rows,
    )
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / f"{name}.json", result)
    lines = [
        f"BC5CDR, {len(train_sentences)} training sentences in 3 sites, evaluated on "
        f"{len(devel_sentences)} devel sentences; {model}, {args.rounds} rounds (epochs for "
        f"centralized), max length {args.max_length}, seed 0; {result['wall_min']} min.",
        "",
        "| method | strict F1 | Chemical F1 | Disease F1 | MB up | MB down "
        "| share of FedAvg's up / down | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fedavg = rows.get("fedavg", {})
    for label, row in rows.items():
        share = "-"
        if fedavg.get("mb_up") and row.get("mb_up"):
            share = (
                f"{100 * row['mb_up'] / fedavg['mb_up']:.0f}% / "
                f"{100 * row['mb_down'] / fedavg['mb_down']:.0f}%"
            )
        if row.get("previous_run"):
            label += " (previous run)"
        lines.append(
            f"| {label} | {row['f1']:.3f} | {row['Chemical_f1']:.3f} | {row['Disease_f1']:.3f} "
            f"| {row.get('mb_up', 0.0):.1f} | {row.get('mb_down', 0.0):.1f} | {share} "
            f"| {row['wall_s'] / 60:.1f} min |"
        )
    atomic_write_text(args.results / f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def write_split(folder: Path, site: str, name: str, source: list[str]) -> None:
    target = folder / site / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n\n".join(source) + "\n", encoding="utf-8")


def table_b(args: argparse.Namespace) -> None:
    train_n, devel_n = (300, 200) if args.quick else (args.mixed_train, args.mixed_devel)
    model = "tiny" if args.quick else args.model
    name = "real-ner-mixed-quick" if args.quick else "real-ner-mixed"
    started_all = time.perf_counter()
    data = args.out / "mixed"
    corpora = {"ncbi": CORPORA / "ncbi-disease", "bc5cdr": CORPORA / "bc5cdr"}
    sizes = {}
    for site, folder in corpora.items():
        train = sentences(folder / "train.tsv")[:train_n]
        devel = sentences(folder / "devel.tsv")[:devel_n]
        write_split(data / "train", site, "train.tsv", train)
        write_split(data / "test", site, "devel.tsv", devel)
        # each devel split alone, to score it by the types its corpus annotates
        write_split(data / f"devel-{site}", site, "devel.tsv", devel)
        sizes[site] = {"train_sentences": len(train), "devel_sentences": len(devel)}

    common = run_settings(args, data, model)
    plans = {
        f"{strategy} {mode}": {"strategy": strategy, "partial_labels": mode == "partial"}
        | ({"epochs": args.rounds} if strategy == "centralized" else {"rounds": args.rounds})
        for strategy in ("fedavg", "centralized")
        for mode in ("naive", "partial")
    }
    rows = {}
    for label, plan in plans.items():
        out = args.out / ("mixed-" + label.replace(" ", "-"))
        _, wall = train_fresh(out, common | plan)
        ncbi = evaluate_run(out, data / "devel-ncbi")["scores"]["exact"]
        bc5 = evaluate_run(out, data / "devel-bc5cdr")["scores"]["exact"]
        rows[label] = {
            "ncbi_disease_f1": ncbi["Disease"]["f1"],
            "bc5cdr_chemical_f1": bc5["Chemical"]["f1"],
            "bc5cdr_chemical_recall": bc5["Chemical"]["recall"],
            "bc5cdr_disease_f1": bc5["Disease"]["f1"],
            "bc5cdr_f1": bc5["micro"]["f1"],
            "wall_s": round(wall, 1),
        }
        print(label, rows[label], flush=True)

    result = record(
        args,
        model,
        started_all,
        corpus="NCBI-disease (site ncbi, diseases only) + BC5CDR (site bc5cdr, both types)",
        sizes=sizes,
        rows=rows,
    )
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / f"{name}.json", result)
    lines = [
        f"Site ncbi: {sizes['ncbi']['train_sentences']} NCBI-disease training sentences "
        f"(diseases only); site bc5cdr: {sizes['bc5cdr']['train_sentences']} BC5CDR sentences "
        f"(chemicals and diseases). Scored on {sizes['ncbi']['devel_sentences']} NCBI and "
        f"{sizes['bc5cdr']['devel_sentences']} BC5CDR devel sentences; {model}, {args.rounds} "
        f"rounds (epochs for centralized), max length {args.max_length}, seed 0; "
        f"{result['wall_min']} min.",
        "",
        "| method | NCBI Disease F1 | BC5CDR Chemical F1 (recall) | BC5CDR Disease F1 "
        "| BC5CDR strict F1 | wall |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        lines.append(
            f"| {label} | {row['ncbi_disease_f1']:.3f} | {row['bc5cdr_chemical_f1']:.3f} "
            f"({row['bc5cdr_chemical_recall']:.3f}) | {row['bc5cdr_disease_f1']:.3f} "
            f"| {row['bc5cdr_f1']:.3f} | {row['wall_s'] / 60:.1f} min |"
        )
    atomic_write_text(args.results / f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=("a", "b"), default="a")
    parser.add_argument("--out", type=Path, default=Path("campaign-runs/real-ner"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--mixed-train", type=int, default=1500, help="(b) sentences per site")
    parser.add_argument("--mixed-devel", type=int, default=1000, help="(b) devel sentences each")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--methods",
        help="(a) only these rows, comma-separated (centralized, fedavg, safl K=2, fedfrozen); "
        "the others are kept from the last results file and marked",
    )
    args = parser.parse_args()
    (table_a if args.table == "a" else table_b)(args)


if __name__ == "__main__":
    main()
