"""weight-only ``--embedding-precision`` on a fused embedding layer (``mograph.EmbedLayerNorm``, BERT's): the node
is expanded back to its Gathers, Adds and ``mograph.LayerNorm`` and the word table's Gather block-quantized
(``mograph.BlockQuantizedGather`` -> ``GatherBlockQuantized``); the segment and position tables stay float."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.fusion.embed_layernorm import FuseEmbedLayerNormPass
from mograph.passes.quant import WeightOnlyPass
from mograph.passes.quant._wo_fused import SMALL_TABLE
from mograph.passes.quant.gather_block_op import dequantize_table
from onnx import helper, numpy_helper
from test_weight_only import representable

from mograph.lowering import lower_model
from mograph.plugins import get_registry
from mograph.testing import assert_close, check_pass, op_types, run_ort, run_pass, to_ir, to_proto

V, TYPES, MAXPOS = 300, 2, 16


def bert_embeddings(word: np.ndarray, w1: np.ndarray, w2: np.ndarray, *, seed: int = 0,
                    tied_head: bool = False, buffered: bool = False, two_tables: bool = False) -> onnx.ModelProto:
    """BERT's embeddings (word + token type + position lookups, LayerNorm) and two MatMuls, fused by
    ``fuse-embed-layernorm`` into one ``mograph.EmbedLayerNorm``; ``tied_head``: then an LM head reading the word
    table itself (``Gemm(transB=1)``, as a masked-LM head tied to it); ``buffered``: the token type and position
    ids from ``BertEmbeddings``' buffers as TorchScript writes them (zeros and ``arange``, sliced to the ids' length,
    the token types expanded to their shape), ``input_ids`` the only input; ``two_tables``: no token type lookup
    (DistilBERT: word + position)."""
    rng = np.random.default_rng(seed)
    h = word.shape[1]
    inits = [numpy_helper.from_array(word, "word"),
             numpy_helper.from_array((rng.standard_normal((TYPES, h)) * 0.05).astype(np.float32), "types"),
             numpy_helper.from_array((rng.standard_normal((MAXPOS, h)) * 0.05).astype(np.float32), "pos"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(h)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(h)).astype(np.float32), "beta"),
             numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")]
    nodes = [helper.make_node("Gather", ["word", "input_ids"], ["w"]),
             helper.make_node("Gather", ["types", "token_type_ids"], ["t"]),
             helper.make_node("Gather", ["pos", "position_ids"], ["p"]),
             helper.make_node("Add", ["w", "t"], ["wt"]), helper.make_node("Add", ["wt", "p"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["e"], axis=-1, epsilon=1e-12),
             helper.make_node("MatMul", ["e", "W1"], ["hid"], name="mlp"),
             helper.make_node("MatMul", ["hid", "W2"], ["y"], name="out")]
    id_inputs = ("input_ids", "token_type_ids", "position_ids")
    if two_tables:
        nodes[1:5] = [nodes[2], helper.make_node("Add", ["w", "p"], ["s"])]  # no token type Gather: one Add
        del inits[1]
        id_inputs = ("input_ids", "position_ids")
    if buffered:
        id_inputs = ("input_ids",)
        inits += [numpy_helper.from_array(np.zeros((1, MAXPOS), np.int64), "tt_buffer"),
                  numpy_helper.from_array(np.arange(MAXPOS, dtype=np.int64)[None], "pos_buffer"),
                  numpy_helper.from_array(np.array([0], np.int64), "zero1"),
                  numpy_helper.from_array(np.array([1], np.int64), "one1")]
        nodes[:0] = [helper.make_node("Shape", ["input_ids"], ["shape"]),
                     helper.make_node("Shape", ["input_ids"], ["seq1"], start=1, end=2),
                     helper.make_node("Slice", ["pos_buffer", "zero1", "seq1", "one1", "one1"], ["position_ids"]),
                     helper.make_node("Slice", ["tt_buffer", "zero1", "seq1", "one1", "one1"], ["tt"]),
                     helper.make_node("Expand", ["tt", "shape"], ["token_type_ids"])][slice(1, 3) if two_tables else slice(5)]
        if two_tables:
            del inits[-4]  # the token type buffer
    ids = [helper.make_tensor_value_info(n, onnx.TensorProto.INT64, ["batch", "seq"]) for n in id_inputs]
    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "seq", h])
    if tied_head:
        nodes += [helper.make_node("Reshape", ["y", "flat"], ["y2"]),
                  helper.make_node("Gemm", ["y2", "word"], ["logits"], transB=1, name="lm_head")]
        inits.append(numpy_helper.from_array(np.array([-1, h], np.int64), "flat"))
        out = helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", V])
    graph = helper.make_graph(nodes, "bert_embeddings", ids, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    fused, result = run_pass(FuseEmbedLayerNormPass(), model)
    assert result.stats.get("EmbedLayerNormFusion") == 1
    return to_proto(fused)


def _feeds(rng: np.random.Generator, two_tables: bool = False) -> dict[str, np.ndarray]:
    feeds = {"input_ids": rng.integers(0, V, (2, 5)).astype(np.int64),
             "token_type_ids": rng.integers(0, TYPES, (2, 5)).astype(np.int64),
             "position_ids": rng.integers(0, MAXPOS, (2, 5)).astype(np.int64)}
    if two_tables:
        del feeds["token_type_ids"]
    return feeds


def _representable(rng: np.random.Generator, h: int, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A word table every (row, block) of which 4-bit RTN stores exactly, and two representable weights."""
    return (np.ascontiguousarray(representable(rng, h, V, bs).T), representable(rng, h, h, bs),
            representable(rng, h, h, bs))


