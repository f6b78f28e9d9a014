"""One training run from a data folder to a finished run folder.

Run folder layout::

    RUN/config.json        the resolved configuration
    RUN/metrics.jsonl      centralized: one object per epoch (``epoch``, ``f1``...);
                           federated: per round and client (``round``, ``client``,
                           ``bytes_up``...) and per round (``round``, ``f1``...)
    RUN/state.json         federated: the last committed round (for --resume)
    RUN/checkpoints/       federated: global weights after that round
    RUN/sites/             local: each site's own weights
    RUN/model/             model.safetensors, model.json, tokenizer/
    RUN/predictions/       test-split predictions in the task's real format
    RUN/summary.json       final metrics (and, federated, communication totals)

``centralized`` trains on all sites' data pooled (the upper reference); the
federated strategies run in the in-process simulator.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clinfed.blocks import num_layers, parameter_blocks
from clinfed.errors import ClinfedError, ProblemLog
from clinfed.federated import payload
from clinfed.federated.client import LocalSettings
from clinfed.federated.partition import PARTITIONS, partition
from clinfed.federated.simulator import Federation, Simulator
from clinfed.federated.strategies import STRATEGIES as FEDERATED
from clinfed.federated.strategies import Strategy, get_strategy
from clinfed.models import add_prompts, build_model, load_tokenizer, save_model
from clinfed.privacy.accountant import Mechanism
from clinfed.privacy.policy import PrivacyPolicy, check_settings
from clinfed.prompts import FUSIONS
from clinfed.runs import (
    append_jsonl,
    atomic_write_json,
    create_run_folder,
    ensure_new_run_folder,
    read_jsonl,
)
from clinfed.tasks import TASKS, get_task
from clinfed.tasks.base import Corpus, Task
from clinfed.training import linear_schedule, make_optimizer, predict, train_epoch

STRATEGIES = ("centralized", *FEDERATED)
# Per-task defaults for settings left unset. MIMIC-III has few, long examples
# and a 50-way sigmoid head: smaller batches (more steps) and a fast head.
TASK_DEFAULTS = {
    "i2b2": {"max_length": 128, "batch_size": 16, "lr": 1e-4, "head_lr": 1e-3},
    "mimic3": {"max_length": 256, "batch_size": 8, "lr": 5e-5, "head_lr": 1e-2},
}
PFEDDC_DEFAULTS = {"lr": 1e-2, "head_lr": 1e-2}
# Settings a resumed run may change without changing its results.
RESUMABLE = {"resume", "threads", "cache_dir", "eval_batch_size"}


@dataclass
class RunConfig:
    """Everything that decides a run; written to ``RUN/config.json``."""

    task: str
    data: str
    out: str
    strategy: str = "centralized"
    model: str = "minilm"
    epochs: int = 3
    batch_size: int | None = None
    lr: float | None = None
    head_lr: float | None = None
    weight_decay: float = 0.01
    warmup: float = 0.1
    max_length: int | None = None
    seed: int = 0
    on_error: str = "strict"
    codes: str = "diagnoses"
    top_k: int = 50
    max_chunks: int = 8
    labels: list[str] | None = None  # mimic3: a fixed code list instead of the top-K
    # federated
    rounds: int = 5
    local_epochs: int = 1
    fraction: float = 1.0
    partition: str = "sites"
    clients: int = 0
    alpha: float = 0.5
    mu: float = 0.01
    freeze_warmup: str = "3"  # FedFrozen's --warmup (a round, or "auto")
    train_embeddings: bool = False
    top_layers: int = 2
    selection: str = "global"
    profile_examples: int = 16
    prompt_length: int = 8  # pfeddc: vectors in each of P_g and P_l
    prompt_fusion: str = "attention"  # pfeddc: attention | concat | global (ablations)
    prompt_depth: int = 1  # pfeddc: encoder layers with a prompt of their own (1: input only)
    resume: bool = False
    # privacy (DP-SGD at every site; off unless a target or a noise is given)
    target_epsilon: float | None = None
    delta: float = 1e-5
    noise_multiplier: float | None = None
    max_grad_norm: float = 1.0
    clipping: str = "auto"
    selection_noise: float = 1.0
    # machine
    threads: int = 0
    cache_dir: str | None = None
    eval_batch_size: int = 64

    def validate(self, check_data: bool = True) -> None:
        """Reject impossible settings before anything is read or written
        (``check_data=False``: the data is elsewhere, at Flower nodes)."""
        if self.task not in TASKS:
            raise ClinfedError(f"--task must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.strategy not in STRATEGIES:
            raise ClinfedError(
                f"--strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}"
            )
        for name in ("epochs", "batch_size", "eval_batch_size", "rounds", "local_epochs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ClinfedError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("lr", "head_lr"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ClinfedError(f"--{name.replace('_', '-')} must be positive")
        if not 0 <= self.warmup < 1:
            raise ClinfedError("the learning-rate warm-up share must be in [0, 1)")
        fw = self.freeze_warmup
        if fw != "auto" and not (fw.isdigit() and int(fw) >= 1):
            raise ClinfedError("--warmup must be a round number >= 1 or 'auto'")
        if self.selection not in ("global", "public", "private"):
            raise ClinfedError("--selection must be one of global, public, private")
        if self.top_layers < 1 or self.profile_examples < 1:
            raise ClinfedError("--top-layers and --profile-examples must be at least 1")
        if self.prompt_fusion not in FUSIONS:
            raise ClinfedError(f"--prompt-fusion must be one of {', '.join(FUSIONS)}")
        if not 1 <= self.prompt_length <= 128:
            raise ClinfedError("--prompt-length must be between 1 and 128")
        if self.labels is not None and self.task != "mimic3":
            raise ClinfedError("--labels (a fixed code list) applies to --task mimic3")
        if self.prompt_depth < 1:
            raise ClinfedError("--prompt-depth must be at least 1")
        if not 0 < self.fraction <= 1:
            raise ClinfedError("--fraction must be in (0, 1]")
        if self.partition not in PARTITIONS:
            raise ClinfedError(f"--partition must be one of {', '.join(PARTITIONS)}")
        if self.partition != "sites" and self.clients < 1:
            raise ClinfedError(f"--partition {self.partition} needs --clients N")
        if self.strategy == "local" and self.partition != "sites":
            raise ClinfedError("--strategy local evaluates each site on its own data: use sites")
        if self.max_length is not None and not 8 <= self.max_length <= 512:
            raise ClinfedError("--max-length must be between 8 and 512")
        if self.dp:
            check_settings(
                self.target_epsilon,
                self.delta,
                self.noise_multiplier,
                self.max_grad_norm,
                self.clipping,
            )
            if self.strategy == "centralized":
                raise ClinfedError(
                    "DP-SGD runs at the sites of a federated strategy, not --strategy centralized"
                )
        if not self.selection_noise > 0:
            raise ClinfedError("--selection-noise must be positive")
        if check_data and not Path(self.data).is_dir():
            raise ClinfedError(f"--data {self.data}: not a folder")

    @property
    def dp(self) -> bool:
        """Whether sites train under DP-SGD (``--target-epsilon inf`` is no DP)."""
        finite_target = self.target_epsilon is not None and not math.isinf(self.target_epsilon)
        return finite_target or self.noise_multiplier is not None

    def resolved(self) -> RunConfig:
        """A copy with every unset setting filled from the task's defaults."""
        values = asdict(self)
        defaults = TASK_DEFAULTS[self.task]
        if self.strategy == "pfeddc":
            # Prompts and a fresh head on a frozen encoder learn at
            # prompt-tuning rates, not fine-tuning ones.
            defaults = defaults | PFEDDC_DEFAULTS
        for name, default in defaults.items():
            if values[name] is None:
                values[name] = default
        return RunConfig(**values)


