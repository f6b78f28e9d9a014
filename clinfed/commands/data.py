"""clinfed data synth | check, score, baseline."""

from __future__ import annotations

from pathlib import Path

import click
import typer
from rich.table import Table

from clinfed.commands.common import (
    CODES,
    FORMAT,
    JSON,
    ON_ERROR,
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
from clinfed.errors import ClinfedError, ProblemLog

data_app = typer.Typer(help="Make and validate corpora.", no_args_is_help=True)
app.add_typer(data_app, name="data")


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

    ensure_new_run_folder(out_dir, "corpus")
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


@data_app.command("convert")
def data_convert(
    source: Path = typer.Argument(..., help="Concept-extraction corpus folder."),
    target: str = typer.Option(
        ..., "--to", help="i2b2, conll or brat.", click_type=click.Choice(["i2b2", "conll", "brat"])
    ),
    out_dir: Path = typer.Option(..., "--out", help="New folder for the converted corpus."),
    annotation_format: str = FORMAT,
    types: str = TYPES,
    on_error: OnError = ON_ERROR,
) -> None:
    """Write a concept-extraction corpus in another format (train/ and test/ kept)."""
    from clinfed.runs import ensure_new_run_folder
    from clinfed.tasks.i2b2.adapter import I2b2Task
    from clinfed.tasks.i2b2.convert import write_documents

    ensure_new_run_folder(out_dir, "converted corpus")
    task = I2b2Task(format=annotation_format, types=types)
    problems = ProblemLog(on_error.value)
    splits = [s for s in ("train", "test") if (source / s).is_dir()]
    parts = {s: task.read_documents(source / s, problems) for s in splits} or {
        "": task.read_documents(source, problems)
    }
    written = sum(
        write_documents(docs, out_dir / split if split else out_dir, target)
        for split, docs in parts.items()
    )
    _warn([str(p) for p in problems.problems])
    out.print(f"wrote {written} documents as {target} to {out_dir}")


@data_app.command("check")
def data_check(
    data: Path = typer.Argument(..., help="Corpus folder."),
    task: TaskName = typer.Option(..., "--task", help="i2b2 or mimic3."),
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
    from clinfed.errors import ClinfedError
    from clinfed.provenance import data_fingerprint

    if not folder.is_dir():
        raise ClinfedError(f"{folder}: not a folder")
    out.print(data_fingerprint(folder))


# --------------------------------------------------------------- score
@app.command("score")
def score(
    task: TaskName = typer.Option(..., "--task", help="i2b2 or mimic3."),
    gold: Path = typer.Option(..., "--gold", help="Gold corpus folder."),
    pred: Path = typer.Option(
        ..., "--pred", help="i2b2: folder of .con files; mimic3: predictions.csv."
    ),
    codes: CodeKind = CODES,
    types: str = TYPES,
    as_json: bool = JSON,
) -> None:
    """Score predictions: i2b2 exact/inexact P/R/F1; mimic3 F1, AUC, P@k."""
    from clinfed.scoring import score_i2b2, score_mimic3

    problems = ProblemLog("strict")
    if task is TaskName.i2b2:
        result = score_i2b2(gold, pred, problems, types)
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
    annotation_format: str = FORMAT,
    types: str = TYPES,
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
    handle = get_task(
        task.value,
        seed=seed,
        codes=codes.value,
        top_k=top_k,
        format=annotation_format,
        types=types,
    )
    corpus = handle.load(data, ProblemLog("strict"))
    if task is TaskName.i2b2:
        result = i2b2_dictionary(corpus.train, corpus.test, handle.entity_types)
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
