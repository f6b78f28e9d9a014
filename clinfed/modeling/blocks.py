"""Which block each parameter belongs to: the unit strategies plan with.

Blocks: ``embeddings``; per encoder layer ``i`` the attention ``query_key``
(the attention kernel, which FedFrozen freezes), ``value`` and ``rest``
(attention output, feed-forward, layer norms); ``head``; and for pfeddc's
prompts ``global_prompt`` (P_g, shared) and ``local_prompt`` (P_l and the
fusion block, never shared). Names are read by the rules of every
registered model family (:mod:`clinfed.modeling.families`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clinfed.modeling.families import FAMILIES, either

# Each registered family's rules (clinfed.modeling.families), read as one.
_LAYER_PATTERNS = tuple(re.compile(f.layers) for f in FAMILIES.values())
_QUERY_KEY = either([f.query_key for f in FAMILIES.values()])
_VALUE = either([f.value for f in FAMILIES.values()])
# Token and position tables beyond a module called "embeddings" (a decoder's
# token table, DeBERTa's relative positions), and a decoder's final norm
# (applied to the top layer's output, read by the head alone).
_EMBEDDINGS = either([f.embeddings for f in FAMILIES.values()])
_FINAL_NORM = either([f.final_norm for f in FAMILIES.values()])


@dataclass(frozen=True, order=True)
class Block:
    """A named group of parameters: ``kind`` is embeddings, query_key, value,
    rest or head; ``layer`` is the encoder layer for per-layer kinds."""

    kind: str
    layer: int | None = None

    def __str__(self) -> str:
        return self.kind if self.layer is None else f"layer{self.layer}.{self.kind}"


EMBEDDINGS = Block("embeddings")
HEAD = Block("head")
GLOBAL_PROMPT = Block("global_prompt")
LOCAL_PROMPT = Block("local_prompt")


def block_of(name: str) -> Block:
    """Block of one parameter name of a clinfed model (``encoder.*`` or ``head.*``).

    Raises
    ------
    ValueError
        For a name no rule knows, so a new architecture fails loudly instead of
        having parameters silently left out of every plan.
    """
    if name.startswith("head."):
        return HEAD
    if name.startswith("prompt.global_prompt."):
        return GLOBAL_PROMPT
    if name.startswith("prompt."):
        return LOCAL_PROMPT  # pfeddc's local prompt and fusion block: never leave a site
    if ".embeddings." in f".{name}" or (_EMBEDDINGS and _EMBEDDINGS.search(name)):
        return EMBEDDINGS
    if _FINAL_NORM and _FINAL_NORM.search(name):
        return HEAD
    for pattern in _LAYER_PATTERNS:
        match = pattern.search(name)
        if match:
            layer = int(match["layer"])
            tail = "." + match["rest"]
            if _QUERY_KEY and _QUERY_KEY.search(tail):
                return Block("query_key", layer)
            if _VALUE and _VALUE.search(tail):
                return Block("value", layer)
            return Block("rest", layer)
    raise ValueError(f"parameter {name!r} belongs to no known block")


def parameter_blocks(names: list[str]) -> dict[str, Block]:
    """Map every parameter name to its block."""
    return {name: block_of(name) for name in names}


def num_layers(blocks: dict[str, Block]) -> int:
    layers = [b.layer for b in blocks.values() if b.layer is not None]
    return max(layers) + 1 if layers else 0
