"""Real text: BC5CDR (PubMed abstracts, expert chemical and disease spans).

BC5CDR's train split (``../shared/corpora/bc5cdr/train.tsv``) is cut into
three sites of consecutive sentences (about 1,520 each; abstracts stay
together except at the two cuts), its devel split likewise into each site's
held-out part, so the global F1 is over the whole devel split. Chemical is
mapped to ``treatment`` and Disease to ``problem`` (``--types``). Measured in
one run, bundled MiniLM, seed 0:

* the dictionary baseline (training spans looked up in the test text);
* centralized (all sites pooled), FedAvg, SAFL K=2 (global selection, free)
  and FedFrozen (warm-up 2 rounds), each evaluated with ``clinfed
  evaluate`` on the devel split: strict span F1, micro and per type.

Writes ``RESULTS/real-ner-bc5cdr.json`` and ``.md`` (the README's table).

    .venv/bin/python benchmarks/real_ner.py              # about 45 minutes on 2 cores
    .venv/bin/python benchmarks/real_ner.py --quick      # tiny model, 300 sentences: a smoke run
"""

from __future__ import annotations

import argparse
import platform
import shutil
import time
from pathlib import Path

import torch

from clinfed.baselines import i2b2_dictionary
from clinfed.errors import ProblemLog
from clinfed.inference import evaluate_run
from clinfed.pipeline import RunConfig, run_training
from clinfed.runs import atomic_write_json, atomic_write_text
from clinfed.tasks.i2b2.adapter import I2b2Task

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpora" / "bc5cdr"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("campaign-runs/real-ner"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
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

    common = dict(
        task="i2b2",
        format="conll",
        types=TYPES,
        data=str(data),
        model=model,
        max_length=args.max_length,
        seed=0,
        threads=0,
    )
    plans = {
        "centralized": {"strategy": "centralized", "epochs": args.rounds},
        "fedavg": {"strategy": "fedavg", "rounds": args.rounds},
        "safl K=2": {"strategy": "safl", "rounds": args.rounds, "top_layers": 2},
        "fedfrozen": {"strategy": "fedfrozen", "rounds": args.rounds, "freeze_from": "2"},
    }
    for label, plan in plans.items():
        out = args.out / label.replace(" ", "-").replace("=", "")
        if out.exists():
            shutil.rmtree(out)
        started = time.perf_counter()
        summary = run_training(RunConfig.of(**common, **plan, out=str(out)))
        wall = time.perf_counter() - started
        metrics = evaluate_run(out, data / "test")
        rows[label] = scores(metrics) | {
            "wall_s": round(wall, 1),
            "mb_up": round(summary.get("mb_up", 0.0), 1),
        }
        print(label, rows[label], flush=True)

    result = {
        "corpus": "BC5CDR train (3 sites of consecutive sentences) / devel",
        "train_sentences": len(train_sentences),
        "devel_sentences": len(devel_sentences),
        "model": model,
        "rounds": args.rounds,
        "max_length": args.max_length,
        "seed": 0,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "wall_min": round((time.perf_counter() - started_all) / 60, 1),
        "rows": rows,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / f"{name}.json", result)
    lines = [
        f"BC5CDR, {len(train_sentences)} training sentences in 3 sites, evaluated on "
        f"{len(devel_sentences)} devel sentences; {model}, {args.rounds} rounds (epochs for "
        f"centralized), max length {args.max_length}, seed 0; {result['wall_min']} min.",
        "",
        "| method | strict F1 | Chemical F1 | Disease F1 | MB up | wall |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        lines.append(
            f"| {label} | {row['f1']:.3f} | {row['Chemical_f1']:.3f} | {row['Disease_f1']:.3f} "
            f"| {row.get('mb_up', 0.0):.1f} | {row['wall_s'] / 60:.1f} min |"
        )
    atomic_write_text(args.results / f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
