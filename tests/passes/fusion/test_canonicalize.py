"""Canonicalization before matching (:mod:`mograph.passes.fusion.canonicalize`): one test per rewrite.

Each case is a norm or GELU in a spelling only a canonical rewrite brings to the rules' forms: the pass
must fuse it (ops left, numbers with ORT optimizations off, a no-op second run) and report the rewrite
it kept; the same spelling where no fusion can follow must come back exactly as it was (undone).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from mograph.passes.fusion.gelu import FuseGeluPass
from mograph.passes.fusion.layernorm import FuseLayerNormPass
from mograph.passes.fusion.rmsnorm import FuseRMSNormPass

from mograph.testing import assert_untouched, op_types, parse, run_pass, to_ir
from mograph.testing import check_pass as check_fusion

H = 8
G = ",".join(f"{0.5 + 0.1 * i:.2f}" for i in range(H))
B = ",".join(f"{0.05 * i - 0.2:.2f}" for i in range(H))
C = math.sqrt(2 / math.pi)


def _model(body: str, inits: str = "", dtype: str = "float", opset: int = 17) -> str:
    base = (f"float eps = {{1e-5}}, float one = {{1.0}}, float zero = {{0.0}}, float m1 = {{-1.0}}, "
            f"float[{H}] g = {{{G}}}, float[{H}] b = {{{B}}}, int64[3] shp = {{1, 1, {H}}}")
    return (f'<ir_version: 8, opset_import: ["" : {opset}]>\n'
            f"m ({dtype}[2,3,{H}] x) => ({dtype}[2,3,{H}] y) <{base}{', ' + inits if inits else ''}> {{\n  "
            + "\n  ".join(body.strip().splitlines()) + "\n}")


RMS_TAIL = "a = Add(ms, eps)\n s = Sqrt(a)\n r = Reciprocal(s)\n n = Mul(x, r)\n y = Mul(n, g)"
LN_HEAD = "m = ReduceMean<axes=[-1]>(x)\n"
LN_TAIL = "dd = Mul(d, d)\n v = ReduceMean<axes=[-1]>(dd)\n a = Add(v, eps)\n s = Sqrt(a)\n n = Div(d, s)\n"

CASES = {
    "identity": (FuseRMSNormPass, "xx = Mul(x, x)\n ms0 = ReduceMean<axes=[-1]>(xx)\n ms = Identity(ms0)\n" + RMS_TAIL,
                 "", "mograph.RMSNorm"),
    "cast-noop": (FuseRMSNormPass, "xx = Mul(x, x)\n ms0 = ReduceMean<axes=[-1]>(xx)\n ms = Cast<to=1>(ms0)\n" + RMS_TAIL,
                  "", "mograph.RMSNorm"),
    "neutral": (FuseRMSNormPass, "xx = Mul(x, x)\n ms0 = ReduceMean<axes=[-1]>(xx)\n ms = Mul(ms0, one)\n" + RMS_TAIL,
                "", "mograph.RMSNorm"),
    "global-average-pool": (FuseRMSNormPass, "xx = Mul(x, x)\n ms = GlobalAveragePool(xx)\n" + RMS_TAIL, "",
                            "mograph.RMSNorm"),
    "scale-out": (FuseRMSNormPass, "xx = Mul(x, x)\n ms = ReduceMean<axes=[-1]>(xx)\n a = Add(ms, eps)\n s = Sqrt(a)\n"
                  " r = Reciprocal(s)\n rg = Mul(r, g)\n y = Mul(x, rg)", "", "mograph.RMSNorm"),
    "sub": (FuseLayerNormPass, LN_HEAD + "nm = Neg(m)\n d = Add(x, nm)\n" + LN_TAIL + " y = Mul(n, g)", "",
            "mograph.LayerNorm"),
    "sub-mul": (FuseLayerNormPass, LN_HEAD + "nm = Mul(m, m1)\n d = Add(nm, x)\n" + LN_TAIL + " y = Add(n, b)", "",
                "mograph.LayerNorm"),
    "fold-broadcast": (FuseLayerNormPass, LN_HEAD + "d = Sub(x, m)\n" + LN_TAIL + " g3 = Reshape(g, shp)\n y = Mul(n, g3)",
                       "", "mograph.LayerNorm"),
    # tf.nn.batch_normalization's LayerNorm: x * s + (b - m * s) with s = rsqrt(var + eps) * g
    "factor-norm": (FuseLayerNormPass, LN_HEAD + "d = Sub(x, m)\n dd = Mul(d, d)\n v = ReduceMean<axes=[-1]>(dd)\n"
                    " a = Add(v, eps)\n s = Sqrt(a)\n r = Reciprocal(s)\n sg = Mul(r, g)\n xs = Mul(x, sg)\n"
                    " nm = Neg(m)\n ms = Mul(nm, sg)\n off = Add(ms, b)\n y = Add(xs, off)", "", "mograph.LayerNorm"),
    # jax2tf: the mean reduced without kept dims, scaled, reshaped back and broadcast (a no-op Expand)
    "keepdims": (FuseRMSNormPass, "xx = Mul(x, x)\n s0 = ReduceSum<keepdims=0>(xx, ax)\n m0 = Mul(s0, inv)\n"
                 " ms1 = Reshape(m0, kshp)\n ms = Expand(ms1, kshp)\n" + RMS_TAIL,
                 f"int64[1] ax = {{2}}, float inv = {{{1 / H}}}, int64[3] kshp = {{2, 3, 1}}", "mograph.RMSNorm"),
    "expand-noop": (FuseRMSNormPass, "xx = Mul(x, x)\n ms0 = ReduceMean<axes=[-1]>(xx)\n ms = Expand(ms0, kshp)\n"
                    + RMS_TAIL, "int64[3] kshp = {2, 3, 1}", "mograph.RMSNorm"),
    # jax2tf: x**3 * 0.044715 written as x * (x * (0.044715 * x))
    "cube": (FuseGeluPass, "a1 = Mul(ca, x)\n a2 = Mul(x, a1)\n t2 = Mul(x, a2)\n i0 = Add(x, t2)\n i = Mul(c, i0)\n"
             " t = Tanh(i)\n o = Add(one, t)\n h0 = Mul(half, o)\n y = Mul(x, h0)",
             f"float ca = {{0.044715}}, float c = {{{C:.7f}}}, float half = {{0.5}}", "mograph.FastGelu"),
    "const-chain": (FuseGeluPass, "x2 = Mul(x, x)\n x3 = Mul(x2, x)\n t1 = Mul(x3, ca)\n t2 = Mul(t1, c)\n"
                    " u = Mul(x, c)\n i = Add(u, t2)\n t = Tanh(i)\n o = Add(t, one)\n h = Mul(x, o)\n y = Mul(h, half)",
                    f"float ca = {{0.044715}}, float c = {{{C:.7f}}}, float half = {{0.5}}", "mograph.FastGelu"),
}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rewrite_makes_a_fusion(rule: str) -> None:
    cls, body, inits, fused = CASES[rule]
    proto = parse(_model(body, inits))
    check_fusion(cls(), proto, ops_left=[fused])
    _, result = run_pass(cls(), proto)
    assert result.details["canonicalized"].get(rule.split("-mul")[0], 0) >= 1, result.details


def test_fp16_cast_islands() -> None:
    """onnxconverter-common's forms: the input cast once per reader; Max kept in float32 between Casts."""
    body = ("z16 = Cast<to=10>(zero)\n e16 = Cast<to=10>(eps)\n xa = Cast<to=10>(x)\n xb = Cast<to=10>(x)\n m = ReduceMean<axes=[-1]>(xa)\n d = Sub(xb, m)\n"
            " xx = Mul(xa, xa)\n e2 = ReduceMean<axes=[-1]>(xx)\n mm = Mul(m, m)\n v0 = Sub(e2, mm)\n"
            " v32 = Cast<to=1>(v0)\n z32 = Cast<to=1>(z16)\n vm = Max(v32, z32)\n v = Cast<to=10>(vm)\n"
            " a = Add(v, e16)\n s = Sqrt(a)\n n = Div(d, s)\n y = Cast<to=1>(n)")
    proto = parse(_model(body))
    model = check_fusion(FuseLayerNormPass(), proto, ops_left=["Cast", "mograph.LayerNorm", "Cast"], rel=2e-3)
    assert "mograph.LayerNorm" in op_types(model)
    _, result = run_pass(FuseLayerNormPass(), proto)
    assert {"cast-cse", "cast-island"} <= set(result.details["canonicalized"]), result.details


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rewrite_undone_without_a_fusion(rule: str) -> None:
    """The same spelling with the epsilon a graph input (not a constant): nothing fuses, all is undone."""
    cls, body, inits, _ = CASES[rule]
    text = _model(body, inits).replace("float[2,3,8] x)", "float[2,3,8] x, float eps)").replace(
        "float eps = {1e-5}, ", "")
    if "eps" not in body:  # the GELU: break its constant instead
        text = text.replace("float half = {0.5}", "float half = {0.6}")
    assert_untouched(cls(), parse(text))


