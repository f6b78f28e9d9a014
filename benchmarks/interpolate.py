"""Shrink a private model toward its public start: does it cut the noise?

Post-processing of a released model, so no privacy cost. DP-SGD's noise
moves every trained number; the signal moves the few the task needs. A
model interpolated between the public start and the private model,

    start + alpha * (private - start),

keeps a share ``alpha`` of both: below 1 it shrinks the noise's random
walk with the signal (WiSE-FT's weight interpolation, Wortsman et al. 2022,
used here as a shrinkage estimator). Scores each ``alpha`` on the test
split (a diagnostic: choosing ``alpha`` there would be tuning on the test)
and, with ``--public DIR``, on public annotated text, where a site or the
server may choose it at no privacy cost.

    python benchmarks/interpolate.py runs/RUN --start START \\
        --data runs/bc5cdr-corpus/data/test [--public DIR] \\
        [--alphas 0,0.5,0.75,1,1.25] [--reset REGEX] [--out FILE.json]

``--reset REGEX``: the tensors whose names match keep the start's values
whatever ``alpha`` (``--reset '^head[.]' --alphas 1``: the private model
with its head put back to the start's, which says what the head's private
update holds).

``RUN`` is a finished run (its ``model/``) or a saved model folder, and
``START`` the model it started from (``config.json``'s ``model.model`` unless
given). A model keeps its name lists and marks (``--gazetteer``,
``--gazetteer-marks``), so both read the same marks.
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


def model_folder(path: Path) -> Path:
    from clinfed.modeling.models import saved_run_model

    folder = saved_run_model(str(path))
    if folder is None:
        raise SystemExit(f"{path}: not a model a clinfed run saved (no model.json)")
    return folder


def interpolated(start: dict, private: dict, alpha: float, reset=None) -> dict:
    """``start + alpha (private - start)`` for every tensor; tensors the run
    did not train are equal in both and stay as they are, and those whose
    names ``reset`` (a compiled pattern) matches take the start's."""
    if start.keys() != private.keys():
        raise SystemExit("the start and the private model hold different tensors")
    out = {}
    for name, theirs in private.items():
        mine = start[name]
        if reset is not None and reset.search(name):
            out[name] = mine
        elif theirs.is_floating_point():
            out[name] = (mine + alpha * (theirs - mine)).contiguous()
        else:
            out[name] = theirs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--start", type=Path)
    parser.add_argument("--data", type=Path, required=True, help="annotated test folder")
    parser.add_argument("--public", type=Path, help="public annotated folder to choose on")
    parser.add_argument("--alphas", default="0,0.5,0.75,0.9,1,1.1,1.25")
    parser.add_argument("--reset", help="tensors (regex on names) kept at the start's values")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    from clinfed.api import evaluate

    torch.set_num_threads(args.threads)
    reset = re.compile(args.reset) if args.reset else None
    private_folder = model_folder(args.run)
    start = args.start
    if start is None:
        # config.json groups the settings: the starting model is model.model.
        start = Path(json.loads((args.run / "config.json").read_text())["model"]["model"])
    start_folder = model_folder(start)
    private = load_file(str(private_folder / "model.safetensors"))
    initial = load_file(str(start_folder / "model.safetensors"))
    moved = {
        name: float((private[name] - initial[name]).norm())
        for name in private
        if private[name].is_floating_point()
    }
    rows = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "model"
        shutil.copytree(private_folder, folder)
        for alpha in [float(a) for a in args.alphas.split(",")]:
            save_file(
                interpolated(initial, private, alpha, reset), str(folder / "model.safetensors")
            )
            row = {"alpha": alpha, "test": evaluate(folder, args.data)}
            if args.public:
                row["public"] = evaluate(folder, args.public)
            rows.append(row)
            shown = {"alpha": alpha, "test_f1": round(row["test"]["f1"], 4)}
            if args.public:
                shown["public_f1"] = round(row["public"]["f1"], 4)
            print(json.dumps(shown), flush=True)
    result = {
        "command": " ".join(sys.argv),
        "run": str(args.run),
        "start": str(start),
        "moved_norm": round(sum(v * v for v in moved.values()) ** 0.5, 4),
        "tensors_moved": sum(1 for v in moved.values() if v > 0),
        "rows": rows,
        "wall_s": round(time.monotonic() - began, 1),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
