"""Per-unit gradient norms at a saved model, on public documents.

Usage (from the repository root)::

    .venv/bin/python benchmarks/unit_norms.py runs/m1k-start runs/mimic3-check-1k/site1 \\
        --trainable head --examples 150 [--json OUT]

DP-SGD clips each unit's gradient to ``--max-grad-norm`` and sizes the
noise to that norm, so a clip norm far above what most units' gradients
measure spends the noise on gradients few units have. This prints the
quantiles of the units' gradient norms over the parameters a plan trains
(``head``: the task head; ``bias``: the encoder's bias terms and the
head; ``all``), at a saved model (a run folder or ``clinfed warm-start``'s
model), on every annotated document of a folder, one example per unit.

Measure it on public documents only: a clip norm read off a site's own
units would be tuned on private data. The model runs in eval mode (no
dropout), so the figures are the same at every call. Prints no text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from clinfed.adapters import add_bias, add_head, shared_names
from clinfed.errors import ProblemLog
from clinfed.inference import saved_model_and_task
from clinfed.scratch import temporary_folder

THRESHOLDS = (0.1, 0.2, 0.3, 0.5, 1.0)
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
# The plan's trainable parameters, as the training run selects them.
PLANS = {"head": add_head, "bias": add_bias, "all": lambda model: model}


def unit_norms(model_path: Path, data: Path, trainable: str, examples: int, seed: int) -> dict:
    """Quantiles of the per-example gradient norms and the share above each threshold."""
    with temporary_folder("cache") as cache_dir:
        model, tokenizer, meta, task = saved_model_and_task(model_path, cache_dir)
        records = task.read_documents(data, ProblemLog("skip"))
        encoded = task.encode(records, tokenizer, meta["max_length"], cache_dir)
        if examples and len(encoded) > examples:
            encoded = encoded.shuffle(seed=seed).select(range(examples))
        model = PLANS[trainable](model)
        model.eval()
        trained = set(shared_names(model))
        params = [(n, p) for n, p in model.named_parameters() if n in trained]
        for name, param in model.named_parameters():
            param.requires_grad_(name in trained)
        norms = []
        for i in range(len(encoded)):
            batch = task.collate(encoded[i : i + 1])
            model.zero_grad(set_to_none=True)
            task.loss(model(**task.model_inputs(batch)), batch).backward()
            squares = sum(float((p.grad**2).sum()) for _, p in params if p.grad is not None)
            norms.append(squares**0.5)
    values = np.array(norms)
    return {
        "model": str(model_path),
        "data": str(data),
        "trainable": trainable,
        "parameters": sum(p.numel() for _, p in params),
        "units": len(values),
        "quantiles": {str(q): float(v) for q, v in zip(QUANTILES, np.quantile(values, QUANTILES))},
        "share_above": {str(t): float((values > t).mean()) for t in THRESHOLDS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("data", type=Path, help="a folder of public annotated documents")
    parser.add_argument("--trainable", choices=("head", "bias", "all"), default="head")
    parser.add_argument("--examples", type=int, default=150, help="at most this many (0: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = unit_norms(args.model, args.data, args.trainable, args.examples, args.seed)
    quantiles = ", ".join(f"{q} {v:.3f}" for q, v in result["quantiles"].items())
    above = ", ".join(f">{t} {v:.0%}" for t, v in result["share_above"].items())
    print(f"{result['units']} units, {result['parameters']:,} numbers: quantiles {quantiles}")
    print(f"share of units above: {above}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