def test_undo_keeps_unrelated_rewrites_out() -> None:
    """A fused norm next to canonicalizable computation no fusion uses: only the norm changes."""
    body = ("xx = Mul(x, x)\n ms0 = ReduceMean<axes=[-1]>(xx)\n ms = Identity(ms0)\n" + RMS_TAIL.replace("y =", "y0 =")
            + "\n w = Identity(x)\n w1 = Mul(w, one)\n g3 = Reshape(g, shp)\n w2 = Mul(w1, g3)\n y = Add(y0, w2)")
    proto = parse(_model(body))
    model = check_fusion(FuseRMSNormPass(), proto,
                         ops_left=Counter(["mograph.RMSNorm", "Identity", "Mul", "Reshape", "Mul", "Add"]))
    # the norm reads w1 (= x * 1) again after the undo, so it must come after w1's Mul: sorted
    order = op_types(model)
    assert order.index("mograph.RMSNorm") > order.index("Identity"), order
    before = op_types(to_ir(proto))
    assert before.count("Identity") == 2


def test_explain_names_the_failing_node() -> None:
    """A GELU with a wrong constant: --explain points at it and says what was expected."""
    body = ("z = Div(x, sq)\n e = Erf(z)\n o = Add(e, one)\n h = Mul(x, o)\n y = Mul(h, half)")
    proto = parse(_model(body, "float sq = {1.3}, float half = {0.5}"))
    p = FuseGeluPass()
    p.config = {"explain": True}
    result = assert_untouched(p, proto)
    regions = result.details["unfused_regions"]
    assert len(regions) == 1 and regions[0]["op"] == "Erf", regions
    assert "1.3" in regions[0]["reason"] and "1.414" in regions[0]["reason"], regions


