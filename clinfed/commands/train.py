"""clinfed train, sweep, evaluate, predict."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.progress import Progress
from rich.table import Table

from clinfed.commands.common import (
    JSON,
    ON_ERROR,
    SETTINGS_FILE,
    OnError,
    _print_json,
    _warn,
    app,
    err,
    log,
    out,
    progress_disabled,
)
from clinfed.commands.options import (
    ESSENTIAL,
    WARM_START,
    settings_parameters,
    with_parameters,
)
from clinfed.commands.progress import (
    PROGRESS,
    ProgressReporter,
    columns,
    duration,
    f1_text,
)
from clinfed.core.errors import ClinfedError
from clinfed.core.events import CellEnd, CellStart, Event, PublicEpoch, SweepStart


# ---------------------------------------------------------------- train
def _round_table(run: Path) -> None:
    """Per-round summary of a federated run, read back from its metrics.jsonl."""
    from clinfed.core.runs import read_jsonl, site_keyed

    records = [site_keyed(r) for r in read_jsonl(run / "metrics.jsonl")]
    table = Table(title=f"{run}")
    private = any("epsilon" in r for r in records)
    columns = ("round", "f1", "sites", "MB up", "MB down") + (("max epsilon",) if private else ())
    for column in columns:
        table.add_column(column, justify="right")
    for record in (r for r in records if "site" not in r):
        sites = [r for r in records if "bytes_up" in r and r["round"] == record["round"]]
        row = [
            str(record["round"]),
            f1_text(record),
            str(len(sites)),
            f"{sum(r['bytes_up'] for r in sites) / 1e6:.1f}",
            f"{sum(r['bytes_down'] for r in sites) / 1e6:.1f}",
        ]
        if private:
            row.append(f"{max((r.get('epsilon', 0.0) for r in sites), default=0.0):.3f}")
        table.add_row(*row)
    out.print(table)


def train(
    config_file: Path = typer.Option(
        None,
        "--config",
        help="Settings file: TOML (keys named like the flags, at the top level or in a table "
        "per concern) or a run's config.json. Flags override it.",
        exists=True,
        dir_okay=False,
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the run's summary as JSON (progress stays on stderr)."
    ),
    **settings: Any,
) -> None:
    """Train a model and write a run folder (config, metrics.jsonl, model, predictions).

    Exit status: 0 done; 1 the run stopped early (too few sites, budgets
    spent); 2 bad settings or data (nothing trained); 130 interrupted (the
    command to resume is printed)."""
    from clinfed.commands.options import given
    from clinfed.runners.pipeline import run_training

    config = _run_config(config_file, given(settings))
    if not config.dp and config.target_epsilon is not None:
        # --target-epsilon inf: said first, before anything else is printed.
        err.print(
            "[bold yellow]not private[/]: --target-epsilon inf trains without differential "
            "privacy; nothing this run releases is protected"
        )
    out_dir = Path(config.out)
    # The wall time counts from the command's start (imports included).
    from clinfed.commands.clock import STARTED as started
    from clinfed.core.scratch import FAREWELL

    FAREWELL.append(f"terminated: {_interrupted_words(config, out_dir)}")
    try:
        with Progress(
            *columns(), **PROGRESS, console=err, transient=True, disable=progress_disabled()
        ) as progress:
            reporter = ProgressReporter(progress, config.epochs, config.rounds)
            summary = run_training(config, reporter)
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]: {_interrupted_words(config, out_dir)}", soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        FAREWELL.clear()
    wall = time.perf_counter() - started
    if as_json:
        _print_json(summary | {"wall_s": round(wall, 1), "run": str(out_dir)})
        raise typer.Exit(EXIT_STOPPED if summary.get("stopped") else 0)
    _print_done(summary, out_dir, wall)
    if summary.get("stopped"):
        # Why it stopped is the last thing on the screen.
        out.print(f"[yellow]{summary['stopped']}[/]")
        raise typer.Exit(EXIT_STOPPED)


def _run_config(config_file: Path | None, flags: dict[str, Any]) -> Any:
    """The run's settings: the flags over ``--config`` (or, with ``--resume
    --out RUN``, over the run's own config.json, which flags must match)."""
    from clinfed.commands.options import merge
    from clinfed.settings import RunConfig

    if flags.get("resume") and config_file is None and flags.get("out"):
        # --resume --out RUN: the run's own settings; flags given must match
        # them (checked with the data before anything runs).
        saved = Path(flags["out"]) / "config.json"
        if saved.is_file():
            config_file = saved
        else:
            from clinfed.runners.resume import refuse_unstarted

            refuse_unstarted(Path(flags["out"]))
            raise ClinfedError(f"--out {flags['out']}: no run to resume (no config.json there)")
    values = merge(config_file, flags)
    if config_file is not None and "data" not in flags and values.get("data"):
        _check_recorded_data(Path(config_file), Path(str(values["data"])))
    if values.get("sites") and "partition" not in values:
        values["partition"] = "iid"  # N synthetic sites: dealt out at random
    config = RunConfig.from_values(values, str(config_file) if config_file else "flags")
    for required in ("data", "out"):
        if not values.get(required):
            raise ClinfedError(f"--{required} is required (a flag or a key of --config)")
    return config


