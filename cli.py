"""The ``clinfed`` command: parse flags, call the library, print.

Installed as ``clinfed.cli`` (``clinfed/cli.py`` links here). Every error a
user can fix is a :class:`~clinfed.errors.ClinfedError`: one line per problem
on stderr, exit status 2, no traceback, and never any note text.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from clinfed.errors import EXIT_USAGE, ClinfedError, DataError, ProblemLog
from clinfed.quiet import quiet_libraries

app = typer.Typer(
    help="Federated training of clinical NLP models with privacy accounting.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Make and validate corpora.", no_args_is_help=True)
app.add_typer(data_app, name="data")

out = Console()
err = Console(stderr=True)
MAX_PROBLEMS_SHOWN = 50


class TaskName(str, Enum):
    i2b2 = "i2b2"
    mimic3 = "mimic3"


class OnError(str, Enum):
    strict = "strict"
    skip = "skip"


class CodeKind(str, Enum):
    diagnoses = "diagnoses"
    procedures = "procedures"
    both = "both"


class Strategy(str, Enum):
    centralized = "centralized"
    fedavg = "fedavg"
    fedprox = "fedprox"
    local = "local"
    fedfrozen = "fedfrozen"
    safl = "safl"
    safl_fedfrozen = "safl+fedfrozen"
    pfeddc = "pfeddc"


class Selection(str, Enum):
    global_ = "global"
    public = "public"
    private = "private"


class Heterogeneity(str, Enum):
    normal = "normal"
    strong = "strong"


class PromptFusion(str, Enum):
    attention = "attention"
    concat = "concat"
    global_ = "global"


class Clipping(str, Enum):
    auto = "auto"
    hooks = "hooks"
    ghost = "ghost"


class Partition(str, Enum):
    iid = "iid"
    dirichlet = "dirichlet"


class BaselineKind(str, Enum):
    dictionary = "dictionary"
    frequency = "frequency"
    keyword = "keyword"


ON_ERROR = typer.Option(
    OnError.strict,
    "--on-error",
    help="strict: report every problem and stop (exit 2); skip: report and leave the bad item out.",
)
CODES = typer.Option(CodeKind.diagnoses, "--codes", help="mimic3: which ICD-9 codes are labels.")
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _warn(problems: list) -> None:
    for problem in problems[:MAX_PROBLEMS_SHOWN]:
        err.print(f"[yellow]warning:[/] {problem}", highlight=False, markup=True, soft_wrap=True)
    if len(problems) > MAX_PROBLEMS_SHOWN:
        err.print(f"[yellow]warning:[/] ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")


# ---------------------------------------------------------------- data
@data_app.command("synth")
def data_synth(
    task: TaskName = typer.Argument(..., help="i2b2 or mimic3."),
    out_dir: Path = typer.Option(
        ..., "--out", help="Folder to write (must not hold a corpus yet)."
    ),
    sites: int = typer.Option(3, "--sites", min=1, max=50, help="Number of hospitals."),
    docs: int = typer.Option(
        40, "--docs", min=2, help="Documents (i2b2) or admissions (mimic3) per site."
    ),
    seed: int = typer.Option(0, "--seed", help="Same seed, same corpus."),
    canary: str = typer.Option(
        None, "--canary", help="mimic3: plant this string in every note (leak audits)."
    ),
    heterogeneity: Heterogeneity = typer.Option(
        Heterogeneity.normal,
        "--heterogeneity",
        help="normal, or strong: sites far apart in concept-type or code mix and abbreviations.",
    ),
) -> None:
    """Write a synthetic multi-site corpus in the real release format."""
    from clinfed.runs import ensure_new_run_folder

    ensure_new_run_folder(out_dir)
    if task is TaskName.i2b2:
        from clinfed.tasks.i2b2.synth import generate

        counts = generate(
            out_dir, sites=sites, docs=docs, seed=seed, heterogeneity=heterogeneity.value
        )
        unit = "documents"
    else:
        from clinfed.tasks.mimic3.synth import generate

        counts = generate(
            out_dir,
            sites=sites,
            docs=docs,
            seed=seed,
            canary=canary,
            heterogeneity=heterogeneity.value,
        )
        unit = "admissions"
    out.print(
        f"wrote {counts['train']} training and {counts['test']} test {unit} "
        f"from {sites} sites to {out_dir}"
    )


@data_app.command("check")
def data_check(
    data: Path = typer.Argument(..., help="Corpus folder."),
    task: TaskName = typer.Option(..., "--task", help="i2b2 or mimic3."),
    on_error: OnError = ON_ERROR,
    codes: CodeKind = CODES,
    as_json: bool = JSON,
) -> None:
    """Validate a corpus and summarize it (documents, concepts, codes, sites)."""
    from clinfed.tasks import get_task

    problems = ProblemLog(on_error.value)
    summary = get_task(task.value, codes=codes.value, top_k=0).summarize(data, problems)
    if as_json:
        _print_json(summary)
        return
    _warn(summary.pop("problems"))
    table = Table(title=f"{task.value} corpus {data}", show_header=False)
    for key, value in summary.items():
        if isinstance(value, dict) and len(value) > 12:
            top = sorted(value.items(), key=lambda kv: -kv[1])[:10]
            value = ", ".join(f"{k}: {v}" for k, v in top) + f", ... ({len(value)} in all)"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        table.add_row(key.replace("_", " "), str(value))
    out.print(table)


# --------------------------------------------------------------- score
@app.command("score")
def score(
    task: TaskName = typer.Option(..., "--task", help="i2b2 or mimic3."),
    gold: Path = typer.Option(..., "--gold", help="Gold corpus folder."),
    pred: Path = typer.Option(
        ..., "--pred", help="i2b2: folder of .con files; mimic3: predictions.csv."
    ),
    codes: CodeKind = CODES,
    as_json: bool = JSON,
) -> None:
    """Score predictions: i2b2 exact/inexact P/R/F1; mimic3 F1, AUC, P@k."""
    from clinfed.scoring import score_i2b2, score_mimic3

    problems = ProblemLog("strict")
    if task is TaskName.i2b2:
        result = score_i2b2(gold, pred, problems)
    else:
        result = score_mimic3(gold, pred, codes.value, problems)
    if as_json:
        _print_json(result)
        return
    if task is TaskName.i2b2:
        table = Table(title=f"i2b2 concepts ({result['documents']} documents)")
        for column in ("mode", "type", "precision", "recall", "f1", "gold", "predicted"):
            table.add_column(column, justify="left" if column in ("mode", "type") else "right")
        for mode in ("exact", "inexact"):
            for kind, s in result[mode].items():
                table.add_row(
                    mode,
                    kind,
                    f"{s['precision']:.4f}",
                    f"{s['recall']:.4f}",
                    f"{s['f1']:.4f}",
                    str(s["n_gold"]),
                    str(s["n_pred"]),
                )
        out.print(table)
        if result["missing_predictions"]:
            missing = len(result["missing_predictions"])
            err.print(f"warning: {missing} gold documents have no prediction file")
    else:
        table = Table(
            title=f"ICD-9 coding ({result['admissions']} admissions, {result['labels']} codes)"
        )
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in result.items():
            if key not in ("admissions", "labels", "f1"):
                table.add_row(key, f"{value:.4f}")
        out.print(table)


# ---------------------------------------------------------------- train
def _load_config(ctx: typer.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``--config FILE``: TOML keys named like the flags (``batch-size = 8``,
    or under a ``[train]`` table) become the defaults; flags given on the
    command line still win (click's ``default_map``)."""
    del param
    if value is None:
        return None
    import tomllib

    try:
        data = tomllib.loads(value.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise typer.BadParameter(f"{value}: {exc}") from None
    table = data.get("train", data)
    names = {
        opt.lstrip("-").replace("-", "_"): p.name
        for p in ctx.command.params
        for opt in getattr(p, "opts", [])
        if opt.startswith("--")
    }
    defaults = {}
    for key, setting in table.items():
        name = names.get(key.replace("-", "_"))
        if name is None or name == "config":
            raise typer.BadParameter(f"{value}: unknown setting {key!r}")
        defaults[name] = setting.value if isinstance(setting, Enum) else setting
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


class _ProgressReporter:
    """Draws rich progress bars from the pipeline's events."""

    def __init__(self, progress: Progress, epochs: int):
        self.progress, self.epochs, self.bar = progress, epochs, None

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        p = self.progress
        if event == "loaded":
            _warn(info["warnings"])
            p.console.print(
                f"{info['train']} training and {info['test']} held-out examples "
                f"from sites {', '.join(info['sites'])}"
            )
        elif event in ("epoch_start", "eval_start"):
            if self.bar is not None:
                p.remove_task(self.bar)
            label = "train" if event == "epoch_start" else "evaluate"
            self.bar = p.add_task(
                f"epoch {info['epoch']}/{self.epochs} {label}", total=info["examples"]
            )
        elif event in ("step", "eval_step"):
            p.advance(self.bar, info["examples"])
        elif event == "epoch_end":
            p.console.print(
                f"epoch {info['epoch']}: f1 {info['f1']:.4f}  loss {info['train_loss']:.4f}  "
                f"{info['tokens_per_s']:.0f} tokens/s"
            )
        elif event == "site_start":
            if self.bar is not None:
                p.remove_task(self.bar)
            self.bar = p.add_task(f"round {info['round']} {info['client']}", total=None)
        elif event == "site_end":
            # Under DP the training loss is not released; epsilon is shown instead.
            detail = (
                f"epsilon {info['epsilon']:.3f}"
                if "epsilon" in info
                else f"loss {info['train_loss']:.4f}"
            )
            p.console.print(
                f"round {info['round']} {info['client']}: {detail}  "
                f"up {info['bytes_up'] / 1e6:.1f} MB  {info['wall_s']:.0f} s"
            )
        elif event == "site_refused":
            p.console.print(
                f"[yellow]round {info['round']} {info['client']}: refused, epsilon would reach "
                f"{info['epsilon_if_trained']:.3f} (spent {info['epsilon']:.3f})[/]"
            )
        elif event == "stopped":
            p.console.print(f"[yellow]{info['reason']}[/]")
        elif event == "round_end":
            p.console.print(f"[bold]round {info['round']}[/]: f1 {info['f1']:.4f}")


def _round_table(run: Path) -> None:
    """Per-round summary of a federated run, read back from its metrics.jsonl."""
    from clinfed.runs import read_jsonl

    records = read_jsonl(run / "metrics.jsonl")
    table = Table(title=f"{run}")
    private = any("epsilon" in r for r in records)
    columns = ("round", "f1", "clients", "MB up", "MB down") + (("max epsilon",) if private else ())
    for column in columns:
        table.add_column(column, justify="right")
    for record in (r for r in records if "client" not in r):
        sites = [r for r in records if "bytes_up" in r and r["round"] == record["round"]]
        row = [
            str(record["round"]),
            f"{record['f1']:.4f}",
            str(len(sites)),
            f"{sum(r['bytes_up'] for r in sites) / 1e6:.1f}",
            f"{sum(r['bytes_down'] for r in sites) / 1e6:.1f}",
        ]
        if private:
            row.append(f"{max((r.get('epsilon', 0.0) for r in sites), default=0.0):.3f}")
        table.add_row(*row)
    out.print(table)


@app.command("train")
def train(
    config_file: Path = typer.Option(
        None,
        "--config",
        help="TOML file of settings named like the flags; flags override it.",
        is_eager=True,
        callback=_load_config,
        exists=True,
        dir_okay=False,
    ),
    task: TaskName = typer.Option(..., "--task", help="i2b2 or mimic3."),
    data: Path = typer.Option(
        ..., "--data", help="Corpus folder (train/ and test/, or one folder to split)."
    ),
    out_dir: Path = typer.Option(..., "--out", help="New run folder (refused if it holds files)."),
    strategy: Strategy = typer.Option(
        Strategy.centralized, "--strategy", help="Training strategy."
    ),
    model: str = typer.Option(
        "minilm", "--model", help="minilm (bundled), tiny (random, tests) or a checkpoint folder."
    ),
    epochs: int = typer.Option(3, "--epochs", help="Passes over the training data."),
    batch_size: int = typer.Option(
        None, "--batch-size", help="Examples per step (default: i2b2 16, mimic3 8)."
    ),
    lr: float = typer.Option(
        None,
        "--lr",
        help="AdamW rate of the encoder, linear warm-up and decay "
        "(default: i2b2 1e-4, mimic3 5e-5).",
    ),
    head_lr: float = typer.Option(
        None,
        "--head-lr",
        help="Rate of the freshly initialised task head (default: i2b2 1e-3, mimic3 1e-2).",
    ),
    max_length: int = typer.Option(
        None, "--max-length", help="Encoder window in tokens (default: i2b2 128, mimic3 256)."
    ),
    seed: int = typer.Option(
        0, "--seed", help="Seeds the model head, data order, dropout and splits."
    ),
    on_error: OnError = ON_ERROR,
    codes: CodeKind = CODES,
    top_k: int = typer.Option(
        50, "--top-k", help="mimic3: keep the K most frequent codes (0: all)."
    ),
    max_chunks: int = typer.Option(8, "--max-chunks", help="mimic3: windows kept per admission."),
    rounds: int = typer.Option(5, "--rounds", help="Federated rounds."),
    local_epochs: int = typer.Option(
        1, "--local-epochs", help="Passes over a site's data per round."
    ),
    sites_from_data: bool = typer.Option(
        False,
        "--sites-from-data",
        help="One client per hospital, as the corpus says (the default).",
    ),
    clients: int = typer.Option(
        0, "--clients", help="Instead of the corpus's sites: N clients made by --partition."
    ),
    partition_mode: Partition = typer.Option(
        Partition.iid, "--partition", help="With --clients: iid, or dirichlet label skew."
    ),
    alpha: float = typer.Option(0.5, "--alpha", help="Dirichlet concentration (small: skewed)."),
    fraction: float = typer.Option(1.0, "--fraction", help="Share of clients sampled per round."),
    mu: float = typer.Option(0.01, "--mu", help="FedProx proximal weight."),
    warmup: str = typer.Option(
        "3", "--warmup", help="FedFrozen: round from which Q/K are frozen, or 'auto'."
    ),
    train_embeddings: bool = typer.Option(
        False, "--train-embeddings", help="SAFL, FedFrozen: train and exchange the embeddings too."
    ),
    top_layers: int = typer.Option(
        2, "--top-layers", help="SAFL: encoder layers each site trains and sends per round."
    ),
    selection: Selection = typer.Option(
        Selection.global_,
        "--selection",
        help="SAFL layer choice from: global (released model, public probe; free), public "
        "(site model, public probe; free) or private (site data, noised; has a privacy cost).",
    ),
    profile_examples: int = typer.Option(
        16, "--profile-examples", help="SAFL: examples per attention profile."
    ),
    prompt_length: int = typer.Option(
        8, "--prompt-length", help="pfeddc: vectors in the global and in the local prompt."
    ),
    prompt_depth: int = typer.Option(
        1,
        "--prompt-depth",
        help="pfeddc: encoder layers that get prompts of their own (1: the input only; up to "
        "the layer count: deep prompts).",
    ),
    prompt_fusion: PromptFusion = typer.Option(
        PromptFusion.attention,
        "--prompt-fusion",
        help="pfeddc: attention (cross-attention fusion of global and local prompts), concat "
        "(ablation: both prepended, no fusion) or global (ablation: no local prompt).",
    ),
    target_epsilon: float = typer.Option(
        None,
        "--target-epsilon",
        help="DP-SGD at every site, each site's noise calibrated so the planned rounds end at "
        "or just under this epsilon; sites refuse rounds past it ('inf': no DP).",
    ),
    delta: float = typer.Option(1e-5, "--delta", help="DP delta (below 1 / site examples)."),
    noise_multiplier: float = typer.Option(
        None,
        "--noise-multiplier",
        help="DP-SGD with this noise multiplier at every site instead of calibrating one.",
    ),
    max_grad_norm: float = typer.Option(
        1.0, "--max-grad-norm", help="DP-SGD per-example clipping norm."
    ),
    clipping: Clipping = typer.Option(
        Clipping.auto,
        "--clipping",
        help="DP-SGD per-example clipping: hooks, ghost, or auto (ghost when embeddings train "
        "and examples are single rows, else hooks).",
    ),
    selection_noise: float = typer.Option(
        1.0,
        "--selection-noise",
        help="SAFL --selection private: noise multiplier of the layer choice (charged to the "
        "privacy ledger every round).",
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out from its last completed round."
    ),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0: all cores)."),
    cache_dir: Path = typer.Option(
        None,
        "--cache-dir",
        help="Keep tokenized data here for reuse (it holds note content: protect it "
        "like the data). Default: a temporary folder, deleted after the run.",
    ),
) -> None:
    """Train a model and write a run folder (config, metrics.jsonl, model, predictions)."""
    from clinfed.pipeline import RunConfig, run_training

    if sites_from_data and clients:
        raise ClinfedError("--sites-from-data and --clients exclude each other: choose one")
    config = RunConfig(
        task=task.value,
        data=str(data),
        out=str(out_dir),
        strategy=strategy.value,
        model=model,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        head_lr=head_lr,
        max_length=max_length,
        seed=seed,
        on_error=on_error.value,
        codes=codes.value,
        top_k=top_k,
        max_chunks=max_chunks,
        rounds=rounds,
        local_epochs=local_epochs,
        partition=partition_mode.value if clients else "sites",
        clients=clients,
        alpha=alpha,
        fraction=fraction,
        mu=mu,
        freeze_warmup=warmup,
        train_embeddings=train_embeddings,
        top_layers=top_layers,
        selection=selection.value,
        profile_examples=profile_examples,
        prompt_length=prompt_length,
        prompt_fusion=prompt_fusion.value,
        prompt_depth=prompt_depth,
        target_epsilon=target_epsilon,
        delta=delta,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        clipping=clipping.value,
        selection_noise=selection_noise,
        resume=resume,
        threads=threads,
        cache_dir=str(cache_dir) if cache_dir else None,
    )
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=err, transient=True) as progress:
        summary = run_training(config, _ProgressReporter(progress, epochs))
    if "mb_up" in summary:
        _round_table(out_dir)
        if summary.get("stopped"):
            out.print(f"[yellow]{summary['stopped']}[/]")
        if "epsilon" in summary:
            spent = ", ".join(f"{k} {v:.3f}" for k, v in summary["epsilon"].items())
            out.print(f"privacy spent (epsilon at delta {summary['delta']:g}): {spent}")
        out.print(
            f"[bold]done[/]: held-out f1 {summary['f1']:.4f}; uploaded {summary['mb_up']:.1f} MB, "
            f"downloaded {summary['mb_down']:.1f} MB ({summary['ratio_to_fedavg_up']:.0%} of "
            f"FedAvg's upload); run folder {out_dir}"
        )
    else:
        out.print(
            f"[bold]done[/]: held-out f1 {summary['f1']:.4f} "
            f"({summary['tokens_per_s']:.0f} training tokens/s); run folder {out_dir}"
        )


