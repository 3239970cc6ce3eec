"""fuse-layernorm / fuse-rmsnorm / fuse-skip-layernorm on graphs built in code, one per variant."""

from __future__ import annotations

import numpy as np
import pytest
from _fusion_util import lowered
from mograph.passes.fusion.layernorm import FuseLayerNormPass
from mograph.passes.fusion.rmsnorm import FuseRMSNormPass
from mograph.passes.fusion.skip_layernorm import FuseSkipLayerNormPass

from mograph.testing import assert_untouched, feeds_for, op_types, parse, run_ort, run_pass
from mograph.testing import check_pass as check_fusion

H = 16
GAMMA = ",".join(f"{0.5 + 0.05 * i:.3f}" for i in range(H))
BETA = ",".join(f"{0.01 * i - 0.05:.3f}" for i in range(H))


def _mean(opset: int, form: str, src: str, out: str) -> str:
    """Lines computing ``out`` = mean of ``src`` over the last axis."""
    if form == "reducemean":
        if opset >= 18:
            return f"{out} = ReduceMean({src}, ax)"
        return f"{out} = ReduceMean<axes=[-1]>({src})"
    red = f"ReduceSum({src}, ax)" if opset >= 13 else f"ReduceSum<axes=[-1]>({src})"
    if form == "reducesum-div":
        return f"{out}_s = {red}\n  {out} = Div({out}_s, n)"
    return f"{out}_s = {red}\n  {out} = Mul(ninv, {out}_s)"


def layernorm_model(*, opset: int = 17, mean: str = "reducemean", square: str = "pow", var: str = "centered",
                    clamp: bool = False, norm: str = "div-sqrt", scale: bool = True, bias: bool = True,
                    eps: str = "initializer", fp16: bool = False, x_dtype: str = "float") -> str:
    lines = []
    x = "x"
    if fp16:
        lines.append("xf = Cast<to=1>(x)")
        x = "xf"
    lines.append(_mean(opset, mean, x, "m"))
    lines.append(f"d = Sub({x}, m)")
    sq = (lambda v: f"Pow({v}, two)") if square == "pow" else (lambda v: f"Mul({v}, {v})")
    if var == "centered":
        lines.append(f"dd = {sq('d')}")
        lines.append(_mean(opset, mean, "dd", "v0"))
    else:
        lines.append(f"xx = {sq(x)}")
        lines.append(_mean(opset, mean, "xx", "ex2"))
        lines.append(f"m2 = {sq('m')}")
        lines.append("v0 = Sub(ex2, m2)")
    vname = "v0"
    if clamp:
        lines.append("v = Max(v0, zero)")
        vname = "v"
    eps_name = {"initializer": "eps", "constant": "eps_c", "cast": "eps_cast", "input": "eps_in"}[eps]
    if eps == "constant":
        lines.append("eps_c = Constant<value = float {1e-5}>()")
    elif eps == "cast":
        lines.append("eps_d = Constant<value = double {1e-5}>()")
        lines.append("eps_cast = Cast<to=1>(eps_d)")
    elif eps == "input":
        eps_name = "eps_in"
    lines.append(f"ve = Add({vname}, {eps_name})")
    if norm == "div-sqrt":
        lines += ["sd = Sqrt(ve)", "y0 = Div(d, sd)"]
    elif norm == "mul-reciprocal":
        lines += ["sd = Sqrt(ve)", "r = Reciprocal(sd)", "y0 = Mul(r, d)"]
    else:
        lines += ["r = Pow(ve, mhalf)", "y0 = Mul(d, r)"]
    y = "y0"
    if fp16:
        lines.append("yh = Cast<to=10>(y0)")
        y = "yh"
    if scale:
        lines.append(f"y1 = Mul(gamma, {y})")
        y = "y1"
    if bias:
        lines.append(f"y2 = Add({y}, beta)")
        y = "y2"
    lines.append(f"y = Identity({y})")
    t = "float"
    inputs = f"{t}[2,5,{H}] x" + (", float eps_in" if eps == "input" else "")
    inits = [
        f"{t}[{H}] gamma = {{{GAMMA}}}", f"{t}[{H}] beta = {{{BETA}}}", "float eps = {1e-5}", "float two = {2.0}",
        "float zero = {0.0}", "float mhalf = {-0.5}", f"float n = {{{H}.0}}", f"float ninv = {{{1.0 / H}}}",
        "int64[1] ax = {-1}",
    ]
    body = "\n  ".join(lines)
    return (f'<ir_version: 8, opset_import: ["" : {opset}]>\n'
            f"g ({inputs}) => ({t}[2,5,{H}] y) <{', '.join(inits)}> {{\n  {body}\n}}")


