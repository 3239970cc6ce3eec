"""Shared helpers of the quantization pass tests: running models with ONNX Runtime and comparing outputs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mograph.ir_version import fit_ir_version


def run(model: ir.Model | onnx.ModelProto, feeds: dict, optimize: bool = False) -> list[np.ndarray]:
    """Run with ONNX Runtime CPU; graph optimizations off unless asked.

    The model runs at an IR version the installed runtime reads (the tests build theirs with
    ``onnx.helper.make_model``, which stamps onnx's newest: onnxruntime 1.31.1 refuses it).
    """
    proto = onnx.ModelProto()
    proto.CopyFrom(model if isinstance(model, onnx.ModelProto) else ir.serde.serialize_model(model))
    fit_ir_version(proto)
    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def optimized_ops(model: ir.Model, tmp_path) -> Counter:  # type: ignore[no-untyped-def]
    """Op types of the graph ONNX Runtime CPU actually runs (all optimizations on)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(tmp_path / "ort_optimized.onnx")).graph.node)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