NEAR_MISSES = {
    # the Keras/TF factored form, but the "mean" is over the sequence axis
    "factor-norm-wrong-axis": (FuseLayerNormPass, "m = ReduceMean<axes=[1]>(x)\n d = Sub(x, m)\n dd = Mul(d, d)\n"
                               " v = ReduceMean<axes=[1]>(dd)\n a = Add(v, eps)\n s = Sqrt(a)\n r = Reciprocal(s)\n"
                               " sg = Mul(r, g)\n xs = Mul(x, sg)\n nm = Neg(m)\n ms = Mul(nm, sg)\n off = Add(ms, b)\n"
                               " y = Add(xs, off)"),
    # x - Neg(...) of something that is not the mean of x
    "sub-not-the-mean": (FuseLayerNormPass, "x2 = Add(x, x)\n m = ReduceMean<axes=[-1]>(x2)\n nm = Neg(m)\n"
                         " d = Add(x, nm)\n" + LN_TAIL + " y = Identity(n)"),
    # epsilon added after the square root (by 0.1, where it changes the result)
    "eps-outside-root": (FuseRMSNormPass, "xx = Mul(x, x)\n ms = GlobalAveragePool(xx)\n s = Sqrt(ms)\n"
                         " a = Add(s, big)\n r = Reciprocal(a)\n n = Mul(x, r)\n y = Mul(n, g)"),
    # tanh-GELU with 0.9 where sqrt(2/pi) belongs, the constants chained
    "const-chain-wrong-constant": (FuseGeluPass, "x2 = Mul(x, x)\n x3 = Mul(x2, x)\n t1 = Mul(x3, ca)\n t2 = Mul(t1, c)\n"
                                   " u = Mul(x, c)\n i = Add(u, t2)\n t = Tanh(i)\n o = Add(t, one)\n h = Mul(x, o)\n"
                                   " y = Mul(h, half)"),
}
NEAR_INITS = ("float big = {0.1}, float[3,1] g31 = {0.5, 1.0, 1.5}, float ca = {0.044715}, float c = {0.9}, "
              "float half = {0.5}")


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_miss_left_untouched(case: str) -> None:
    cls, body = NEAR_MISSES[case]
    assert_untouched(cls(), parse(_model(body, NEAR_INITS)))


