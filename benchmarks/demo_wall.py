"""Wall time of the demo's two trainings: one after the other on every
core, against side by side on half the cores each (the demo's way since
2026-11-26, ``clinfed.runners.demo.private_and_reference``).

Runs ``clinfed demo`` once (its phases timed from its progress lines), then
trains its private run and its reference again from their saved
settings, into other folders under OUT: first one after the other at the
demo's thread count, then side by side. Prints each phase's wall time and
the ratio, and writes ``OUT/demo_wall.json``.

    python benchmarks/demo_wall.py runs/demo-wall [--threads 0]

Measure with nothing else running: the two ways share the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clinfed.runners.demo import private_and_reference, run_demo  # noqa: E402
from clinfed.runners.pipeline import run_training  # noqa: E402
from clinfed.settings import RunConfig, load_file  # noqa: E402


def saved(run: Path, out: Path, threads: int) -> RunConfig:
    config = RunConfig.from_values(load_file(run / "config.json"), str(run / "config.json"))
    return replace(config, out=str(out), threads=threads, resume=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a new folder")
    parser.add_argument("--threads", type=int, default=0, help="the demo's --threads (0: all)")
    args = parser.parse_args()
    cores = args.threads or os.cpu_count() or 1
    steps: list[tuple[float, str]] = []
    demo = run_demo(
        args.out / "demo",
        threads=args.threads,
        on_step=lambda text: steps.append((time.perf_counter(), text)),
    )
    started = next(t for t, text in steps if text.startswith("training fedavg"))
    ended = next(t for t, text in steps if text.startswith("auditing"))
    in_demo = ended - started
    print(f"demo: {demo['wall_s']:.0f} s in all; its two trainings side by side {in_demo:.0f} s")

    runs = args.out / "demo"
    t0 = time.perf_counter()
    for name in ("private", "no-dp"):
        run_training(saved(runs / name, args.out / f"after-{name}", cores))
    in_turn = time.perf_counter() - t0
    print(f"one after the other, {cores} threads each: {in_turn:.0f} s")

    t0 = time.perf_counter()
    private_and_reference(
        saved(runs / "private", args.out / "beside-private", cores),
        saved(runs / "no-dp", args.out / "beside-no-dp", cores),
        args.threads,
        lambda text: None,
        lambda event, info: None,
    )
    beside = time.perf_counter() - t0
    print(f"side by side, {max(1, cores // 2)} threads each: {beside:.0f} s")
    print(f"side by side / one after the other: {beside / in_turn:.2f}")
    record = {
        "command": " ".join(["benchmarks/demo_wall.py", *sys.argv[1:]]),
        "cores": cores,
        "demo_wall_s": demo["wall_s"],
        "demo_trainings_side_by_side_s": round(in_demo, 1),
        "in_turn_s": round(in_turn, 1),
        "side_by_side_s": round(beside, 1),
        "ratio": round(beside / in_turn, 3),
        "f1_private": demo["f1_private"],
        "f1_no_dp": demo["f1_no_dp"],
    }
    (args.out / "demo_wall.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
