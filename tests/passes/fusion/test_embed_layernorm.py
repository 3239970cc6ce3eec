"""fuse-embed-layernorm on BERT-style embedding layers built in code, and its lowerings."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _fusion_util import lowered
from mograph.passes.fusion.embed_layernorm import FuseEmbedLayerNormPass
from mograph.passes.fusion.layernorm import FuseLayerNormPass

from mograph.plugins import get_registry
from mograph.testing import (
    Pipeline,
    assert_close,
    assert_untouched,
    feeds_for,
    op_types,
    parse,
    run_ort,
    run_pass,
    to_proto,
)
from mograph.testing import check_pass as check_fusion

H, VOCAB, TYPES, MAXPOS = 16, 50, 2, 12
DIMS = {"batch": 2, "seq": 5, "vocab": TYPES}  # ids below 2 are valid in every table


def _tables(f: str, types: bool = True) -> list[str]:
    """The tables and the norm's scale and bias as initializers of dtype ``f`` (seeded; ``types``: with the token type
    table, whose draw is made either way)."""
    rng = np.random.default_rng(3)
    arrays = {"word": rng.standard_normal((VOCAB, H)), "types": rng.standard_normal((TYPES, H)),
              "pos": rng.standard_normal((MAXPOS, H)), "gamma": 1 + 0.1 * rng.standard_normal(H),
              "beta": 0.1 * rng.standard_normal(H)}
    if not types:
        del arrays["types"]
    return [f"{f}[{','.join(map(str, a.shape))}] {name} = {{{','.join(f'{x:.4f}' for x in a.reshape(-1))}}}"
            for name, a in arrays.items()]


def embed_model(*, positions: str = "slice", order: str = "wt+p", axis: int = -1, sum_read: bool = False,
                fp16: bool = False, token_types: str = "input") -> onnx.ModelProto:
    """BERT's embeddings as TorchScript writes them: position ids sliced from an arange buffer (``slice``),
    a ``[batch, seq]`` input (``input``), a constant that is not an arange (``reversed``), sliced to the length
    DistilBERT reads from the word rows, ``Shape(Word[ids])[1]`` (``rows``), ``Range(0, S, 1)`` unsqueezed and expanded
    to the ids' shape (``range``: ``torch.arange(S).unsqueeze(0).expand_as(ids)``); token type ids an input, or
    (``buffer``) a zero buffer sliced and expanded to the ids' shape as ``BertEmbeddings`` does, or (``none``) no
    token type lookup at all (DistilBERT: word + position)."""
    f = "float16" if fp16 else "float"
    lines = []
    inputs = ["int64[batch,seq] input_ids"]
    inits = ["int64[1] zero = {0}", "int64[1] one = {1}", "int64 one_s = {1}"]
    if token_types == "input":
        inputs.append("int64[batch,seq] token_type_ids")
    elif token_types == "none":
        pass
    else:  # "buffer", "gather": the zero buffer; "buffer-mixed": a buffer not all one id (a near miss)
        ids = ["1" if token_types == "buffer-mixed" and i == 3 else "0" for i in range(MAXPOS)]
        inits += [f"int64[1,{MAXPOS}] tt_buffer = {{{','.join(ids)}}}", "int64[2] minus_one = {-1,-1}",
                  "int64[2] ones = {1,1}", "int64 zero_s = {0}", "int64[1] flat = {-1}"]
        lines += ["tshape = Shape(input_ids)", "b = Gather<axis=0>(tshape, zero_s)", "sq = Gather<axis=0>(tshape, one_s)",
                  "bu = Unsqueeze(b, zero)", "su = Unsqueeze(sq, zero)", "bs = Concat<axis=0>(bu, su)",
                  "bsf = Reshape(bs, flat)", "neg = Equal(bsf, minus_one)", "size = Where(neg, ones, bsf)"]
        if token_types == "gather":  # transformers 5: the buffer gathered by the (sliced) position ids
            buf = ",".join(str(i) for i in range(MAXPOS))
            inits.append(f"int64[1,{MAXPOS}] tt_pos = {{{buf}}}")
            lines += ["tp = Slice(tt_pos, zero, su, one, one)", "tt = GatherElements<axis=1>(tt_buffer, tp)"]
        else:
            lines.append("tt = Slice(tt_buffer, zero, su, one, one)")
        lines.append("token_type_ids = Expand(tt, size)")
    if positions == "slice":
        buf = ",".join(str(i) for i in range(MAXPOS))
        inits.append(f"int64[1,{MAXPOS}] pos_buffer = {{{buf}}}")
        lines += ["shape = Shape(input_ids)", "seq = Gather<axis=0>(shape, one_s)", "ends = Unsqueeze(seq, zero)",
                  "position_ids = Slice(pos_buffer, zero, ends, one, one)"]
    elif positions.startswith("slice-mask"):  # dynamo: the end is dim 1 of attention_mask, Shape<start=1, end=2>
        buf = ",".join(str(i) for i in range(MAXPOS))
        inits.append(f"int64[1,{MAXPOS}] pos_buffer = {{{buf}}}")
        inputs.append("int64[batch,seq] attention_mask" if positions == "slice-mask" else "int64[batch,len] attention_mask")
        lines += ["ends = Shape<start=1, end=2>(attention_mask)", "position_ids = Slice(pos_buffer, zero, ends, one, one)",
                  "mask_sum = ReduceSum<keepdims=0>(attention_mask)"]
    elif positions == "rows":  # TorchScript DistilBERT: the length read from the word rows
        buf = ",".join(str(i) for i in range(MAXPOS))
        inits.append(f"int64[1,{MAXPOS}] pos_buffer = {{{buf}}}")
        lines += ["w = Gather(word, input_ids)", "wshape = Shape(w)", "seq = Gather<axis=0>(wshape, one_s)",
                  "ends = Unsqueeze(seq, zero)", "position_ids = Slice(pos_buffer, zero, ends, one, one)"]
    elif positions == "range":
        inits.append("int64 zero_r = {0}")
        lines += ["shape = Shape(input_ids)", "seq = Gather<axis=0>(shape, one_s)", "r = Range(zero_r, seq, one_s)",
                  "ru = Unsqueeze(r, zero)", "position_ids = Expand(ru, shape)"]
    elif positions == "input":
        inputs.append("int64[batch,seq] position_ids")
    else:
        inits.append("int64[1,5] position_ids = {4,2,3,0,1}")
    if positions != "rows":
        lines.append("w = Gather(word, input_ids)")
    if token_types == "none":  # two lookups; sum_read: the sum is read elsewhere
        lines += ["p = Gather(pos, position_ids)", "s = Add(w, p)" if order == "wt+p" else "s = Add(p, w)"]
    else:
        lines += ["t = Gather(types, token_type_ids)", "p = Gather(pos, position_ids)"]
        if order == "wt+p":
            lines += ["wt = Add(w, t)", "s = Add(wt, p)"]
        else:  # p + (t + w)
            lines += ["wt = Add(t, w)", "s = Add(p, wt)"]
    lines.append(f"y = LayerNormalization<axis={axis}, epsilon=1e-12>(s, gamma, beta)")
    outs = f"{f}[batch,seq,{H}] y"
    if positions.startswith("slice-mask"):
        outs += ", int64 mask_sum"
    if sum_read:
        lines.append("wt2 = Mul(s, s)" if token_types == "none" else "wt2 = Mul(wt, wt)")
        outs += f", {f}[batch,seq,{H}] wt2"
    shape = "[batch,5]" if positions == "reversed" else "[batch,seq]"
    inputs = [i.replace("[batch,seq]", shape) for i in inputs]
    inits += _tables("float", types=token_types != "none")
    text = (f'<ir_version: 8, opset_import: ["" : 17]>\n'
            f"g ({', '.join(inputs)}) => ({outs}) <{', '.join(inits)}> {{\n  " + "\n  ".join(lines) + "\n}")
    proto = parse(text)
    if fp16:  # the parser takes no float16 literals: convert the tables after parsing
        for i, init in enumerate(proto.graph.initializer):
            if init.data_type == onnx.TensorProto.FLOAT:
                arr = onnx.numpy_helper.to_array(init).astype(np.float16)
                proto.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
        onnx.checker.check_model(proto)
    return proto


def _feeds(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    feeds = feeds_for(proto, dims=DIMS)
    rng = np.random.default_rng(1)
    feeds["input_ids"] = rng.integers(0, VOCAB, feeds["input_ids"].shape).astype(np.int64)
    if "position_ids" in feeds:
        feeds["position_ids"] = rng.integers(0, MAXPOS, feeds["position_ids"].shape).astype(np.int64)
    return feeds


STATS = {"EmbedLayerNormFusion": 1, "EmbedLayerNormFusion.standard": 1}


@pytest.mark.parametrize("order", ["wt+p", "p+tw"])
def test_embed_layernorm_ort_implicit_positions(order):
    proto = embed_model(order=order)
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 2, "embed_implicit_positions": 1}
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=_feeds(proto),
                         ops_left=["Cast", "Cast", "com.microsoft.EmbedLayerNormalization"])
    node = next(n for n in model.graph if n.op_type == "EmbedLayerNormalization")
    assert len(node.inputs) == 7  # no mask, no position_ids: the kernel's own 0 .. S-1
    assert node.inputs[2].name == "word" and node.inputs[3].name == "pos" and node.inputs[4].name == "types"
    assert node.attributes["epsilon"].value == pytest.approx(1e-12)


def test_embed_layernorm_canonical_op_and_onnx_target():
    proto = embed_model()
    feeds = _feeds(proto)
    model = check_fusion(FuseEmbedLayerNormPass(), proto, stats=STATS, feeds=feeds,
                         ops_left=["Shape", "Gather", "Unsqueeze", "Slice", "mograph.EmbedLayerNorm"])
    node = next(n for n in model.graph if n.op_type == "EmbedLayerNorm")
    assert [v.name for v in node.inputs[:6]] == ["input_ids", "token_type_ids", "position_ids", "word", "types", "pos"]
    # onnx, tensorrt: the standard ops again (which a second run would fuse again, as for every op lowered to them)
    for target in ("onnx", "tensorrt"):
        model, result = run_pass(lowered(FuseEmbedLayerNormPass(), target), proto)
        assert result.stats == {**STATS, "lowered.EmbedLayerNorm": 1}
        assert op_types(model) == ["Shape", "Gather", "Unsqueeze", "Slice", "Gather", "Gather", "Add", "Gather", "Add",
                                   "LayerNormalization"]
        assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), rel=1e-5)


def test_embed_layernorm_reference_matches_function_body():
    from mograph.passes.fusion.ops import embed_layer_norm

    proto = embed_model(positions="input")
    model = run_pass(FuseEmbedLayerNormPass(), proto)[0]
    feeds = _feeds(proto)
    (y,) = run_ort(to_proto(model), feeds)
    t = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    ref = embed_layer_norm(feeds["input_ids"], feeds["token_type_ids"], feeds["position_ids"], t["word"], t["types"],
                           t["pos"], t["gamma"], t["beta"], epsilon=1e-12)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_dims,implicit", [("slice-mask", True), ("slice-mask-len", False)])
def test_embed_layernorm_ort_positions_sliced_to_the_mask_length(mask_dims, implicit):
    """dynamo slices the position buffer to ``Shape<start=1, end=2>(attention_mask)``: implicit positions when the
    mask is declared with the ids' sequence dim, else the sliced ids go to the kernel."""
    proto = embed_model(positions=mask_dims)
    feeds = _feeds(proto)
    feeds["attention_mask"] = np.ones((2, 5), dtype=np.int64)
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 2 if implicit else 3}
    # not provably [1, S]: expanded to the ids' shape for the kernel
    stats.update({"embed_implicit_positions": 1} if implicit else {"embed_ids_expanded": 1, "embed_ids_shape": 1})
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=feeds)
    node = next(n for n in model.graph if n.op_type == "EmbedLayerNormalization")
    assert (len(node.inputs) == 7) == implicit