def test_scale_out_with_a_scale_that_is_not_a_vector() -> None:
    """x * (rsqrt * g) with g [3, 1]: the RMSNorm itself fuses, g stays a Mul after it (not absorbed)."""
    body = ("xx = Mul(x, x)\n ms = ReduceMean<axes=[-1]>(xx)\n a = Add(ms, eps)\n s = Sqrt(a)\n r = Reciprocal(s)\n"
            " rg = Mul(r, g31)\n y = Mul(x, rg)")
    check_fusion(FuseRMSNormPass(), parse(_model(body, NEAR_INITS)), ops_left=["mograph.RMSNorm", "Mul"])


def test_explain_regions_of_near_misses() -> None:
    """Each unfused region is listed with the node where the match failed; a wrong constant is named."""
    cls, body = NEAR_MISSES["eps-outside-root"]
    p = cls()
    p.config = {"explain": True}
    (region,) = assert_untouched(p, parse(_model(body, NEAR_INITS))).details["unfused_regions"]
    assert region["failed_at_op"] == "Add" and "expected Sqrt" in region["reason"], region
    cls, body = NEAR_MISSES["const-chain-wrong-constant"]
    p = cls()
    p.config = {"explain": True}
    (region,) = assert_untouched(p, parse(_model(body, NEAR_INITS))).details["unfused_regions"]
    assert region["op"] == "Tanh" and any("is 0.9, expected 0.797" in c for c in region["constants_off"]), region


def test_fused_op_bodies_below_opset_12() -> None:
    """Opset 11 has no Constant value_float: the bodies take epsilon/alpha another exact way (they must run)."""
    quick = _model("s = Mul(x, k)\n g0 = Sigmoid(s)\n y = Mul(x, g0)", "float k = {1.702}", opset=11)
    check_fusion(FuseGeluPass(), parse(quick), ops_left=["mograph.QuickGelu"])
    rms = _model("xx = Mul(x, x)\n ms = ReduceMean<axes=[-1]>(xx)\n" + RMS_TAIL, opset=11)
    check_fusion(FuseRMSNormPass(), parse(rms), ops_left=["mograph.RMSNorm"])


# ------------------------------------------------------------------ dynamic batch (issue 27) ------
# Flax's LayerNorm through jax2tf + tf2onnx with a dynamic batch dim: the mean as ReduceSum * 1/N without
# kept dims, the variance as E[x^2] - E[x]^2 (clamped by Max(., 0) or not), each reshaped back and
# broadcast to Concat(Slice(Shape(x), 0, 1), [S], [1]) (through Casts), a shape inference cannot follow.