def _ln(text: str):
    proto = parse(text)
    if "Cast<to=10>" in text:
        proto = to_fp16(proto)
    return proto


def to_fp16(proto):
    """The fp16 version of a graph written with float I/O and float scale/bias (Casts already in the text)."""
    import onnx
    from onnx import numpy_helper

    for v in list(proto.graph.input) + list(proto.graph.output):
        v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    for i, init in enumerate(proto.graph.initializer):
        if init.name in ("gamma", "beta"):
            arr = numpy_helper.to_array(init).astype(np.float16)
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.checker.check_model(proto)
    return proto


CORE = {"LayerNormFusion": 1, "LayerNormScaleFusion": 1, "LayerNormBiasFusion": 1}


def _stats(variant: str, *, scale: bool = True, bias: bool = True, cast: bool = False) -> dict[str, int]:
    out = {"LayerNormFusion": 1, f"LayerNormFusion.{variant}": 1}
    if scale:
        out["LayerNormScaleFusion"] = 1
    if bias:
        out["LayerNormBiasFusion"] = 1
    if cast:
        out["LayerNormCastFusion"] = 1
        out["LayerNormCastFusion.stash"] = 1
    return out


@pytest.mark.parametrize("opset", [14, 17, 18])
@pytest.mark.parametrize("mean", ["reducemean", "reducesum-div", "reducesum-mul"])
def test_layernorm_mean_forms(opset, mean):
    text = layernorm_model(opset=opset, mean=mean)
    variant = f"div-sqrt.centered.{mean}"
    check_fusion(FuseLayerNormPass(), _ln(text), stats=_stats(variant), ops_left=["mograph.LayerNorm", "Identity"])


@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("var", ["centered", "moments"])
@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("norm", ["div-sqrt", "mul-reciprocal", "mul-pow"])
def test_layernorm_variance_and_norm_forms(square, var, clamp, norm):
    text = layernorm_model(square=square, var=var, clamp=clamp, norm=norm)
    variant = f"{norm}.{var}.reducemean" + (".max0" if clamp else "")
    check_fusion(FuseLayerNormPass(), _ln(text), stats=_stats(variant), ops_left=["mograph.LayerNorm", "Identity"])


@pytest.mark.parametrize("scale,bias", [(False, False), (True, False), (False, True)])
def test_layernorm_without_scale_or_bias(scale, bias):
    text = layernorm_model(scale=scale, bias=bias)
    model = check_fusion(lowered(FuseLayerNormPass(), "ort"), _ln(text),
                         stats={**_stats("div-sqrt.centered.reducemean", scale=scale, bias=bias), "lowered.LayerNorm": 1})
    assert op_types(model) == ["LayerNormalization", "Identity"]


@pytest.mark.parametrize("eps", ["initializer", "constant", "cast"])
def test_layernorm_epsilon_forms(eps):
    text = layernorm_model(eps=eps)
    check_fusion(FuseLayerNormPass(), _ln(text), stats=_stats("div-sqrt.centered.reducemean"))


@pytest.mark.parametrize("opset", [17, 18])
def test_layernorm_fp16_with_casts_around_the_reduction(opset):
    text = layernorm_model(opset=opset, fp16=True)
    model = check_fusion(FuseLayerNormPass(), _ln(text),
                         stats=_stats("div-sqrt.centered.reducemean", cast=True), rel=2e-3)
    assert op_types(model) == ["mograph.LayerNorm", "Identity"]
    node = next(iter(model.graph))
    assert node.attributes["stash_type"].value == 1
    assert node.inputs[0].name == "x"


@pytest.mark.parametrize("target,expected", [
    ("mograph", ["mograph.LayerNorm", "Identity"]),
    ("onnx", ["LayerNormalization", "Identity"]),
    ("ort", ["LayerNormalization", "Identity"]),
    ("tensorrt", ["LayerNormalization", "Identity"]),
])
def test_layernorm_targets_opset17(target, expected):
    model = check_fusion(lowered(FuseLayerNormPass(), target), _ln(layernorm_model(opset=17)))
    assert op_types(model) == expected


