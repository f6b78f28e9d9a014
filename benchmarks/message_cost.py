"""The fixed cost of a Flower message at a node, with and without the
node's worker.

Flower starts a fresh ClientApp process for every message. This script
plays that part: each message is a new Python process that imports the
ClientApp module, reads one training message's records (serialized the way
Flower carries them) and answers it, either

* through the node's worker (:mod:`clinfed.flower.worker`, the default),
  which keeps torch, the encoded data and the model between messages, or
* on its own (``worker=false``): every import, the site and the model built
  for this one message.

The work of the message itself (load the download, train one round, write
the node's copy) is what the worker's log says it took with everything
already built; a message's fixed cost is its wall time less that work. The
first message of each kind, which starts the worker and fills the node's
caches, is left out.

Writes ``RESULTS/message_cost.json`` and ``.md``.

    .venv/bin/python benchmarks/message_cost.py --docs 8      # the Flower benchmark's site size
    .venv/bin/python benchmarks/message_cost.py --docs 100    # about 2,000 sentences
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _child(message: Path, node: str) -> None:
    """One message, as a ClientApp process answers it."""
    started = time.perf_counter()
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict

    from clinfed.flower import client

    imported = time.perf_counter()
    proto = RecordDict()
    proto.ParseFromString(message.read_bytes())
    reply = client.answer(recorddict_from_proto(proto), json.loads(node))
    recorddict_to_proto(reply).SerializeToString()
    answered = time.perf_counter()
    print(json.dumps({"imports_s": imported - started, "answer_s": answered - imported}))


def _message(message: Path, node: dict) -> tuple[float, dict]:
    command = [sys.executable, __file__, "--child", str(message), json.dumps(node)]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(Path(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=8, help="documents per site")
    parser.add_argument("--repeats", type=int, default=3, help="messages timed per kind")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()

    from flwr.common.serde import recorddict_to_proto

    from clinfed.core.runs import atomic_write_json, atomic_write_text
    from clinfed.federated.messages import Message
    from clinfed.flower.deploy import flower_run_config
    from clinfed.flower.records import message_records
    from clinfed.flower.worker import FOLDER
    from clinfed.runners.factories import make_model, make_task
    from clinfed.tasks.i2b2.synth import generate

    settings = {
        "task": "i2b2",
        "model": args.model,
        "strategy": args.strategy,
        "rounds": 2,
        "max_length": args.max_length,
        "batch_size": 16,
        "threads": args.threads,
    }
    with tempfile.TemporaryDirectory(prefix="clinfed-message-bench-") as tmp:
        root = Path(tmp)
        data = root / "data"
        generate(data, sites=1, docs=args.docs, seed=0)
        config = flower_run_config(settings, root / "run")
        model = make_model(config, make_task(config, ""))
        records = message_records(
            Message("train", 1, model.state_dict(), full=True, evaluate=False),
            {"name": "run", "config": config.to_dict()},
        )
        message = root / "message.bin"
        message.write_bytes(recorddict_to_proto(records).SerializeToString())
        node = {"data": str(data), "state": str(root / "state"), "allow-no-dp": True}
        alone = node | {"worker": False}
        # The worker is this process's child's child: it ends when this
        # process does (its "SuperNode").
        _message(message, node)
        _message(message, alone)
        kinds: dict[str, list] = {"worker": [], "alone": []}
        for _ in range(args.repeats):
            kinds["worker"].append(_message(message, node))
            kinds["alone"].append(_message(message, alone))
        log = (root / "state" / FOLDER / "worker.log").read_text()
        work = [float(s) for s in re.findall(r"answered in ([0-9.]+) s", log)][1:]
        # i2b2 notes hold one sentence per line.
        sentences = sum(len(p.read_text().splitlines()) for p in (data / "train").rglob("*.txt"))
    work_s = statistics.median(work)
    row = {}
    for kind, runs in kinds.items():
        wall = statistics.median(w for w, _ in runs)
        row[kind] = {
            "wall_s": [w for w, _ in runs],
            "imports_s": [c["imports_s"] for _, c in runs],
            "answer_s": [c["answer_s"] for _, c in runs],
            "fixed_s": wall - work_s,
        }
    result = {
        "settings": settings | {"docs": args.docs, "training_sentences": sentences},
        "work_s": work,
        "kinds": row,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / "message_cost.json", result)

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}"

    lines = [
        "# The fixed cost of a Flower message at a node (one run)",
        "",
        f"{args.strategy}, {args.model}, one synthetic i2b2 site of {args.docs} documents "
        f"({sentences} training sentences), "
        f"max length {args.max_length}, batch 16, {args.threads} threads, no DP; a fresh "
        f"process per message (as Flower runs a ClientApp), median of {args.repeats}.",
        "",
        "| | imports | answer | whole message | work | **fixed cost** |",
        "|---|---|---|---|---|---|",
    ]
    for kind, label in (("alone", "each message on its own"), ("worker", "through the worker")):
        runs = kinds[kind]
        lines.append(
            f"| {label} | {med([c['imports_s'] for _, c in runs])} | "
            f"{med([c['answer_s'] for _, c in runs])} | {med([w for w, _ in runs])} | "
            f"{work_s:.2f} | **{row[kind]['fixed_s']:.2f}** |"
        )
    atomic_write_text(args.results / "message_cost.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