def _dyn_ln(*, clamp: bool, keepdims: int, shape_of: str = "x") -> str:
    if keepdims:
        back = ("m = Mul(s1, inv)\n e2 = Mul(s2, inv)\n")
        red = "s1 = ReduceSum<keepdims=1>(x, ax)\n s2 = ReduceSum<keepdims=1>(xx, ax)\n"
    else:
        back = ("m0 = Mul(s1, inv)\n e20 = Mul(s2, inv)\n m1 = Reshape(m0, k64)\n m = Expand(m1, k64)\n")
        red = "s1 = ReduceSum<keepdims=0>(x, ax)\n s2 = ReduceSum<keepdims=0>(xx, ax)\n"
    var = "mm = Mul(m0, m0)\n v0 = Sub(e20, mm)\n" if not keepdims else "mm = Mul(m, m)\n v0 = Sub(e2, mm)\n"
    var += ("v1 = Max(zero, v0)\n" if clamp else "v1 = Identity(v0)\n")
    if not keepdims:
        var += "v2 = Reshape(v1, k64)\n v = Expand(v2, k64)\n"
    else:
        var += "v = Identity(v1)\n"
    body = ("sh = Shape(" + shape_of + ")\n sh32 = Cast<to=6>(sh)\n b = Slice(sh32, z1, o1, z1)\n"
            " k32 = Concat<axis=0>(b, s3, o1)\n k64 = Cast<to=7>(k32)\n"
            " xx = Mul(x, x)\n" + red + back + "d = Sub(x, m)\n" + var
            + "a = Add(v, eps)\n r0 = Sqrt(a)\n r = Reciprocal(r0)\n rg = Mul(r, g)\n n = Mul(d, rg)\n y = Add(n, bb)")
    inits = (f"float eps = {{1e-5}}, float zero = {{0.0}}, float inv = {{{1 / H}}}, int64[1] ax = {{2}}, "
             f"int32[1] z1 = {{0}}, int32[1] o1 = {{1}}, int32[1] s3 = {{3}}, float[{H}] g = {{{G}}}, float[{H}] bb = {{{B}}}")
    extra = f", float[M,3,{H}] z" if shape_of == "z" else ""
    return (f'<ir_version: 8, opset_import: ["" : 13]>\n'
            f"m (float[N,3,{H}] x{extra}) => (float[N,3,{H}] y) <{inits}> {{\n  " + "\n  ".join(body.splitlines()) + "\n}")


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("clamp", [True, False])
def test_dynamic_batch_sum_mean_and_moments_variance_fuse(clamp: bool, keepdims: int) -> None:
    proto = parse(_dyn_ln(clamp=clamp, keepdims=keepdims))
    variant = "mul-reciprocal.moments.reducesum-mul" + (".max0" if clamp else "")
    model = check_fusion(FuseLayerNormPass(), proto, stats={
        "LayerNormFusion": 1, f"LayerNormFusion.{variant}": 1, "LayerNormScaleFusion": 1, "LayerNormBiasFusion": 1})
    assert [t for t in op_types(model) if t not in ("Shape", "Cast", "Slice", "Concat")] == ["mograph.LayerNorm"]
    _, result = run_pass(FuseLayerNormPass(), proto)
    if not keepdims:
        assert result.details["canonicalized"]["keepdims"] == 2 and result.details["canonicalized"]["expand-noop"] == 2


def test_dynamic_batch_shape_of_another_tensor_is_a_near_miss() -> None:
    """The kept shape read from another input ``z`` (equal at run time here, not provably): untouched."""
    proto = parse(_dyn_ln(clamp=True, keepdims=0, shape_of="z"))
    p = FuseLayerNormPass()
    p.config = {"explain": True}
    result = assert_untouched(p, proto)
    regions = result.details["unfused_regions"]
    # both sum-based reductions without kept dims are reported, each with where its match stopped
    assert sorted(r["op"] for r in regions) == ["ReduceSum", "ReduceSum"], regions
    assert all(r.get("failed_at") for r in regions), regions