privacy_app = typer.Typer(
    help="The privacy accountant as a calculator (RDP of the subsampled Gaussian).",
    no_args_is_help=True,
)
app.add_typer(privacy_app, name="privacy")


@privacy_app.command("epsilon")
def privacy_epsilon(
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson rate q = batch / n."),
    noise_multiplier: float = typer.Option(..., "--noise-multiplier", help="Noise over clip."),
    steps: int = typer.Option(..., "--steps", help="DP-SGD steps."),
    delta: float = typer.Option(..., "--delta", help="Target delta."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (key: epsilon)."),
) -> None:
    """Epsilon spent by STEPS steps of DP-SGD at rate Q and noise S."""
    from clinfed.privacy.calculator import epsilon_for

    result = epsilon_for(sample_rate, noise_multiplier, steps, delta)
    if as_json:
        _print_json(result)
    else:
        out.print(
            f"epsilon {result['epsilon']:.4f} at delta {delta:g} "
            f"(PLD, tighter: {result['epsilon_pld']:.4f}); {result['accountant']}"
        )


@privacy_app.command("noise")
def privacy_noise(
    target_epsilon: float = typer.Option(..., "--target-epsilon", help="Budget epsilon."),
    delta: float = typer.Option(..., "--delta", help="Target delta."),
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson rate q = batch / n."),
    steps: int = typer.Option(..., "--steps", help="DP-SGD steps."),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (keys: noise_multiplier, epsilon)."
    ),
) -> None:
    """The smallest noise multiplier that keeps STEPS steps within the target."""
    from clinfed.privacy.calculator import noise_for

    result = noise_for(target_epsilon, delta, sample_rate, steps)
    if as_json:
        _print_json(result)
    else:
        out.print(
            f"noise multiplier {result['noise_multiplier']:.4f} gives epsilon "
            f"{result['epsilon']:.4f} at delta {delta:g}"
        )


