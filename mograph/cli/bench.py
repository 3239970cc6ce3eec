"""``mograph bench``: latency, throughput and memory of a model on a backend (ONNX Runtime by default).

What is measured, exactly:

* **latency** — wall-clock time of each ``run`` call after the warm-up runs, on the same feeds every
  time; reported as p50/p90/p99 (and mean/min/max) in milliseconds;
* **throughput** — timed runs divided by their total time (inferences/s); times the batch size
  (samples/s) when the model has a dynamic leading batch dim or ``--batch`` is given;
* **memory** — the peak resident set size (RSS) of this process while the session is created and
  run, minus the RSS just before the session was created: a background thread samples RSS every
  few milliseconds (psutil), so short spikes between samples can be missed.  It covers the
  runtime's copy of the weights, its arena and its kernels' scratch, but not the feeds (made before).

ONNX Runtime's own graph optimizations are **on** (``ORT_ENABLE_ALL``), as in a deployment;
``--no-ort-optimizations`` measures the graph exactly as written.

**On the GPU** (``--device cuda``, ONNX Runtime's CUDA provider; exit 7 without ``onnxruntime-gpu``):
each timed run is ``run_with_iobinding`` on feeds copied to the GPU once, with the outputs left on the
GPU and the run waited for (``--io-binding``, the default there), so host copies do not hide the
kernels' time; ``--cuda-graph`` replays the whole run as one CUDA graph (ONNX Runtime refuses models
with nodes outside CUDA: the error lists them).  The report says where the nodes ran: the first run
is profiled, and nodes that fell back to the CPU and the ``Memcpy`` nodes ONNX Runtime inserted are
listed.

``--profile`` adds where the time goes (:func:`mograph.profile.profile_model`): per op type, the
slowest ``--top`` nodes, the GPU kernels on CUDA, and the time of decomposed LayerNorm / GELU /
attention subgraphs that a fusion pass would replace.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from mograph.cli import CommandResult
from mograph.cli._common import add_device_argument, add_feed_limit_argument, add_model_arguments, model_source
from mograph.errors import UsageError
from mograph.specs import parse_shapes

__all__ = ["add_parser", "run", "RssSampler"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "bench",
        parents=[common],
        help="measure latency, throughput and peak memory of a model on a backend (ONNX Runtime by default)",
        description="Run MODEL repeatedly on seeded random feeds (or --feeds) and report latency p50/p90/p99 "
        "after warm-up, throughput (inferences/s, and samples/s when there is a batch dim), session creation "
        "time and peak memory (RSS increase of this process during session creation and runs, sampled). "
        "ONNX Runtime's graph optimizations are ON, as deployed; --no-ort-optimizations turns them off. "
        "--device cuda runs ONNX Runtime's CUDA provider with IO binding (feeds and outputs stay on the GPU) and "
        "reports the nodes that fell back to the CPU and the Memcpy nodes ORT inserted; --cuda-graph replays "
        "the run as a CUDA graph; --profile shows where the time goes (per op type, top nodes, CUDA kernels, "
        "decomposed LayerNorm/GELU/attention).",
    )
    add_model_arguments(p, "the .onnx file (or use --example)", verb="benchmark")
    p.add_argument("--backend", default="ort", metavar="NAME", help="registered backend to run on (default: ort)")
    p.add_argument(
        "--provider",
        action="append",
        metavar="NAME",
        help="ONNX Runtime execution provider, in priority order (repeatable; default CPUExecutionProvider)",
    )
    add_device_argument(p)
    p.add_argument(
        "--io-binding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time runs on feeds and outputs bound on the device (ONNX Runtime IO binding); default: on for "
        "--device cuda, off on the CPU",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="--device cuda: capture the run as a CUDA graph and replay it (ONNX Runtime's enable_cuda_graph; "
        "symbolic dims are pinned to the feeds' shapes; refused, with the CPU nodes named, unless every node runs on CUDA)",
    )
    p.add_argument("--threads", type=int, metavar="N", help="intra-op threads (default: the runtime's choice)")
    p.add_argument(
        "--session-config",
        action="append",
        metavar="KEY=VALUE",
        help="an ONNX Runtime session config entry for the timed (and profiled) sessions, repeatable, e.g. "
        "ep.cuda.fpa_intb_gemm=1 (ONNX Runtime's CUTLASS kernels for MatMulNBits; see the precision recipe); "
        "ONNX Runtime ignores keys it does not know; --backend ort only",
    )
    p.add_argument(
        "--shape",
        action="append",
        metavar="NAME:DIMS",
        help="size of an input's dynamic dims, e.g. input_ids:1x128 (repeatable); wins over --batch",
    )
    p.add_argument("--batch", type=int, metavar="N", help="size of dynamic leading (batch) dims (default 1)")
    p.add_argument("--feeds", metavar="FILE.npz", help="input feeds (keys are input names) instead of random ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the random feeds (default 0)")
    add_feed_limit_argument(p)
    p.add_argument("--warmup", type=int, default=10, metavar="N", help="untimed runs first (default 10)")
    p.add_argument("--iterations", type=int, default=100, metavar="N", help="timed runs (default 100)")
    p.add_argument(
        "--no-ort-optimizations",
        dest="ort_optimizations",
        action="store_false",
        help="turn ONNX Runtime's own graph optimizations off (ORT_DISABLE_ALL)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile (ONNX Runtime's profiler, a separate session): time per op type, the --top slowest "
        "nodes, CUDA kernels on the GPU, and decomposed LayerNorm/GELU/attention subgraphs with their share",
    )
    p.add_argument("--top", type=int, default=10, metavar="N", help="--profile: how many nodes and kernels to list (default 10)")
    p.add_argument("--profile-runs", type=int, default=10, metavar="N", help="--profile: profiled runs after warm-up (default 10)")
    p.set_defaults(run=run)


class RssSampler:
    """Track the peak RSS of this process from a background thread (psutil)."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.baseline = self._proc.memory_info().rss
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mograph-rss", daemon=True)

    def _sample(self) -> None:
        rss = self._proc.memory_info().rss
        if rss > self.peak:
            self.peak = rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


