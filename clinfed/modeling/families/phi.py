"""Phi: a decoder with Llama's attention names, a plain two-layer
feed-forward (``fc1``, ``fc2``), the attention output as ``dense`` and a
LayerNorm after its top layer (``final_layernorm``)."""

from clinfed.modeling.families import Family, register

register(
    Family(
        name="Phi",
        model_types=frozenset({"phi"}),
        layers=r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<rest>.+)$",
        query_key=r"(?:^|\.)self_attn\.[qk]_proj\.",
        value=r"(?:^|\.)self_attn\.v_proj\.",
        lora_targets=("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"),
        layer_path="layers",
        embeddings=r"(?:^|\.)embed_tokens\.",
        final_norm=r"(?:^|\.)final_layernorm\.(?:weight|bias)$",
    )
)