@app.command("report")
def report_cmd(
    run: Path = typer.Argument(..., help="A run folder.", exists=True, file_okay=False),
) -> None:
    """Write RUN/report/ (report.html, report.md, privacy.json): what the run
    released, what it cost in epsilon per site, layers sent, F1."""
    from clinfed.privacy.report import write_report

    folder = write_report(run)
    out.print(f"[bold]report[/]: {folder / 'report.html'}")


@app.command("audit")
def audit_cmd(
    run: Path = typer.Argument(..., help="A finished run folder.", exists=True, file_okay=False),
    max_examples: int = typer.Option(
        400, "--max-examples", help="Training and held-out examples each."
    ),
) -> None:
    """Loss-threshold membership-inference attack on the run's model; writes
    RUN/audit.json (shown by clinfed report)."""
    from clinfed.privacy.audit import audit

    result = audit(run, max_examples)
    out.print(
        f"membership-inference AUC {result['auc']:.3f} ({result['members']} training vs "
        f"{result['non_members']} held-out examples; 0.5 = no better than chance)"
    )


@app.command("sweep")
def sweep_cmd(
    task: TaskName = typer.Option(..., "--task", help="i2b2 or mimic3."),
    data: Path = typer.Option(..., "--data", help="Corpus folder."),
    out_dir: Path = typer.Option(..., "--out", help="Sweep folder (one run folder per cell)."),
    strategies: str = typer.Option(
        "fedavg,safl,fedfrozen,safl+fedfrozen", "--strategies", help="Comma-separated."
    ),
    epsilons: str = typer.Option(
        "0.5,1,2,4,8,inf", "--epsilons", help="Target epsilons, comma-separated; inf = no DP."
    ),
    seeds: int = typer.Option(1, "--seeds", help="Seeds per cell (0..N-1)."),
    model: str = typer.Option("minilm", "--model", help="minilm, tiny or a checkpoint folder."),
    rounds: int = typer.Option(5, "--rounds", help="Federated rounds per cell."),
    delta: float = typer.Option(1e-5, "--delta", help="DP delta."),
    max_length: int = typer.Option(None, "--max-length", help="Encoder window in tokens."),
    top_layers: int = typer.Option(2, "--top-layers", help="SAFL layers per site."),
    warmup: str = typer.Option("3", "--warmup", help="FedFrozen warm-up round or 'auto'."),
    top_k: int = typer.Option(50, "--top-k", help="mimic3: most frequent codes kept."),
    max_chunks: int = typer.Option(8, "--max-chunks", help="mimic3: windows per admission."),
    batch_size: int = typer.Option(
        None, "--batch-size", help="Expected batch per step (default: the task's)."
    ),
    lr: float = typer.Option(None, "--lr", help="Encoder learning rate (default: the task's)."),
    local_epochs: int = typer.Option(1, "--local-epochs", help="Local epochs per round."),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="DP clipping norm."),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0: all cores)."),
) -> None:
    """F1 at fixed epsilon budgets: one run per strategy x epsilon x seed,
    resumable, summarised in sweep.csv, sweep.md and sweep.png."""
    from clinfed.pipeline import RunConfig
    from clinfed.sweep import parse_epsilons, run_sweep

    base = RunConfig(
        task=task.value,
        data=str(data),
        out=str(out_dir),
        model=model,
        rounds=rounds,
        delta=delta,
        max_length=max_length,
        top_layers=top_layers,
        freeze_warmup=warmup,
        top_k=top_k,
        max_chunks=max_chunks,
        batch_size=batch_size,
        lr=lr,
        local_epochs=local_epochs,
        max_grad_norm=max_grad_norm,
        threads=threads,
    )
    names = [s.strip() for s in strategies.split(",") if s.strip()]

    def show(event: str, info: dict[str, Any]) -> None:
        if event == "cell_start":
            err.print(f"sweep: running {info['cell']}")

    run_sweep(base, out_dir, names, parse_epsilons(epsilons), seeds, show)
    out.print((out_dir / "sweep.md").read_text())
    out.print(f"[bold]sweep[/]: {out_dir / 'sweep.csv'}, {out_dir / 'sweep.png'}")