def _print_done(summary: dict[str, Any], out_dir: Path, wall: float) -> None:
    """The run's last lines: F1, what it sent and spent, where it is."""
    word = "[bold yellow]stopped early[/]" if summary.get("stopped") else "[bold]done[/]"
    if summary.get("finished_before"):
        # --resume of a finished run: verified, nothing written again.
        word = "[bold]already finished[/] (verified; nothing was trained or written)"
    if "mb_up" not in summary:  # pooled: no federation, nothing sent
        out.print(
            f"{word}: held-out f1 {summary['f1']:.4f} "
            f"({summary['tokens_per_s']:.0f} training tokens/s); run folder {out_dir}; "
            f"{duration(wall)}"
        )
        return
    _round_table(out_dir)
    if "epsilon" in summary:
        spent = ", ".join(f"{k} {v:.3f}" for k, v in summary["epsilon"].items())
        out.print(f"privacy spent (epsilon at delta {summary['delta']:g}): {spent}")
    out.print(
        f"{word}: held-out f1 {f1_text(summary)}; uploaded {summary['mb_up']:.1f} MB, "
        f"downloaded {summary['mb_down']:.1f} MB "
        f"({100 * summary['ratio_to_fedavg_up']:.3g}% of "
        f"FedAvg's upload); run folder {out_dir} ({_folder_size(out_dir)}); {duration(wall)}"
    )
    # What a person does next with it.
    out.print(f"next: clinfed report {out_dir}   (and clinfed export {out_dir} --out MODEL)")


# A run that stopped before its last round (as ``clinfed flower run``).
EXIT_STOPPED = 1
EXIT_INTERRUPTED = 130