def _const_target_ln(target: str, allowzero: int = 0) -> str:
    """A LayerNorm whose sum-based moments (keepdims 0) are reshaped back by a constant target with a 0 or
    -1 entry (``view(-1, 3, 1)``), the batch dim dynamic."""
    az = f"<allowzero={allowzero}>" if allowzero else ""
    body = ("xx = Mul(x, x)\n s1 = ReduceSum<keepdims=0>(x, ax)\n s2 = ReduceSum<keepdims=0>(xx, ax)\n"
            " m0 = Mul(s1, inv)\n e20 = Mul(s2, inv)\n mm = Mul(m0, m0)\n v0 = Sub(e20, mm)\n v1 = Max(zero, v0)\n"
            f" m = Reshape{az}(m0, tgt)\n v = Reshape{az}(v1, tgt)\n d = Sub(x, m)\n"
            " a = Add(v, eps)\n r0 = Sqrt(a)\n r = Reciprocal(r0)\n n = Mul(d, r)\n y = Mul(n, g)")
    inits = (f"float eps = {{1e-5}}, float zero = {{0.0}}, float inv = {{{1 / H}}}, int64[1] ax = {{-1}}, "
             f"int64[3] tgt = {{{target}}}, float[{H}] g = {{{G}}}")
    return (f'<ir_version: 8, opset_import: ["" : 14]>\n'
            f"m (float[N,3,{H}] x) => (float[N,3,{H}] y) <{inits}> {{\n  " + "\n  ".join(body.splitlines()) + "\n}")


@pytest.mark.parametrize("target", ["-1, 3, 1", "0, 0, 1", "0, 3, 1", "0, -1, 1"])
def test_kept_dims_restored_by_a_constant_target_with_0_or_minus_1(target: str) -> None:
    """A constant Reshape target whose 0 copies the reduced value's dim and whose -1 is the one dim left:
    provably the reduced input's dims ending in a 1 (it was refused as 'not provably dims ending in a 1')."""
    proto = parse(_const_target_ln(target))
    model = check_fusion(FuseLayerNormPass(), proto, stats={
        "LayerNormFusion": 1, "LayerNormFusion.mul-reciprocal.moments.reducesum-mul.max0": 1, "LayerNormScaleFusion": 1})
    assert op_types(model) == ["mograph.LayerNorm"]


@pytest.mark.parametrize("target,allowzero", [("-1, 2, 1", 0), ("0, 0, 1", 1), ("-1, -1, 1", 0)])
def test_a_constant_target_that_is_not_the_kept_dims_stays(target: str, allowzero: int) -> None:
    """-1 beside a dim that is not the reduced value's, a 0 read literally (allowzero), two -1: untouched."""
    proto = parse(_const_target_ln(target, allowzero))
    assert_untouched(FuseLayerNormPass(), proto)


def test_rules_say_why_they_did_not_apply() -> None:
    """Each rule that does not rewrite a node says why (a value, for diagnostics); one that would says ""."""
    from mograph.passes.fusion.canonicalize import RULES, Canonicalizer

    body = "t = Mul(x, two)\n nx = Neg(x)\n u = Add(t, nx)\n w = Identity(u)\n y = Mul(w, one)"
    model = to_ir(parse(_model(body, "float two = {2.0}")))
    nodes = {n.outputs[0].name: n for n in model.graph}
    canon = Canonicalizer(model.graph, 17)
    times_two = canon.why_not(nodes["t"])
    assert set(times_two) == {r.name for r in RULES}
    assert all(times_two.values()), times_two  # nothing rewrites x * 2
    assert times_two["neutral"] == "no operand is a one that leaves the other's shape"
    assert times_two["sub"] == "applies to Add nodes, not Mul"
    assert times_two["cube"] == "not a product of exactly three of one value (and constants)"
    plus_neg = canon.why_not(nodes["u"])
    assert plus_neg["sub"] == "" and plus_neg["neutral"].startswith("no operand is a zero")
    assert canon.why_not(nodes["w"])["identity"] == ""
    assert op_types(model) == ["Mul", "Neg", "Add", "Identity", "Mul"]  # asking changed nothing
    assert canon.apply() == Counter({"sub": 1, "identity": 1})  # y = w * 1 is a graph output: kept as it is