@app.command("evaluate")
def evaluate(
    run: Path = typer.Argument(..., help="A finished run folder."),
    data: Path = typer.Option(..., "--data", help="Folder of annotated documents to score."),
    on_error: OnError = ON_ERROR,
    as_json: bool = JSON,
) -> None:
    """Score a run's final model on a folder of annotated data."""
    from clinfed.inference import evaluate_run

    metrics = evaluate_run(run, data, on_error.value)
    _warn(metrics.pop("warnings"))
    if as_json:
        _print_json(metrics)
        return
    table = Table(title=f"{run} on {data}", show_header=False)
    for key, value in metrics.items():
        if isinstance(value, float):
            table.add_row(key, f"{value:.4f}")
        elif isinstance(value, dict) and key == "per_site_f1":
            table.add_row(key, ", ".join(f"{k}: {v:.4f}" for k, v in value.items()))
    out.print(table)


@app.command("predict")
def predict_cmd(
    run: Path = typer.Argument(..., help="A finished run folder."),
    data: Path = typer.Option(..., "--data", help="Folder of documents (i2b2) or CSVs (mimic3)."),
    out_dir: Path = typer.Option(..., "--out", help="New folder for the predictions."),
    on_error: OnError = ON_ERROR,
) -> None:
    """Write predictions in the real format: i2b2 .con files, mimic3 predictions.csv."""
    from clinfed.inference import predict_run

    count = predict_run(run, data, out_dir, on_error.value)
    out.print(f"wrote predictions for {count} records to {out_dir}")


