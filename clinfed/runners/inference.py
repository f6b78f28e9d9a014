"""Use a finished run: evaluate its model on a folder, or write predictions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.runs import ensure_new_run_folder
from clinfed.core.scratch import temporary_folder
from clinfed.modeling.models import load_saved_model, saved_run_model
from clinfed.modeling.training import predict
from clinfed.tasks import get_task, task_head


def saved_model_and_task(run: Path, cache_dir: str) -> tuple[Any, Any, dict[str, Any], Any]:
    """A run folder's model, or a saved model itself (RUN/model, clinfed
    warm-start's): the model, its tokenizer, its metadata, and its task
    with the options and the label set it was saved with."""
    model_dir = saved_run_model(str(run))
    if model_dir is None:
        raise ClinfedError(f"{run}: no model/ folder (not a finished clinfed run?)")
    model, tokenizer, meta = load_saved_model(model_dir, task_head)
    options = {k: meta[k] for k in ("codes", "top_k", "max_chunks", "format", "types") if k in meta}
    task = get_task(meta["task"], cache_dir=cache_dir, **options)
    task.labels = list(meta["labels"])  # the model's label set, whatever the folder holds
    return model, tokenizer, meta, task


def _outputs(run: Path, data: Path, problems: ProblemLog, cache_dir: str, device: str):
    from clinfed.core.device import resolve_device

    model, tokenizer, meta, task = saved_model_and_task(run, cache_dir)
    model = model.to(resolve_device(device))
    records = task.read_documents(Path(data), problems)
    examples = task.encode(records, tokenizer, meta["max_length"], cache_dir)
    if len(examples) == 0:
        raise ClinfedError(f"{data}: no documents to run the model on")
    return task, records, examples, predict(model, task, examples)


def evaluate_run(
    run: Path, data: Path, on_error: str = "strict", device: str = "auto"
) -> dict[str, Any]:
    """Metrics of the run's final model on every annotated document of ``data``
    (``device``: as ``--device``)."""
    problems = ProblemLog(on_error)
    with temporary_folder("cache") as cache:
        task, records, examples, outputs = _outputs(run, data, problems, cache, device)
        metrics = task.evaluate(records, examples, outputs)
    return metrics | {"warnings": [str(p) for p in problems.problems]}


def predict_run(
    run: Path, data: Path, out: Path, on_error: str = "strict", device: str = "auto"
) -> int:
    """Write predictions for every document of ``data`` to the new folder
    ``out`` in the task's format; return how many records were predicted."""
    ensure_new_run_folder(out, "predictions", {"`data`": data, "RUN": run})
    problems = ProblemLog(on_error)
    with temporary_folder("cache") as cache:
        task, records, examples, outputs = _outputs(run, data, problems, cache, device)
        Path(out).mkdir(parents=True, exist_ok=True)
        task.write_predictions(records, examples, outputs, Path(out))
    return len(records)
