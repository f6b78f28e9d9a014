"""clinfed privacy epsilon | noise | clip-norm, report, audit."""

from __future__ import annotations

from pathlib import Path

import typer

from clinfed.commands.common import (
    JSON,
    ON_ERROR,
    OnError,
    _print_json,
    _warn,
    app,
    err,
    out,
    progress_disabled,
)
from clinfed.commands.options import settings_parameters, with_parameters

privacy_app = typer.Typer(
    help="The privacy accountant as a calculator (the Poisson-subsampled Gaussian, replace-one), "
    "and the clip norm read off public documents.",
    no_args_is_help=True,
)
app.add_typer(privacy_app, name="privacy")


COUNT = typer.Option(
    True,
    "--count/--no-count",
    help="Under add-remove, include the noisy unit count a run releases once.",
)
# The relation and the unit are the run's settings, flags as clinfed train's.
AS_A_RUN = ("neighbours", "privacy_unit")


def _as_a_run(settings: dict) -> tuple[str, str]:
    """The relation and unit given, else clinfed train's defaults."""
    from clinfed.settings import schema_fields

    fields = schema_fields()
    return tuple(  # type: ignore[return-value]
        str(settings.get(name) or fields[name].default) for name in AS_A_RUN
    )


@privacy_app.command("epsilon")
def privacy_epsilon(
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson rate q = batch / n."),
    noise_multiplier: float = typer.Option(..., "--noise-multiplier", help="Noise over clip."),
    steps: int = typer.Option(..., "--steps", help="DP-SGD steps (a run's: per round x rounds)."),
    delta: float = typer.Option(1e-5, "--delta", help="Target delta (as clinfed train's)."),
    count: bool = COUNT,
    as_json: bool = typer.Option(False, "--json", help="Print JSON (key: epsilon)."),
    **settings,
) -> None:
    """Epsilon spent by STEPS steps of DP-SGD at rate Q and noise S, as a
    run's ledger states it (add/remove, with its count, by default)."""
    from clinfed.reporting.calculator import epsilon_for

    relation, unit = _as_a_run(settings)
    result = epsilon_for(sample_rate, noise_multiplier, steps, delta, relation, count, unit)
    if as_json:
        _print_json(result)
    else:
        out.print(
            f"epsilon {result['epsilon']:.4f} at delta {delta:g} (looser RDP bound: "
            f"{result['epsilon_rdp']:.4f}); {_terms(result)}"
        )


@privacy_app.command("noise")
def privacy_noise(
    target_epsilon: float = typer.Option(..., "--target-epsilon", help="Budget epsilon."),
    delta: float = typer.Option(1e-5, "--delta", help="Target delta (as clinfed train's)."),
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson rate q = batch / n."),
    steps: int = typer.Option(..., "--steps", help="DP-SGD steps (a run's: per round x rounds)."),
    count: bool = COUNT,
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (keys: noise_multiplier, epsilon)."
    ),
    **settings,
) -> None:
    """The smallest noise multiplier that keeps STEPS steps within the target
    (add/remove, with the count, by default: as clinfed train calibrates)."""
    from clinfed.reporting.calculator import noise_for

    relation, unit = _as_a_run(settings)
    result = noise_for(target_epsilon, delta, sample_rate, steps, relation, count, unit)
    if as_json:
        _print_json(result)
    else:
        out.print(
            f"noise multiplier {result['noise_multiplier']:.4f} gives epsilon "
            f"{result['epsilon']:.4f} at delta {delta:g}; {_terms(result)}"
        )


def _terms(result: dict) -> str:
    """Under what the figure holds, in words."""
    count = ", with the noisy unit count released once" if result["count_included"] else ""
    return f"{result['relation']} neighbours{count}, unit: {result['unit']}; {result['accountant']}"


with_parameters(privacy_epsilon, settings_parameters(only=AS_A_RUN))
with_parameters(privacy_noise, settings_parameters(only=AS_A_RUN))