def test_embed_layernorm_ort_position_ids_input_passed():
    proto = embed_model(positions="input")
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 3}
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=_feeds(proto),
                         ops_left=["Cast", "Cast", "Cast", "com.microsoft.EmbedLayerNormalization"])
    node = next(n for n in model.graph if n.op_type == "EmbedLayerNormalization")
    assert node.inputs[7] is None and node.inputs[8].name == "position_ids_int32"


def test_embed_layernorm_ort_positions_not_arange_kept():
    """Constant [1, S] position ids that are not 0 .. S-1 go to the kernel (as an int32 initializer)."""
    proto = embed_model(positions="reversed")
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 3}
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=_feeds(proto),
                         ops_left=["Cast", "Cast", "com.microsoft.EmbedLayerNormalization"])
    node = next(n for n in model.graph if n.op_type == "EmbedLayerNormalization")
    assert node.inputs[8].const_value is not None
    assert node.inputs[8].const_value.numpy().tolist() == [[4, 2, 3, 0, 1]]


def _decompose_norm(proto: onnx.ModelProto, f: str = "float16") -> onnx.ModelProto:
    """``proto`` with its ``LayerNormalization`` written out (ReduceMean, Sub, Mul, Sqrt, Div: as TorchScript exports
    below opset 17), computing in float32 (``f``: the tensors' dtype)."""
    node = next(n for n in proto.graph.node if n.op_type == "LayerNormalization")
    idx = list(proto.graph.node).index(node)
    del proto.graph.node[idx]
    cast_in, cast_out = ("  sf = Cast<to=1>(s)\n", "  nh = Cast<to=10>(n)\n") if f == "float16" else ("", "")
    body = (cast_in + "  m = ReduceMean<axes=[-1]>(sf)\n  d = Sub(sf, m)\n  dd = Mul(d, d)\n"
            "  v = ReduceMean<axes=[-1]>(dd)\n  ve = Add(v, eps)\n  r = Sqrt(ve)\n  n = Div(d, r)\n"
            + cast_out + "  g = Mul(nh, gamma)\n  y = Add(g, beta)\n")
    if f != "float16":
        body = body.replace("(sf", "(s").replace("sf)", "s)").replace("Mul(nh", "Mul(n")
    decomposed = parse(
        '<ir_version: 8, opset_import: ["" : 17]>\n'
        f"ln ({f}[batch,seq,{H}] s, {f}[{H}] gamma, {f}[{H}] beta) => ({f}[batch,seq,{H}] y) "
        "<float eps = {1e-12}, int64[1] ax = {-1}> {\n" + body + "}")
    proto.graph.node.extend(decomposed.graph.node)
    proto.graph.initializer.extend(decomposed.graph.initializer)
    onnx.checker.check_model(proto)
    return proto


