"""Personalized prompts on a frozen encoder (pFedDC adapted to clinical text).

After pFedDC (arXiv 2506.21144), which keeps a shared global prompt and a
private local prompt on a frozen CLIP backbone and fuses them by
cross-attention. Here the prompts are learned vectors prepended to a
frozen BERT-style encoder's input embeddings:

``P_g`` (global prompt)
    ``length`` vectors, shared: the only tensors a site uploads; averaged.
``P_l`` (local prompt)
    ``length`` vectors, private to a site (hospital templates, abbreviations).
fusion
    A private cross-attention block: the global prompt's vectors attend over
    both prompts, ``P = P_g + W_o softmax(P_g W_q (X W_k)^T / sqrt(d)) X W_v``
    with ``X = [P_g; P_l]``. ``W_o`` starts at zero, so training starts from
    the global prompt alone and learns how much local context to mix in.

Modes (``fusion``): ``attention`` (the above), ``concat`` (ablation: ``[P_g;
P_l]`` prepended, no fusion block), ``global`` (ablation: ``P_g`` only, no
local prompt). :attr:`DualPrompt.global_only` evaluates a site's model with
``P_g`` in place of the fused prompt.

Depth: with ``depth=1`` the prompt enters at the input only. With ``depth``
up to the encoder's layer count, the first ``depth`` layers each get a
prompt of their own (deep prompts, as in VPT-deep / P-Tuning v2): the
hidden states at the prompt positions are replaced by that layer's prompt
before the layer runs, so a small frozen encoder can be steered at every
depth. Each layer has its own ``P_g`` and ``P_l`` tables; the fusion block
is shared by all layers.

Prompts are ``nn.Embedding`` tables indexed by position and the fusion is
made of ``nn.Linear`` layers, so Opacus computes per-example gradients for
every trainable part and DP-SGD covers them all.
"""

from __future__ import annotations

import math

import torch
from torch import nn

FUSIONS = ("attention", "concat", "global")


class CrossAttentionFusion(nn.Module):
    """One cross-attention step from the global prompt over both prompts."""

    def __init__(self, hidden: int):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, global_prompt: torch.Tensor, local_prompt: torch.Tensor) -> torch.Tensor:
        both = torch.cat([global_prompt, local_prompt], dim=1)  # (B, 2m, d)
        scores = self.query(global_prompt) @ self.key(both).transpose(1, 2)
        attention = (scores / math.sqrt(global_prompt.shape[-1])).softmax(dim=-1)
        return global_prompt + self.output(attention @ self.value(both))


class DualPrompt(nn.Module):
    """Global and local prompts and their fusion; ``forward(rows)`` returns the
    ``(rows, tokens, hidden)`` prompt prepended to every encoder row."""

    def __init__(self, hidden: int, length: int = 8, fusion: str = "attention", depth: int = 1):
        super().__init__()
        if fusion not in FUSIONS:
            raise ValueError(f"prompt fusion must be one of {', '.join(FUSIONS)}")
        if length < 1 or depth < 1:
            raise ValueError("prompt length and depth must be at least 1")
        self.length, self.fusion_mode, self.depth = length, fusion, depth

        def tables() -> nn.ModuleList:
            layers = nn.ModuleList(nn.Embedding(length, hidden) for _ in range(depth))
            for table in layers:
                nn.init.normal_(table.weight, std=0.02)
            return layers

        self.global_prompt = tables()
        self.local_prompt = tables() if fusion != "global" else None
        self.fusion = CrossAttentionFusion(hidden) if fusion == "attention" else None
        self.global_only = False

    @property
    def tokens(self) -> int:
        """Prompt vectors prepended to each row (in the current mode)."""
        doubled = self.fusion_mode == "concat" and not self.global_only
        return 2 * self.length if doubled else self.length

    def forward(self, rows: int, layer: int = 0) -> torch.Tensor:
        table = self.global_prompt[layer]
        positions = torch.arange(self.length, device=table.weight.device)
        index = positions.unsqueeze(0).expand(rows, self.length)
        global_prompt = table(index)
        if self.local_prompt is None or self.global_only:
            return global_prompt
        local_prompt = self.local_prompt[layer](index)
        if self.fusion is None:
            return torch.cat([global_prompt, local_prompt], dim=1)
        return self.fusion(global_prompt, local_prompt)


def encode_with_prompt(
    encoder: nn.Module, prompt: DualPrompt, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Run ``encoder`` with ``prompt`` prepended to its input embeddings;
    return the hidden states of the real tokens only (prompt rows dropped)."""
    input_ids, mask = inputs["input_ids"], inputs["attention_mask"]
    rows, length = input_ids.shape
    prefix = prompt(rows)
    extra = prefix.shape[1]
    words = encoder.get_input_embeddings()(input_ids)
    embeds = torch.cat([prefix.to(words.dtype), words], dim=1)
    full_mask = torch.cat([mask.new_ones(rows, extra), mask], dim=1)
    kwargs = {"inputs_embeds": embeds, "attention_mask": full_mask}
    if "position_ids" in inputs:
        offset = int(inputs["position_ids"][0, 0]) if length else 0
        positions = torch.arange(extra + length, device=input_ids.device) + offset
        kwargs["position_ids"] = positions.unsqueeze(0).expand(rows, -1).contiguous()
    if "token_type_ids" in inputs:
        # The prompt's positions are type 0; the real tokens keep theirs
        # (a --gazetteer's marks).
        types = inputs["token_type_ids"]
        kwargs["token_type_ids"] = torch.cat([types.new_zeros(rows, extra), types], dim=1)
    hooks = []
    for depth, layer in enumerate(encoder_layers(encoder)[1 : prompt.depth], start=1):

        def deep(module, args, kwargs, depth=depth):
            # Replace the prompt positions' states by this layer's prompt.
            del module
            hidden = args[0] if args else kwargs["hidden_states"]
            fresh = torch.cat([prompt(rows, depth).to(hidden.dtype), hidden[:, extra:]], dim=1)
            if args:
                return (fresh, *args[1:]), kwargs
            return args, kwargs | {"hidden_states": fresh}

        hooks.append(layer.register_forward_pre_hook(deep, with_kwargs=True))
    try:
        return encoder(**kwargs).last_hidden_state[:, extra:]
    finally:
        for hook in hooks:
            hook.remove()


def encoder_layers(encoder: nn.Module) -> list[nn.Module]:
    """The transformer layers of a model, in order: where its family says
    they are (``encoder.layer``, ``transformer.layer``, ``layers``...)."""
    from clinfed.modeling.families import FAMILIES

    for path in dict.fromkeys(f.layer_path for f in FAMILIES.values()):
        module = encoder
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if module is not None:
            return list(module)
    raise ValueError("deep prompts need a model whose family says where its layers are")