def test_layernorm_targets_opset14():
    proto = _ln(layernorm_model(opset=14))
    model = check_fusion(FuseLayerNormPass(), proto)
    assert op_types(model) == ["mograph.LayerNorm", "Identity"]  # the canonical op, with its function body
    assert ("mograph", "LayerNorm", "") in model.functions
    model, result = run_pass(lowered(FuseLayerNormPass(), "onnx"), proto)  # no standard op below 17: inlined
    assert result.stats["inlined.LayerNorm"] == 1 and "lowered.LayerNorm" not in result.stats
    assert not any(n.domain == "mograph" for n in model.graph) and not model.functions
    assert "mograph" not in model.opset_imports
    model = check_fusion(lowered(FuseLayerNormPass(), "ort"), proto)
    assert op_types(model) == ["LayerNormalization", "Identity"]  # ORT's own op at any opset
    model, _ = run_pass(lowered(FuseLayerNormPass(), "tensorrt"), proto)
    node = next(iter(model.graph))
    assert (node.domain, node.op_type) == ("mograph", "LayerNorm")
    assert node.attributes["plugin_namespace"].value == "mograph"
    assert node.attributes["plugin_version"].value == "1"
    assert not model.functions  # a plugin node has no body, so the parser falls back to the plugin


# ------------------------------------------------------------------ near misses -----------------


def test_near_miss_epsilon_not_constant():
    text = layernorm_model(eps="input")
    result = assert_untouched(FuseLayerNormPass(explain=True), _ln(text))
    misses = result.details["rules"]["LayerNormFusion"]["near_miss_list"]
    assert [m["reason"] for m in misses] == ["epsilon is not a constant"]
    assert result.details["rules"]["LayerNormFusion"]["candidates"] == 1


def test_near_miss_reduction_not_last_axis():
    text = layernorm_model().replace("axes=[-1]", "axes=[1]")
    result = assert_untouched(FuseLayerNormPass(explain=True), _ln(text))
    (miss,) = result.details["rules"]["LayerNormFusion"]["near_miss_list"]
    assert "is not over the last axis" in miss["reason"]


def test_near_miss_intermediate_is_graph_output():
    text = layernorm_model().replace("=> (float[2,5,16] y)", "=> (float[2,5,16] y, float[2,5,1] v0)")
    proto = _ln(text)
    result = assert_untouched(FuseLayerNormPass(explain=True), proto)
    (miss,) = result.details["rules"]["LayerNormFusion"]["near_miss_list"]
    assert miss["reason"] == "intermediate value 'v0' is also a graph output"
    assert miss["nodes"]  # names of the nodes involved


def test_near_miss_without_explain_counts_only():
    result = assert_untouched(FuseLayerNormPass(), _ln(layernorm_model(eps="input")))
    entry = result.details["rules"]["LayerNormFusion"]
    assert entry == {"candidates": 1, "fused": 0, "near_misses": 1}


def test_mean_read_elsewhere_is_left_correct():
    # the mean is read by another node: fusing would delete it -> near miss, numbers unchanged
    text = layernorm_model().replace("y = Identity(y2)", "y3 = Add(y2, m)\n  y = Identity(y3)")
    result = assert_untouched(FuseLayerNormPass(explain=True), _ln(text))
    (miss,) = result.details["rules"]["LayerNormFusion"]["near_miss_list"]
    assert "is also read by" in miss["reason"]


# ------------------------------------------------------------------ RMSNorm ---------------------


