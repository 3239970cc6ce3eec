"""``cleanup,fuse`` on models whose ``Reshape`` s are below opset 14: they fuse as at opset 14.

ONNX's inference of ``Reshape``-5 and ``Reshape``-13 gives the output a shape only when the target is a
constant; ``Reshape``-14 also reads a target computed at run time (``Shape``/``Gather``/``Unsqueeze``/``Concat``,
as exporters write the split into heads).  Below 14 the first attention's reshape left every value after it
without a rank: on an opset-13 BERT, ``AttentionFusion`` took one attention of two (the second's query had no
shape) and ``BiasGeluFusion`` none ("the rank of ... is unknown"); on TorchScript's export at 11, 12 and 13, no
attention and no bias GELU.  Shape inference now gives such a ``Reshape`` the dims the shape rules prove
(:func:`mograph.irutil.run_shape_inference`) and infers again from them.

Checks, as the other fusion tests: exact stats of every rule, the ops left, numbers against the unfused model
on ONNX Runtime with its optimizations off (padded feeds), an untouched near miss, a no-op second run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.cleanup.infer_shapes import InferShapesPass
from mograph.passes.fusion.bias_gelu import FuseBiasGeluPass
from mograph.passes.fusion.gelu import FuseGeluPass
from onnx import helper

from models.builders import bert_feeds, bert_tiny, make_model
from mograph.pass_infra import graph_fingerprint
from mograph.plugins import get_registry
from mograph.testing import assert_close, assert_untouched, op_counts, parse, run_ort, run_pass, to_ir, to_proto

L = 2  # layers of every model here

#: bert_tiny's fusions at 14 (5 decomposed LayerNorms: the embeddings' and two per layer, 4 of them after a residual)
BERT_TINY_STATS = {
    "LayerNormFusion": 5, "LayerNormFusion.div-sqrt.centered.reducemean": 5, "LayerNormScaleFusion": 5,
    "LayerNormBiasFusion": 5, "SkipLayerNormFusion": 4, "SkipLayerNormFusion.bias": 4,
    # word + position tables, no segment table: the embedding's Add and norm are EmbedLayerNorm's (two lookups)
    "EmbedLayerNormFusion": 1, "EmbedLayerNormFusion.mograph.no-segment": 1,
    "GeluFusion": 2, "GeluFusion.(x*t)*0.5.div-sqrt2": 2, "BiasGeluFusion": 2, "BiasGeluFusion.exact": 2,
    "AttentionFusion": 2, "AttentionFusion.div.mask": 2,
}
#: what bert_tiny is left with for --target ort: ORT's kernels, the mask arithmetic and the projections
BERT_TINY_ORT_OPS = Counter({
    "com.microsoft.SkipLayerNormalization": 4, "com.microsoft.EmbedLayerNormalization": 1, "com.microsoft.Attention": 2,
    "com.microsoft.BiasGelu": 2, "MatMul": 6, "Constant": 3, "Shape": 1, "Gather": 1, "Unsqueeze": 1, "Cast": 2, "Sub": 1,
    "Mul": 1, "Concat": 1, "Expand": 1,
})


def _preset(model: ir.Model, target: str, names: str = "cleanup,fuse", explain: bool = False
            ) -> tuple[dict[str, int], bool, list[tuple[str, str]]]:
    """``names`` for ``target`` as ``mograph optimize --passes`` runs them: the stats of the fusions and of the
    lower step, whether anything changed, the near misses (rule, reason)."""
    reg = get_registry()
    options = {"target": target, "explain": explain}
    stats: Counter = Counter()
    modified = False
    misses: list[tuple[str, str]] = []
    for p in reg.instantiate(reg.plan(names, options), options):
        result = p.call(model)
        modified = modified or result.modified
        if p.name.startswith("fuse-") or p.name == "lower":
            stats.update({k: v for k, v in result.stats.items() if v})
        for rule, info in (result.details.get("rules") or {}).items():
            misses += [(rule, m["reason"]) for m in info.get("near_miss_list", [])]
    return dict(stats), modified, misses


def _no_op_second_run(model: ir.Model, target: str) -> None:
    before = graph_fingerprint(model)
    stats, modified, _ = _preset(model, target, "fuse")
    assert (stats, modified) == ({}, False)
    assert graph_fingerprint(model) == before


# ------------------------------------------------------------------ shape inference ----------------


@pytest.mark.parametrize("opset", [11, 12, 13])
def test_a_reshape_to_a_runtime_target_gets_the_dims_of_opset_14(opset: int) -> None:
    """``Reshape(x, Concat(Unsqueeze(Shape(x)[0]), Unsqueeze(Shape(x)[1]), [4], [-1]))``: [b, s, 4, 16] and the
    Transpose after it [b, 4, s, 16], as ONNX infers them at 14; ``Unsqueeze`` in the form of the opset (axes an
    attribute below 13)."""

    def text(version: int) -> str:
        if version < 13:
            unsq = ["b1 = Unsqueeze<axes=[0]>(b)", "s1 = Unsqueeze<axes=[0]>(s)"]
        else:
            unsq = ["b1 = Unsqueeze(b, zero)", "s1 = Unsqueeze(s, zero)"]
        body = "\n  ".join(["sh = Shape(x)", "b = Gather<axis=0>(sh, i0)", "s = Gather<axis=0>(sh, i1)", *unsq,
                            "t = Concat<axis=0>(b1, s1, four, minus)", "r = Reshape(x, t)",
                            "y = Transpose<perm=[0,2,1,3]>(r)"])
        return (f'<ir_version: 7, opset_import: ["" : {version}]>\n'
                "g (float[batch,seq,64] x) => (float[batch,4,seq,16] y) <int64 i0 = {0}, int64 i1 = {1}, "
                "int64[1] zero = {0}, int64[1] four = {4}, int64[1] minus = {-1}> {\n  " + body + "\n}")

    shapes = {}
    for version in (opset, 14):
        model = to_ir(parse(text(version)))
        InferShapesPass().call(model)
        shapes[version] = {v.name: v.shape for n in model.graph for v in n.outputs if n.op_type in ("Reshape", "Transpose")}
    assert shapes[opset] == {"r": ir.Shape(["batch", "seq", 4, 16]), "y": ir.Shape(["batch", 4, "seq", 16])}
    # at 14 ONNX does not resolve the -1 (a name it makes up); every other dim is the same
    assert shapes[14]["y"] == shapes[opset]["y"]  # (declared on the output)
    assert list(shapes[14]["r"])[:3] == list(shapes[opset]["r"])[:3]
    assert str(shapes[14]["r"][3]).startswith("unk__")


def test_bert_tiny_opset13_every_value_has_a_shape() -> None:
    """``infer-shapes`` on bert_tiny at 13: every value typed with a shape (108 of 201 before), the split into heads
    [batch, seq, 4, 16] as at 14."""
    shapes = {}
    for opset in (13, 14):
        model = to_ir(bert_tiny(opset=opset))
        result = InferShapesPass().call(model)
        values = [v for n in model.graph for v in n.outputs]
        assert result.stats["values_with_shape"] == len(values) == 201
        # a dim ONNX makes up (``unk__N``) is numbered in the order it meets them: compared as "unk"
        shapes[opset] = {str(v.name): ["unk" if str(d).startswith("unk__") else str(d) for d in v.shape]  # type: ignore[union-attr]
                         for v in values}
    assert shapes[13]["/encoder/layer.0/attention/self/Reshape_output_0"] == ["batch", "seq", "4", "16"]
    assert shapes[13] == shapes[14]


# ------------------------------------------------------------------ bert_tiny ----------------------


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_bert_tiny_opset13_fuses_as_opset14(target: str) -> None:
    """Both attentions and both bias GELUs at 13 (1 and 0 before), the stats and ops left of 14, numbers equal to
    the unfused model's; for ``ort`` a second ``fuse`` changes nothing."""
    feeds = bert_feeds(2, 16)
    left = {}
    for opset in (13, 14):
        proto = bert_tiny(opset=opset)
        model = to_ir(proto)
        stats, modified, misses = _preset(model, target, explain=True)
        lowered = {"ort": {"bias_expansions": 2, "lowered.Attention": 2, "lowered.BiasGelu": 2,
                           "lowered.SkipLayerNorm": 4, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 1,
                           "embed_implicit_positions": 1, "embed_no_segment": 1},
                   "onnx": {"lowered.Attention": 2, "inlined.BiasGelu": 2, "inlined.SkipLayerNorm": 4,
                            "inlined.EmbedLayerNorm": 1}}[target]
        assert stats == {**BERT_TINY_STATS, **lowered}, (opset, stats)
        assert modified and misses == []
        left[opset] = op_counts(model)
        assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)
        if target == "ort":
            assert left[opset] == BERT_TINY_ORT_OPS
            _no_op_second_run(model, target)
    assert left[13] == left[14]
    assert left[13]["Softmax"] == (2 if target == "onnx" else 0)