def test_embed_layernorm_after_fuse_layernorm_fp16():
    """A decomposed fp16 LayerNorm (``mograph.LayerNorm`` from fuse-layernorm) fuses too, and runs on ORT."""
    proto = _decompose_norm(embed_model(fp16=True))
    feeds = _feeds(proto)
    fused, result = run_pass(Pipeline(FuseLayerNormPass(), lowered(FuseEmbedLayerNormPass(), "ort")), proto)
    assert op_types(fused) == ["Cast", "Cast", "com.microsoft.EmbedLayerNormalization"]
    assert result.stats["EmbedLayerNormFusion.mograph"] == 1
    assert_close(run_ort(proto, feeds), run_ort(to_proto(fused), feeds), rel=5e-3)


def test_embed_layernorm_near_miss_norm_not_over_last_axis():
    result = assert_untouched(FuseEmbedLayerNormPass(explain=True), embed_model(axis=1))
    (miss,) = result.details["rules"]["EmbedLayerNormFusion"]["near_miss_list"]
    assert "is not over the last axis" in miss["reason"]


def test_embed_layernorm_near_miss_partial_sum_read():
    assert_untouched(FuseEmbedLayerNormPass(explain=True), embed_model(sum_read=True))


def test_embed_layernorm_ort_segment_ids_expanded_when_shape_unproven():
    """Token type ids of an unknown shape get ``Expand(ids, Shape(input_ids))`` before the kernel."""
    proto = embed_model()
    tt = next(i for i in proto.graph.input if i.name == "token_type_ids")
    for d, name in zip(tt.type.tensor_type.shape.dim, ("b2", "s2")):
        d.dim_param = name
    feeds = _feeds(proto)
    feeds["token_type_ids"] = np.random.default_rng(2).integers(0, TYPES, (2, 5)).astype(np.int64)
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 2, "embed_implicit_positions": 1,
             "embed_ids_expanded": 1, "embed_ids_shape": 1}
    check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=feeds,
                 ops_left=["Shape", "Expand", "Cast", "Cast", "com.microsoft.EmbedLayerNormalization"])
    broadcast = {**feeds, "token_type_ids": feeds["token_type_ids"][:1]}  # [1, S] against [B, S]
    fused = run_pass(lowered(FuseEmbedLayerNormPass(), "ort"), proto)[0]
    assert_close(run_ort(proto, broadcast), run_ort(to_proto(fused), broadcast), rel=1e-5)


