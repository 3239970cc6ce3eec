"""Build, check and benchmark mograph's CUDA kernels on a GPU machine, in one run.

    python tools/gpu_kernels.py                 # build + correctness grid + benchmark, table at the end
    python tools/gpu_kernels.py --no-compile    # skip the torch.compile baseline (its compiles take minutes)
    python tools/gpu_kernels.py --prewarm-compile 8             # compile the baselines in 8 processes first
    python tools/gpu_kernels.py --sweep legacy,nopdl,default    # also time compile-time variants side by side
    python tools/gpu_kernels.py --no-correctness --sweep-only --sweep v1,v2,...,v12 --json sweep.json
    python tools/gpu_kernels.py --emit-tuning sweep.json        # rewrite kernels/src/tuning_table.cuh

Steps:
  1. build ``kernels/build/libmograph_kernels.so`` with nvcc (``kernels/build.py``);
  2. the correctness grid of ``kernels/harness.py`` (every op x fp32/fp16/bf16 x hidden in
     {64, 768, 1000, 1024, 4096, 8192, 33, ...}, options, misaligned pointers) against the numpy reference;
  3. benchmarks at 16384x768, 65536x1024, 16384x4096 and 4096x8192: each kernel's time, its achieved
     bandwidth (bytes it must read and write / time) as a fraction of the device-to-device copy bandwidth
     measured in the same run, and its speed-up over torch.nn.functional and over torch.compile of the
     decomposed formula. Each kernel's output is also compared with torch's at those shapes.

Timing: every candidate is warmed up, then K calls are captured in a CUDA graph (so Python and ctypes
launch overhead does not hide the GPU time), the graph is replayed between CUDA events, and the median of
many replays / K is the time of one call. Calls rotate over enough input/output sets that their bytes
exceed the L2 cache several times, so the numbers are HBM numbers, not cache numbers.

Output: progress lines, then a table; with ``--json PATH`` or ``$OUT`` set, the full results as JSON
(``$OUT/gpu_kernels.json``). Needs torch with CUDA and nvcc.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = ((16384, 768), (65536, 1024), (16384, 4096), (4096, 8192))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """ "16384x768,4096x8192" -> [(16384, 768), (4096, 8192)] (--shapes)."""
    out = []
    for item in text.split(","):
        rows, sep, hidden = item.strip().lower().partition("x")
        if not sep or not rows.isdigit() or not hidden.isdigit() or int(rows) < 1 or int(hidden) < 1:
            raise argparse.ArgumentTypeError(f"--shapes wants ROWSxHIDDEN[,ROWSxHIDDEN...], got {item!r}")
        out.append((int(rows), int(hidden)))
    return out
BENCH_OPS = ("layer_norm", "rms_norm", "skip_layer_norm", "skip_rms_norm", "gelu", "gelu_tanh", "bias_gelu")
SKIP_OPS = ("skip_layer_norm", "skip_rms_norm")
EPS = 1e-5
L2_MULTIPLE_BYTES = 256 << 20  # rotate buffers until one graph's sets span this many bytes (L2 is 50-60 MB)


def _load(name: str):
    mod_name = f"mograph_kernels_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, ROOT / "kernels" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    return sys.modules[mod_name]


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- timing ------------------------------------------------------------------------------------------------
def time_graph(torch, calls, reps: int, use_graph: bool = True) -> tuple[float, str]:
    """Median seconds per call of ``calls`` (a list of closures run in order), timed as explained above.

    Falls back to timing a plain loop between events if graph capture fails (returned mode says which).
    """
    for fn in calls:  # warm-up: loads modules, compiles, fills allocator pools
        fn()
    torch.cuda.synchronize()
    mode = "graph"
    graph = None
    if use_graph:
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for fn in calls:
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                for fn in calls:
                    fn()
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:  # a baseline that cannot be captured is still timed, less precisely
            log(f"    (graph capture failed: {exc.__class__.__name__}: {str(exc)[:120]}; timing eagerly)")
            graph = None
            mode = "eager"
            torch.cuda.synchronize()

    def run_once():
        if graph is not None:
            graph.replay()
        else:
            for fn in calls:
                fn()

    run_once()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run_once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times), mode


def copy_bandwidth(torch, reps: int) -> dict[str, float]:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written) over 1 GiB buffers.

    Measured three ways, because they differ: ``copy_`` timed eagerly, ``copy_`` captured in a graph (a
    captured device-to-device memcpy may run on a copy engine instead of the SMs), and ``torch.neg`` into
    a preallocated output (a plain elementwise kernel). The best of them is the ceiling the kernels are
    compared with. 100 untimed copies first bring the clocks up.
    """
    n = (1 << 30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(100):
        dst.copy_(src)
    torch.cuda.synchronize()
    nbytes = 2 * n * 4
    out = {}
    t, _ = time_graph(torch, [functools.partial(dst.copy_, src)] * 10, reps, use_graph=False)
    out["copy_eager"] = nbytes / t
    t, _ = time_graph(torch, [functools.partial(dst.copy_, src)] * 10, reps)
    out["copy_graph"] = nbytes / t
    t, _ = time_graph(torch, [functools.partial(torch.neg, src, out=dst)] * 10, reps)
    out["neg_graph"] = nbytes / t
    out["best"] = max(out.values())
    return out


# ---- one benchmark ------------------------------------------------------------------------------------------
class Bench:
    """Inputs, our launcher and the torch baselines of one (op, dtype, shape)."""

    def __init__(self, torch, lib, abi, op: str, dtype: str, rows: int, hidden: int, device: str = "cuda"):
        self.torch, self.lib, self.abi = torch, lib, abi
        self.op, self.dtype, self.rows, self.hidden = op, dtype, rows, hidden
        tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
        self.tdt = tdt
        n = rows * hidden
        esize = torch.tensor([], dtype=tdt).element_size()
        reads = 2 if op in SKIP_OPS else 1
        writes = 2 if op in SKIP_OPS else 1
        self.bytes = (reads + writes) * n * esize  # vectors (gamma, beta, bias) are negligible and cached
        nsets = max(1, min(8, math.ceil(L2_MULTIPLE_BYTES / self.bytes)))
        gen = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=gen, device=device) * scale + shift).to(tdt)

        self.sets = []
        for _ in range(nsets):
            s = {"x": rnd(rows, hidden, scale=2.0, shift=0.5 if "gelu" not in op else 0.0)}
            s["y"] = torch.empty_like(s["x"])
            if op in SKIP_OPS:
                s["skip"] = rnd(rows, hidden)
                s["sum"] = torch.empty_like(s["x"])
            self.sets.append(s)
        self.vecs = {"gamma": rnd(hidden, scale=0.2, shift=1.0), "beta": rnd(hidden, scale=0.2),
                     "bias": rnd(hidden, scale=0.2)}  # fmt: skip
        self.fn = getattr(lib, abi.symbol(self.kernel_op, dtype))

    @property
    def kernel_op(self) -> str:
        return "gelu" if self.op == "gelu_tanh" else self.op

    def calls_needed(self) -> int:
        est = self.bytes / 3.5e12
        return int(min(50, max(5, math.ceil(3e-3 / est))))

    # ours
    def ours(self, s) -> None:
        a, r, h, v = self.abi, self.rows, self.hidden, self.vecs
        stream = self.torch.cuda.current_stream().cuda_stream
        p = lambda t: t.data_ptr()  # noqa: E731
        if self.op == "layer_norm":
            st = self.fn(p(s["x"]), p(v["gamma"]), p(v["beta"]), p(s["y"]), r, h, EPS, 0, stream)
        elif self.op == "rms_norm":
            st = self.fn(p(s["x"]), p(v["gamma"]), p(s["y"]), r, h, EPS, 0, stream)
        elif self.op == "skip_layer_norm":
            st = self.fn(p(s["x"]), p(s["skip"]), p(v["bias"]), p(v["gamma"]), p(v["beta"]), p(s["y"]), p(s["sum"]),
                         r, h, EPS, 0, stream)  # fmt: skip
        elif self.op == "skip_rms_norm":
            st = self.fn(p(s["x"]), p(s["skip"]), p(v["bias"]), p(v["gamma"]), p(s["y"]), p(s["sum"]), r, h, EPS, 0,
                         stream)  # fmt: skip
        elif self.op in ("gelu", "gelu_tanh"):
            st = self.fn(p(s["x"]), p(s["y"]), r * h, a.GELU_TANH if self.op == "gelu_tanh" else 0, stream)
        else:
            st = self.fn(p(s["x"]), p(v["bias"]), p(s["y"]), r, h, 0, stream)
        if st != a.OK:
            a.check(self.lib, self.op, st)

    # torch.nn.functional
    def eager(self, s, vecs=None):
        F = self.torch.nn.functional
        h = self.hidden
        v = vecs or self.vecs
        if self.op == "layer_norm":
            return F.layer_norm(s["x"], (h,), v["gamma"], v["beta"], EPS)
        if self.op == "rms_norm":
            return F.rms_norm(s["x"], (h,), v["gamma"], EPS)
        if self.op == "skip_layer_norm":
            t = s["x"] + s["skip"] + v["bias"]
            return F.layer_norm(t, (h,), v["gamma"], v["beta"], EPS), t
        if self.op == "skip_rms_norm":
            t = s["x"] + s["skip"] + v["bias"]
            return F.rms_norm(t, (h,), v["gamma"], EPS), t
        if self.op == "gelu":
            return F.gelu(s["x"])
        if self.op == "gelu_tanh":
            return F.gelu(s["x"], approximate="tanh")
        return F.gelu(s["x"] + v["bias"])

    # decomposed formulas for torch.compile (fp32 math, cast back, as the kernels do)
    def decomposed(self):
        torch = self.torch
        op = self.op

        def ln(x, g, b):
            xf = x.float()
            mean = xf.mean(-1, keepdim=True)
            d = xf - mean
            var = (d * d).mean(-1, keepdim=True)
            return (d * torch.rsqrt(var + EPS) * g.float() + b.float()).to(x.dtype)

        def rms(x, g):
            xf = x.float()
            return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + EPS) * g.float()).to(x.dtype)

        v = self.vecs
        if op == "layer_norm":
            return lambda s: ln(s["x"], v["gamma"], v["beta"])
        if op == "rms_norm":
            return lambda s: rms(s["x"], v["gamma"])
        if op == "skip_layer_norm":

            def sln(x, skip, bias, g, b):
                t = (x.float() + skip.float() + bias.float()).to(x.dtype)
                return ln(t, g, b), t

            return lambda s: sln(s["x"], s["skip"], v["bias"], v["gamma"], v["beta"])
        if op == "skip_rms_norm":

            def srms(x, skip, bias, g):
                t = (x.float() + skip.float() + bias.float()).to(x.dtype)
                return rms(t, g), t

            return lambda s: srms(s["x"], s["skip"], v["bias"], v["gamma"])

        def gelu_exact(v):
            return 0.5 * v * (1.0 + torch.erf(v * 0.7071067811865476))

        def gelu_tanh(v):
            return 0.5 * v * (1.0 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))

        if op == "gelu":
            return lambda s: gelu_exact(s["x"].float()).to(s["x"].dtype)
        if op == "gelu_tanh":
            return lambda s: gelu_tanh(s["x"].float()).to(s["x"].dtype)
        return lambda s: gelu_exact(s["x"].float() + v["bias"].float()).to(s["x"].dtype)

    def error_vs_torch(self) -> float:
        """max |ours - F(fp32 copies of the inputs)| / rms(F) over every output, on the first input set."""
        torch = self.torch
        s = self.sets[0]
        self.ours(s)
        ref = self.eager({k: t.float() for k, t in s.items()}, {k: t.float() for k, t in self.vecs.items()})
        pairs = [(s["y"], ref[0] if isinstance(ref, tuple) else ref)]
        if isinstance(ref, tuple):
            pairs.append((s["sum"], ref[1]))
        err = 0.0
        for got, want in pairs:
            want = want.float()
            err = max(err, ((got.float() - want).abs().max() / want.pow(2).mean().sqrt()).item())
        torch.cuda.synchronize()
        return err


