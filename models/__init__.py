"""Generators of mograph's test and example models, written in code rather than shipped as blobs.

Two modules, split by what they need:

- :mod:`models.builders` builds ONNX graphs directly with ``onnx.helper`` and numpy (no torch). Its models
  copy the op patterns that PyTorch exporters emit (decomposed LayerNorm, Erf GELU, Shape/Gather/Concat
  reshapes, ...), so fusion passes can be tested on realistic graphs quickly and deterministically.
- :mod:`models.export_hf` exports small random-weight Hugging Face models (BERT, GPT-2, ViT, LLaMA) with the
  real PyTorch exporters. It needs the ``mograph[torch]`` extra and is imported lazily: ``import models``
  never imports torch.

Everything is seeded: the same arguments give the same model, byte for byte.
"""

from models.builders import bert_feeds, bert_tiny, cnn_small, make_model, random_feeds, tensor_info

__all__ = ["bert_feeds", "bert_tiny", "cnn_small", "make_model", "random_feeds", "tensor_info"]