@pytest.mark.parametrize("token_types", ["buffer", "gather"])
def test_embed_layernorm_ort_buffered_token_types_folded(token_types):
    """``BertEmbeddings``' zero buffer (TorchScript: sliced and expanded to ``Shape(input_ids)``; transformers 5: also
    gathered by the position ids) holds segment 0 everywhere: row 0 of the segment table goes into the position
    table and the kernel gets no segment inputs.  The ids' shape subgraph, computed on the host and copied to the
    device before, is gone: ONNX Runtime's CUDA provider can capture the graph (it could not before)."""
    from mograph.cuda_graph import cuda_graph_check

    proto = embed_model(token_types=token_types)
    assert not cuda_graph_check(run_pass(lowered(FuseEmbedLayerNormPass(), "onnx"), proto)[0]).capturable
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 1, "embed_implicit_positions": 1,
             "embed_segment_folded": 1}
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=_feeds(proto),
                         ops_left=["Cast", "com.microsoft.EmbedLayerNormalization"])
    (node,) = [n for n in model.graph if n.op_type == "EmbedLayerNormalization"]
    assert node.inputs[1] is None and node.inputs[4] is None and len(node.inputs) == 7
    rng = np.random.default_rng(3)  # the seeded tables of _tables: word, types, pos
    rng.standard_normal((VOCAB, H))  # the word table
    types, pos = rng.standard_normal((TYPES, H)), rng.standard_normal((MAXPOS, H))
    folded = node.inputs[3].const_value.numpy()
    expect = (np.round(pos, 4).astype(np.float32) + np.round(types[0], 4).astype(np.float32))
    np.testing.assert_array_equal(folded, expect)
    assert {"types", "pos"}.isdisjoint(model.graph.initializers)  # the old tables are read no more
    report = cuda_graph_check(model)
    assert report.capturable, report.blockers
    for batch, seq in ((3, 7), (1, 12)):  # other shapes than the seeded feeds'
        feeds = {"input_ids": np.random.default_rng(batch).integers(0, VOCAB, (batch, seq)).astype(np.int64)}
        assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), rel=1e-5)


