"""DP-SGD's clip norm, read off public documents.

DP-SGD clips each privacy unit's gradient to the clip norm ``C``
(``--max-grad-norm``) and adds noise of standard deviation ``sigma * C``
to the sum. The noise is sized to ``C`` whatever the units' gradients
measure: at a clip norm far above most units' norms it is sized for
gradients few units have, and the averaged step is mostly noise; far
below them, every unit loses most of its length. :func:`clip_norm_from_public`
measures each unit's gradient norm over the parameters a plan trains, at
a saved model (the run's start), on public documents, and proposes a
percentile of them (the 75th by default: the noise shrinks to what three
units in four have, and a quarter of the units are clipped).

Run it on public documents only, of the sites' kind where there are
any. A clip norm read off a site's own units is a quantity computed
from private data that no accountant covers, and DP-SGD's guarantee
holds for any clip norm fixed before training; public text spends no
privacy. The figures depend on how close the public text is to the
model: text the start was trained on has small gradients (it is fitted),
so measure on public documents the start has not seen
(``benchmarks/results/NOTEBOOK.md``, "the clip norm").

What it moved (``benchmarks/results/NOTEBOOK.md``, "the clip norm from public text"):
on ICD coding's head, public admissions of the sites' kind put the 75th
percentile at 0.43, and a clip norm of 0.4 gained 2.4 F1 points at
epsilon 8 over the default 1.0; on BC5CDR's bias terms from a start
fitted to the sites' guidelines, public text put it at 2.1, and 2.2
moved nothing (-0.2), nor did 0.4 (+0.2). The noise on the averaged step grows with the clip
norm exactly and the signal by less, so a larger clip norm lowers their
ratio: read the percentiles as what share of units a clip norm clips,
and lower the clip norm when most units' norms are far below it.

The model runs in evaluation mode (no dropout), one unit a backward
pass, so the norms are exact and the same at every call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from clinfed.core.device import device_of, to_device
from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.modeling.adapters import add_bias, add_head, add_labels, shared_names

__all__ = ["PLANS", "clip_norm_from_public", "unit_gradient_norms"]

# The parameters each --adapter trains, as the training run selects them.
PLANS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "none": lambda model: model,
    "bias": add_bias,
    "head": add_head,
    "labels": add_labels,
}
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
THRESHOLDS = (0.1, 0.2, 0.3, 0.5, 1.0, 2.0)


def unit_gradient_norms(
    model: nn.Module,
    task: Any,
    examples: Any,
    units: list[np.ndarray],
    progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, int]:
    """Each unit's gradient norm over the parameters :func:`shared_names`
    lists (what DP-SGD clips), and how many numbers those parameters hold.

    A unit's gradient is that of the sum of its examples' losses
    (``task.example_losses``), as DP-SGD folds a unit's rows before
    clipping. ``units`` holds each unit's rows of ``examples``
    (``task.unit_rows``).
    """
    trained = set(shared_names(model))
    params = [p for n, p in model.named_parameters() if n in trained]
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        param.requires_grad_(name in trained)
    was_training = model.training
    model.eval()
    norms = np.empty(len(units))
    try:
        for i, rows in enumerate(units):
            batch = to_device(task.collate(examples[rows.tolist()]), device_of(model))
            losses = task.example_losses(model(**task.model_inputs(batch)), batch)
            grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
            norms[i] = float(sum(float((g**2).sum()) for g in grads if g is not None)) ** 0.5
            if progress is not None:
                progress(1)
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
        model.train(was_training)
    return norms, sum(p.numel() for p in params)


def clip_norm_from_public(
    model_path: Path,
    data: Path,
    adapter: str | None = None,
    percentile: float = 75.0,
    max_units: int = 600,
    privacy_unit: str = "example",
    seed: int = 0,
    on_error: str = "strict",
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Propose a clip norm: the ``percentile`` of the public units' gradient norms.

    Parameters
    ----------
    model_path
        A run folder or a saved model (``clinfed warm-start``'s): the model
        private training will start from.
    data
        A folder of public annotated documents, in the model's task format.
    adapter
        The plan's trained parameters (``--adapter``): ``none`` (every weight),
        ``bias``, ``head``, ``labels``; default the task's (``Task.dp_adapter``).
    percentile
        Which percentile of the unit norms to propose (0 to 100).
    max_units
        Measure at most this many units, drawn at random (0: all).
    privacy_unit
        ``example``, ``document`` or ``patient``, as ``--privacy-unit``.
    seed
        Which units are drawn (public data: the draw need not be secret).
    device
        Where the gradients are computed (``--device``: auto, cpu, cuda).

    Returns
    -------
    dict
        ``clip_norm``, ``percentile``, ``units``, ``parameters``, ``adapter``,
        ``quantiles`` (10th to 90th), ``share_above`` (of the units, above a
        few norms) and ``share_clipped`` (above the proposal).
    """
    from clinfed.core.device import resolve_device
    from clinfed.core.scratch import temporary_folder
    from clinfed.runners.inference import saved_model_and_task

    if adapter is not None and adapter not in PLANS:
        raise ClinfedError(
            f"`adapter` {adapter}: choose one of {', '.join(PLANS)} (a LoRA factor's "
            "gradient depends on the run's seeded start: measure lora runs with bias or none)"
        )
    target = resolve_device(device)
    if not 0.0 <= percentile <= 100.0:
        raise ClinfedError(f"`percentile` {percentile:g}: must be between 0 and 100")
    with temporary_folder("cache") as cache_dir:
        model, tokenizer, meta, task = saved_model_and_task(model_path, cache_dir)
        model.to(target)
        adapter = adapter or task.dp_adapter
        if privacy_unit not in task.units:
            raise ClinfedError(
                f"`privacy_unit` {privacy_unit}: `task` {task.name} offers {', '.join(task.units)}"
            )
        problems = ProblemLog(on_error)
        records = task.read_documents(Path(data), problems)
        examples = task.encode(records, tokenizer, meta["max_length"], cache_dir)
        units = task.unit_rows(examples, privacy_unit)
        if not units:
            raise ClinfedError(f"{data}: no annotated documents to measure")
        if max_units and len(units) > max_units:
            chosen = np.random.default_rng(seed).permutation(len(units))[:max_units]
            units = [units[i] for i in chosen]
        tick = progress("unit gradients", len(units)) if progress else None
        norms, parameters = unit_gradient_norms(PLANS[adapter](model), task, examples, units, tick)
    return _proposal(norms, percentile, adapter, privacy_unit, parameters, problems)


def _proposal(
    norms: np.ndarray,
    percentile: float,
    adapter: str,
    privacy_unit: str,
    parameters: int,
    problems: ProblemLog,
) -> dict[str, Any]:
    """What :func:`clip_norm_from_public` returns for the measured norms."""
    clip = float(np.percentile(norms, percentile))
    return {
        "clip_norm": clip,
        "percentile": percentile,
        "adapter": adapter,
        "privacy_unit": privacy_unit,
        "units": len(norms),
        "parameters": parameters,
        "quantiles": {str(q): float(v) for q, v in zip(QUANTILES, np.quantile(norms, QUANTILES))},
        "share_above": {str(t): float((norms > t).mean()) for t in THRESHOLDS},
        "share_clipped": float((norms > clip).mean()),
        "warnings": [str(p) for p in problems.problems],
    }