def rmsnorm_model(*, opset: int = 17, eps: bool = True, norm: str = "mul-reciprocal", square: str = "pow",
                  fp16: bool = False, mean: str = "reducemean") -> str:
    t = "float"
    lines = []
    x = "x"
    if fp16:
        lines.append("xf = Cast<to=1>(x)")
        x = "xf"
    lines.append(f"xx = Pow({x}, two)" if square == "pow" else f"xx = Mul({x}, {x})")
    lines.append(_mean(opset, mean, "xx", "ms"))
    root = "ms"
    if eps:
        lines.append("mse = Add(ms, eps)")
        root = "mse"
    if norm == "mul-reciprocal":
        lines += [f"r = Sqrt({root})", "ri = Reciprocal(r)", f"y0 = Mul({x}, ri)"]
    elif norm == "mul-one-div":
        lines += [f"r = Sqrt({root})", "ri = Div(one, r)", f"y0 = Mul({x}, ri)"]
    elif norm == "div-sqrt":
        lines += [f"r = Sqrt({root})", f"y0 = Div({x}, r)"]
    else:
        lines += [f"ri = Pow({root}, mhalf)", f"y0 = Mul(ri, {x})"]
    y = "y0"
    if fp16:
        lines.append("yh = Cast<to=10>(y0)")
        y = "yh"
    lines.append(f"y = Mul(gamma, {y})")
    inits = [f"{t}[{H}] gamma = {{{GAMMA}}}", "float eps = {1e-6}", "float two = {2.0}", "float one = {1.0}",
             "float mhalf = {-0.5}", f"float n = {{{H}.0}}", f"float ninv = {{{1.0 / H}}}", "int64[1] ax = {-1}"]
    body = "\n  ".join(lines)
    return (f'<ir_version: 8, opset_import: ["" : {opset}]>\n'
            f"g ({t}[2,5,{H}] x) => ({t}[2,5,{H}] y) <{', '.join(inits)}> {{\n  {body}\n}}")


@pytest.mark.parametrize("norm", ["mul-reciprocal", "mul-one-div", "div-sqrt", "mul-pow"])
@pytest.mark.parametrize("eps", [True, False])
def test_rmsnorm_forms(norm, eps):
    proto = parse(rmsnorm_model(norm=norm, eps=eps))
    variant = f"{norm}.{'eps' if eps else 'no-eps'}.reducemean"
    stats = {"RMSNormFusion": 1, f"RMSNormFusion.{variant}": 1, "RMSNormScaleFusion": 1, "lowered.RMSNorm": 1}
    check_fusion(lowered(FuseRMSNormPass(), "ort"), proto, stats=stats, ops_left=["SimplifiedLayerNormalization"])


@pytest.mark.parametrize("mean,square", [("reducesum-div", "mul"), ("reducesum-mul", "pow")])
def test_rmsnorm_reducesum_forms(mean, square):
    proto = parse(rmsnorm_model(mean=mean, square=square, opset=18))
    stats = {"RMSNormFusion": 1, f"RMSNormFusion.mul-reciprocal.eps.{mean}": 1, "RMSNormScaleFusion": 1}
    check_fusion(FuseRMSNormPass(), proto, stats=stats, ops_left=["mograph.RMSNorm"])


def test_rmsnorm_fp16_casts():
    proto = _ln(rmsnorm_model(fp16=True))
    stats = {"RMSNormFusion": 1, "RMSNormFusion.mul-reciprocal.eps.reducemean": 1, "RMSNormCastFusion": 1,
             "RMSNormCastFusion.stash": 1, "RMSNormScaleFusion": 1}
    check_fusion(FuseRMSNormPass(), proto, stats=stats, ops_left=["mograph.RMSNorm"], rel=2e-3)


def test_rmsnorm_near_miss_axis():
    text = rmsnorm_model().replace("axes=[-1]", "axes=[0]")
    result = assert_untouched(FuseRMSNormPass(explain=True), parse(text))
    (miss,) = result.details["rules"]["RMSNormFusion"]["near_miss_list"]
    assert "is not over the last axis" in miss["reason"]


# ------------------------------------------------------------------ skip LayerNorm --------------


def skip_model(*, bias: bool = True, sum_output: bool = False, opset: int = 17) -> str:
    lines = ["h = MatMul(a, w)"]
    if bias:
        lines.append("hb = Add(dense_b, h)")
        lines.append("s = Add(res, hb)")
    else:
        lines.append("s = Add(h, res)")
    lines.append("y = LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma, beta)")
    outs = f"float[2,5,{H}] y" + (f", float[2,5,{H}] s2" if sum_output else "")
    if sum_output:
        lines.append("s2 = Mul(s, two)")
    w = ",".join(f"{(i * 7 % 11) / 11 - 0.5:.3f}" for i in range(H * H))
    inits = [f"float[{H}] gamma = {{{GAMMA}}}", f"float[{H}] beta = {{{BETA}}}", f"float[{H}] dense_b = {{{BETA}}}",
             f"float[{H},{H}] w = {{{w}}}", "float two = {2.0}"]
    body = "\n  ".join(lines)
    return (f'<ir_version: 8, opset_import: ["" : {opset}]>\n'
            f"g (float[2,5,{H}] a, float[2,5,{H}] res) => ({outs}) <{', '.join(inits)}> {{\n  {body}\n}}")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sum_output", [False, True])
