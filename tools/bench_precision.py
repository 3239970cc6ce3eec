"""BERT-base at each precision on the GPU, in one run: mograph fp16, mograph's GPU int8 / int4 recipes, ONNX
Runtime's ``MatMulNBitsQuantizer`` on the same fp16 graph (issue 26 item 3).

Usage (the H200; ``prepare`` is CPU work, ``--jobs`` runs the variants N at a time)::

    python tools/bench_precision.py prepare --cache /tmp/prec --jobs 4
    python tools/bench_precision.py time --cache /tmp/prec --out prec.jsonl
    python tools/bench_precision.py markdown --out prec.jsonl
    # CPU smoke (ORT CPU, ~1 min):
    python tools/bench_precision.py prepare --model bert-tiny --cache /tmp/prec-tiny --jobs 2 && \\
        python tools/bench_precision.py time --model bert-tiny --cache /tmp/prec-tiny --device cpu --out /tmp/p.jsonl

* **model** (``--model``): ``bert-base`` (transformers ``BertModel`` without pooler, seeded random weights: 12
  layers, hidden 768, 12 heads, FFN 3072) or ``bert-tiny`` (2 layers, hidden 128, 2 heads, FFN 512), exported
  with TorchScript (opset 17, dynamic batch and sequence; ``input_ids, attention_mask -> last_hidden_state``):
  the variant ``fp32``, every accuracy figure's reference.
* **variants** (``--variants``): ``fp16`` (``mograph optimize --passes cleanup,fuse,fp16 --target ort``),
  ``int8-wo`` (``--passes cleanup,fuse,int8 --target ort --device cuda``: the GPU recipe, weight-only 8-bit
  ``MatMulNBits`` with float16 activations), ``int4`` (``--passes cleanup,fuse,int4 --target ort --device
  cuda``), every mograph run with ``--calibration-data`` (one seeded feed of 8x64); ``ort-nbits4`` /
  ``ort-nbits8`` (``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``, RTN, block 128,
  asymmetric, on the ``fp16`` variant's graph); ``int8-wo-b32`` (the int8 recipe in blocks of 32 without zero
  points); ``int8-wo-b32+fpa`` / ``int4+fpa`` (those graphs, nothing built, run with the session config entry
  ``ep.cuda.fpa_intb_gemm=1``: ONNX Runtime's CUTLASS weight-only kernels, off by default).
* **cells** (``--cells``, default ``1x128,8x128,8x512``), each ``plain`` (IO binding, inputs and the output bound
  once on the device) and, on ``--device cuda``, ``graph`` (the same under ``enable_cuda_graph``; a variant ONNX
  Runtime does not capture is recorded with its error); the variants of a cell are timed in interleaved rounds.
* **accuracy**: cosine and max abs of ``last_hidden_state`` against the ``fp32`` export on the same device and
  feeds, per cell and mode.  **size**: the bytes of ``model.onnx`` and the external data files it names;
  the row also counts the graph's ``MatMulNBits`` by ``bits`` and any ``MatMulInteger`` / ``QuantizeLinear``,
  so a recipe that did not write what its name says shows it.

``markdown`` prints the times with ratios to ``fp16`` and the sizes, and checks the issue's goal for
``int8-wo``: at most 1.05x ``fp16``'s time at less than 0.6x its size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import cosine, cuda_kernels, time_runners  # noqa: E402
from bench_llm import _after, _step, ort_nbits, parse_config, parse_nbits, run_mograph  # noqa: E402

#: layers, hidden, heads, FFN
MODELS = {"bert-base": (12, 768, 12, 3072), "bert-tiny": (2, 128, 2, 512)}
VOCAB = 30522
#: name -> ("mograph", passes, extra CLI args) or ("nbits", base variant, nbits spec of bench_llm.parse_nbits)
VARIANTS: dict[str, tuple[str, str, str]] = {
    "fp16": ("mograph", "cleanup,fuse,fp16", "--target ort"),
    "int8-wo": ("mograph", "cleanup,fuse,int8", "--target ort --device cuda"),
    "int4": ("mograph", "cleanup,fuse,int4", "--target ort --device cuda"),
    "ort-nbits4": ("nbits", "fp16", "nbits4:block=128"),
    "ort-nbits8": ("nbits", "fp16", "nbits8:block=128"),
    # ONNX Runtime's CUTLASS weight-only kernels (fpA_intB: 4/8-bit blocks of 32 without zero points or bias), off by
    # default in onnxruntime-gpu 1.31, switched on per session: the graphs of another variant, nothing built
    "int8-wo-b32": ("mograph", "cleanup,fuse,int8", "--target ort --device cuda --block-size 32 --symmetric yes"),
    "int8-wo-b32+fpa": ("same", "int8-wo-b32", "ep.cuda.fpa_intb_gemm=1"),
    "int4+fpa": ("same", "int4", "ep.cuda.fpa_intb_gemm=1"),
}
CELLS = "1x128,8x128,8x512"
_NP = {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(int64)": np.int64,
       "tensor(int32)": np.int32}


def log(msg: str) -> None:
    sys.stderr.write(f"[bench_precision {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# -- building ---------------------------------------------------------------------------------------------


def export_bert(model: str, out: Path, attn: str = "eager") -> None:
    """The seeded random-weight BERT, exported with TorchScript (opset 17), and the calibration feeds beside it."""
    import torch
    import transformers as T

    layers, hidden, heads, ffn = MODELS[model]
    torch.manual_seed(0)
    kw: dict[str, Any] = {"attn_implementation": attn}
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=ffn, max_position_embeddings=512, **kw)
    bert = T.BertModel(cfg, add_pooling_layer=False).eval()

    class Text(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = bert

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, VOCAB, (2, 16))
    axes = {n: {0: "batch", 1: "seq"} for n in ("input_ids", "attention_mask", "last_hidden_state")}
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(Text().eval(), (ids, torch.ones(2, 16, dtype=torch.int64)), str(out),
                          input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=17, dynamo=False)
    rng = np.random.default_rng(3)  # mograph's calibration feed: one seeded batch of 8x64
    np.savez(out.parent / "calibration.npz", input_ids=rng.integers(0, VOCAB, (8, 64)),
             attention_mask=np.ones((8, 64), np.int64))


def make_variant(d: Path, name: str, extra: str = "") -> None:
    how, a, b = VARIANTS[name]
    if how == "mograph":
        run_mograph(d / "fp32" / "model.onnx", d / name / "model.onnx", a, f"{b} {extra}".strip() if name != "fp16" else b)
    else:
        ort_nbits(d / a / "model.onnx", d / name / "model.onnx", **parse_nbits(b))


def prepare(args: argparse.Namespace) -> int:
    d = Path(args.cache) / args.model
    names = args.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"bench_precision: unknown variant {n!r} (known: {', '.join(VARIANTS)})")
        if VARIANTS[n][0] in ("nbits", "same") and VARIANTS[n][1] not in names:
            raise SystemExit(f"bench_precision: {n} reads {VARIANTS[n][1]}'s graph: list it too")
    if not _step(args.model, d / "fp32" / "model.onnx", lambda: export_bert(args.model, d / "fp32" / "model.onnx",
                                                                             args.attn), args.retry):
        return 1
    from concurrent.futures import ThreadPoolExecutor

    futures: dict[str, Any] = {}
    with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        # the mograph runs first, then the ones reading their graph (FIFO: a base is running or done by then)
        for n in sorted((n for n in names if VARIANTS[n][0] != "same"), key=lambda n: VARIANTS[n][0] == "nbits"):
            target, make = d / n / "model.onnx", (lambda n=n: make_variant(d, n, args.quant_args))
            base = futures.get(VARIANTS[n][1]) if VARIANTS[n][0] == "nbits" else None
            futures[n] = pool.submit(_after, base, args.model, target, make, args.retry)
        failed = sum(not f.result() for f in futures.values())
    return 1 if failed else 0


# -- running ----------------------------------------------------------------------------------------------


def graph_facts(path: Path) -> dict[str, Any]:
    """Bytes on disk (the graph and the external data it names) and the quantized ops it holds."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    files = {path.name}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            files |= {e.value for e in init.external_data if e.key == "location"}
    nbits: Counter[str] = Counter()
    ops = Counter(n.op_type for n in model.graph.node)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            nbits[str(next((a.i for a in node.attribute if a.name == "bits"), 4))] += 1
    return {"bytes": sum((path.parent / f).stat().st_size for f in files),
            "matmulnbits_bits": dict(nbits), "matmul": ops["MatMul"] + ops["Gemm"],
            "int8_ops": {k: ops[k] for k in ("MatMulInteger", "QuantizeLinear", "DynamicQuantizeLinear") if ops[k]}}