# ------------------------------------------------------------- baseline
@app.command("baseline")
def baseline(
    task: TaskName = typer.Option(..., "--task", help="i2b2 or mimic3."),
    data: Path = typer.Option(..., "--data", help="Corpus folder."),
    kind: BaselineKind = typer.Option(
        ..., "--kind", help="i2b2: dictionary; mimic3: frequency or keyword."
    ),
    codes: CodeKind = CODES,
    top_k: int = typer.Option(
        50, "--top-k", help="mimic3: keep the K most frequent codes (0: all)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the split when the corpus has none."),
    as_json: bool = JSON,
) -> None:
    """Score a model-free baseline on the held-out split."""
    from clinfed.baselines import i2b2_dictionary, mimic3_frequency, mimic3_keyword
    from clinfed.tasks import get_task

    valid = {
        TaskName.i2b2: {BaselineKind.dictionary},
        TaskName.mimic3: {BaselineKind.frequency, BaselineKind.keyword},
    }
    if kind not in valid[task]:
        raise ClinfedError(f"--kind {kind.value} does not apply to {task.value}")
    handle = get_task(task.value, seed=seed, codes=codes.value, top_k=top_k)
    corpus = handle.load(data, ProblemLog("strict"))
    if task is TaskName.i2b2:
        result = i2b2_dictionary(corpus.train, corpus.test)
    else:
        ks = (5,) if len(handle.labels) <= 50 else (8, 15)
        if kind is BaselineKind.frequency:
            result = mimic3_frequency(
                corpus.train["codes"], corpus.test["codes"], handle.labels, ks
            )
        else:
            result = mimic3_keyword(
                corpus.train["text"],
                corpus.train["codes"],
                corpus.test["text"],
                corpus.test["codes"],
                handle.labels,
                ks,
            )
    if as_json:
        _print_json(result)
    else:
        out.print(f"{kind.value} baseline on {task.value}: f1 {result['f1']:.4f}")