def _plan(result) -> dict[str, dict[str, str]]:
    return {e["node"]: e for e in result.details["plan"]["nodes"]}


def test_five_checks_fused_word_table_quantized():
    rng = np.random.default_rng(0)
    word, w1, w2 = _representable(rng, 64, 64)
    proto = bert_embeddings(word, w1, w2)
    assert [n.op_type for n in proto.graph.node][0] == "EmbedLayerNorm"
    feeds = _feeds(rng)
    # exactly representable: the expanded, quantized model computes what the fused float one does
    model = check_pass(WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits"), proto,
                       stats={"quantized": 1, "kept_float": 1, "quantized.int4": 1, "quantized.embeddings": 1,
                              "expanded.embed_layernorm": 1},
                       ops_left=["mograph.BlockQuantizedGather", "Gather", "Gather", "Add", "Add", "mograph.LayerNorm",
                                 "mograph.WeightOnlyMatMul", "MatMul"], feeds=feeds)
    gathers = [n for n in model.graph if n.op_type == "Gather"]
    assert [g.inputs[0].name for g in gathers] == ["types", "pos"]  # the small tables stay float
    assert [g.metadata_props[SMALL_TABLE] for g in gathers] == ["segment", "position"]
    assert "word" not in model.graph.initializers
    # the rows keep a shape (the fp16 pass's measurement sizes its groups by them)
    assert [list(n.outputs[0].shape) for n in model.graph if n.op_type.endswith("Gather")] == [["batch", "seq", 64]] * 3
    assert not any(key[1] == "EmbedLayerNorm" for key in model.functions)  # its body went with the node
    assert any(key[1] == "LayerNorm" for key in model.functions)
    plan = _plan(WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits").call(to_ir(proto)))
    word_key = next(k for k in plan if k.endswith("/word"))
    assert plan[word_key]["precision"] == "int4" and "hidden axis" in plan[word_key]["reason"]
    small = [e for k, e in plan.items() if k.endswith(("/segment", "/position"))]
    assert len(small) == 2 and all(e["precision"] == "float" and "small" in e["reason"] for e in small)
    # a later run that quantizes the head leaves the small tables float (a plain Gather of a table is quantized)
    again = WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits", output_projection="bits")
    result = again.call(model)
    assert result.stats == {"quantized": 1, "kept_float": 0, "quantized.int4": 1}
    assert [n.op_type for n in model.graph if n.op_type.endswith("Gather")] == ["BlockQuantizedGather", "Gather", "Gather"]


def test_buffered_ids_become_device_lookups():
    """Token type ids that are provably all 0 (the zero buffer) and position ids sliced from 0 of the ``arange``
    buffer: segment row 0 goes into the position table (no segment Gather) and the position rows are ``Slice`` of
    that table, so no lookup reads ids computed on the host from shape values: capturable as a CUDA graph once
    lowered for ONNX Runtime (it was not: both Gathers read host ids, a Memcpy each)."""
    from mograph.cuda_graph import cuda_graph_check

    rng = np.random.default_rng(6)
    word, w1, w2 = _representable(rng, 64, 64)
    proto = bert_embeddings(word, w1, w2, buffered=True)
    feeds = {"input_ids": rng.integers(0, V, (3, 7)).astype(np.int64)}
    before = to_ir(proto)
    WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits",
                   precision_plan={"pass": "weight-only", "nodes": []}).call(before)
    model = check_pass(WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits"), proto,
                       stats={"quantized": 1, "kept_float": 1, "quantized.int4": 1, "quantized.embeddings": 1,
                              "expanded.embed_layernorm": 1, "embeddings.segment_folded": 1,
                              "embeddings.positions_sliced": 1},
                       ops_left=["Shape", "Slice", "mograph.BlockQuantizedGather", "Unsqueeze", "Add",
                                 "mograph.LayerNorm", "mograph.WeightOnlyMatMul", "MatMul"], feeds=feeds)
    (cut,) = [n for n in model.graph if n.op_type == "Slice"]
    folded = cut.inputs[0].const_value.numpy()
    types, pos = (numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == n)) for n in ("types", "pos"))
    np.testing.assert_array_equal(folded, pos + types[0])
    assert {"types", "pos", "tt_buffer", "pos_buffer"}.isdisjoint(model.graph.initializers)
    for shape in ((1, 1), (2, MAXPOS)):  # the shortest and the whole buffer
        f = {"input_ids": rng.integers(0, V, shape).astype(np.int64)}
        assert_close(run_ort(proto, f), run_ort(to_proto(model), f), 1e-5)
    lower_model(model, "ort", registry=get_registry())
    report = cuda_graph_check(model)
    assert report.capturable, report.blockers


