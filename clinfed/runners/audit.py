"""``clinfed audit RUN``: an empirical membership-inference check.

Members and non-members come from the same distribution. A run trained
with ``--audit-holdout F`` sets aside a random share F of each site's
training units before training (``RUN/audit/holdout.json`` records which
rows); they are the non-members, the rest of the site's training rows the
members. (Comparing training examples with the test split instead measures
the split as much as the model: on the synthetic data, non-members against
the test split alone already give AUC 0.57.)

Two attacks, on two targets:

* loss threshold (Yeom et al. 2018): "member" when the model's loss on a
  row is low;
* loss calibrated by the run's initial model (difficulty calibration,
  Watson et al. 2022; a likelihood-ratio test with one reference model,
  which costs one more forward pass): "member" when training lowered the
  row's loss the most;

against the final global model (what anyone with the run folder has) and,
per site, the model its last update made (what the server saw:
``RUN/audit/updates/<site>.safetensors``, kept by an auditing run).

Each AUC comes with a 95% bootstrap interval, resampled by privacy unit. An AUC above 0.5 beyond its
interval shows leakage this attack can exploit; an AUC near 0.5 is not a
proof of privacy (stronger attacks exist). It is never a bound: epsilon is
the guarantee.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import rankdata
from sklearn.metrics import roc_auc_score

from clinfed.core.device import device_of, to_device
from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.runs import atomic_write_json
from clinfed.core.scratch import temporary_folder
from clinfed.federated.state import load_tensors
from clinfed.modeling.models import load_saved_model
from clinfed.modeling.training import split_batches
from clinfed.reporting.holdout import AUDIT_HOLDOUT, AUDIT_UPDATES
from clinfed.settings import RunConfig, read_run_config
from clinfed.tasks import task_head


@torch.no_grad()
def example_losses(model, task, examples, batch_size: int = 32) -> np.ndarray:
    """Each example's own loss under ``model`` (evaluation mode)."""
    model.eval()
    losses = []
    for idx in split_batches(np.arange(len(examples)), batch_size):
        batch = to_device(task.collate(examples[idx.tolist()]), device_of(model))
        losses.append(
            task.example_losses(model(**task.model_inputs(batch)), batch).float().cpu().numpy()
        )
    return np.concatenate(losses) if losses else np.zeros(0)


def _clusters(groups: Any, size: int) -> list[np.ndarray]:
    """The row indices of each cluster (one per row when ``groups`` is None)."""
    if groups is None:
        return [np.asarray([i]) for i in range(size)]
    index: dict[Any, list[int]] = {}
    for row, key in enumerate(groups):
        index.setdefault(key, []).append(row)
    return [np.asarray(rows) for rows in index.values()]


def _resample(scores: np.ndarray, clusters: list[np.ndarray], rng) -> np.ndarray:
    picked = rng.integers(len(clusters), size=len(clusters))
    return np.concatenate([scores[clusters[c]] for c in picked])


def rank_auc(positives: np.ndarray, negatives: np.ndarray) -> float:
    """ROC AUC of scores (higher: positive) by the Mann-Whitney rank sum,
    ties counted half: the same number as scikit-learn's ``roc_auc_score``
    without its input checks, which took a third of an audit's time over
    a bootstrap's thousand draws."""
    ranks = rankdata(np.r_[positives, negatives])
    k = len(positives)
    return float((ranks[:k].sum() - k * (k + 1) / 2) / (k * len(negatives)))


def auc_with_interval(
    members: np.ndarray,
    non_members: np.ndarray,
    rng: np.random.Generator,
    resamples: int = 1000,
    member_units: Any = None,
    non_member_units: Any = None,
) -> dict[str, float]:
    """ROC AUC of scores (higher: "member") and its 95% bootstrap interval.

    Members and non-members are resampled separately, and by privacy unit
    (a cluster bootstrap): the rows of one unit (the windows of one
    sentence, the sentences of one note) are not independent, and
    resampling them one by one would make the interval too narrow.
    ``member_units`` / ``non_member_units``: each row's unit key (``None``:
    every row its own unit)."""
    labels = np.r_[np.ones(len(members)), np.zeros(len(non_members))]
    auc = float(roc_auc_score(labels, np.r_[members, non_members]))
    member_clusters = _clusters(member_units, len(members))
    non_member_clusters = _clusters(non_member_units, len(non_members))
    draws = []
    for _ in range(resamples):
        m = _resample(members, member_clusters, rng)
        n = _resample(non_members, non_member_clusters, rng)
        draws.append(rank_auc(m, n))
    low, high = np.percentile(draws, [2.5, 97.5])
    return {"auc": auc, "ci_low": float(low), "ci_high": float(high)}


