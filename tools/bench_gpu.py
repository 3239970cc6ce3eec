"""GPU benchmark: mograph against ONNX Runtime's transformers optimizer, onnxscript's ORT fusions, and torch.

One grid, measured on one GPU, written as JSON lines as it goes (so it can be spread over several calls):

* **models** (random seeded weights, built from transformers configs; nothing is downloaded):
  ``bert`` (BERT-base: 12 layers, hidden 768, 12 heads, FFN 3072), ``gpt2`` (GPT-2 124M), ``llama``
  (LLaMA-style decoder: 12 layers, hidden 768, 12 query / 4 KV heads, rotary, SwiGLU 2048), ``vit``
  (ViT-B/16), ``whisper`` (a Whisper-style encoder: 12 layers, d_model 768, 80 mel bins);
* **exports**: ``torchscript`` (``torch.onnx.export(dynamo=False)``, opset 17) and ``dynamo``
  (``dynamo=True``, opset 18), each with transformers' ``eager`` and ``sdpa`` attention (``--attn``);
* **variants**, all float16 on the GPU, inputs and outputs float32:
  ``exported`` (the export through ``onnxruntime.transformers.float16.convert_float_to_float16
  (keep_io_types=True)``), ``ort-t`` (``onnxruntime.transformers.optimizer.optimize_model`` with the
  model's ``model_type``, then the same converter), ``onnxscript`` (``onnxscript.rewriter.ort_fusions.
  optimize_for_ort``, dynamo exports only, then the same converter), ``mograph`` (``cleanup,fuse`` lowered
  ``--target ort``, then mograph's own ``fp16`` pass calibrated on 4 seeded feeds), ``mograph-ortfp16``
  (the same fused float32 graph through ORT's converter instead: mograph's fp16 against ORT's on one graph,
  issue 15 item 4); and the references
  ``torch-eager`` (the model in float16 with sdpa attention) and ``torch-compile`` (the same through
  ``torch.compile``), on the same GPU (on CPU, ``--smoke``, torch runs float32 and torch.compile is skipped);
* **shapes**: ``BxS`` prefill cells (default 1, 8, 32 x 128, 512) and ``decode:BxP`` (one token with a
  KV cache of P, default P = 512) for the decoders.  ViT has no sequence input: S=128 runs 224x224
  images (197 tokens), S=512 384x384 (577 tokens), other S the nearest square patch grid.  The Whisper
  encoder is built with ``max_source_positions = S`` (2S mel frames).

Each cell's time is the median of single ``run_with_iobinding`` calls (inputs and outputs on the
device, bound once; the call returns when the GPU is done) after ``--warmup`` runs; the variants of a
cell are timed in interleaved rounds so that drift hits them alike.  Accuracy is the cosine (and max
abs) of the model's main output against the float32 torch model (eager attention) on the same feeds.
``ratio`` is mograph over the best ORT peer of the cell; ``vs_compile`` mograph over torch.compile.

Every ORT variant's first run is profiled (ONNX Runtime's profiler, read by ``mograph.backends.ort``): each row
records how many nodes ran off the device's provider (on the CPU, under CUDA) and how many Memcpy nodes ONNX
Runtime inserted, so "no Memcpy nodes added by mograph that the export did not have" is visible per cell.

``--kernels N`` also records, per cell and ORT variant, the CUDA kernels ``torch.profiler`` saw over N IO-bound
runs (total device ms a run, launches, the 25 heaviest by name), so a slow cell says which kernel it is.
``mograph-lengths`` (asked for by name only) is mograph with ``--mask-format lengths``: the 1-D key lengths
ORT's transformers optimizer also uses, exact only for right-padded masks.

Exports and optimized variants are kept in ``--cache`` (keyed by model, export, attention, graph), so a
later call only times; each built graph is loaded once by CPU ONNX Runtime before it is kept (a peer's
invalid rewrite fails its build, not a GPU call), and a graph's float32 intermediates are deleted once all
its variants are built (``--keep-intermediates``).  ``--list`` prints what is left and estimates the build
(spread over ``--jobs``) and timing seconds and the disk the cache needs.  A cell that fails is recorded with its error and the grid goes on; a cell whose
process died (a crash inside a runtime) is recorded as such on the next call, not retried.
``--time-budget`` stops starting new work after that many seconds, so one call can stay under a limit.

Usage (the H200, with onnxruntime-gpu installed there: ``import torch`` before ``onnxruntime`` so the CUDA
provider finds cuDNN/cuBLAS)::

    python tools/bench_gpu.py --out results.jsonl --cache /tmp/mograph-gpu --time-budget 480
    python tools/bench_gpu.py --out results.jsonl --models bert --exports torchscript --shapes 8x512
    python tools/bench_gpu.py --markdown BENCHMARKS-GPU.md --out results.jsonl
    python tools/bench_gpu.py --smoke --out /tmp/smoke.jsonl    # tiny models on CPU ONNX Runtime, ~2 min
    python tools/bench_gpu.py --smoke --models bert,gpt2,llama,vit,whisper --out /tmp/all.jsonl  # every cell, ~8 min

The sequence that fills the whole grid on the H200 is in BENCHMARKS-GPU.md ("How to run").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
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


# -- models -----------------------------------------------------------------------------------------------


def hf_model(model: str, kind: str, attn: str, dims: Dims) -> Any:
    """The transformers module for a graph, random weights (seed 0), in eval mode, float32, on CPU."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    if model == "bert":
        cfg = T.BertConfig(vocab_size=dims.vocab["bert"], hidden_size=dims.hidden, num_hidden_layers=dims.layers,
                           num_attention_heads=dims.heads, intermediate_size=dims.ffn, max_position_embeddings=512,
                           attn_implementation=attn)
        return T.BertModel(cfg, add_pooling_layer=False).eval()
    if model == "gpt2":
        cfg = T.GPT2Config(vocab_size=dims.vocab["gpt2"], n_positions=1024, n_embd=dims.hidden, n_layer=dims.layers,
                           n_head=dims.heads, attn_implementation=attn)
        return T.GPT2Model(cfg).eval()
    if model == "llama":
        cfg = T.LlamaConfig(vocab_size=dims.vocab["llama"], hidden_size=dims.hidden, intermediate_size=dims.llama_ffn,
                            num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                            num_key_value_heads=dims.kv_heads, max_position_embeddings=2048, attn_implementation=attn)
        return T.LlamaModel(cfg).eval()
    if model == "vit":
        cfg = T.ViTConfig(hidden_size=dims.hidden, num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                          intermediate_size=dims.ffn, image_size=int(kind[3:]), patch_size=dims.patch,
                          attn_implementation=attn)
        return T.ViTModel(cfg, add_pooling_layer=False).eval()
    if model == "whisper":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        cfg = T.WhisperConfig(d_model=dims.hidden, encoder_layers=dims.layers, encoder_attention_heads=dims.heads,
                              encoder_ffn_dim=dims.ffn, decoder_layers=1, decoder_attention_heads=dims.heads,
                              decoder_ffn_dim=dims.ffn, num_mel_bins=dims.mels, max_source_positions=int(kind[3:]),
                              attn_implementation=attn)
        return WhisperEncoder(cfg).eval()
    raise SystemExit(f"bench_gpu: unknown model {model!r}")


def _cache_tensors(cache: Any) -> list[Any]:
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for i in range(len(cache.key_cache)) for t in (cache.key_cache[i], cache.value_cache[i])]


