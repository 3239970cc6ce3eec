"""The precision recipe: what ``int4`` / ``int8`` (and the explicit Q/DQ passes) become on the device the model runs on.

A quantized model is only worth writing if the device runs it faster (or, failing that, knowingly smaller).
Which lowering of a low-precision MatMul is fast differs per runtime and device, so the choice is made from a
table of **measured** kernel times (:data:`KERNELS`), never from op names:

==========================  ===============================================  ======================================
device / target             ``int4``                                         ``int8``
==========================  ===============================================  ======================================
``cuda`` (ONNX Runtime)     ``weight-only`` 4-bit (``MatMulNBits``), then    ``weight-only`` 8-bit (``MatMulNBits``),
                            ``fp16`` activations; target ``ort``             then ``fp16``; target ``ort``
``cpu`` (ONNX Runtime)      ``weight-only`` 4-bit, float32 activations       ``qdq-int8`` (today's recipe) when the
                            (today's recipe)                                 table measures it faster than
                                                                             weight-only 8-bit, else weight-only
``--target tensorrt``       ``weight-only`` (blocked ``DequantizeLinear``)   ``qdq-int8``: explicit Q/DQ, TensorRT's
                                                                             precision plan (strongly typed)
==========================  ===============================================  ======================================

How the table decides: for each precision, every lowering the device has is compared with the device's float
MatMul (float16 on CUDA, float32 on the CPU) at each measured row count ``M`` (1: decode; 512/4096 or 128:
prefill); the recipe takes the lowering with the smallest geometric-mean ratio.  A precision whose *every*
lowering is slower than float at *every* measured ``M`` (FP8 and INT8 activations on ONNX Runtime CUDA) is
still written when asked for explicitly (``--passes qdq-fp8`` / ``qdq-int8``), but never silently:
:func:`resolve` returns one line with the measured reason and the alternatives, ``optimize`` prints it and
the report records it under ``recipe``.

The output projection / LM head and embeddings are listed per device (:data:`PLACEMENT`) with the reason; the
``cuda`` recipe's 4-bit weights are blocks of 32 without zero points (:data:`LAYOUT`, measured on whole decoders).  On
``cuda`` the embedding table is block-quantized (``--embedding-precision bits``): it pays in file size, measured
(:data:`EMBEDDINGS`, with the command); its GPU speed is not measured, so no speed-up is claimed for it.

ONNX Runtime settings that change how the written graph runs (session config entries, which a model file cannot
carry) are measured too (:data:`RUNTIME_OPTIONS`): the decision text names each with where it pays and where it
costs, and mograph does not set them (``mograph bench --session-config KEY=VALUE`` measures them on a model).

Only what ``--device`` names is changed: without it the pipeline is exactly what ``--passes`` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EMBEDDINGS", "KERNELS", "LAYOUT", "PLACEMENT", "RUNTIME_OPTIONS", "WHOLE_MODELS", "Recipe", "resolve",
           "lowering_ratios", "runtime_line", "table_rows"]

#: Median wall milliseconds per run of one-node graphs ``[M, K] x [K, N]``, per lowering.  ``float`` is the
#: device's float MatMul.  Lowerings: ``nbits4`` / ``nbits8``: weight-only ``com.microsoft.MatMulNBits``
#: (block 128); ``matmulinteger``: INT8 activations (``DynamicQuantizeLinear`` + ``MatMulInteger``);
#: ``qdq_a8w8``: Q/DQ INT8 activations and weights before ``MatMul``; ``fp8_gemm``: ``GemmFloat8`` (E4M3).
KERNELS: dict[str, dict[str, Any]] = {
    "cuda": {
        "shape": "M x 4096 x 4096",
        "m": (1, 512, 4096),
        "ms": {
            "float": (0.032, 0.050, 0.217),
            "nbits4": (0.025, 0.063, 0.234),
            "nbits8": (0.023, 0.068, 0.241),
            "fp8_gemm": (0.204, 0.268, 0.422),
            "matmulinteger": (0.043, 0.182, 1.177),
            "qdq_a8w8": (0.114, 0.131, 0.352),
        },
        "kernel_ms": {  # the profiler's kernel time of the same runs (what the wall time pays for)
            "float": (0.009, 0.024, 0.204),
            "nbits4": (0.005, 0.036, 0.205),
            "nbits8": (0.008, 0.043, 0.215),
            "fp8_gemm": (0.006, 0.017, 0.116),
            "matmulinteger": (0.019, 0.145, 1.080),
            "qdq_a8w8": (0.075, 0.095, 0.310),
        },
        "source": "NVIDIA H200, ONNX Runtime 1.31.1 CUDA provider, float16 activations, IO binding, median wall ms "
                  "(kernel ms from torch.profiler); the per-kernel table of mograph issue 26",
        "command": "python tools/recipe_kernels.py --device cuda --k 4096 --n 4096 --m 1,512,4096 (onnxruntime-gpu; "
                   "the issue's figures were measured before this tool existed, with the same one-node graphs)",
    },
    "cpu": {
        "shape": "M x 2048 x 2048",
        "m": (1, 128),
        "ms": {
            "float": (0.648, 80.29),
            "nbits4": (0.320, 92.14),
            "nbits8": (91.40, 190.40),
            "matmulinteger": (0.064, 36.69),
            "qdq_a8w8": (0.090, 33.95),
        },
        "source": "2-core x86-64 development machine (shared, load average 9-12 while measured), ONNX Runtime "
                  "1.32.0 CPU, float32 activations, 2 threads, median wall ms of 30 runs, 2026-12-02; a second run "
                  "gave the same order (float 0.714 / 117.4, nbits4 0.328 / 79.8, nbits8 88.8 / 172.7, "
                  "matmulinteger 0.086 / 34.6, qdq_a8w8 0.083 / 33.8). M=1 repeats one weight, so the quantized "
                  "weights stay in cache: decode ratios are optimistic for a whole model",
        "command": "OMP_NUM_THREADS=2 python tools/recipe_kernels.py --device cpu --k 2048 --n 2048 --m 1,128 --runs 30",
    },
}

#: Which lowerings give each precision, per device kind (``fp8`` only exists through explicit passes).
LOWERINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {"int4": ("nbits4",), "int8": ("nbits8", "matmulinteger", "qdq_a8w8"), "fp8": ("fp8_gemm",)},
    "cpu": {"int4": ("nbits4",), "int8": ("nbits8", "matmulinteger", "qdq_a8w8")},
}

#: Per device: where the output projection / LM head and embedding tables go, and why.
PLACEMENT: dict[str, dict[str, tuple[str, str]]] = {
    "cuda": {
        "output_projection": (
            "float",
            "kept float16: MatMulNBits 4-bit is 0.78x float16 wall at M=1 but 1.26x at M=512 and 1.08x at M=4096 "
            "(KERNELS['cuda']), and the LM head is the layer whose 4-bit error reaches the logits unfiltered; "
            "--output-projection bits|int8 quantizes it for decode-bound use (whole 1B-class decoder, H200, CUDA "
            "graphs, head 4-bit vs float16: decode 1x512 0.966 vs 1.023 ms, decode 8x512 1.804 vs 1.775 ms, prefill "
            "1x512 4.042 vs 3.856 ms; BENCHMARKS-GPU.md session 11)",
        ),
        "embeddings": (
            "bits",
            "block-quantized like the other layers (mograph.BlockQuantizedGather -> GatherBlockQuantized, blocks "
            "along the hidden axis; shares the data of an LM head tied to it and quantized too; a BERT word table "
            "read by the fused EmbedLayerNorm too, that node expanded to its parts): size: measured "
            "(EMBEDDINGS['cuda']); GPU speed: not measured (a Gather reads M rows per call, so no speed-up is "
            "claimed); --embedding-precision float keeps the table float16",
        ),
    },
    "cpu": {
        "output_projection": ("float", "default rule of weight-only: the LM head stays float32"),
        "embeddings": ("float", "a Gather reads M rows per call: quantizing the table saves size, not time"),
    },
}

#: File sizes with the embedding table float or block-quantized (``--embedding-precision``), the reason the
#: ``cuda`` recipe quantizes it.  Size only: the GPU speed of ``GatherBlockQuantized`` is not measured.
EMBEDDINGS: dict[str, dict[str, Any]] = {
    "cuda": {
        "size": "measured",
        "gpu_speed": "not measured",
        "model": "random LLaMA, SmolLM2-135M widths (hidden 576, 9/3 heads, FFN 1536), 2 layers, vocab 49152, "
                 "TorchScript prefill export, float32 (254,918,812 bytes; the tied export holds the head as an equal "
                 "copy of the table, as TorchScript writes it); --passes int4 --target ort --algorithm rtn (float32 "
                 "elsewhere: the cuda recipe's fp16 halves the float parts too); 2-core CPU machine, 2026-12-02",
        "bytes": {  # (head, embeddings, lm head) -> bytes of the written file
            ("untied", "float", "float"): 230_677_061,
            ("untied", "bits", "float"): 134_391_027,
            ("untied", "float", "bits"): 134_290_468,
            ("untied", "bits", "bits"): 38_004_434,
            ("tied", "float", "float"): 230_677_061,
            ("tied", "bits", "float"): 134_391_027,
            ("tied", "float", "bits"): 134_290_468,
            ("tied", "bits", "bits"): 21_292_472,  # the table and the head share one copy of codes and scales
        },
        "command": "python tools/embedding_sizes.py --layers 2 --vocab 49152",
    },
}

#: Whole models through the ``cuda`` recipe against mograph's own fp16 graph (time ratio, size ratio), so the recipe's
#: line says where a precision is smaller but not faster.  Per-kernel ratios (:data:`KERNELS`) decide the lowering;
#: these say what a user gets from it.
WHOLE_MODELS: dict[str, dict[str, Any]] = {
    "cuda": {
        "int8": ["BERT-base 1x128 / 8x128 / 8x512: 1.45 / 1.39 / 1.21x fp16's time at 0.525x its size (smaller, "
                 "not faster: at M >= 128 each MatMulNBits dequantizes before a float16 GEMM; ONNX Runtime's "
                 "MatMulNBitsQuantizer 8-bit on the same fp16 graph: 1.17 / 1.15 / 1.05x at 0.714x)"],
        "int4": ["1B-class decoder, decode 1x512 as a CUDA graph: 0.75x fp16's time (0.966 vs 1.280 ms; the GenAI "
                 "builder's int4: 0.967 ms); decode 8x512: 1.35x (ONNX Runtime's batched 4-bit kernel; see "
                 "RUNTIME_OPTIONS); prefill 1x512: 1.23x with the LM head float16 (this recipe's default), 1.29x "
                 "with it 4-bit (every MatMulNBits dequantizes first, the builder's too)",
                 "BERT-base 1x128 / 8x128 / 8x512: 1.43 / 1.40 / 1.19x fp16's time at 0.300x its size"],
        "source": "NVIDIA H200, ONNX Runtime 1.31.1 CUDA, random weights, IO binding, median ms; 2026-12-03 "
                  "(BENCHMARKS-GPU.md, session 11: the quiet reruns)",
        "command": "python tools/bench_precision.py prepare|time (BERT); bash tools/gpu_llm.sh start|time (decoders)",
    },
}

#: The block layout of the 4-bit weights the ``cuda`` recipe writes (the user's ``--block-size`` / ``--symmetric``
#: win), measured on whole decoders: at M=8 ONNX Runtime's batched 4-bit kernel with zero points is the slower one.
LAYOUT: dict[str, dict[str, Any]] = {
    "cuda": {
        "block_size": 32,
        "symmetric": True,
        "reason": "4-bit blocks of 32 without zero points (MatMulFloat4BitsKernelM1<half, 32, false>, "
                  "MatMulFloat4BatchedKernel<half, 32, false, 8, 2>): against blocks of 128 with zero points, "
                  "SmolLM2-135M shape as CUDA graphs: decode 1x512 1.180 vs 1.275 ms, decode 8x512 1.471 vs 1.543 "
                  "ms, prefill 1x512 2.136 vs 2.187 ms (ONNX Runtime GenAI's int4: 1.181 / 1.454 / 2.107 ms)",
        "source": "NVIDIA H200, ONNX Runtime 1.31.1 CUDA provider, random-weight LlamaForCausalLM, IO binding, "
                  "median ms; BENCHMARKS-GPU.md session 9 lease 2 (benchmarks/llm-h200-session9b.jsonl)",
        "command": "python3 tools/bench_llm.py time --models smollm --cells decode:1x512,decode:8x512,1x512 "
                   "--variant 'mograph-ts-int4b32s-shared=ts:cleanup,fuse,int4:--target ort --device cuda "
                   "--fp16-io yes --kv-cache shared --block-size 32 --symmetric yes' (and the same without the last two)",
    },
}

#: ONNX Runtime settings that change how the written graph runs, measured; mograph cannot store them in the model (they
#: are session config entries of whoever runs it), so the recipe reports them with the figures instead of setting them.
RUNTIME_OPTIONS: dict[str, dict[str, dict[str, Any]]] = {
    "cuda": {
        "fpa_intb": {
            "session_config": {"ep.cuda.fpa_intb_gemm": "1"},
            "default": "off (onnxruntime-gpu 1.31)",
            "what": "ONNX Runtime's CUTLASS weight-only GEMM and GEMV for MatMulNBits (fpA_intB)",
            "eligible": "float16 activations, 4 or 8 bits, blocks of 32 without zero points and without a bias input, "
                        "N a multiple of 64 (4-bit) or 32 (8-bit): the cuda recipe's 4-bit layout (LAYOUT); its 8-bit "
                        "layout with --block-size 32 --symmetric yes",
            "kernel_ms": {  # median wall ms, M x 4096 x 4096
                "m": (1, 8, 512, 4096),
                "float": (0.0327, 0.0320, 0.0493, 0.2199),
                "nbits4_b32": (0.0206, 0.0291, 0.0566, 0.2139),
                "nbits4_b32+fpa": (0.0201, 0.0224, 0.0840, 0.4300),
                "nbits8_b32": (0.0261, 0.0422, 0.0628, 0.2114),
                "nbits8_b32+fpa": (0.0195, 0.0237, 0.0856, 0.3998),
            },
            "whole_models": [
                "1B-class decoder int4 as CUDA graphs: decode 8x512 1.846 -> 1.388 ms (fp16 1.381), decode 1x512 "
                "0.977 -> 1.239 ms, prefill 1x512 4.042 -> 5.310 ms",
                "Qwen2.5-0.5B shape int4, CUDA graphs: decode 8x512 1.887 -> 1.542 ms (fp16 1.479), decode 1x512 "
                "1.340 -> 1.456 ms, prefill 1x512 2.920 -> 3.903 ms",
                "BERT-base int4 (quiet run): 1x128 1.382 -> 1.175 ms, 8x512 2.885 -> 3.963 ms (fp16 0.967 / 2.430)",
            ],
            "advice": "faster only for a few rows per call (batched decode, M about 2-64), slower at M=1 in whole "
                      "decoders and 1.5-2x slower in prefill (M >= 512): set it only in a session that runs batched "
                      "decode steps",
            "source": "NVIDIA H200, ONNX Runtime 1.31.1 CUDA provider, IO binding, median ms; 2026-12-03 "
                      "(BENCHMARKS-GPU.md, session 11; builds ran on the CPU during the kernel table)",
            "command": "python tools/recipe_kernels.py --device cuda --k 4096 --n 4096 --m 1,8,512,4096 --runs 50 --fpa; "
                       "bench_llm.py / bench_precision.py variants NAME+fpa=same:NAME:ep.cuda.fpa_intb_gemm=1",
        },
    },
}


def runtime_line(device: str) -> str:
    """One sentence per measured runtime option of ``device`` for the recipe's decision text ('' if none)."""
    parts = []
    for opt in RUNTIME_OPTIONS.get(device, {}).values():
        cfg = ", ".join(f"{k}={v}" for k, v in opt["session_config"].items())
        parts.append(f"runtime option not set by mograph: {opt['what']} (session config {cfg}, default "
                     f"{opt['default']}): {opt['advice']}; measured: {opt['whole_models'][0]}")
    return "; ".join(parts)