def reading(result: dict[str, float]) -> str:
    """An AUC and its interval in plain words."""
    if result["ci_low"] > 0.5:
        return (
            f"the attack tells training rows from held-out ones better than chance (AUC "
            f"{result['auc']:.3f}, 95% CI {result['ci_low']:.3f}-{result['ci_high']:.3f}): the "
            "model leaks membership at least this much to this attack"
        )
    return (
        f"the attack does no better than chance within its 95% interval (AUC "
        f"{result['auc']:.3f}, CI {result['ci_low']:.3f}-{result['ci_high']:.3f}); that is "
        "evidence, not proof, of privacy: stronger attacks exist, epsilon is the guarantee"
    )


def starting_model(
    config: RunConfig, task: Any, tokenizer: Any, cache: str, public_start: dict | None = None
) -> Any:
    """The weights the run started from: the seeded model (or the saved one
    ``--model`` names), trained again on the run's public text when it
    warm-started inline (``--public-data``: the same seed, the same steps,
    the rates ``public_start`` recorded, as the run's ``config.json`` has
    it), so the attack measures what the private rounds changed."""
    from dataclasses import replace

    from clinfed.runners.factories import make_model

    initial = make_model(config, task)
    if config.public_data:
        from clinfed.runners.warmstart import warm_start

        recorded = public_start or {}
        if recorded.get("head_lr") is not None:
            config = replace(config, head_lr=recorded["head_lr"])
        warm_start(config, task, initial, tokenizer, cache, ProblemLog(config.on_error))
    return initial