Reporter = Callable[[str, dict[str, Any]], None]


def _quiet(event: str, info: dict[str, Any]) -> None:
    del event, info


def _check_resume(config: RunConfig) -> None:
    """A resumed run must be the same run: same settings, same data."""
    out = Path(config.out)
    saved_path = out / "config.json"
    if not saved_path.is_file():
        raise ClinfedError(f"{out}: no run to resume (no config.json)")
    if config.strategy == "centralized":
        raise ClinfedError("--resume applies to federated strategies (rounds), not centralized")
    saved = json.loads(saved_path.read_text())
    for key, value in asdict(config).items():
        if key not in RESUMABLE and saved.get(key) != value:
            raise ClinfedError(
                f"--resume of {out} with a different config: {key} was {saved.get(key)!r}, "
                f"now {value!r}"
            )


@dataclass
class _Prepared:
    task: Task
    corpus: Corpus
    tokenizer: Any
    model: nn.Module
    out: Path
    cache_dir: str


def _finish(
    prep: _Prepared,
    config: RunConfig,
    test,
    outputs: list,
    record: dict,
    metrics: dict,
    extra: dict | None = None,
) -> dict[str, Any]:
    meta = prep.task.meta() | {"max_length": config.max_length, "encoder": config.model}
    save_model(prep.model, prep.out / "model", meta, prep.tokenizer)
    prep.task.write_predictions(prep.corpus.test, test, outputs, prep.out / "predictions")
    summary = record | (extra or {}) | {"detail": metrics.get("scores")}
    atomic_write_json(prep.out / "summary.json", summary)
    return summary