def _rotating(fn, sets: list, k: int) -> list:
    """k calls of fn, the i-th on input set i mod len(sets)."""
    return [functools.partial(fn, sets[i % len(sets)]) for i in range(k)]


def run_benchmarks(
    torch, lib, abi, args, copy_bps: float, results: list, compile_deadline: float, on_record=None
) -> None:
    dtypes = args.dtypes.split(",")
    ops = args.ops.split(",")
    compile_dtypes = set(args.compile_dtypes.split(","))
    if args.compile:
        _fresh_autotune(torch)
    for rows, hidden in args.shapes:
        for dtype in dtypes:
            for op in ops:
                rec = {"op": op, "dtype": dtype, "rows": rows, "hidden": hidden}
                try:
                    b = Bench(torch, lib, abi, op, dtype, rows, hidden)
                    rec.update(bytes=b.bytes, sets=len(b.sets))
                    k = b.calls_needed()

                    rec["max_err_vs_torch_fp32"] = b.error_vs_torch()

                    calls = _rotating(b.ours, b.sets, k)
                    t_ours, _ = time_graph(torch, calls, args.reps)
                    rec["ours_s"] = t_ours
                    rec["ours_bw"] = b.bytes / t_ours
                    rec["ours_frac_copy"] = b.bytes / t_ours / copy_bps

                    calls = _rotating(b.eager, b.sets, k)
                    try:
                        t_eager, mode = time_graph(torch, calls, args.reps)
                        rec["torch_s"] = t_eager
                        rec["torch_mode"] = mode
                        rec["speedup_vs_torch"] = t_eager / t_ours
                    except Exception as exc:
                        rec["torch_error"] = f"{exc.__class__.__name__}: {exc}"[:300]

                    if args.compile and dtype in compile_dtypes and time.monotonic() < compile_deadline:
                        try:
                            t0 = time.monotonic()
                            torch._dynamo.reset()  # a fresh cache: no recompile limit reached, no stale guards
                            compiled = torch.compile(b.decomposed(), dynamic=False)
                            calls = _rotating(compiled, b.sets, k)
                            t_comp, mode = time_graph(torch, calls, args.reps)
                            rec["compile_s"] = t_comp
                            rec["compile_mode"] = mode
                            rec["compile_wall_s"] = time.monotonic() - t0
                            rec["speedup_vs_compile"] = t_comp / t_ours
                        except Exception as exc:
                            rec["compile_error"] = f"{exc.__class__.__name__}: {exc}"[:300]
                    elif args.compile and dtype in compile_dtypes:
                        rec["compile_error"] = "skipped: compile time budget spent"
                except Exception as exc:  # keep going: one broken combination must not lose the others
                    rec["error"] = traceback.format_exc()[-1500:]
                    log(f"  ERROR {op} {dtype} {rows}x{hidden}: {exc.__class__.__name__}: {exc}")
                results.append(rec)
                log(_row(rec))
                if on_record:
                    on_record()
                b = calls = None  # free this shape's buffers before the next one
                torch.cuda.empty_cache()


