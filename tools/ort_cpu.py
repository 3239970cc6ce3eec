"""The CPU ONNX Runtime session the ``tools/bench_*`` scripts time with (one place for their shared options)."""

from __future__ import annotations

from typing import Any

#: ``--ort-level`` names -> ``onnxruntime.GraphOptimizationLevel`` member names.
LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
          "all": "ORT_ENABLE_ALL"}


def cpu_session(model: Any, threads: int, level: str = "all") -> Any:
    """An ``InferenceSession`` on ``CPUExecutionProvider`` with ``threads`` intra-op threads, one inter-op thread,
    graph optimizations at ``level`` (a :data:`LEVELS` key); ``model`` is a path or an ``onnx.ModelProto``."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    payload = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(payload, opts, providers=["CPUExecutionProvider"])
