"""Helpers of the fusion tests: build graphs from a few lines of ONNX text, run and compare them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir

from mograph.pass_infra import PassResult, graph_fingerprint

ORT = None


def parse(text: str) -> onnx.ModelProto:
    """A model from ONNX textual syntax (``<ir_version: 8, opset_import: ["" : 17]> graph (...) {...}``)."""
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    return model


def to_ir(proto: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(proto)


def to_proto(model: ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(model)


def op_types(model: ir.Model) -> list[str]:
    out = []
    for n in model.graph:
        out.append(f"{n.domain}.{n.op_type}" if n.domain else n.op_type)
    return out


def op_counts(model: ir.Model) -> Counter:
    return Counter(op_types(model))


def feeds_for(proto: onnx.ModelProto, seed: int = 0, dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dims = dims or {}
    inits = {i.name for i in proto.graph.initializer}
    out = {}
    for inp in proto.graph.input:
        if inp.name in inits:
            continue
        t = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 3) for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            out[inp.name] = rng.integers(0, dims.get("vocab", 50), size=shape).astype(dtype)
        else:
            out[inp.name] = (rng.standard_normal(shape) * 2 + 0.3).astype(dtype)
    return out


def run_ort(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    proto = to_proto(model) if isinstance(model, ir.Model) else model
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_close(ref: list[np.ndarray], got: list[np.ndarray], rel: float = 1e-4) -> float:
    """Max abs error relative to the output scale (max |ref|, at least 1) must be <= rel."""
    worst = 0.0
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert r.shape == g.shape, (r.shape, g.shape)
        r64, g64 = r.astype(np.float64), g.astype(np.float64)
        scale = max(1.0, float(np.max(np.abs(r64)))) if r64.size else 1.0
        err = float(np.max(np.abs(r64 - g64))) / scale if r64.size else 0.0
        worst = max(worst, err)
    assert worst <= rel, f"max abs error {worst:.3g} (relative to output scale) > {rel}"
    return worst


def run_pass(pass_obj: Any, proto: onnx.ModelProto) -> tuple[ir.Model, PassResult]:
    model = to_ir(proto)
    result = pass_obj.call(model)
    return model, result


def check_fusion(
    pass_obj: Any,
    proto: onnx.ModelProto,
    *,
    stats: dict[str, int] | None = None,
    ops_left: list[str] | Counter | None = None,
    rel: float = 1e-4,
    feeds: dict[str, np.ndarray] | None = None,
) -> ir.Model:
    """The five things of a pass test: ops left, exact stats, numbers, and a no-op second run."""
    feeds = feeds if feeds is not None else feeds_for(proto)
    ref = run_ort(proto, feeds)
    model, result = run_pass(pass_obj, proto)
    if stats is not None:
        assert {k: v for k, v in result.stats.items()} == stats, result.stats
        assert result.modified == bool(stats)
    if ops_left is not None:
        if isinstance(ops_left, Counter):
            assert op_counts(model) == ops_left, op_types(model)
        else:
            assert op_types(model) == ops_left, op_types(model)
    out_proto = to_proto(model)
    got = run_ort(out_proto, feeds)
    assert_close(ref, got, rel)
    # second run: nothing to do, nothing changed
    before = graph_fingerprint(model)
    again = pass_obj.call(model)
    assert again.modified is False, again.stats
    assert graph_fingerprint(model) == before
    return model


def assert_untouched(pass_obj: Any, proto: onnx.ModelProto) -> PassResult:
    """A near miss: the pass reports modified=False and the graph is unchanged."""
    model = to_ir(proto)
    before = graph_fingerprint(model)
    result = pass_obj.call(model)
    assert result.modified is False, result.stats
    assert graph_fingerprint(model) == before
    return result
