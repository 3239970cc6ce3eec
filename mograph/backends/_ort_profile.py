"""Reading ONNX Runtime's profiler output: per-node times, where each node ran, Memcpy nodes, kernels.

ONNX Runtime writes a Chrome-trace JSON (a list of events) when a session is created with
``SessionOptions.enable_profiling``; ``session.end_profiling()`` returns its path and stops profiling,
so later runs of the same session are not slowed down.  The events used here:

* ``{"cat": "Session", "name": "model_run", "ts": ..., "dur": ...}`` — one per ``run`` call; times
  are microseconds from the start of the session;
* ``{"cat": "Node", "name": "<node name>_kernel_time", "dur": ..., "args": {"op_name": ...,
  "provider": ...}}`` — one per node executed, with the execution provider that ran it.  The nodes
  are those of the graph ONNX Runtime *runs*: after its own graph optimizations (fused nodes get new
  names) and with the ``MemcpyToHost`` / ``MemcpyFromHost`` nodes it inserts between providers;
* ``{"cat": "Kernel", "name": "<CUDA kernel>", "dur": ...}`` — GPU kernels, only in ONNX Runtime
  builds made with ``--enable_cuda_profiling`` (the PyPI ``onnxruntime-gpu`` wheel is not, as far as
  its documentation says; :mod:`mograph.profile` falls back to ``torch.profiler`` for kernels).

Everything here is plain parsing, so it is tested on real CPU profiles.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["read_events", "run_windows", "node_times", "kernel_times", "placement", "MEMCPY_OPS"]

#: The op types ONNX Runtime gives the copy nodes it inserts between execution providers.
MEMCPY_OPS = ("MemcpyToHost", "MemcpyFromHost")

_SUFFIX = "_kernel_time"


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of an ONNX Runtime profile file (a JSON list, or ``{"traceEvents": [...]}``)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("traceEvents", [])
    return [e for e in data if isinstance(e, dict)]


def run_windows(events: Iterable[Mapping[str, Any]], last: int | None = None) -> list[tuple[float, float]]:
    """``(start, end)`` of each ``model_run`` event in time order, only the ``last`` N when given."""
    runs = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run" and "ts" in e
    )
    return runs[-last:] if last else runs


def _inside(ts: float, windows: list[tuple[float, float]]) -> bool:
    return any(start <= ts <= end for start, end in windows)


def node_events(events: Iterable[Mapping[str, Any]], windows: list[tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    """The ``Node`` events (one per node executed), inside ``windows`` when given, as
    ``{"name", "op_type", "provider", "us", "ts"}``."""
    out = []
    for e in events:
        if e.get("cat") != "Node":
            continue
        name = str(e.get("name", ""))
        if not name.endswith(_SUFFIX):  # fence_before / fence_after events of older versions
            continue
        ts = float(e.get("ts", 0))
        if windows is not None and not _inside(ts, windows):
            continue
        args = e.get("args") or {}
        out.append(
            {
                "name": name[: -len(_SUFFIX)],
                "op_type": str(args.get("op_name", "?")),
                "provider": str(args.get("provider", "?")),
                "us": float(e.get("dur", 0)),
                "ts": ts,
            }
        )
    return out


def node_times(events: Iterable[Mapping[str, Any]], runs: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """Per node, its mean time per run over the last ``runs`` runs (all runs: ``None``).

    Returns ``([{"name", "op_type", "provider", "ms", "calls"}], runs_seen)`` in execution order of the
    first run seen; ``calls`` is how many times the node ran per run (more than 1 inside a loop).
    """
    events = list(events)
    windows = run_windows(events, runs)
    nodes = node_events(events, windows if windows else None)
    n_runs = max(len(windows), 1)
    table: dict[str, dict[str, Any]] = {}
    for ev in nodes:
        entry = table.setdefault(
            ev["name"], {"name": ev["name"], "op_type": ev["op_type"], "provider": ev["provider"], "us": 0.0, "n": 0}
        )
        entry["us"] += ev["us"]
        entry["n"] += 1
    out = [
        {
            "name": e["name"],
            "op_type": e["op_type"],
            "provider": e["provider"],
            "ms": e["us"] / 1000.0 / n_runs,
            "calls": max(1, round(e["n"] / n_runs)),
        }
        for e in table.values()
    ]
    return out, len(windows)


def kernel_times(events: Iterable[Mapping[str, Any]], runs: int | None = None) -> list[dict[str, Any]]:
    """GPU kernels from ``Kernel`` events (ONNX Runtime builds with CUDA profiling only): per kernel name,
    ``{"name", "ms", "count"}`` per run, slowest first; ``[]`` when the profile has none."""
    events = list(events)
    windows = run_windows(events, runs)
    n_runs = max(len(windows), 1)
    table: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != "Kernel":
            continue
        entry = table.setdefault(str(e.get("name", "?")), [0.0, 0])
        entry[0] += float(e.get("dur", 0))
        entry[1] += 1
    out = [{"name": k, "ms": us / 1000.0 / n_runs, "count": max(1, round(n / n_runs))} for k, (us, n) in table.items()]
    return sorted(out, key=lambda k: -k["ms"])


def placement(events: Iterable[Mapping[str, Any]], device_provider: str) -> dict[str, Any]:
    """Where the nodes of one profiled run ran, against the provider they were meant for.

    Args:
        events: a profile's events (:func:`read_events`).
        device_provider: the provider the session targets (``CUDAExecutionProvider``).

    Returns:
        ``{"provider": device_provider, "nodes": N, "by_provider": {provider: count},
        "fallback": [{"name", "op_type", "provider"}], "memcpy": [{"name", "op_type", "provider"}],
        "profiled": bool}`` — ``fallback`` lists the compute nodes that ran on another provider (Memcpy
        nodes excluded), ``memcpy`` the copy nodes ONNX Runtime inserted between providers; ``profiled``
        is False when the profile held no node events (nothing can be said).
    """
    events = list(events)
    windows = run_windows(events, 1)
    nodes = node_events(events, windows if windows else None)
    seen: dict[str, dict[str, Any]] = {}
    for ev in nodes:
        seen.setdefault(ev["name"], ev)
    by_provider: dict[str, int] = {}
    fallback, memcpy = [], []
    for ev in seen.values():
        by_provider[ev["provider"]] = by_provider.get(ev["provider"], 0) + 1
        brief = {"name": ev["name"], "op_type": ev["op_type"], "provider": ev["provider"]}
        if ev["op_type"] in MEMCPY_OPS:
            memcpy.append(brief)
        elif ev["provider"] != device_provider:
            fallback.append(brief)
    return {
        "provider": device_provider,
        "nodes": len(seen),
        "by_provider": by_provider,
        "fallback": fallback,
        "memcpy": memcpy,
        "profiled": bool(seen),
    }