def test_embed_layernorm_ort_token_types_not_one_id_kept():
    """Near miss: a token type buffer that is not all one id (a 1 at position 3) stays the kernel's segment input."""
    proto = embed_model(token_types="buffer-mixed")
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 2, "embed_implicit_positions": 1}
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=_feeds(proto))
    (node,) = [n for n in model.graph if n.op_type == "EmbedLayerNormalization"]
    assert node.inputs[1] is not None and node.inputs[4].name == "types" and node.inputs[3].name == "pos"
    assert op_types(model).count("Expand") == 1  # the model's own


def test_embed_layernorm_ort_token_type_input_kept():
    """Near miss: token type ids that are a model input stay the kernel's segment ids (nothing folded)."""
    proto = embed_model()
    model = run_pass(lowered(FuseEmbedLayerNormPass(), "ort"), proto)[0]
    (node,) = [n for n in model.graph if n.op_type == "EmbedLayerNormalization"]
    assert node.inputs[1].producer().inputs[0].name == "token_type_ids"
    assert node.inputs[3].name == "pos" and node.inputs[4].name == "types"


@pytest.mark.parametrize("lower_first", [True, False])
def test_embed_layernorm_fp16(lower_first):
    """fp16 converts the op (lowered: ORT's schema; before lowering: float-generic), ids stay integer."""
    from mograph.passes.quant._fp16_measure import keep_fp16_rounding
    from mograph.passes.quant.fp16 import Fp16Pass

    from mograph.lowering import LowerPass

    proto = embed_model(positions="input")
    model = run_pass(lowered(FuseEmbedLayerNormPass(), "ort" if lower_first else "mograph"), proto)[0]
    calib = [_feeds(proto) for _ in range(4)]
    for i, feeds in enumerate(calib):
        feeds["input_ids"] = np.random.default_rng(20 + i).integers(0, VOCAB, (2, 5)).astype(np.int64)
    result = Fp16Pass(calibration_data=calib).call(model)
    assert result.stats["kept_fp32"] == 0 and result.stats["casts"] == 1  # the float32 output only
    if not lower_first:
        LowerPass(target="ort", registry=get_registry()).call(model)
    (node,) = [n for n in model.graph if n.op_type == "EmbedLayerNormalization"]
    assert [v.dtype for v in node.inputs[2:7]] == [onnx.TensorProto.FLOAT16] * 5  # tables, gamma, beta
    assert node.inputs[0].dtype == node.inputs[1].dtype == node.inputs[8].dtype == onnx.TensorProto.INT32
    feeds = _feeds(proto)
    got = run_ort(to_proto(keep_fp16_rounding(model)), feeds)
    assert_close(run_ort(proto, feeds), got, rel=5e-3)


