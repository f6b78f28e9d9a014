"""Which parts of a plan hold each unit's gradient norm?

DP-SGD clips a unit's gradient over every trained number jointly, so a
part whose gradients are large takes most of each unit's clip budget and
the others' signal shrinks against noise that is the same for every
number. This measures, at a saved model, each unit's squared gradient
norm split by part (the head, the token-type table, the encoder's bias
terms by kind), as `clinfed privacy clip-norm` measures the whole
(`clinfed.runners.clip_norm`: eval mode, one unit a backward pass):

    python benchmarks/unit_norm_groups.py MODEL --data DIR [--adapter bias]
        [--max-units 300] [--seed 1] [--out FILE.json]

Read it on public text to choose anything; on a site's training text it
is a diagnostic only (a figure computed from private data that no
accountant covers).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def part(name: str) -> str:
    """The part a trained tensor belongs to."""
    if name.startswith("head."):
        return "head." + name.rsplit(".", 1)[-1]
    if "token_type" in name:
        return "token-type table"
    kind = re.search(r"layer\.\d+\.(.*)\.bias$", name)
    if kind:
        return "bias " + kind.group(1).replace("attention.self.", "").replace(
            "attention.output.", "attention-out "
        )
    return "bias " + name.removeprefix("encoder.").rsplit(".", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--adapter", default="bias")
    parser.add_argument("--max-units", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0, help="clip norm for the clipped shares")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from clinfed.core.errors import ProblemLog
    from clinfed.core.scratch import temporary_folder
    from clinfed.modeling.adapters import shared_names
    from clinfed.runners.clip_norm import PLANS
    from clinfed.runners.inference import saved_model_and_task

    torch.set_num_threads(args.threads)
    began = time.monotonic()
    with temporary_folder("cache") as cache_dir:
        model, tokenizer, meta, task = saved_model_and_task(args.model, cache_dir)
        model = PLANS[args.adapter](model)
        records = task.read_documents(args.data, ProblemLog("strict"))
        examples = task.encode(records, tokenizer, meta["max_length"], cache_dir)
        units = task.unit_rows(examples, "example")
        if args.max_units and len(units) > args.max_units:
            chosen = np.random.default_rng(args.seed).permutation(len(units))[: args.max_units]
            units = [units[i] for i in chosen]
        trained = set(shared_names(model))
        names = [n for n, _ in model.named_parameters() if n in trained]
        params = [p for n, p in model.named_parameters() if n in trained]
        for name, param in model.named_parameters():
            param.requires_grad_(name in trained)
        model.eval()
        squares = defaultdict(list)
        for rows in units:
            batch = task.collate(examples[rows.tolist()])
            losses = task.example_losses(model(**task.model_inputs(batch)), batch)
            grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
            by_part = defaultdict(float)
            for name, g in zip(names, grads, strict=True):
                if g is None:
                    continue
                if "token_type" in name:  # row by row: row 0 is every unmarked piece's
                    for row, values in enumerate(g):
                        by_part[f"token-type row {row}"] += float((values.float() ** 2).sum())
                else:
                    by_part[part(name)] += float((g.float() ** 2).sum())
            for key in set(by_part) | {part(n) for n in names if "token_type" not in n}:
                squares[key].append(by_part.get(key, 0.0))
    parts = sorted(squares)
    table = np.array([squares[k] for k in parts])  # parts x units
    total = table.sum(0)
    factor = np.minimum(1.0, args.clip / np.sqrt(total + 1e-12))
    numbers = defaultdict(int)
    for n, p in zip(names, params, strict=True):
        if "token_type" in n:
            for row in range(p.shape[0]):
                numbers[f"token-type row {row}"] = p.shape[1]
        else:
            numbers[part(n)] += p.numel()
    result = {
        "command": " ".join(sys.argv),
        "units": len(units),
        "unit_norm_median": float(np.median(np.sqrt(total))),
        "clip": args.clip,
        "parts": {
            k: {
                "numbers": numbers[k],
                "share_of_squared_norm": float(table[i].sum() / total.sum()),
                "median_norm": float(np.median(np.sqrt(table[i]))),
                # The part's mean clipped gradient per unit, over its numbers:
                # its signal per number against noise that is the same for all.
                "clipped_norm_per_sqrt_number": float(
                    np.mean(np.sqrt(table[i]) * factor) / np.sqrt(numbers[k])
                ),
            }
            for i, k in enumerate(parts)
        },
        "wall_s": round(time.monotonic() - began, 1),
    }
    for k, v in sorted(result["parts"].items(), key=lambda kv: -kv[1]["share_of_squared_norm"]):
        print(
            f"{k:32s} {v['numbers']:6d} numbers  share {v['share_of_squared_norm']:.3f}  "
            f"median {v['median_norm']:.3f}  "
            f"clipped/sqrt(n) {v['clipped_norm_per_sqrt_number']:.2e}"
        )
    print(f"units {len(units)}, median unit norm {result['unit_norm_median']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
