"""DistilBERT: BERT's layers under ``transformer.layer``, its own linear names."""

from clinfed.modeling.families import Family, register

register(
    Family(
        name="DistilBERT",
        model_types=frozenset({"distilbert"}),
        layers=r"(?:^|\.)transformer\.layer\.(?P<layer>\d+)\.(?P<rest>.+)$",
        query_key=r"(?:^|\.)attention\.(?:q_lin|k_lin)\.",
        value=r"(?:^|\.)attention\.v_lin\.",
        lora_targets=("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"),
        layer_path="transformer.layer",
    )
)