@pytest.mark.parametrize("target,op", [("ort", "com.microsoft.SkipLayerNormalization"), ("mograph", "mograph.SkipLayerNorm")])
def test_skip_layernorm(bias, sum_output, target, op):
    proto = parse(skip_model(bias=bias, sum_output=sum_output))
    variant = ("bias" if bias else "plain") + (".sum-output" if sum_output else "")
    stats = {"SkipLayerNormFusion": 1, f"SkipLayerNormFusion.{variant}": 1}
    if target == "ort":
        stats["lowered.SkipLayerNorm"] = 1
    expected = ["MatMul", op] + (["Mul"] if sum_output else [])
    check_fusion(lowered(FuseSkipLayerNormPass(), target), proto, stats=stats, ops_left=expected)


def test_skip_layernorm_after_fuse_layernorm():
    text = layernorm_model().replace("g (float[2,5,16] x)", "g (float[2,5,16] a, float[2,5,16] b)").replace(
        "  m = ReduceMean", "  x = Add(a, b)\n  m = ReduceMean")
    proto = parse(text)
    from mograph.testing import run_ort, to_ir, to_proto
    feeds = feeds_for(proto)
    model = to_ir(proto)
    FuseLayerNormPass().call(model)
    result = FuseSkipLayerNormPass().call(model)
    assert result.stats == {"SkipLayerNormFusion": 1, "SkipLayerNormFusion.plain": 1}
    assert op_types(model) == ["mograph.SkipLayerNorm", "Identity"]
    np.testing.assert_allclose(run_ort(to_proto(model), feeds)[0], run_ort(proto, feeds)[0], atol=1e-5)


def test_skip_layernorm_near_miss_mean_output_used():
    text = skip_model().replace("y = LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma, beta)",
                                "y0, mu = LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma, beta)\n  y = Add(y0, mu)")
    result = assert_untouched(lowered(FuseSkipLayerNormPass(explain=True), "ort"), parse(text))
    (miss,) = result.details["rules"]["SkipLayerNormFusion"]["near_miss_list"]
    assert "read" in miss["reason"]


def test_optimize_api_reports_near_misses_with_explain():
    import mograph

    proto = _ln(layernorm_model(eps="input"))
    _, report = mograph.optimize(proto, "fuse", options={"explain": True})
    entry = report.to_dict()["passes"][0]
    assert entry["name"] == "fuse-layernorm" and entry["modified"] is False
    (miss,) = entry["details"]["rules"]["LayerNormFusion"]["near_miss_list"]
    assert miss["reason"] == "epsilon is not a constant"
    _, report = mograph.optimize(_ln(layernorm_model()), "fuse", options={"target": "ort"}, verify=True)
    assert report.passes[0].stats["LayerNormFusion"] == 1
    assert report.verification["passed"]


# ------------------------------------------------------------------ skip RMSNorm ----------------


def skip_rms_model(*, bias: bool = False, sum_output: bool = False, cast: bool = False) -> str:
    """Residual Add (and dense bias) feeding a decomposed RMSNorm; optionally the sum is read on, and
    optionally goes through a float-to-float Cast first (as TorchScript exports of LLaMA have it)."""
    add = "x0" if cast else "x"
    head = ["hb = Add(dense_b, h)", f"{add} = Add(res, hb)"] if bias else [f"{add} = Add(h, res)"]
    if cast:
        head.append("x = Cast<to=1>(x0)")
    text = rmsnorm_model().replace("g (float[2,5,16] x)", "g (float[2,5,16] h, float[2,5,16] res)")
    text = text.replace("  xx = Pow", "  " + "\n  ".join(head) + "\n  xx = Pow")
    text = text.replace("float eps = {1e-6}", f"float eps = {{1e-6}}, float[{H}] dense_b = {{{BETA}}}")
    if sum_output:
        text = text.replace(f"=> (float[2,5,{H}] y)", f"=> (float[2,5,{H}] y, float[2,5,{H}] s2)")
        text = text.replace("  y = Mul(gamma", "  s2 = Mul(x, two)\n  y = Mul(gamma")
    return text