def test_embed_layernorm_ort_two_expanded_ids_get_unique_names():
    """Token type ids and position ids both of an unproven shape: both are expanded (unnamed values), and their
    int32 casts were both named ``ids_int32`` (not SSA: exit 4 on a TorchScript BERT at opset 12, --target ort)."""
    proto = embed_model(positions="slice-mask-len")
    tt = next(i for i in proto.graph.input if i.name == "token_type_ids")
    for d, name in zip(tt.type.tensor_type.shape.dim, ("b2", "s2")):
        d.dim_param = name
    feeds = _feeds(proto)
    feeds["attention_mask"] = np.ones((2, 5), dtype=np.int64)
    feeds["token_type_ids"] = np.random.default_rng(2).integers(0, TYPES, (2, 5)).astype(np.int64)
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 3, "embed_ids_expanded": 2, "embed_ids_shape": 1}
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=feeds)
    names = [o.name for n in model.graph for o in n.outputs]
    assert len(names) == len(set(names)) and sum(n.startswith("ids_int32") for n in names) == 2
    onnx.checker.check_model(to_proto(model), full_check=True)


# -- two lookups: word + position, no token type table (DistilBERT) ------------------------------------------------

NO_SEGMENT_STATS = {"EmbedLayerNormFusion": 1, "EmbedLayerNormFusion.standard.no-segment": 1}


