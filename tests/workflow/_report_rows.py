"""Ledger rows of a small sweep, and Chromium helpers, shared by the report tests."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from mograph.workflow import report as rep


def sweep_rows() -> list[dict]:
    """A sweep of one model: baseline, four configurations (int8-slow dominated), one failure."""
    common = {"model_hash": "a1b2c3d4e5f6", "model_path": "model.onnx", "provider": "CPUExecutionProvider"}
    return [
        {**common, "id": 1, "name": "baseline", "baseline": True, "pipeline": [], "status": "ok",
         "metrics": {"latency_p50_ms": 10.0, "latency_p90_ms": 11.0, "latency_p99_ms": 12.5, "throughput": 100.0,
                     "peak_mem_mb": 50.0, "size_bytes": 40e6},
         "versions": {"mograph": "0.1.0", "onnxruntime": "1.32.0"}, "calib_hash": None, "eval_hash": "e" * 64},
        {**common, "id": 2, "name": "fuse", "pipeline": ["cleanup", "fuse"],
         "metrics": {"latency_p50_ms": 7.0, "size_bytes": 40e6, "cosine_mean": 0.99999, "cosine_min": 0.9999,
                     "max_abs": 1e-4, "top1_agreement": 1.0},
         "report": [{"name": "fuse-layernorm", "modified": True, "stats": {"layernorm": 4}, "seconds": 0.012,
                     "nodes_before": 120, "nodes_after": 84},
                    {"name": "fuse-gelu", "modified": False, "stats": {}, "seconds": 0.003,
                     "nodes_before": 84, "nodes_after": 84}],
         "profile": {"total_ms": 7.0, "provider": "CPUExecutionProvider",
                     "by_op_type": [{"op_type": "MatMul", "ms": 4.0, "pct": 57.1, "count": 24}],
                     "top_nodes": [{"name": "/l0/attn/MatMul", "op_type": "MatMul", "ms": 0.5, "pct": 7.1,
                                    "provider": "CPUExecutionProvider"}],
                     "kernels": [{"name": "ampere_sgemm_128x64", "ms": 2.5, "count": 24}],
                     "candidates": [{"kind": "gelu", "instances": 4, "ms": 0.7, "pct": 10.0}]}},
        {**common, "id": 3, "name": "fp16", "pipeline": ["cleanup", "fuse", "fp16"],
         "metrics": {"latency_p50_ms": 6.0, "size_bytes": 20e6, "cosine_mean": 0.9995}},
        {**common, "id": 4, "name": "int8", "pipeline": ["cleanup", "fuse", "qdq-int8"],
         "metrics": {"latency_p50_ms": 4.0, "size_bytes": 10e6, "cosine_mean": 0.995},
         "plan": {"pass": "qdq-int8", "calibration": {"samples": 64},
                  "nodes": [{"node": "/l0/attn/MatMul", "op": "MatMul", "precision": "int8",
                             "reason": "default rule: weight matmul"},
                            {"node": "/head/MatMul", "op": "MatMul", "precision": "fp32",
                             "reason": "default rule: final projection"}]}},
        {**common, "id": 5, "name": "int8-slow", "pipeline": ["qdq-int8"],
         "metrics": {"latency_p50_ms": 8.0, "size_bytes": 10e6, "cosine_mean": 0.99}},
        {**common, "id": 6, "name": "broken", "pipeline": ["prune"], "status": "failed",
         "error": "pass 'prune-structured' failed: no prunable layer", "metrics": {}},
    ]


def chromium() -> str:
    found = rep.find_chromium()
    if found is None:
        if os.environ.get("MOGRAPH_REQUIRE_CHROMIUM"):
            pytest.fail("MOGRAPH_REQUIRE_CHROMIUM is set and no chromium is installed")
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    return found


def pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int32)


def near(px: np.ndarray, color: str, tol: int = 40) -> np.ndarray:
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
    return np.abs(px - rgb).sum(axis=-1) < tol