@privacy_app.command("clip-norm")
def privacy_clip_norm(
    model: Path = typer.Argument(..., help="The model training starts from (run or saved model)."),
    data: Path = typer.Option(
        ..., "--data", help="PUBLIC annotated documents the model has not trained on."
    ),
    adapter: str | None = typer.Option(
        None,
        "--adapter",
        help="The plan's trained parameters: none, bias, head or labels (default: the task's "
        "private plan, every weight; ICD coding: head).",
    ),
    percentile: float = typer.Option(75.0, "--percentile", help="Percentile of the unit norms."),
    units: int = typer.Option(600, "--units", help="Measure at most this many units (0: all)."),
    privacy_unit: str = typer.Option(
        "example", "--privacy-unit", help="example, document or patient (as clinfed train's)."
    ),
    seed: int = typer.Option(0, "--seed", help="Which public units are drawn."),
    on_error: OnError = ON_ERROR,
    as_json: bool = JSON,
    **settings,
) -> None:
    """A clip norm (--max-grad-norm) from public units' gradient norms at the start.

    DP-SGD's noise is sized to the clip norm; this proposes the given
    percentile of the units' gradient norms over the parameters the plan
    trains. Read only public text: a clip norm read off private units is
    unaccounted.
    """
    from rich.progress import Progress

    from clinfed.core.device import use_threads

    use_threads(settings.get("threads"))

    from clinfed.commands.progress import PROGRESS, columns
    from clinfed.runners.clip_norm import clip_norm_from_public

    with Progress(*columns(), **PROGRESS, console=err, disable=progress_disabled()) as progress:

        def bar(label: str, total: int):
            task = progress.add_task(label, total=total)
            return lambda done: progress.advance(task, done)

        result = clip_norm_from_public(
            model, data, adapter, percentile, units, privacy_unit, seed, on_error.value, bar,
            device=settings.get("device") or "auto",
        )  # fmt: skip
    _warn(result.pop("warnings"))
    if as_json:
        _print_json(result)
        return
    quantiles = ", ".join(f"{float(q):.0%} {v:.3f}" for q, v in result["quantiles"].items())
    out.print(
        f"clip norm {result['clip_norm']:.3g}: the {_ordinal(result['percentile'])} percentile of "
        f"{result['units']:,} public units' gradient norms over {result['parameters']:,} "
        f"trained numbers (--adapter {result['adapter']}); "
        f"{result['share_clipped']:.0%} of them would be clipped. Percentiles: {quantiles}. "
        "Above the default 1.0: "
        f"{result['share_above']['1.0']:.0%}."
    )


def _ordinal(number: float) -> str:
    """75 -> '75th', 1 -> '1st', 22 -> '22nd', 12.5 -> '12.5th'."""
    text = f"{number:g}"
    if not float(number).is_integer() or 11 <= int(number) % 100 <= 13:
        return f"{text}th"
    return text + {1: "st", 2: "nd", 3: "rd"}.get(int(number) % 10, "th")


@app.command("report")
def report_cmd(
    run: Path = typer.Argument(..., help="A run folder.", exists=True, file_okay=False),
    reference: Path = typer.Option(
        None,
        "--reference",
        help="The same run without DP (a run folder), for the F1 plot; found beside RUN in "
        "a sweep otherwise.",
        exists=True,
        file_okay=False,
    ),
    as_json: bool = typer.Option(False, "--json", help="Print privacy.json."),
) -> None:
    """Write RUN/report/ (report.html, report.md, privacy.json): a verdict per
    site, epsilon in plain words, what left each hospital, layers sent, F1."""
    import json

    from clinfed.reporting.report import write_report

    folder = write_report(run, reference)
    content = json.loads((folder / "privacy.json").read_text())
    if as_json:
        _print_json(content)
        return
    from rich.markup import escape

    # The verdicts first, as the page's first screen says them.
    for verdict in content.get("verdicts", []):
        out.print(f"- {escape(verdict.replace('**', ''))}", soft_wrap=True, highlight=False)
    out.print(f"[bold]report[/]: {folder / 'report.html'}")


