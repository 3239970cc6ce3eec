"""``--list``: what a selection still has to build and time, with estimated seconds and disk."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

from .cache import Graph, graph_for, needed_steps
from .grid import FULL, INTERMEDIATES, ORT_VARIANTS, SMOKE, SMOKE_GRID, TORCH_VARIANTS, Shape, applies, graph_kind
from .results import Results, cell_key, torch_ids

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
                    todo = {cell_key(*torch_ids(model, export, attn, v), v, s.text): v for v, s in todo_pairs}
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
                     "tools/gpubench/estimate.py, --warmup/--min-time, 5 ms a run)\n")
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