def _rms_fused(text: str, target: str):
    from mograph.testing import to_ir, to_proto

    model = to_ir(parse(text))
    assert FuseRMSNormPass().call(model).stats["RMSNormFusion"] == 1  # canonical: lowering comes last
    return to_proto(model)


@pytest.mark.parametrize("bias,cast", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("sum_output", [False, True])
@pytest.mark.parametrize("target,op", [("ort", "com.microsoft.SkipSimplifiedLayerNormalization"),
                                       ("mograph", "mograph.SkipRMSNorm")])
def test_skip_rmsnorm(bias, cast, sum_output, target, op):
    from mograph.testing import assert_close, run_ort, to_proto

    text = skip_rms_model(bias=bias, sum_output=sum_output, cast=cast)
    original = parse(text)
    proto = _rms_fused(text, target)  # fuse-rmsnorm first, as the fuse preset does
    variant = ("bias" if bias else "plain") + (".cast" if cast else "") + (".sum-output" if sum_output else "")
    stats = {"SkipRMSNormFusion": 1, f"SkipRMSNormFusion.{variant}": 1}
    if target == "ort":
        stats["lowered.SkipRMSNorm"] = 1
    model = check_fusion(lowered(FuseSkipLayerNormPass(), target), proto, stats=stats,
                         ops_left=[op] + (["Mul"] if sum_output else []))
    feeds = feeds_for(original)  # and against the unfused original
    assert_close(run_ort(original, feeds), run_ort(to_proto(model), feeds), rel=1e-5)


def test_skip_rmsnorm_reference_matches_function_body():
    from mograph.passes.fusion.ops import skip_rms_norm

    from mograph.testing import run_ort, to_proto

    text = skip_rms_model(bias=True, sum_output=True)
    model = run_pass(FuseSkipLayerNormPass(), _rms_fused(text, "mograph"))[0]
    node = next(n for n in model.graph if n.op_type == "SkipRMSNorm")
    feeds = feeds_for(parse(text))
    y, s2 = run_ort(to_proto(model), feeds)
    gamma = node.inputs[2].const_value.numpy()
    bias = node.inputs[3].const_value.numpy()
    ref_y, ref_s = skip_rms_norm(feeds["h"], feeds["res"], gamma, bias, epsilon=1e-6)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2, ref_s * 2, rtol=1e-6)


def test_skip_rmsnorm_near_miss_cast_changes_dtype():
    text = skip_rms_model(cast=True).replace("x = Cast<to=1>(x0)", "xd = Cast<to=11>(x0)\n  x = Cast<to=1>(xd)")
    result = assert_untouched(FuseSkipLayerNormPass(explain=True), _rms_fused(text, "mograph"))
    reasons = [m["reason"] for m in result.details["rules"]["SkipRMSNormFusion"]["near_miss_list"]]
    assert reasons and all("Add" in r for r in reasons), reasons  # the double Cast is not an identity Cast


@pytest.mark.parametrize("sum_output", [False, True])
def test_skip_rmsnorm_tensorrt_takes_the_rmsnorm_plugin_node(sum_output):
    # fuse-rmsnorm --target tensorrt leaves an RMSNorm plugin node; the skip pass takes it with its Add and
    # emits the SkipRMSNorm plugin in the form the plugin accepts (ORT cannot run it: checked structurally
    # here, numerically by the plugin's GPU tests and by an engine build in tests/backends).
    from mograph.backends.tensorrt_plugins import PLUGINS

    model, result = run_pass(lowered(FuseSkipLayerNormPass(), "tensorrt"), _rms_fused(skip_rms_model(sum_output=sum_output),
                                                                                 "tensorrt"))
    variant = "plain" + (".sum-output" if sum_output else "")
    assert result.stats == {"SkipRMSNormFusion": 1, f"SkipRMSNormFusion.{variant}": 1, "lowered.SkipRMSNorm": 1}
    (node,) = [n for n in model.graph if n.domain == "mograph"]
    assert node.op_type == "SkipRMSNorm"
    assert {k: a.value for k, a in node.attributes.items()} == {
        **PLUGINS["SkipRMSNorm"].node_attributes(sum_output=int(sum_output)), "epsilon": pytest.approx(1e-6)}
    assert [v.name for v in node.inputs[:2]] == ["h", "res"] and len(node.inputs) == 3  # zero Bias left off
    assert node.inputs[2].shape.dims == (H,)
    assert len(node.outputs) == (2 if sum_output else 1)
    assert not model.functions  # plugin nodes carry no function body
    again = lowered(FuseSkipLayerNormPass(), "tensorrt").call(model)
    assert again.modified is False