@app.command("audit")
def audit_cmd(
    run: Path = typer.Argument(..., help="A finished run folder.", exists=True, file_okay=False),
    max_examples: int = typer.Option(
        400, "--max-examples", help="Members and held-out non-members each, per target."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print audit.json."),
    **settings,
) -> None:
    """Membership-inference attacks (loss threshold, and loss calibrated by the
    initial model) on the final model and each site's last update, members
    against the training rows the run set aside (--audit-holdout); writes
    RUN/audit.json (shown by clinfed report)."""
    from clinfed.reporting.render import possessive
    from clinfed.runners.audit import audit

    result = audit(
        run, max_examples, threads=settings.get("threads"), device=settings.get("device") or "auto"
    )
    if as_json:
        _print_json(result)
        return
    final = result["final_model"]
    out.print(
        f"final model, {final['members']} members vs {final['non_members']} held out: "
        f"{final['loss_threshold']['reading']}"
    )
    out.print(f"calibrated by the initial model: {final['calibrated_loss']['reading']}")
    if result["starting_model"]["matches_run"] is False:
        out.print(
            "warning: the initial model rebuilt for the calibrated attack is not the run's "
            "by digest (a warm start trained on a GPU is not bit for bit repeatable): that "
            "reading is measured from a near copy"
        )
    for site, attack in result["site_updates"].items():
        out.print(f"{possessive(site)} last update: {attack['loss_threshold']['reading']}")


def plan_cmd(
    units: str = typer.Option(
        ...,
        "--units",
        help="Each site's privacy units, comma-separated (declared, or a run's released "
        "counts): 1520,1520,1400.",
    ),
    epsilons: str = typer.Option("1,4,8", "--epsilons", help="Budgets to plan, comma-separated."),
    forecast_dir: Path = typer.Option(
        None,
        "--forecast",
        metavar="DIR",
        help="Also forecast F1: run the plan on --public-data dealt into sites of these sizes, "
        "at each budget and without DP, in this new folder (as long as the runs take).",
    ),
    draws: int = typer.Option(
        3,
        "--forecast-draws",
        min=1,
        max=20,
        help="Deals of the public text into sites, each trained at every budget; their "
        "spread gives the forecast's interval.",
    ),
    config_file: Path = typer.Option(
        None, "--config", help="The run's settings (TOML or a run's config.json)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    **settings,
) -> None:
    """What each budget buys before any is spent: each site's batch, noise
    and epsilon by round, from its size alone; with --forecast, F1 at each
    budget measured on public text in sites of the same sizes."""
    from clinfed.commands.options import given, merge
    from clinfed.core.errors import ClinfedError
    from clinfed.runners.forecast import forecast, noise_plan, parse_units
    from clinfed.runners.sweep import parse_epsilons
    from clinfed.settings import RunConfig

    values = merge(config_file, given(settings))
    values |= {"out": str(forecast_dir or "plan"), "data": values.get("data") or "(none)"}
    config = RunConfig.from_values(values, str(config_file) if config_file else "flags")
    sizes, budgets = parse_units(units), parse_epsilons(epsilons)
    rows = noise_plan(config, sizes, budgets)
    result: dict = {"plan": rows}
    if forecast_dir is not None:
        if forecast_dir.exists():
            raise ClinfedError(f"--forecast {forecast_dir}: already exists; name a new folder")
        if config.public_data:
            from clinfed.core.runs import ensure_outside

            ensure_outside(forecast_dir, config.public_data, "--public-data")
        result["forecast"] = forecast(config, sizes, budgets, forecast_dir, draws)
    if as_json:
        _print_json(result)
        return
    out.print("[bold]the plan[/] (from the sites' sizes alone; no data read):")
    for row in rows:
        by_round = ", ".join(f"{e:.2f}" for e in row["epsilon_by_round"])
        count = " (the noisy count included)" if row["relation"] == "add-remove" else ""
        out.print(
            f"  epsilon {row['target_epsilon']:g} at delta {row['delta']:g}, {row['site']} "
            f"({row['units']:,} units; unit: {row['unit']}; {row['relation']} neighbours"
            f"{count}): batch {row['batch_size']}, {row['steps_per_round']} steps a round, "
            f"noise multiplier {row['noise_multiplier']:.3f} ({row['noise_on_mean_step']:.4f} "
            f"on the mean step); epsilon after each round {by_round}",
            soft_wrap=True,
        )
    if forecast_dir is not None:
        _print_forecast(result["forecast"], draws)


def _print_forecast(made: dict, draws: int) -> None:
    """The forecast's lines: F1 at each budget with its interval and DP's cost."""
    out.print(
        f"forecast on {made['test_units']:,} held-out public units "
        f"({made['test_mentions']:,} mentions), {draws} draw(s) a budget:"
    )
    for budget, made_at in made["forecasts"].items():
        cost = made["cost_points"].get(budget)
        spent = "no DP" if budget == "inf" else f"epsilon {budget}"
        out.print(
            f"  {spent}: F1 {made_at['f1']:.3f} ({made_at['low']:.3f} to "
            f"{made_at['high']:.3f})" + ("" if cost is None else f", DP costs {cost:.1f} points")
        )


with_parameters(
    plan_cmd,
    settings_parameters(
        exclude=("out", "resume", "target_epsilon", "data", "noise_multiplier"),
        shown=("task", "model", "strategy", "rounds", "adapter", "public_data", "public_types"),
    ),
)
privacy_app.command("plan")(plan_cmd)


# CPU work on a machine that may be shared: its thread count, as train's.
with_parameters(privacy_clip_norm, settings_parameters(only=("threads", "device")))
with_parameters(audit_cmd, settings_parameters(only=("threads", "device")))