def _tune(norm: tuple[int, ...] | None = None, gelu: tuple[int, int, int] | None = None, pdl: bool = True):
    """-D flags forcing the tuning knobs of kernels/src (NormTune and GeluTune in common.cuh).

    norm = (hints, min_threads[, block]), gelu = (hints, min_threads, group); None keeps the table of
    kernels/src/tuning_table.cuh for that family. pdl=False launches without programmatic dependent launch.
    """
    flags = []
    if norm is not None:
        flags += [f"-DMOGRAPH_NORM_HINTS={norm[0]}", f"-DMOGRAPH_NORM_MIN_THREADS={norm[1]}"]
        if len(norm) > 2:
            flags.append(f"-DMOGRAPH_NORM_BLOCK={norm[2]}")
    if gelu is not None:
        flags += [f"-DMOGRAPH_GELU_HINTS={gelu[0]}", f"-DMOGRAPH_GELU_MIN_THREADS={gelu[1]}",
                  f"-DMOGRAPH_GELU_GROUP={gelu[2]}"]  # fmt: skip
    if not pdl:
        flags.append("-DMOGRAPH_NO_PDL")
    return flags


# Candidates of --emit-tuning: each forces one norm setting (hints, min_threads, block) and one Gelu setting
# (hints, min_threads, group); norm and Gelu ops are timed separately, so each variant is two candidates.
# v13..v24 repeat the norm settings of v1..v12 with 64-thread blocks for rows that share blocks (their Gelu
# settings repeat v1..v12 too, so a sweep of v13..v24 needs no Gelu ops).
_TUNING_BASE = {
    "v1": ((1, 0), (1, 0, 1)),  # the choices before tuning, with programmatic dependent launch
    "v2": ((1, 1024), (1, 1024, 1)),
    "v3": ((1, 1280), (1, 1280, 1)),
    "v4": ((1, 1536), (0, 1280, 1)),
    "v5": ((0, 0), (0, 0, 1)),
    "v6": ((0, 1024), (0, 1024, 1)),
    "v7": ((0, 1280), (1, 0, 4)),
    "v8": ((0, 1536), (0, 0, 4)),
    "v9": ((2, 0), (1, 1024, 4)),
    "v10": ((2, 1024), (0, 1024, 4)),
    "v11": ((2, 1280), (1, 0, 8)),
    "v12": ((2, 1536), (0, 0, 8)),
}
# Candidates of the second stage of --emit-tuning: the layout choices of the norm kernel (gamma/beta loaded with
# the row; LayerNorm statistics from one merged reduction), each forced everywhere on top of the table's
# other settings. G0M0 is the baseline: gamma after the statistics, two reductions.
LAYOUT_VARIANTS = {"G0M0": (0, 0), "G1M0": (1, 0), "G0M1": (0, 1), "G1M1": (1, 1)}


# Candidates of the third stage: the cache hints of the norm activations, forced everywhere on top of the table's
# other settings (hints 4: Triton's evict_last loads with evict-first stores, see load_stream in common.cuh).
# "default" (the table as it is) is the baseline, so an entry changes only when a candidate beats what it has.
# Hints 3 (the same loads, plain stores) is a sweep variant only: as fast as 4 on most shapes in sweep s18, but
# 5-12% slower on four of them (bf16 LayerNorm 16384x768, fp16/bf16 LayerNorm 65536x1024, fp32/bf16
# SkipLayerNorm 4096x8192), where 4 never was.
# A candidate is (hints, min_threads, block); None keeps the entry's own. The h4m* variants also set the register
# cap and the block size of rows that share blocks (the tuning stage's other two settings, re-chosen with hints 4).
HINT_VARIANTS = {
    "h4": (4, None, None),
    **{f"h4m{m}b{b}": (4, m, b) for m in (0, 1024, 1280, 1536) for b in (128, 64)},
}
# Also third-stage candidates: the register kernel without its grid-stride loop (NormTune::one_pass), on top of
# each entry's other settings.
ONE_PASS_VARIANTS = {"NL": ["-DMOGRAPH_NORM_ONE_PASS=1"]}


def _hint_flags(setting: tuple, family: str = "NORM", third: str = "BLOCK") -> list[str]:
    """-D flags of a third-stage candidate (hints, min_threads, block or group); None leaves a setting out."""
    names = ("HINTS", "MIN_THREADS", third)
    return [f"-DMOGRAPH_{family}_{n}={v}" for n, v in zip(names, setting, strict=True) if v is not None]


# The same for the Gelu kernels, per dtype and form (geometric mean over the sizes): (hints, min_threads, group),
# None keeping the entry's own; gh3 is a sweep variant only.
GELU_HINT_VARIANTS = {
    "gh4": (4, None, None),
    **{f"gh4m{m}g{g}": (4, m, g) for m in (0, 1024) for g in (1, 4, 8)},
}


def _layout(gamma_early: int, merged: int) -> list[str]:
    return [f"-DMOGRAPH_NORM_GAMMA_EARLY={gamma_early}", f"-DMOGRAPH_NORM_MERGED={merged}"]


TUNING_VARIANTS = {
    **{name: ((*n, 128), g) for name, (n, g) in _TUNING_BASE.items()},
    **{f"v{int(name[1:]) + 12}": ((*n, 64), g) for name, (n, g) in _TUNING_BASE.items()},
}

