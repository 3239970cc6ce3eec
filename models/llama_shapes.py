"""Random-weight LLaMA decoders of real model shapes, exported to ONNX (for timing quantization, not accuracy).

``135m`` is SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads, FFN 1536, vocab 49152, tied
embeddings); ``1b`` is a Llama-3.2-1B-class shape (16 layers, hidden 2048, 32 / 8 heads, FFN 8192, vocab
128256, tied).  The weights are seeded random numbers: no checkpoint is read, nothing is downloaded.
The graph takes ``input_ids`` and ``attention_mask`` ``[batch, seq]`` (int64) and returns ``logits``
(no KV cache), exported by torch's TorchScript exporter at opset 17.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SHAPES", "build_module", "export"]

SHAPES: dict[str, dict[str, int]] = {
    "135m": {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "ffn": 1536, "vocab": 49152},
    "1b": {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256},
}


def build_module(shape: str, *, layers: int | None = None, seed: int = 0) -> Any:
    """The eval-mode ``LlamaForCausalLM`` of ``shape`` (``layers`` overrides the layer count), in a wrapper
    whose ``forward(input_ids, attention_mask)`` returns ``(logits,)``."""
    import torch
    import transformers

    s = dict(SHAPES[shape])
    if layers is not None:
        s["layers"] = layers
    config = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], intermediate_size=s["ffn"],
        max_position_embeddings=2048, tie_word_embeddings=True, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any]:
            return (self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits,)

    return Wrapper().eval()


def export(shape: str, path: str | os.PathLike[str], *, layers: int | None = None, seed: int = 0) -> Path:
    """Export :func:`build_module` to ``path`` (dynamic batch and sequence); return the path."""
    import torch

    path = Path(path)
    module = build_module(shape, layers=layers, seed=seed)
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 1000, (2, 8)).astype(np.int64))
    mask = torch.ones_like(ids)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(
            module, (ids, mask), str(path), input_names=["input_ids", "attention_mask"], output_names=["logits"],
            opset_version=17, dynamo=False, dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes},
            do_constant_folding=True,
        )  # fmt: skip
    return path
