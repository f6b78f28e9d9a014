"""Which block each parameter belongs to: the unit strategies plan with.

Blocks: ``embeddings``; per encoder layer ``i`` the attention ``query_key``
(the attention kernel, which FedFrozen freezes), ``value`` and ``rest``
(attention output, feed-forward, layer norms); ``head``; and for pfeddc's
prompts ``global_prompt`` (P_g, shared) and ``local_prompt`` (P_l and the
fusion block, never shared). Names are read for BERT, RoBERTa (same module
names as BERT), DeBERTa-v2 (``query_proj``/``key_proj``/``value_proj``; its
relative-position table is an embedding) and DistilBERT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER_PATTERNS = (
    # BERT / RoBERTa / ELECTRA: encoder.layer.3.attention.self.query.weight
    re.compile(r"(?:^|\.)encoder\.layer\.(?P<layer>\d+)\.(?P<rest>.+)$"),
    # DistilBERT: transformer.layer.3.attention.q_lin.weight
    re.compile(r"(?:^|\.)transformer\.layer\.(?P<layer>\d+)\.(?P<rest>.+)$"),
    # Llama / Qwen2 / Mistral: encoder.layers.3.self_attn.q_proj.weight
    re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<rest>.+)$"),
)
_QUERY_KEY = re.compile(
    r"(?:^|\.)(?:attention\.self\.(?:query|key)(?:_proj)?|attention\.(?:q_lin|k_lin)"
    r"|self_attn\.[qk]_proj)\."
)
_VALUE = re.compile(
    r"(?:^|\.)(?:attention\.self\.value(?:_proj)?|attention\.v_lin|self_attn\.v_proj)\."
)
# A decoder's token table, and its final norm (applied to the top layer's
# output, read by the head alone).
_DECODER_EMBEDDINGS = re.compile(r"(?:^|\.)embed_tokens\.")
_DECODER_FINAL_NORM = re.compile(r"(?:^|\.)norm\.(?:weight|bias)$")
# DeBERTa-v2: the relative-position table every layer reads (and its norm).
_RELATIVE = re.compile(r"(?:^|\.)encoder\.(?:rel_embeddings|LayerNorm)\.")


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
    if ".embeddings." in f".{name}" or _RELATIVE.search(name) or _DECODER_EMBEDDINGS.search(name):
        return EMBEDDINGS
    if _DECODER_FINAL_NORM.search(name):
        return HEAD
    for pattern in _LAYER_PATTERNS:
        match = pattern.search(name)
        if match:
            layer = int(match["layer"])
            tail = "." + match["rest"]
            if _QUERY_KEY.search(tail):
                return Block("query_key", layer)
            if _VALUE.search(tail):
                return Block("value", layer)
            return Block("rest", layer)
    raise ValueError(f"parameter {name!r} belongs to no known block")


def parameter_blocks(names: list[str]) -> dict[str, Block]:
    """Map every parameter name to its block."""
    return {name: block_of(name) for name in names}


def num_layers(blocks: dict[str, Block]) -> int:
    layers = [b.layer for b in blocks.values() if b.layer is not None]
    return max(layers) + 1 if layers else 0