_FLOAT_BASELINE = {"cuda": "float16", "cpu": "float32"}
_NAMES = {"nbits4": "MatMulNBits 4-bit", "nbits8": "MatMulNBits 8-bit", "fp8_gemm": "GemmFloat8 (E4M3)",
          "matmulinteger": "MatMulInteger (INT8 activations)", "qdq_a8w8": "Q/DQ A8W8 -> MatMul"}


def lowering_ratios(device: str, lowering: str) -> tuple[float, ...]:
    """Wall-time ratio of ``lowering`` to the device's float MatMul at each measured ``M``."""
    table = KERNELS[device]["ms"]
    return tuple(round(x / f, 3) for x, f in zip(table[lowering], table["float"]))


def _geomean(values: tuple[float, ...]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def best_lowering(device: str, precision: str) -> tuple[str, tuple[float, ...]]:
    """The fastest lowering of ``precision`` on ``device`` (smallest geometric-mean ratio to float)."""
    options = [lw for lw in LOWERINGS[device].get(precision, ()) if lw in KERNELS[device]["ms"]]
    best = min(options, key=lambda lw: _geomean(lowering_ratios(device, lw)))
    return best, lowering_ratios(device, best)


#: The lowerings an explicit Q/DQ pass can end up as (ONNX Runtime fuses Q/DQ around MatMul its own way).
PASS_LOWERINGS: dict[str, tuple[str, ...]] = {"qdq-int8": ("matmulinteger", "qdq_a8w8"), "qdq-fp8": ("fp8_gemm",)}


def _slower_everywhere(device: str, lowerings: tuple[str, ...]) -> bool:
    """Every one of ``lowerings`` measured slower than float at every ``M`` on ``device``."""
    have = [lw for lw in lowerings if lw in KERNELS[device]["ms"]]
    return bool(have) and all(min(lowering_ratios(device, lw)) > 1.0 for lw in have)


def _figures(device: str, lowering: str) -> str:
    t = KERNELS[device]
    pairs = ", ".join(f"M={m}: {x:g} vs {f:g} ms" for m, x, f in zip(t["m"], t["ms"][lowering], t["ms"]["float"]))
    return f"{_NAMES[lowering]} {pairs} ({_FLOAT_BASELINE[device]}, {t['shape']})"


@dataclass
class Recipe:
    """A resolved pipeline: the pass list to expand, the options, and what was decided (for the report)."""

    passes: list[str]
    options: dict[str, Any]
    device: str
    decisions: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "passes": list(self.passes), "decisions": self.decisions,
                "warnings": self.warnings, "placement": {k: {"precision": p, "reason": r}
                                                         for k, (p, r) in PLACEMENT[self.device].items()},
                "table": {"source": KERNELS[self.device]["source"], "command": KERNELS[self.device]["command"]},
                **({"runtime_options": RUNTIME_OPTIONS[self.device]} if self.device in RUNTIME_OPTIONS else {}),
                **({"layout": {k: self.options[k] for k in ("block_size", "symmetric")}
                    | {"reason": LAYOUT[self.device]["reason"]}}
                   if self.device in LAYOUT and self.options.get("block_size") is not None else {})}