def wrapper(model: str, kind: str, hf: Any, layers: int) -> Any:
    """A module with tensor inputs and outputs (main output first) for export, torch timing and reference."""
    import torch

    if kind == "decode":
        import transformers as T

        class Decode(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = hf

            def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> Any:
                cache = T.DynamicCache()
                for i in range(layers):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
                return (out.last_hidden_state, *_cache_tensors(out.past_key_values))

        return Decode().eval()

    if model in ("bert", "gpt2", "llama"):
        extra = {} if model == "bert" else {"use_cache": False}

        class Text(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = hf

            def forward(self, input_ids: Any, attention_mask: Any) -> Any:
                return self.m(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state

        return Text().eval()
    key = "pixel_values" if model == "vit" else "input_features"

    class Single(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = hf

        def forward(self, x: Any) -> Any:
            return self.m(**{key: x}).last_hidden_state

    return Single().eval()


def input_names(model: str, kind: str, layers: int) -> list[str]:
    if model == "vit":
        return ["pixel_values"]
    if model == "whisper":
        return ["input_features"]
    names = ["input_ids", "attention_mask"]
    if kind == "decode":
        names += [f"past_{i}_{kv}" for i in range(layers) for kv in ("key", "value")]
    return names


def output_names(kind: str, layers: int) -> list[str]:
    out = ["last_hidden_state"]
    if kind == "decode":
        out += [f"present_{i}_{kv}" for i in range(layers) for kv in ("key", "value")]
    return out


def make_feeds(model: str, kind: str, batch: int, seq: int, dims: Dims, seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs of one cell (``seq`` is the KV cache length for ``decode``)."""
    rng = np.random.default_rng(seed)
    if model == "vit":
        side = int(kind[3:])
        return {"pixel_values": rng.standard_normal((batch, 3, side, side), dtype=np.float32)}
    if model == "whisper":
        return {"input_features": rng.standard_normal((batch, dims.mels, 2 * int(kind[3:])), dtype=np.float32)}
    vocab = dims.vocab[model]
    if kind != "decode":
        return {"input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64),
                "attention_mask": np.ones((batch, seq), dtype=np.int64)}
    kv = dims.kv_heads if model == "llama" else dims.heads
    head = dims.hidden // dims.heads
    feeds = {"input_ids": rng.integers(0, vocab, (batch, 1), dtype=np.int64),
             "attention_mask": np.ones((batch, seq + 1), dtype=np.int64)}
    for i in range(dims.layers):
        for name in ("key", "value"):
            feeds[f"past_{i}_{name}"] = rng.standard_normal((batch, kv, seq, head), dtype=np.float32)
    return feeds


def dynamic_spec(model: str, kind: str, layers: int) -> tuple[dict[str, dict[int, str]], Any]:
    """``dynamic_axes`` (TorchScript) and ``dynamic_shapes`` (dynamo) of a graph."""
    import torch

    dyn = torch.export.Dim.DYNAMIC
    if model in ("vit", "whisper"):
        name = input_names(model, kind, layers)[0]
        return ({name: {0: "batch"}, "last_hidden_state": {0: "batch"}}, ({0: dyn},))
    if kind != "decode":
        axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                "last_hidden_state": {0: "batch", 1: "seq"}}
        return axes, ({0: dyn, 1: dyn}, {0: dyn, 1: dyn})
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"}, "last_hidden_state": {0: "batch"}}
    for name in input_names(model, kind, layers)[2:]:
        axes[name] = {0: "batch", 2: "past"}
    for name in output_names(kind, layers)[1:]:
        axes[name] = {0: "batch", 2: "total"}
    return axes, ({0: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in range(2 * layers)))


# -- the cache: exports and variants --------------------------------------------------------------------


@dataclass
class Graph:
    model: str
    export: str
    attn: str
    kind: str
    folder: Path

    @property
    def name(self) -> str:
        return f"{self.model}/{self.export}/{self.attn}/{self.kind}"

    def path(self, variant: str) -> Path:
        return self.folder / f"{variant}.onnx"

    def status_path(self) -> Path:
        return self.folder / "status.json"

    def status(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.status_path().read_text())
        return {}

    def record(self, variant: str, entry: dict[str, Any]) -> None:
        status = self.status()
        status[variant] = entry
        tmp = self.status_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=1))
        os.replace(tmp, self.status_path())


def weights_for(model: str, kind: str, dims: Dims, cache: Path, smoke: bool) -> dict[str, Any]:
    """The state dict of a (model, graph): made once and kept, so every export and torch run agree."""
    import torch

    path = cache / f"weights-{'smoke-' if smoke else ''}{model}-{kind}.pt"
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=True)
    state = hf_model(model, kind, "eager", dims).state_dict()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # --jobs: the eager and sdpa builds of a model race here
    torch.save(state, tmp)
    os.replace(tmp, path)  # the same seeded weights either way
    return state


def torch_module(model: str, kind: str, attn: str, dims: Dims, cache: Path, smoke: bool) -> Any:
    hf = hf_model(model, kind, attn, dims)
    hf.load_state_dict(weights_for(model, kind, dims, cache, smoke))
    return wrapper(model, kind, hf, dims.layers)


def export_graph(g: Graph, dims: Dims, cache: Path, smoke: bool) -> None:
    import torch

    module = torch_module(g.model, g.kind, g.attn, dims, cache, smoke)
    feeds = make_feeds(g.model, g.kind, 2, 16 if g.kind in ("prefill", "decode") else 0, dims, seed=123)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names = input_names(g.model, g.kind, dims.layers)
    outs = output_names(g.kind, dims.layers)
    axes, shapes = dynamic_spec(g.model, g.kind, dims.layers)
    tmp = g.folder / "export.tmp.onnx"
    with torch.no_grad():
        if g.export == "torchscript":
            torch.onnx.export(module, args, str(tmp), input_names=names, output_names=outs, dynamic_axes=axes,
                              opset_version=OPSETS["torchscript"], dynamo=False, do_constant_folding=True)
        else:
            torch.onnx.export(module, args, str(tmp), input_names=names, output_names=outs, dynamic_shapes=shapes,
                              opset_version=OPSETS["dynamo"], dynamo=True, external_data=False)
    os.replace(tmp, g.path("fp32"))


def _fp16_peer(src: Any) -> Any:
    """ONNX Runtime's float16 converter, inputs and outputs kept float32 (how the peers are made fp16)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(src, keep_io_types=True)


def op_counts(path: Path) -> dict[str, int]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ops = Counter(n.op_type for n in proto.graph.node)
    out = {k: ops[k] for k in COUNTED_OPS if ops[k]}
    out["attention"] = sum(ops[k] for k in ATTENTION_OPS)
    out["nodes"] = sum(ops.values())
    return out


def calibration_file(g: Graph, dims: Dims, smoke: bool) -> Path:
    """Four seeded feeds of batch 1 (stacked in one .npz) for mograph's fp16 pass."""
    path = g.folder / "calibration.npz"
    if not path.exists():
        seq = 16 if smoke else 128
        feeds = make_feeds(g.model, g.kind, 4, seq, dims, seed=7)
        np.savez(path, **feeds)
    return path


def prepare_variant(g: Graph, variant: str, dims: Dims, smoke: bool, gpu: bool = True) -> None:
    """Write ``variant.onnx`` (float16) from the export ``fp32.onnx`` (``gpu``: the ORT optimizer's ``use_gpu``)."""
    import onnx

    src, dst = g.path("fp32"), g.path(variant)
    tmp = g.folder / f"{variant}.tmp.onnx"
    if variant == "exported":
        onnx.save(_fp16_peer(onnx.load(str(src))), str(tmp))
    elif variant == "ort-t":
        from onnxruntime.transformers.optimizer import optimize_model

        model_type = ORT_MODEL_TYPE[g.model]
        try:
            opt = optimize_model(str(src), model_type=model_type, num_heads=dims.heads, hidden_size=dims.hidden,
                                 use_gpu=gpu)
        except Exception as exc:  # noqa: BLE001 - the peer's own recipe crashed on this export: try its generic one
            if model_type == "bert":
                raise
            # e.g. ORT 1.2x-1.31's gpt2 post-processing indexes a Gemm's bias that a dynamo export's Gemm lacks
            opt = optimize_model(str(src), model_type="bert", num_heads=dims.heads, hidden_size=dims.hidden,
                                 use_gpu=gpu)
            g.record("ort-t-note", {"note": f"model_type={model_type} failed ({describe(exc)}); built with "
                                            "model_type=bert"})
        onnx.save(_fp16_peer(opt.model), str(tmp))
    elif variant == "onnxscript":
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model = ir.load(str(src))
        model, fusions = optimize_for_ort(model)
        g.record("onnxscript-fusions", {k: v for k, v in dict(fusions).items() if v})
        onnx.save(_fp16_peer(ir.serde.serialize_model(model)), str(tmp))
    elif variant == "fused":
        import mograph

        model, report = mograph.optimize(str(src), "cleanup,fuse", options={"target": "ort"})
        g.record("mograph-fuse", {p.name: p.stats for p in report.passes if p.modified})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "fused-lengths":  # the same with --mask-format lengths (exact only for right padding)
        import mograph

        model, report = mograph.optimize(str(src), "cleanup,fuse", options={"target": "ort", "mask_format": "lengths"})
        g.record("mograph-lengths-fuse", {p.name: p.stats for p in report.passes if p.modified})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "mograph-lengths":
        import mograph

        model, _ = mograph.optimize(str(g.path("fused-lengths")), "fp16",
                                    options={"calibration_data": str(calibration_file(g, dims, smoke))})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "mograph":
        import mograph

        model, report16 = mograph.optimize(str(g.path("fused")), "fp16",
                                           options={"calibration_data": str(calibration_file(g, dims, smoke))})
        g.record("mograph-passes", {"fuse": g.status().get("mograph-fuse"),
                                    "fp16": {p.name: p.stats for p in report16.passes}})
        mograph.save(model, str(tmp), overwrite=True)
    elif variant == "mograph-ortfp16":
        onnx.save(_fp16_peer(onnx.load(str(g.path("fused")))), str(tmp))
    else:
        raise ValueError(variant)
    check_loads(tmp)
    os.replace(tmp, dst)


def check_loads(path: Path) -> None:
    """Fail the build (on the CPU, before the GPU sees it) when ONNX Runtime cannot load the graph: type or
    shape errors a peer's rewrite left (seen: onnxscript's ORT fusions on GPT-2 dynamo exports feed a rank-3
    tensor to a Gemm).  An op without a CPU kernel (a CUDA-only contrib op) is not an error here."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 4
    opts.intra_op_num_threads = 1
    try:
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - re-raised as one line, below
        if "Could not find an implementation" in str(exc):
            return
        raise RuntimeError(f"ONNX Runtime cannot load the {path.stem.removesuffix('.tmp')} graph: "
                           f"{str(exc).strip()[:300]}") from None


def needed_steps(g: Graph, variants: list[str]) -> list[str]:
    """The steps still to run for these variants: the missing ones and the graphs they are built from when
    those are not in the cache (an export dropped after its graph was complete is made again only if needed)."""
    missing = [v for v in dict.fromkeys(variants) if v in ORT_VARIANTS and not g.path(v).exists()]
    sources = list(dict.fromkeys(d for v in missing for d in BUILT_FROM.get(v, ()) if not g.path(d).exists()))
    raw = bool(sources) or any(not BUILT_FROM.get(v) for v in missing)
    return (["fp32"] if raw and not g.path("fp32").exists() else []) + sources + missing


def drop_intermediates(g: Graph, asked: list[str] | None = None) -> list[str]:
    """Delete the float32 export and mograph's fused float32 graphs once every variant of the graph is built
    (or failed): nothing times them, and the full grid's cache would not fit a 64 GiB disk with them.  "Every"
    is those ``asked`` for (a later call asking for another rebuilds what it needs), else the grid's variants."""
    status = g.status()
    wanted = set(asked) if asked else set(ORT_VARIANTS) - set(OPTIONAL_VARIANTS)
    variants = [v for v in ORT_VARIANTS if v in wanted and applies(g.model, g.export, g.attn, v)]
    if not all(g.path(v).exists() or (status.get(v) or {}).get("error") for v in variants):
        return []
    dropped = [s for s in INTERMEDIATES if g.path(s).exists()]
    for s in dropped:
        g.path(s).unlink()
    return dropped


def prepare(g: Graph, variants: list[str], dims: Dims, cache: Path, smoke: bool, retry: bool,
            deadline: float, gpu: bool = True, keep: bool = False) -> dict[str, str]:
    """Export (once) and build every variant asked for; return ``{variant: error}`` for those that failed.
    Unless ``keep``, the float32 intermediates go once the graph has all its variants (:func:`drop_intermediates`)."""
    g.folder.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    status = g.status()
    for step in needed_steps(g, variants):
        if g.path(step).exists():
            continue
        if step in status and status[step].get("error") and not retry:
            errors[step] = status[step]["error"]
            continue
        if "fp32" in errors:
            errors[step] = f"export failed: {errors['fp32']}"
            continue
        failed_from = [d for d in BUILT_FROM.get(step, ()) if d in errors]
        if failed_from:
            errors[step] = f"{failed_from[0]} failed: {errors[failed_from[0]]}"
            continue
        if time.time() > deadline:
            errors[step] = "budget"
            continue
        t = time.perf_counter()
        log(f"{g.name}: {'exporting' if step == 'fp32' else 'building ' + step}")
        try:
            if step == "fp32":
                export_graph(g, dims, cache, smoke)
            else:
                prepare_variant(g, step, dims, smoke, gpu)
            g.record(step, {"seconds": round(time.perf_counter() - t, 1), "ops": op_counts(g.path(step))})
        except Exception as exc:  # noqa: BLE001 - a failing step is a result, recorded, and the grid goes on
            msg = describe(exc)
            log(f"{g.name}: {step} failed: {msg}")
            g.record(step, {"error": msg, "seconds": round(time.perf_counter() - t, 1),
                            "traceback": traceback.format_exc()[-3000:]})
            errors[step] = msg
    if not keep:
        drop_intermediates(g, variants)
    return errors


def describe(exc: BaseException) -> str:
    """One line for an error: its type and first line, and the first line of the exception that caused it
    (torch.onnx's export errors say only "step 1/3 failed"; the cause says why)."""
    parts = []
    seen = 0
    while exc is not None and seen < 4:
        text = str(exc).strip().splitlines()
        first = text[0][:300] if text else ""
        if not parts or first not in " ".join(parts):  # a cause that only repeats its wrapper adds nothing
            parts.append(f"{type(exc).__name__}: {first}")
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return " <- ".join(parts)[:700]


# -- runners ------------------------------------------------------------------------------------------


class Runner:
    """One thing to time on one cell: ``run()`` once (returns when the device is done), ``output()``."""

    def run(self) -> None:
        raise NotImplementedError

    def output(self) -> np.ndarray:
        raise NotImplementedError


class OrtRunner(Runner):
    def __init__(self, session: Any, feeds: dict[str, np.ndarray], device: str) -> None:
        import onnxruntime as ort

        self.session = session
        self.io = session.io_binding()
        self.values = []  # keep the OrtValues alive
        dev = "cuda" if device == "cuda" else "cpu"
        wanted = {i.name for i in session.get_inputs()}
        for name, arr in feeds.items():
            if name not in wanted:
                continue
            value = ort.OrtValue.ortvalue_from_numpy(arr, dev, 0)
            self.values.append(value)
            self.io.bind_ortvalue_input(name, value)
        for out in session.get_outputs():
            self.io.bind_output(out.name, dev)

    def run(self) -> None:
        self.session.run_with_iobinding(self.io)

    def output(self) -> np.ndarray:
        return np.asarray(self.io.copy_outputs_to_cpu()[0], dtype=np.float32)


class TorchRunner(Runner):
    def __init__(self, module: Any, feeds: dict[str, np.ndarray], device: str, half: bool) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.module = module
        dtype = torch.float16 if half else torch.float32
        self.args = [torch.from_numpy(v).to(device) for v in feeds.values()]
        self.args = [a.to(dtype) if a.is_floating_point() else a for a in self.args]
        self.last: Any = None

    def run(self) -> None:
        with self.torch.inference_mode():
            self.last = self.module(*self.args)
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def output(self) -> np.ndarray:
        out = self.last[0] if isinstance(self.last, (tuple, list)) else self.last
        return out.float().cpu().numpy()


def ort_session(path: Path, device: str, threads: int | None, profile_dir: str | None = None) -> Any:
    """A session on ``device``; with ``profile_dir``, ONNX Runtime's profiler is on until :func:`placement`
    reads where the nodes of the first run ran (and stops it, so the timed runs are not profiled)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    if profile_dir:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(profile_dir) / "ort")
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), opts, providers=providers)
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"CUDAExecutionProvider not active (got {session.get_providers()})")
    return session


def placement(runner: OrtRunner, profile_dir: str, device: str) -> dict[str, Any]:
    """Run once (profiled) and say where the nodes ran: ``{"nodes", "off_device", "memcpy", "off_device_ops"}``
    (``off_device``: compute nodes not on the device's provider, i.e. on the CPU under CUDA; ``memcpy``: the
    MemcpyToHost/FromHost nodes ONNX Runtime inserted), from mograph's reading of ONNX Runtime's profile."""
    from mograph.backends.ort import profile_placement

    runner.run()
    where = profile_placement(runner.session, profile_dir,
                              "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider")
    return {"nodes": where["nodes"], "off_device": len(where["fallback"]), "memcpy": len(where["memcpy"]),
            "off_device_ops": dict(Counter(n["op_type"] for n in where["fallback"])), "profiled": where["profiled"]}


def cuda_kernels(runner: Runner, runs: int, top: int = 25) -> dict[str, Any]:
    """The CUDA kernels (and memcpys) ``runs`` runs launch, from ``torch.profiler`` (CUPTI sees every kernel of
    the process, ONNX Runtime's too): ``{"ms": total device ms a run, "launches": kernels a run, "top": [...]}``,
    ``top`` the heaviest by device time, each ``{"name", "ms" (a run), "count" (a run)}``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            runner.run()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = float(getattr(ev, "self_device_time_total", 0.0) or 0.0)
        if us > 0:
            rows.append({"name": str(ev.key)[:160], "ms": round(us / 1000.0 / runs, 5),
                         "count": round(int(ev.count) / runs, 2)})
    rows.sort(key=lambda r: -r["ms"])
    return {"ms": round(sum(r["ms"] for r in rows), 5), "launches": round(sum(r["count"] for r in rows), 1),
            "top": rows[:top]}


def time_runners(runners: dict[str, Runner], warmup: int, min_time: float, rounds: int,
                 max_iters: int) -> dict[str, dict[str, Any]]:
    """Interleaved timing: warm each up, size its chunk from a few runs, then ``rounds`` rounds in turn."""
    results: dict[str, dict[str, Any]] = {}
    chunk: dict[str, int] = {}
    live: dict[str, Runner] = {}
    for name, r in runners.items():
        try:
            for _ in range(warmup):
                r.run()
            t = time.perf_counter()
            for _ in range(3):
                r.run()
            per = max((time.perf_counter() - t) / 3, 1e-6)
            chunk[name] = int(min(max(min_time / rounds / per, 3), max(max_iters // rounds, 3)))
            live[name] = r
        except Exception as exc:  # noqa: BLE001
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
    samples: dict[str, list[float]] = {n: [] for n in live}
    order = list(live)
    for rnd in range(rounds):
        for name in order[rnd % max(len(order), 1):] + order[: rnd % max(len(order), 1)]:
            r = live[name]
            if name in results:
                continue
            try:
                for _ in range(chunk[name]):
                    t = time.perf_counter()
                    r.run()
                    samples[name].append(time.perf_counter() - t)
            except Exception as exc:  # noqa: BLE001
                results[name] = {"error": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
    for name, values in samples.items():
        if name in results or not values:
            continue
        ms = sorted(v * 1e3 for v in values)
        results[name] = {"median_ms": round(statistics.median(ms), 4), "p10_ms": round(ms[len(ms) // 10], 4),
                         "p90_ms": round(ms[(len(ms) * 9) // 10], 4), "iters": len(ms)}
    return results


def cosine(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    if x.shape != y.shape:
        return float("nan"), float("nan")
    denom = float(np.linalg.norm(x) * np.linalg.norm(y))
    cos = float(np.dot(x, y) / denom) if denom else float("nan")
    return cos, float(np.max(np.abs(x - y))) if x.size else 0.0


# -- results file -------------------------------------------------------------------------------------


def cell_key(model: str, export: str, attn: str, variant: str, shape: str) -> str:
    return f"{model}/{export}/{attn}/{variant}/{shape}"


def read_results(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line))
    return rows


class Results:
    """The JSON-lines file: appended line by line (flushed, fsynced), read back to resume."""

    def __init__(self, path: Path, retry_errors: bool) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        started: set[str] = set()
        for row in read_results(path):
            if row.get("status") == "started":
                started.add(row["key"])
            elif "key" in row:
                if row.get("status") == "ok" or not retry_errors:
                    self.done[row["key"]] = row
                started.discard(row["key"])
        self.crashed = started - set(self.done)

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if row.get("status") != "started":
            self.done[row["key"]] = row


# -- the grid -------------------------------------------------------------------------------------------


@dataclass
class Context:
    args: argparse.Namespace
    dims: Dims
    device: str
    cache: Path
    results: Results
    deadline: float
    versions: dict[str, str]
    gpu: str
    argv: str
    refs: dict[tuple[str, str, str], np.ndarray] = field(default_factory=dict)
    torch_modules: dict[tuple[str, str, str], Any] = field(default_factory=dict)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx_ir", "mograph"):
        with contextlib.suppress(Exception):
            out[mod] = str(__import__(mod).__version__)
    return out


def _base_row(ctx: Context, model: str, export: str, attn: str, variant: str, shape: Shape, kind: str) -> dict[str, Any]:
    return {"key": cell_key(model, export, attn, variant, shape.text), "model": model, "export": export, "attn": attn,
            "variant": variant, "shape": shape.text, "batch": shape.batch, "seq": shape.seq, "decode": shape.decode,
            "graph": kind, "device": ctx.device, "gpu": ctx.gpu, "smoke": ctx.args.smoke,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": ctx.versions,
            "command": ctx.argv}


def reference(ctx: Context, model: str, kind: str, shape: Shape, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The float32 torch output (eager attention) for a cell, on the benchmark's device."""
    key = (model, kind, shape.text)
    if key not in ctx.refs:
        import torch

        mkey = (model, kind, "reference")
        if mkey not in ctx.torch_modules:
            ctx.torch_modules[mkey] = torch_module(model, kind, "eager", ctx.dims, ctx.cache, ctx.args.smoke).to(ctx.device)
        runner = TorchRunner(ctx.torch_modules[mkey], feeds, ctx.device, half=False)
        runner.run()
        ctx.refs[key] = runner.output()
        del runner
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    return ctx.refs[key]


def torch_runner(ctx: Context, model: str, kind: str, variant: str) -> Any:
    key = (model, kind, variant)
    if key not in ctx.torch_modules:
        import torch

        module = torch_module(model, kind, "sdpa", ctx.dims, ctx.cache, ctx.args.smoke).to(ctx.device)
        if ctx.device == "cuda":
            module = module.half()
        if variant == "torch-compile":
            module = torch.compile(module, dynamic=False)
        ctx.torch_modules[key] = module
    return ctx.torch_modules[key]


def graph_for(cache: Path, smoke: bool, model: str, export: str, attn: str, kind: str) -> Graph:
    return Graph(model, export, attn, kind, cache / f"{'smoke-' if smoke else ''}{model}-{export}-{attn}-{kind}")


def pending_ort(ctx: Context, model: str, export: str, attn: str, shapes: list[Shape], variants: list[str]) -> list[str]:
    """The ORT variants of a graph that some of these shapes still need."""
    return [v for v in variants if v in ORT_VARIANTS and applies(model, export, attn, v)
            and any(cell_key(model, export, attn, v, s.text) not in ctx.results.done for s in shapes)]


def _prepare_worker(model: str, export: str, attn: str, kind: str, variants: list[str], smoke: bool, cache: str,
                    retry: bool, deadline: float, threads: int, verbose: bool, gpu: bool, keep: bool) -> dict[str, str]:
    """One graph's export and variants, in a worker process (``--jobs``)."""
    if not verbose:
        _quiet()
    import torch

    torch.set_num_threads(max(threads, 1))
    _limit_ort_threads(max(threads, 1))
    dims = SMOKE if smoke else FULL
    g = graph_for(Path(cache), smoke, model, export, attn, kind)
    return prepare(g, variants, dims, Path(cache), smoke, retry, deadline, gpu, keep)


def _limit_ort_threads(threads: int) -> None:
    """In a build worker: every ONNX Runtime session that does not choose its thread count (the calibration
    sessions of mograph's fp16 pass, ORT's own optimizer) gets ``threads`` and no spinning, so that N workers
    do not each start a spinning pool as wide as the host."""
    import onnxruntime as ort

    base = ort.InferenceSession.__init__

    def init(self: Any, path_or_bytes: Any, sess_options: Any = None, *rest: Any, **kwargs: Any) -> None:
        opts = sess_options if sess_options is not None else ort.SessionOptions()
        if not opts.intra_op_num_threads:
            opts.intra_op_num_threads = threads
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        base(self, path_or_bytes, opts, *rest, **kwargs)

    ort.InferenceSession.__init__ = init  # type: ignore[method-assign]


def prepare_all(ctx: Context, jobs_list: list[tuple[str, str, str, str, list[Shape], list[str]]]) -> None:
    """Build every graph the grid still needs in ``--jobs`` processes at once (exports are CPU-bound)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    work = []
    for model, export, attn, kind, shapes, variants in jobs_list:
        wanted = pending_ort(ctx, model, export, attn, shapes, variants)
        g = graph_for(ctx.cache, ctx.args.smoke, model, export, attn, kind)
        if wanted and needed_steps(g, wanted):
            work.append((model, export, attn, kind, wanted))
    if not work:
        return
    # the order of --exports (then --models) is the priority when --time-budget stops the builds
    work.sort(key=lambda w: ctx.args.exports.index(w[1]) if w[1] in ctx.args.exports else 99)
    if ctx.args.jobs <= 1:  # --prepare-only without --jobs: build in this process, one graph after another
        for model, export, attn, kind, wanted in work:
            g = graph_for(ctx.cache, ctx.args.smoke, model, export, attn, kind)
            prepare(g, wanted, ctx.dims, ctx.cache, ctx.args.smoke, ctx.args.retry_errors, ctx.deadline,
                    ctx.device == "cuda", ctx.args.keep_intermediates)
        return
    jobs = max(1, min(ctx.args.jobs, len(work)))
    threads = max(1, (os.cpu_count() or 2) // jobs)
    log(f"building {len(work)} graph(s) in {jobs} processes ({threads} threads each)")
    for attempt in (1, 2):  # a worker killed (out of memory, a crash in a library) breaks the whole pool
        broken = []
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_prepare_worker, *w, ctx.args.smoke, str(ctx.cache), ctx.args.retry_errors,
                                   ctx.deadline, threads, ctx.args.verbose, ctx.device == "cuda",
                                   ctx.args.keep_intermediates): w for w in work}
            for fut in cf.as_completed(futures):
                w = futures[fut]
                try:
                    errors = fut.result()
                    log(f"{'/'.join(w[:4])}: built" + (f" ({len(errors)} failed: {', '.join(errors)})" if errors else ""))
                except cf.process.BrokenProcessPool:
                    broken.append(w)
                except Exception as exc:  # noqa: BLE001 - the timing loop builds it again in-process
                    log(f"{'/'.join(w[:4])}: build worker failed: {describe(exc)}")
        if not broken or attempt == 2 or time.time() > ctx.deadline:
            break
        work, jobs = broken, max(1, min(jobs, len(broken)) // 2)  # fewer at once: less memory
        log(f"a build worker died: {len(work)} graph(s) again in {jobs} processes")
    if broken:
        log(f"a build worker died again: {', '.join('/'.join(w[:4]) for w in broken)} left to the timing loop")


def run_cells(ctx: Context, model: str, export: str, attn: str, kind: str, shapes: list[Shape],
              variants: list[str]) -> None:
    """Time every pending cell of one graph: ORT variants from the cache (and torch, once per model)."""
    args = ctx.args
    g = graph_for(ctx.cache, args.smoke, model, export, attn, kind)

    def pending(variant: str, shape: Shape) -> bool:
        return cell_key(*_torch_ids(model, export, attn, variant), variant, shape.text) not in ctx.results.done

    ort_wanted = pending_ort(ctx, model, export, attn, shapes, variants)
    torch_wanted = [v for v in variants if v in TORCH_VARIANTS and any(pending(v, s) for s in shapes)
                    and not (v == "torch-compile" and ctx.device != "cuda" and not args.compile_on_cpu)]
    if not ort_wanted and not torch_wanted:
        return
    errors: dict[str, str] = {}
    if ort_wanted:
        errors = prepare(g, ort_wanted, ctx.dims, ctx.cache, args.smoke, args.retry_errors, ctx.deadline,
                         ctx.device == "cuda", args.keep_intermediates)
    status = g.status()
    sessions: dict[str, Any] = {}
    placements: dict[str, dict[str, Any]] = {}
    first = make_feeds(model, kind, shapes[0].batch, shapes[0].seq, ctx.dims, seed=0)
    for v in ort_wanted:
        if v in errors:
            continue
        try:
            with tempfile.TemporaryDirectory(prefix="bench-gpu-profile-", ignore_cleanup_errors=True) as profile_dir:
                sessions[v] = ort_session(g.path(v), ctx.device, args.threads, profile_dir)
                placements[v] = placement(OrtRunner(sessions[v], first, ctx.device), profile_dir, ctx.device)
        except Exception as exc:  # noqa: BLE001
            errors[v] = f"session: {type(exc).__name__}: {str(exc).strip()[:400]}"
    for shape in shapes:
        if time.time() > ctx.deadline:
            log("time budget reached: stopping (the next call resumes here)")
            return
        feeds = make_feeds(model, kind, shape.batch, shape.seq, ctx.dims, seed=0)
        todo = [v for v in ort_wanted + torch_wanted if pending(v, shape)]
        if not todo:
            continue
        rows: dict[str, dict[str, Any]] = {}
        runners: dict[str, Runner] = {}
        for v in todo:
            m, e, a = _torch_ids(model, export, attn, v)
            row = _base_row(ctx, m, e, a, v, shape, kind)
            rows[v] = row
            if v in errors:
                if errors[v] == "budget":
                    rows.pop(v)
                    continue
                row.update(status="error", error=errors[v])
                continue
            if v in ORT_VARIANTS:
                row["ops"] = status.get(v, {}).get("ops")
                row["placement"] = placements.get(v)
                if v == "mograph":
                    row["mograph_passes"] = status.get("mograph-passes")
                if v == "onnxscript":
                    row["onnxscript_fusions"] = status.get("onnxscript-fusions")
                if status.get(f"{v}-note"):
                    row["note"] = status[f"{v}-note"]["note"]
            ctx.results.write({"key": row["key"], "status": "started"})
            try:
                if v in ORT_VARIANTS:
                    runners[v] = OrtRunner(sessions[v], feeds, ctx.device)
                else:
                    runners[v] = TorchRunner(torch_runner(ctx, model, kind, v), feeds, ctx.device,
                                             half=ctx.device == "cuda")
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", error=f"{type(exc).__name__}: {str(exc).strip()[:400]}")
        try:
            ref = reference(ctx, model, kind, shape, feeds)
        except Exception as exc:  # noqa: BLE001
            ref = None
            log(f"{model}/{kind} {shape.text}: no float32 reference: {exc}")
        timed = time_runners(runners, args.warmup, args.min_time, args.rounds, args.max_iters) if runners else {}
        for v, row in rows.items():
            if "status" in row:
                ctx.results.write(row)
                continue
            res = timed.get(v, {"error": "not timed"})
            if "error" in res:
                row.update(status="error", error=res["error"])
            else:
                row.update(status="ok", **res)
                if ref is not None:
                    try:
                        cos, mx = cosine(runners[v].output(), ref)
                        row.update(cosine=round(cos, 7), max_abs=mx)
                    except Exception as exc:  # noqa: BLE001
                        row["accuracy_error"] = str(exc)[:200]
                if args.kernels and v in ORT_VARIANTS and ctx.device == "cuda":
                    try:
                        row["kernels"] = cuda_kernels(runners[v], args.kernels)
                    except Exception as exc:  # noqa: BLE001
                        row["kernels_error"] = describe(exc)
            ctx.results.write(row)
            shown = f"{row['median_ms']:.3f} ms cos {row.get('cosine', float('nan')):.5f}" if row["status"] == "ok" \
                else f"ERROR {row['error'][:120]}"
            log(f"{row['key']}: {shown}")
        runners.clear()


def _torch_ids(model: str, export: str, attn: str, variant: str) -> tuple[str, str, str]:
    """Torch references belong to the model, not to an export: one cell per model and shape."""
    return (model, "torch", "sdpa") if variant in TORCH_VARIANTS else (model, export, attn)


def _quiet() -> None:
    """Exporter and tracer warnings (thousands of lines on a grid) off; errors are recorded per cell."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("transformers", "torch.onnx", "onnxscript", "onnx_ir", "mograph", "onnxruntime"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_grid(args: argparse.Namespace) -> int:
    dims = SMOKE if args.smoke else FULL
    if not args.verbose:
        _quiet()
    device = "cpu" if args.smoke else args.device
    start = time.time()
    deadline = start + args.time_budget if args.time_budget else float("inf")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # before onnxruntime: the CUDA provider finds cuDNN/cuBLAS through it

    if args.threads:
        torch.set_num_threads(args.threads)
    import onnxruntime as ort

    if device == "cuda":
        with contextlib.suppress(Exception):
            ort.preload_dlls()
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpu: no CUDA device (use --smoke, or --device cpu)")
        # the float32 reference is float32: no TF32 in its matmuls or convolutions (ViT patches, Whisper conv)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SystemExit(f"bench_gpu: onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                             "(install onnxruntime-gpu, a CUDA build that matches the device's)")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = Results(out, args.retry_errors)
    ctx = Context(args, dims, device, cache, results, deadline, _versions(), gpu,
                  " ".join(shlex.quote(a) for a in ["python", "tools/bench_gpu.py", *sys.argv[1:]]))
    for key in sorted(results.crashed):
        parts = key.split("/")
        row = {"key": key, "model": parts[0], "export": parts[1], "attn": parts[2], "variant": parts[3],
               "shape": parts[4], "status": "error", "error": "the process died while timing this cell (a crash "
               "inside the runtime, or killed by the time limit); not retried", "device": device, "gpu": gpu,
               "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": ctx.argv}
        results.write(row)
        log(f"{key}: recorded as crashed in an earlier call")
    shapes = [Shape.parse(s) for s in args.shapes]
    variants = list(args.variants)
    # the grid, graph by graph; torch references go with the first export/attention of a model's graph
    plan: list[tuple[str, str, str, str, list[Shape], list[str]]] = []
    for model in args.models:
        kinds: dict[str, list[Shape]] = {}
        for s in shapes:
            kind = graph_kind(model, s, dims)
            if kind is not None:
                kinds.setdefault(kind, []).append(s)
        for kind, kind_shapes in kinds.items():
            first = True
            for export in args.exports:
                for attn in args.attn:
                    if args.smoke_grid and (model, export, attn) not in SMOKE_GRID:
                        continue
                    vs = [v for v in variants if v not in TORCH_VARIANTS or first]
                    plan.append((model, export, attn, kind, kind_shapes, vs))
                    first = False
    if args.jobs > 1 or args.prepare_only:
        prepare_all(ctx, plan)
    if args.prepare_only:
        log("--prepare-only: built what the grid needs; nothing timed")
        return 0
    current: tuple[str, str] | None = None
    for model, export, attn, kind, kind_shapes, vs in plan:
        if current != (model, kind):  # a new graph kind: free the previous torch modules and references
            ctx.torch_modules.clear()
            ctx.refs.clear()
            if device == "cuda":
                torch.cuda.empty_cache()
            current = (model, kind)
        if time.time() > deadline:
            log("time budget reached: stopping (the next call resumes here)")
            return _finish(ctx, start)
        try:
            run_cells(ctx, model, export, attn, kind, kind_shapes, vs)
        except Exception as exc:  # noqa: BLE001 - never lose the rest of the grid
            log(f"{model}/{export}/{attn}/{kind}: {describe(exc)}")
            traceback.print_exc()
    return _finish(ctx, start)


def _finish(ctx: Context, start: float) -> int:
    rows = [r for r in read_results(ctx.results.path) if r.get("status") != "started"]
    ok = sum(r.get("status") == "ok" for r in rows)
    log(f"done in {time.time() - start:.0f} s: {ok} ok / {len(rows)} cells in {ctx.results.path}")
    sys.stdout.write(summary_table(rows) + "\n")
    return 0


# -- tables ---------------------------------------------------------------------------------------------


def latest(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("status") in ("ok", "error") and "key" in r:
            out[r["key"]] = r
    return out


def _ms(r: dict[str, Any] | None) -> float | None:
    return r.get("median_ms") if r and r.get("status") == "ok" else None


#: Rows further apart than this are taken to come from different device leases (other machine, other noise).
LEASE_SECONDS = 45 * 60


def _same_lease(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two result rows were measured close enough in time to be compared (rows without a time: yes)."""
    if not a.get("time") or not b.get("time"):
        return True
    ta, tb = datetime.fromisoformat(a["time"]), datetime.fromisoformat(b["time"])
    return abs((ta - tb).total_seconds()) <= LEASE_SECONDS


def grid_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (model, export, attention, shape): each variant's ms, best peer, ratios, accuracy."""
    cells = latest(rows)
    groups: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = {}
    torch_rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in cells.values():
        if r["export"] == "torch":
            torch_rows.setdefault((r["model"], r["shape"]), {})[r["variant"]] = r
        else:
            groups.setdefault((r["model"], r["export"], r["attn"], r["shape"]), {})[r["variant"]] = r
    order = {m: i for i, m in enumerate(MODELS)}
    shape_order = {s: i for i, s in enumerate(SHAPES + SMOKE_SHAPES)}
    out = []
    for (model, export, attn, shape), vs in sorted(
        groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1], kv[0][2], shape_order.get(kv[0][3], 99), kv[0][3])
    ):
        line: dict[str, Any] = {"model": model, "export": export, "attn": attn, "shape": shape}
        ref = vs.get("mograph")
        if ref is not None:  # several --out files: only rows of mograph's own lease are compared with it
            vs = {v: r for v, r in vs.items() if _same_lease(r, ref)}
            line["time"] = ref.get("time")
        for v in ORT_VARIANTS:
            line[v] = _ms(vs.get(v))
            if vs.get(v) and vs[v].get("status") == "error":
                line[v + "_error"] = vs[v]["error"]
            line[v + "_cosine"] = vs.get(v, {}).get("cosine")
            line[v + "_attention"] = (vs.get(v, {}).get("ops") or {}).get("attention")
            line[v + "_placement"] = vs.get(v, {}).get("placement")
            line[v + "_casts"] = (vs.get(v, {}).get("ops") or {}).get("Cast")
        fp16 = ((vs.get("mograph", {}).get("mograph_passes") or {}).get("fp16") or {}).get("fp16")
        if fp16:
            line["mograph_kept_fp32"] = {k.split(".", 1)[1]: n for k, n in fp16.items()
                                         if k.startswith("kept_fp32.") and n}
        for v, r in torch_rows.get((model, shape), {}).items():
            if ref is not None and not _same_lease(r, ref):
                continue
            line[v] = _ms(r)
            line[v + "_cosine"] = r.get("cosine")
        peers = {v: line[v] for v in PEERS if line.get(v) is not None}
        if peers:
            best = min(peers, key=lambda k: peers[k])
            line["best_peer"], line["best_peer_ms"] = best, peers[best]
            line["best_peer_fuses_attention"] = bool(line.get(best + "_attention"))
        if line.get("mograph") is not None and line.get("best_peer_ms"):
            line["ratio"] = line["mograph"] / line["best_peer_ms"]
        if line.get("mograph-lengths") is not None and line.get("best_peer_ms"):
            line["lengths_ratio"] = line["mograph-lengths"] / line["best_peer_ms"]
        if line.get("mograph") is not None and line.get("mograph-ortfp16"):
            line["fp16_ratio"] = line["mograph"] / line["mograph-ortfp16"]  # issue 15 item 4: <= 1 is the goal
        exported_memcpy = (line.get("exported_placement") or {}).get("memcpy")
        mograph_memcpy = (line.get("mograph_placement") or {}).get("memcpy")
        if exported_memcpy is not None and mograph_memcpy is not None:
            line["memcpy_added"] = max(0, mograph_memcpy - exported_memcpy)
        if line.get("mograph") is not None and line.get("torch-compile"):
            line["vs_compile"] = line["mograph"] / line["torch-compile"]
        out.append(line)
    return out


def _f(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _goal(line: dict[str, Any]) -> str:
    """Issue 15's goal for a cell: mograph within 3% of the best peer, 1.3x faster than it where it fuses
    no attention, and at 8x512 within 1.25x of torch.compile."""
    ratio = line.get("ratio")
    if ratio is None:
        return "-"
    need = 1 / 1.3 if not line.get("best_peer_fuses_attention") else 1.03
    if ratio > need:
        return "miss"
    if line.get("shape") == "8x512" and line.get("vs_compile") is not None and line["vs_compile"] > 1.25:
        return "miss (compile)"
    return "ok"


def _placements(line: dict[str, Any]) -> str:
    """``off/memcpy`` per ORT variant (``-`` where not measured), and a flag where mograph has more Memcpy
    nodes than the export (issue 15 item 3: mograph must add none)."""
    parts = []
    for v in ORT_VARIANTS:
        if v in OPTIONAL_VARIANTS:  # not a column of the tables
            continue
        p = line.get(v + "_placement")
        parts.append("-" if not p else f"{p['off_device']}/{p['memcpy']}")
    text = " · ".join(parts)
    if line.get("memcpy_added"):
        text += f" **(+{line['memcpy_added']} Memcpy)**"
    return text


def _fp16_cell(line: dict[str, Any]) -> str:
    """``kept (why) / Casts mograph · Casts ORT conv``: the nodes mograph's fp16 pass kept in float32 and why,
    and the Cast nodes of both fp16 conversions of the fused graph."""
    kept = line.get("mograph_kept_fp32")
    why = "-" if kept is None else (f"{sum(kept.values())} ({', '.join(f'{k} {n}' for k, n in kept.items())})"
                                    if kept else "0")
    return f"{why} / {_f(line.get('mograph_casts'), 'd')} · {_f(line.get('mograph-ortfp16_casts'), 'd')}"


def summary_table(rows: list[dict[str, Any]]) -> str:
    lines = grid_rows(rows)
    head = (f"{'model':<8} {'export':<11} {'attn':<5} {'shape':<13} {'exported':>9} {'ort-t':>9} {'onnxscr':>9} "
            f"{'mograph':>9} {'mg+ortf16':>9} {'best peer':>10} {'ratio':>6} {'fp16 r':>6} {'cos mograph':>11} "
            f"{'torch':>9} {'compile':>9} goal")
    out = [head]
    for ln in lines:
        out.append(
            f"{ln['model']:<8} {ln['export']:<11} {ln['attn']:<5} {ln['shape']:<13} {_f(ln.get('exported')):>9} "
            f"{_f(ln.get('ort-t')):>9} {_f(ln.get('onnxscript')):>9} {_f(ln.get('mograph')):>9} "
            f"{_f(ln.get('mograph-ortfp16')):>9} {ln.get('best_peer', '-'):>10} {_f(ln.get('ratio'), '.2f'):>6} "
            f"{_f(ln.get('fp16_ratio'), '.2f'):>6} {_f(ln.get('mograph_cosine'), '.5f'):>11} "
            f"{_f(ln.get('torch-eager')):>9} {_f(ln.get('torch-compile')):>9} {_goal(ln)}"
        )
    errors = [r for r in latest(rows).values() if r.get("status") == "error"]
    if errors:
        out.append(f"\n{len(errors)} cell(s) failed:")
        out += [f"  {r['key']}: {str(r.get('error'))[:160]}" for r in errors]
    return "\n".join(out)


#: In a --markdown target, the text above this line is kept (a hand-written "How to run", older runs).
KEEP_MARKER = "<!-- tools/bench_gpu.py --markdown replaces everything below this line; the text above is kept -->"


def write_markdown(path: Path, tables: str) -> None:
    """Write ``tables`` to ``path``; when ``path`` has :data:`KEEP_MARKER`, keep what is above it."""
    head = ""
    if path.exists():
        text = path.read_text()
        if KEEP_MARKER in text:
            head = text[: text.index(KEEP_MARKER)] + KEEP_MARKER + "\n\n"
            if tables.startswith("# "):  # the kept text has the title
                tables = tables.split("\n", 1)[1].lstrip("\n")
    path.write_text(head + tables)


def markdown(rows: list[dict[str, Any]], sources: list[str]) -> str:
    lines = grid_rows(rows)
    cells = list(latest(rows).values())
    commands = sorted({r.get("command") for r in cells if r.get("command")})
    gpus = sorted({str(r.get("gpu")) for r in cells if r.get("gpu")})
    versions: dict[str, set[str]] = {}
    for r in cells:
        for k, v in (r.get("versions") or {}).items():
            versions.setdefault(k, set()).add(str(v))
    smoke = any(r.get("smoke") for r in cells)
    md = ["# GPU benchmarks: mograph vs ONNX Runtime's transformers optimizer, onnxscript's ORT fusions, torch", ""]
    if smoke:
        md += ["**These rows come from `--smoke` (tiny random models on CPU ONNX Runtime): they test the script, "
               "they say nothing about GPU speed.**", ""]
    md += [f"Device: {', '.join(gpus) or 'unknown'}. Versions: "
           + ", ".join(f"{k} {'/'.join(sorted(v))}" for k, v in sorted(versions.items())) + ".", ""]
    md += ["Median ms of one `run_with_iobinding` call (inputs and outputs on the device), float16 (inputs and "
           "outputs float32), random seeded weights; variants of a cell timed in interleaved rounds in one process. "
           "`ratio` = mograph / best ORT peer (exported, ort-t, onnxscript) of the cell; `goal`: ratio <= 1.03, or "
           "<= 1/1.3 where the best peer fuses no attention, and at 8x512 `vs compile` <= 1.25; "
           "`vs compile` = mograph / torch.compile. `mograph + ORT fp16`: mograph's fused float32 graph through "
           "ORT's float16 converter (the same graph as `mograph`, the other fp16 conversion); `fp16: mograph / ORT conv` "
           "= mograph / that (issue 15 item 4 asks <= 1). Off-device / Memcpy nodes: from ONNX Runtime's profile of "
           "the first run, compute nodes that ran on another provider than the device's (under CUDA: on the CPU) and "
           "the Memcpy nodes ONNX Runtime inserted (it keeps small shape computations on the CPU on purpose: the Memcpy "
           "count is the one to watch); bold where mograph has more Memcpy nodes than the export. The last column: "
           "the nodes mograph's fp16 pass kept in float32 and the reasons it measured, and the Cast nodes of "
           "mograph's and ORT's fp16 conversions of the fused graph. "
           "Cosine: the main output against float32 torch (eager attention) on the same feeds. "
           "ViT has no sequence input: its S=128 cells run 224x224 images (197 tokens), S=512 384x384 (577 tokens); "
           "the Whisper-style encoder is built for S positions (2S mel frames). `decode:BxP`: one new token per "
           "sequence with a KV cache of P.", ""]
    md += ["Made with:", "", "```bash"] + commands + [f"python tools/bench_gpu.py --markdown BENCHMARKS-GPU.md "
                                                        f"--out {' --out '.join(sources)}", "```", ""]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for ln in lines:
        by_model.setdefault(ln["model"], []).append(ln)
    for model, group in by_model.items():
        md += [f"## {model}", "",
               "| export | attn | shape | exported | ort-t | onnxscript | mograph | mograph + ORT fp16 | best peer | "
               "ratio | goal | fp16: mograph / ORT conv | cos mograph | cos best peer | cos mograph + ORT fp16 | "
               "torch eager | torch.compile | vs compile | attention ops (best peer / mograph) | "
               "off-device / Memcpy nodes (exported, ort-t, onnxscript, mograph, mograph + ORT fp16) | "
               "mograph fp16: kept fp32 (why) / Casts (mograph · ORT conv) |",
               "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
        for ln in group:
            best = ln.get("best_peer")
            md.append(
                f"| {ln['export']} | {ln['attn']} | {ln['shape']} | {_f(ln.get('exported'))} | {_f(ln.get('ort-t'))} | "
                f"{_f(ln.get('onnxscript'))} | {_f(ln.get('mograph'))} | {_f(ln.get('mograph-ortfp16'))} | "
                f"{best or '-'} | {_f(ln.get('ratio'), '.2f')} | {_goal(ln)} | {_f(ln.get('fp16_ratio'), '.2f')} | "
                f"{_f(ln.get('mograph_cosine'), '.6f')} | {_f(ln.get(f'{best}_cosine') if best else None, '.6f')} | "
                f"{_f(ln.get('mograph-ortfp16_cosine'), '.6f')} | {_f(ln.get('torch-eager'))} | "
                f"{_f(ln.get('torch-compile'))} | {_f(ln.get('vs_compile'), '.2f')} | "
                f"{_f(ln.get(f'{best}_attention') if best else None, 'd')} / {_f(ln.get('mograph_attention'), 'd')} | "
                f"{_placements(ln)} | {_fp16_cell(ln)} |"
            )
        md.append("")
    notes = sorted({(r["key"].rsplit("/", 1)[0], r["note"]) for r in cells if r.get("note")})
    if notes:
        md += ["## Notes", "", "| graph / variant | note |", "|---|---|"]
        md += [f"| `{k}` | {n.replace('|', '/')[:300]} |" for k, n in notes]
        md.append("")
    errors = [r for r in cells if r.get("status") == "error"]
    if errors:
        md += ["## Cells that failed", "", "| cell | error |", "|---|---|"]
        md += [f"| `{r['key']}` | {str(r.get('error')).replace('|', '/')[:300]} |" for r in sorted(errors, key=lambda r: r["key"])]
        md.append("")
    return "\n".join(md)


# -- command line ---------------------------------------------------------------------------------------


def _csv(choices: tuple[str, ...] | None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if choices is not None:
            bad = [t for t in items if t not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Grid: models x exports x attention x variants x shapes; see the module docstring.")
    ap.add_argument("--out", action="append", metavar="FILE.jsonl",
                    help="results, one JSON line per cell, appended as they finish; cells already there are skipped "
                    "(with --markdown: the files to read, repeatable)")
    ap.add_argument("--cache", default="/tmp/mograph-gpu-cache", metavar="DIR",
                    help="exports and optimized variants, reused by later calls (default /tmp/mograph-gpu-cache)")
    ap.add_argument("--models", type=_csv(MODELS), help=f"subset of {','.join(MODELS)} (default: all)")
    ap.add_argument("--exports", type=_csv(EXPORTS), help=f"subset of {','.join(EXPORTS)} (default: both)")
    ap.add_argument("--attn", type=_csv(ATTNS), help="transformers attention: eager,sdpa (default: both)")
    ap.add_argument("--variants", type=_csv(VARIANTS), default=[v for v in VARIANTS if v not in OPTIONAL_VARIANTS],
                    help=f"subset of {','.join(VARIANTS)} (default: all but {','.join(OPTIONAL_VARIANTS)})")
    ap.add_argument("--shapes", type=_csv(None), default=None,
                    help=f"cells: BxS prefill, decode:BxP one token with a cache of P (default {','.join(SHAPES)})")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to run (default cuda)")
    ap.add_argument("--time-budget", type=float, default=0, metavar="SECONDS",
                    help="start no new export or cell after this many seconds (0: no limit)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed runs per variant and cell (default 10)")
    ap.add_argument("--min-time", type=float, default=1.0, metavar="SECONDS",
                    help="timed seconds per variant and cell, over all rounds (default 1.0)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--max-iters", type=int, default=2000, help="most timed runs per variant and cell")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for ONNX Runtime and torch (0: default)")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="build the exports and variants the grid needs in N processes first (CPU-bound, mostly one "
                    "thread each: e.g. 12 on the 16-core H200 host, up to ~8 GB of memory each), then time them one by one")
    ap.add_argument("--prepare-only", action="store_true",
                    help="only export and build (fills --cache; in N processes with --jobs N), time nothing")
    ap.add_argument("--keep-intermediates", action="store_true",
                    help="keep each graph's float32 export and mograph's fused float32 graph in --cache after all its "
                    "variants are built (default: deleted then; the full grid's cache is ~40 GB without them)")
    ap.add_argument("--kernels", type=int, default=0, metavar="RUNS",
                    help="after timing, profile RUNS runs of each ORT variant with torch.profiler (CUDA only) and record "
                    "the kernels it launched in the cell's row (\"kernels\": total device ms a run, launches, the top 25)")
    ap.add_argument("--retry-errors", action="store_true", help="run again the cells and builds that failed before")
    ap.add_argument("--compile-on-cpu", action="store_true", help="time torch.compile on CPU too (slow to compile)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random models (2 layers, hidden 64) on CPU ONNX Runtime, shapes 1x16,2x32,decode:2x16, "
                    "few iterations, no torch.compile: checks the script end to end in under two minutes; unless "
                    "--models/--exports/--attn are given it runs bert dynamo/sdpa, bert torchscript/eager and gpt2 "
                    "torchscript/sdpa")
    ap.add_argument("--list", action="store_true", help="print what the selection still has to build and time, with estimated build (at --jobs), timing "
                    "and disk, and exit")
    ap.add_argument("--verbose", action="store_true", help="keep the exporters' and libraries' warnings")
    ap.add_argument("--markdown", metavar="FILE.md", help="write the tables of the --out files as Markdown and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.out:
        raise SystemExit("bench_gpu: --out FILE.jsonl is required")
    if args.markdown:
        rows = [r for path in args.out for r in read_results(Path(path))]
        if not rows:
            raise SystemExit(f"bench_gpu: no results in {', '.join(args.out)}")
        write_markdown(Path(args.markdown), markdown(rows, args.out))
        sys.stdout.write(f"wrote {args.markdown} ({len(latest(rows))} cells)\n")
        return 0
    if len(args.out) != 1:
        raise SystemExit("bench_gpu: one --out file when running the grid")
    args.out = args.out[0]
    if args.shapes is None:
        args.shapes = list(SMOKE_SHAPES if args.smoke else SHAPES)
    args.smoke_grid = args.smoke and args.models is None and args.exports is None and args.attn is None
    args.models = args.models or list(MODELS)
    args.exports = args.exports or list(EXPORTS)
    args.attn = args.attn or list(ATTNS)
    if args.smoke:
        args.warmup = min(args.warmup, 2)
        args.min_time = min(args.min_time, 0.05)
        args.rounds = min(args.rounds, 2)
        if args.cache == "/tmp/mograph-gpu-cache":
            args.cache = "/tmp/mograph-gpu-cache-smoke"
    for s in args.shapes:
        Shape.parse(s)
    if args.list:
        return list_pending(args)
    return run_grid(args)


#: Rough seconds to build one cached graph of a full-size BERT-base-sized model in one ``--jobs`` worker, used by
#: ``--list`` until the cache holds measured times: measured on a shared 2-core host (BERT-base, one process per
#: step; see BENCHMARKS-GPU.md "How to run") and divided by 2.5 for the contention there. Once some graphs are
#: built, the median measured time of each (export, step) in --cache replaces these (scaled by MODEL_SCALE).
BUILD_SECONDS = {("torchscript", "fp32"): 15.0, ("dynamo", "fp32"): 18.0, ("torchscript", "exported"): 5.0,
                 ("dynamo", "exported"): 5.0, ("torchscript", "ort-t"): 16.0, ("dynamo", "ort-t"): 16.0,
                 ("dynamo", "onnxscript"): 25.0, ("torchscript", "fused"): 8.0, ("dynamo", "fused"): 10.0,
                 ("torchscript", "mograph"): 25.0, ("dynamo", "mograph"): 25.0,
                 ("torchscript", "mograph-ortfp16"): 6.0, ("dynamo", "mograph-ortfp16"): 6.0,
                 ("torchscript", "fused-lengths"): 8.0, ("dynamo", "fused-lengths"): 10.0,
                 ("torchscript", "mograph-lengths"): 25.0, ("dynamo", "mograph-lengths"): 25.0}
MODEL_SCALE = {"bert": 1.0, "gpt2": 1.2, "llama": 1.1, "vit": 0.8, "whisper": 0.8}
#: Parameters (millions) of the full-size models: the cache holds ~2 bytes a parameter per float16 variant.
PARAMS_M = {"bert": 110, "gpt2": 124, "llama": 100, "vit": 86, "whisper": 88}
#: Timing: creating and profiling one CUDA session of a graph, the float32 torch reference of a cell, and
#: torch.compile of a model at one shape (session 1 on the H200: 20-40 s).
SESSION_SECONDS, REFERENCE_SECONDS, COMPILE_SECONDS = 1.0, 0.3, 35.0
SMOKE_SCALE = 0.05


def measured_build_seconds(cache: Path) -> dict[tuple[str, str], float]:
    """Median seconds per (export, step) over the graphs already built in ``cache``, per unit of MODEL_SCALE."""
    seen: dict[tuple[str, str], list[float]] = {}
    for status_file in cache.glob("*/status.json"):
        with contextlib.suppress(OSError, ValueError):
            status = json.loads(status_file.read_text())
            model, export = status_file.parent.name.removeprefix("smoke-").split("-")[:2]
            for step, entry in status.items():
                if isinstance(entry, dict) and "seconds" in entry and not entry.get("error"):
                    seen.setdefault((export, step), []).append(entry["seconds"] / MODEL_SCALE.get(model, 1.0))
    return {k: statistics.median(v) for k, v in seen.items()}


def estimate_build(g: Graph, steps: list[str], smoke: bool,
                   measured: dict[tuple[str, str], float] | None = None) -> float:
    """Seconds to build these (missing) ``steps`` of ``g``: this graph's recorded time of a step (an
    intermediate dropped and needed again), else the cache's median for the step, else the table."""
    status = g.status()
    total = 0.0
    for step in steps:
        recorded = (status.get(step) or {}).get("seconds")
        if recorded is not None and not (status.get(step) or {}).get("error"):
            total += float(recorded)
            continue
        if measured and (g.export, step) in measured:
            total += measured[(g.export, step)] * MODEL_SCALE.get(g.model, 1.0)
            continue
        base = BUILD_SECONDS.get((g.export, step), 20.0) * MODEL_SCALE.get(g.model, 1.0)
        if g.kind == "decode":
            base *= 1.3
        total += base * (SMOKE_SCALE if smoke else 1.0)
    return total


def estimate_cell(variant: str, args: argparse.Namespace, expected_ms: float) -> float:
    """Seconds to time one variant on one cell: warm-up, the three sizing runs, then --min-time."""
    if variant == "torch-compile":
        return COMPILE_SECONDS + args.min_time
    return (args.warmup + 3) * expected_ms / 1e3 + args.min_time + 0.05


def list_pending(args: argparse.Namespace) -> int:
    """Print the cells of the selection still missing from --out, per graph, which graphs are cached, and an
    estimate of the build (CPU, spread over --jobs) and timing (GPU, one at a time) seconds still to spend."""
    dims = SMOKE if args.smoke else FULL
    done = Results(Path(args.out), args.retry_errors).done
    cache = Path(args.cache)
    shapes = [Shape.parse(s) for s in args.shapes]
    total = graphs = built = 0
    build_s: list[float] = []
    time_s = 0.0
    seen: set[str] = set()  # torch cells belong to the model, not to one export: counted once
    on_cpu = args.smoke or args.device == "cpu"
    variants = [v for v in args.variants if not (v == "torch-compile" and on_cpu and not args.compile_on_cpu)]
    expected_ms = 0.3 if args.smoke else 5.0
    measured = measured_build_seconds(cache)
    disk = 0.0
    for model in args.models:
        for kind in dict.fromkeys(k for k in (graph_kind(model, s, dims) for s in shapes) if k):
            kind_shapes = [s for s in shapes if graph_kind(model, s, dims) == kind]
            for export in args.exports:
                for attn in args.attn:
                    if args.smoke_grid and (model, export, attn) not in SMOKE_GRID:
                        continue
                    todo_pairs = [(v, s) for v in variants if v in TORCH_VARIANTS or applies(model, export, attn, v)
                                  for s in kind_shapes]
                    todo = {cell_key(*_torch_ids(model, export, attn, v), v, s.text): v for v, s in todo_pairs}
                    todo = {k: v for k, v in todo.items() if k not in done and k not in seen}
                    seen.update(todo)
                    g = graph_for(cache, args.smoke, model, export, attn, kind)
                    ready = [v for v in ["fp32", *INTERMEDIATES[1:], *ORT_VARIANTS] if g.path(v).exists()]
                    ort_todo = sorted({v for v in todo.values() if v in ORT_VARIANTS})
                    b = estimate_build(g, needed_steps(g, ort_todo), args.smoke, measured)
                    disk += sum(not g.path(v).exists() for v in ort_todo) * 2e6 * PARAMS_M.get(model, 100)
                    t = sum(estimate_cell(v, args, expected_ms) for v in todo.values())
                    t += len(ort_todo) * SESSION_SECONDS * (SMOKE_SCALE if args.smoke else 1.0)
                    t += len({k.rsplit("/", 1)[1] for k in todo}) * REFERENCE_SECONDS
                    graphs += 1
                    built += bool(ready)
                    total += len(todo)
                    if b:
                        build_s.append(b)
                    time_s += t
                    sys.stdout.write(f"{g.name}: {len(todo)} cell(s) to time (~{t:.0f} s); build ~{b:.0f} s; "
                                     f"cached: {', '.join(ready) or 'nothing'}\n")
    jobs = max(1, args.jobs)
    wall = _spread(build_s, jobs)
    sys.stdout.write(f"{total} cell(s) to time over {graphs} graph(s), {built} with something cached\n")
    sys.stdout.write(f"estimate: build ~{sum(build_s):.0f} CPU-s serial, ~{wall:.0f} s wall with --jobs {jobs}; "
                     f"timing ~{time_s:.0f} s; total ~{(wall + time_s) / 60:.1f} min (rough: BUILD_SECONDS in "
                     "tools/bench_gpu.py, --warmup/--min-time, 5 ms a run)\n")
    if not args.smoke:
        have = sum(f.stat().st_size for f in cache.glob("*/*.onnx")) if cache.exists() else 0
        sys.stdout.write(f"disk: --cache holds {have / 1e9:.1f} GB; the selection adds ~{disk / 1e9:.1f} GB of float16 "
                         "graphs (plus ~1 GB per graph being built, and 0.5 GB of weights per model and graph kind)\n")
    return 0


def _spread(seconds: list[float], jobs: int) -> float:
    """Wall time of these jobs on ``jobs`` workers, longest first (the pool's order does not matter much)."""
    lanes = [0.0] * jobs
    for s in sorted(seconds, reverse=True):
        lanes[lanes.index(min(lanes))] += s
    return max(lanes) if lanes else 0.0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
