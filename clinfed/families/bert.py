"""BERT and the families that share its module names: RoBERTa (positions
after the padding index), XLM-RoBERTa, CamemBERT, ELECTRA."""

from clinfed.families import Family, register

register(
    Family(
        name="BERT",
        model_types=frozenset({"bert", "electra"}),
        layers=r"(?:^|\.)encoder\.layer\.(?P<layer>\d+)\.(?P<rest>.+)$",
        query_key=r"(?:^|\.)attention\.self\.(?:query|key)\.",
        value=r"(?:^|\.)attention\.self\.value\.",
        lora_targets=("query", "key", "value", "dense"),
        layer_path="encoder.layer",
        pooler=True,
    )
)
register(
    Family(
        name="RoBERTa",
        model_types=frozenset({"roberta", "xlm-roberta", "camembert"}),
        layers=r"(?:^|\.)encoder\.layer\.(?P<layer>\d+)\.(?P<rest>.+)$",
        query_key=r"(?:^|\.)attention\.self\.(?:query|key)\.",
        value=r"(?:^|\.)attention\.self\.value\.",
        lora_targets=("query", "key", "value", "dense"),
        layer_path="encoder.layer",
        pooler=True,
        position_offset=True,
    )
)