def run_training(config: RunConfig, report: Reporter = _quiet) -> dict[str, Any]:
    """Train, evaluate and write the run folder.

    Parameters
    ----------
    report
        Called with progress events (``loaded``, ``epoch_start``, ``step``,
        ``eval_start``, ``epoch_end``, ``site_start``, ``site_end``,
        ``round_end``); the CLI draws progress bars from them.

    Returns
    -------
    dict
        The final evaluation record (also in ``RUN/summary.json``).
    """
    config.validate()
    config = config.resolved()
    if config.resume:
        _check_resume(config)
    else:
        ensure_new_run_folder(config.out)
    torch.set_num_threads(config.threads or os.cpu_count() or 1)
    problems = ProblemLog(config.on_error)
    # Tokenized notes are protected health information: unless the user names
    # a cache folder, they live in a temporary one removed after the run.
    with tempfile.TemporaryDirectory(prefix="clinfed-cache-") as tmp:
        cache_dir = config.cache_dir or tmp
        task = make_task(config, cache_dir)
        corpus = task.load(Path(config.data), problems)
        if len(corpus.train) == 0:
            raise ClinfedError(f"{config.data}: no annotated training examples")
        if len(corpus.test) == 0:
            raise ClinfedError(f"{config.data}: no held-out examples to evaluate on")
        # Everything that can fail on bad input happens before the run folder
        # exists, so a failed start leaves nothing behind.
        tokenizer = load_tokenizer(config.model)
        model = make_model(config, task)
        if config.strategy.startswith("safl"):
            layers = num_layers(parameter_blocks([n for n, _ in model.named_parameters()]))
            if config.top_layers > layers:
                raise ClinfedError(
                    f"--top-layers {config.top_layers} exceeds the model's {layers} layers"
                )
        train = task.encode(corpus.train, tokenizer, config.max_length, cache_dir)
        test = task.encode(corpus.test, tokenizer, config.max_length, cache_dir)
        clients = None
        if config.strategy != "centralized":
            groups, labels = task.partition_keys(corpus.train, train)
            clients = partition(
                groups,
                labels,
                np.asarray(train["site"]),
                config.partition,
                config.clients,
                config.alpha,
                config.seed,
            )
        policy = None
        if config.dp:
            sizes = {client: len(idx) for client, idx in clients.items()}
            policy = privacy_policy(config, sizes, Path(config.out) / "privacy")
            problems.problems.extend(policy.warnings)
        out = Path(config.out) if config.resume else create_run_folder(config.out)
        if not config.resume:
            atomic_write_json(out / "config.json", asdict(config))
            atomic_write_json(out / "labels.json", {"labels": task.labels, "sites": corpus.sites})
        report(
            "loaded",
            {
                "train": len(train),
                "test": len(test),
                "sites": corpus.sites,
                "clients": sorted(clients) if clients else None,
                "warnings": [str(p) for p in problems.problems],
            },
        )
        prep = _Prepared(task, corpus, tokenizer, model, out, cache_dir)
        if clients is None:
            return _centralized(prep, config, train, test, report)
        if policy is not None and not config.resume:
            atomic_write_json(out / "privacy" / "policy.json", policy.describe())
        return _federated(prep, config, train, test, clients, report, policy)


