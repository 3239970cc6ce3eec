"""The one lowering step (:mod:`mograph.lowering`): the ``lower`` pass, the pipeline plan, backends' first act."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import mograph
from mograph.errors import OptionError, PassFailedError
from mograph.lowering import LowerPass, has_custom_ops, known_targets, lowered_for
from mograph.pass_infra import graph_fingerprint
from mograph.plugins import get_registry
from mograph.testing import assert_untouched, check_pass, feeds_for, op_types, parse, run_ort, to_ir, to_proto

H = 16
GAMMA = ", ".join(f"{1 + 0.01 * i:.2f}" for i in range(H))

#: A fused model as ``--target mograph`` leaves it: two canonical ops with their function bodies.
FUSED = f"""<ir_version: 8, opset_import: ["" : 17, "mograph" : 1]>
g (float[2,5,{H}] x, float[2,5,{H}] res) => (float[2,5,{H}] y) <float[{H}] gamma = {{{GAMMA}}}, float[1] zero = {{0.0}}> {{
  n, s = mograph.SkipLayerNorm<epsilon=1e-5>(x, res, gamma, zero, zero)
  y = mograph.Gelu(n)
}}"""


def _fused() -> onnx.ModelProto:
    from mograph.passes.fusion.ops import function_for

    proto = onnx.parser.parse_model(FUSED)
    for name in ("SkipLayerNorm", "Gelu"):
        proto.functions.append(mograph.ir_io.ir.serde.serialize_function(function_for(name, 17)))
    onnx.checker.check_model(proto)
    return proto


@pytest.mark.parametrize("target,ops,stats", [
    ("ort", ["com.microsoft.SkipLayerNormalization", "com.microsoft.Gelu"],
     {"lowered.SkipLayerNorm": 1, "lowered.Gelu": 1}),
    # opset 17: LayerNormalization is standard, Gelu (20) is not, so its body is inlined
    ("onnx", None, {"lowered.SkipLayerNorm": 1, "inlined.Gelu": 1}),
])
def test_lower_pass_the_five_checks(target, ops, stats):
    pytest.importorskip("onnxruntime")
    model = check_pass(LowerPass(target=target), _fused(), stats=stats, ops_left=ops, rel=1e-4)
    if target == "onnx":
        assert "LayerNormalization" in op_types(model) and "Erf" in op_types(model)
        assert not model.functions and "mograph" not in model.opset_imports
        # the inlined body is simplified for the concrete call: float32 in, so no casts, constants folded
        assert not {"Cast", "CastLike"} & set(op_types(model)), op_types(model)


def test_lower_keeps_custom_ops_for_mograph_and_touches_a_model_without_any():
    assert not LowerPass(target="mograph", registry=get_registry()).call(to_ir(_fused())).modified
    plain = parse('<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) { y = Relu(x) }')
    result = assert_untouched(LowerPass(target="ort"), plain)
    assert result.stats == {}


def test_a_target_lowerings_decline_keeps_the_op_with_its_body():
    pytest.importorskip("onnxruntime")
    # QuickGelu has no onnx lowering and tensorrt lowers it to pointwise ops; a Gelu at opset 17 has no
    # tensorrt standard form either, so it becomes a plugin node; nothing is left half-done
    model = to_ir(_fused())
    result = LowerPass(target="tensorrt", registry=get_registry()).call(model)
    assert result.stats == {"lowered.SkipLayerNorm": 1, "lowered.Gelu": 1}
    assert all("plugin_namespace" in n.attributes for n in model.graph if n.domain == "mograph")
    assert not model.functions  # plugin nodes carry no body


def test_unknown_target_is_an_option_error_listing_the_known_ones():
    with pytest.raises(OptionError, match="unknown target.*onnx, ort, tensorrt, mograph"):
        LowerPass(target="tpu")
    assert {"onnx", "ort", "tensorrt", "mograph"} <= set(known_targets(get_registry()))


def test_onnx_target_refuses_an_op_without_standard_form_or_body():
    from mograph.custom_ops import CustomOp
    from mograph.lowering import lower_model

    reg = get_registry()
    op = CustomOp(name="Opaque", domain="acme")
    registry = type(reg)(pm=reg.pm, custom_ops={**reg.custom_ops, op.key: op}, backends=reg.backends)
    text = '<ir_version: 8, opset_import: ["" : 17, "acme" : 1]> g (float[2] x) => (float[2] y) { y = acme.Opaque(x) }'
    with pytest.raises(PassFailedError, match="no standard ONNX form at opset 17 and no function body"):
        lower_model(to_ir(onnx.parser.parse_model(text)), "onnx", registry=registry)


def test_plan_appends_lower_where_a_pass_fuses_or_a_target_is_given():
    reg = get_registry()
    assert reg.plan("cleanup") == reg.expand("cleanup")
    after = reg.expand("after-lower")  # the lowered forms' shape computations, tidied
    assert after == ["simplify-shapes", "cse", "eliminate-dead"]  # lower runs once
    assert reg.plan("cleanup", {"target": "ort"})[-4:] == ["lower", *after]
    assert reg.plan("fuse,qdq-int8")[-5:] == ["qdq-int8", "lower", *after]
    assert reg.plan("fuse", {"target": "mograph"})[-1] == "lower"  # the fused ops kept: nothing to tidy
    explicit = reg.plan("fuse-layernorm,lower,cleanup")
    assert explicit.count("lower") == 1 and explicit.index("lower") == 1  # where the user put it
    assert "simplify-shapes" not in explicit  # nothing is added after a lower the list names


def test_optimize_reports_the_lower_step_as_a_pass():
    _, report = mograph.optimize(_fused(), "eliminate-dead", options={"target": "ort"})
    (lower,) = [p for p in report.passes if p.name == "lower"]  # once: the after-lower preset has none
    assert lower.modified and lower.stats == {"lowered.SkipLayerNorm": 1, "lowered.Gelu": 1}
    assert [p.name for p in report.passes][-4:] == ["lower", "simplify-shapes", "cse", "eliminate-dead"]


def test_backends_lower_first_without_changing_the_callers_model():
    ort = pytest.importorskip("onnxruntime")
    del ort
    model = to_ir(_fused())
    before = graph_fingerprint(model)
    assert has_custom_ops(model, get_registry())
    lowered, stats = lowered_for(model, "ort", registry=get_registry())
    assert lowered is not model and stats == {"lowered.SkipLayerNorm": 1, "lowered.Gelu": 1}
    assert graph_fingerprint(model) == before and not has_custom_ops(lowered, get_registry())
    runner = get_registry().backends["ort"].make_runner(model, optimizations=False, registry=get_registry())
    assert runner.lowered == stats
    feeds = feeds_for(_fused())
    got = runner(feeds)["y"]
    np.testing.assert_allclose(got, run_ort(to_proto(model), feeds)[0], rtol=1e-4, atol=1e-5)
    _same, none = lowered_for(to_ir(parse('<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) '
                                         '{ y = Relu(x) }')), "ort", registry=get_registry())
    assert none == {}


def test_tensorrt_plugin_nodes_beside_a_kept_op_of_the_same_name_pass_the_output_check():
    """torchaudio's Emformer RNN-T with ``--target tensorrt``: 28 SkipLayerNorms became plugin nodes, two (a
    ``[hidden]`` bias as the skip, which the plugin does not broadcast) stayed ``mograph.SkipLayerNorm`` with
    their function body.  ONNX Runtime's load then read the plugin nodes as calls of that body (two outputs
    against the plugin node's one) and refused the model: exit 4, 'wrote a model that does not load'.  Such a
    model is not ONNX Runtime's to load; the check says why it skipped."""
    from mograph.passes.fusion.ops import function_for

    from mograph.output_check import check_model_output

    text = FUSED.replace("  y = mograph.Gelu(n)\n", "  m, t = mograph.SkipLayerNorm<epsilon=1e-5>(n, gamma, gamma, zero, zero)\n"
                         "  y = Identity(m)\n")
    proto = onnx.parser.parse_model(text)
    proto.functions.append(mograph.ir_io.ir.serde.serialize_function(function_for("SkipLayerNorm", 17)))
    onnx.checker.check_model(proto)
    model = to_ir(proto)
    result = LowerPass(target="tensorrt", registry=get_registry()).call(model)
    assert result.stats == {"lowered.SkipLayerNorm": 1, "kept.SkipLayerNorm": 1}
    assert any("plugin_namespace" in n.attributes for n in model.graph) and model.functions
    out = check_model_output(model)
    assert out["onnx_checker"] == "passed" and out["onnxruntime"].startswith("skipped: TensorRT plugin node"), out
