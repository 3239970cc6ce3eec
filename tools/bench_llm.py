"""LLM decoders on the GPU: mograph's graphs against ONNX Runtime GenAI's model builder, in one run.

Issue 25 item 4 and issue 26 item 3. Everything is built from seeded random weights in code (nothing is
downloaded), one harness feeds every graph the same tokens, and every cell of one run is timed in interleaved
rounds so drift hits all variants alike.

* **models** (``--models``): ``smollm`` (SmolLM2-135M shape: 30 layers, hidden 576, 9/3 heads, FFN 1536,
  vocab 49152), ``1b`` (1B class: 16 layers, hidden 2048, 32/8 heads, FFN 8192, vocab 128256), ``qwen``
  (Qwen2.5-0.5B shape, ``Qwen2ForCausalLM``: 24 layers, hidden 896, 14/2 heads, FFN 4864, QKV biases), and
  ``tiny`` / ``tiny-qwen`` (2 layers, hidden 64: the CPU smoke tests). Each is saved as a Hugging Face
  folder (safetensors and a word-level tokenizer) so the builder runs on it offline.
* **graphs**: ``builder-fp16`` / ``builder-int4`` (``python -m onnxruntime_genai.models.builder -p fp16|int4
  -e cuda``); the exports ``ts`` (``torch.onnx.export(dynamo=False)``, opset 17) and ``dynamo`` (opset 18) of
  ``*ForCausalLM`` (prefill: ``input_ids, attention_mask -> logits, present_*``; decode: ``input_ids,
  attention_mask, past_* -> logits, present_*``), each through mograph: ``mograph-<exp>`` (``--variant`` specs
  below; default ``cleanup,fuse,fp16 --target ort``), so a variant is a pipeline, not code. ``ts-pos`` /
  ``dynamo-pos`` are the same exports taking ``position_ids`` ``[B, S]`` as a third input, as optimum's do
  (``models/decoder_export.py``); the harness feeds each new token's position (the mask's ones before it).
* **cells**: prefill ``BxS`` (no past) and decode ``decode:BxP`` (one token over a past of P), each ``plain``
  (IO binding, outputs on the device, present grown by the graph) and ``graph`` (``enable_cuda_graph``; the
  past/present share one static buffer of ``P + 64`` positions per layer and the mask is that long, zeros after
  the valid tokens, as ONNX Runtime GenAI binds it, where the graph takes past in that form; else the cell
  says why it cannot be captured).
* **accuracy**: logits of a 16-token prefill against the torch float32 model on the same device (cosine, max
  abs, argmax agreement), and a 64-step greedy loop (through the shared buffer where the graph allows) against
  torch's greedy tokens (the number of steps before the first different token).

A variant spec is ``NAME=EXPORT:PASSES[:EXTRA CLI ARGS]``, e.g. ``mograph-ts=ts:cleanup,fuse,fp16:--target ort``
or ``mograph-ts-shared=ts:cleanup,fuse,fp16:--target ort --kv-cache shared``; mograph runs as
``python -m mograph optimize`` on the export of the cell's kind (prefill or decode graph).  A spec
``NAME=from:VARIANT:nbits4|nbits8[:block=K,sym,acc=N]`` is ONNX Runtime's ``MatMulNBitsQuantizer`` (RTN; block
128 and asymmetric unless given) on the graphs of another ``ts``/``dynamo`` variant of the run (every MatMul with
a constant weight, the LM head too), e.g. ``ort-int4-b32=from:mograph-ts-shared:nbits4:block=32,sym`` (the
builder's ``-p int4`` blocks) or ``ort-int4-b128=from:mograph-ts-shared:nbits4``: with ``--jobs`` it waits for
that variant's graph.  A spec ``NAME=same:VARIANT:KEY=VALUE[,...]`` times the graphs of another variant (or of
``builder-fp16`` / ``builder-int4``) with ONNX Runtime session config entries, built by nothing, e.g.
``builder-int4+fpa=same:builder-int4:ep.cuda.fpa_intb_gemm=1`` (ONNX Runtime's CUTLASS weight-only GEMM/GEMV for
``MatMulNBits``, off by default).  Names holding ``int4`` or ``nbits4`` are compared with ``builder-int4`` in
``markdown`` (a name ``X+SUFFIX`` with ``builder-int4+SUFFIX`` where the run has it).

Usage (the H200, with onnxruntime-gpu and onnxruntime-genai installed there; the device has no network, so their
wheels are carried over by a script kept outside this repository)::

    python tools/bench_llm.py prepare --models smollm --cache /tmp/llm          # HF folder, builder, exports, mograph
    python tools/bench_llm.py time --models smollm --cache /tmp/llm --out r.jsonl
    python tools/bench_llm.py markdown --out r.jsonl
    S="--target ort --fp16-io yes --kv-cache shared"; V=(--variant "mograph-ts-shared=ts:cleanup,fuse,fp16:$S" \\
        --variant "mograph-ts-int4-shared=ts:cleanup,fuse,int4:$S --device cuda" \\
        --variant "mograph-ts-int8-shared=ts:cleanup,fuse,int8:$S --device cuda" \\
        --variant "ort-int4-b32=from:mograph-ts-shared:nbits4:block=32,sym" \\
        --variant "ort-int4-b128=from:mograph-ts-shared:nbits4" --variant "ort-nbits8=from:mograph-ts-shared:nbits8")
    python tools/bench_llm.py prepare --models smollm,1b --cache /tmp/llm --jobs 4 "${V[@]}"
    python tools/bench_llm.py time --models smollm,1b --cache /tmp/llm --out r.jsonl "${V[@]}"
    python tools/bench_llm.py prepare --models tiny --cache /tmp/llm --device cpu && \\
        python tools/bench_llm.py time --models tiny --cache /tmp/llm --device cpu --out /tmp/r.jsonl  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import cosine, cuda_kernels, time_runners  # noqa: E402


@dataclass(frozen=True)
class Spec:
    arch: str
    layers: int
    hidden: int
    heads: int
    kv: int
    ffn: int
    vocab: int
    theta: float = 10000.0
    head_dim: int = 0  # 0: hidden // heads
    window: int = 0  # gemma3: the sliding layers' window

    @property
    def head(self) -> int:
        return self.head_dim or self.hidden // self.heads


MODELS = {
    "smollm": Spec("llama", 30, 576, 9, 3, 1536, 49152, 100000.0),
    "1b": Spec("llama", 16, 2048, 32, 8, 8192, 128256, 500000.0),
    "qwen": Spec("qwen2", 24, 896, 14, 2, 4864, 151936, 1000000.0),
    "tiny": Spec("llama", 2, 64, 4, 2, 128, 1000, 10000.0),
    "tiny-qwen": Spec("qwen2", 2, 64, 4, 2, 128, 1000, 1000000.0),
    # Qwen3-0.6B's shape (q_norm / k_norm on each head before the rotary; head_dim 128 apart from hidden / heads)
    "qwen3": Spec("qwen3", 28, 1024, 16, 8, 3072, 151936, 1000000.0, head_dim=128),
    # Gemma 3 270M's shape (5 sliding-window layers of 512 to each global one, head_dim 256, one KV head)
    "gemma3": Spec("gemma3", 18, 640, 4, 1, 2048, 262144, 1000000.0, head_dim=256, window=512),
    "tiny-qwen3": Spec("qwen3", 2, 64, 4, 2, 128, 1000, 1000000.0, head_dim=32),
    "tiny-gemma3": Spec("gemma3", 2, 64, 4, 1, 128, 1000, 1000000.0, head_dim=32, window=8),
}
#: the transformers config class of each ``Spec.arch``
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma3": "Gemma3TextConfig"}
DEFAULT_VARIANTS = [
    "mograph-ts=ts:cleanup,fuse,fp16:--target ort --fp16-io yes --mask-format lengths",
    "mograph-ts-shared=ts:cleanup,fuse,fp16:--target ort --fp16-io yes --kv-cache shared",
    "mograph-dynamo-shared=dynamo:cleanup,fuse,fp16:--target ort --fp16-io yes --kv-cache shared",
    "mograph-ts-int4-shared=ts:cleanup,fuse,int4:--target ort --device cuda --fp16-io yes --kv-cache shared",
    "mograph-ts-int4h-shared=ts:cleanup,fuse,int4:--target ort --device cuda --fp16-io yes --kv-cache shared "
    "--output-projection bits",
]
#: the exports a variant starts from: ``-pos`` ones take ``position_ids`` ``[B, S]`` as their third input (as optimum's
#: exports do; made by ``models/decoder_export.py``, its ``past_key_values.i.key`` / ``present.i.key`` names)
EXPORTS = ("ts", "dynamo", "ts-pos", "dynamo-pos")
CELLS = ["1x512", "8x512", "decode:1x512", "decode:8x512"]
PROMPT, STEPS = 16, 64


def log(msg: str) -> None:
    sys.stderr.write(f"[bench_llm {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# -- building ---------------------------------------------------------------------------------------------


def hf_module(spec: Spec, seed: int = 0) -> Any:
    import torch
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv,
                  max_position_embeddings=4096, rope_theta=spec.theta, tie_word_embeddings=True,
                  attn_implementation="eager")
    if spec.head_dim:
        common["head_dim"] = spec.head_dim
    if spec.arch == "gemma3":  # every 6th layer global, the others a sliding window (Gemma 3's pattern)
        common.update(sliding_window=spec.window, query_pre_attn_scalar=spec.head,
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                   for i in range(spec.layers)])
    cfg = getattr(T, CONFIGS[spec.arch])(**common)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, as trained weights have
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def save_hf(spec: Spec, out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = hf_module(spec)
    model.save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(spec.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(out)


def run_builder(hf: Path, out: Path, precision: str, cache: Path, ep: str = "cuda") -> None:
    import importlib.util

    found = importlib.util.find_spec("onnxruntime_genai")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError("onnxruntime-genai is not installed")
    script = Path(list(found.submodule_search_locations)[0]) / "models" / "builder.py"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, str(script), "-i", str(hf), "-o", str(out), "-p", precision, "-e", ep, "-c", str(cache)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode or not (out / "model.onnx").exists():
        raise RuntimeError(f"builder -p {precision} failed: {done.stderr[-1500:]}")


def wrappers(model: Any, layers: int) -> tuple[Any, Any]:
    import torch
    import transformers as T

    def flat(cache: Any) -> list[Any]:
        if hasattr(cache, "layers"):
            return [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return [t for i in range(len(cache.key_cache)) for t in (cache.key_cache[i], cache.value_cache[i])]

    class Prefill(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            # a cache without the config: every layer keeps every key (Gemma 3's sliding layers would keep only
            # the last window-1 keys as their present; the graphs here keep all, their masks apply the window)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=T.DynamicCache(),
                         use_cache=True)
            return (out.logits, *flat(out.past_key_values))

    class Decode(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> Any:
            cache = T.DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            return (out.logits, *flat(out.past_key_values))

    return Prefill().eval(), Decode().eval()


def export_position_ids(spec: Spec, hf: Path, exporter: str, kind: str, out: Path) -> None:
    """The ``ts-pos`` / ``dynamo-pos`` exports: ``models/decoder_export.py`` on the folder's weights, with
    ``position_ids``; calibration feeds like :func:`export`'s."""
    import transformers as T

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.append(root)  # appended: the installed mograph keeps precedence over the source tree
    from models import decoder_export as de

    cfg = T.AutoConfig.from_pretrained(str(hf), local_files_only=True)
    cfg._attn_implementation = "sdpa"
    out.parent.mkdir(parents=True, exist_ok=True)
    de.export(cfg, kind, "torchscript" if exporter == "ts-pos" else "dynamo", out, hf_dir=hf, position_ids=True)
    feeds = de.feeds(cfg, kind, batch=2, seq=16 if kind == "prefill" else 1, past=16, seed=3, position_ids=True)
    for name in feeds:
        if name.startswith("past"):
            feeds[name] = (0.5 * feeds[name]).astype(np.float32)
    np.savez(out.parent / "calibration.npz", **feeds)


