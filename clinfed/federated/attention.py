"""Attention profiles for SAFL: how much each layer attends to task-relevant tokens.

For layer ``l`` and one sequence, with attention ``alpha[h, i, j]`` (head,
query, key) and a 0/1 mask ``relevant[j]``::

    A_l = sum_h sum_i sum_j alpha[h, i, j] * relevant[j] / (H * n_queries)

over the sequence's real (non-padding) query positions. Each row of
``alpha`` sums to 1, so ``A_l`` is the average share of attention that lands
on relevant tokens: in [0, 1] whatever the sequence length. Which tokens are
relevant is the task's call (``Task.relevant_tokens``): tokens inside
concept spans and [CLS] for i2b2, [CLS] of every chunk for MIMIC-III.
"""

from __future__ import annotations

from collections.abc import Sequence

import datasets
import numpy as np
import torch
from torch import nn

from clinfed.core.device import device_of
from clinfed.modeling.training import batches, split_batches
from clinfed.tasks.base import Task


def layer_scores(
    attentions: Sequence[torch.Tensor], attention_mask: torch.Tensor, relevant: torch.Tensor
) -> torch.Tensor:
    """Per-sequence scores ``(sequences, layers)`` from per-layer attention
    tensors ``(sequences, heads, queries, keys)``."""
    mask = attention_mask.to(attentions[0].dtype)
    rel = (relevant.bool() & attention_mask.bool()).to(attentions[0].dtype)
    queries = mask.sum(-1).clamp(min=1.0)
    scores = []
    for alpha in attentions:
        on_relevant = torch.einsum("bhij,bj->bhi", alpha, rel)  # mass on relevant keys
        per_query = on_relevant.sum(1) * mask  # summed over heads; padding queries dropped
        scores.append(per_query.sum(-1) / (alpha.shape[1] * queries))
    return torch.stack(scores, dim=-1)


@torch.no_grad()
def profile(
    model: nn.Module, task: Task, examples: datasets.Dataset, batch_size: int = 16
) -> np.ndarray:
    """Scores ``(examples, layers)`` of ``model`` on ``examples``.

    Runs in eval mode (no attention dropout, so rows sum to 1) with eager
    attention, the only implementation that returns attention weights; both
    are restored afterwards so training keeps its faster kernel. A MIMIC-III
    admission's score is the mean over its chunks.
    """
    encoder = model.encoder
    was_training, implementation = model.training, encoder.config._attn_implementation
    model.eval()
    encoder.set_attn_implementation("eager")
    try:
        rows = []
        order = split_batches(np.arange(len(examples)), batch_size)
        for batch in batches(examples, task, order, device_of(model)):
            ids, mask = batch["input_ids"], batch["attention_mask"]
            flat_ids, flat_mask = ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, mask.shape[-1])
            out = encoder(**model._inputs(flat_ids, flat_mask), output_attentions=True)
            relevant = task.relevant_tokens(batch).reshape(flat_ids.shape)
            scores = layer_scores(out.attentions, flat_mask, relevant)
            per_example = scores.reshape(*ids.shape[:-1], -1)
            if per_example.dim() == 3:  # (examples, chunks, layers): mean over real chunks
                real = (mask.sum(-1) > 0).to(scores.dtype).unsqueeze(-1)
                per_example = (per_example * real).sum(1) / real.sum(1).clamp(min=1.0)
            rows.append(per_example)
        return torch.cat(rows).double().cpu().numpy()
    finally:
        encoder.set_attn_implementation(implementation)
        model.train(was_training)


def top_k_layers(scores: Sequence[float], k: int) -> list[int]:
    """The ``k`` best layers, ties broken towards the lower layer index."""
    order = sorted(range(len(scores)), key=lambda layer: (-scores[layer], layer))
    return sorted(order[:k])