def make_model(config: RunConfig, task: Task) -> nn.Module:
    """The run's starting model (with pfeddc's prompts when the strategy has
    them): the same weights wherever it is built from the same config."""
    model = build_model(task.head, config.model, len(task.labels), seed=config.seed)
    if config.strategy == "pfeddc":
        add_prompts(
            model, config.prompt_length, config.prompt_fusion, config.seed, config.prompt_depth
        )
        window = model.encoder.config.max_position_embeddings
        if (config.max_length or 0) + model.prompt.tokens > window:
            raise ClinfedError(
                f"--max-length {config.max_length} plus {model.prompt.tokens} prompt vectors "
                f"exceeds the encoder's {window} positions"
            )
    return model


def make_task(config: RunConfig, cache_dir: str) -> Task:
    """The run's task adapter, with its options."""
    return get_task(
        config.task,
        seed=config.seed,
        codes=config.codes,
        top_k=config.top_k,
        max_chunks=config.max_chunks,
        cache_dir=cache_dir,
        labels=config.labels,
    )


def privacy_policy(config: RunConfig, sizes: dict[str, int], folder: Path) -> PrivacyPolicy:
    """Each site's DP-SGD settings and ledger for a run (``sizes``: training
    examples per site). A site calibrates from its own size only, so the
    simulator and a Flower SuperNode get the same noise."""
    selection = None
    if config.strategy.startswith("safl") and config.selection == "private":
        selection = Mechanism("safl-selection", config.selection_noise, 1.0, 1)
    target = config.target_epsilon
    return PrivacyPolicy.build(
        folder,
        sizes,
        config.batch_size,
        config.local_epochs,
        config.rounds,
        config.delta,
        None if target is None or math.isinf(target) else target,
        config.noise_multiplier,
        config.max_grad_norm,
        config.clipping,
        selection,
    )


