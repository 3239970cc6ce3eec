"""Runners and timing: ONNX Runtime (IO binding) and torch runners, interleaved timing rounds, kernels, cosine."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

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
