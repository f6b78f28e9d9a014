"""Where a private model's update lives, and how much noise its start takes.

Post-processing of released models, so no privacy cost; diagnostics of
DP-SGD's noise, scored on the test split (choosing anything there would be
tuning on the test). Every command reads a finished private run (or a saved
model folder) and the model it started from (``config.json``'s
``model.model`` unless ``--start`` is given).

    python benchmarks/update_anatomy.py spectrum runs/PRIVATE --reference runs/NO-DP
    python benchmarks/update_anatomy.py resets runs/PRIVATE --data TEST
    python benchmarks/update_anatomy.py noise runs/PRIVATE --data TEST --scales 1,1.5,2,3
    python benchmarks/update_anatomy.py ensemble runs/PRIVATE --data TEST

``spectrum``: each tensor's update (private minus start) against the update
of the run without DP from the same start: norms, cosine, and for matrices
the top singular value over the median (a Gaussian random matrix gives
about 2.5 for a square one; a fine-tuning update, tens), and the cosine
with the reference's update of the private one truncated to its top
singular directions (``TRUNCATION_RANKS``).

``resets``: the private model with one group of tensors put back to the
start's values (``GROUPS`` below), for each group: what that group's
private update is worth. ``--together G1,G2``: one row, those groups put
back at once. ``--by layer`` groups the tensors by where they sit instead
(the embeddings, each encoder layer, the head): which layers' updates a
plan could leave untrained.

``noise``: the start plus Gaussian noise, per tensor ``scale`` times the
standard deviation of the private update's entries (``--only`` restricts
it to some groups): how far the noise's random walk can go before it costs
F1. The noise is seeded (``--seed``): a diagnostic, never a release.

``ensemble``: the private model and its start averaged in log-probability
space, decoded as the task decodes.

``--out FILE.json`` keeps the rows and the command.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interpolate import model_folder  # noqa: E402

# A BERT encoder's tensors by what they do (first match wins).
GROUPS: dict[str, str] = {
    "head.weight": r"^head[.]weight$",
    "head.bias": r"^head[.]bias$",
    "word embeddings": r"word_embeddings",
    "position embeddings": r"position_embeddings",
    "token-type table": r"token_type_embeddings",
    "LayerNorm gains": r"LayerNorm[.]weight$",
    "LayerNorm biases": r"LayerNorm[.]bias$",
    "other biases": r"[.]bias$",
    "query and key": r"(query|key)[.]weight$",
    "value and attention output": r"(value|attention[.]output[.]dense)[.]weight$",
    "feed-forward": r"layer[.]\d+[.](intermediate|output)[.]dense[.]weight$",
}


# Ranks ``spectrum`` truncates each matrix's private update to.
TRUNCATION_RANKS = (1, 4, 16, 64)


def group_of(name: str, by: str = "kind") -> str:
    """The group of tensor ``name``: by what it does (``GROUPS``), or by layer."""
    if by == "layer":
        layer = re.search(r"[.]layer[.](\d+)[.]", name)
        if layer:
            return f"layer {layer.group(1)}"
        if "embeddings" in name:
            return "embeddings"
        return "head" if name.startswith("head.") else "other"
    for group, pattern in GROUPS.items():
        if re.search(pattern, name):
            return group
    return "other"


def layer_order(group: str) -> int:
    """Sort key of a ``--by layer`` group: the model's order, layer 2 before 10."""
    ends = {"embeddings": -1, "head": 10**6, "other": 10**6 + 1}
    return ends[group] if group in ends else int(group.split()[-1])


def load_pair(run: Path, start: Path | None) -> tuple[Path, dict, dict, Path]:
    from safetensors.torch import load_file

    private_folder = model_folder(run)
    if start is None:
        start = Path(json.loads((run / "config.json").read_text())["model"]["model"])
    start_folder = model_folder(start)
    private = load_file(str(private_folder / "model.safetensors"))
    initial = load_file(str(start_folder / "model.safetensors"))
    if private.keys() != initial.keys():
        raise SystemExit("the start and the private model hold different tensors")
    return private_folder, private, initial, start_folder


def scored(template: Path, tensors: dict, data: Path) -> float:
    """Strict F1 on ``data`` of ``template``'s model with ``tensors`` in it."""
    from safetensors.torch import save_file

    from clinfed.api import evaluate

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        shutil.copytree(template, folder, ignore=shutil.ignore_patterns("model.safetensors"))
        contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
        save_file(contiguous, str(folder / "model.safetensors"))
        return float(evaluate(folder, data)["f1"])


def truncated(u, values, v, rank: int):
    """The rank-``rank`` part of a matrix from its SVD, flattened."""
    return ((u[:, :rank] * values[:rank]) @ v[:rank]).flatten()


