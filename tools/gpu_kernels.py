"""Build, check and benchmark mograph's CUDA kernels on a GPU machine, in one run.

    python tools/gpu_kernels.py                 # build + correctness grid + benchmark, table at the end
    python tools/gpu_kernels.py --no-compile    # skip the torch.compile baseline (its compiles take minutes)
    python tools/gpu_kernels.py --prewarm-compile 8             # compile the baselines in 8 processes first
    python tools/gpu_kernels.py --lib new.so --baseline-lib old.so --table mograph/_kernels/BENCHMARKS.md
                                                # our kernels from two builds side by side, and against the table

Steps:
  1. build ``mograph/_kernels/build/libmograph_kernels.so`` with nvcc (``mograph._kernels.build``);
  2. the correctness grid of ``mograph._kernels.harness`` (every op x fp32/fp16/bf16 x hidden in
     {64, 768, 1000, 1024, 4096, 8192, 33, ...}, options, misaligned pointers) against the numpy reference;
  3. benchmarks at 16384x768, 65536x1024, 16384x4096 and 4096x8192: each kernel's time, its achieved
     bandwidth (bytes it must read and write / time) as a fraction of the device-to-device copy bandwidth
     measured in the same run, and its speed-up over torch.nn.functional and over torch.compile of the
     decomposed formula. Each kernel's output is also compared with torch's at those shapes. With
     ``--baseline-lib`` step 3 is instead our kernels from this build and from that library, side by side
     (see :func:`run_compare`).

The kernels' launch choices are frozen (``mograph/_kernels/src/launch_table.cuh``): this tool measures them,
it does not tune them.

Timing: every candidate is warmed up, then K calls are captured in a CUDA graph (so Python and ctypes
launch overhead does not hide the GPU time), the graph is replayed between CUDA events, and the median of
many replays / K is the time of one call. Calls rotate over enough input/output sets that their bytes
exceed the L2 cache several times, so the numbers are HBM numbers, not cache numbers.

Output: progress lines, then a table; with ``--json PATH`` or ``$OUT`` set, the full results as JSON
(``$OUT/gpu_kernels.json``). Needs torch with CUDA and nvcc (or ``--lib``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from mograph._kernels import abi, build, harness

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


def read_table(path: Path) -> dict[tuple[str, str, int, int], float]:
    """The "ours µs" column of a BENCHMARKS.md final table: (op, dtype, rows, hidden) -> seconds."""
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] not in BENCH_OPS or "x" not in cells[2]:
            continue
        rows, hidden = (int(v) for v in cells[2].split("x"))
        out[(cells[0], cells[1], rows, hidden)] = float(cells[3]) * 1e-6
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def run_compare(torch, lib, base_lib, args, copy_bps: float, out: list, on_record=None) -> dict:
    """Our kernels from two libraries, side by side: this build and ``--baseline-lib`` (e.g. an older commit's).

    Each case is timed four times in the order base, new, new, base (so drifts of the clocks or the
    neighbours weigh on both alike); a library's time is the mean of its two medians. Returns the summary:
    the geometric mean of new / base time over the cases (below 1: the new build is faster), its range and
    the highest cases; with ``--table`` also new time / the table's "ours µs".
    """
    table = read_table(args.table) if args.table else {}
    log(f"{'op':<16}{'dtype':<6}{'shape':>12}{'base us':>10}{'new us':>10}{'new/base':>10}{'/copy':>7}{'new/table':>11}")
    for rows, hidden in args.shapes:
        for dtype in args.dtypes.split(","):
            for op in args.ops.split(","):
                rec: dict = {"op": op, "dtype": dtype, "rows": rows, "hidden": hidden}
                try:
                    b = Bench(torch, lib, abi, op, dtype, rows, hidden)
                    k = b.calls_needed()
                    times: dict[str, list[float]] = {"base": [], "new": []}
                    for name in ("base", "new", "new", "base"):
                        b.lib = base_lib if name == "base" else lib
                        b.fn = getattr(b.lib, abi.symbol(b.kernel_op, dtype))
                        if not times[name]:
                            rec[f"{name}_err_vs_torch_fp32"] = b.error_vs_torch()
                        t, _ = time_graph(torch, _rotating(b.ours, b.sets, k), args.reps)
                        times[name].append(t)
                    rec["base_s"] = statistics.fmean(times["base"])
                    rec["new_s"] = statistics.fmean(times["new"])
                    rec["runs_s"] = times
                    rec["new_over_base"] = rec["new_s"] / rec["base_s"]
                    rec["new_frac_copy"] = b.bytes / rec["new_s"] / copy_bps
                    key = (op, dtype, rows, hidden)
                    if key in table:
                        rec["table_s"] = table[key]
                        rec["new_over_table"] = rec["new_s"] / table[key]
                except Exception as exc:  # keep going: one broken combination must not lose the others
                    rec["error"] = traceback.format_exc()[-1500:]
                    log(f"  ERROR {op} {dtype} {rows}x{hidden}: {exc.__class__.__name__}: {exc}")
                out.append(rec)
                log(
                    f"{op:<16}{dtype:<6}{str(rows) + 'x' + str(hidden):>12}{_fmt(rec.get('base_s', 0) * 1e6, '.1f'):>10}"
                    f"{_fmt(rec.get('new_s', 0) * 1e6, '.1f'):>10}{_fmt(rec.get('new_over_base'), '.3f'):>10}"
                    f"{_fmt(rec.get('new_frac_copy'), '.3f'):>7}{_fmt(rec.get('new_over_table'), '.3f'):>11}"
                )
                if on_record:
                    on_record()
                b = None  # free this shape's buffers before the next one
                torch.cuda.empty_cache()
    summary: dict = {}
    for key in ("new_over_base", "new_over_table"):
        recs = [r for r in out if key in r]
        if not recs:
            continue
        ratios = [r[key] for r in recs]
        worst = sorted(recs, key=lambda r: -r[key])[:5]
        summary[key] = {
            "geomean": _geomean(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "cases": len(ratios),
            "highest": [f"{r['op']} {r['dtype']} {r['rows']}x{r['hidden']}: {r[key]:.3f}" for r in worst],
        }
        log(
            f"{key}: geometric mean {summary[key]['geomean']:.4f} ({min(ratios):.3f}..{max(ratios):.3f}) over "
            f"{len(ratios)} cases; highest: " + "; ".join(summary[key]["highest"])
        )
    return summary


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
        help="benchmark shapes, ROWSxHIDDEN,... (default: " + ",".join(f"{r}x{h}" for r, h in SHAPES) + ")",
    )
    parser.add_argument("--reps", type=int, default=25, help="timed graph replays per candidate")
    parser.add_argument("--grid-rows", type=int, default=67)
    parser.add_argument(
        "--baseline-lib",
        type=Path,
        default=None,
        help="instead of the benchmark table, time our kernels from this library and from this build side by side",
    )
    parser.add_argument(
        "--table",
        type=Path,
        default=None,
        help="with --baseline-lib: also compare with the 'ours us' column of this BENCHMARKS.md",
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
    parser.add_argument("--compile-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="write results here (default: $OUT/gpu_kernels.json)")
    args = parser.parse_args(argv)
    if args.compile_worker:
        return compile_worker(args)
    if args.prewarm_only:
        prewarm_compile(args)
        return 0
    import torch

    if not torch.cuda.is_available():
        log("no CUDA GPU visible to torch: nothing to do")
        return 2
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
        if args.baseline_lib:
            results["baseline_lib"] = str(args.baseline_lib)
            results["compare"] = []
            results["compare_summary"] = run_compare(
                torch, lib, abi.load(args.baseline_lib), args, copy_bps, results["compare"], save
            )
            results["copy_bytes_per_s_after"] = copy_bandwidth(torch, args.reps)
            save()
            return 0 if not args.correctness or all(r["ok"] for r in results["correctness"]) else 1
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
