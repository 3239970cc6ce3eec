"""Running the grid: build what it needs (in ``--jobs`` processes), then time each pending cell."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from .cache import describe, graph_for, needed_steps, prepare, torch_module
from .grid import FULL, ORT_VARIANTS, SMOKE, SMOKE_GRID, TORCH_VARIANTS, Dims, Shape, applies, graph_kind, log
from .models import make_feeds
from .results import Results, cell_key, read_results, torch_ids
from .runners import OrtRunner, Runner, TorchRunner, cosine, cuda_kernels, ort_session, placement, time_runners
from .tables import summary_table

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
        return cell_key(*torch_ids(model, export, attn, variant), variant, shape.text) not in ctx.results.done

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
            m, e, a = torch_ids(model, export, attn, v)
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
