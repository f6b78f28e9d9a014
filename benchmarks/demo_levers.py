"""One run of the demo's plan on the demo's corpus, with one lever changed.

Usage (from the repository root, after ``make install``)::

    .venv/bin/python benchmarks/demo_levers.py OUT dp|nodp PUBLIC|none '{"setting": value}'

``OUT`` is a new run folder; ``dp`` runs at the demo's epsilon 8, ``nodp``
without DP; ``PUBLIC`` is a folder of public annotated text for the warm
start (``clinfed/public`` is what the demo ships) or ``none``; the JSON
object overrides settings (``"_plan": "bias"`` picks the demo's other plan).
The corpus is the demo's (3 synthetic hospitals x 30 notes, seed 0), written
once to ``benchmarks/results/demo-corpus``.

``PUBLIC`` may also be the folder ``clinfed demo --out`` wrote: the run then
repeats that demo's run (its plan, its ``data/``, its 10% audit holdout)
from its starting model (``start/``) with no warm start, which is how the
demo's private rounds are drawn again with fresh secret noise. Prints one
JSON line: F1 by
round, final F1, epsilon per site. One thread per run, so two runs share 2
cores; each run takes 1.5 to 5 minutes on MiniLM.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from clinfed.core.runs import read_jsonl
from clinfed.runners.demo import COMMON, PLANS, SEED, SITES
from clinfed.runners.pipeline import RunConfig, run_training
from clinfed.tasks.i2b2.synth import generate

DATA = Path(__file__).resolve().parent / "results" / "demo-corpus"


def main(out: Path, dp: bool, public: str, extra: dict) -> dict:
    if not DATA.exists():
        # Written aside, then renamed: two runs started together never read
        # a half-written corpus.
        partial = DATA.with_name(f"{DATA.name}.{os.getpid()}.partial")
        generate(partial, sites=SITES, docs=30, seed=SEED)
        try:
            partial.rename(DATA)
        except OSError:  # the other run's corpus got there first (the same one)
            shutil.rmtree(partial)
    if (Path(public) / "demo.json").is_file():
        return _repeat_demo(out, dp, Path(public), extra)
    plan = extra.pop("_plan", "safl+fedfrozen")
    keys = ("public_data", "public_types", "public_examples", "audit_holdout")
    settings = {k: v for k, v in COMMON.items() if k not in keys} | PLANS[plan]
    settings |= {"model": "minilm", "threads": 1, "seed": SEED}
    if not dp:
        settings.pop("target_epsilon")
    if public != "none":
        settings |= {"public_data": public, "public_types": "Disease=problem,Chemical=treatment"}
    settings |= extra
    return _run(out, dp, public, extra, DATA, settings)


def _repeat_demo(out: Path, dp: bool, demo: Path, extra: dict) -> dict:
    """The demo's run from the demo folder's own corpus and starting model."""
    plan = json.loads((demo / "demo.json").read_text())["plan"]
    settings = {k: v for k, v in COMMON.items() if not k.startswith("public_")} | PLANS[plan]
    settings |= {"model": str(demo / "start"), "threads": 1, "seed": SEED}
    if not dp:
        settings.pop("target_epsilon")
    settings |= extra
    return _run(out, dp, str(demo), extra, demo / "data", settings)


def _run(out: Path, dp: bool, public: str, extra: dict, data: Path, settings: dict) -> dict:
    summary = run_training(RunConfig.of(data=str(data), out=str(out), **settings))
    rounds = [r for r in read_jsonl(out / "metrics.jsonl") if "f1" in r and "client" not in r]
    return {
        "out": str(out),
        "dp": dp,
        "public": public,
        "extra": extra,
        "f1_by_round": [round(r["f1"], 4) for r in rounds],
        "f1": round(summary["f1"], 4),
        "epsilon": summary.get("epsilon"),
    }


if __name__ == "__main__":
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2] == "dp", sys.argv[3], extra)))
