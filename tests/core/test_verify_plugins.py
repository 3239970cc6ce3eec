"""``--target tensorrt --verify``: TensorRT plugin nodes are checked through their ops' function bodies.

ONNX Runtime has no kernel for a plugin node; the verifier turns each back into its canonical
``mograph.*`` op (on a copy), adds the op's function body and compares that.  The models hold the
canonical ops directly (as a fusion pass leaves them), at opset 13, where TensorRT has no native
LayerNorm or Gelu layer so every op lowers to its plugin.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import ir_io
from mograph.cli import main
from mograph.errors import VerificationError
from mograph.lowering import ensure_functions, is_plugin_node, lower_model, plugin_nodes_as_ops
from mograph.plugins import get_registry
from mograph.validate import Verifier

H = 8
RNG = np.random.default_rng(0)


def _canonical_model() -> ir.Model:
    """LayerNorm (zero B: left off the plugin node) -> FastGelu -> BiasGelu -> SkipLayerNorm (zero B and Bias)."""
    scale = (0.5 + 0.1 * np.arange(H)).astype(np.float32)
    inits = [
        numpy_helper.from_array(scale, "scale"),
        numpy_helper.from_array(np.zeros(H, np.float32), "zero"),
        numpy_helper.from_array(RNG.standard_normal(H).astype(np.float32), "bias"),
    ]
    nodes = [
        helper.make_node("LayerNorm", ["x", "scale", "zero"], ["ln"], domain="mograph", epsilon=1e-3, name="ln"),
        helper.make_node("FastGelu", ["ln"], ["fg"], domain="mograph", name="fast_gelu"),
        helper.make_node("BiasGelu", ["fg", "bias"], ["bg"], domain="mograph", name="bias_gelu"),
        helper.make_node("SkipLayerNorm", ["bg", "x", "scale", "zero", "zero"], ["y", "unused_sum"],
                         domain="mograph", name="skip"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, H])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("mograph", 1)])
    proto.ir_version = 8
    model = ir_io.load_model(proto, check=False)
    ensure_functions(model, get_registry().custom_ops)
    return model


def _copy(model: ir.Model) -> ir.Model:
    return ir.serde.deserialize_model(ir.serde.serialize_model(model))


def _plugins(model: ir.Model) -> list[tuple[str, int]]:
    return [(n.op_type, len(n.inputs)) for n in model.graph if is_plugin_node(n)]


def test_lowered_model_has_plugin_nodes_ort_cannot_run():
    lowered = _copy(_canonical_model())
    lower_model(lowered, "tensorrt", registry=get_registry())
    assert _plugins(lowered) == [("LayerNorm", 2), ("Gelu", 1), ("BiasGelu", 2), ("SkipLayerNorm", 3)]


def test_plugin_nodes_map_back_to_their_ops():
    lowered = _copy(_canonical_model())
    lower_model(lowered, "tensorrt", registry=get_registry())
    done, left = plugin_nodes_as_ops(lowered, get_registry().custom_ops)
    assert (done, left) == (4, [])
    assert [(n.domain, n.op_type, len(n.inputs)) for n in lowered.graph] == [
        ("mograph", "LayerNorm", 3), ("mograph", "FastGelu", 1), ("mograph", "BiasGelu", 2),
        ("mograph", "SkipLayerNorm", 5),
    ]
    ln = lowered.graph.node(0)
    assert ln.attributes["epsilon"].value == pytest.approx(1e-3)
    np.testing.assert_array_equal(ln.inputs[2].const_value.numpy(), np.zeros(H, np.float32))
    assert {k[1] for k in lowered.functions} == {"LayerNorm", "FastGelu", "BiasGelu", "SkipLayerNorm"}


def test_verifier_checks_plugin_nodes_through_function_bodies():
    original = _canonical_model()
    lowered = _copy(original)
    lower_model(lowered, "tensorrt", registry=get_registry())
    check = Verifier(original, registry=get_registry()).check(lowered, family="fusion")
    assert check["passed"] is True, check
    assert check["plugin_nodes"] == 4
    assert "4 TensorRT plugin node(s) checked through their ops' function bodies" in check["summary"]
    assert _plugins(lowered)  # the model itself keeps its plugin nodes


def test_a_wrong_plugin_field_is_caught():
    original = _canonical_model()
    lowered = _copy(original)
    lower_model(lowered, "tensorrt", registry=get_registry())
    gelu = next(n for n in lowered.graph if n.op_type == "Gelu")
    gelu.attributes["approximate"] = ir.AttrString("approximate", "none")  # exact Gelu where FastGelu was fused
    ln = next(n for n in lowered.graph if n.op_type == "LayerNorm")
    ln.attributes["epsilon"] = ir.AttrFloat32("epsilon", 10.0)
    check = Verifier(original, atol=1e-6, rtol=1e-6, registry=get_registry()).check(lowered, family="fusion")
    assert check["passed"] is False and check["outputs"]["y"]["max_abs"] > 1e-3


def _fusable_proto() -> onnx.ModelProto:
    """y = LayerNorm(x) written out at opset 13 (what fuse-layernorm fuses), then exact Gelu by Erf."""
    scale = (0.5 + 0.1 * np.arange(H)).astype(np.float32)
    bias = (0.01 * np.arange(H)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]),
        helper.make_node("Sub", ["x", "mu"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]),
        helper.make_node("Mul", ["n", "scale"], ["ns"]),
        helper.make_node("Add", ["ns", "bias"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
             numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(bias, "bias")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("mode", ["end", "each"])
def test_target_tensorrt_verify_passes_from_the_cli(tmp_path, capsys, mode):
    src = tmp_path / "ln.onnx"
    onnx.save(_fusable_proto(), src)
    out = tmp_path / "ln.trt.onnx"
    code = main(["optimize", str(src), "-o", str(out), "--passes", "fuse-layernorm", "--target", "tensorrt",
                 "--verify", mode])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert [n.op_type for n in onnx.load(out).graph.node] == ["LayerNorm"]  # the plugin node is what is written
    assert "TensorRT plugin node(s) checked through their ops' function bodies" in captured.out


def test_run_passes_keeps_failing_a_wrong_lowering(monkeypatch):
    """A plugin node whose fields disagree with the fused op still fails verification (exit 5)."""
    from mograph import api

    reg = get_registry()
    op = reg.custom_ops[("mograph", "LayerNorm")]
    real = op.lowerings["tensorrt"]

    def wrong(node, ctx):  # type: ignore[no-untyped-def]
        if not real(node, ctx):
            return False
        for n in ctx.model.graph:
            if is_plugin_node(n) and n.op_type == "LayerNorm":
                n.attributes["epsilon"] = ir.AttrFloat32("epsilon", 5.0)
        return True

    monkeypatch.setitem(op.lowerings, "tensorrt", wrong)
    with pytest.raises(VerificationError):
        api.optimize(_fusable_proto(), ["fuse-layernorm"], options={"target": "tensorrt"}, verify=True)


def test_a_plugin_node_with_a_bad_field_is_named_not_a_crash():
    original = _canonical_model()
    lowered = _copy(original)
    lower_model(lowered, "tensorrt", registry=get_registry())
    gelu = next(n for n in lowered.graph if n.op_type == "Gelu")
    gelu.attributes["approximate"] = ir.AttrString("approximate", "cubic")
    check = Verifier(original, registry=get_registry()).check(lowered, family="fusion")
    assert check["passed"] is False and check["plugin_nodes"] == 3
    assert len(check["plugin_nodes_unchecked"]) == 1 and "approximate must be one of" in check["plugin_nodes_unchecked"][0]
    assert "cannot be loaded" in check["reason"]
