"""DP-SGD step-time overhead against non-DP training of the same plan, one run.

One site of synthetic i2b2, MiniLM, batches of 16 and 64, max length 128, the real
client update (``client_update``) with and without DP-SGD, for two plans:
FedAvg's (everything trains, embeddings included: ghost clipping) and SAFL
K=2's (two layers and the head, embeddings frozen: hook clipping). Each
measurement is one local epoch, repeated ``--repeats`` times, alternating
DP and non-DP so machine noise hits both; reports the median seconds per
training token and the ratio. Two more plans put LoRA adapters (rank 8, B
factors trained, the encoder frozen) in place of the encoder weights: every
layer's, and SAFL K=2's two layers'. One more trains only the encoder's
bias terms and the head (BitFit). DP runs twice per repeat: with
``--clipping auto`` (book-keeping, one backward pass) and with the Opacus
mode clinfed used before it (ghost where embeddings train, else hooks), so
the table shows what book-keeping buys. Writes ``RESULTS/dp_overhead.json``
and ``.md`` (``dp_overhead-document.*`` with ``--unit document``).

``--unit document`` clips each note's sentences as one unit (batches then
count notes, and the plain step takes as many sentences as a batch of notes
holds on average): book-keeping runs the drawn notes' sentences in
length-grouped passes and carries each note across them; Opacus's ghost
clipping needs one row per unit, so the comparison there is with hooks
(every row's gradient of the whole model: about 20 GB at batch 2, which
``--skip-opacus`` leaves out).

``--profile`` then runs one more plain and one more DP epoch of each plan
under cProfile and splits the DP epoch's time: the forward and backward
passes (more of them than the plain step's: a Poisson batch runs as
length-grouped passes, and the taps record each layer's activations and
output gradients), the per-unit norms, the clipped sums, the noise, and
the rest (collating the passes' batches, the optimizer). cProfile slows
Python-heavy code, so read the split, not the totals. Writes
``RESULTS/dp_overhead-profile.json`` and ``.md`` (``-document-profile``).

    .venv/bin/python benchmarks/dp_overhead.py --batch-sizes 64   # ~10 min on 2 cores
    .venv/bin/python benchmarks/dp_overhead.py --unit document --batch-sizes 2 --repeats 2  # 20 GB
    .venv/bin/python benchmarks/dp_overhead.py --batch-sizes 64 --repeats 3 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers

from clinfed.core.device import resolve_device
from clinfed.core.errors import ProblemLog
from clinfed.core.runs import atomic_write_json, atomic_write_text
from clinfed.federated.client import LocalSettings, LocalWork, client_update
from clinfed.federated.plan import Plan, full_plan, names_in
from clinfed.modeling.adapters import add_bias, add_lora, shared_names
from clinfed.modeling.blocks import HEAD, Block
from clinfed.modeling.models import build_model, load_tokenizer
from clinfed.privacy.dpsgd import DPSettings
from clinfed.privacy.randomness import secret
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.tasks.i2b2.synth import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch-sizes",
        default="16,64",
        help="comma-separated; DP-SGD's per-step cost (noise over every trainable "
        "parameter) is fixed, so the overhead per token falls as the batch grows",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--unit", default="example", choices=("example", "document"), help="the privacy unit"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument(
        "--skip-opacus",
        action="store_true",
        help="leave out the Opacus column: at --unit document its hooks keep every row's "
        "gradient of the whole model (about 20 GB at batch 2)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="split each plan's DP epoch by where it spends"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    print(f"device: {device}", flush=True)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        generate(Path(work) / "data", sites=1, docs=args.docs, seed=0)
        task = I2b2Task()
        records = task.read_documents(Path(work) / "data" / "train", ProblemLog())
        examples = task.encode(records, load_tokenizer("minilm"), 128, work)
        model = build_model("token", "minilm", len(task.labels), seed=0).to(device)
        adapted = add_lora(build_model("token", "minilm", len(task.labels), seed=0), 8, 16, "b", 0)
        adapted = adapted.to(device)
        biased = add_bias(build_model("token", "minilm", len(task.labels), seed=0)).to(device)
        top_two = {Block(k, layer) for layer in (4, 5) for k in ("query_key", "value", "rest")}

        def plan_of(names, blocks=None):
            chosen = full_plan(names).trainable if blocks is None else names_in(names, blocks)
            return Plan(chosen, chosen, frozenset(names))

        names, lora_names = [n for n, _ in model.named_parameters()], shared_names(adapted)
        plans = {
            "fedavg (all parameters, embeddings train)": (model, plan_of(names)),
            "safl K=2 (2 layers + head, embeddings frozen)": (
                model,
                plan_of(names, top_two | {HEAD}),
            ),
            "lora r=8 (B factors of every layer + head)": (adapted, plan_of(lora_names)),
            "safl K=2 + lora r=8 (2 layers' B factors + head)": (
                adapted,
                plan_of(lora_names, top_two | {HEAD}),
            ),
            "bias only (every encoder bias + head)": (biased, plan_of(shared_names(biased))),
        }
        starts = {
            id(m): {k: v.clone() for k, v in m.state_dict().items()}
            for m in (model, adapted, biased)
        }
        results, lines, profiles = {}, [], {}
        units = len(task.unit_rows(examples, args.unit))
        print(f"{len(examples)} rows in {units} {args.unit} units", flush=True)
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            # The plain step takes as many rows as a private batch of units
            # holds on average: a per-token comparison at the same batch.
            rows = max(1, round(batch_size * len(examples) / units))
            settings = LocalSettings(epochs=1, batch_size=rows, lr=1e-4)
            for label, (model, plan) in plans.items():
                start = starts[id(model)]
                timings: dict[str, list[float]] = {"plain": [], "dp": [], "opacus": []}
                clipping = {}
                embeddings = "encoder.embeddings.word_embeddings.weight" in plan.trainable
                opacus = "ghost" if embeddings and args.unit == "example" else "hooks"
                for repeat in range(args.repeats):
                    for mode in ("plain", "dp") if args.skip_opacus else ("plain", "dp", "opacus"):
                        model.load_state_dict(start)
                        dp = {
                            "plain": None,
                            "dp": DPSettings(
                                1.0, 1.0, "auto", unit=args.unit, batch_size=batch_size
                            ),
                            "opacus": DPSettings(
                                1.0, 1.0, opacus, unit=args.unit, batch_size=batch_size
                            ),
                        }[mode]
                        generator = np.random.default_rng(repeat)
                        randomness = secret() if dp is not None else None
                        work = LocalWork(
                            model, task, examples, plan, settings, generator, dp,
                            randomness=randomness,
                        )  # fmt: skip
                        result = client_update(work)
                        tokens = sum(s.tokens for s in result.stats)
                        timings[mode].append(result.seconds / tokens)
                        clipping[mode] = result.clipping
                plain, private = (statistics.median(timings[m]) for m in ("plain", "dp"))
                before = statistics.median(timings["opacus"]) if timings["opacus"] else None
                noised = sum(p.numel() for n, p in model.named_parameters() if n in plan.trainable)
                if args.profile:
                    for mode, dp in (("plain", None), ("dp", DPSettings(
                        1.0, 1.0, "auto", unit=args.unit, batch_size=batch_size
                    ))):  # fmt: skip
                        model.load_state_dict(start)
                        work = LocalWork(
                            model, task, examples, plan, settings, np.random.default_rng(0), dp,
                            randomness=secret() if dp is not None else None,
                        )  # fmt: skip
                        profiles[f"{label}, batch {batch_size}", mode] = profiled(work)
                results[f"{label}, batch {batch_size}"] = {
                    "batch_size": batch_size,
                    "noised_parameters": noised,
                    "plain_tokens_per_s": 1 / plain,
                    "dp_tokens_per_s": 1 / private,
                    "ratio": private / plain,
                    "clipping": clipping["dp"],
                    "opacus_clipping": opacus,
                    "opacus_ratio": before / plain if before else None,
                    "timings_s_per_token": timings,
                }
                lines.append(
                    f"| {label} | {batch_size} | {noised / 1e6:.2f}M | {1 / plain:.0f} "
                    f"| {clipping['dp']}: {1 / private:.0f} | {private / plain:.2f}x "
                    f"| {f'{opacus}: {before / plain:.2f}x' if before else 'not run'} |"
                )
                print(lines[-1], flush=True)
    table = (
        "| plan | batch | noised numbers | plain tokens/s | DP-SGD tokens/s "
        "| DP time / plain time | the same with Opacus clipping |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n"
    )
    args.results.mkdir(parents=True, exist_ok=True)
    stem = "dp_overhead" if args.unit == "example" else f"dp_overhead-{args.unit}"
    atomic_write_json(args.results / f"{stem}.json", results)
    atomic_write_text(args.results / f"{stem}.md", table)
    print(table)
    if args.profile:
        write_profile(profiles, args.results / f"{stem}-profile")


# Where an epoch's time goes: (file, functions) whose cumulative time is the
# part. The backward pass includes the taps' recording of output gradients.
PARTS = {
    "forward": ("clinfed/modeling/heads.py", ("forward",)),
    "backward": ("~", ("<method 'run_backward' of 'torch._C._EngineBase' objects>",)),
    "norms": ("privacy/layer_rules.py", ("norms",)),
    "clipped sums": ("privacy/layer_rules.py", ("accumulate",)),
    "noise": ("privacy/noise.py", ("add_noise",)),
}


def profiled(work: LocalWork) -> dict[str, float]:
    """One client update under cProfile: its seconds and each part's."""
    profile = cProfile.Profile()
    result = profile.runcall(client_update, work)
    stats = pstats.Stats(profile).stats  # (file, line, function) -> (.., .., tt, ct, ..)
    parts = {"epoch": result.seconds}
    for part, (file, functions) in PARTS.items():
        parts[part] = sum(
            entry[3]
            for (path, _, function), entry in stats.items()
            if path.endswith(file) and function in functions
        )
    parts["rest"] = parts["epoch"] - sum(parts[p] for p in PARTS)
    return parts


def write_profile(profiles: dict, stem: Path) -> None:
    columns = ["epoch", *PARTS, "rest"]
    lines = [
        "| plan | | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for (label, mode), parts in profiles.items():
        cells = " | ".join(f"{parts[c]:.2f}" for c in columns)
        lines.append(f"| {label} | {mode} | {cells} |")
    table = "seconds of one epoch under cProfile\n\n" + "\n".join(lines) + "\n"
    flat = {f"{label} | {mode}": parts for (label, mode), parts in profiles.items()}
    atomic_write_json(stem.with_suffix(".json"), flat)
    atomic_write_text(stem.with_suffix(".md"), table)
    print(table)


if __name__ == "__main__":
    main()