@pytest.mark.parametrize("positions,implicit,ops_before", [
    ("slice", True, []), ("slice-mask", True, ["ReduceSum"]), ("rows", True, []), ("range", True, []),
    ("input", False, ["Cast"]), ("reversed", False, []),
])
@pytest.mark.parametrize("order", ["wt+p", "p+tw"])
def test_embed_layernorm_two_tables_ort(positions, implicit, ops_before, order):
    """Word + position lookups and their LayerNorm -> ``EmbedLayerNormalization`` without segment inputs (optional in
    the kernel): the neutral segment lookup the fusion writes is left out, positions 0 .. S-1 (sliced from the
    buffer to the ids' length, however read: the ids, the mask, the word rows' Shape as DistilBERT does; or a
    ``Range``) are the kernel's own, other position ids are passed."""
    proto = embed_model(positions=positions, token_types="none", order=order)
    feeds = _feeds(proto)
    if positions == "slice-mask":
        feeds["attention_mask"] = np.ones((2, 5), dtype=np.int64)
    # int32 ids: input_ids, and the position ids where they are passed (a Cast, or a new constant)
    stats = {**NO_SEGMENT_STATS, "lowered.EmbedLayerNorm": 1, "embed_no_segment": 1,
             "embed_ids_int32": 1 if implicit else 2}
    if implicit:
        stats["embed_implicit_positions"] = 1
    model = check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=feeds,
                         ops_left=[*ops_before, "Cast", "com.microsoft.EmbedLayerNormalization"])
    (node,) = [n for n in model.graph if n.op_type == "EmbedLayerNormalization"]
    assert node.inputs[0].producer().inputs[0].name == "input_ids"
    assert node.inputs[1] is None and node.inputs[4] is None  # no segment ids, no segment table
    assert node.inputs[2].name == "word" and node.inputs[3].name == "pos"
    assert len(node.inputs) == (7 if implicit else 9)
    assert not any(name.startswith("mograph_no_segment") for name in model.graph.initializers)
    for batch, seq in ((3, 7), (1, 1), (1, MAXPOS)):  # other shapes than the seeded feeds'
        rng = np.random.default_rng(seq)
        f = {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)}
        if positions == "slice-mask":
            f["attention_mask"] = np.ones((batch, seq), dtype=np.int64)
        if positions == "input":
            f["position_ids"] = rng.integers(0, MAXPOS, (batch, seq)).astype(np.int64)
        if positions != "reversed":  # (its positions are 5 constants)
            assert_close(run_ort(proto, f), run_ort(to_proto(model), f), rel=1e-5)


def test_embed_layernorm_two_tables_canonical_op_and_standard_targets():
    """The canonical op reads a neutral segment lookup: ids ``[[0]]`` of a ``[1, hidden]`` table of negative zeros
    (``x + -0.0`` is ``x``: the function body computes the graph's sum exactly); ``onnx``/``tensorrt`` give back the
    very graph matched (two Gathers, one Add): the same numbers to the bit."""
    proto = embed_model(positions="input", token_types="none")
    feeds = _feeds(proto)
    model = check_fusion(FuseEmbedLayerNormPass(), proto, stats=NO_SEGMENT_STATS, feeds=feeds,
                         ops_left=["mograph.EmbedLayerNorm"])
    (node,) = list(model.graph)
    assert [v.name for v in node.inputs[:6]] == ["input_ids", "mograph_no_segment_ids", "position_ids", "word",
                                                 "mograph_no_segment", "pos"]
    table, ids = node.inputs[4].const_value.numpy(), node.inputs[1].const_value.numpy()
    assert table.shape == (1, H) and table.dtype == np.float32 and not np.any(table) and np.all(np.signbit(table))
    assert ids.tolist() == [[0]]
    t = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    from mograph.passes.fusion.ops import layer_norm

    ref = layer_norm(t["word"][feeds["input_ids"]] + t["pos"][feeds["position_ids"]], t["gamma"], t["beta"], 1e-12)
    np.testing.assert_allclose(run_ort(to_proto(model), feeds)[0], ref, rtol=1e-5, atol=1e-5)
    for target in ("onnx", "tensorrt"):
        model, result = run_pass(lowered(FuseEmbedLayerNormPass(), target), proto)
        assert result.stats == {**NO_SEGMENT_STATS, "lowered.EmbedLayerNorm": 1}
        assert op_types(model) == ["Gather", "Gather", "Add", "LayerNormalization"]
        assert set(model.graph.initializers) == {i.name for i in proto.graph.initializer}
        for a, b in zip(run_ort(proto, feeds), run_ort(to_proto(model), feeds)):
            np.testing.assert_array_equal(a, b)


