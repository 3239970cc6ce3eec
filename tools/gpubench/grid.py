"""The grid: models, exports, attention, variants and shapes, the model sizes, and which graph serves a cell."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: The repository (on the path, so that ``mograph`` imports from this checkout).
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("bert", "gpt2", "llama", "vit", "whisper")
DECODERS = ("gpt2", "llama")
EXPORTS = ("torchscript", "dynamo")
ATTNS = ("eager", "sdpa")
ORT_VARIANTS = ("exported", "ort-t", "onnxscript", "mograph", "mograph-ortfp16", "mograph-lengths")
PEERS = ("exported", "ort-t", "onnxscript")
#: Variants timed only when asked for (``--variants``): mograph with ``--mask-format lengths`` (exact only for
#: right-padded masks, like ORT's transformers optimizer's mask_index; the feeds here are all ones).
OPTIONAL_VARIANTS = ("mograph-lengths",)
#: Cached graphs a variant is built from besides the export ``fp32`` (mograph's fused float32 graph, shared by
#: ``mograph`` and ``mograph-ortfp16`` so that both fp16 conversions start from the same graph).
BUILT_FROM = {"mograph": ("fused",), "mograph-ortfp16": ("fused",), "mograph-lengths": ("fused-lengths",)}
INTERMEDIATES = ("fp32", "fused", "fused-lengths")
TORCH_VARIANTS = ("torch-eager", "torch-compile")
VARIANTS = ORT_VARIANTS + TORCH_VARIANTS
SHAPES = ("1x128", "8x128", "32x128", "1x512", "8x512", "32x512", "decode:1x512", "decode:8x512", "decode:32x512")
SMOKE_SHAPES = ("1x16", "2x32", "decode:2x16")
#: What ``--smoke`` runs unless --models/--exports/--attn say otherwise: each export path, each kind of
#: graph (encoder, decoder prefill and decode step) and every variant once, in under two minutes on CPU.
SMOKE_GRID = {("bert", "dynamo", "sdpa"), ("bert", "torchscript", "eager"), ("gpt2", "torchscript", "sdpa")}
OPSETS = {"torchscript": 17, "dynamo": 18}
#: ORT transformers optimizer model_type per model (LLaMA: as ORT's own LLaMA recipe; Whisper: bart).
ORT_MODEL_TYPE = {"bert": "bert", "gpt2": "gpt2", "llama": "gpt2", "vit": "vit", "whisper": "bart"}
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
                 "PackedMultiHeadAttention", "DecoderMaskedMultiHeadAttention", "PagedAttention")
COUNTED_OPS = ATTENTION_OPS + ("RotaryEmbedding", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
                               "LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization",
                               "Gelu", "FastGelu", "BiasGelu", "BiasAdd", "Softmax", "MatMul", "FusedMatMul",
                               "Gemm", "Cast", "MemcpyToHost", "MemcpyFromHost")


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    llama_ffn: int
    vocab: dict[str, int]
    patch: int
    mels: int


FULL = Dims(768, 12, 12, 4, 3072, 2048, {"bert": 30522, "gpt2": 50257, "llama": 32000}, 16, 80)
SMOKE = Dims(64, 2, 4, 2, 128, 96, {"bert": 100, "gpt2": 100, "llama": 100}, 8, 16)


def log(msg: str) -> None:
    sys.stderr.write(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# -- shapes and graphs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    text: str
    batch: int
    seq: int
    decode: bool = False  # seq is then the KV cache length; one new token

    @classmethod
    def parse(cls, text: str) -> Shape:
        body, decode = (text[7:], True) if text.startswith("decode:") else (text, False)
        try:
            b, s = (int(v) for v in body.lower().split("x"))
        except ValueError:
            raise SystemExit(f"bench_gpu: bad shape {text!r}: expected BxS or decode:BxP") from None
        return cls(text, b, s, decode)


def vit_image(seq: int, patch: int) -> int:
    """Image side for a ViT cell: S=128 -> 224 (197 tokens), S=512 -> 384 (577), else a square grid."""
    if patch == 16 and seq in (128, 512):
        return {128: 224, 512: 384}[seq]
    return patch * max(1, round(math.sqrt(seq)))


def graph_kind(model: str, shape: Shape, dims: Dims) -> str | None:
    """Which exported graph serves this cell (None: the cell does not apply to the model)."""
    if shape.decode:
        return "decode" if model in DECODERS else None
    if model == "vit":
        return f"img{vit_image(shape.seq, dims.patch)}"
    if model == "whisper":
        return f"pos{shape.seq}"
    return "prefill"


def applies(model: str, export: str, attn: str, variant: str) -> bool:
    if variant == "onnxscript":
        return export == "dynamo"
    return True