def _folder_size(folder: Path) -> str:
    """A run folder's size on disk, said on the run's last line."""
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    for unit in ("bytes", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _interrupted_words(config: Any, out_dir: Path) -> str:
    """Ctrl-C or SIGTERM: what is kept and how to go on."""
    from clinfed.federated.strategies import STRATEGIES

    if STRATEGIES[config.strategy].pooled:
        return (
            f"a {config.strategy} run does not resume; start it again with a new --out (or "
            f"remove {out_dir})"
        )
    return (
        "the rounds committed so far are kept; resume with\n"
        f"  clinfed train --config {out_dir / 'config.json'} --out {out_dir} --resume"
    )


def sweep_cmd(
    out_dir: Path = typer.Option(..., "--out", help="Sweep folder (one run folder per cell)."),
    strategies: str = typer.Option(
        "fedavg,safl,fedfrozen,safl+fedfrozen", "--strategies", help="Comma-separated."
    ),
    epsilons: str = typer.Option(
        "0.5,1,2,4,8,inf", "--epsilons", help="Target epsilons, comma-separated; inf = no DP."
    ),
    seeds: int = typer.Option(1, "--seeds", help="Seeds per cell (0..N-1)."),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the sweep in --out (finished cells are kept)."
    ),
    config_file: Path = SETTINGS_FILE,
    as_json: bool = typer.Option(False, "--json", help="Print the sweep's rows as JSON."),
    **settings: Any,
) -> None:
    """F1 at fixed epsilon budgets: one run per strategy x epsilon x seed,
    resumable, summarised in sweep.csv, sweep.md and sweep.png."""
    from clinfed.commands.options import given, merge
    from clinfed.runners.sweep import parse_epsilons, run_sweep
    from clinfed.settings import RunConfig, option_owners

    values = merge(config_file, given(settings))
    owners = option_owners()
    options = {k: v for k, v in values.items() if k in owners}
    options |= values.pop("strategy_options", {}) or {}
    base = RunConfig.from_values(
        {k: v for k, v in values.items() if k not in owners}
        | {"out": str(out_dir), "resume": resume},
        str(config_file) if config_file else "flags",
    )
    for required in ("task", "data"):
        if not getattr(base, required):
            raise ClinfedError(f"--{required} is required (a flag or a key of --config)")
    names = [s.strip() for s in strategies.split(",") if s.strip()]

    with Progress(*columns(), **PROGRESS, console=err, disable=progress_disabled()) as progress:
        cells: Any = None

        def show(event: Event) -> None:
            nonlocal cells
            if isinstance(event, SweepStart):
                cells = progress.add_task("sweep cells", total=event.cells)
                progress.update(cells, completed=event.finished)
            elif isinstance(event, CellStart):
                log.info(f"sweep: running {event.cell}")
            elif isinstance(event, CellEnd):
                log.info(f"sweep: {event.cell} done in {event.seconds:.0f} s")
                progress.advance(cells)

        rows = run_sweep(base, out_dir, names, parse_epsilons(epsilons), seeds, show, options)
    if as_json:
        _print_json(rows)
        return
    out.print((out_dir / "sweep.md").read_text())
    out.print(f"[bold]sweep[/]: {out_dir / 'sweep.csv'}, {out_dir / 'sweep.png'}")


with_parameters(
    sweep_cmd,
    settings_parameters(
        exclude=("out", "resume", "strategy", "target_epsilon", "seed"), shown=ESSENTIAL
    ),
)
app.command("sweep")(sweep_cmd)


@app.command("evaluate")
def evaluate(
    run: Path = typer.Argument(..., help="A finished run folder."),
    data: Path = typer.Option(..., "--data", help="Folder of annotated documents to score."),
    on_error: OnError = ON_ERROR,
    as_json: bool = JSON,
    **settings: Any,
) -> None:
    """Score a run's final model on a folder of annotated data."""
    from clinfed.runners.inference import evaluate_run

    metrics = evaluate_run(run, data, on_error.value, _machine(settings))
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
    **settings: Any,
) -> None:
    """Write predictions in the real format: i2b2 .con files, mimic3 predictions.csv."""
    from clinfed.runners.inference import predict_run

    count = predict_run(run, data, out_dir, on_error.value, _machine(settings))
    out.print(f"wrote predictions for {count} records to {out_dir}")


@app.command("export")
def export_cmd(
    run: Path = typer.Argument(..., help="A finished run folder."),
    out_dir: Path = typer.Option(..., "--out", help="New folder for the exported model."),
    as_json: bool = JSON,
    **settings: Any,
) -> None:
    """The run's concept-extraction model as a transformers model folder
    (AutoModelForTokenClassification with its real labels, and its tokenizer)."""
    from clinfed.core.device import use_threads
    from clinfed.runners.exporter import export_run

    use_threads(settings.get("threads"))
    record = export_run(run, out_dir)
    if as_json:
        _print_json(record)
    else:
        out.print(
            f"[bold]exported[/]: {out_dir} ({record['class']}, {len(record['labels'])} labels); "
            "load it with transformers' AutoModelForTokenClassification.from_pretrained"
        )