class _Progress:
    """Progress on stderr once a phase takes more than a second: one line rewritten in place on a
    terminal, a line every ten seconds otherwise (logs, CI)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.interval = 1.0 if self.tty else 10.0
        self.start = time.perf_counter()
        self.last = self.start
        self.shown = False

    def update(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        finished = done == total
        if now - self.last < self.interval and not (finished and self.shown):
            return
        self.last = now
        self.shown = True
        text = f"bench: {phase} {done}/{total} ({now - self.start:.1f}s)"
        if self.tty:
            sys.stderr.write("\r" + text + ("\n" if finished else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
        if finished:
            self.shown = False


def _batch_size(model: Any, feeds: dict[str, np.ndarray], requested: int | None) -> int | None:
    """The batch size, when every input has a dynamic leading dim (or ``--batch`` was given)."""
    from mograph.validate import graph_inputs

    leading = {str(v.name): v.shape[0] for v in graph_inputs(model) if v.shape is not None and len(v.shape) > 0}
    if requested is not None:
        for name, dim in leading.items():
            if isinstance(dim, int) and dim != requested:
                raise UsageError(f"--batch {requested}: input '{name}' has a fixed leading dim of {dim}")
        return requested
    if leading and all(not isinstance(dim, int) for dim in leading.values()):
        sizes = {int(feeds[n].shape[0]) for n in leading if n in feeds and feeds[n].ndim}
        if len(sizes) == 1:
            return sizes.pop()
    return None


def _stats(latencies: list[float]) -> dict[str, float]:
    ms = np.asarray(latencies) * 1000.0
    return {
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
        "mean": float(ms.mean()),
        "min": float(ms.min()),
        "max": float(ms.max()),
        "std": float(ms.std()),
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def run(args: argparse.Namespace) -> CommandResult:
    from mograph import _spill, ir_io
    from mograph.backend_protocol import check_device, get_backend, registry_keywords, require_available
    from mograph.plugins import get_registry
    from mograph.validate import make_feeds

    src = model_source(args)
    if args.iterations < 1 or args.warmup < 0:
        raise UsageError("--iterations must be at least 1 and --warmup at least 0")
    if args.batch is not None and args.batch < 1:
        raise UsageError("--batch must be at least 1")
    if args.top < 1 or args.profile_runs < 1:
        raise UsageError("--top and --profile-runs must be at least 1")
    if args.device and args.provider:
        raise UsageError("give --device or --provider, not both (--device cuda picks the CUDA provider)")
    session_config = parse_session_config(args.session_config)
    if session_config and args.backend != "ort":
        raise UsageError(f"--session-config sets ONNX Runtime sessions: it needs --backend ort, not '{args.backend}'")
    registry = get_registry(args.block_plugin)
    backend = get_backend(registry.backends, args.backend, job="bench")
    runner_options = check_device(backend, args.device)
    if session_config:
        runner_options["session_config"] = session_config
    runner_options.update(registry_keywords(backend.make_runner, registry))
    device = runner_options.get("device", "cpu")
    on_gpu = device.startswith("cuda") or "CUDAExecutionProvider" in (args.provider or [])
    if args.cuda_graph and not device.startswith("cuda"):
        raise UsageError("--cuda-graph needs --device cuda")
    if args.cuda_graph and args.io_binding is False:
        raise UsageError("--cuda-graph runs on bound feeds and outputs; it cannot go with --no-io-binding")
    io_binding = bool(args.cuda_graph or (args.io_binding if args.io_binding is not None else on_gpu))
    require_available(backend)  # exit 7 with the backend's own reason
    if device.startswith("cuda") and args.backend == "ort":
        from mograph.backends.ort import require_device

        require_device(device)  # exit 7 naming onnxruntime-gpu, before any work
    import_runtime = getattr(backend, "import_runtime", None)
    if callable(import_runtime):
        import_runtime()  # not inside the memory measurement
    model = ir_io.load_model(src)
    feeds, info = make_feeds(
        model, shapes=parse_shapes(args.shape), feeds=args.feeds, seed=args.seed, batch=args.batch or 1,
        limit_bytes=args.feed_limit,
    )
    batch = _batch_size(model, feeds, args.batch)
    del model
    # an IR graph is a web of cycles: collected now, its weights (decoded, for a model whose weights are inside
    # its file) do not sit beside the session measured next
    _spill.free_dropped()
    progress = _Progress(enabled=not (args.json or args.quiet))
    if args.cuda_graph:
        runner_options.update(cuda_graph=True, shapes={n: tuple(a.shape) for n, a in feeds.items()})
    warmup = max(args.warmup, 2) if args.cuda_graph else args.warmup  # the graph is captured in a warm-up run

    try:
        sampler: RssSampler | None = RssSampler()
    except ImportError:
        sampler = None
    latencies: list[float] = []
    with sampler if sampler is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        runner = _make_runner(backend, src, feeds, args, runner_options)
        session_s = time.perf_counter() - t0
        step = _step(runner, feeds, io_binding, args.backend)
        if getattr(runner, "profiling", False):
            step()  # the profiled run that records where nodes ran: never timed, whatever --warmup says
        for i in range(warmup):
            step()
            progress.update("warm-up", i + 1, warmup)
        total_start = time.perf_counter()
        for i in range(args.iterations):
            start = time.perf_counter()
            step()
            latencies.append(time.perf_counter() - start)
            progress.update("runs", i + 1, args.iterations)
        total_s = time.perf_counter() - total_start

    session = getattr(runner, "session", None)
    device = str(getattr(runner, "device", device))  # --provider CUDAExecutionProvider runs on cuda too
    runtime = args.backend
    providers = list(args.provider or [])
    if args.backend == "ort":
        from mograph.backends.ort import ort_version

        runtime = f"onnxruntime {ort_version()}"
        if session is not None:
            providers = list(session.get_providers())
    ips = args.iterations / total_s if total_s > 0 else None
    memory: dict[str, Any] = {
        "measures": "peak RSS of this process during session creation and runs minus RSS just before "
        "session creation (psutil, sampled every 2 ms)",
        "rss_before_bytes": None,
        "peak_rss_bytes": None,
        "peak_increase_bytes": None,
    }
    if sampler is not None:
        memory.update(
            rss_before_bytes=sampler.baseline,
            peak_rss_bytes=sampler.peak,
            peak_increase_bytes=sampler.peak - sampler.baseline,
        )
    else:
        memory["measures"] = "not measured: psutil is not installed (pip install 'mograph[bench]')"
    if device.startswith("cuda"):
        memory["measures"] += "; host memory only: GPU memory is not counted"
    data: dict[str, Any] = {
        "model": str(src),
        "backend": args.backend,
        "runtime": runtime,
        "providers": providers,
        "ort_optimizations": bool(args.ort_optimizations),
        "threads": args.threads,
        "session_config": session_config,
        "device": device,
        "io_binding": io_binding,
        "cuda_graph": bool(args.cuda_graph),
        "placement": getattr(runner, "placement", None),
        "feeds": info["inputs"],
        "defaulted_dims": info["defaulted_dims"],
        "batch": batch,
        "warmup": warmup,
        "iterations": args.iterations,
        "session_seconds": session_s,
        "latency_ms": _stats(latencies),
        "throughput": {
            "inferences_per_s": ips,
            "samples_per_s": ips * batch if (ips is not None and batch is not None) else None,
        },
        "memory": memory,
        "lowered": dict(getattr(runner, "lowered", None) or {}),
    }
    if device.startswith("cuda") and args.backend == "ort":
        from mograph.backends import ort as ort_backend

        data["cuda_libraries"] = ort_backend.load_cuda_libraries(ort_backend.import_ort())
        data["pinned_dims"] = dict(getattr(runner, "free_dims", {}) or {})
    del step, runner, session  # free the session (GPU memory included) before profiling
    if args.profile:
        from mograph.profile import format_profile, profile_model

        profile = profile_model(
            src, backend=backend, feeds=feeds, runs=args.profile_runs, device=device,
            optimizations=args.ort_optimizations, threads=args.threads, top=args.top, registry=registry,
            session_config=session_config or None,
        )
        data["profile"] = profile
    lat = data["latency_ms"]
    feeds_s = ", ".join(f"{n} {i['dtype']} {'x'.join(map(str, i['shape'])) or 'scalar'}" for n, i in info["inputs"].items())
    lines = [
        f"model:      {src}",
        f"backend:    {runtime} [{', '.join(providers) or '-'}], graph optimizations "
        f"{'on' if args.ort_optimizations else 'off'}, threads {args.threads or 'default'}"
        + (f", session config {', '.join(f'{k}={v}' for k, v in session_config.items())}" if session_config else ""),
        f"device:     {device}; timed runs: "
        + (f"IO binding (feeds and outputs on {device}, run waited for)" if io_binding else "run(feeds) (host copies included)")
        + ("; CUDA graph replay" if args.cuda_graph else ""),
        f"feeds:      {feeds_s or '(none)'}",
    ]
    if info["defaulted_dims"]:
        dims = ", ".join(f"{k}={v}" for k, v in info["defaulted_dims"].items())
        lines.append(f"            dynamic dims defaulted: {dims} (set them with --shape / --batch)")
    if data.get("pinned_dims"):
        lines.append("            dims pinned for the CUDA graph: " + ", ".join(f"{k}={v}" for k, v in data["pinned_dims"].items()))
    lines.extend(placement_lines(data["placement"]))
    if data["lowered"]:
        lowered = ", ".join(f"{k}={v}" for k, v in data["lowered"].items())
        lines.append(f"lowered:    for the {args.backend} backend first (its fused ops were not): {lowered}")
    lines += [
        f"session:    created in {session_s * 1000:.1f} ms",
        f"latency:    p50 {lat['p50']:.3f} ms   p90 {lat['p90']:.3f} ms   p99 {lat['p99']:.3f} ms   "
        f"(mean {lat['mean']:.3f}, min {lat['min']:.3f}, max {lat['max']:.3f}; {args.iterations} runs after "
        f"{warmup} warm-up)",
    ]
    tp = f"throughput: {ips:.1f} inferences/s" if ips is not None else "throughput: -"
    if data["throughput"]["samples_per_s"] is not None:
        tp += f", {data['throughput']['samples_per_s']:.1f} samples/s at batch {batch}"
    lines.append(tp)
    if sampler is not None:
        lines.append(
            f"memory:     peak +{_mib(memory['peak_increase_bytes'])} RSS over {_mib(memory['rss_before_bytes'])} "
            "before the session (session creation and runs, sampled)"
        )
    else:
        lines.append("memory:     not measured (psutil is not installed)")
    if args.profile:
        from mograph.profile import format_profile

        lines.append("")
        lines.append(format_profile(data["profile"]))
    return CommandResult(data=data, text="\n".join(lines))


def placement_lines(placement: dict[str, Any] | None, limit: int = 8) -> list[str]:
    """Where the nodes ran (:attr:`mograph.backends.ort.OrtRunner.placement`), for people."""
    if not placement:
        return []
    if not placement.get("profiled"):
        return ["placement:  unknown (the profiled run recorded no nodes)"]
    counts = ", ".join(f"{n} on {p}" for p, n in sorted(placement["by_provider"].items(), key=lambda kv: -kv[1]))
    lines = [f"placement:  {placement['nodes']} nodes run: {counts}"]
    fallback, memcpy = placement["fallback"], placement["memcpy"]

    def names(items: list[dict[str, Any]]) -> str:
        shown = ", ".join(f"{e['name']} ({e['op_type']})" for e in items[:limit])
        return shown + (f", ... {len(items) - limit} more" if len(items) > limit else "")

    if fallback:
        lines.append(f"            {len(fallback)} node(s) fell back from {placement['provider']}: {names(fallback)}")
    elif placement["provider"] != "CPUExecutionProvider":
        lines.append(f"            every compute node ran on {placement['provider']}")
    if memcpy:
        lines.append(f"            {len(memcpy)} Memcpy node(s) inserted by ONNX Runtime: {names(memcpy)}")
    return lines


def parse_session_config(items: list[str] | None) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` -> ``{KEY: VALUE}`` (a malformed or repeated key is a usage error)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not (eq and key and value):
            raise UsageError(f"--session-config {item!r}: expected KEY=VALUE, e.g. ep.cuda.fpa_intb_gemm=1")
        if key in out and out[key] != value:
            raise UsageError(f"--session-config {key} given twice ({out[key]!r} and {value!r})")
        out[key] = value
    return out


def _make_runner(backend: Any, src: Path, feeds: dict[str, np.ndarray], args: argparse.Namespace,
                 options: dict[str, Any]) -> Any:
    """The backend's runner (a refused CUDA graph is a usage error naming the nodes that run on the CPU)."""
    return backend.make_runner(
        src, optimizations=args.ort_optimizations, threads=args.threads, providers=args.provider, **options
    )


def _step(runner: Any, feeds: dict[str, np.ndarray], io_binding: bool, backend_name: str) -> Any:
    """What one timed run calls: the runner's IO-bound step, or ``runner(feeds)``."""
    if not io_binding:
        return lambda: runner(feeds)
    bind = getattr(runner, "bind", None)
    if not callable(bind):
        raise UsageError(f"--io-binding: backend '{backend_name}' has no IO binding (its runner has no bind())")
    return bind(feeds)
