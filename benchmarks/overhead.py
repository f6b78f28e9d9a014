"""Cost of the federated machinery, measured in one run.

(a) round overhead: the share of a FedAvg round (evaluation excluded) spent
    outside forward/backward/optimizer steps, where the compute time is that
    of a bare PyTorch loop over exactly the same batches;
(b) client-update tokens/s against that bare loop (same model, batches,
    optimizer);
(c) peak RSS of a whole run with the same data split over 3 and over 30
    clients (separate processes).

Writes ``RESULTS/overhead.json`` and ``RESULTS/overhead.md``.

    .venv/bin/python benchmarks/overhead.py            # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers

from clinfed.core.device import device_of, resolve_device, to_device
from clinfed.core.errors import ProblemLog
from clinfed.core.runs import atomic_write_json, atomic_write_text
from clinfed.federated.client import LocalSettings
from clinfed.federated.engine import RoundEngine
from clinfed.federated.inprocess import InProcessTransport
from clinfed.federated.partition import partition
from clinfed.federated.site import SiteRunner
from clinfed.federated.strategies import get_strategy
from clinfed.modeling.models import build_model, load_tokenizer
from clinfed.modeling.training import length_grouped_batches, make_optimizer
from clinfed.tasks import get_task
from clinfed.tasks.i2b2.synth import generate

PEAK_RSS = """
import resource, sys
from clinfed.commands import main
status = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(status)
"""


def bare_loop_seconds(model, task, dataset, batch_size, generator, lr, head_lr):
    """Forward, backward and AdamW over pre-collated batches: compute only.
    Returns (seconds, tokens)."""
    plan = length_grouped_batches(np.asarray(dataset["n_tokens"]), batch_size, generator)
    device = device_of(model)
    tensors = [to_device(task.collate(dataset[idx.tolist()]), device) for idx in plan]
    optimizer = make_optimizer(model, lr, 0.01, head_lr)
    model.train()
    tokens, started = 0, time.perf_counter()
    for batch in tensors:
        loss = task.loss(model(**task.model_inputs(batch)), batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tokens += int(batch["attention_mask"].sum())
    return time.perf_counter() - started, tokens


def peak_rss_mb(data: Path, out: Path, clients: int, model: str) -> float:
    args = [
        "train",
        "--task",
        "i2b2",
        "--data",
        str(data),
        "--strategy",
        "fedavg",
        "--model",
        model,
        "--rounds",
        "1",
        "--clients",
        str(clients),
        "--partition",
        "iid",
        "--out",
        str(out),
    ]
    result = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *args], capture_output=True, text=True, check=True
    )
    line = next(x for x in result.stdout.splitlines() if x.startswith("PEAK_RSS_KB"))
    return int(line.split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--docs", type=int, default=20, help="documents per site")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    args = parser.parse_args()
    device = resolve_device(args.device)
    print(f"device: {device}", flush=True)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "data"
        generate(data, sites=3, docs=args.docs, seed=0)
        task = get_task("i2b2")
        corpus = task.load(data, ProblemLog())
        tokenizer = load_tokenizer(args.model)
        train = task.encode(corpus.train, tokenizer, 128, work)
        test = task.encode(corpus.test, tokenizer, 128, work)
        groups, labels = task.partition_keys(corpus.train, train)
        clients = partition(groups, labels, np.asarray(train["site"]), "sites", 0, 0.5, 0)
        settings = LocalSettings(batch_size=16, lr=1e-4, head_lr=1e-3)

        # (a), (b): one FedAvg round, then the same batches in a bare loop
        model = build_model(task.head, args.model, len(task.labels), seed=0).to(device)
        start_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        strategy = get_strategy("fedavg")
        runners = {
            name: SiteRunner(
                name,
                task,
                model,
                start_state,
                strategy,
                train.select(idx),
                test.select([]),
                corpus.test,
                settings,
                0,
                Path(work) / "sites" / name,
            )
            for name, idx in clients.items()
        }
        names = [n for n, _ in model.named_parameters()]
        engine = RoundEngine(task, strategy, start_state, names, Path(work) / "run", rounds=1)
        (Path(work) / "run").mkdir()
        started = time.perf_counter()
        # (a) and (b) time round 1, which evaluates nothing (round 2 would
        # carry round 1's evaluation).
        engine.run_round(InProcessTransport(runners), 1)
        round_s = time.perf_counter() - started
        site_records = [json.loads(x) for x in (Path(work) / "run" / "metrics.jsonl").open()]
        client_s = sum(r["wall_s"] for r in site_records)

        bare_s = bare_tokens = 0
        order = np.random.default_rng(0)  # a data order of the same kind, replayed:
        for name in sorted(clients):  # the very same batches, client by client
            model.load_state_dict(start_state)
            model.requires_grad_(True)
            seconds, tokens = bare_loop_seconds(
                model, task, train.select(clients[name]), 16, order, 1e-4, 1e-3
            )
            bare_s, bare_tokens = bare_s + seconds, bare_tokens + tokens
        client_tps = bare_tokens / client_s
        bare_tps = bare_tokens / bare_s

        # (c): peak RSS with 3 and 30 clients over the same data
        rss = {n: peak_rss_mb(data, Path(work) / f"rss{n}", n, args.model) for n in (3, 30)}

    results = {
        "model": args.model,
        "train_examples": len(train),
        "train_tokens": bare_tokens,
        "round_s": round(round_s, 2),
        "client_update_s": round(client_s, 2),
        "bare_compute_s": round(bare_s, 2),
        "round_overhead_share": round(1 - bare_s / round_s, 4),
        "client_update_tokens_per_s": round(client_tps, 1),
        "bare_loop_tokens_per_s": round(bare_tps, 1),
        "client_vs_bare": round(client_tps / bare_tps, 4),
        "peak_rss_mb_3_clients": round(rss[3], 1),
        "peak_rss_mb_30_clients": round(rss[30], 1),
        "rss_30_vs_3": round(rss[30] / rss[3], 4),
    }
    table = (
        "\n".join(
            [
                "| measure | value |",
                "|---|---|",
                "| round overhead (share of a FedAvg round outside compute, no evaluation) | "
                f"{results['round_overhead_share']:.1%} |",
                "| client update vs bare PyTorch loop, tokens/s | "
                f"{client_tps:.0f} vs {bare_tps:.0f} ({results['client_vs_bare']:.2f}x) |",
                f"| peak RSS, 3 vs 30 clients (same data) | {rss[3]:.0f} MB vs {rss[30]:.0f} MB "
                f"({results['rss_30_vs_3']:.2f}x) |",
            ]
        )
        + "\n"
    )
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.results / "overhead.json", results)
    atomic_write_text(args.results / "overhead.md", table)
    print(table)


if __name__ == "__main__":
    main()
