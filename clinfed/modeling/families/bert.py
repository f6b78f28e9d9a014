"""BERT and the families that share its module names: ELECTRA, and RoBERTa
(with XLM-RoBERTa and CamemBERT), whose positions start after the padding
index."""

from clinfed.modeling.families import Family, register

_NAMES = {
    "layers": r"(?:^|\.)encoder\.layer\.(?P<layer>\d+)\.(?P<rest>.+)$",
    "query_key": r"(?:^|\.)attention\.self\.(?:query|key)\.",
    "value": r"(?:^|\.)attention\.self\.value\.",
    "lora_targets": ("query", "key", "value", "dense"),
    "layer_path": "encoder.layer",
    "pooler": True,
}

register(Family(name="BERT", model_types=frozenset({"bert", "electra"}), **_NAMES))
register(
    Family(
        name="RoBERTa",
        model_types=frozenset({"roberta", "xlm-roberta", "camembert"}),
        position_offset=True,
        **_NAMES,
    )
)