def export(spec: Spec, hf: Path, exporter: str, kind: str, out: Path) -> None:
    if exporter.endswith("-pos"):
        export_position_ids(spec, hf, exporter, kind, out)
        return
    import torch
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager", dtype=torch.float32).eval()
    prefill, decode = wrappers(model, spec.layers)
    b, s, p = 2, 8, 8
    present = [f"present_{i}_{kv}" for i in range(spec.layers) for kv in ("key", "value")]
    past = [f"past_{i}_{kv}" for i in range(spec.layers) for kv in ("key", "value")]
    # a decode step is traced with 3 new tokens: with 1, dynamo specializes the token dim to 1 and spells the
    # positions differently (mograph's rotary proof does not accept that spelling yet); the graph runs S=1 fine
    new = 3
    ids = torch.randint(0, spec.vocab, (b, s if kind == "prefill" else new))
    if kind == "prefill":
        mod, args, names = prefill, (ids, torch.ones(b, s, dtype=torch.int64)), ["input_ids", "attention_mask"]
        axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                "logits": {0: "batch", 1: "seq"}, **{n: {0: "batch", 2: "seq"} for n in present}}
    else:
        pv = [torch.randn(b, spec.kv, p, spec.head) for _ in past]
        mod, args = decode, (ids, torch.ones(b, p + new, dtype=torch.int64), *pv)
        names = ["input_ids", "attention_mask", *past]
        axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                "logits": {0: "batch", 1: "seq"},
                **{n: {0: "batch", 2: "past"} for n in past}, **{n: {0: "batch", 2: "total"} for n in present}}
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if exporter == "ts":
            torch.onnx.export(mod, args, str(out), input_names=names, output_names=["logits", *present],
                              dynamic_axes=axes, opset_version=17, dynamo=False)
        else:
            dyn = torch.export.Dim.DYNAMIC
            shapes: Any = ({0: dyn, 1: dyn}, {0: dyn, 1: dyn}) if kind == "prefill" else (
                {0: dyn, 1: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in past))
            prog = torch.onnx.export(mod, args, input_names=names, output_names=["logits", *present],
                                     dynamic_shapes=shapes, opset_version=18, dynamo=True)
            prog.save(str(out), external_data=True)
    # calibration feeds for mograph's fp16/int4 passes: seeded tokens, one feed of batch 2
    rng = np.random.default_rng(3)
    feeds = {"input_ids": rng.integers(0, spec.vocab, (2, 16 if kind == "prefill" else 1))}
    if kind == "prefill":
        feeds["attention_mask"] = np.ones((2, 16), np.int64)
    else:
        feeds["attention_mask"] = np.ones((2, 17), np.int64)
        for n in past:
            feeds[n] = (0.5 * rng.standard_normal((2, spec.kv, 16, spec.head))).astype(np.float32)
    np.savez(out.parent / "calibration.npz", **feeds)