# The machine's settings, as clinfed train's flags, on every command that computes.
MACHINE = ("threads", "device")


def _machine(settings: dict[str, Any]) -> str:
    """Set torch's thread count from ``--threads`` (0 or none: every core)
    and return the ``--device`` to compute on (``auto`` when not given)."""
    from clinfed.core.device import use_threads

    use_threads(settings.get("threads"))
    return str(settings.get("device") or "auto")


with_parameters(evaluate, settings_parameters(only=MACHINE))
with_parameters(predict_cmd, settings_parameters(only=MACHINE))
with_parameters(export_cmd, settings_parameters(only=("threads",)))


def _check_recorded_data(config_file: Path, data: Path) -> None:
    """A run's config.json read back trains on the data that run trained on:
    its recorded fingerprint must match the folder it names (a relative path
    read from another folder, or a corpus changed since, would silently
    train on other data). Settings files without a fingerprint pass."""
    from clinfed.core.provenance import data_fingerprint
    from clinfed.settings import load_file

    recorded = load_file(config_file).get("data_fingerprint")
    if not recorded:
        return
    if not data.is_dir() or data_fingerprint(data) != recorded:
        raise ClinfedError(
            f"{config_file}: its data {data} is not the data that run trained on (the "
            "fingerprint differs); name the data with --data"
        )


with_parameters(train, settings_parameters(shown=ESSENTIAL))
app.command("train")(train)


def warm_start_cmd(
    config_file: Path = SETTINGS_FILE,
    as_json: bool = typer.Option(False, "--json", help="Print what was done as JSON."),
    **settings: Any,
) -> None:
    """Train a starting model on public text (--public-data) and save it to --out.

    Runs then start from it with --model OUT: the private run and its no-DP
    reference start from the same model, and the warm start is paid once.
    Nothing private is read, not even the label set: it comes from --types
    (or the task's preset or public code list). --data, if given, is only
    checked against: the public inputs and --out must lie outside it, and no
    public file may have a private file's bytes. No privacy is spent. Exit
    status: 0 done; 2 bad settings or data."""
    from clinfed.commands.options import given, merge
    from clinfed.runners.warmstart import warm_start_model
    from clinfed.settings import RunConfig

    values = merge(config_file, given(settings))
    for required in ("out", "public_data"):
        if not values.get(required):
            raise ClinfedError(f"--{required.replace('_', '-')} is required")
    config = RunConfig.from_values(values, str(config_file) if config_file else "flags")
    started = time.perf_counter()

    def show(event: Event) -> None:
        if isinstance(event, PublicEpoch):
            # Counts only: nothing of the public corpus is printed.
            log.info(f"warm start: epoch {event.epoch} over {event.examples:,} public examples")

    record = warm_start_model(config, show)
    if as_json:
        _print_json(record | {"wall_s": round(time.perf_counter() - started, 1)})
        return
    out.print(
        f"[bold]done[/]: starting model {record['model']} ({record['examples']:,} public "
        f"examples, {record['epochs']} epoch(s), final loss {record['final_loss']:.3f}); "
        f"start runs from it with --model {config.out}; "
        f"{duration(time.perf_counter() - started)}"
    )


with_parameters(warm_start_cmd, settings_parameters(exclude=("resume",), only=WARM_START))
app.command("warm-start")(warm_start_cmd)


@app.command("strategies")
def strategies(as_json: bool = JSON) -> None:
    """The strategies --strategy takes: what each trains and sends, and its options."""
    from dataclasses import fields

    from clinfed.federated.strategies import STRATEGIES

    rows = [
        {
            "strategy": name,
            "summary": cls.summary,
            "options": ["--" + f.name.replace("_", "-") for f in fields(cls.options)],
        }
        for name, cls in STRATEGIES.items()
    ]
    if as_json:
        _print_json(rows)
        return
    table = Table(title="strategies (--strategy NAME)")
    for column in ("strategy", "what trains and what travels", "its options"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["strategy"], row["summary"], " ".join(row["options"]) or "-")
    out.print(table)