def device_kind(device: str) -> str:
    kind = device.split(":", 1)[0].strip().lower()
    if kind not in KERNELS:
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")
    return kind


def resolve(names: list[str], options: dict[str, Any], device: str) -> Recipe:
    """Rewrite the user's pass list ``names`` (before preset expansion) for ``device``.

    ``int4`` and ``int8`` become the device's fastest form (module docstring); ``qdq-int8`` and ``qdq-fp8``
    named explicitly stay, with a warning when every lowering of their precision is measured slower than
    float on the device.  ``options`` is copied and completed (``target``, ``bits``); options the user gave
    are never overridden, except that two presets wanting different ``--bits`` in one list is an error.
    """
    kind = device_kind(device)
    target = options.get("target")
    out_opts = dict(options)
    recipe = Recipe([], out_opts, kind)
    tensorrt = target == "tensorrt"
    onto_ort = kind == "cuda" and not tensorrt
    bits_wanted: set[int] = set()
    for name in names:
        if name in ("int4", "int8") and onto_ort:
            bits = 4 if name == "int4" else 8
            bits_wanted.add(bits)
            lowering, ratios = best_lowering(kind, name)
            recipe.passes += ["weight-only", "fp16"]
            text = (f"{name} on ONNX Runtime CUDA: weight-only {bits}-bit MatMulNBits with float16 activations "
                    f"(weight-only, then fp16); {_figures(kind, lowering)}")
            if name == "int8":
                slow = [lw for lw in LOWERINGS[kind]["int8"] if lw != lowering]
                text += "; INT8 activations not used: " + "; ".join(_figures(kind, lw) for lw in slow)
            models = WHOLE_MODELS.get(kind, {}).get(name, [])
            if models:
                text += "; whole models measured: " + "; ".join(models)
            if runtime_line(kind):
                text += "; " + runtime_line(kind)
            recipe.decisions.append({"precision": name, "lowering": lowering, "ratios_to_float": ratios,
                                     "passes": ["weight-only", "fp16"], "reason": text, "whole_models": models})
        elif name == "int8" and kind == "cpu" and not tensorrt:
            lowering, ratios = best_lowering(kind, "int8")
            chosen = ["weight-only"] if lowering.startswith("nbits") else ["qdq-int8"]
            if chosen == ["weight-only"]:
                bits_wanted.add(8)
            recipe.passes += chosen
            recipe.decisions.append({"precision": name, "lowering": lowering, "ratios_to_float": ratios,
                                     "passes": chosen, "reason": f"int8 on ONNX Runtime CPU: {_figures(kind, lowering)}"})
        elif name in ("int4", "int8"):
            recipe.passes.append(name)
            why = ("explicit Q/DQ, TensorRT's precision plan" if tensorrt and name == "int8"
                   else "today's recipe (weight-only, float32 activations)")
            lowering, ratios = best_lowering(kind, name)
            recipe.decisions.append({"precision": name, "lowering": lowering if not tensorrt else "tensorrt",
                                     "ratios_to_float": ratios if not tensorrt else None, "passes": [name],
                                     "reason": f"{name} on {'TensorRT' if tensorrt else kind}: {why}"
                                     + ("" if tensorrt else f"; {_figures(kind, lowering)}")})
        else:
            recipe.passes.append(name)
            lws = PASS_LOWERINGS.get(name, ())
            if lws and onto_ort and _slower_everywhere(kind, lws):
                recipe.warnings.append(
                    f"{name} on ONNX Runtime CUDA is measured slower than float16 at every size: "
                    + "; ".join(_figures(kind, lw) for lw in lws)
                    + "; alternatives: --passes int4 or int8 with --device cuda (weight-only MatMulNBits + fp16), "
                    "or --target tensorrt for explicit Q/DQ")
    if len(bits_wanted) > 1:
        raise ValueError("int4 and int8 in one pipeline for one device: the weight-only pass takes one --bits")
    if bits_wanted:
        bits = bits_wanted.pop()
        if out_opts.get("bits") is not None and int(out_opts["bits"]) != bits:
            raise ValueError(f"--bits {out_opts['bits']} contradicts the preset's {bits} bits")
        out_opts["bits"] = bits
    if onto_ort and target is None and any(d["passes"] != [d["precision"]] for d in recipe.decisions):
        out_opts["target"] = "ort"  # MatMulNBits is ONNX Runtime's op
    if kind == "cuda" and not tensorrt and out_opts.get("output_projection") is None and "weight-only" in recipe.passes:
        out_opts["output_projection"] = PLACEMENT["cuda"]["output_projection"][0]
    if kind == "cuda" and not tensorrt and out_opts.get("embedding_precision") is None and "weight-only" in recipe.passes:
        out_opts["embedding_precision"] = PLACEMENT["cuda"]["embeddings"][0]
    if kind == "cuda" and not tensorrt and out_opts.get("bits") == 4 and "weight-only" in recipe.passes:
        for key in ("block_size", "symmetric"):
            if out_opts.get(key) is None:
                out_opts[key] = LAYOUT["cuda"][key]
    return recipe


def table_rows() -> list[tuple[str, str, str, str]]:
    """``(device, precision, passes, reason)`` for the README / ``--help`` table, from the data above."""
    rows = []
    for device in ("cuda", "cpu"):
        for precision in ("int4", "int8"):
            r = resolve([precision], {}, device)
            rows.append((device, precision, ",".join(r.passes), r.decisions[0]["reason"]))
    return rows