def test_buffered_ids_named_by_the_plan_stay_gathers():
    """Near miss: plan entries for the segment and position Gathers keep them (the plan decides their tables);
    lowered, the check names both lookups that read host ids."""
    from mograph.cuda_graph import cuda_graph_check

    rng = np.random.default_rng(7)
    word, w1, w2 = _representable(rng, 64, 64)
    proto = bert_embeddings(word, w1, w2, buffered=True)
    name = next(n.name for n in proto.graph.node if n.op_type == "EmbedLayerNorm")
    plan = {"pass": "weight-only", "nodes": [{"node": f"{name}/segment", "precision": "float", "reason": "edited"},
                                             {"node": f"{name}/position", "precision": "float", "reason": "edited"}]}
    model = check_pass(WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits", precision_plan=plan),
                       proto, stats={"quantized": 1, "kept_float": 1, "quantized.int4": 1, "quantized.embeddings": 1,
                                     "expanded.embed_layernorm": 1},
                       feeds={"input_ids": rng.integers(0, V, (2, 5)).astype(np.int64)})
    assert [g.inputs[0].name for g in model.graph if g.op_type == "Gather"] == ["types", "pos"]
    lower_model(model, "ort", registry=get_registry())
    report = cuda_graph_check(model)
    assert {b["node"] for b in report.blockers} == {f"{name}/segment", f"{name}/position"}, report.blockers


