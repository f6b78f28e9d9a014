"""Parameter-efficient training: LoRA adapters (``--adapter lora``) on peft,
bias terms only (``--adapter bias``), or the head alone (``--adapter head``).

The pretrained encoder stays frozen at every party; each linear layer of
every encoder layer (attention query, key, value and output, feed-forward
in and out) gets a low-rank update ``B A`` (rank ``--lora-rank``, scaled by
``alpha / rank``), and the task head trains in full. Only adapter tensors
and the head ever train, travel or are aggregated: :func:`shared_names` is
what every strategy plans over, so the adapter plan composes with any of
them (SAFL moves the selected layers' adapters; FedFrozen stops the
query/key adapters after its warm-up, as :mod:`clinfed.modeling.blocks` files a
``query.lora_B`` under the layer's ``query_key`` block).

Aggregating the factors. Averaging ``A`` and ``B`` separately, as most
federated LoRA does, is not averaging the sites' updates: ``mean(B) mean(A)
!= mean(B A)``, the cross terms are lost. Averaging the products would send
``d x d`` matrices, the full layer. ``--lora-factors b`` (the default)
keeps ``A`` at its seeded random start everywhere (as FFA-LoRA, Sun et al.
2024) and trains ``B`` alone: then ``mean(B) A = mean(B A)`` exactly, half
the adapter travels, and DP-SGD noises half as many coordinates.
``--lora-factors ab`` trains both and averages them separately (more
capacity per round, inexact aggregation); the choice is recorded in the
run's config.

``--adapter bias`` (BitFit, Ben Zaken et al. 2022) is the cheaper
alternative: the encoder's weights stay frozen and only its bias terms
(attention, feed-forward and LayerNorm biases, about 0.5% of MiniLM) and
the head train and travel. Nothing is added to the model, so aggregation
is exact, and under DP-SGD only those few coordinates are noised.
``--adapter head`` goes further: the encoder stays as the run starts it
(a public warm start, say) and only the head trains, travels and is noised.
``--adapter labels`` keeps even the head's shared layers at the start and
trains its per-label rows alone: for ICD coding the label-wise attention's
queries and outputs (7,690 numbers for ten codes, against 155,530 for the
whole head, whose ``project`` layer every code shares); for concept
extraction, whose head is one row per tag already, the same as ``head``.
Under DP-SGD the noise is per coordinate, so a twentieth of the
coordinates is a twentieth of the noise's squared norm on the update.

Every party builds the same adapters from the run's seed, so the frozen
encoder and ``A`` are never sent. A saved model has its adapters merged
into the encoder weights (:func:`merged`): it loads as a plain clinfed or
transformers model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from clinfed.core.errors import ClinfedError
from clinfed.modeling.families import FAMILIES
from clinfed.modeling.gazetteer import gazetteer_of

# Head layers every label shares: --adapter labels keeps them at the start.
SHARED_HEAD_LAYERS = ("head.project.",)
# A low-rank update starting at zero moves the model slowly at the encoder's
# fine-tuning rate (1e-4): adapters train at 1e-3 unless --lr says otherwise
# (the usual LoRA rate for BERT-sized encoders; the head keeps its own).
TRAINING_DEFAULTS = {"lr": 1e-3}
LORA_FACTORS = ("b", "ab")
# Every linear layer of an encoder or decoder layer (attention and
# feed-forward), as each registered family names them (clinfed.modeling.families).
LORA_TARGETS = tuple(
    dict.fromkeys(name for family in FAMILIES.values() for name in family.lora_targets)
)


def add_lora(model: nn.Module, rank: int, alpha: float, factors: str, seed: int) -> nn.Module:
    """Give ``model.encoder`` LoRA adapters (in place; see the module docstring)."""
    from peft import LoraConfig, inject_adapter_in_model

    if factors not in LORA_FACTORS:
        raise ClinfedError(f"`lora_factors` must be one of {', '.join(LORA_FACTORS)}")
    present = {name.rsplit(".", 1)[-1] for name, _ in model.encoder.named_modules()}
    targets = sorted(present & set(LORA_TARGETS))
    if not targets:
        raise ClinfedError("`adapter` lora: the encoder has no linear layer LoRA knows")
    torch.manual_seed(seed + 2)  # A's random start: the same at every party
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)
    model.encoder = inject_adapter_in_model(config, model.encoder)
    model.adapter = {"kind": "lora", "rank": rank, "alpha": alpha, "factors": factors}
    return model


def add_bias(model: nn.Module) -> nn.Module:
    """Train and share only the encoder's bias terms (and the head); with a
    gazetteer attached (``--gazetteer``), also the token-type table.

    The table is where the gazetteer's marks enter the encoder: a row a
    mark, added to the embedding of every marked word piece, so it acts as
    a bias term of its own (a few hundred numbers a mark). Attach the
    gazetteer first.
    """
    if not any(n.endswith(".bias") for n, _ in model.encoder.named_parameters()):
        raise ClinfedError("`adapter` bias: the encoder has no bias terms")
    model.adapter = {"kind": "bias", "marks": gazetteer_of(model) is not None}
    return model


def add_head(model: nn.Module) -> nn.Module:
    """Train and share only the task head: the encoder stays as the run
    starts it (a linear probe of a warm-started encoder; under DP-SGD the
    fewest noised coordinates)."""
    model.adapter = {"kind": "head"}
    return model


def add_labels(model: nn.Module) -> nn.Module:
    """Train and share only the head's per-label rows (see the module
    docstring): the encoder and the layers every label shares stay as the
    run starts them."""
    model.adapter = {"kind": "labels"}
    return model


# The encoder's token-type table (BERT family): the gazetteer's marks' rows.
TYPE_TABLE = "encoder.embeddings.token_type_embeddings.weight"


def adapter_of(model: nn.Module) -> dict | None:
    return getattr(model, "adapter", None)


def _travels(name: str, adapter: dict | None) -> bool:
    if adapter is None:
        return True  # everything
    if not name.startswith("encoder."):  # the head (and prompts)
        return adapter["kind"] != "labels" or not name.startswith(SHARED_HEAD_LAYERS)
    if adapter["kind"] == "bias":
        return name.endswith(".bias") or (adapter.get("marks", False) and name == TYPE_TABLE)
    if adapter["kind"] in ("head", "labels"):
        return False
    return ".lora_B." in name or (adapter["factors"] == "ab" and ".lora_A." in name)


def shared_names(model: nn.Module) -> list[str]:
    """The parameters a plan may train, send and aggregate: all of them,
    or with adapters the trained adapter factors and the head."""
    adapter = adapter_of(model)
    return [n for n, _ in model.named_parameters() if _travels(n, adapter)]


def shared_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The entries of the global model (server checkpoints, full downloads):
    the whole state, or with adapters what :func:`shared_names` lists."""
    adapter = adapter_of(model)
    return {k: v for k, v in model.state_dict().items() if _travels(k, adapter)}


def fedavg_bytes(model: nn.Module) -> int | None:
    """Bytes of FedAvg's upload of the whole model (adapters merged): the
    yardstick of an adapter run's traffic; ``None`` without adapters (the
    shared model is the whole one)."""
    if adapter_of(model) is None:
        return None
    from clinfed.core import payload

    return len(payload.encode(dict(merged(model).named_parameters())))


def load_shared(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a global model (:func:`shared_state`'s entries, all of them)."""
    missing = sorted(set(shared_state(model)) - set(state))
    if missing:
        raise ClinfedError(f"the global model lacks {missing[0]}")
    model.load_state_dict(state, strict=adapter_of(model) is None)


def merged(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with its adapters merged into the encoder's
    weights and removed (peft's ``merge``), or ``model`` if it has none
    (bias-only training adds no module: the model is already plain)."""
    adapter = adapter_of(model)
    if adapter is None:
        return model
    if adapter["kind"] in ("bias", "head", "labels"):
        plain = copy.deepcopy(model)
        plain.adapter = None
        return plain
    from peft.tuners.lora import LoraLayer

    plain = copy.deepcopy(model)
    for name, module in list(plain.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent_name), child, module.get_base_layer())
    plain.adapter = None
    return plain