def test_skip_rmsnorm_near_miss_inverse_std_used():
    text = (f'<ir_version: 8, opset_import: ["" : 17]>\n'
            f"g (float[2,5,{H}] h, float[2,5,{H}] res) => (float[2,5,{H}] y) <float[{H}] gamma = {{{GAMMA}}}> {{\n"
            "  x = Add(h, res)\n"
            "  y0, inv = SimplifiedLayerNormalization<axis=-1, epsilon=1e-6>(x, gamma)\n"
            "  y = Add(y0, inv)\n}")
    import onnx

    proto = onnx.parser.parse_model(text)  # ORT's SimplifiedLayerNormalization is not in onnx's checker
    result = assert_untouched(lowered(FuseSkipLayerNormPass(explain=True), "ort"), proto)
    # ORT's SimplifiedLayerNormalization is a lowered form: the rules never take it (issue 14)
    assert result.details["rules"]["SkipRMSNormFusion"]["fused"] == 0


def _ln14(x: str, p: str, out: str) -> str:
    """Lines of an opset-14 LayerNorm of ``x`` into ``out``, its values prefixed with ``p``."""
    return "\n".join([
        f"{p}m = ReduceMean<axes=[-1]>({x})", f"{p}d = Sub({x}, {p}m)", f"{p}dd = Pow({p}d, two)",
        f"{p}v = ReduceMean<axes=[-1]>({p}dd)", f"{p}ve = Add({p}v, eps)", f"{p}sd = Sqrt({p}ve)",
        f"{p}n = Div({p}d, {p}sd)", f"{p}s = Mul(gamma, {p}n)", f"{out} = Add({p}s, beta)",
    ])


def test_layernorm_in_an_if_branch_and_the_main_graph_inlined_below_opset17():
    """A LayerNorm in the main graph and one in an ``If`` branch (openWakeWord's classifiers: a verifier
    model in the then-branch), inlined at opset 14: onnx_ir names the body's new values from each graph's
    own counter, so both graphs got ``val_0``...; the branch's must not shadow the main graph's (the ONNX
    checker refused the model: "'val_0' has been used as output names multiple times")."""
    import onnx
    import onnx_ir as ir

    inits = [f"float[{H}] gamma = {{{GAMMA}}}", f"float[{H}] beta = {{{BETA}}}", "float eps = {1e-5}",
             "float two = {2.0}"]
    main = _ln14("x", "a_", "y0").replace("\n", "\n  ")
    branch = _ln14("y0", "b_", "t").replace("\n", "\n    ")
    text = (f'<ir_version: 8, opset_import: ["" : 14]>\n'
            f"g (float[2,5,{H}] x, bool c) => (float[2,5,{H}] y) <{', '.join(inits)}> {{\n  {main}\n"
            f"  y = If(c) <then_branch = then_g () => (float[2,5,{H}] t) {{\n    {branch}\n  }},"
            f" else_branch = else_g () => (float[2,5,{H}] e) {{\n    e = Identity(y0)\n  }}>\n}}")
    proto = parse(text)
    stats = {k: 2 * v for k, v in _stats("div-sqrt.centered.reducemean").items()}
    for c in (True, False):
        feeds = {**feeds_for(proto), "c": np.array(c)}
        model = check_fusion(lowered(FuseLayerNormPass(), "onnx"), proto, feeds=feeds, second_run="last",
                             stats={**stats, "inlined.LayerNorm": 2})
        onnx.checker.check_model(ir.serde.serialize_model(model))  # no value of the branch shadows one outside it
        assert not model.functions and "If" in op_types(model)
        assert not any(n.domain == "mograph" for n in model.graph)
    # The same through the pipeline (the plugin manager's core mograph_run_pass), checked and loaded on the way out.
    import mograph

    out, report = mograph.optimize(proto, "fuse-layernorm", options={"target": "onnx"}, check_output=True)
    onnx.checker.check_model(out)
    feeds = {**feeds_for(proto), "c": np.array(True)}
    np.testing.assert_allclose(run_ort(out, feeds)[0], run_ort(proto, feeds)[0], rtol=1e-5, atol=1e-5)