def test_embed_layernorm_two_tables_decomposed_norm_before_skip_layernorm():
    """TorchScript below opset 17 writes the norm out: ``fuse-layernorm`` makes it ``mograph.LayerNorm``, then the two
    lookups fuse with it (``fuse-skip-layernorm`` took the Add and the norm before: ``SkipLayerNormFusion.plain``)."""
    from mograph.passes.fusion.skip_layernorm import FuseSkipLayerNormPass

    proto = _decompose_norm(embed_model(positions="rows", token_types="none"), "float")
    pipeline = Pipeline(FuseLayerNormPass(), FuseEmbedLayerNormPass(), FuseSkipLayerNormPass())
    stats = {"LayerNormFusion": 1, "LayerNormFusion.div-sqrt.centered.reducemean": 1, "LayerNormScaleFusion": 1,
             "LayerNormBiasFusion": 1, "EmbedLayerNormFusion": 1,
             "EmbedLayerNormFusion.mograph.no-segment": 1, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 1,
             "embed_implicit_positions": 1, "embed_no_segment": 1}
    check_fusion(lowered(pipeline, "ort"), proto, stats=stats, feeds=_feeds(proto),
                 ops_left=["Cast", "com.microsoft.EmbedLayerNormalization"])


def test_embed_layernorm_two_tables_near_miss_norm_not_over_last_axis():
    result = assert_untouched(FuseEmbedLayerNormPass(explain=True), embed_model(axis=1, token_types="none"))
    (miss,) = result.details["rules"]["EmbedLayerNormFusion"]["near_miss_list"]
    assert "is not over the last axis" in miss["reason"]


def test_embed_layernorm_two_tables_near_miss_sum_read():
    """The sum of the two lookups read elsewhere (GPT-2: the residual stream): the kernel does not return it."""
    result = assert_untouched(FuseEmbedLayerNormPass(explain=True), embed_model(token_types="none", sum_read=True))
    (miss,) = result.details["rules"]["EmbedLayerNormFusion"]["near_miss_list"]
    assert "is also read by" in miss["reason"] and "(Mul)" in miss["reason"]


def test_absent_segment_is_only_the_neutral_lookup():
    """A segment lookup is left out only when it adds nothing whatever the ids: all negative zeros at a valid row."""
    from mograph.passes.fusion.lowerings.embed import absent_segment

    def value(arr):
        return ir.Value(name="v", const_value=ir.tensor(arr))

    neg = value(np.full((1, H), -0.0, np.float32))
    assert absent_segment(value(np.zeros((1, 1), np.int64)), neg)
    assert absent_segment(value(np.zeros((1, 1), np.int64)), value(np.full((1, H), -0.0, np.float16)))
    assert not absent_segment(value(np.zeros((1, 1), np.int64)), value(np.zeros((1, H), np.float32)))  # +0.0
    assert not absent_segment(value(np.ones((1, 1), np.int64)), neg)  # row 1 of a 1-row table: an error to keep
    assert not absent_segment(value(np.array([[0, 1]], np.int64)), value(np.full((2, H), -0.0, np.float32)))
    assert not absent_segment(ir.Value(name="ids", type=ir.TensorType(ir.DataType.INT64)), neg)


def test_embed_layernorm_three_tables_shape_of_rows_rewired():
    """A ``Shape`` of the word rows (what DistilBERT reads the length from) no longer blocks three lookups either."""
    proto = embed_model(positions="rows")
    stats = {**STATS, "lowered.EmbedLayerNorm": 1, "embed_ids_int32": 2, "embed_implicit_positions": 1}
    check_fusion(lowered(FuseEmbedLayerNormPass(), "ort"), proto, stats=stats, feeds=_feeds(proto),
                 ops_left=["Cast", "Cast", "com.microsoft.EmbedLayerNormalization"])