class Runner:
    """One variant on one cell: inputs and the output bound once as device OrtValues (a CUDA graph replays)."""

    def __init__(self, path: Path, device: str, cuda_graph: bool, feeds: dict[str, np.ndarray], hidden: int,
                 config: dict[str, str] | None = None) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        for key, value in (config or {}).items():
            opts.add_session_config_entry(key, value)
        providers: list[Any] = (
            [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if cuda_graph else "0"}), "CPUExecutionProvider"]
            if device == "cuda" else ["CPUExecutionProvider"])
        self.session = ort.InferenceSession(str(path), opts, providers=providers)
        if device == "cuda" and "CUDAExecutionProvider" not in self.session.get_providers():
            raise RuntimeError(f"CUDAExecutionProvider not active (got {self.session.get_providers()})")
        self.io = self.session.io_binding()
        self.keep: list[Any] = []
        for i in self.session.get_inputs():
            v = ort.OrtValue.ortvalue_from_numpy(feeds[i.name].astype(_NP[i.type]), device, 0)
            self.keep.append(v)
            self.io.bind_ortvalue_input(i.name, v)
        out = self.session.get_outputs()[0]
        b, s = feeds["input_ids"].shape
        self.out = ort.OrtValue.ortvalue_from_numpy(np.zeros((b, s, hidden), _NP[out.type]), device, 0)
        self.io.bind_ortvalue_output(out.name, self.out)

    def run(self) -> None:
        self.session.run_with_iobinding(self.io)

    def output(self) -> np.ndarray:
        return np.asarray(self.out.numpy(), dtype=np.float32)


