"""GPT-2-style ``Gemm`` + bias (``Conv1D``): the bias moves into the Skip norm's or the GELU's bias input.

The graphs are what TorchScript writes for ``transformers``' ``Conv1D``:
``Reshape(Gemm(Reshape(x, [-1, K]), W, bias), [batch, seq, N])``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fusion_util import lowered
from mograph.passes.fusion.bias_gelu import FuseBiasGeluPass
from mograph.passes.fusion.skip_layernorm import FuseSkipLayerNormPass

from mograph.testing import assert_untouched, feeds_for, parse, run_ort, to_ir, to_proto
from mograph.testing import check_pass as check_fusion

H = 8
W = ",".join(f"{((i * 7) % 11 - 5) / 10:.1f}" for i in range(H * H))
B = ",".join(f"{0.1 * i - 0.3:.2f}" for i in range(H))
INITS = (f"float[{H},{H}] w = {{{W}}}, float[{H}] b = {{{B}}}, int64[2] flat = {{-1, {H}}}, "
         f"int64[3] back = {{2, 3, {H}}}, float[{H}] scale = {{{','.join(['1.5'] * H)}}}, "
         f"float[{H}] beta = {{{','.join(['0.25'] * H)}}}")


def _text(body: str, opset: int = 17, outputs: str = f"float[2,3,{H}] y", gemm: str = "") -> str:
    return (f'<ir_version: 8, opset_import: ["" : {opset}]>\n'
            f"g (float[2,3,{H}] x, float[2,3,{H}] res) => ({outputs}) <{INITS}> {{\n"
            f"  xf = Reshape(x, flat)\n  mm = Gemm{gemm}(xf, w, b)\n  proj = Reshape(mm, back)\n"
            + "\n".join(f"  {line.strip()}" for line in body.strip().splitlines()) + "\n}")


@pytest.mark.parametrize("order", ["proj+res", "res+proj"])
@pytest.mark.parametrize("target", ["mograph", "ort"])
def test_gemm_bias_into_skip_layernorm(order, target):
    add = "s = Add(proj, res)" if order == "proj+res" else "s = Add(res, proj)"
    proto = parse(_text(f"{add}\n y = LayerNormalization<axis=-1, epsilon=1e-5>(s, scale, beta)"))
    stats = {"SkipLayerNormGemmBiasFusion": 1}
    skip = {"mograph": "mograph.SkipLayerNorm", "ort": "com.microsoft.SkipLayerNormalization"}[target]
    if target == "ort":
        stats["lowered.SkipLayerNorm"] = 1
    model = check_fusion(lowered(FuseSkipLayerNormPass(), target), proto, stats=stats)
    ops = [n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in model.graph]
    gemm = next(n for n in model.graph if n.op_type == "Gemm")
    assert len([v for v in gemm.inputs if v is not None]) == 2  # the bias left the Gemm
    assert ops == ["Reshape", "Gemm", "Reshape", skip]
    norm = model.graph.node(3)
    assert norm.inputs[4] is not None and norm.inputs[4].name == "b"


def test_gemm_bias_residual_read_elsewhere_keeps_the_sum():
    proto = parse(_text("s = Add(proj, res)\n y = LayerNormalization<axis=-1, epsilon=1e-5>(s, scale, beta)",
                        outputs=f"float[2,3,{H}] y, float[2,3,{H}] s"))
    model = check_fusion(lowered(FuseSkipLayerNormPass(), "ort"), proto,
                         stats={"SkipLayerNormGemmBiasFusion": 1, "SkipLayerNormGemmBiasFusion.sum-output": 1,
                                "lowered.SkipLayerNorm": 1})
    norm = next(n for n in model.graph if n.op_type == "SkipLayerNormalization")
    assert norm.outputs[3].is_graph_output()


@pytest.mark.parametrize("approx,op_name", [("none", "BiasGelu"), ("tanh", "BiasFastGelu")])
@pytest.mark.parametrize("target", ["mograph", "ort"])
def test_gemm_bias_into_gelu(approx, op_name, target):
    proto = parse(_text(f'y = Gelu<approximate="{approx}">(proj)', opset=20))
    form = "tanh" if approx == "tanh" else "exact"
    stats = {"GemmBiasGeluFusion": 1, f"GemmBiasGeluFusion.{form}": 1}
    if target == "ort":
        stats[f"lowered.{op_name}"] = 1
    model = check_fusion(lowered(FuseBiasGeluPass(), target), proto, stats=stats)
    expected = {"mograph": f"mograph.{op_name}",
                "ort": "com.microsoft." + ("BiasGelu" if form == "exact" else "FastGelu")}[target]
    ops = [n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in model.graph]
    assert ops == ["Reshape", "Gemm", "Reshape", expected]
    gemm = model.graph.node(1)
    assert len([v for v in gemm.inputs if v is not None]) == 2


def test_near_misses_untouched():
    # the Reshape after the Gemm does not keep the columns last: the bias is not per last axis
    text = _text("s = Add(proj, res)\n y = LayerNormalization<axis=-1, epsilon=1e-5>(s, scale, beta)")
    text = text.replace("int64[3] back = {2, 3, 8}", "int64[3] back = {2, 8, 3}").replace(
        "float[2,3,8] res", "float[2,8,3] res").replace("=> (float[2,3,8] y)", "=> (float[2,8,3] y)").replace(
        "float[8] scale", "float[3] scale").replace("float[8] beta", "float[3] beta")
    text = text.replace("{1.5,1.5,1.5,1.5,1.5,1.5,1.5,1.5}", "{1.5,1.5,1.5}").replace(
        "{0.25,0.25,0.25,0.25,0.25,0.25,0.25,0.25}", "{0.25,0.25,0.25}")
    assert_untouched(FuseBiasGeluPass(), parse(text))
    result = FuseSkipLayerNormPass().call(to_ir(parse(text)))
    assert "SkipLayerNormGemmBiasFusion" not in result.stats  # the plain residual rule may still fuse the Add
    gelu = parse(_text('y = Gelu<approximate="tanh">(proj)', opset=20).replace(
        "mm = Gemm(xf, w, b)", "mm = Gemm<beta=0.0>(xf, w, b)"))
    model = to_ir(gelu)
    assert FuseBiasGeluPass().call(model).stats == {"GemmBiasGeluFusion": 1, "GemmBiasGeluFusion.tanh": 1}
    np.testing.assert_allclose(run_ort(to_proto(model), feeds_for(gelu))[0], run_ort(gelu, feeds_for(gelu))[0],
                               atol=1e-5)  # beta = 0: the bias is scaled away, not dropped wrongly