@pytest.mark.parametrize("bits", [4, 8])
def test_ort_lowering_matches_embed_layer_normalization_with_the_dequantized_table(bits):
    rng = np.random.default_rng(1)
    h = 128
    word = (rng.standard_normal((V, h)) * 0.05).astype(np.float32)
    w1, w2 = representable(rng, h, h, 128, bits), representable(rng, h, h, 128, bits)  # stored exactly
    proto = bert_embeddings(word, w1, w2)
    feeds = _feeds(rng)
    model = to_ir(proto)
    result = WeightOnlyPass(algorithm="rtn", bits=bits, embedding_precision="bits").call(model)
    assert result.stats["quantized.embeddings"] == 1 and result.stats["expanded.embed_layernorm"] == 1
    gbq = model.graph.node(0)
    data, scales, zp = (gbq.inputs[i].const_value.numpy() for i in (0, 2, 3))
    table = dequantize_table(data, scales, zp, h, bits)
    step = np.repeat(scales, 128, axis=1)
    assert np.all(np.abs(table - word) <= step * 0.5001 + 1e-7)  # RTN: within half a step of each block
    lower_model(model, "ort", registry=get_registry())
    assert op_types(model) == ["com.microsoft.GatherBlockQuantized", "Gather", "Gather", "Add", "Add",
                               "LayerNormalization", "com.microsoft.MatMulNBits", "MatMul"]
    got = run_ort(to_proto(model), feeds)[0]
    # the reference: the fused float model with the dequantized word table, lowered to ONNX Runtime's
    # EmbedLayerNormalization (the MatMul weights are stored exactly)
    ref = to_ir(proto)
    ref.graph.initializers["word"].const_value = ir.tensor(table.astype(np.float32), name="word")
    lower_model(ref, "ort", registry=get_registry())
    assert "com.microsoft.EmbedLayerNormalization" in op_types(ref)
    assert_close(run_ort(to_proto(ref), feeds), [got], 1e-5)
    # and within the quantization error of the float model
    float_out = run_ort(proto, feeds)[0]
    cos = float(np.sum(got * float_out) / np.linalg.norm(got) / np.linalg.norm(float_out))
    assert cos > 0.99 if bits == 4 else cos > 0.9999


def test_float_precision_keeps_the_fused_node():
    rng = np.random.default_rng(2)
    word, w1, w2 = _representable(rng, 64, 64)
    model = to_ir(bert_embeddings(word, w1, w2))
    result = WeightOnlyPass(algorithm="rtn", block_size=64).call(model)
    assert result.stats == {"quantized": 1, "kept_float": 1, "quantized.int4": 1}
    assert op_types(model)[0] == "mograph.EmbedLayerNorm" and "word" in model.graph.initializers
    lower_model(model, "ort", registry=get_registry())
    assert "com.microsoft.EmbedLayerNormalization" in op_types(model)


def test_hidden_size_not_a_multiple_of_the_block_keeps_the_fused_node():
    rng = np.random.default_rng(3)
    word, w1, w2 = _representable(rng, 64, 64)
    model = to_ir(bert_embeddings(word, w1, w2))
    result = WeightOnlyPass(algorithm="rtn", block_size=128, embedding_precision="bits").call(model)
    assert "expanded.embed_layernorm" not in result.stats and "quantized.embeddings" not in result.stats
    assert op_types(model)[0] == "mograph.EmbedLayerNorm"