SWEEP_VARIANTS = {
    "default": [],  # the shipped tuning table
    # the kernels as they were before tuning: evict-first hints, no register cap, contiguous Gelu chunks,
    # plain launches
    "legacy": _tune((1, 0, 128), (1, 0, 1), pdl=False),
    "nopdl": _tune(pdl=False),  # the shipped table without programmatic dependent launch (nor its instructions)
    **{name: _tune(n, g) for name, (n, g) in TUNING_VARIANTS.items()},
    "E8": ["-DMOGRAPH_NORM_MAX_ELEMS=8"],
    "E16": ["-DMOGRAPH_NORM_MAX_ELEMS=16"],
    "E32": ["-DMOGRAPH_NORM_MAX_ELEMS=32"],
    "H48": ["-DMOGRAPH_NORM_MAX_ELEMS_HALF=48"],  # fp16/bf16 LayerNorm/RMSNorm rows: up to 48 elements a thread
    "M0": ["-DMOGRAPH_NORM_MIN_THREADS=0"],  # the table without its register caps
    "nocs": ["-DMOGRAPH_NO_STREAMING_HINTS"],
    "flatbias": ["-DMOGRAPH_GELU_FLAT_BIAS"],
    **{name: _layout(*setting) for name, setting in LAYOUT_VARIANTS.items()},
    "B32np": _tune((1, 0, 32), pdl=False),  # one 32-thread block per row of up to 32 threads, no PDL
    "B32nph4": _tune((4, 0, 32), pdl=False),  # the same with hints 4
    "H48h4": ["-DMOGRAPH_NORM_MAX_ELEMS_HALF=48", "-DMOGRAPH_NORM_HINTS=4"],
    **ONE_PASS_VARIANTS,
    "h4NL": ["-DMOGRAPH_NORM_HINTS=4", "-DMOGRAPH_NORM_ONE_PASS=1"],  # both, everywhere (the untuned choice)
    # norm activations with Triton's hints: L1/L2 evict_last loads, plain (h3) or evict-first (h4) stores
    **{name: _hint_flags(h) for name, h in {"h3": (3, None, None), **HINT_VARIANTS}.items()},
    **{name: _hint_flags(h, "GELU", "GROUP") for name, h in {"gh3": (3, None, None), **GELU_HINT_VARIANTS}.items()},
}
"""Compile-time variants of the library for --sweep (see the MOGRAPH_* macros in kernels/src)."""


# ---- tuning table -------------------------------------------------------------------------------------------
_DTYPE_CODE = {"f32": 0, "f16": 1, "bf16": 2}
_KIND_CODE = {"layer_norm": 0, "rms_norm": 1, "skip_layer_norm": 2, "skip_rms_norm": 3}
_GELU_CODE = {"gelu": 0, "gelu_tanh": 1, "bias_gelu": 2}
_VPT_CHOICES = (1, 2, 3, 4, 6, 8)


def centered_op(op: str) -> bool:
    """Whether a norm op subtracts the mean (LayerNorm kinds), i.e. has two statistics to reduce."""
    return op in ("layer_norm", "skip_layer_norm")
# The norm kernel's choice for launch shapes without an entry (kNormUntuned in the emitted table): hints 4 and one
# pass, measured against hints 1 with the loop over 16 sizes outside the table (sweep s28; geometric mean 1.046,
# 0.94-1.28); also the starting point of an entry that a sweep adds.
UNTUNED_NORM = {"hints": 4, "min_threads": 0, "block": 128, "gamma_early": False, "merged": False, "one_pass": True}
TUNING_KEEP_MARGIN = 0.005  # a candidate must beat the untuned choice (v1) by this fraction to replace it


