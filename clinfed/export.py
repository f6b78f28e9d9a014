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
records the clinfed, torch and transformers versions, and ``README.md`` is a
Hugging Face model card: task, labels, the starting model and public text,
the federation, and the privacy guarantee in plain words (epsilon, delta,
unit, relation, per site) from the run's verified ledgers, so the guarantee
travels with the weights.

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
    from clinfed.reporting.report import build

    card = model_card(build(run), labels)  # verified before anything is written
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
    card.save(out / "README.md")
    return record


def model_card(content: dict[str, Any], labels: list[str]) -> Any:
    """A Hugging Face model card from a run's report content (what the
    report states, no more): the guarantee in words, per site."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="token-classification",
        tags=["clinical", "federated-learning", "clinfed"]
        + (["differential-privacy"] if content["differential_privacy"] else []),
    )
    header = dict(content["header"])
    lines = [
        f"# {content['task']} model trained with clinfed",
        "",
        f"Task: {header.get('Task', content['task'])}. Labels: {', '.join(labels)}.",
        "",
        "## How it was trained",
        "",
        f"- Starting model: {header.get('Model', '-')}; {header.get('Starting model', '-')}.",
        f"- Strategy: {content['strategy']}"
        + (f"; {header['Sites']} sites" if "Sites" in header else "")
        + (f"; rounds: {header['Rounds']}" if "Rounds" in header else "")
        + ".",
        f"- Held-out F1 at the end of training: {_fmt(content['final_f1'])}.",
        "",
        "## Privacy guarantee",
        "",
    ]
    if content["pooled"]:
        lines.append("None: the training data was pooled in one place, without DP.")
    elif not content["differential_privacy"]:
        lines.append(
            "None: the sites trained without differential privacy; the weights can reveal "
            "their training notes."
        )
    else:
        if content.get("not_private"):
            lines += [f"**NOT PRIVATE.** {content['not_private']}.", ""]
        lines += [
            f"Each site trained under DP-SGD. The unit of privacy is {content['unit']}; "
            f"neighbouring datasets differ in one unit ({content['relation']}). For any one "
            "unit, anything computed from these weights is almost as likely whether or not "
            "that unit was in its site's data: by a factor of at most e^epsilon, except with "
            f"probability delta = {content['delta']:g}.",
            "",
            "| site | epsilon (PLD) | delta |",
            "|---|---|---|",
        ]
        lines += [
            f"| {row['site']} | {row['epsilon']:.3f} | {row['delta']:g} |"
            for row in content["sites"]
        ]
        lines += [
            "",
            "Held-out notes used for evaluation are outside epsilon (exact counts, declared "
            "and capped). A note or patient with k units is protected by group privacy only; "
            "the run's privacy report gives k and that bound.",
        ]
    lines += ["", f"Run folder: `{content['run']}` (its report: `report/report.html`)."]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-"


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