def time_all(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        import torch  # noqa: F401  (loads the CUDA libraries ONNX Runtime's provider needs)
    d = Path(args.cache) / args.model
    hidden = MODELS[args.model][1]
    names = ["fp32", *args.variants.split(",")]
    paths = {n: d / (VARIANTS[n][1] if VARIANTS.get(n, ("",))[0] == "same" else n) / "model.onnx" for n in names}
    configs = {n: parse_config(VARIANTS[n][2]) for n in names if VARIANTS.get(n, ("",))[0] == "same"}
    with open(args.out, "a") as out:

        def write(row: dict[str, Any]) -> None:
            row = {"model": args.model, "device": args.device, "when": round(time.time(), 1), **row}
            log(json.dumps({k: v for k, v in row.items() if k != "kernels"}))
            out.write(json.dumps(row) + "\n")
            out.flush()

        for n, p in paths.items():
            if p.exists():
                write({"variant": n, "cell": "size", **graph_facts(p)})
            else:
                failed = p.parent / "FAILED"
                write({"variant": n, "cell": "size",
                       "error": failed.read_text()[-500:] if failed.exists() else "not prepared"})
        refs: dict[str, np.ndarray] = {}
        for cell in args.cells.split(","):
            b, s = (int(v) for v in cell.split("x"))
            rng = np.random.default_rng(11)
            feeds = {"input_ids": rng.integers(0, VOCAB, (b, s)), "attention_mask": np.ones((b, s), np.int64)}
            for mode in ("plain", "graph") if args.device == "cuda" else ("plain",):
                runners: dict[str, Any] = {}
                notes: dict[str, str] = {}
                for n, p in paths.items():
                    if not p.exists():
                        continue
                    try:
                        runners[n] = Runner(p, args.device, mode == "graph", feeds, hidden, configs.get(n))
                    except Exception as exc:  # noqa: BLE001
                        notes[n] = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
                timed = time_runners(runners, args.warmup, args.min_time, args.rounds, args.max_iters)
                if "fp32" in runners and "error" not in timed.get("fp32", {}):
                    refs[cell] = runners["fp32"].output()
                ref = refs.get(cell)  # under a CUDA graph the export may not capture: the plain run's output
                for n in paths:
                    if n not in runners and n not in notes:
                        continue
                    row: dict[str, Any] = {"variant": n, "cell": cell, "mode": mode, **timed.get(n, {})}
                    if n in notes:
                        row.setdefault("error", notes[n])
                    elif "error" not in row and ref is not None:
                        cos, mx = cosine(runners[n].output(), ref)
                        row.update(cosine=round(cos, 6), max_abs=round(mx, 5))
                    if args.kernels and args.device == "cuda" and n in runners and "error" not in row:
                        try:
                            row["kernels"] = cuda_kernels(runners[n], args.kernels, top=12)
                        except Exception as exc:  # noqa: BLE001
                            row["kernels"] = {"error": str(exc)[:200]}
                    write(row)
                del runners
    return 0


# -- table ------------------------------------------------------------------------------------------------


def markdown(args: argparse.Namespace) -> int:
    rows = [json.loads(line) for line in Path(args.out).read_text().splitlines() if line.strip()]
    latest: dict[tuple[str, str, str, str, str], dict[str, Any]] = {}
    for r in rows:
        latest[(r["model"], r["device"], r["cell"], r.get("mode", ""), r["variant"])] = r
    variants = list(dict.fromkeys(k[4] for k in latest))
    others = [v for v in variants if v != "fp16"]
    lines: list[str] = []

    def ms(key: tuple[str, str, str, str, str]) -> float | None:
        r = latest.get(key)
        return None if not r or r.get("error") else r.get("median_ms")

    for model, device in dict.fromkeys(k[:2] for k in latest):
        lines += [f"### {model} on {device}", "",
                  "| cell | mode | " + " | ".join(f"{v} ms" for v in variants) + " | "
                  + " | ".join(f"{v} / fp16" for v in others) + " | " + " | ".join(f"{v} cos" for v in others) + " |",
                  "|---|---|" + "---:|" * (len(variants) + 2 * len(others))]
        cells = dict.fromkeys(k[2:4] for k in latest if k[:2] == (model, device) and k[2] != "size")
        for cell, mode in cells:
            base = ms((model, device, cell, mode, "fp16"))
            times, ratios, cos = [], [], []
            for v in variants:
                t = ms((model, device, cell, mode, v))
                times.append(f"{t:.3f}" if t else ("error" if (model, device, cell, mode, v) in latest else ""))
            for v in others:
                t = ms((model, device, cell, mode, v))
                ratios.append(f"**{t / base:.2f}**" if t and base else "–")
                c = latest.get((model, device, cell, mode, v), {}).get("cosine")
                cos.append(f"{c:.5f}" if c is not None else "–")
            lines.append(f"| {cell} | {mode} | " + " | ".join(times + ratios + cos) + " |")
        lines += ["", "| variant | MB | / fp16 | MatMulNBits by bits | float MatMul/Gemm | int8 ops | error |",
                  "|---|---:|---:|---|---:|---|---|"]
        fp16 = latest.get((model, device, "size", "", "fp16"), {}).get("bytes")
        for v in variants:
            r = latest.get((model, device, "size", "", v))
            if not r:
                continue
            if r.get("error"):
                lines.append(f"| {v} | | | | | | {r['error'][:100]} |")
                continue
            ratio = f"{r['bytes'] / fp16:.3f}" if fp16 else "–"
            lines.append(f"| {v} | {r['bytes'] / 2**20:.1f} | {ratio} | {r['matmulnbits_bits'] or ''} | "
                         f"{r['matmul']} | {r['int8_ops'] or ''} | |")
        for v8 in (v for v in variants if v.startswith("int8-wo")):
            sized = VARIANTS[v8][1] if VARIANTS.get(v8, ("",))[0] == "same" else v8
            size8 = latest.get((model, device, "size", "", sized), {}).get("bytes")
            worst = [ms((model, device, c, m, v8)) / base for c, m in cells  # type: ignore[operator]
                     if (base := ms((model, device, c, m, "fp16"))) and ms((model, device, c, m, v8))]
            if worst and size8 and fp16:
                ok = max(worst) <= 1.05 and size8 / fp16 < 0.6
                lines += ["", f"{v8} goal (<= 1.05x fp16 time in every cell, < 0.6x its size): worst time "
                          f"{max(worst):.2f}x, size {size8 / fp16:.3f}x: **{'met' if ok else 'not met'}**"]
        lines.append("")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("prepare", "time", "markdown"))
    ap.add_argument("--model", default="bert-base", choices=sorted(MODELS))
    ap.add_argument("--cache", default="/tmp/mograph-precision")
    ap.add_argument("--out", default="bench_precision.jsonl")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--attn", default="eager", choices=("eager", "sdpa"), help="transformers attention at export")
    ap.add_argument("--cells", default=CELLS)
    ap.add_argument("--jobs", type=int, default=1, help="prepare: variants built N at a time")
    ap.add_argument("--quant-args", default="", help="prepare: extra mograph options for the int8/int4 variants, e.g. "
                    "'--algorithm rtn --accuracy-budget off' for a timing-only build (the same ops and shapes as the "
                    "default GPTQ/AWQ plan, in seconds instead of minutes; the accuracy columns then are RTN's)")
    ap.add_argument("--retry", action="store_true", help="retry steps that failed before")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--kernels", type=int, default=0, help="record the CUDA kernels of N runs per cell")
    args = ap.parse_args(argv)
    if args.what == "prepare":
        return prepare(args)
    if args.what == "time":
        return time_all(args)
    return markdown(args)


if __name__ == "__main__":
    raise SystemExit(main())