_JOB_ENV: dict[str, str] = {}  # set by ``prepare --jobs``: the threads each mograph run may use


def run_mograph(src: Path, out: Path, passes: str, extra: str) -> None:
    cmd = [sys.executable, "-m", "mograph", "optimize", str(src), "-o", str(out), "--passes", passes, *extra.split()]
    if "--calibration" not in extra:
        cmd += ["--calibration-data", str(src.parent / "calibration.npz")]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(out.parent), env=_JOB_ENV or None)
    if done.returncode:
        raise RuntimeError(f"mograph exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
    log(f"  {out.name}: {time.perf_counter() - t:.1f} s")


def parse_nbits(text: str) -> dict[str, Any]:
    """``nbits4|nbits8[:block=K,sym,acc=N]`` -> ``{"bits", "block", "symmetric", "accuracy_level"}``
    (defaults: block 128, asymmetric, no accuracy level)."""
    head, _, opts = text.partition(":")
    m = re.fullmatch(r"nbits([248])", head)
    if not m:
        raise ValueError(f"expected nbits4|nbits8[:block=K,sym,acc=N], got {text!r}")
    out: dict[str, Any] = {"bits": int(m.group(1)), "block": 128, "symmetric": False, "accuracy_level": None}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if key == "block" and value.isdigit():
            out["block"] = int(value)
        elif key == "sym" and not value:
            out["symmetric"] = True
        elif key == "acc" and value.isdigit():
            out["accuracy_level"] = int(value)
        else:
            raise ValueError(f"unknown nbits option {opt!r} in {text!r}")
    return out


def ort_nbits(src: Path, out: Path, bits: int, block: int, symmetric: bool = False,
              accuracy_level: int | None = None) -> None:
    """ONNX Runtime's ``MatMulNBitsQuantizer`` (RTN, the default weight-only config) on the graph ``src``: every
    MatMul with a constant weight becomes ``com.microsoft.MatMulNBits`` of ``bits`` bits, blocks of ``block``
    along K, float16 scales where the weights were float16; written with its weights as external data."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    t = time.perf_counter()
    model = onnx.load(str(src))
    quant = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=symmetric,
                                 accuracy_level=accuracy_level)
    quant.process()
    n = sum(node.op_type == "MatMulNBits" for node in quant.model.model.graph.node)
    if not n:
        raise RuntimeError(f"MatMulNBitsQuantizer made no MatMulNBits node in {src}")
    out.parent.mkdir(parents=True, exist_ok=True)
    quant.model.save_model_to_file(str(out), use_external_data_format=True)
    log(f"  {out.parent.name}: {n} MatMulNBits ({bits}-bit, block {block}) in {time.perf_counter() - t:.1f} s")


def parse_variant(text: str) -> tuple[str, str, str, str]:
    """``NAME=ts|dynamo:PASSES[:ARGS]`` -> (name, export, passes, args); ``NAME=from:BASE:nbitsB[:OPTS]`` (ONNX
    Runtime's MatMulNBitsQuantizer on the graphs of the variant BASE, see :func:`parse_nbits`) -> (name, "from",
    BASE, "nbitsB[:OPTS]")."""
    name, _, body = text.partition("=")
    exp, _, rest = body.partition(":")
    passes, _, extra = rest.partition(":")
    if name and exp == "same" and passes:
        try:
            parse_config(extra)
        except ValueError as exc:
            raise SystemExit(f"bench_llm: bad --variant {text!r}: {exc}") from None
        return name, exp, passes, extra
    if name and exp == "from" and passes:
        try:
            parse_nbits(extra)
        except ValueError as exc:
            raise SystemExit(f"bench_llm: bad --variant {text!r}: {exc}") from None
        return name, exp, passes, extra
    if not (name and exp in EXPORTS and passes):
        raise SystemExit(f"bench_llm: bad --variant {text!r}: expected NAME=ts|dynamo|ts-pos|dynamo-pos:PASSES[:ARGS], "
                         "NAME=from:VARIANT:nbits4|nbits8[:block=K,sym,acc=N] or NAME=same:VARIANT:KEY=VALUE[,...]")
    return name, exp, passes, extra


def parse_config(text: str) -> dict[str, str]:
    """``KEY=VALUE[,KEY=VALUE]`` -> ONNX Runtime session config entries (``SessionOptions.add_session_config_entry``)."""
    entries = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not (key and eq):
            raise ValueError(f"session config entry {item!r}: expected KEY=VALUE")
        entries[key.strip()] = value.strip()
    if not entries:
        raise ValueError("a same: variant needs at least one session config entry KEY=VALUE")
    return entries


def _variant_base(args: argparse.Namespace, dirname: str) -> str:
    """``NAME-KIND`` of a ``from:`` variant -> ``BASE-KIND`` (the folder of the graph it quantizes); else ''."""
    for v in args.variant:
        vname, exp, base, _ = parse_variant(v)
        for kind in ("prefill", "decode"):
            if exp == "from" and dirname == f"{vname}-{kind}":
                return f"{base}-{kind}"
    return ""


def _drop_when_done(folder: Path, futures: list[Any]) -> None:
    """Delete ``folder`` (an export) once every future reading it is done (``prepare --drop-exports``)."""
    import shutil
    import threading

    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                shutil.rmtree(folder, ignore_errors=True)
                log(f"dropped {folder.parent.name}/{folder.name}")

    for f in futures:
        f.add_done_callback(done)


def _after(base: Any, name: str, target: Path, make: Any, retry: bool) -> bool:
    """:func:`_step` once the future ``base`` (the step it reads, submitted earlier to the same pool) is done."""
    if base is not None:
        base.result()
    return _step(name, target, make, retry)


def _variant_export(args: argparse.Namespace, dirname: str) -> str:
    """``NAME-KIND`` (a variant's output folder) -> ``EXP-KIND`` (the export folder it is made from)."""
    for v in args.variant:
        vname, exp, _, _ = parse_variant(v)
        for kind in ("prefill", "decode"):
            if exp != "from" and dirname == f"{vname}-{kind}":
                return f"{exp}-{kind}"
    return ""


def _step(name: str, target: Path, make: Any, retry: bool) -> bool:
    """Build one cached artefact unless it is there (or failed before and ``retry`` is off); False if it failed."""
    if target.exists():
        return True
    err = target.parent / "FAILED"
    if err.exists() and not retry:
        return True
    log(f"{name}: building {target.parent.name}")
    t = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        make()
        err.unlink(missing_ok=True)
        log(f"{name}: {target.parent.name} done in {time.perf_counter() - t:.1f} s")
        return True
    except Exception as exc:  # noqa: BLE001
        err.write_text(f"{type(exc).__name__}: {exc}"[-3000:])
        log(f"{name}: {target.parent.name} FAILED: {str(exc)[-600:]}")
        if target.name == "model.onnx" and target.exists():
            target.unlink()
        return False


def prepare(args: argparse.Namespace) -> int:
    root = Path(args.cache)
    failed = 0
    for name in args.models.split(","):
        spec, d = MODELS[name], root / name
        steps: list[tuple[Path, Any]] = [(d / "hf" / "config.json", lambda d=d, spec=spec: save_hf(spec, d / "hf"))]
        if not args.no_builder:
            for prec in args.builder_precisions.split(","):
                steps.append((d / f"builder-{prec}" / "model.onnx",
                              lambda d=d, prec=prec: run_builder(d / "hf", d / f"builder-{prec}", prec, d / "hfcache",
                                                                 args.builder_ep)))
        exps = {parse_variant(v)[1] for v in args.variant} - {"from", "same"}
        bases = {parse_variant(v)[0]: parse_variant(v)[1] for v in args.variant}
        for v in args.variant:
            vname, exp, base, _ = parse_variant(v)
            if exp == "same" and bases.get(base) is None and not base.startswith("builder-"):
                raise SystemExit(f"bench_llm: --variant {vname}: same:{base} is not a --variant or builder graph of this run")
            if exp == "from" and bases.get(base) not in EXPORTS:
                raise SystemExit(f"bench_llm: --variant {vname}: from:{base} is not a ts/dynamo(-pos) --variant of this run")
        for exp in sorted(exps):
            for kind in ("prefill", "decode"):
                steps.append((d / f"export-{exp}-{kind}" / "model.onnx",
                              lambda d=d, exp=exp, kind=kind, spec=spec: export(
                                  spec, d / "hf", exp, kind, d / f"export-{exp}-{kind}" / "model.onnx")))
        for v in args.variant:
            vname, exp, passes, extra = parse_variant(v)
            for kind in ("prefill", "decode"):
                if exp in ("from", "same"):
                    continue
                steps.append((d / f"{vname}-{kind}" / "model.onnx",
                              lambda d=d, exp=exp, kind=kind, vname=vname, passes=passes, extra=extra: run_mograph(
                                  d / f"export-{exp}-{kind}" / "model.onnx", d / f"{vname}-{kind}" / "model.onnx",
                                  passes, extra)))
        for v in args.variant:  # after every variant they may read
            vname, exp, base, extra = parse_variant(v)
            for kind in ("prefill", "decode"):
                if exp == "from":
                    steps.append((d / f"{vname}-{kind}" / "model.onnx",
                                  lambda d=d, kind=kind, vname=vname, base=base, extra=extra: ort_nbits(
                                      d / f"{base}-{kind}" / "model.onnx", d / f"{vname}-{kind}" / "model.onnx",
                                      **parse_nbits(extra))))
        if args.jobs <= 1:
            failed += sum(not _step(name, t, m, args.retry) for t, m in steps)
            continue
        # --jobs N: the HF folder and the exports run here, one after another (torch in this process); the
        # builders (one after another: they share a cache folder) and mograph's runs are subprocesses, run N at a
        # time, each variant as soon as its export is there
        from concurrent.futures import ThreadPoolExecutor

        # N runs side by side must share the cores: each ONNX Runtime session (MOGRAPH_ORT_THREADS) and BLAS
        # pool gets cores / N threads, else N x cores threads thrash (seen on the H200: 5-10x slower builds)
        share = str(max(1, len(os.sched_getaffinity(0)) // args.jobs))
        _JOB_ENV.update({k: os.environ.get(k, share) for k in (
            "MOGRAPH_ORT_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
        _JOB_ENV.update({k: v for k, v in os.environ.items() if k not in _JOB_ENV})

        builders = [(t, m) for t, m in steps if t.parent.name.startswith("builder-")]
        exports = [(t, m) for t, m in steps if t.parent.name.startswith("export-")]
        variants = [(t, m) for t, m in steps[1:] if (t, m) not in builders and (t, m) not in exports
                    and not _variant_base(args, t.parent.name)]
        derived = [(t, m) for t, m in steps if _variant_base(args, t.parent.name)]
        if not _step(name, *steps[0], args.retry):
            failed += 1
            continue
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(lambda n=name, bs=builders: all([_step(n, t, m, args.retry) for t, m in bs]))]
            by_dir: dict[str, Any] = {}
            for t, m in exports:
                if not _step(name, t, m, args.retry):
                    failed += 1
                    continue
                exp_kind = t.parent.name.removeprefix("export-")
                readers = []
                for vt, vm in variants:
                    if _variant_export(args, vt.parent.name) == exp_kind:
                        by_dir[vt.parent.name] = pool.submit(_step, name, vt, vm, args.retry)
                        futures.append(by_dir[vt.parent.name])
                        readers.append(by_dir[vt.parent.name])
                if args.drop_exports and readers:  # the export's disk back once every graph made from it is there
                    _drop_when_done(t.parent, readers)
                # a from: variant waits in the pool for its base, submitted before it (the queue is FIFO, so the
                # base is running or done by then: no deadlock)
                for vt, vm in derived:
                    base = _variant_base(args, vt.parent.name)
                    if base in by_dir and vt.parent.name not in by_dir:
                        by_dir[vt.parent.name] = pool.submit(_after, by_dir[base], name, vt, vm, args.retry)
                        futures.append(by_dir[vt.parent.name])
            # those whose base's export failed: their step fails, unless the base's graph is cached
            futures += [pool.submit(_step, name, vt, vm, args.retry) for vt, vm in derived
                        if vt.parent.name not in by_dir]
            failed += sum(not f.result() for f in futures)
    return 1 if failed else 0


# -- running ----------------------------------------------------------------------------------------------

_PAST = re.compile(r"past\D*?(\d+)\D*?(key|value)")
_PRESENT = re.compile(r"present\D*?(\d+)\D*?(key|value)")
_NP = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int64)": np.int64,
       "tensor(int32)": np.int32, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}


class Graph:
    """One ONNX file and how to feed it: which inputs are past K/V (and their dtype), which outputs present."""

    def __init__(self, name: str, path: Path, device: str, cuda_graph: bool,
                 config: dict[str, str] | None = None) -> None:
        import onnxruntime as ort

        self.name, self.path, self.device = name, path, device
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for key, value in (config or {}).items():
            opts.add_session_config_entry(key, value)
        if device == "cuda":
            po = {"enable_cuda_graph": "1" if cuda_graph else "0"}
            providers: list[Any] = [("CUDAExecutionProvider", po), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), opts, providers=providers)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.past = {self._key(_PAST, n): n for n in self.inputs if _PAST.search(n)}
        self.present = {self._key(_PRESENT, n): n for n in self.outputs if _PRESENT.search(n)}
        self.kv_dtype = _NP[self.inputs[next(iter(self.past.values()))].type] if self.past else np.float32
        self.ort = ort

    @staticmethod
    def _key(rx: re.Pattern[str], name: str) -> tuple[int, str]:
        m = rx.search(name)
        assert m
        return int(m.group(1)), m.group(2)

    def value(self, arr: np.ndarray) -> Any:
        return self.ort.OrtValue.ortvalue_from_numpy(arr, self.device, 0)


class Step:
    """One IO binding of a graph: ``run()`` returns when the device is done; ``logits()`` copies them back."""

    def __init__(self, g: Graph, ids: np.ndarray, mask: np.ndarray, past: dict[tuple[int, str], Any] | None,
                 shared: bool) -> None:
        self.g, self.io, self.shared = g, g.session.io_binding(), shared
        self.keep = [g.value(ids.astype(_NP[g.inputs["input_ids"].type])),
                     g.value(mask.astype(_NP[g.inputs["attention_mask"].type]))]
        self.io.bind_ortvalue_input("input_ids", self.keep[0])
        self.io.bind_ortvalue_input("attention_mask", self.keep[1])
        if "position_ids" in g.inputs:  # each new token's position: the mask's ones before it (a loop's feed)
            s = ids.shape[1]
            pos = mask.sum(axis=1, keepdims=True) - s + np.arange(s)[None, :]
            self.keep.append(g.value(pos.astype(_NP[g.inputs["position_ids"].type])))
            self.io.bind_ortvalue_input("position_ids", self.keep[-1])
        for key, name in g.past.items():
            self.io.bind_ortvalue_input(name, past[key])
        for name in g.outputs:
            m = _PRESENT.search(name)
            if shared and m:
                self.io.bind_ortvalue_output(name, past[(int(m.group(1)), m.group(2))])
            else:
                self.io.bind_output(name, g.device)

    def run(self) -> None:
        self.g.session.run_with_iobinding(self.io)

    def logits(self) -> np.ndarray:
        return np.asarray(self.io.get_outputs()[self.g.outputs.index("logits")].numpy(), dtype=np.float32)

    def output(self) -> np.ndarray:
        return self.logits()

    def presents(self) -> dict[tuple[int, str], Any]:
        outs = self.io.get_outputs()
        return {Graph._key(_PRESENT, n): outs[i] for i, n in enumerate(self.g.outputs) if _PRESENT.search(n)}


def cell_step(g: Graph, spec: Spec, cell: str, shared: bool, seed: int) -> Step:
    rng = np.random.default_rng(seed)
    decode = cell.startswith("decode:")
    b, s = (int(v) for v in cell.split(":")[-1].split("x"))
    if not decode:
        # GroupQueryAttention takes a prompt over a shared buffer at batch 1 only ("batch_size must be 1 when
        # sequence_length > 1 and past context is given"): larger prompts go in with an empty past
        shared = shared and b == 1
        ids = rng.integers(0, spec.vocab, (b, s))
        cap = s + STEPS if shared else 0
        mask = np.zeros((b, max(cap, s)), np.int64)
        mask[:, :s] = 1
        past = {k: g.value(np.zeros((b, spec.kv, cap, spec.head), g.kv_dtype)) for k in g.past} if g.past else None
        return Step(g, ids, mask, past, shared)
    if not g.past:
        raise ValueError("graph has no past inputs")
    ids = rng.integers(0, spec.vocab, (b, 1))
    cap = s + STEPS if shared else s
    mask = np.zeros((b, s + STEPS if shared else s + 1), np.int64)
    mask[:, : s + 1] = 1
    past = {k: g.value((0.5 * rng.standard_normal((b, spec.kv, cap, spec.head))).astype(g.kv_dtype)) for k in g.past}
    return Step(g, ids, mask, past, shared)


def graph_files(d: Path, variants: list[str], kind: str) -> dict[str, Path]:
    files = {f"builder-{p}": d / f"builder-{p}" / "model.onnx" for p in ("fp16", "int4", "fp32")}
    for v in variants:
        vname, exp, base, _ = parse_variant(v)
        if exp != "same":
            files[vname] = d / f"{vname}-{kind}" / "model.onnx"
    for v in variants:  # a same: variant runs its base's file
        vname, exp, base, _ = parse_variant(v)
        if exp == "same" and base in files:
            files[vname] = files[base]
    return {k: v for k, v in files.items() if v.exists()}


def session_config(variants: list[str], name: str) -> dict[str, str]:
    """The session config entries of variant ``name`` (a ``same:`` variant), else none."""
    for v in variants:
        vname, exp, _, extra = parse_variant(v)
        if vname == name and exp == "same":
            return parse_config(extra)
    return {}


def shared_ok(g: Graph) -> bool:
    """Past and present can share one static buffer when every past input feeds a GroupQueryAttention node
    (as its past_key/past_value) whose present output is the graph's present: the op then writes the new
    tokens in place at ``seqlens_k`` (how ONNX Runtime GenAI binds the builder's graphs)."""
    if not g.past:
        return False
    import onnx

    model = onnx.load(str(g.path), load_external_data=False)
    graph_outputs = {o.name for o in model.graph.output}
    fed = {}
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention" and len(node.input) > 4 and len(node.output) > 2:
            fed[node.input[3]] = node.output[1] in graph_outputs
            fed[node.input[4]] = node.output[2] in graph_outputs
    return all(fed.get(name, False) for name in g.past.values())


def torch_reference(spec: Spec, hf: Path, device: str, ids: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Prefill logits of ``ids`` and STEPS greedy tokens after it, from the float32 torch model."""
    import torch
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(
        hf, attn_implementation="eager", dtype=torch.float32).eval().to(device)
    with torch.inference_mode():
        x = torch.from_numpy(ids).to(device)
        out = model(input_ids=x, use_cache=True)
        logits = out.logits.float().cpu().numpy()
        cache, tok, tokens = out.past_key_values, int(out.logits[0, -1].argmax()), []
        margins = []
        for _ in range(STEPS):
            tokens.append(tok)
            o = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=cache, use_cache=True)
            top = torch.topk(o.logits[0, -1].float(), 2).values
            margins.append(float(top[0] - top[1]))
            cache, tok = o.past_key_values, int(o.logits[0, -1].argmax())
    torch_reference.margins = margins  # type: ignore[attr-defined]
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return logits, tokens


def greedy(prefill: Graph, decode: Graph, spec: Spec, ids: np.ndarray, shared: bool) -> tuple[np.ndarray, list[int]]:
    """Prefill ``ids`` then STEPS greedy tokens; with ``shared``, the decode steps run over one static buffer per
    layer (bound as both past and present, the mask as long as the buffer), filled by the prefill: in place
    where the prefill graph takes the buffer too, else copied from its presents once."""
    n = ids.shape[1]
    cap = n + STEPS
    if shared and prefill.past:
        past = {k: prefill.value(np.zeros((1, spec.kv, cap, spec.head), prefill.kv_dtype)) for k in decode.past}
        mask = np.zeros((1, cap), np.int64)
        mask[:, :n] = 1
        first = Step(prefill, ids, mask, past, True)
    else:
        empty = {k: prefill.value(np.zeros((1, spec.kv, 0, spec.head), prefill.kv_dtype)) for k in prefill.past}
        first = Step(prefill, ids, np.ones((1, n), np.int64), empty or None, False)
    first.run()
    logits = first.logits()
    tok, tokens = int(logits[0, -1].argmax()), []
    cache = first.presents()
    if shared and not prefill.past:
        buffers = {}
        for k, v in cache.items():
            buf = np.zeros((1, spec.kv, cap, spec.head), decode.kv_dtype)
            buf[:, :, :n] = v.numpy()
            buffers[k] = decode.value(buf)
        cache = buffers
    elif shared:
        cache = past
    for i in range(STEPS):
        tokens.append(tok)
        total = n + i + 1
        if shared:
            mask = np.zeros((1, cap), np.int64)
            mask[:, :total] = 1
        else:
            mask = np.ones((1, total), np.int64)
        st = Step(decode, np.array([[tok]]), mask, cache, shared)
        st.run()
        tok = int(st.logits()[0, -1].argmax())
        if not shared:
            cache = st.presents()
    return logits, tokens


def time_model(args: argparse.Namespace, name: str, out: Any) -> None:
    spec, d = MODELS[name], Path(args.cache) / name
    cells = args.cells.split(",")
    # accuracy first: torch fp32 on the device, then each graph pair's prefill logits and greedy loop
    ids = np.random.default_rng(7).integers(0, spec.vocab, (1, PROMPT))
    ref_logits, ref_tokens = torch_reference(spec, d / "hf", args.device, ids)
    pre, dec = graph_files(d, args.variant, "prefill"), graph_files(d, args.variant, "decode")
    for vname in sorted(set(pre) & set(dec)):
        row: dict[str, Any] = {"model": name, "variant": vname, "cell": "accuracy", "when": time.time()}
        try:
            cfg = session_config(args.variant, vname)
            gp, gd = (Graph(vname, pre[vname], args.device, False, cfg),
                      Graph(vname, dec[vname], args.device, False, cfg))
            shared = shared_ok(gd)
            logits, tokens = greedy(gp, gd, spec, ids, shared)
            cos, mx = cosine(logits[0, -1], ref_logits[0, -1])
            agree = float(np.mean(logits[0].argmax(-1) == ref_logits[0].argmax(-1)))
            same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
            row.update(shared=shared, cosine=round(cos, 6), max_abs=round(mx, 4), argmax_agree=agree,
                       greedy_same_steps=same, greedy_steps=STEPS)
            if same < STEPS:  # how close torch's own top two logits were at the first different token
                row["torch_top2_margin_there"] = round(torch_reference.margins[same - 1], 5) if same else None
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        log(json.dumps(row))
        out.write(json.dumps(row) + "\n")
        out.flush()
    for cell in cells:
        kind = "decode" if cell.startswith("decode:") else "prefill"
        files = graph_files(d, args.variant, kind)
        for mode in ("plain", "graph"):
            runners: dict[str, Any] = {}
            notes: dict[str, str] = {}
            for vname, path in files.items():
                try:
                    g = Graph(vname, path, args.device, mode == "graph" and args.device == "cuda",
                              session_config(args.variant, vname))
                    shared = mode == "graph" and shared_ok(g)
                    if mode == "graph" and kind == "decode" and not shared:
                        notes[vname] = "not capturable in a generation loop: no shared past/present buffer"
                        continue
                    runners[vname] = cell_step(g, spec, cell, shared, seed=11)
                except Exception as exc:  # noqa: BLE001
                    notes[vname] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
            timed = time_runners(runners, args.warmup, args.min_time, args.rounds, args.max_iters)
            kern = {}
            if args.kernels and args.device == "cuda":
                for vname, r in runners.items():
                    if "error" not in timed.get(vname, {}):
                        try:
                            kern[vname] = cuda_kernels(r, args.kernels, top=12)
                        except Exception as exc:  # noqa: BLE001
                            kern[vname] = {"error": str(exc)[:200]}
            for vname in files:
                row = {"model": name, "variant": vname, "cell": cell, "mode": mode, "when": time.time(),
                       **timed.get(vname, {})}
                if runners.get(vname) is not None:
                    row["shared"] = runners[vname].shared
                if vname in notes:
                    row.setdefault("error", notes[vname])
                if vname in kern:
                    row["kernels"] = kern[vname]
                log(json.dumps({k: v for k, v in row.items() if k != "kernels"}))
                out.write(json.dumps(row) + "\n")
                out.flush()
            del runners


def time_all(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        import importlib

        import torch  # noqa: F401  (loads the CUDA libraries ONNX Runtime's provider needs: before onnxruntime)

        ort = importlib.import_module("onnxruntime")

        if "CUDAExecutionProvider" not in ort.get_available_providers():  # e.g. the CPU wheel is the one imported
            raise SystemExit(f"bench_llm: --device cuda, but onnxruntime {ort.__version__} at {ort.__file__} has no "
                             "CUDAExecutionProvider (install onnxruntime-gpu first)")
    with open(args.out, "a") as out:
        for name in args.models.split(","):
            time_model(args, name, out)
    return 0


def markdown(args: argparse.Namespace) -> int:
    rows = [json.loads(line) for line in Path(args.out).read_text().splitlines() if line.strip()]
    latest: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for r in rows:
        latest[(r["model"], r["cell"], r.get("mode", ""), r["variant"])] = r
    variants = sorted({k[3] for k in latest})
    ours = [v for v in variants if not v.startswith("builder")]

    def peer(v: str) -> str:  # a same: variant named NAME+X is compared with builder-...+X where the run has it
        base = "builder-int4" if "int4" in v or "nbits4" in v else "builder-fp16"
        suffix = v[v.index("+"):] if "+" in v else ""
        return base + suffix if suffix and base + suffix in variants else base

    lines = ["| model | cell | mode | " + " | ".join(variants) + " | " + " | ".join(f"{v} / {peer(v)}" for v in ours)
             + " |", "|---|---|---|" + "---:|" * (len(variants) + len(ours))]

    def ms(model: str, cell: str, mode: str, v: str) -> float | None:
        r = latest.get((model, cell, mode, v))
        return None if not r or r.get("error") else r.get("median_ms")

    for model in dict.fromkeys(k[0] for k in latest):
        for cell in dict.fromkeys(k[1] for k in latest if k[0] == model and k[1] != "accuracy"):
            for mode in ("plain", "graph"):
                cells = []
                for v in variants:
                    t = ms(model, cell, mode, v)
                    cells.append(f"{t:.3f}" if t else ("–" if (model, cell, mode, v) in latest else ""))
                ratios = []
                for v in ours:
                    a_, b_ = ms(model, cell, mode, v), ms(model, cell, mode, peer(v))
                    ratios.append(f"**{a_ / b_:.2f}**" if a_ and b_ else "–")
                lines.append(f"| {model} | {cell} | {mode} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "| model | variant | shared buffer | logits cosine | max abs | argmax agree | greedy steps = torch |",
              "|---|---|---|---:|---:|---:|---:|"]
    for (model, cell, _, v), r in latest.items():
        if cell == "accuracy":
            if "error" in r:
                lines.append(f"| {model} | {v} | | error: {r['error'][:80]} | | | |")
            else:
                lines.append(f"| {model} | {v} | {r['shared']} | {r['cosine']:.6f} | {r['max_abs']:.4f} | "
                             f"{r['argmax_agree']:.2f} | {r['greedy_same_steps']}/{r['greedy_steps']} |")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("prepare", "time", "markdown"))
    ap.add_argument("--models", default="smollm")
    ap.add_argument("--cache", default="/tmp/mograph-llm")
    ap.add_argument("--out", default="bench_llm.jsonl")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--variant", action="append", help="NAME=ts|dynamo|ts-pos|dynamo-pos:PASSES[:ARGS] (repeatable)")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--no-builder", action="store_true")
    ap.add_argument("--builder-precisions", default="fp16,int4", help="builder -p values (fp32 for a CPU smoke)")
    ap.add_argument("--builder-ep", default="cuda", help="builder -e (cpu for a CPU smoke)")
    ap.add_argument("--retry", action="store_true", help="retry steps that failed before")
    ap.add_argument("--drop-exports", action="store_true",
                    help="with --jobs: delete each export once every mograph graph made from it is built (disk)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="prepare: run the builders and mograph's runs N at a time (the exports stay one at a time), each "
                         "with cores/N threads (MOGRAPH_ORT_THREADS, OMP_NUM_THREADS); with several models at once "
                         "(tools/gpu_llm.sh starts one process per model) set MOGRAPH_ORT_THREADS yourself")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--kernels", type=int, default=0, help="record the CUDA kernels of N runs per cell")
    args = ap.parse_args(argv)
    args.variant = args.variant or list(DEFAULT_VARIANTS)
    if args.what == "prepare":
        return prepare(args)
    if args.what == "time":
        return time_all(args)
    return markdown(args)


if __name__ == "__main__":
    raise SystemExit(main())
