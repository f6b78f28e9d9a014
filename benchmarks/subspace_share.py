"""How much of a private step the public gradient subspace holds, at the
start and at a later global model.

``--dp-subspace`` finds its basis ``V`` on public text at the starting
model; each DP-SGD step keeps only ``V S`` of the step's clipped sum ``S``.
This measures ``||V S||^2 / ||S||^2`` for a sum of ``--units`` clipped
per-sentence gradients of the private training text (drawn at ``--seed``):

1. at the starting model, with the start's basis;
2. at a later global model (a round's checkpoint of a ``dp_utility.py``
   run), with the start's basis (what ``--dp-subspace`` uses);
3. at that model, with a basis found again there on the same public text
   (what ``--dp-subspace-refresh`` uses).

Usage (after a ``dp_utility.py`` run with ``--set dp_subspace=K``)::

    .venv/bin/python benchmarks/subspace_share.py runs/NAME \\
        runs/NAME/checkpoints/round-0003.safetensors

Reads the run's ``dp_utility.json`` for its settings; writes
``subspace_share.json`` beside it. Prints figures only, never text. The
private text is read for this measurement alone: nothing of it is
released, so it is an analysis of the benchmark corpus, not a step a
private run may take.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from clinfed.device import to_device
from clinfed.errors import ProblemLog
from clinfed.models import load_tokenizer
from clinfed.pipeline import RunConfig, make_model, make_task
from clinfed.scratch import temporary_folder
from clinfed.warmstart import public_subspace


def clipped_sum(model, task, examples, rows, space, clip: float) -> dict[str, float]:
    """The sum of the clipped per-example gradients of ``rows`` over the
    basis's tensors; and the share the basis holds of it and, on average,
    of each example's gradient."""
    params = dict(model.named_parameters())
    names = list(space.basis)
    total = {n: torch.zeros_like(params[n]) for n in names}
    each = []
    model.eval()  # no dropout: the model's own directions
    for row in rows:
        batch = to_device(task.collate(examples[[row]]), torch.device("cpu"))
        loss = task.example_losses(model(**task.model_inputs(batch)), batch).sum()
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(params[n]) for n, g in zip(names, grads)]
        norm = float(torch.sqrt(sum(g.square().sum() for g in grads)))
        factor = min(1.0, clip / (norm + 1e-12))
        for name, g in zip(names, grads, strict=True):
            total[name] += factor * g
        each.append(space.held_share(dict(zip(names, grads, strict=True))))
    model.train()
    return {"sum": space.held_share(total), "per_example": float(np.mean(each))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a dp_utility.py run folder")
    parser.add_argument("checkpoint", type=Path, help="a later global model (safetensors)")
    parser.add_argument("--units", type=int, default=190, help="sentences in the sum")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    settings = json.loads((args.run / "dp_utility.json").read_text())["settings"]
    settings.pop("threads", None)
    with temporary_folder("cache") as cache, temporary_folder("out") as out:
        config = RunConfig.of(**settings, out=str(Path(out) / "run")).resolved()
        problems = ProblemLog()
        task = make_task(config, cache)
        tokenizer = load_tokenizer(config.model)
        model = make_model(config, task)
        corpus = task.load(Path(config.data), ProblemLog())
        train = task.encode(corpus.train, tokenizer, config.max_length, cache)
        rows = np.random.default_rng(args.seed).choice(len(train), args.units, replace=False)
        rows = rows.tolist()
        clip = config.max_grad_norm
        start, start_record = public_subspace(config, task, model, tokenizer, cache, problems)
        result = {"start": clipped_sum(model, task, train, rows, start, clip)}
        model.load_state_dict(load_file(str(args.checkpoint)), strict=False)
        result["later_start_basis"] = clipped_sum(model, task, train, rows, start, clip)
        again, again_record = public_subspace(config, task, model, tokenizer, cache, ProblemLog())
        result["later_found_again"] = clipped_sum(model, task, train, rows, again, clip)
    result |= {
        "command": "benchmarks/subspace_share.py "
        + " ".join(
            str(a) for a in (args.run, args.checkpoint, "--units", args.units, "--seed", args.seed)
        ),
        "rank": config.dp_subspace,
        "public_share": {
            "start": start_record["public_gradient_share"],
            "later": again_record["public_gradient_share"],
        },
        "units": args.units,
        "clip": clip,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (args.run / "subspace_share.json").write_text(json.dumps(result, indent=2) + "\n")
    for key in ("start", "later_start_basis", "later_found_again"):
        print(
            f"{key}: the basis holds {result[key]['sum']:.1%} of the clipped sum "
            f"({result[key]['per_example']:.1%} of an example's gradient on average)"
        )


if __name__ == "__main__":
    main()