def norm_launch_shape(op: str, dtype: str, hidden: int) -> tuple[int, int] | None:
    """(threads per row, packs per thread) that kernels/src/norm.cuh launches for an aligned row of hidden."""
    esize = 4 if dtype == "f32" else 2
    vec = 16 // esize
    if hidden % vec:
        return None
    max_elems = 16 if (esize == 4 or op in ("skip_layer_norm", "skip_rms_norm")) else 32
    maxv = max(1, max_elems // vec)
    nvec = hidden // vec
    tpr = 4
    while tpr <= 1024 and nvec > tpr * maxv:
        tpr *= 2
    if tpr > 1024:
        return None
    need = -(-nvec // tpr)
    for vpt in _VPT_CHOICES:
        usable = vpt <= maxv and (tpr == 4 or 2 * vpt > maxv) and (tpr < 1024 or vpt * vec <= 16)
        if usable and vpt >= need:
            return tpr, vpt
    return None


def norm_entry_shape(op: str, dtype: str, hidden: int) -> tuple[int, int, bool] | None:
    """(threads per row, packs per thread, full) of the table entry that a row of hidden takes: full when the launch
    shape covers the row exactly (hidden == tpr * vpt * pack width); rows it covers in part run another instance
    (per-pack bounds tests, more registers) and have entries of their own."""
    shape = norm_launch_shape(op, dtype, hidden)
    if shape is None:
        return None
    return (*shape, shape[0] * shape[1] * (16 // (4 if dtype == "f32" else 2)) == hidden)


_NORM_ENTRY = re.compile(
    r"if \(dtype == (\d) && kind == (\d) && tpr == (\d+) && vpt == (\d+) && (!?)full\) "
    r"return \{(kHints\w+), (\d+), (\d+)(?:, (true|false), (true|false)(?:, (true|false))?)?\};\s*// (.*)$"
)
_HINT_NAME = {0: "kHintsNone", 1: "kHintsStream", 2: "kHintsLoad", 3: "kHintsL2Last", 4: "kHintsL2LastCs"}
_HINT_CODE = {v: k for k, v in _HINT_NAME.items()}


def read_norm_table(path: Path) -> dict:
    """The norm entries of a tuning_table.cuh written by emit_tuning.

    Returns {(dtype, op, (tpr, vpt, full)): entry} (see norm_entry_shape), entry a dict of hints, min_threads, block, gamma_early, merged,
    one_pass, cases (the benchmarked sizes it was chosen on), tuning, layout and hint (the chosen variants' names; hint is
    "" when the third stage kept the tuning stage's hints).
    """
    dtypes = {v: k for k, v in _DTYPE_CODE.items()}
    kinds = {v: k for k, v in _KIND_CODE.items()}
    out = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        m = _NORM_ENTRY.search(line.strip())
        if not m:
            continue
        d, k, tpr, vpt, partial, hints, min_threads, block, gamma, merged, one_pass, note = m.groups()
        cases, _, names = note.rpartition(": ")
        tuning, layout, hint = (names.split(", ") + ["", ""])[:3]
        out[(dtypes[int(d)], kinds[int(k)], (int(tpr), int(vpt), not partial))] = {
            "hints": _HINT_CODE[hints],
            "min_threads": int(min_threads),
            "block": int(block),
            "gamma_early": gamma == "true",
            "merged": merged == "true",
            "one_pass": one_pass == "true",
            "cases": cases.split(" ", 2)[-1] if cases else "",
            "tuning": tuning or "v1",
            "layout": layout or "G0M0",
            "hint": hint,
        }
    return out


_GELU_ENTRY = re.compile(
    r"if \(dtype == (\d) && (?:\(op == 2 \|\| op == 3\)|op == (\d))\) return \{(kHints\w+), (\d+), (\d+)\};"
    r"\s*// (\w+) (\w+)(?:: (\w+))?$"
)


def read_gelu_table(path: Path) -> dict:
    """The Gelu entries of a tuning_table.cuh: {(dtype, op): {hints, min_threads, group, hint}} in file order."""
    out = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        m = _GELU_ENTRY.search(line.strip())
        if m:
            _, _, hints, min_threads, group, op, dtype, hint = m.groups()
            out[(dtype, op)] = {"hints": _HINT_CODE[hints], "min_threads": int(min_threads), "group": int(group),
                                "hint": hint or ""}  # fmt: skip
    return out


def _pick(means: dict, baseline):
    """The key with the smallest mean log time ratio, or baseline unless that one is TUNING_KEEP_MARGIN faster."""
    best = min(means, key=means.get)
    return baseline if math.exp(means[best]) > 1 - TUNING_KEEP_MARGIN else best


def _best_per_key(sweep: list, names: list[str], baseline: str) -> tuple[dict, dict]:
    """Per norm table key (dtype, op, (tpr, vpt, full)): the variant with the best geometric mean of time / baseline
    over the benchmarked sizes of that shape, replaced by the baseline unless it is TUNING_KEEP_MARGIN faster.
    Returns ({key: (name, time ratio)}, {key: [sizes]})."""
    scores: dict = {}
    cases: dict = {}
    for r in sweep:
        if "op" not in r or r["op"] not in _KIND_CODE:
            continue
        times = {n: r[n]["s"] for n in names if isinstance(r.get(n), dict) and "s" in r[n]}
        if not centered_op(r["op"]):  # merged layouts: the same code as unmerged ones for the RMS kinds
            times = {n: t for n, t in times.items() if n not in LAYOUT_VARIANTS or not LAYOUT_VARIANTS[n][1]}
        if baseline not in times:
            continue
        shape = norm_entry_shape(r["op"], r["dtype"], r["hidden"])
        if shape is None:
            continue
        key = (r["dtype"], r["op"], shape)
        cases.setdefault(key, []).append(f"{r['rows']}x{r['hidden']}")
        for n, t in times.items():
            scores.setdefault(key, {}).setdefault(n, []).append(math.log(t / times[baseline]))
    best = {}
    for key, by_variant in scores.items():
        means = {n: sum(v) / len(v) for n, v in by_variant.items() if len(v) == len(cases[key])}
        name = _pick(means, baseline)
        best[key] = (name, math.exp(means[name]))
    return best, cases


def _norm_init(e: dict) -> str:
    """The C++ initializer of a NormTune (one_pass written only when set)."""
    flags = f"{'true' if e['gamma_early'] else 'false'}, {'true' if e['merged'] else 'false'}"
    if e.get("one_pass"):
        flags += ", true"
    return f"{{{_HINT_NAME[e['hints']]}, {e['min_threads']}, {e['block']}, {flags}}}"


def emit_tuning(sweep: list, out_path: Path, source: str) -> str:
    """Choose table entries from a sweep and rewrite kernels/src/tuning_table.cuh (``out_path``).

    Three kinds of sweep, any of them in one file, each measured on top of the table it updates:
    TUNING_VARIANTS (v1 the baseline) choose the norm kernel's hints, register cap and block size per
    (dtype, op, threads per row, packs per thread), and the Gelu settings per (dtype, form) by the geometric
    mean over the sizes; LAYOUT_VARIANTS choose the norm kernel's layout (gamma/beta loaded with the row, merged
    LayerNorm statistics) per launch shape, against G0M0, or against the table as it is when the sweep has the
    "default" variant too; HINT_VARIANTS and ONE_PASS_VARIANTS (and GELU_HINT_VARIANTS for Gelu) against
    "default" change an entry's hints (cap, block, group) or drop its grid-stride loop. What a sweep did not
    time is kept from the current table. A candidate replaces the baseline only when faster by
    TUNING_KEEP_MARGIN. Returns a text summary.
    """
    present = {n for r in sweep if "op" in r for n in r}
    tuning_names = [n for n in TUNING_VARIANTS if n in present]
    layout_names = [n for n in LAYOUT_VARIANTS if n in present]
    hint_names = [n for n in (*HINT_VARIANTS, *ONE_PASS_VARIANTS) if n in present]
    gelu_hint_names = [n for n in GELU_HINT_VARIANTS if n in present]
    if (hint_names or gelu_hint_names) and "default" not in present:
        raise ValueError("the sweep has hint variants but no default variant (the table as it is)")
    if hint_names:
        hint_names = ["default", *hint_names]
    if not tuning_names and not layout_names and not hint_names and not gelu_hint_names:
        raise ValueError("the sweep has no v1 variant, no G0M0 variant and no hint variant: nothing to choose from")
    if tuning_names and "v1" not in tuning_names:
        raise ValueError("the sweep has no v1 variant")
    if layout_names and "G0M0" not in layout_names:
        raise ValueError("the sweep has no G0M0 variant")
    # With the table as it is in the sweep too, a layout replaces an entry's own only when faster than it.
    layout_baseline = "default" if layout_names and "default" in present else "G0M0"
    if layout_baseline == "default":
        layout_names = ["default", *layout_names]
    entries = read_norm_table(out_path)
    default = {**UNTUNED_NORM, "cases": "", "tuning": "v1", "layout": "G0M0", "hint": ""}
    summary = []
    for names, baseline in ((tuning_names, "v1"), (layout_names, layout_baseline), (hint_names, "default")):
        if not names:
            continue
        best, cases = _best_per_key(sweep, names, baseline)
        layout_stage = names is layout_names
        for key, (name, ratio) in best.items():
            e = entries.setdefault(key, dict(default))
            e["cases"] = ", ".join(cases[key])
            if baseline == "v1":
                e["hints"], e["min_threads"], e["block"] = TUNING_VARIANTS[name][0]
                e["tuning"] = name
                e["hint"] = ""  # the tuning stage sets the hints
            elif layout_stage:
                if name != "default":
                    gamma, merged = LAYOUT_VARIANTS[name]
                    e["gamma_early"], e["merged"] = bool(gamma), bool(merged)
                    e["layout"] = f"G{gamma}M{merged}"
            elif baseline == "default":
                if name in ONE_PASS_VARIANTS:
                    e["one_pass"] = True
                    tags = [t for t in e["hint"].split("+") if t and t != name]
                    e["hint"] = "+".join([*tags, name])
                elif name != "default":
                    hints, min_threads, block = HINT_VARIANTS[name]
                    e["hints"] = hints
                    e["min_threads"] = e["min_threads"] if min_threads is None else min_threads
                    e["block"] = e["block"] if block is None else block
                    e["hint"] = "+".join([name, *(t for t in e["hint"].split("+") if t in ONE_PASS_VARIANTS)])
            dtype, op, shape = key
            summary.append(f"{op:<16}{dtype:<5}{e['cases']:<22} tpr={shape[0]:<4} vpt={shape[1]}"
                           f"{'' if shape[2] else ' partial'} -> {name}: "
                           f"time / {baseline} {ratio:.3f}")  # fmt: skip

    gelu_scores: dict = {}
    for r in sweep:
        if "op" not in r or r["op"] not in _GELU_CODE:
            continue
        times = {n: r[n]["s"] for n in tuning_names if isinstance(r.get(n), dict) and "s" in r[n]}
        if "v1" not in times:
            continue
        for n, t in times.items():
            gelu_scores.setdefault((r["dtype"], r["op"]), {}).setdefault(TUNING_VARIANTS[n][1], []).append(
                math.log(t / times["v1"])
            )
    gelu = read_gelu_table(out_path)
    for (dtype, op), by_setting in sorted(gelu_scores.items()):
        means = {k: sum(v) / len(v) for k, v in by_setting.items()}
        best = _pick(means, TUNING_VARIANTS["v1"][1])
        gelu[(dtype, op)] = {"hints": best[0], "min_threads": best[1], "group": best[2], "hint": ""}
        summary.append(f"{op:<16}{dtype:<5} -> hints {best[0]}, min_threads {best[1]}, group {best[2]}: "
                       f"time / v1 {math.exp(means[best]):.3f} (geometric mean over shapes)")  # fmt: skip
    # Gelu hint stage: per dtype and form, a hint variant replaces the entry's hints when faster in geometric mean.
    hint_scores: dict = {}
    for r in sweep:
        if "op" not in r or r["op"] not in _GELU_CODE or not gelu_hint_names:
            continue
        times = {n: r[n]["s"] for n in ["default", *gelu_hint_names] if isinstance(r.get(n), dict) and "s" in r[n]}
        if "default" not in times:
            continue
        for n, t in times.items():
            hint_scores.setdefault((r["dtype"], r["op"]), {}).setdefault(n, []).append(math.log(t / times["default"]))
    for key, by_name in sorted(hint_scores.items()):
        if key not in gelu:
            raise ValueError(f"the sweep times Gelu hints for {key} but the table has no entry for it")
        means = {n: sum(v) / len(v) for n, v in by_name.items() if len(v) == len(by_name["default"])}
        name = _pick(means, "default")
        if name != "default":
            hints, min_threads, group = GELU_HINT_VARIANTS[name]
            gelu[key]["hints"], gelu[key]["hint"] = hints, name
            if min_threads is not None:
                gelu[key]["min_threads"] = min_threads
            if group is not None:
                gelu[key]["group"] = group
        summary.append(f"{key[1]:<16}{key[0]:<5} -> {name}: time / default {math.exp(means[name]):.3f} "
                       "(geometric mean over shapes)")  # fmt: skip
    gelu_rows = [] if not gelu_scores and not hint_scores else list(gelu.items())

    lines = [
        "// tuning_table.cuh - launch choices per dtype, op and row shape (see NormTune / GeluTune in common.cuh).",
        "//",
        "// Generated by tools/gpu_kernels.py --emit-tuning from sweeps of its TUNING_VARIANTS, LAYOUT_VARIANTS and",
        f"// HINT_VARIANTS (last: {source}).",
        "// A third name after a norm entry, a name after a Gelu entry: the third-stage variants that replaced its",
        "// hints (and cap, block or group) or dropped its grid-stride loop (NL).",
        "// Norms: per launch shape (threads per row, packs per thread) of a benchmarked size, the fastest setting",
        "// there; other launch shapes get kNormUntuned. Gelu: per dtype and form, the setting with the best",
        f"// geometric mean over the sizes. A setting replaces the untuned one only when {TUNING_KEEP_MARGIN:.1%} faster.",
        "// Do not edit by hand: sweep again.",
        "#pragma once",
        "",
        '#include "common.cuh"',
        "",
        "namespace mograph {",
        "",
        "// dtype: 0 fp32, 1 fp16, 2 bf16; kind: 0 LayerNorm, 1 RMSNorm, 2 SkipLayerNorm, 3 SkipRMSNorm;",
        "// tpr, vpt: threads per row and 16-byte packs per thread of the register kernel; full: the row is exactly",
        "// tpr * vpt packs (rows covered in part run an instance with bounds tests, tuned apart);",
        "// {hints, min_threads, block, gamma_early, merged[, one_pass]}: see NormTune.",
        f"constexpr NormTune kNormUntuned = {_norm_init(UNTUNED_NORM)};  // launch shapes without an entry",
        "constexpr NormTune norm_table(int dtype, int kind, int tpr, int vpt, bool full) {",
    ]
    order = {k: i for i, k in enumerate(entries)}
    for (dtype, op, (tpr, vpt, full)), e in sorted(entries.items(), key=lambda kv: order[kv[0]]):
        lines.append(
            f"    if (dtype == {_DTYPE_CODE[dtype]} && kind == {_KIND_CODE[op]} && tpr == {tpr} && vpt == {vpt} && "
            f"{'' if full else '!'}full) "
            f"return {_norm_init(e)};"
            f"  // {op} {dtype} {e['cases']}: {e['tuning']}, {e['layout']}" + (f", {e['hint']}" if e["hint"] else "")
        )
    lines += ["    return kNormUntuned;", "}", ""]
    if not gelu_rows:  # no Gelu stage in this sweep: the Gelu entries stay as they are, verbatim
        old_text = out_path.read_text() if out_path.is_file() else ""
        start = old_text.find("// op: 0 Gelu")
        end = old_text.find("}  // namespace mograph")
        if start < 0 or end < 0:
            raise ValueError("the sweep has no Gelu ops and the current table has no Gelu entries to keep")
        kept = old_text[start:end].rstrip("\n").split("\n")
        note = "// Gelu entries: kept from the table this one replaced (the sweep above timed the norm ops only)."
        lines += [note, *kept]
        lines += ["", "}  // namespace mograph", ""]
        out_path.write_text("\n".join(lines))
        return "\n".join(summary)
    lines += [
        "// op: 0 Gelu, 1 Gelu (tanh), 2 BiasGelu, 3 BiasGelu (tanh; takes the exact form's entry).",
        "constexpr GeluTune gelu_table(int dtype, int op) {",
    ]
    for (dtype, op), g in gelu_rows:
        code = _GELU_CODE[op]
        cond = "(op == 2 || op == 3)" if code == 2 else f"op == {code}"
        lines.append(
            f"    if (dtype == {_DTYPE_CODE[dtype]} && {cond}) "
            f"return {{{_HINT_NAME[g['hints']]}, {g['min_threads']}, {g['group']}}};"
            f"  // {op} {dtype}" + (f": {g['hint']}" if g["hint"] else "")
        )
    lines += ["    return {kHintsStream, 0, 1};", "}", "", "}  // namespace mograph", ""]
    out_path.write_text("\n".join(lines))
    return "\n".join(summary)


def sweep_library_path(name: str) -> Path:
    return ROOT / "kernels" / "build" / f"sweep_{name}" / "libmograph_kernels.so"


def build_sweep_variants(build, names: list[str], log_fn=None) -> dict[str, Path]:
    """Build each variant for sm_90 only into kernels/build/sweep_<name> (in parallel); returns the paths."""

    def build_variant(name: str) -> Path:
        out_dir = sweep_library_path(name).parent
        return build.build(archs=("90",), ptx=(), build_dir=out_dir, extra_flags=SWEEP_VARIANTS[name], log=log_fn)

    with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        return dict(zip(names, pool.map(build_variant, names)))


def run_sweep(torch, abi, build, harness, args, copy_bps: float, on_record=None, main_lib=None, out=None) -> list:
    """Time our kernels in several compile-time variants side by side.

    Each variant is built for sm_90 only into kernels/build/sweep_<name> ("default": the shipped tuning), or
    with --prebuilt taken from there as it is ("default" then falls back to the main library). Variants named
    by --sweep-grid (default: all) are also run through the correctness grid; every timed case records its
    error against torch in fp32. The first variant is the reference of the closing summary.
    """
    names = args.sweep.split(",")
    t0 = time.monotonic()
    paths = {}
    missing = []
    for nm in names:
        if args.prebuilt and sweep_library_path(nm).is_file():
            paths[nm] = sweep_library_path(nm)
        elif args.prebuilt and nm == "default" and main_lib is not None:
            paths[nm] = Path(main_lib)
        else:
            missing.append(nm)
    if missing:
        paths.update(build_sweep_variants(build, missing))
    log(f"sweep: {len(names) - len(missing)} prebuilt, built {len(missing)} variants in {time.monotonic() - t0:.1f}s")
    libs = {nm: abi.load(paths[nm]) for nm in names}
    backend, _ = harness.find_backend()
    out = [] if out is None else out
    grid_names = names if args.sweep_grid == "all" else [n for n in args.sweep_grid.split(",") if n in libs]
    for nm in grid_names:
        lib = libs[nm]
        cases = harness.make_grid(rows=args.grid_rows)
        bad = [c.label for i, c in enumerate(cases) if not harness.check_case(lib, backend, c, seed=i).ok]
        out.append({"variant": nm, "grid_cases": len(cases), "grid_failures": bad})
        log(f"sweep {nm}: correctness {len(cases) - len(bad)}/{len(cases)}" + (f" FAIL {bad[:5]}" if bad else ""))
    ops = args.sweep_ops.split(",")
    header = f"{'op':<16}{'dtype':<6}{'shape':>12}" + "".join(f"{nm[:9] + ' us':>12}{'/copy':>7}" for nm in names)
    log(header)
    lines = [header]
    for rows, hidden in args.shapes:
        for dtype in args.sweep_dtypes.split(","):
            for op in ops:
                rec = {"op": op, "dtype": dtype, "rows": rows, "hidden": hidden}
                line = f"{op:<16}{dtype:<6}{str(rows) + 'x' + str(hidden):>12}"
                b = Bench(torch, libs[names[0]], abi, op, dtype, rows, hidden)
                k = b.calls_needed()
                for nm in names:
                    b.lib = libs[nm]
                    b.fn = getattr(libs[nm], abi.symbol(b.kernel_op, dtype))
                    try:
                        err = b.error_vs_torch()
                        t, mode = time_graph(torch, _rotating(b.ours, b.sets, k), args.sweep_reps)
                        rec[nm] = {"s": t, "frac_copy": b.bytes / t / copy_bps, "err": err, "mode": mode}
                        line += f"{t * 1e6:>12.1f}{b.bytes / t / copy_bps:>7.3f}"
                    except Exception as exc:
                        rec[nm] = {"error": f"{exc.__class__.__name__}: {exc}"[:300]}
                        line += f"{'ERR':>12}{'':>7}"
                out.append(rec)
                log(line)
                lines.append(line)
                if on_record:
                    on_record()
                b = None
                torch.cuda.empty_cache()
    # summary: per variant, geometric mean of (time of the first variant / time of this one)
    timed = [r for r in out if "op" in r]
    summary = []
    for nm in names:
        ratios = [r[names[0]]["s"] / r[nm]["s"] for r in timed if "s" in r.get(nm, {}) and "s" in r.get(names[0], {})]
        if ratios:
            g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            summary.append(f"{nm}: {g:.3f} ({min(ratios):.3f}..{max(ratios):.3f}) over {len(ratios)} cases")
    out.append({"summary_vs_first": summary})
    log("sweep speed-up over " + names[0] + " (geometric mean, range): " + "; ".join(summary))
    return out


def _fresh_autotune(torch) -> None:
    """Make torch.compile autotune in this process instead of reusing autotuning results stored on disk.

    Set the same way in the compile workers and the benchmark (the setting is part of the cache key of the
    compiled graphs), so the benchmark reuses the workers' compiled code but picks its kernel configurations
    itself, on a quiet GPU.
    """
    try:
        cfg = importlib.import_module("torch._inductor.config")
    except ImportError:
        return
    if hasattr(cfg, "autotune_local_cache"):
        cfg.autotune_local_cache = False


def prewarm_compile(args) -> None:
    """Fill the torch.compile caches (FX graph + Triton) for every benchmarked case, in parallel processes.

    The benchmark itself then compiles from the caches (and autotunes again, see run_benchmarks), which saves
    minutes of a GPU lease; the compiled code is the same.
    """
    n = args.prewarm_compile
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    t0 = time.monotonic()
    procs = []
    for i in range(n):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-worker", f"{i}/{n}",
               "--dtypes", args.dtypes, "--ops", args.ops, "--compile-dtypes", args.compile_dtypes,
               "--shapes", ",".join(f"{r}x{h}" for r, h in args.shapes)]  # fmt: skip
        if args.lib:
            cmd += ["--lib", str(args.lib)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for i, p in enumerate(procs):
        out, _ = p.communicate()
        if p.returncode != 0:
            log(f"  compile worker {i}/{n} failed ({p.returncode}): {out[-800:]}")
    log(f"prewarm: {n} compile workers done in {time.monotonic() - t0:.1f}s")


def compile_worker(args) -> int:
    i, n = (int(v) for v in args.compile_worker.split("/"))
    import torch

    _fresh_autotune(torch)
    abi = _load("abi")
    build = _load("build")
    lib = abi.load(args.lib or build.default_library_path())
    compile_dtypes = set(args.compile_dtypes.split(","))
    combos = [(rows, hidden, dtype, op) for rows, hidden in args.shapes for dtype in args.dtypes.split(",")
              for op in args.ops.split(",") if dtype in compile_dtypes]  # fmt: skip
    for j, (rows, hidden, dtype, op) in enumerate(combos):
        if j % n != i:
            continue
        b = Bench(torch, lib, abi, op, dtype, rows, hidden)
        torch._dynamo.reset()
        compiled = torch.compile(b.decomposed(), dynamic=False)
        compiled(b.sets[0])
        torch.cuda.synchronize()
        b = compiled = None
        torch.cuda.empty_cache()
    return 0


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


HEADER = (
    f"{'op':<16}{'dtype':<6}{'shape':>12}{'ours us':>10}{'GB/s':>8}{'/copy':>7}"
    f"{'torch us':>10}{'x torch':>9}{'compile us':>12}{'x comp':>8}{'err':>10}"
)


def _row(r: dict) -> str:
    return (
        f"{r['op']:<16}{r['dtype']:<6}{str(r['rows']) + 'x' + str(r['hidden']):>12}"
        f"{_fmt(r.get('ours_s', 0) * 1e6, '.1f'):>10}{_fmt(r.get('ours_bw', 0) / 1e9, '.0f'):>8}"
        f"{_fmt(r.get('ours_frac_copy'), '.3f'):>7}"
        f"{_fmt(r.get('torch_s', float('nan')) * 1e6, '.1f'):>10}{_fmt(r.get('speedup_vs_torch'), '.2f'):>9}"
        f"{_fmt(r.get('compile_s', float('nan')) * 1e6, '.1f'):>12}{_fmt(r.get('speedup_vs_compile'), '.2f'):>8}"
        f"{_fmt(r.get('max_err_vs_torch_fp32'), '.2e'):>10}"
    )


def run_correctness(lib, harness, backend, args) -> list:
    cases = harness.make_grid(rows=args.grid_rows)
    out = []
    failures = 0
    t0 = time.monotonic()
    for i, case in enumerate(cases):
        try:
            res = harness.check_case(lib, backend, case, seed=i)
            rec = {"case": case.label, "ok": res.ok, "err": res.max_scaled_err, "tol": res.tolerance,
                   "message": res.message}  # fmt: skip
        except Exception as exc:
            rec = {"case": case.label, "ok": False, "err": None, "message": f"{exc.__class__.__name__}: {exc}"}
        out.append(rec)
        if not rec["ok"]:
            failures += 1
            log(f"  FAIL {rec['case']}: {rec['message']}")
    worst = {}
    for rec in out:
        dt = rec["case"].split("[")[1].split(",")[0]
        if rec["err"] is not None:
            worst[dt] = max(worst.get(dt, 0.0), rec["err"])
    log(
        f"correctness: {len(cases) - failures}/{len(cases)} cases pass in {time.monotonic() - t0:.1f}s; "
        f"worst scaled error per dtype: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lib", type=Path, default=None, help="use this library instead of building")
    parser.add_argument("--arch", default="80,90", help="machine-code archs for the build (default: %(default)s)")
    parser.add_argument("--no-correctness", dest="correctness", action="store_false")
    parser.add_argument("--no-bench", dest="bench", action="store_false")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile baseline")
    parser.add_argument("--compile-budget", type=float, default=240.0, help="seconds for torch.compile baselines")
    parser.add_argument("--compile-dtypes", default="f16,f32,bf16", help="dtypes that get a torch.compile baseline")
    parser.add_argument("--dtypes", default="f16,f32,bf16")
    parser.add_argument("--ops", default=",".join(BENCH_OPS))
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=list(SHAPES),
        help="benchmark and sweep shapes, ROWSxHIDDEN,... (default: " + ",".join(f"{r}x{h}" for r, h in SHAPES) + ")",
    )
    parser.add_argument("--reps", type=int, default=25, help="timed graph replays per candidate")
    parser.add_argument("--grid-rows", type=int, default=67)
    parser.add_argument(
        "--sweep",
        default="",
        help=f"comma-separated norm-kernel variants to build and time side by side: {', '.join(SWEEP_VARIANTS)}",
    )
    parser.add_argument("--sweep-dtypes", default="f16,f32,bf16")
    parser.add_argument("--sweep-ops", default=",".join(BENCH_OPS))
    parser.add_argument("--sweep-reps", type=int, default=25, help="timed graph replays per sweep candidate")
    parser.add_argument("--sweep-grid", default="all", help="variants to run through the correctness grid, or all")
    parser.add_argument(
        "--prebuilt",
        action="store_true",
        help="use kernels/build/sweep_<name> libraries that exist instead of building",
    )
    parser.add_argument(
        "--prewarm-compile",
        type=int,
        default=0,
        metavar="N",
        help="first fill the torch.compile caches for every case with N parallel processes",
    )
    parser.add_argument(
        "--prewarm-only", action="store_true", help="only run the --prewarm-compile step (needs a built library)"
    )
    parser.add_argument("--sweep-only", action="store_true", help="stop after the sweep (no benchmark table)")
    parser.add_argument("--build-variants", default="", help="only build these sweep variants (comma-separated)")
    parser.add_argument(
        "--emit-tuning",
        type=Path,
        default=None,
        metavar="JSON",
        help="only write kernels/src/tuning_table.cuh (or --tuning-out) from the sweep in this results file",
    )
    parser.add_argument("--tuning-out", type=Path, default=ROOT / "kernels" / "src" / "tuning_table.cuh")
    parser.add_argument("--compile-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="write results here (default: $OUT/gpu_kernels.json)")
    args = parser.parse_args(argv)
    if args.compile_worker:
        return compile_worker(args)
    if args.prewarm_only:
        prewarm_compile(args)
        return 0
    if args.emit_tuning:
        data = json.loads(args.emit_tuning.read_text())
        dev = data.get("info", {})
        source = f"{dev.get('device', '?')}, torch {dev.get('torch', '?')}, {args.emit_tuning.name}"
        log(emit_tuning(data.get("sweep", []), args.tuning_out, source))
        log(f"wrote {args.tuning_out}")
        return 0
    if args.build_variants:
        for nm, path in build_sweep_variants(_load("build"), args.build_variants.split(","), log).items():
            log(f"{nm}: {path}")
        return 0

    import torch

    if not torch.cuda.is_available():
        log("no CUDA GPU visible to torch: nothing to do")
        return 2
    abi = _load("abi")
    build = _load("build")
    harness = _load("harness")
    props = torch.cuda.get_device_properties(0)
    info = {
        "device": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    log(f"device: {info}")
    json_path = args.json or (Path(os.environ["OUT"]) / "gpu_kernels.json" if os.environ.get("OUT") else None)
    results: dict = {"info": info}

    def save():
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(results, indent=1))

    t0 = time.monotonic()
    lib_path = args.lib or build.build(archs=tuple(args.arch.split(",")), log=log)
    results["build_s"] = time.monotonic() - t0
    lib = abi.load(lib_path)
    log(f"library: {lib_path} ({results['build_s']:.1f}s)")

    if args.correctness:
        backend, why = harness.find_backend()
        results["correctness"] = run_correctness(lib, harness, backend, args)
        save()

    if args.bench:
        copies = copy_bandwidth(torch, args.reps)
        copy_bps = copies["best"]
        results["copy_bytes_per_s"] = copies
        log("copy bandwidth (read + write, 1 GiB): " + ", ".join(f"{k} {v / 1e9:.0f} GB/s" for k, v in copies.items()))
        if args.sweep:
            results["sweep"] = []
            run_sweep(torch, abi, build, harness, args, copy_bps, save, main_lib=lib_path, out=results["sweep"])
            save()
            if args.sweep_only:
                return 0
        if args.compile and args.prewarm_compile > 0:
            prewarm_compile(args)
        bench: list = []
        results["bench"] = bench
        log(HEADER)
        try:
            run_benchmarks(torch, lib, abi, args, copy_bps, bench, time.monotonic() + args.compile_budget, save)
        finally:
            save()
        after = copy_bandwidth(torch, args.reps)
        results["copy_bytes_per_s_after"] = after
        log("")
        log(
            f"copy bandwidth {copy_bps / 1e9:.0f} GB/s before, {after['best'] / 1e9:.0f} GB/s after the benchmarks; "
            "x torch / x comp = time of torch / time of ours (>1: ours faster); err = max |ours - F(fp32)| / rms"
        )
        log(HEADER)
        for rec in bench:
            log(_row(rec))
    save()
    if args.correctness and not all(r["ok"] for r in results["correctness"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