def _centralized(prep: _Prepared, config: RunConfig, train, test, report: Reporter) -> dict:
    task, model = prep.task, prep.model
    optimizer = make_optimizer(model, config.lr, config.weight_decay, config.head_lr)
    steps = config.epochs * -(-len(train) // config.batch_size)
    scheduler = linear_schedule(optimizer, steps, config.warmup)
    order = np.random.default_rng(config.seed)
    torch.manual_seed(config.seed)
    record: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    outputs: list = []
    for epoch in range(1, config.epochs + 1):
        report("epoch_start", {"epoch": epoch, "examples": len(train)})
        stats = train_epoch(
            model,
            task,
            train,
            optimizer,
            config.batch_size,
            order,
            scheduler,
            on_step=lambda n: report("step", {"examples": n}),
        )
        report("eval_start", {"epoch": epoch, "examples": len(test)})
        started = time.perf_counter()
        outputs = predict(
            model,
            task,
            test,
            config.eval_batch_size,
            on_step=lambda n: report("eval_step", {"examples": n}),
        )
        metrics = task.evaluate(prep.corpus.test, test, outputs)
        record = {
            "epoch": epoch,
            "f1": metrics["f1"],
            "train_loss": stats.loss,
            "train_tokens": stats.tokens,
            "train_seconds": round(stats.seconds, 3),
            "tokens_per_s": round(stats.tokens_per_s, 1),
            "eval_seconds": round(time.perf_counter() - started, 3),
        } | {k: v for k, v in metrics.items() if k not in ("f1", "scores")}
        append_jsonl(prep.out / "metrics.jsonl", record)
        report("epoch_end", record)
    return _finish(prep, config, test, outputs, record, metrics)


PROBE_SEED = 20_101


def _public_probe(task: Task, tokenizer: Any, config: RunConfig, cache_dir: str):
    """A public probe set for SAFL's free selection modes: a small synthetic
    corpus of the same task, generated here with a fixed seed, so no
    private example shapes the layer choice."""
    folder = Path(cache_dir) / "probe"
    if config.task == "i2b2":
        from clinfed.tasks.i2b2.synth import generate

        generate(folder, sites=3, docs=4, seed=PROBE_SEED)
        records = task.read_documents(folder / "train", ProblemLog())
    else:
        from clinfed.tasks.mimic3.synth import generate

        generate(folder, sites=1, docs=24, seed=PROBE_SEED)
        records = task.read_documents(folder, ProblemLog())
    examples = task.encode(records, tokenizer, config.max_length, cache_dir)
    return examples.shuffle(seed=PROBE_SEED)


def local_settings(config: RunConfig) -> LocalSettings:
    """How every site trains in a round (``config`` resolved)."""
    return LocalSettings(
        epochs=config.local_epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        head_lr=config.head_lr,
        weight_decay=config.weight_decay,
    )


def make_strategy(config: RunConfig, task: Task, tokenizer: Any, cache_dir: str) -> Strategy:
    """The run's federated strategy (with SAFL's public probe set when its
    selection needs one); the simulator and every Flower node build it the
    same way from the same config."""
    fw = config.freeze_warmup
    warmup = fw if fw == "auto" else int(fw)
    probe = None
    if config.strategy.startswith("safl") and config.selection != "private":
        probe = _public_probe(task, tokenizer, config, cache_dir)
    return get_strategy(
        config.strategy,
        config.mu,
        warmup,
        config.train_embeddings,
        config.top_layers,
        config.selection,
        probe,
        config.profile_examples,
        config.seed,
        config.selection_noise,
    )


def _federated(
    prep: _Prepared,
    config: RunConfig,
    train,
    test,
    clients: dict,
    report: Reporter,
    policy: PrivacyPolicy | None = None,
) -> dict:
    strategy = make_strategy(config, prep.task, prep.tokenizer, prep.cache_dir)
    fed = Federation(
        prep.task,
        prep.model,
        strategy,
        train,
        test,
        prep.corpus.test,
        clients,
        local_settings(config),
        config.rounds,
        config.fraction,
        config.seed,
        config.eval_batch_size,
        policy,
    )
    # FedAvg's payload for this model: the yardstick for every strategy.
    full_bytes = len(payload.encode(dict(prep.model.named_parameters())))
    torch.manual_seed(config.seed)
    simulator = Simulator(fed, prep.out, report)
    if config.resume:
        simulator.resume()
    record = simulator.run()
    sites = [r for r in read_jsonl(prep.out / "metrics.jsonl") if "bytes_up" in r]
    up = sum(r["bytes_up"] for r in sites)
    down = sum(r["bytes_down"] for r in sites)
    extra = {
        "mb_up": up / 1e6,
        "mb_down": down / 1e6,
        "fedavg_mb_up": full_bytes * len(sites) / 1e6,
        "ratio_to_fedavg_up": up / (full_bytes * len(sites)) if sites else 0.0,
    }
    if simulator.stopped:
        extra["stopped"] = simulator.stopped
    if policy is not None:
        extra["epsilon"] = {site: policy.ledger(site).spent for site in sorted(clients)}
        extra["delta"] = config.delta
    return _finish(prep, config, test, simulator.outputs, record, simulator.last_metrics, extra)
