"""``--upgrade-opset``: the fusion passes raise the opset only when asked, so fused ops lower to standard ops.

ONNX Runtime 1.32's CPU provider has kernels for ``Gelu``-20 and ``RMSNormalization``-23, so the numbers
are checked with it (optimizations off); ``onnx.reference`` checks the RMSNorm case a second way.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from _fusion_util import lowered
from mograph.passes.fusion.gelu import FuseGeluPass
from mograph.passes.fusion.layernorm import FuseLayerNormPass
from mograph.passes.fusion.rmsnorm import FuseRMSNormPass
from mograph.passes.fusion.skip_layernorm import FuseSkipLayerNormPass
from test_norms import layernorm_model, rmsnorm_model

from mograph.errors import OptionError
from mograph.lowering import LowerPass
from mograph.opset import OpsetUpgradeError, upgrade_opset
from mograph.pass_infra import graph_fingerprint
from mograph.plugins import get_registry
from mograph.testing import (
    assert_close,
    assert_untouched,
    feeds_for,
    op_counts,
    op_types,
    parse,
    run_ort,
    run_pass,
    to_ir,
    to_proto,
)
from mograph.testing import check_pass as check_fusion

H = 8


def gelu_model(opset: int = 17, extra: str = "") -> onnx.ModelProto:
    """Exact GELU of x; ``extra`` lines may add more (output ``y``)."""
    body = ["z = Div(x, sqrt2)", "e = Erf(z)", "t = Add(e, one)", "h = Mul(x, t)", "g = Mul(h, half)"]
    body += extra.strip().splitlines() if extra else ["y = Identity(g)"]
    text = (f'<ir_version: 8, opset_import: ["" : {opset}]>\n'
            f"g (float[2,3,{H}] x) => (float[2,3,{H}] y) "
            f"<float sqrt2 = {{{math.sqrt(2):.7f}}}, float one = {{1.0}}, float half = {{0.5}}> {{\n  "
            + "\n  ".join(body) + "\n}")
    return parse(text)


GELU_STATS = {"GeluFusion": 1, "GeluFusion.(x*t)*0.5.div-sqrt2": 1, "lowered.Gelu": 1}


def test_without_the_option_the_opset_never_changes():
    # no standard Gelu at 17: the lower step inlines the function body, the opset stays
    model, result = run_pass(lowered(FuseGeluPass(), "onnx"), gelu_model(17))
    assert result.stats == {"GeluFusion": 1, "GeluFusion.(x*t)*0.5.div-sqrt2": 1, "inlined.Gelu": 1}
    assert model.opset_imports[""] == 17 and "mograph" not in model.opset_imports and not model.functions


@pytest.mark.parametrize("level", ["auto", 20, "20"])
def test_gelu_lowers_to_standard_gelu_after_the_upgrade(level):
    stats = {**GELU_STATS, "opset_upgrade.from": 17, "opset_upgrade.to": 20, "opset_upgrade.rewritten": 0}
    pass_ = lowered(FuseGeluPass(), "onnx", upgrade_opset=level)
    model = check_fusion(pass_, gelu_model(17), stats=stats, ops_left=["Gelu", "Identity"])
    assert model.opset_imports[""] == 20 and "mograph" not in model.opset_imports and not model.functions
    onnx.checker.check_model(to_proto(model), full_check=True)


def test_rmsnorm_lowers_to_rmsnormalization_at_23():
    proto = parse(rmsnorm_model(opset=17))
    stats = {"RMSNormFusion": 1, "RMSNormFusion.mul-reciprocal.eps.reducemean": 1, "RMSNormScaleFusion": 1,
             "lowered.RMSNorm": 1, "opset_upgrade.from": 17, "opset_upgrade.to": 23, "opset_upgrade.rewritten": 0}
    model = check_fusion(lowered(FuseRMSNormPass(), "onnx", upgrade_opset="auto"), proto, stats=stats,
                         ops_left=["RMSNormalization"])
    assert model.opset_imports[""] == 23
    from onnx.reference import ReferenceEvaluator

    feeds = feeds_for(proto)
    ref = ReferenceEvaluator(proto).run(None, feeds)
    assert_close(ref, ReferenceEvaluator(to_proto(model)).run(None, feeds), rel=1e-5)


def test_layernorm_from_opset_14():
    proto = parse(layernorm_model(opset=14))
    stats = {"LayerNormFusion": 1, "LayerNormFusion.div-sqrt.centered.reducemean": 1, "LayerNormScaleFusion": 1,
             "LayerNormBiasFusion": 1, "lowered.LayerNorm": 1, "opset_upgrade.from": 14, "opset_upgrade.to": 17,
             "opset_upgrade.rewritten": 0}
    model = check_fusion(lowered(FuseLayerNormPass(), "onnx", upgrade_opset="auto"), proto, stats=stats,
                         ops_left=["LayerNormalization", "Identity"])
    assert model.opset_imports[""] == 17


def test_nodes_outside_the_fusion_are_converted_and_keep_their_numbers():
    # a ReduceMean with axes as an attribute (opset < 18) must get its axes as an input at 20
    proto = gelu_model(14, extra="m = ReduceMean<axes=[-1]>(g)\n y = Sub(g, m)")
    stats = {**GELU_STATS, "opset_upgrade.from": 14, "opset_upgrade.to": 20, "opset_upgrade.rewritten": 1}
    model = check_fusion(lowered(FuseGeluPass(), "onnx", upgrade_opset="auto"), proto, stats=stats,
                         ops_left=["Gelu", "Constant", "ReduceMean", "Sub"])
    reduce = next(n for n in model.graph if n.op_type == "ReduceMean")
    assert "axes" not in reduce.attributes and len(reduce.inputs) == 2


def test_a_level_below_what_the_op_needs_changes_no_opset():
    pass_ = lowered(FuseGeluPass(explain=True), "onnx", upgrade_opset=19)
    model, result = run_pass(pass_, gelu_model(17))
    assert result.stats == {"GeluFusion": 1, "GeluFusion.(x*t)*0.5.div-sqrt2": 1, "inlined.Gelu": 1}
    assert model.opset_imports[""] == 17
    result = lowered(FuseGeluPass(), "onnx", upgrade_opset=19).call(to_ir(gelu_model(17)))
    assert result.details["opset_upgrade"] == {
        "done": False, "reason": "--upgrade-opset 19 is below the opset the standard form of Gelu (20) needs"}


def test_near_miss_leaves_the_opset_alone():
    proto = parse(layernorm_model(opset=14, eps="input"))  # epsilon not constant: nothing fuses
    assert_untouched(lowered(FuseLayerNormPass(), "onnx", upgrade_opset="auto"), proto)


def test_other_targets_ignore_it():
    model = check_fusion(lowered(FuseGeluPass(), "ort", upgrade_opset="auto"), gelu_model(17),
                         stats={"GeluFusion": 1, "GeluFusion.(x*t)*0.5.div-sqrt2": 1, "lowered.Gelu": 1},
                         ops_left=["com.microsoft.Gelu", "Identity"])
    assert model.opset_imports[""] == 17


def test_skip_layernorm_lowers_to_add_and_layernormalization_where_the_upgrade_reaches_17():
    from test_norms import skip_model

    # a mograph LayerNorm at opset 14, as fuse-layernorm leaves it
    text = skip_model(opset=14).replace("LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma, beta)",
                                        "mograph.LayerNorm<epsilon=1e-5>(s, gamma, beta)")
    text = text.replace('opset_import: ["" : 14]', 'opset_import: ["" : 14, "mograph" : 1]')
    proto = parse(text)
    model, result = run_pass(lowered(FuseSkipLayerNormPass(), "onnx", upgrade_opset="auto"), proto)
    assert result.stats["SkipLayerNormFusion"] == 1 and result.stats["lowered.SkipLayerNorm"] == 1
    assert (result.stats["opset_upgrade.from"], result.stats["opset_upgrade.to"]) == (14, 17)
    assert "LayerNormalization" in op_types(model) and not any(n.domain for n in model.graph)
    original = onnx.parser.parse_model(skip_model(opset=14))  # ORT has LayerNormalization at every opset
    feeds = feeds_for(proto)
    assert_close(run_ort(original, feeds), run_ort(to_proto(model), feeds))
    _, without = run_pass(lowered(FuseSkipLayerNormPass(), "onnx"), proto)  # without it: the body is inlined
    assert without.stats["inlined.SkipLayerNorm"] == 1 and "opset_upgrade.from" not in without.stats


@pytest.mark.parametrize("raw", ["x", 0, -3, True, 1.5])
def test_bad_levels_are_option_errors(raw):
    with pytest.raises(OptionError, match="upgrade-opset"):
        LowerPass(upgrade_opset=raw)


# ------------------------------------------------------------------ the converter itself ---------


def _bert(opset: int) -> onnx.ModelProto:
    from models.builders import bert_tiny

    return bert_tiny(opset=opset)


def _bert_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(0, 100, (2, 16)).astype(np.int64), "attention_mask": np.ones((2, 16), np.int64)}


def test_upgrade_is_bit_exact_and_keeps_unchanged_nodes():
    proto = _bert(14)
    model = to_ir(proto)
    before = {id(n): n.op_type for n in model.graph}
    done = upgrade_opset(model, 23, ops=get_registry().custom_ops)
    assert (done.from_opset, done.to_opset, done.rewritten) == (14, 23, {"ReduceMean": 10})
    kept = [n for n in model.graph if id(n) in before]
    assert len(kept) == len(before) - 10  # every node but the ten ReduceMeans is the same object
    out = to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    assert out.ir_version >= 11
    feeds = _bert_feeds()
    for ref, got in zip(run_ort(proto, feeds), run_ort(out, feeds)):
        np.testing.assert_array_equal(ref, got)


def test_subgraphs_are_converted():
    text = f"""<ir_version: 8, opset_import: ["" : 14]>
    g (float[2,{H}] x, bool c) => (float[2,1] y) {{
      y = If(c) <then_branch = t () => (float[2,1] a) {{ a = ReduceMean<axes=[-1]>(x) }},
                 else_branch = e () => (float[2,1] b) {{ b = ReduceMax<axes=[-1]>(x) }}>
    }}"""
    proto = parse(text)
    model = to_ir(proto)
    done = upgrade_opset(model, 18, ops=get_registry().custom_ops)
    assert done.rewritten == {"ReduceMean": 1, "ReduceMax": 1}
    out = to_proto(model)
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, H)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        np.testing.assert_array_equal(run_ort(proto, feeds)[0], run_ort(out, feeds)[0])


def test_foreign_functions_are_refused_and_nothing_changes():
    proto = gelu_model(14, extra="m = ReduceMean<axes=[-1]>(g)\n y = Sub(g, m)")
    fn = onnx.helper.make_function("vendor", "Twice", ["a"], ["b"], [onnx.helper.make_node("Add", ["a", "a"], ["b"])],
                                   [onnx.helper.make_opsetid("", 14)])
    proto.functions.append(fn)
    model = to_ir(proto)
    before = graph_fingerprint(model)
    with pytest.raises(OpsetUpgradeError, match="vendor::Twice"):
        upgrade_opset(model, 20, ops=get_registry().custom_ops)
    assert graph_fingerprint(model) == before and model.opset_imports[""] == 14
    # through the passes: fused and lowered as without the option (the body inlined), and the details say
    # why the opset stayed
    result = lowered(FuseGeluPass(), "onnx", upgrade_opset="auto").call(model)
    assert result.modified and "opset_upgrade.to" not in result.stats and result.stats["inlined.Gelu"] == 1
    assert "vendor::Twice" in result.details["opset_upgrade"]["reason"]
    assert "Erf" in op_types(model) and model.opset_imports[""] == 14


NORM_AND_GELU = ["fuse-layernorm", "fuse-rmsnorm", "fuse-skip-layernorm", "fuse-gelu", "fuse-bias-gelu"]


def test_norm_and_gelu_passes_on_bert_from_opset_14():
    from mograph.plugins import get_registry

    proto = _bert(14)
    model = to_ir(proto)
    reg = get_registry()
    options = {"target": "onnx", "upgrade_opset": "auto"}
    names = reg.plan(NORM_AND_GELU, options)
    assert names == [*NORM_AND_GELU, "lower", "simplify-shapes", "cse", "eliminate-dead"]
    stats: dict[str, float] = {}
    for p in reg.instantiate(names, options):
        for k, v in p.call(model).stats.items():
            if k.startswith(("opset_upgrade", "lowered", "inlined")):
                stats[f"{p.name}:{k}"] = v
    # the fusions leave SkipLayerNorm (needs 17) and BiasGelu (needs 20): one upgrade to 20, then standard ops
    assert stats == {
        "lower:opset_upgrade.from": 14, "lower:opset_upgrade.to": 20, "lower:opset_upgrade.rewritten": 0,
        "lower:lowered.SkipLayerNorm": 5, "lower:lowered.BiasGelu": 2,
    }
    counts = {t: op_types(model).count(t) for t in ("LayerNormalization", "Gelu")}
    assert counts == {"LayerNormalization": 5, "Gelu": 2} and model.opset_imports == {"": 20}
    feeds = _bert_feeds()
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), rel=1e-4)
    # a second run re-fuses the standard forms and lowers them back: the same ops and numbers come out
    before = op_counts(model)
    for p in reg.instantiate(names, options):
        p.call(model)
    assert op_counts(model) == before and model.opset_imports == {"": 20}
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), rel=1e-4)
