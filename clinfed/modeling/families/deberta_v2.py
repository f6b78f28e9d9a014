"""DeBERTa-v2: relative attention over a position table every layer reads
(an embedding, as is its norm). Refused under DP."""

from clinfed.modeling.families import Family, register

register(
    Family(
        name="DeBERTa-v2",
        model_types=frozenset({"deberta-v2"}),
        layers=r"(?:^|\.)encoder\.layer\.(?P<layer>\d+)\.(?P<rest>.+)$",
        query_key=r"(?:^|\.)attention\.self\.(?:query|key)_proj\.",
        value=r"(?:^|\.)attention\.self\.value_proj\.",
        lora_targets=("query_proj", "key_proj", "value_proj", "dense"),
        layer_path="encoder.layer",
        embeddings=r"(?:^|\.)encoder\.(?:rel_embeddings|LayerNorm)\.",
        dp_refusal=(
            "its layers also project the relative-position table, an input every example "
            "shares, so one example's gradient cannot be clipped alone"
        ),
    )
)
