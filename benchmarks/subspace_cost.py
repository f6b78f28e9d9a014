"""What finding the ``--dp-subspace`` basis costs, one public example a
backward pass against ``SUBSPACE_BATCH`` (clinfed.warmstart), and whether
the two find the same basis.

Every refresh (``--dp-subspace-refresh``, ``--dp-subspace-refresh-epochs``)
pays this once per model, so it bounds how often a site can afford one.

Usage (after a ``dp_utility.py`` run with ``--set dp_subspace=K``)::

    .venv/bin/python benchmarks/subspace_cost.py runs/NAME --threads 1

Reads the run's ``dp_utility.json`` for its settings and finds the basis at
the run's starting model, alternating the two ways ``--repeats`` times
(the machine's noise hits both alike). Writes ``subspace_cost.json`` beside
the run; prints figures only, never text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import clinfed.warmstart as warmstart
from clinfed.errors import ProblemLog
from clinfed.models import load_tokenizer
from clinfed.pipeline import RunConfig, make_model, make_task
from clinfed.scratch import temporary_folder


def overlap(first, second) -> float:
    """``||V1 V2^T||_F^2 / rank``: 1 when the two bases span one subspace."""
    names = sorted(first.basis)
    one = torch.cat([first.basis[n] for n in names], dim=1)
    two = torch.cat([second.basis[n] for n in names], dim=1)
    return float((one @ two.T).square().sum()) / one.shape[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a dp_utility.py run folder")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = json.loads((args.run / "dp_utility.json").read_text())["settings"]
    settings.pop("threads", None)
    batched = warmstart.SUBSPACE_BATCH
    seconds: dict[int, list[float]] = {1: [], batched: []}
    spaces = {}
    with temporary_folder("cache") as cache, temporary_folder("out") as out:
        config = RunConfig.of(**settings, out=str(Path(out) / "run")).resolved()
        task = make_task(config, cache)
        tokenizer = load_tokenizer(config.model)
        model = make_model(config, task)
        # Read and encode the public text once, outside the timings.
        warmstart.public_examples(
            config, task, tokenizer, cache, ProblemLog(), np.random.default_rng(0)
        )
        for _ in range(args.repeats):
            for batch in (1, batched):
                warmstart.SUBSPACE_BATCH = batch
                started = time.perf_counter()
                spaces[batch], _ = warmstart.public_subspace(
                    config, task, model, tokenizer, cache, ProblemLog()
                )
                seconds[batch].append(time.perf_counter() - started)
    result = {
        "command": f"benchmarks/subspace_cost.py {args.run} --repeats {args.repeats} "
        f"--threads {args.threads}",
        "rank": config.dp_subspace,
        "public_examples": config.dp_subspace_examples,
        "adapter": config.adapter,
        "threads": args.threads,
        "seconds_one_a_pass": [round(s, 1) for s in seconds[1]],
        f"seconds_{batched}_a_pass": [round(s, 1) for s in seconds[batched]],
        "speedup": round(min(seconds[1]) / min(seconds[batched]), 2),
        "basis_overlap": round(overlap(spaces[1], spaces[batched]), 6),
    }
    (args.run / "subspace_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
