"""Model families: what clinfed must know of a checkpoint's kind, one file
per family.

A family says which ``model_type`` values it covers and how its parameter
names read: where a transformer layer's parameters are (the layer index),
which of them are the attention query/key kernels (FedFrozen freezes them)
and the value projection, which are token tables (``embeddings``) and a
decoder's final norm (read by the head alone); the linear layers LoRA
adapts; how it loads (a pooler left out) and counts positions (RoBERTa's
start after the padding index); where its layers are (deep prompts); and,
if DP-SGD cannot train it, why. Blocks, LoRA, prompts, loading and the DP
check read this registry; adding a family is one file here (every module
of this package is loaded and registers itself) plus its test.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring).

    Attributes
    ----------
    name
        What error messages and docs call it (``Llama``).
    model_types
        The transformers ``model_type`` values it covers.
    layers
        A regex over a parameter's full name with groups ``layer`` (the
        index) and ``rest`` (the name inside the layer).
    query_key, value
        Regexes over ``"." + rest``: the attention query/key kernels and
        the value projection.
    embeddings
        A regex over the full name: token or position tables beyond a
        module called ``embeddings`` (which every family's names share).
    final_norm
        A regex over the full name: a decoder's norm after its top layer.
    lora_targets
        The names of the linear modules LoRA adapts (attention and
        feed-forward).
    layer_path
        Where the model's layers are (``encoder.layer``), for deep prompts.
    pooler
        Loaded with ``add_pooling_layer=False`` (the pooler is never used).
    position_offset
        Positions start after the padding index (RoBERTa).
    dp_refusal
        Why DP-SGD cannot train this family, or ``None``.
    """

    name: str
    model_types: frozenset[str]
    layers: str
    query_key: str
    value: str
    lora_targets: tuple[str, ...]
    layer_path: str
    embeddings: str = ""
    final_norm: str = ""
    pooler: bool = False
    position_offset: bool = False
    dp_refusal: str | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to the registry (each family module calls it)."""
    FAMILIES[family.name] = family
    return family


def family_of(model_type: str) -> Family | None:
    """The registered family that covers ``model_type``, if any."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def names() -> str:
    """The registered families, for messages: ``BERT, RoBERTa, ...``."""
    return ", ".join(FAMILIES)


def either(patterns: list[str]) -> re.Pattern[str] | None:
    """One regex matching any of ``patterns`` (``None`` when there are none)."""
    kept = [p for p in patterns if p]
    return re.compile("|".join(f"(?:{p})" for p in kept)) if kept else None


# Every module of this package is a family: loaded, so it registers itself.
for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_module.name}")