def spectrum(private: dict, initial: dict, reference: dict) -> list[dict]:
    import torch

    cos = torch.nn.functional.cosine_similarity
    rows = []
    for name, theirs in private.items():
        update, wanted = theirs - initial[name], reference[name] - initial[name]
        row = {
            "tensor": name,
            "group": group_of(name),
            "numbers": update.numel(),
            "private_norm": round(float(update.norm()), 4),
            "reference_norm": round(float(wanted.norm()), 4),
            "cosine": round(float(cos(update.flatten(), wanted.flatten(), dim=0)), 4),
        }
        if update.dim() == 2 and min(update.shape) > 3:
            wanted_values = torch.linalg.svdvals(wanted)
            row["reference_top_over_median"] = round(
                float(wanted_values[0] / wanted_values.median()), 2
            )
            if update.shape[0] > 4096:  # the word embeddings: a full SVD too large here
                values = torch.linalg.svdvals(update)
            else:
                # Low-rank denoising: does the top of the private spectrum hold
                # more of the reference's direction than the whole update?
                u, values, v = torch.linalg.svd(update, full_matrices=False)
                row["truncated_cosine"] = {
                    rank: round(
                        float(cos(truncated(u, values, v, rank), wanted.flatten(), dim=0)), 4
                    )
                    for rank in TRUNCATION_RANKS
                    if rank < min(update.shape)
                }
            row["private_top_over_median"] = round(float(values[0] / values.median()), 2)
        rows.append(row)
    return rows


def ensemble_f1(folders: list[Path], data: Path) -> float:
    """Strict F1 of the mean of the models' log-probabilities."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from clinfed.core.errors import ProblemLog
    from clinfed.core.scratch import temporary_folder
    from clinfed.modeling.training import predict
    from clinfed.runners.inference import saved_model_and_task

    class Mean(nn.Module):
        def __init__(self, models):
            super().__init__()
            self.models = nn.ModuleList(models)

        def forward(self, **inputs):
            return torch.stack([F.log_softmax(m(**inputs).float(), -1) for m in self.models]).mean(
                0
            )

    with temporary_folder("cache") as cache:
        loaded = [saved_model_and_task(folder, cache) for folder in folders]
        _, tokenizer, meta, task = loaded[0]
        records = task.read_documents(data, ProblemLog("strict"))
        examples = task.encode(records, tokenizer, meta["max_length"], cache)
        outputs = predict(Mean([m.eval() for m, *_ in loaded]), task, examples)
        return float(task.evaluate(records, examples, outputs)["f1"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["spectrum", "resets", "noise", "ensemble"])
    parser.add_argument("run", type=Path)
    parser.add_argument("--start", type=Path)
    parser.add_argument("--reference", type=Path, help="spectrum: the run without DP")
    parser.add_argument("--data", type=Path, help="annotated test folder")
    parser.add_argument("--scales", default="1,1.5,2,3", help="noise: multiples of the update")
    parser.add_argument("--only", help="noise: comma-separated groups (default: every tensor)")
    parser.add_argument("--together", help="resets: comma-separated groups put back at once")
    parser.add_argument(
        "--by", choices=["kind", "layer"], default="kind", help="resets: how tensors are grouped"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.command == "spectrum" and args.reference is None:
        parser.error("spectrum needs --reference")
    if args.command != "spectrum" and args.data is None:
        parser.error(f"{args.command} needs --data")
    only = args.only.split(",") if args.only else None
    together = args.together.split(",") if args.together else None
    if only and set(only) - set(GROUPS):
        parser.error(f"--only takes groups among: {', '.join(GROUPS)}")

    import torch

    torch.set_num_threads(args.threads)
    began = time.monotonic()
    template, private, initial, start_folder = load_pair(args.run, args.start)
    rows: list[dict] = []
    if args.command == "spectrum":
        _, reference, _, _ = load_pair(args.reference, args.start)
        rows = spectrum(private, initial, reference)
    elif args.command == "resets":
        group = {name: group_of(name, args.by) for name in private}
        names = list(GROUPS) if args.by == "kind" else sorted(set(group.values()), key=layer_order)
        if together and set(together) - set(names):
            parser.error(f"--together takes groups among: {', '.join(names)}")
        rows.append({"reset": None, "f1": round(scored(template, private, args.data), 4)})
        for chosen in [together] if together else [[name] for name in names]:
            if not any(group[name] in chosen for name in private):
                continue
            tensors = {k: initial[k] if group[k] in chosen else v for k, v in private.items()}
            reset = chosen if together else chosen[0]
            rows.append({"reset": reset, "f1": round(scored(template, tensors, args.data), 4)})
            print(json.dumps(rows[-1]), flush=True)
    elif args.command == "noise":
        generator = torch.Generator().manual_seed(args.seed)
        for scale in [float(s) for s in args.scales.split(",")]:
            tensors = {}
            for name, start in initial.items():
                hit = only is None or group_of(name) in only
                if hit and start.is_floating_point() and start.numel() > 1:
                    size = scale * float((private[name] - start).std())
                    start = start + size * torch.randn(start.shape, generator=generator)
                tensors[name] = start
            f1 = scored(template, tensors, args.data)
            rows.append({"scale": scale, "only": only, "f1": round(f1, 4)})
            print(json.dumps(rows[-1]), flush=True)
    else:
        f1 = ensemble_f1([template, start_folder], args.data)
        rows.append({"models": ["private", "start"], "f1": round(f1, 4)})
    if args.command == "spectrum":
        by_group: dict[str, list] = {}
        for row in rows:
            by_group.setdefault(row["group"], []).append(row)
        for group, members in by_group.items():
            mean = sum(r["cosine"] for r in members) / len(members)
            print(f"{group:28s} tensors {len(members):3d}  mean cosine {mean:+.3f}")
    else:
        print(json.dumps(rows[-1]))
    if args.out:
        result = {
            "command": " ".join(sys.argv),
            "run": str(args.run),
            "rows": rows,
            "wall_s": round(time.monotonic() - began, 1),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
