"""``clinfed export RUN --out DIR``: a run's model as a plain transformers model.

A concept-extraction run (``i2b2`` task, token head) becomes a standard
``AutoModelForTokenClassification`` folder: ``config.json`` with the real
``id2label`` / ``label2id`` (``B-problem``, ``I-test`` ...), the weights as
``model.safetensors`` under transformers' own names (the encoder under its
base-model prefix, the linear head as ``classifier``), and the tokenizer.
Anyone can then load it with::

    from transformers import AutoModelForTokenClassification, AutoTokenizer
    model = AutoModelForTokenClassification.from_pretrained(DIR)
    tokenizer = AutoTokenizer.from_pretrained(DIR)

The export is checked before it is written: the transformers model must give
the same logits as clinfed's on a probe input. ``clinfed-export.json``
records the clinfed, torch and transformers versions.

Not exported, said plainly: a MIMIC-III model's label-wise attention head
and a pfeddc model's prompts are not transformers classes. Load those with
:func:`clinfed.models.load_saved_model` (``RUN/model``), which rebuilds the
model offline from the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from clinfed.errors import ClinfedError
from clinfed.runs import atomic_write_json, create_run_folder, ensure_new_run_folder


def export_run(run: Path, out: Path) -> dict[str, Any]:
    """Write ``run``'s model to ``out`` (a new folder) as a transformers
    token-classification model; returns what ``clinfed-export.json`` says."""
    import transformers
    from transformers import AutoConfig, AutoModelForTokenClassification

    from clinfed import __version__
    from clinfed.models import load_saved_model

    run, out = Path(run), Path(out)
    ensure_new_run_folder(out, "exported model", {"RUN": run})
    model, tokenizer, meta = load_saved_model(run / "model")
    if meta.get("head") != "token":
        raise ClinfedError(
            f"{run}: a {meta.get('head')} model (label-wise attention) is not a transformers "
            "class; load it with clinfed.models.load_saved_model(RUN/model)"
        )
    if getattr(model, "prompt", None) is not None:
        raise ClinfedError(
            f"{run}: a model with pfeddc prompts is not a transformers class; load it with "
            "clinfed.models.load_saved_model(RUN/model)"
        )
    labels = list(meta["labels"])
    encoder_config = model.encoder.config.to_dict()
    config = AutoConfig.for_model(
        encoder_config.pop("model_type"),
        **(
            encoder_config
            | {
                "num_labels": len(labels),
                "id2label": dict(enumerate(labels)),
                "label2id": {label: i for i, label in enumerate(labels)},
            }
        ),
    )
    exported = AutoModelForTokenClassification.from_config(config)
    prefix = exported.base_model_prefix
    state = {f"{prefix}.{k}": v for k, v in model.encoder.state_dict().items()}
    state |= {f"classifier.{k}": v for k, v in model.head.state_dict().items()}
    missing, unexpected = exported.load_state_dict(state, strict=False)
    # A pooler the encoder was built without stays at its initial values:
    # token classification never uses it.
    missing = [k for k in missing if ".pooler." not in k]
    if missing or unexpected:
        raise ClinfedError(
            f"{run}: the encoder ({config.model_type}) does not map onto "
            f"{type(exported).__name__} ({(missing + unexpected)[0]})"
        )
    _check_same_logits(model, exported, tokenizer)
    create_run_folder(out)
    exported.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    record = {
        "run": str(run.resolve()),
        "task": meta.get("task"),
        "labels": labels,
        "class": type(exported).__name__,
        "max_length": meta.get("max_length"),
        "versions": {
            "clinfed": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    atomic_write_json(out / "clinfed-export.json", record)
    return record


@torch.no_grad()
def _check_same_logits(model, exported, tokenizer) -> None:
    model.eval()
    exported.eval()
    batch = tokenizer(["probe sentence for the export check"], return_tensors="pt")
    ours = model(batch["input_ids"], batch["attention_mask"])
    theirs = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if not torch.allclose(ours, theirs, atol=1e-4):
        raise ClinfedError(
            "the exported model does not reproduce the run's logits; nothing was written"
        )
