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
:func:`clinfed.modeling.models.load_saved_model` (``RUN/model``), which rebuilds the
model offline from the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from clinfed.core.errors import ClinfedError
from clinfed.core.runs import atomic_write_json, create_run_folder, ensure_new_run_folder


def export_run(run: Path, out: Path) -> dict[str, Any]:
    """Write ``run``'s model to ``out`` (a new folder) as a transformers
    token-classification model, with its model card and privacy report;
    returns what ``clinfed-export.json`` says. The run is only read."""
    import transformers

    from clinfed.core.version import __version__
    from clinfed.modeling.models import load_saved_model
    from clinfed.reporting.report import build, write_report
    from clinfed.tasks import task_head

    run, out = Path(run), Path(out)
    ensure_new_run_folder(out, "exported model", {"RUN": run})
    content = build(run)  # verified (the seal included) before the model is read
    model, tokenizer, meta = load_saved_model(run / "model", task_head)
    exported = _as_transformers(run, model, meta)
    _check_same_logits(model, exported, tokenizer)
    provenance = _provenance(run, meta)
    labels = list(meta["labels"])
    card = model_card(content, labels, provenance)
    create_run_folder(out)
    exported.save_pretrained(out, safe_serialization=True)
    # The windows it was trained on, so a pipeline cuts text the same way.
    if meta.get("max_length"):
        tokenizer.model_max_length = int(meta["max_length"])
    tokenizer.save_pretrained(out)
    # The privacy report beside the weights: the card says no more than it.
    write_report(run, folder=out / "privacy-report")
    record = {
        "run": str(run.resolve()),
        "task": meta.get("task"),
        "labels": labels,
        "class": type(exported).__name__,
        "max_length": meta.get("max_length"),
        "base_model": provenance["base_model"],
        "synthetic_data": provenance["synthetic"],
        "versions": {
            "clinfed": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    atomic_write_json(out / "clinfed-export.json", record)
    card.save(out / "README.md")
    return record


def _as_transformers(run: Path, model: Any, meta: dict[str, Any]) -> Any:
    """The run's model as an ``AutoModelForTokenClassification``, its
    weights under transformers' names (refused where no such class fits)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    if meta.get("head") != "token":
        raise ClinfedError(
            f"{run}: a {meta.get('head')} model (label-wise attention) is not a transformers "
            "class; load it with clinfed.modeling.models.load_saved_model(RUN/model)"
        )
    if getattr(model, "prompt", None) is not None:
        raise ClinfedError(
            f"{run}: a model with pfeddc prompts is not a transformers class; load it with "
            "clinfed.modeling.models.load_saved_model(RUN/model)"
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
    return exported


# The bundled encoders: what a card names as the base model, and its licence.
BASE_MODELS = {
    "minilm": ("sentence-transformers/all-MiniLM-L6-v2", "apache-2.0"),
    "tiny": ("a tiny randomly initialised BERT (clinfed's tests)", None),
}


def _provenance(run: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The base model (followed through warm-started folders to the encoder
    they began from), its licence, and whether the data was synthetic."""
    import json

    encoder, seen = str(meta.get("encoder", "")), set()
    while encoder not in BASE_MODELS and encoder not in seen:
        seen.add(encoder)
        saved = Path(encoder) / "model.json"
        if not saved.is_file():
            break
        encoder = str(json.loads(saved.read_text()).get("encoder", ""))
    base, licence = BASE_MODELS.get(encoder, (encoder or "unknown", None))
    config = json.loads((run / "config.json").read_text())
    return {
        "base_model": base,
        "license": licence,
        "synthetic": bool(config.get("synthetic_data")),
        "max_length": meta.get("max_length"),
    }


def model_card(content: dict[str, Any], labels: list[str], provenance: dict[str, Any]) -> Any:
    """A Hugging Face model card from a run's report content (what the
    report states, no more): the base model and its licence, intended use,
    how to use it, where the data came from, and the guarantee per site."""
    from huggingface_hub import ModelCard, ModelCardData

    base, licence = provenance["base_model"], provenance["license"]
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="token-classification",
        license=licence or "other",
        base_model=base if "/" in base else None,
        tags=["clinical", "federated-learning", "clinfed"]
        + (["differential-privacy"] if content["differential_privacy"] else [])
        + (["synthetic-data"] if provenance["synthetic"] else []),
    )
    header = dict(content["header"])
    lines = [
        f"# {content['task']} model trained with clinfed",
        "",
        *(_SYNTHETIC if provenance["synthetic"] else []),
        *([f"**Unverified.** {content['unverified']}.", ""] if content.get("unverified") else []),
        f"Task: {header.get('Task', content['task'])}. Labels: {', '.join(labels)}.",
        "",
        "## Base model and licence",
        "",
        f"Fine-tuned from {base}"
        + (f" (licence: {licence})." if licence else " (see its own licence)."),
        " The hospitals' terms for their notes apply to these weights as well.",
        "",
        *_usage(provenance),
        "## How it was trained",
        "",
        f"- Starting model: {header.get('Starting model', '-')} (encoder {base}).",
        f"- Strategy: {content['strategy']}"
        + (f"; {header['Sites']} sites" if "Sites" in header else "")
        + (f"; rounds: {header['Rounds']}" if "Rounds" in header else "")
        + f"; windows of {provenance['max_length']} tokens.",
        "- Data: "
        + (
            "synthetic notes from clinfed data synth."
            if provenance["synthetic"]
            else "each site's own notes, which never left it."
        ),
        f"- Held-out F1 at the end of training: {_fmt(content['final_f1'])}.",
        "",
        "## Privacy guarantee",
        "",
    ]
    lines += _guarantee(content)
    lines += [
        "",
        "The run's privacy report is beside these weights (`privacy-report/report.html`); "
        f"the run folder was `{content['run']}`.",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


_SYNTHETIC = [
    "> **Trained on synthetic data** (`clinfed data synth`): a demonstration, not a "
    "clinical model. Do not use it on patients' notes.",
    "",
]


def _usage(provenance: dict[str, Any]) -> list[str]:
    """Intended use, limits, and the example that returns whole entities."""
    return [
        "## Intended use and limits",
        "",
        "Concept extraction (problems, tests, treatments, or the run's own types) from "
        "clinical text like the notes it was trained on, as a step a person checks. Not "
        "for diagnosis or any decision about a patient without review. It has seen only "
        "its sites' notes: expect lower accuracy on other institutions, note types and "
        f"languages, and text is read in windows of {provenance['max_length']} tokens.",
        "",
        "## How to use it",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        'tagger = pipeline("token-classification", model="PATH", aggregation_strategy="first")',
        'tagger("Patient denies chest pain ; started on aspirin .")',
        "```",
        "",
        '`aggregation_strategy="first"` joins word pieces into whole words and B-/I- tags '
        "into whole entities; without it the pipeline returns word pieces.",
        "",
    ]


def _guarantee(content: dict[str, Any]) -> list[str]:
    """The guarantee in plain words, per site, as the report states it."""
    if content["pooled"]:
        return ["None: the training data was pooled in one place, without DP."]
    if not content["differential_privacy"]:
        return [
            "None: the sites trained without differential privacy; the weights can reveal "
            "their training notes."
        ]
    lines = (
        [f"**NOT PRIVATE.** {content['not_private']}.", ""] if content.get("not_private") else []
    )
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
        f"| {row['site']} | {row['epsilon']:.3f} | {row['delta']:g} |" for row in content["sites"]
    ]
    return lines + [
        "",
        "Held-out notes used for evaluation are outside epsilon (exact counts, declared "
        "and capped). A note or patient with k units is protected by group privacy only; "
        "the privacy report gives that bound for several k.",
    ]


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
