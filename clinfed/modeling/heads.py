"""The task heads on an encoder: a token tagger (concept extraction) and
label-wise attention over chunks (ICD coding), with the encoder's inputs
they build and the DP rules their own layers bring.

A clinfed model is an ``nn.Module`` with two children, ``encoder`` and
``head``, so parameter names read ``encoder.…`` and ``head.…`` whatever the
architecture (see :mod:`clinfed.modeling.blocks`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from clinfed.modeling.families import FAMILIES
from clinfed.modeling.gazetteer import PieceMarker
from clinfed.modeling.prompts import DualPrompt, encode_with_prompt
from clinfed.privacy import bookkeeping

OFFSET_POSITIONS = {t for f in FAMILIES.values() if f.position_offset for t in f.model_types}


class EncoderInputs:
    """Builds the encoder's keyword inputs. Position and token-type ids are
    passed explicitly and contiguous: Opacus's per-sample gradients for
    trainable embeddings need them (DESIGN.md section 6)."""

    def __init__(self, encoder: nn.Module):
        params = inspect.signature(encoder.forward).parameters
        self.takes_positions = "position_ids" in params
        self.takes_token_types = "token_type_ids" in params
        config = encoder.config
        self.position_offset = (
            config.pad_token_id + 1 if config.model_type in OFFSET_POSITIONS else 0
        )
        # --gazetteer: token-type ids marking listed names (clinfed.modeling.gazetteer).
        self.marker: PieceMarker | None = None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        batch, length = input_ids.shape
        if self.takes_positions:
            positions = torch.arange(length, device=input_ids.device) + self.position_offset
            inputs["position_ids"] = positions.unsqueeze(0).expand(batch, length).contiguous()
        if self.takes_token_types:
            if self.marker is None:
                inputs["token_type_ids"] = torch.zeros_like(input_ids)
            else:
                inputs["token_type_ids"] = self.marker(input_ids)
        return inputs


def _encode(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The encoder's token states, through the model's prompt if it has one."""
    inputs = model._inputs(input_ids, mask)
    if model.prompt is None:
        return model.encoder(**inputs).last_hidden_state
    return encode_with_prompt(model.encoder, model.prompt, inputs)


class TokenTagger(nn.Module):
    """Encoder + linear layer over every token (i2b2 concept tagging)."""

    def __init__(self, encoder: nn.Module, num_labels: int, dropout: float = 0.1):
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(encoder.config.hidden_size, num_labels)
        self._inputs = EncoderInputs(encoder)
        self.prompt: DualPrompt | None = None  # pfeddc: see add_prompts
        teach_dp(encoder)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, tokens, labels)``."""
        hidden = _encode(self, input_ids, attention_mask)
        return self.head(self.dropout(hidden))


class LabelAttention(nn.Module):
    """Label-wise attention (LAAT, Vu et al. 2020; PLM-ICD, Huang et al. 2022).

    Each code attends over every token of the admission and gets its own
    summary vector, so a code signalled by one phrase in a long note is not
    averaged away: ``a = softmax(U tanh(W h))``, ``v_l = sum_t a_lt h_t``,
    ``logit_l = <w_l, v_l> + b_l``.
    """

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.project = nn.Linear(hidden, hidden)
        self.query = nn.Linear(hidden, num_labels, bias=False)
        self.output = LabelwiseLinear(hidden, num_labels)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.query(torch.tanh(self.project(hidden)))  # (B, T, L)
        scores = scores.masked_fill(~mask.bool().unsqueeze(-1), torch.finfo(scores.dtype).min)
        attention = scores.softmax(dim=1)
        summary = torch.einsum("btl,bth->blh", attention, hidden)
        return self.output(summary)


class LabelwiseLinear(nn.Module):
    """One linear score per label over that label's own summary vector:
    ``logit_l = <w_l, v_l> + b_l`` for ``v`` of shape ``(B, L, H)``.

    A module of its own so DP-SGD knows its per-example gradient (registered
    below with ``clinfed.privacy.bookkeeping.register``)."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden))
        self.bias = nn.Parameter(torch.zeros(num_labels))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, summary: torch.Tensor) -> torch.Tensor:
        return (summary * self.weight).sum(-1) + self.bias


def _labelwise_per_example(
    layer: LabelwiseLinear, summary: torch.Tensor, backprop: torch.Tensor
) -> dict[str, torch.Tensor]:
    # logit_bl = <w_l, v_bl> + b_l, so d logit_bl / d w_l = v_bl per example.
    grads = {}
    if layer.weight.requires_grad:
        grads["weight"] = backprop.unsqueeze(-1) * summary
    if layer.bias.requires_grad:
        grads["bias"] = backprop
    return grads


# DP-SGD's clipping learns this layer's per-example gradient from here.
bookkeeping.register(LabelwiseLinear, _labelwise_per_example)


def teach_dp(encoder: nn.Module) -> None:
    """Register the per-example gradient of the RMSNorm of a decoder family
    (Llama, Qwen2, Mistral, Gemma: each its own class, one formula) with
    DP-SGD's clipping; its linear layers and token table are covered already."""
    for module in encoder.modules():
        kind = type(module)
        if kind.__name__.endswith("RMSNorm") and kind not in bookkeeping.RULES:
            bookkeeping.register_rms_norm(kind)


class ChunkedLabelAttentionClassifier(nn.Module):
    """Multi-label classifier for notes longer than the encoder's window.

    An admission arrives as ``C`` chunks of at most ``T`` tokens. Each chunk
    is encoded on its own; the token states of all real chunks are then
    pooled per admission by label-wise attention, so the pooling across
    chunks is learned per code rather than fixed.
    """

    def __init__(self, encoder: nn.Module, num_labels: int, dropout: float = 0.1):
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.head = LabelAttention(encoder.config.hidden_size, num_labels)
        self._inputs = EncoderInputs(encoder)
        self.prompt: DualPrompt | None = None  # pfeddc: see add_prompts
        teach_dp(encoder)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, chunk_mask: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``(batch, labels)`` from ``(batch, chunks, tokens)`` inputs.

        ``chunk_mask`` marks real chunks; padding chunks carry an all-zero
        ``attention_mask`` and so receive no attention.
        """
        del chunk_mask  # implied by attention_mask; kept in the signature for clarity
        batch, chunks, length = input_ids.shape
        flat_ids = input_ids.reshape(batch * chunks, length)
        flat_mask = attention_mask.reshape(batch * chunks, length)
        hidden = _encode(self, flat_ids, flat_mask)
        hidden = self.dropout(hidden).reshape(batch, chunks * length, -1)
        return self.head(hidden, attention_mask.reshape(batch, chunks * length))


HEADS = {"token": TokenTagger, "multilabel": ChunkedLabelAttentionClassifier}
