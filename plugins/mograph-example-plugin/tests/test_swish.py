"""Tests of ``example.BetaSwish`` and ``fuse-swish``: op types left, exact stats, numbers (ONNX Runtime with its
own optimizations off, and the op's numpy reference), near misses left alone, a second run that changes
nothing; the op's function body, reference, shape function and lowering agree."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph_example_plugin import SWISH, FuseSwishPass
from mograph_example_plugin.swish import lower_swish, swish, swish_function
from onnx import TensorProto, helper, numpy_helper

import mograph
from mograph.lowering import LoweringContext
from mograph.pass_infra import PROVENANCE_PASS, PROVENANCE_RULE, PassManager
from mograph.testing import assert_untouched, check_pass, op_types, run_ort

SHAPE = [2, 3, 8]


def _model(nodes, *, inits=(), opset=17, dtype=TensorProto.FLOAT, outputs=("y",)) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", dtype, SHAPE)
    outs = [helper.make_tensor_value_info(o, dtype, None) for o in outputs]
    graph = helper.make_graph(nodes, "g", [x], outs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _beta(value: float, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=dtype), "beta")


def silu(x="x", y="y", swap=False):
    ins = ["s", x] if swap else [x, "s"]
    return [helper.make_node("Sigmoid", [x], ["s"]), helper.make_node("Mul", ins, [y])]


def scaled(x="x", y="y"):
    return [
        helper.make_node("Mul", ["beta", x], ["m"]),
        helper.make_node("Sigmoid", ["m"], ["s"]),
        helper.make_node("Mul", ["s", x], [y]),
    ]


def _run(proto: onnx.ModelProto) -> tuple[ir.Model, mograph.PassResult]:
    model = ir.serde.deserialize_model(proto)
    report = PassManager([FuseSwishPass()], check_modified=True).run(model)
    entry = report.passes[0]
    return model, mograph.PassResult(entry.modified, entry.stats, entry.details)


_ops = op_types  # mograph.testing: the main graph's op types, ``domain.op`` outside the default domain


def _ort(model: onnx.ModelProto | ir.Model, x: np.ndarray) -> np.ndarray:
    pytest.importorskip("onnxruntime")
    return run_ort(model, {"x": x})[0]  # mograph.testing: ONNX Runtime with its optimizations off


def test_the_five_checks_through_mograph_testing():
    """The checks every pass test makes, as mograph.testing offers them to plugin authors too."""
    pytest.importorskip("onnxruntime")
    feeds = {"x": _x()}
    check_pass(FuseSwishPass(), _model(silu()), stats={"SwishFusion": 1}, ops_left=["example.BetaSwish"], feeds=feeds)
    assert_untouched(FuseSwishPass(), _model([helper.make_node("Sigmoid", ["x"], ["s"]),
                                              helper.make_node("Add", ["x", "s"], ["y"])]))  # x + sigmoid(x)


def test_fuse_then_lower_through_mograph_testing():
    """Fusion plus the ``lower`` step that gives back the standard ops: run again, fuse-swish would rightly
    fuse them anew, so only the last pass (``lower``) must change nothing the second time."""
    pytest.importorskip("onnxruntime")
    from mograph.lowering import LowerPass
    from mograph.testing import Pipeline

    model = check_pass(Pipeline(FuseSwishPass(), LowerPass(target="onnx")), _model(scaled(), inits=[_beta(1.5)]),
                       stats={"SwishFusion": 1, "lowered.BetaSwish": 1}, ops_left=["Constant", "Mul", "Sigmoid", "Mul"],
                       feeds={"x": _x()}, second_run="last")
    assert not model.functions and "example" not in model.opset_imports


def _x(dtype=np.float32) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(SHAPE) * 3).astype(dtype)


@pytest.mark.parametrize("swap", [False, True], ids=["x*sigmoid", "sigmoid*x"])
def test_silu_is_fused_with_beta_one(swap):
    proto = _model(silu(swap=swap))
    model, result = _run(proto)
    assert _ops(model) == ["example.BetaSwish"]
    assert result.modified is True and result.stats == {"SwishFusion": 1}
    node = model.graph.node(0)
    assert node.attributes["beta"].as_float() == 1.0
    assert node.metadata_props[PROVENANCE_PASS] == "fuse-swish"
    assert node.metadata_props[PROVENANCE_RULE] == "SwishFusion"
    assert model.opset_imports["example"] == 1 and ("example", "BetaSwish", "") in model.functions
    assert node.outputs[0].shape == ir.Shape(SHAPE) and node.outputs[0].dtype == ir.DataType.FLOAT
    x = _x()
    np.testing.assert_allclose(_ort(model, x), _ort(proto, x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_ort(model, x), swish(x), rtol=1e-6, atol=1e-6)
    again, second = _run(ir.serde.serialize_model(model))
    assert second.modified is False and second.stats == {"SwishFusion": 0} and _ops(again) == _ops(model)


@pytest.mark.parametrize(("dtype", "np_dtype", "tol"), [(TensorProto.FLOAT, np.float32, 1e-6),
                                                         (TensorProto.FLOAT16, np.float16, 2e-3)])
def test_beta_constant_is_fused_into_the_attribute(dtype, np_dtype, tol):
    proto = _model(scaled(), inits=[_beta(1.702, np_dtype)], dtype=dtype)
    model, result = _run(proto)
    assert _ops(model) == ["example.BetaSwish"]
    assert result.stats == {"SwishFusion": 1}
    assert model.graph.node(0).attributes["beta"].as_float() == pytest.approx(float(np_dtype(1.702)))
    x = _x(np_dtype)
    np.testing.assert_allclose(_ort(model, x).astype(np.float32), _ort(proto, x).astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("nodes", "inits", "opset", "outputs", "reason"),
    [
        (silu(), (), 14, ("y",), "opset 14 < 15"),
        (silu(), (), 17, ("y", "s"), "other readers"),
        (scaled(), [numpy_helper.from_array(np.ones(8, np.float32), "beta")], 17, ("y",), "not a one-element"),
        ([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["s", "s"], ["y"])], (), 17, ("y",), None),
    ],
    ids=["old-opset", "sigmoid-shared", "vector-beta", "not-swish"],
)
def test_near_misses_are_left_alone(nodes, inits, opset, outputs, reason):
    proto = _model(nodes, inits=inits, opset=opset, outputs=outputs)
    model, result = _run(proto)
    assert result.modified is False and result.stats == {"SwishFusion": 0}
    assert _ops(model) == [n.op_type for n in proto.graph.node]
    if reason is not None:
        assert reason in result.details["near_misses"][0]["reason"]
    else:
        assert not result.details


def test_declaration_reference_body_and_shapes_agree():
    assert SWISH.key == ("example", "BetaSwish") and SWISH.attributes == {"beta": 1.0}
    assert set(SWISH.lowerings) == {"onnx", "ort"}
    x = _x()
    (ref,) = SWISH.reference(x, beta=0.5)
    np.testing.assert_allclose(ref, x / (1 + np.exp(-0.5 * x)), rtol=1e-6)
    assert ref.dtype == np.float32 and swish(x.astype(np.float16)).dtype == np.float16
    function = swish_function(17)
    assert (function.domain, function.name) == ("example", "BetaSwish")
    assert [n.op_type for n in function] == ["Constant", "CastLike", "Mul", "Sigmoid", "Mul"]
    node = ir.node("BetaSwish", [ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT16), shape=ir.Shape([4, 2]))],
                   domain="example")
    SWISH.infer_shapes(node)
    assert node.outputs[0].dtype == ir.DataType.FLOAT16 and node.outputs[0].shape == ir.Shape([4, 2])


@pytest.mark.parametrize("beta", [1.0, 0.75])
def test_lowering_to_standard_ops(beta):
    nodes = scaled() if beta != 1.0 else silu()
    proto = _model(nodes, inits=[_beta(beta)] if beta != 1.0 else [])
    model, _ = _run(proto)
    node = model.graph.node(0)
    assert lower_swish(node, LoweringContext(model, "ort")) is True
    expected = ["Sigmoid", "Mul"] if beta == 1.0 else ["Constant", "Mul", "Sigmoid", "Mul"]
    assert _ops(model) == expected
    assert [v.name for v in model.graph.outputs] == ["y"]
    x = _x()
    np.testing.assert_allclose(_ort(model, x), swish(x, beta), rtol=1e-6, atol=1e-6)


def test_lowering_declines_an_untyped_input():
    node = ir.node("BetaSwish", [ir.Value(name="x")], domain="example")
    graph = ir.Graph([node.inputs[0]], node.outputs, nodes=[node], opset_imports={"": 17, "example": 1})
    model = ir.Model(graph, ir_version=8)
    assert lower_swish(node, LoweringContext(model, "ort")) is False
    assert _ops(model) == ["example.BetaSwish"]


def test_shape_rule_through_mograph_shapes():
    """The op's declared shape rule reaches mograph's shape query: ``Y`` has ``X``'s symbolic dims."""
    from mograph.shapes import ShapeQuery, builtin_rules, declared_rules

    x = ir.Value(name="x", shape=ir.Shape(["batch", 7, 8]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node(SWISH.name, [x], domain=SWISH.domain)
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17, SWISH.domain: SWISH.version})
    query = ShapeQuery(graph, builtin_rules().merged(declared_rules([SWISH])))
    assert query.dims(node.outputs[0]) == query.dims(x) and query.dims(x) is not None
    assert ShapeQuery(graph).dims(node.outputs[0]) is None  # without the declaration nothing is known
