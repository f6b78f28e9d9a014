"""``clinfed audit RUN``: an empirical membership-inference check.

The loss-threshold attack (Yeom et al. 2018) guesses "member" when the
model's loss on an example is low. Its ROC AUC over the run's training
examples (members) against its held-out examples (non-members) is written
to ``RUN/audit.json`` and shown in the privacy report next to epsilon.
AUC 0.5 means the attack cannot tell the two apart; it is evidence, never a
proof, of privacy (epsilon is the guarantee).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.models import load_saved_model
from clinfed.runs import atomic_write_json
from clinfed.settings import read_run_config
from clinfed.tasks import get_task
from clinfed.training import split_batches


@torch.no_grad()
def example_losses(model, task, examples, batch_size: int = 32) -> np.ndarray:
    """Each example's own loss under ``model`` (evaluation mode)."""
    model.eval()
    losses = []
    for idx in split_batches(np.arange(len(examples)), batch_size):
        batch = task.collate(examples[idx.tolist()])
        losses.append(task.example_losses(model(**task.model_inputs(batch)), batch).numpy())
    return np.concatenate(losses) if losses else np.zeros(0)


def audit(run: Path, max_examples: int = 400, seed: int = 0) -> dict[str, Any]:
    """Run the attack on ``run``'s final model; write and return ``audit.json``."""
    run = Path(run)
    config_path, model_dir = run / "config.json", run / "model"
    if not config_path.is_file() or not model_dir.is_dir():
        raise ClinfedError(f"{run}: no config.json or model/ (not a finished clinfed run?)")
    config = read_run_config(run)
    model, tokenizer, meta = load_saved_model(model_dir)
    with tempfile.TemporaryDirectory(prefix="clinfed-cache-") as cache:
        options = {k: config[k] for k in ("codes", "top_k", "max_chunks") if k in config}
        task = get_task(config["task"], seed=config.get("seed", 0), cache_dir=cache, **options)
        corpus = task.load(Path(config["data"]), ProblemLog(config.get("on_error", "strict")))
        task.labels = list(meta["labels"])
        rng = np.random.default_rng(seed)
        scores, members = [], []
        for split, is_member in ((corpus.train, 1), (corpus.test, 0)):
            examples = task.encode(split, tokenizer, meta["max_length"], cache)
            take = min(max_examples, len(examples))
            chosen = np.sort(rng.choice(len(examples), size=take, replace=False))
            losses = example_losses(model, task, examples.select(chosen))
            scores.extend((-losses).tolist())  # low loss: "member"
            members.extend([is_member] * take)
    if len(set(members)) < 2:
        raise ClinfedError(f"{run}: the audit needs both training and held-out examples")
    result = {
        "attack": "loss threshold (Yeom et al. 2018)",
        "auc": float(roc_auc_score(members, scores)),
        "members": int(sum(members)),
        "non_members": int(len(members) - sum(members)),
    }
    atomic_write_json(run / "audit.json", result)
    return result