def test_plan_entry_of_the_word_gather_expands_and_decides():
    rng = np.random.default_rng(4)
    word, w1, w2 = _representable(rng, 64, 64)
    proto = bert_embeddings(word, w1, w2)
    name = next(n.name for n in proto.graph.node if n.op_type == "EmbedLayerNorm")
    plan = {"pass": "weight-only", "nodes": [{"node": f"{name}/word", "precision": "int8", "reason": "edited"},
                                             {"node": f"{name}/position", "precision": "int8", "reason": "edited"}]}
    result = WeightOnlyPass(algorithm="rtn", block_size=64, precision_plan=plan).call(model := to_ir(proto))
    assert result.stats["expanded.embed_layernorm"] == 1 and result.stats["quantized.embeddings"] == 2
    gathers = {n.name: n for n in model.graph if n.op_type.endswith("Gather")}
    assert gathers[f"{name}/word"].op_type == "BlockQuantizedGather" and gathers[f"{name}/word"].attributes["bits"].as_int() == 8
    assert gathers[f"{name}/position"].op_type == "BlockQuantizedGather"  # the plan quantizes a small table too
    assert gathers[f"{name}/segment"].op_type == "Gather"
    assert _plan(result)[f"{name}/word"]["reason"].startswith("from plan")


def test_word_table_tied_to_the_head_is_shared_or_left_fused():
    rng = np.random.default_rng(5)
    word, w1, w2 = _representable(rng, 64, 64)
    proto = bert_embeddings(word, w1, w2, tied_head=True)
    feeds = _feeds(rng)
    # the head float (default rule): the table is its own weight, a quantized copy would add size: node left fused
    result = WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits").call(model := to_ir(proto))
    assert "expanded.embed_layernorm" not in result.stats and op_types(model)[0] == "mograph.EmbedLayerNorm"
    # the head quantized: the Gather and the head share one copy of the codes, scales and zero points
    model = check_pass(WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits", output_projection="bits"),
                       proto, stats={"quantized": 3, "kept_float": 0, "quantized.int4": 3, "quantized.embeddings": 1,
                                     "embeddings.shared_with_head": 1, "expanded.embed_layernorm": 1}, feeds=feeds)
    gather, head = model.graph.node(0), next(n for n in model.graph if n.name == "lm_head")
    assert gather.op_type == "BlockQuantizedGather" and gather.inputs[0] is head.inputs[1]
    assert "word" not in model.graph.initializers


@pytest.mark.parametrize("buffered", [False, True])
def test_two_tables_expand_without_a_segment_lookup(buffered):
    """A fused layer of two lookups (word + position: DistilBERT) expands to two Gathers and one Add: its neutral
    segment lookup (negative zeros, one id) is neither a Gather nor folded into the position table, and goes."""
    rng = np.random.default_rng(8)
    word, w1, w2 = _representable(rng, 64, 64)
    proto = bert_embeddings(word, w1, w2, buffered=buffered, two_tables=True)
    (node,) = [n for n in proto.graph.node if n.op_type == "EmbedLayerNorm"]
    assert node.input[1] == "mograph_no_segment_ids" and node.input[4] == "mograph_no_segment"
    feeds = _feeds(rng, two_tables=True) if not buffered else {"input_ids": rng.integers(0, V, (3, 7)).astype(np.int64)}
    stats = {"quantized": 1, "kept_float": 1, "quantized.int4": 1, "quantized.embeddings": 1,
             "expanded.embed_layernorm": 1}
    ops = ["mograph.BlockQuantizedGather", "Gather", "Add", "mograph.LayerNorm", "mograph.WeightOnlyMatMul", "MatMul"]
    if buffered:  # the position rows sliced from the table (no host ids read by a Gather)
        stats["embeddings.positions_sliced"] = 1
        ops = ["Shape", "Slice", "mograph.BlockQuantizedGather", "Unsqueeze", *ops[2:]]
    model = check_pass(WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits"), proto,
                       stats=stats, ops_left=ops, feeds=feeds)
    assert not any(n.metadata_props.get(SMALL_TABLE) == "segment" for n in model.graph)
    assert {"mograph_no_segment", "mograph_no_segment_ids"}.isdisjoint(model.graph.initializers)
    assert "pos" in model.graph.initializers  # the position table itself, no folded copy