def test_near_miss_a_target_of_unknown_length_stays_unknown() -> None:
    """A ``Reshape``-13 to a target read from a graph input of unknown length: no rule proves a rank (neither
    would ONNX's inference at 14), so BiasGelu is a near miss ("rank unknown"), untouched."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Reshape", ["x", "shp"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["a"]), helper.make_node("Div", ["a", "sqrt2"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]), helper.make_node("Add", ["e", "one"], ["p"]),
             helper.make_node("Mul", ["a", "p"], ["t"]), helper.make_node("Mul", ["t", "half"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, ["batch", "seq", 64]), ("shp", np.int64, ["n"])],
                       [("y", np.float32, None)],
                       {"w": rng.standard_normal((64, 128)).astype(np.float32),
                        "bias": rng.standard_normal(128).astype(np.float32), "sqrt2": np.float32(np.sqrt(2.0)),
                        "one": np.float32(1.0), "half": np.float32(0.5)}, opset=13)
    model, result = run_pass(FuseGeluPass(), proto)
    assert result.stats["GeluFusion"] == 1
    result = assert_untouched(FuseBiasGeluPass(explain="true"), to_proto(model))
    (miss,) = result.details["rules"]["BiasGeluFusion"]["near_miss_list"]
    assert miss["reason"] == "the rank of 'm' is unknown"


# ------------------------------------------------------------------ TorchScript's export ------------

#: what TorchScript's BERT export fuses at 14 (as tests/passes/fusion/test_exports.py holds it): 11 to 13 the same,
#: but for the attention below 13, whose function body needs opset 13
EXPORT_STATS = {"LayerNormFusion": 5, "EmbedLayerNormFusion": 1, "SkipLayerNormFusion": 4, "GeluFusion": L,
                "BiasGeluFusion": L, "AttentionFusion": L}


def _export(export_dir: Path, opset: int) -> onnx.ModelProto:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import export_hf

    path = export_dir / f"bert_torchscript_{opset}.onnx"  # the cache test_exports.py uses
    if not path.exists():
        export_hf.export("bert", path, exporter="torchscript", opset=opset, layers=L)
    return onnx.load(str(path))


@pytest.mark.torch
@pytest.mark.parametrize("opset", [11, 12, 13, 14])
def test_torchscript_bert_below_opset14_fuses_as_at_14(export_dir: Path, opset: int) -> None:
    """``torch.onnx.export(dynamo=False, opset_version=N)`` of a 2-layer BertModel: at 13 every fusion of 14 (no
    attention and no bias GELU before); at 11 and 12 all but the attention, a near miss that says why."""
    proto = _export(export_dir, opset)
    assert proto.opset_import[0].version == opset
    from models import export_hf

    feeds = export_hf.sample_feeds("bert", 3, 16, seed=1)
    assert feeds["attention_mask"].min() == 0  # padded rows
    model = to_ir(proto)
    stats, modified, misses = _preset(model, "ort", explain=True)
    want = dict(EXPORT_STATS)
    if opset < 13:
        want.pop("AttentionFusion")
    assert {k: v for k, v in stats.items() if k in EXPORT_STATS} == want
    assert modified
    reasons = Counter(reason for rule, reason in misses if rule == "AttentionFusion")
    if opset < 13:
        assert reasons == Counter({f"the function body of mograph.Attention needs opset >= 13 (model has {opset})": L})
    else:
        assert reasons == Counter()
    assert not any("is unknown" in reason for _, reason in misses), misses
    ops = op_counts(model)
    assert ops["com.microsoft.BiasGelu"] == L and ops["com.microsoft.SkipLayerNormalization"] == 4
    assert ops["com.microsoft.Attention"] == (L if opset >= 13 else 0)
    assert ops["Softmax"] == (0 if opset >= 13 else L)
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)
    _no_op_second_run(model, "ort")
