"""fuse-gelu / fuse-bias-gelu on graphs built in code, one per exporter form, and the fused ops."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _fusion_util import lowered
from mograph.passes.fusion import ops
from mograph.passes.fusion.bias_gelu import FuseBiasGeluPass
from mograph.passes.fusion.gelu import FuseGeluPass

from mograph.testing import assert_untouched, op_types, parse
from mograph.testing import check_pass as check_fusion

H = 8
HEAD = f'<ir_version: 8, opset_import: ["" : 17]>\ng (float[2,3,{H}] x) => (float[2,3,{H}] y) '
C = {
    "half": "float half = {0.5}", "one": "float one = {1.0}", "two": "float two = {2.0}",
    "sqrt2": f"float sqrt2 = {{{math.sqrt(2):.7f}}}", "isqrt2": f"float isqrt2 = {{{1 / math.sqrt(2):.7f}}}",
    "c": f"float c = {{{math.sqrt(2 / math.pi):.7f}}}", "a": "float a = {0.044715}", "three": "float three = {3.0}",
    "ca": f"float ca = {{{math.sqrt(2 / math.pi) * 0.044715:.7f}}}", "k": "float k = {1.702}",
}


def model(body: str) -> str:
    inits = ", ".join(C.values())
    return HEAD + f"<{inits}> {{\n  " + "\n  ".join(body.strip().splitlines()) + "\n}"


OUTER = {
    "(x*0.5)*t": "h = Mul(x, half)\n y = Mul(h, t)",
    "x*(t*0.5)": "h = Mul(half, t)\n y = Mul(x, h)",
    "(x*t)*0.5": "h = Mul(t, x)\n y = Mul(h, half)",
    "(x*t)/2": "h = Mul(x, t)\n y = Div(h, two)",
}


@pytest.mark.parametrize("assoc", list(OUTER))
@pytest.mark.parametrize("scale", ["div-sqrt2", "mul-inv-sqrt2"])
def test_gelu_exact_forms(assoc, scale):
    z = "z = Div(x, sqrt2)" if scale == "div-sqrt2" else "z = Mul(isqrt2, x)"
    text = model(f"{z}\n e = Erf(z)\n t = Add(one, e)\n" + OUTER[assoc])
    stats = {"GeluFusion": 1, f"GeluFusion.{assoc}.{scale}": 1}
    check_fusion(FuseGeluPass(), parse(text), stats=stats, ops_left=["mograph.Gelu"])


INNER = {
    "c*(x+a*x3)": "p = Mul(cube, a)\n q = Add(x, p)\n u = Mul(c, q)",
    "c*x+c*a*x3": "p = Mul(x, c)\n q = Mul(ca, cube)\n u = Add(p, q)",
    "c*x*(1+a*x2)": "x2 = Mul(x, x)\n p = Mul(a, x2)\n q = Add(one, p)\n r = Mul(x, c)\n u = Mul(r, q)",
}
CUBE = {"pow3": "cube = Pow(x, three)", "x*x*x": "xx = Mul(x, x)\n cube = Mul(x, xx)"}


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("cube", list(CUBE))
@pytest.mark.parametrize("assoc", ["(x*0.5)*t", "(x*t)*0.5"])
def test_gelu_tanh_forms(inner, cube, assoc):
    body = (CUBE[cube] + "\n" if "cube" in INNER[inner] else "") + INNER[inner] + "\n e = Tanh(u)\n t = Add(e, one)\n" + OUTER[assoc]
    stats = {"GeluTanhFusion": 1, f"GeluTanhFusion.{assoc}.{inner}" + (f".{cube}" if "cube" in INNER[inner] else ""): 1}
    check_fusion(FuseGeluPass(), parse(model(body)), stats=stats, ops_left=["mograph.FastGelu"])


def test_quick_gelu():
    text = model("u = Mul(x, k)\n s = Sigmoid(u)\n y = Mul(s, x)")
    check_fusion(lowered(FuseGeluPass(), "ort"), parse(text), stats={"QuickGeluFusion": 1, "lowered.QuickGelu": 1},
                 ops_left=["com.microsoft.QuickGelu"])


@pytest.mark.parametrize("target,expected", [
    ("mograph", ["mograph.Gelu"]), ("ort", ["com.microsoft.Gelu"]),
])
def test_gelu_targets(target, expected):
    text = model("z = Div(x, sqrt2)\n e = Erf(z)\n t = Add(one, e)\n" + OUTER["(x*t)*0.5"])
    check_fusion(lowered(FuseGeluPass(), target), parse(text), ops_left=expected)


def test_gelu_target_onnx_below_opset_20_inlines_the_body():
    from mograph.testing import assert_close, feeds_for, run_ort, run_pass, to_proto

    proto = parse(model("z = Div(x, sqrt2)\n e = Erf(z)\n t = Add(one, e)\n" + OUTER["(x*t)*0.5"]))
    m, result = run_pass(lowered(FuseGeluPass(), "onnx"), proto)
    assert result.stats["GeluFusion"] == 1 and result.stats["inlined.Gelu"] == 1
    assert "Erf" in op_types(m) and not any(n.domain for n in m.graph) and not m.functions  # standard ONNX only
    feeds = feeds_for(proto)
    assert_close(run_ort(proto, feeds), run_ort(to_proto(m), feeds))


def test_gelu_onnx_target_at_opset_20_uses_standard_gelu():
    text = model("z = Div(x, sqrt2)\n e = Erf(z)\n t = Add(one, e)\n" + OUTER["(x*t)*0.5"]).replace('"" : 17', '"" : 20')
    check_fusion(lowered(FuseGeluPass(), "onnx"), parse(text), ops_left=["Gelu"])


def test_gelu_near_miss_wrong_constant():
    text = model("z = Div(x, two)\n e = Erf(z)\n t = Add(one, e)\n" + OUTER["(x*t)*0.5"])
    result = assert_untouched(FuseGeluPass(explain=True), parse(text))
    (miss,) = result.details["rules"]["GeluFusion"]["near_miss_list"]
    assert "expected 1.414" in miss["reason"]


def test_silu_is_not_gelu():
    # x * sigmoid(x) (SiLU) must stay, and is not even reported as a near miss
    result = assert_untouched(FuseGeluPass(explain=True), parse(model("s = Sigmoid(x)\n y = Mul(x, s)")))
    assert result.details["rules"]["QuickGeluFusion"]["candidates"] == 0


BIAS = ",".join(f"{0.1 * i - 0.3:.2f}" for i in range(H))


@pytest.mark.parametrize("form,op_name", [("exact", "BiasGelu"), ("tanh", "BiasFastGelu")])
@pytest.mark.parametrize("target", ["mograph", "ort"])
def test_bias_gelu(form, op_name, target):
    from mograph.pass_infra import graph_fingerprint
    from mograph.testing import feeds_for, op_types, run_ort, to_ir, to_proto

    gelu = ("z = Div(xb, sqrt2)\n e = Erf(z)\n t = Add(one, e)\n h = Mul(xb, t)\n y = Mul(h, half)" if form == "exact"
            else "cube = Pow(xb, three)\n p = Mul(cube, a)\n q = Add(xb, p)\n u = Mul(c, q)\n e = Tanh(u)\n"
                 " t = Add(e, one)\n h = Mul(xb, half)\n y = Mul(h, t)")
    text = model(f"xb = Add(b, x)\n{gelu}").replace("> {", f", float[{H}] b = {{{BIAS}}}> {{")
    proto = parse(text)
    feeds = feeds_for(proto)
    m = to_ir(proto)
    FuseGeluPass().call(m)  # canonical ops first; the lower step comes last
    result = lowered(FuseBiasGeluPass(), target).call(m)
    stats = {"BiasGeluFusion": 1, f"BiasGeluFusion.{form}": 1}
    if target == "ort":
        stats["lowered." + op_name] = 1
    assert result.stats == stats
    expected = {"mograph": f"mograph.{op_name}", "ort": "com.microsoft." + ("BiasGelu" if form == "exact" else "FastGelu")}
    assert op_types(m) == [expected[target]]
    np.testing.assert_allclose(run_ort(to_proto(m), feeds)[0], run_ort(proto, feeds)[0], atol=1e-4)
    before = graph_fingerprint(m)
    assert lowered(FuseBiasGeluPass(), target).call(m).modified is False
    assert graph_fingerprint(m) == before


def test_bias_gelu_near_miss_bias_not_constant():
    text = model("z = Div(xb, sqrt2)\n e = Erf(z)\n t = Add(one, e)\n h = Mul(xb, t)\n y = Mul(h, half)")
    text = text.replace("g (float[2,3,8] x)", "g (float[2,3,8] x, float[8] b)").replace("  z = Div", "  xb = Add(x, b)\n  z = Div")
    from mograph.testing import to_ir

    m = to_ir(parse(text))
    FuseGeluPass().call(m)
    result = FuseBiasGeluPass(explain=True).call(m)
    assert result.modified is False
    (miss,) = result.details["rules"]["BiasGeluFusion"]["near_miss_list"]
    assert "not a constant" in miss["reason"]


# ------------------------------------------------------------------ the ops themselves ----------


def test_references_match_function_bodies():
    """The numpy references agree with the ONNX function bodies run by ONNX Runtime."""
    import onnx
    from onnx import helper

    from mograph.testing import run_ort

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, H)).astype(np.float32)
    vec = rng.standard_normal(H).astype(np.float32)
    cases = {
        "LayerNorm": ([x, vec, vec * 0.1], {"epsilon": 1e-5}),
        "RMSNorm": ([x, vec], {"epsilon": 1e-6}),
        "SkipLayerNorm": ([x, x[::-1].copy(), vec, vec * 0.1, vec * 0.2], {"epsilon": 1e-5}),
        "SkipRMSNorm": ([x, x[::-1].copy(), vec, vec * 0.2], {"epsilon": 1e-6}),
        "Gelu": ([x], {}), "FastGelu": ([x], {}), "QuickGelu": ([x], {}),
        "BiasGelu": ([x, vec], {}), "BiasFastGelu": ([x, vec], {}),
    }
    for opset in (14, 18):
        for name, (args, attrs) in cases.items():
            decl = next(o for o in ops.custom_ops() if o.name == name)
            expected = decl.reference(*args, **attrs)
            names = [f"i{i}" for i in range(len(args))]
            outs = [f"o{i}" for i in range(len(expected))]
            node = helper.make_node(name, names, outs, domain="mograph", **attrs)
            graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, 1, a.shape) for n, a in zip(names, args)],
                                      [helper.make_tensor_value_info(o, 1, args[0].shape) for o in outs])
            import onnx_ir as ir

            proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("mograph", 1)])
            proto.functions.append(ir.serde.serialize_function(ops.function_for(name, opset)))
            onnx.checker.check_model(proto)
            got = run_ort(proto, dict(zip(names, args)))
            for e, g in zip(expected, got):
                np.testing.assert_allclose(g, e, atol=2e-5, err_msg=f"{name} opset {opset}")


def test_custom_ops_registered_once():
    from mograph.plugins import get_registry

    reg = get_registry()
    mine = sorted(name for (domain, name) in reg.custom_ops if domain == "mograph" and name in ops.FUSED_OPS)
    assert mine == sorted(ops.FUSED_OPS)
    # the norm and GELU passes come first, in this order (later passes, e.g. attention, may follow)
    assert reg.expand("fuse")[:6] == ["fuse-layernorm", "fuse-rmsnorm", "fuse-embed-layernorm", "fuse-skip-layernorm",
                                      "fuse-gelu", "fuse-bias-gelu"]


def test_package_references_agree_with_kernel_references():
    """ops' references are thin calls of the one reference of each op, mograph._kernels.reference."""
    from mograph._kernels import reference as kref

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, H)).astype(np.float32)
    g, b = rng.standard_normal(H).astype(np.float32), rng.standard_normal(H).astype(np.float32)
    np.testing.assert_allclose(ops.layer_norm(x, g, b, 1e-5), kref.layer_norm(x, g, b, 1e-5), atol=1e-5)
    np.testing.assert_allclose(ops.rms_norm(x, g, 1e-6), kref.rms_norm(x, g, 1e-6), atol=1e-5)
    for approx in ("none", "tanh"):
        np.testing.assert_allclose(ops.gelu(x, approx), kref.gelu(x, approx), atol=1e-5)
        np.testing.assert_allclose(ops.bias_gelu(x, b, approx), kref.bias_gelu(x, b, approx), atol=1e-5)