# --------------------------------------------------------------- flower
flower_app = typer.Typer(
    help="Multi-hospital deployment on Flower: a SuperLink, one SuperNode per site.",
    no_args_is_help=True,
)
app.add_typer(flower_app, name="flower")
INSECURE = typer.Option(
    False, "--insecure", help="No TLS (plain HTTP). Only for a test on one machine."
)
ROOT_CERT = typer.Option(
    None, "--root-cert", help="CA certificate (ca.crt) that signed the SuperLink's certificate."
)
SUPERLINK = typer.Option(
    "127.0.0.1:8000", "--superlink", help="The SuperLink's address, HOST:PORT."
)


def _exec(command: list[str], env: dict[str, str]) -> int:
    """Run a Flower process in the foreground; Ctrl-C stops it."""
    import subprocess

    err.print(f"running: {' '.join(command)}", highlight=False, soft_wrap=True)
    try:
        return subprocess.run(command, env=env).returncode
    except KeyboardInterrupt:
        return 130


@flower_app.command("certs")
def flower_certs(
    out_dir: Path = typer.Option(..., "--out", help="Folder for ca.crt, server.pem and keys."),
    host: list[str] = typer.Option(
        ["127.0.0.1", "localhost"], "--host", help="Names or IPs the SuperLink is reached at."
    ),
    days: int = typer.Option(365, "--days", help="Validity in days."),
) -> None:
    """Make a private CA and a SuperLink certificate (for pilots and tests)."""
    from clinfed.flower.deploy import make_certificates

    written = make_certificates(out_dir, host, days)
    out.print(f"wrote {', '.join(sorted(written))} to {out_dir}")