def _start_check(run: Path, initial: Any) -> dict[str, Any]:
    """Whether the starting model rebuilt here is the run's, by the digest the
    run recorded for it (``state.json``). A warm start trained on a GPU is not
    bit for bit repeatable (its sums run in no fixed order), so the rebuilt
    one can differ: the calibrated attack then measures from a near copy."""
    from clinfed.core import payload
    from clinfed.modeling.adapters import shared_state

    try:
        recorded = json.loads((run / "state.json").read_text())["digests"]["0"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None  # no record to compare with (a run from another runner)
    # The run records the digest of what its rounds share (every weight, or
    # an adapter plan's entries alone), so compare the same entries.
    rebuilt = payload.digest(shared_state(initial))
    return {"digest": rebuilt, "matches_run": None if recorded is None else rebuilt == recorded}


def _attack(
    model, initial, task, examples, members: list[int], non_members: list[int], rng, unit: str
) -> dict[str, Any]:
    rows = members + non_members
    selected = examples.select(rows)
    final = example_losses(model, task, selected)
    before = example_losses(initial, task, selected)
    k = len(members)
    keys = task.unit_keys(selected, unit)
    units = {"member_units": keys[:k], "non_member_units": keys[k:]}
    loss = auc_with_interval(-final[:k], -final[k:], rng, **units)
    calibrated = auc_with_interval(before[:k] - final[:k], before[k:] - final[k:], rng, **units)
    return {
        "members": k,
        "non_members": len(non_members),
        "loss_threshold": loss | {"reading": reading(loss)},
        "calibrated_loss": calibrated | {"reading": reading(calibrated)},
    }


def _read_holdout(run: Path, path: Path) -> tuple[dict[str, Any], dict[str, tuple[list, list]]]:
    """The run's holdout record, and per site its member and non-member rows."""
    if not path.is_file():
        raise ClinfedError(
            f"{run}: trained without `audit_holdout`, so there are no held-out training rows "
            "to compare with (the test split is another distribution); train with "
            "`audit_holdout` 0.1 to audit"
        )
    try:
        holdout = json.loads(path.read_text())
        sites = {
            s: (list(v["members"]), list(v["non_members"])) for s, v in holdout["sites"].items()
        }
    except (ValueError, KeyError, TypeError):
        raise ClinfedError(f"{path}: not an audit holdout record") from None
    return holdout, sites


def _sample(rows: list[int], cap: int, rng: np.random.Generator) -> list[int]:
    """At most ``cap`` of ``rows``, at random, in order."""
    if len(rows) <= cap:
        return sorted(rows)
    return sorted(rng.choice(rows, size=cap, replace=False).tolist())


def audit(
    run: Path,
    max_examples: int = 400,
    seed: int = 0,
    threads: int | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Run both attacks on ``run``; write and return ``RUN/audit.json``.

    ``max_examples``: members and non-members each, at most, per target.
    ``threads``: torch's CPU threads (default the run's own ``--threads``,
    so that a warm start rebuilt for the calibrated attack sums in the same
    order as the run's and matches it bit for bit). ``device``: where the
    models score the examples (``--device``).
    """
    from clinfed.core.device import resolve_device, use_threads
    from clinfed.core.seal import SEAL, check_seal, seal_run
    from clinfed.runners.factories import make_model, make_task

    target = resolve_device(device)  # a machine without it: said before any work
    run = Path(run)
    config_path, model_dir = run / "config.json", run / "model"
    if not config_path.is_file() or not model_dir.is_dir():
        raise ClinfedError(f"{run}: no config.json or model/ (not a finished clinfed run?)")
    if max_examples < 2:
        raise ClinfedError(f"`max_examples` must be at least 2, not {max_examples}")
    # The model and the rows set aside are the run's as it sealed them.
    unsealed = check_seal(run)
    holdout_path = run / AUDIT_HOLDOUT
    holdout, sites = _read_holdout(run, holdout_path)
    config = RunConfig.from_values(read_run_config(run), str(config_path)).resolved()
    use_threads(threads, config.threads)
    model, tokenizer, meta = load_saved_model(model_dir, task_head)
    rng = np.random.default_rng(seed)
    with temporary_folder("cache") as cache:
        task = make_task(config, cache)
        corpus = task.load(Path(config.data), ProblemLog(config.on_error))
        task.labels = list(meta["labels"])
        examples = task.encode(corpus.train, tokenizer, meta["max_length"], cache)
        public_start = json.loads(config_path.read_text()).get("public_start")
        initial = starting_model(config, task, tokenizer, cache, public_start)
        start = _start_check(run, initial)  # on the CPU: the digest is the run's
        model.to(target)
        initial.to(target)
        if any(i >= len(examples) for m, n in sites.values() for i in m + n):
            raise ClinfedError(f"{holdout_path}: rows beyond the data's; was the data changed?")

        def attack(target: Any, members: list[int], non_members: list[int]) -> dict[str, Any]:
            chosen = [_sample(rows, max_examples, rng) for rows in (members, non_members)]
            return _attack(target, initial, task, examples, *chosen, rng, config.privacy_unit)

        pooled_members = [i for m, _ in sites.values() for i in m]
        pooled_non = [i for _, n in sites.values() for i in n]
        if not pooled_members or not pooled_non:
            raise ClinfedError(f"{holdout_path}: no held-out or no member rows to compare")
        result: dict[str, Any] = {
            "holdout_share": holdout.get("share"),
            "starting_model": start,
            "final_model": attack(model, pooled_members, pooled_non),
            "site_updates": {},
        }
        site_model = make_model(config, task).to(target)
        for site, (members, non_members) in sorted(sites.items()):
            path = run / AUDIT_UPDATES / f"{site}.safetensors"
            if not path.is_file() or not members or not non_members:
                continue
            site_model.load_state_dict(load_tensors(path))
            result["site_updates"][site] = attack(site_model, members, non_members)
    final = result["final_model"]["loss_threshold"]
    result |= {"auc": final["auc"], "members": result["final_model"]["members"]}
    result["non_members"] = result["final_model"]["non_members"]
    atomic_write_json(run / "audit.json", result)
    if unsealed is None and (run / SEAL).is_file():
        seal_run(run)  # the audit is stated by the report: sealed with the rest
    return result
