"""clinfed demo."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import Progress

from clinfed.commands.common import JSON, _print_json, app, err, log, out, progress_disabled
from clinfed.commands.progress import PROGRESS, ProgressReporter, columns, duration


@app.command("demo")
def demo(
    out_dir: Path = typer.Option(Path("demo"), "--out", help="New folder for everything."),
    model: str = typer.Option("minilm", "--model", help="minilm (bundled) or tiny (tests)."),
    docs: int = typer.Option(30, "--docs", help="Synthetic notes per hospital."),
    rounds: int = typer.Option(None, "--rounds", help="Rounds (default: the demo's plan)."),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0: all cores)."),
    plan: str = typer.Option(
        "bias",
        "--plan",
        help="bias (FedAvg of bias terms and head, 3 local epochs: the best private model "
        "measured) or safl+fedfrozen (SAFL's 2 layers, Q/K frozen from round 2).",
    ),
    public: str = typer.Option(
        "notes",
        "--public",
        help="Public text the starting model trains on: notes (synthetic notes of other "
        "patients, as a public annotated clinical corpus) or pubmed (the shipped PubMed "
        "abstracts: diseases and chemicals, unlike the notes).",
    ),
    as_json: bool = JSON,
) -> None:
    """The product's main job on synthetic data: three hospitals train one
    model federated under DP (epsilon 8 each), with ledgers, an audit and a
    privacy report, beside the same run without DP."""
    from clinfed.runners.demo import PLAN, run_demo

    with Progress(
        *columns(), **PROGRESS, console=err, transient=True, disable=progress_disabled()
    ) as progress:
        reporter = ProgressReporter(progress, 1, rounds or PLAN["rounds"])
        summary = run_demo(
            out_dir,
            model,
            docs,
            rounds,
            threads,
            plan,
            public,
            on_step=log.info,
            on_event=reporter,
        )
    if as_json:
        _print_json(summary)
        raise typer.Exit(1 if summary.get("stopped") else 0)
    gap = 100 * (summary["f1_no_dp"] - summary["f1_private"])
    spent = ", ".join(f"{site} {eps:.2f}" for site, eps in summary["epsilon"].items())
    out.print(f"[bold]clinfed demo[/]: done; {duration(summary['wall_s'])}")
    out.print(
        f"  F1 (strict, held-out): [bold]{summary['f1_private']:.3f}[/] under DP at epsilon "
        f"{summary['target_epsilon']:g}, {summary['f1_no_dp']:.3f} without DP "
        f"({gap:.1f} points apart); {summary['f1_start']:.3f} from the public text alone "
        f"({summary['public']})"
    )
    out.print(f"  epsilon spent per hospital: {spent} (delta {summary['delta']:g})")
    out.print(
        f"  sent: {summary['mb_up']:.3g} MB up, {100 * summary['ratio_to_fedavg_up']:.2g}% of "
        f"FedAvg's {summary['fedavg_mb_up']:.0f} MB (plan {summary['plan']})"
    )
    out.print(
        f"  membership inference on the private model: AUC {summary['audit_auc']:.2f} "
        "(0.5: members and non-members cannot be told apart)"
    )
    out.print(f"  report: {summary['report']}")
    if summary.get("stopped"):
        out.print(f"[yellow]{summary['stopped']}[/]")
        raise typer.Exit(1)