@flower_app.command("key")
def flower_key(
    out_dir: Path = typer.Option(..., "--out", help="Folder for the key pair."),
    name: str = typer.Option(..., "--name", help="File name (the site's name, say)."),
) -> None:
    """Make a SuperNode authentication key pair (register the .pub with the SuperLink)."""
    from clinfed.flower.deploy import make_node_key

    private, public = make_node_key(out_dir, name)
    out.print(f"private key {private} (stays at the site); public key {public}")


@flower_app.command("superlink")
def flower_superlink(
    certs: Path = typer.Option(
        None, "--certs", help="Folder with ca.crt, server.pem, server.key (clinfed flower certs)."
    ),
    insecure: bool = INSECURE,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port of the SuperLink's HTTP APIs."),
    database: Path = typer.Option(None, "--database", help="SQLite state file (default: memory)."),
    node_auth: bool = typer.Option(
        False, "--node-auth", help="Accept only registered SuperNodes (clinfed flower register)."
    ),
    home: Path = typer.Option(None, "--home", help="Flower's home folder (default ~/.flwr)."),
) -> None:
    """Start the SuperLink (the server's end; runs the ServerApp of each submitted run)."""
    from clinfed.flower.deploy import environment, superlink_command

    command = superlink_command(certs, insecure, host, port, database, node_auth)
    raise typer.Exit(_exec(command, environment(home)))


@flower_app.command("supernode")
def flower_supernode(
    superlink: str = SUPERLINK,
    data: Path = typer.Option(..., "--data", help="This site's data folder (task format)."),
    state: Path = typer.Option(
        ..., "--state", help="This site's state folder: ledger, model copy, predictions."
    ),
    site: str = typer.Option(None, "--site", help="Site name, if the data holds several."),
    max_epsilon: float = typer.Option(
        None, "--max-epsilon", help="Most epsilon this site spends on a run, whatever is asked."
    ),
    root_cert: Path = ROOT_CERT,
    insecure: bool = INSECURE,
    key: Path = typer.Option(None, "--key", help="Private key for SuperNode authentication."),
    port: int = typer.Option(9094, "--port", help="Local port of the node's own runtime API."),
    share_ledger: bool = typer.Option(
        True, "--share-ledger/--keep-ledger", help="Report ledger lines to the server's report."
    ),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0: all cores)."),
) -> None:
    """Start a SuperNode for one site (trains when the SuperLink asks)."""
    from clinfed.flower.deploy import environment, supernode_command

    command = supernode_command(
        superlink,
        data,
        state,
        site,
        max_epsilon,
        root_cert,
        insecure,
        key,
        port,
        share_ledger,
        threads,
    )
    state.mkdir(parents=True, exist_ok=True)
    raise typer.Exit(_exec(command, environment(state / "flwr")))


