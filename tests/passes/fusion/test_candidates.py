"""``FusionPass.candidates``: what the rules would fuse, read-only (the profile asks it through the registry)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion import FuseGeluPass, FuseLayerNormPass
from onnx import TensorProto, helper, numpy_helper

from mograph.pass_infra import graph_fingerprint


def _layernorm(axis: int = -1) -> ir.Model:
    f = np.float32
    inits = [numpy_helper.from_array(np.array(v, f), n) for n, v in (("two", 2.0), ("eps", 1e-5))]
    inits += [numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(f), "g"),
              numpy_helper.from_array(np.linspace(-1, 1, 8).astype(f), "b")]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], name="mean", axes=[axis]),
        helper.make_node("Sub", ["x", "m"], ["d"], name="sub"),
        helper.make_node("Pow", ["d", "two"], ["d2"], name="pow"),
        helper.make_node("ReduceMean", ["d2"], ["v"], name="var", axes=[axis]),
        helper.make_node("Add", ["v", "eps"], ["ve"], name="add_eps"),
        helper.make_node("Sqrt", ["ve"], ["s"], name="sqrt"),
        helper.make_node("Div", ["d", "s"], ["n"], name="div"),
        helper.make_node("Mul", ["n", "g"], ["ng"], name="scale"),
        helper.make_node("Add", ["ng", "b"], ["y"], name="bias"),
        helper.make_node("Relu", ["y"], ["z"], name="after"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4, 8])], inits)
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_layernorm_region_with_its_scale_and_bias_and_the_model_unchanged():
    model = _layernorm()
    before = graph_fingerprint(model)
    found = FuseLayerNormPass().candidates(model)
    assert graph_fingerprint(model) == before  # read-only
    assert [(c.kind, c.op, c.reason) for c in found] == [("LayerNorm", "LayerNorm", None)]
    # the core rule's nodes, grown by the absorption rules that took the scale and bias in; not the Relu
    assert found[0].nodes == ("mean", "sub", "pow", "var", "add_eps", "sqrt", "div", "scale", "bias")
    # and the pass itself then fuses exactly that
    result = FuseLayerNormPass().call(model)
    assert result.modified and [n.op_type for n in model.graph] == ["LayerNorm", "Relu"]


def test_near_miss_is_a_reason_not_a_region():
    model = _layernorm(axis=1)  # over the sequence, not the last axis: no LayerNorm
    found = FuseLayerNormPass().candidates(model)
    assert found and all(c.op is None and c.kind is None for c in found)
    assert any("not over the last axis" in (c.reason or "") for c in found)
    assert FuseGeluPass().candidates(model) == []  # nothing of a GELU here
