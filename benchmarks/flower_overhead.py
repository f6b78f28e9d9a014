"""Per-round cost of the Flower deployment over the in-process simulator.

The same workload both ways: synthetic i2b2, 3 sites, the bundled MiniLM,
the same RunConfig and seed (so both train exactly the same updates; the
script checks the final weights agree). The simulator runs the sites one
after another in this process; the deployment starts a SuperLink and three
SuperNodes on 127.0.0.1 (TLS) and submits the run with ``flwr run``.

A round's time is the wall time between the ends of consecutive rounds
(round 1 is left out: it includes start-up and the full-model download):
in the simulator from its ``round_end`` events, in the deployment from the
arrival of the ServerApp's ``round N: f1`` log lines; the one round engine
emits both at the same point, when round N's evaluation is recorded. Both
include one evaluation of the global model per round (the sites evaluate it
at the start of the next round, on their own test data).

The fixed cost per message is the extra wall time of a Flower round over
the simulator's, divided by the round's messages (one per site).

Writes ``RESULTS/NAME.json`` and ``.md`` (``--name``, default
``flower_overhead``).

    .venv/bin/python benchmarks/flower_overhead.py          # about 8 minutes on 2 cores
    .venv/bin/python benchmarks/flower_overhead.py --docs 100 --rounds 3 \
        --name flower_overhead_2k                           # about 2,000 sentences per site
    .venv/bin/python benchmarks/flower_overhead.py --secure --name flower_overhead_secure
    .venv/bin/python benchmarks/flower_overhead.py --strategy safl --name flower_overhead_safl
    .venv/bin/python benchmarks/flower_overhead.py --adapter lora --name flower_overhead_lora
    .venv/bin/python benchmarks/flower_overhead.py --no-worker --name flower_overhead_flower

With ``--secure`` both runs use secure aggregation: a round is then four
exchanges (train, share, mask, unmask), and the fixed cost is still
divided by the three training messages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clinfed.core.events import Event, RoundEnd  # noqa: E402
from clinfed.core.quiet import quiet_libraries  # noqa: E402
from clinfed.core.runs import atomic_write_json, atomic_write_text  # noqa: E402
from clinfed.flower.deploy import flower_run_config, make_certificates  # noqa: E402
from clinfed.runners.pipeline import run_training  # noqa: E402
from clinfed.tasks.i2b2.synth import generate  # noqa: E402
from tests.flower_harness import LocalFederation  # noqa: E402

SITES = ("beth", "partners", "site3")


def round_seconds(ends: dict[int, float]) -> list[float]:
    rounds = sorted(ends)
    return [ends[r] - ends[r - 1] for r in rounds[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=8, help="documents per site")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--adapter", default="none", help="none (every weight), lora, bias...")
    parser.add_argument("--top-layers", type=int, default=2, help="SAFL's K")
    parser.add_argument(
        "--no-worker", action="store_true", help="nodes without the executor (Flower's own)"
    )
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--name", default="flower_overhead", help="results file name")
    parser.add_argument("--secure", action="store_true", help="both runs with --secure-aggregation")
    args = parser.parse_args()
    quiet_libraries()
    cores = os.cpu_count() or 1
    settings = {
        "task": "i2b2",
        "model": args.model,
        "strategy": args.strategy,
        "rounds": args.rounds,
        "max_length": args.max_length,
        "batch_size": 16,
        "secure_aggregation": args.secure,
        "adapter": args.adapter,
    }
    if args.strategy.startswith("safl"):
        settings["top_layers"] = args.top_layers
    with tempfile.TemporaryDirectory(prefix="clinfed-flower-bench-") as tmp:
        root = Path(tmp)
        data = root / "data"
        generate(data, sites=3, docs=args.docs, seed=0)
        # i2b2 notes hold one sentence per line.
        sentences = {
            site.name: sum(len(t.read_text().splitlines()) for t in site.rglob("*.txt"))
            for site in sorted((data / "train").iterdir())
        }

        # --- simulator: sites one after another, all cores
        config = flower_run_config(settings | {"threads": cores}, root / "flower-run")
        simulated = config.replace(data=str(data), out=str(root / "sim"))
        sim_ends: dict[int, float] = {}

        def on_event(event: Event) -> None:
            if isinstance(event, RoundEnd):
                sim_ends[event.info()["round"]] = time.perf_counter()

        started = time.perf_counter()
        run_training(simulated, on_event)
        sim_total = time.perf_counter() - started

        # --- Flower: SuperLink + 3 SuperNodes on loopback, TLS
        certs = root / "certs"
        make_certificates(certs, ["127.0.0.1", "localhost"])
        (root / "deploy").mkdir()
        federation = LocalFederation(root / "deploy", certs=certs)
        flower_ends: dict[int, float] = {}
        pattern = re.compile(r"round (\d+): f1 ")

        def on_line(line: str) -> None:
            match = pattern.search(line)
            if match:
                flower_ends[int(match.group(1))] = time.perf_counter()

        try:
            federation.start_superlink()
            # The sites run concurrently on this one machine: share the cores.
            threads = max(1, cores // len(SITES))
            for site in SITES:
                federation.start_node(
                    site, data, threads=threads, allow_no_dp=True, no_worker=args.no_worker
                )
            started = time.perf_counter()
            process = federation.submit(config, min_sites=3, round_timeout=900, on_line=on_line)
            flower_total = time.perf_counter() - started
        finally:
            federation.close()
        if process.returncode != 0:
            raise SystemExit("\n".join(federation.lines[-40:]))
        ours = load_file(str(Path(config.out) / "model" / "model.safetensors"))
        theirs = load_file(str(root / "sim" / "model" / "model.safetensors"))
        max_diff = max((ours[k].double() - theirs[k].double()).abs().max().item() for k in ours)

    sim_rounds, flower_rounds = round_seconds(sim_ends), round_seconds(flower_ends)
    sim_mean = sum(sim_rounds) / len(sim_rounds)
    flower_mean = sum(flower_rounds) / len(flower_rounds)
    result = {
        "settings": settings
        | {
            "docs_per_site": args.docs,
            "train_sentences": sentences,
            "sites": len(SITES),
            "cores": cores,
        },
        "torch": torch.__version__,
        "simulator_round_s": sim_rounds,
        "flower_round_s": flower_rounds,
        "simulator_total_s": sim_total,
        "flower_total_s": flower_total,
        "ratio_per_round": flower_mean / sim_mean,
        # The definition: the extra wall time of a Flower round over
        # the same work in process, per message (one per site per round).
        "fixed_cost_per_message_s": (flower_mean - sim_mean) / len(SITES),
        "max_abs_weight_difference": max_diff,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / f"{args.name}.json", result)
    lines = [
        "# Flower deployment vs in-process simulator (one run)",
        "",
        f"{args.strategy}{' with secure aggregation' if args.secure else ''}, {args.model}"
        f"{'' if args.adapter == 'none' else ' + ' + args.adapter}, "
        f"{'no executor (a process per message), ' if args.no_worker else ''}"
        f"synthetic i2b2 {len(SITES)} sites x {args.docs} docs "
        f"({min(sentences.values())}-{max(sentences.values())} training sentences each), "
        f"max length {args.max_length}, {args.rounds} rounds, {cores} cores; Flower over TLS on "
        "127.0.0.1, sites concurrent (threads split), simulator sequential (all threads).",
        "",
        "| | seconds per round (rounds 2..N) | whole run (s) |",
        "|---|---|---|",
        f"| simulator | {sim_mean:.1f} | {sim_total:.1f} |",
        f"| Flower | {flower_mean:.1f} | {flower_total:.1f} |",
        f"| ratio | **{flower_mean / sim_mean:.2f}x** | {flower_total / sim_total:.2f}x |",
        "",
        f"Fixed cost per message ((Flower round - simulator round) / {len(SITES)} messages per "
        f"round): **{result['fixed_cost_per_message_s']:.2f} s**.",
        "",
        f"Final weights: largest absolute difference {max_diff:.2e}.",
    ]
    atomic_write_text(args.results / f"{args.name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"ratio_per_round": result["ratio_per_round"]}))


if __name__ == "__main__":
    main()