@flower_app.command("register")
def flower_register(
    public_key: Path = typer.Argument(..., help="A SuperNode's .pub (clinfed flower key)."),
    superlink: str = SUPERLINK,
    root_cert: Path = ROOT_CERT,
    insecure: bool = INSECURE,
) -> None:
    """Register a SuperNode's public key with a SuperLink started with --node-auth."""
    import tempfile

    from clinfed.flower.deploy import environment, register_command, write_connection

    with tempfile.TemporaryDirectory(prefix="clinfed-flwr-") as home:
        write_connection(Path(home), superlink, root_cert, insecure)
        raise typer.Exit(_exec(register_command(public_key), environment(Path(home))))


@flower_app.command("run")
def flower_run(
    config_file: Path = typer.Option(
        None,
        "--config",
        help="TOML of training settings named like clinfed train's flags ([train] table or top "
        "level); the flags below override it.",
        exists=True,
        dir_okay=False,
    ),
    task: TaskName = typer.Option(None, "--task", help="i2b2."),
    out_dir: Path = typer.Option(
        ..., "--out", help="New run folder, on the SuperLink's machine (made absolute here)."
    ),
    strategy: Strategy = typer.Option(None, "--strategy", help="Federated strategy."),
    model: str = typer.Option(None, "--model", help="minilm (bundled), tiny, or a folder."),
    rounds: int = typer.Option(None, "--rounds", help="Federated rounds."),
    seed: int = typer.Option(None, "--seed", help="Seeds the model head and every site."),
    target_epsilon: float = typer.Option(
        None, "--target-epsilon", help="DP-SGD at every site, calibrated to this epsilon."
    ),
    labels_file: Path = typer.Option(
        None,
        "--labels",
        help="mimic3: the codes to predict, one per line, or a run's labels.json.",
        exists=True,
        dir_okay=False,
    ),
    superlink: str = SUPERLINK,
    root_cert: Path = ROOT_CERT,
    insecure: bool = INSECURE,
    min_sites: int = typer.Option(
        1, "--min-sites", help="Replies a round needs; fewer: retried, then the run stops."
    ),
    round_timeout: float = typer.Option(
        900.0, "--round-timeout", help="Seconds a round waits for replies."
    ),
    round_retries: int = typer.Option(
        1, "--round-retries", help="Times a round short of --min-sites is sent again."
    ),
    wait_for_sites: float = typer.Option(
        300.0, "--wait-for-sites", help="Seconds to wait for --min-sites nodes to connect."
    ),
) -> None:
    """Submit a training run to a SuperLink and follow its log until it ends."""
    import tempfile

    import tomllib

    from clinfed.flower.deploy import (
        environment,
        flower_run_config,
        read_labels,
        run_command,
        run_overrides,
        write_connection,
    )

    settings: dict[str, Any] = {}
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ClinfedError(f"{config_file}: {exc}") from None
        settings = dict(data.get("train", data))
    flags = {
        "task": task.value if task else None,
        "strategy": strategy.value if strategy else None,
        "model": model,
        "rounds": rounds,
        "seed": seed,
        "target_epsilon": target_epsilon,
    }
    settings |= {k: v for k, v in flags.items() if v is not None}
    if labels_file is not None:
        settings["labels"] = read_labels(labels_file)
    config = flower_run_config(settings, out_dir)
    with tempfile.TemporaryDirectory(prefix="clinfed-flwr-") as home:
        overrides = Path(home) / "run.toml"
        overrides.write_text(
            run_overrides(config, min_sites, round_timeout, round_retries, wait_for_sites)
        )
        write_connection(Path(home), superlink, root_cert, insecure)
        code = _exec(run_command(overrides), environment(Path(home)))
    if code == 0 and (Path(config.out) / "metrics.jsonl").is_file():
        _round_table(Path(config.out))
        summary_path = Path(config.out) / "summary.json"
        if summary_path.is_file() and "stopped" in json.loads(summary_path.read_text()):
            err.print(f"[yellow]{json.loads(summary_path.read_text())['stopped']}[/]")
            code = 1
    raise typer.Exit(code)


# ----------------------------------------------------------------- main
def _report_error(exc: ClinfedError) -> None:
    lines = [str(p) for p in exc.problems] if isinstance(exc, DataError) else str(exc).splitlines()
    for line in lines[:MAX_PROBLEMS_SHOWN]:
        err.print(f"[red]error:[/] {line}", highlight=False, soft_wrap=True)
    if len(lines) > MAX_PROBLEMS_SHOWN:
        err.print(f"[red]error:[/] ... and {len(lines) - MAX_PROBLEMS_SHOWN} more problems")


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    quiet_libraries()
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="clinfed", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except ClinfedError as exc:
        _report_error(exc)
        return EXIT_USAGE
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        err.print("aborted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
