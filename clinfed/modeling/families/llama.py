"""Decoders with Llama's names: Llama, Qwen2, Mistral, Gemma (layers under
``layers``, a gated feed-forward, an RMSNorm after the top layer)."""

from clinfed.modeling.families import Family, register

register(
    Family(
        name="Llama",
        model_types=frozenset({"llama", "qwen2", "mistral", "gemma"}),
        layers=r"(?:^|\.)layers\.(?P<layer>\d+)\.(?P<rest>.+)$",
        query_key=r"(?:^|\.)self_attn\.[qk]_proj\.",
        value=r"(?:^|\.)self_attn\.v_proj\.",
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        layer_path="layers",
        embeddings=r"(?:^|\.)embed_tokens\.",
        final_norm=r"(?:^|\.)norm\.(?:weight|bias)$",
    )
)
