"""The Conv1D QKV bias moved into MultiHeadAttention's ``bias`` input (``_split_bias`` of the ort lowering):
where it applies, and the near misses it leaves alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.fusion.lowerings import attention as lowering
from onnx import TensorProto, helper

H = 16


def _graph(sizes: list[int], extra_reader: bool = False) -> tuple[ir.Model, ir.Node]:
    """x [B*S, H] -> Gemm(W [H, 3H], b [3H]) -> Reshape [B, S, 3H] -> Split(sizes) -> q, k, v -> Sum (the stand-in
    for the attention node the lowering replaces)."""
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor("W", TensorProto.FLOAT, [H, 3 * H], rng.standard_normal(3 * H * H).tolist()),
             helper.make_tensor("b", TensorProto.FLOAT, [3 * H], rng.standard_normal(3 * H).tolist()),
             helper.make_tensor("shape", TensorProto.INT64, [3], [2, 3, 3 * H]),
             helper.make_tensor("sizes", TensorProto.INT64, [3], sizes)]
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["r"]),
             helper.make_node("Split", ["r", "sizes"], ["q", "k", "v"], axis=2),
             helper.make_node("Concat", ["q", "k", "v"], ["out"], axis=2)]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3, 3 * H])]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["q"], ["q_relu"]))
        outputs.append(helper.make_tensor_value_info("q_relu", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, H])], outputs, inits)
    proto = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    model = ir.serde.deserialize_model(proto)
    reader = next(n for n in model.graph if n.op_type == "Concat")
    return model, reader


def test_equal_split_of_gemm_bias_moves_the_bias():
    model, reader = _graph([H, H, H])
    q, k, v = reader.inputs
    bias = lowering._split_bias(reader, q, k, v)
    assert bias is not None and bias.const_value is not None
    gemm = next(n for n in model.graph if n.op_type == "Gemm")
    assert len(gemm.inputs) == 2  # no C left: the kernel adds it
    np.testing.assert_array_equal(bias.const_value.numpy(), model.graph.initializers["b"].const_value.numpy())


@pytest.mark.parametrize("sizes,extra", [([H + 8, H - 8, H], False), ([H, H, H], True)],
                         ids=["unequal-split", "q-read-elsewhere"])
def test_near_misses_are_left_alone(sizes, extra):
    model, reader = _graph(sizes, extra_reader=extra)
    q, k, v = reader.inputs
    assert lowering._split_bias(reader, q, k, v) is None
    gemm = next(n for n in model.graph if n.op_type == "Gemm")
    assert len(gemm.inputs) == 3 and gemm.inputs[2].name == "b"
