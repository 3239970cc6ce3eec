"""weight-only ``--embedding-precision``: embedding tables as ``mograph.BlockQuantizedGather`` (blocks along the
hidden axis), lowered to ONNX Runtime's ``GatherBlockQuantized``; a table tied to the LM head shares its data."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import WeightOnlyPass
from mograph.passes.quant.gather_block_op import dequantize_table, reference
from mograph.passes.quant.recipe import EMBEDDINGS, PLACEMENT, resolve
from onnx import helper, numpy_helper
from test_weight_only import representable

from mograph.lowering import lower_model
from mograph.plugins import get_registry
from mograph.testing import assert_untouched, check_pass, op_types, run_ort, to_ir, to_proto

V, H = 300, 256


def lm(table: np.ndarray, w1: np.ndarray, head: np.ndarray | None, *, tied: str = "untied") -> onnx.ModelProto:
    """``Gather(E, ids) -> MatMul(W1) -> LM head``; ``tied``: ``untied`` (head weight ``head``), ``copy`` (an equal
    copy of ``E^T``, as TorchScript writes a tied head), ``same`` (``Gemm(transB=1)`` reading ``E`` itself)."""
    v, h = table.shape
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"], name="embed"),
             helper.make_node("MatMul", ["x", "W1"], ["hid"], name="mlp")]
    inits = [numpy_helper.from_array(table, "E"), numpy_helper.from_array(w1, "W1")]
    if tied == "same":
        nodes += [helper.make_node("Reshape", ["hid", "flat"], ["hid2"]),
                  helper.make_node("Gemm", ["hid2", "E"], ["logits"], transB=1, name="lm_head")]
        inits.append(numpy_helper.from_array(np.array([-1, h], np.int64), "flat"))
        out = helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", v])
    else:
        w = np.ascontiguousarray(table.T) if tied == "copy" else head
        assert w is not None
        inits.append(numpy_helper.from_array(w, "Whead"))
        nodes.append(helper.make_node("MatMul", ["hid", "Whead"], ["logits"], name="lm_head"))
        out = helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["B", "S", v])
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["B", "S"])],
                              [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    return model


def _feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(0, V, (2, 5)).astype(np.int64)}


def _weights(rng: np.random.Generator, bits: int = 4, bs: int = 128) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A table every (row, block) of which RTN stores exactly, and two representable weights."""
    table = np.ascontiguousarray(representable(rng, H, V, bs, bits).T)
    return table, representable(rng, H, H, bs, bits), representable(rng, H, V, bs, bits)


def test_five_checks_untied_table_quantized():
    rng = np.random.default_rng(0)
    table, w1, head = _weights(rng)
    proto = lm(table, w1, head)
    # exactly representable: the quantized model computes what the float one does
    model = check_pass(WeightOnlyPass(algorithm="rtn", embedding_precision="bits"), proto,
                       stats={"quantized": 1, "kept_float": 1, "quantized.int4": 1, "quantized.embeddings": 1},
                       ops_left=["mograph.BlockQuantizedGather", "mograph.WeightOnlyMatMul", "MatMul"],
                       feeds=_feeds(rng))
    data = model.graph.node(0).inputs[0].const_value
    assert data.dtype == ir.DataType.UINT8 and data.nbytes == V * H // 2  # 4 bits a weight
    assert "E" not in model.graph.initializers  # the float table is gone
    plan = {e["node"]: e for e in WeightOnlyPass(algorithm="rtn", embedding_precision="bits").call(
        to_ir(proto)).details["plan"]["nodes"]}
    assert plan["embed"]["precision"] == "int4" and "hidden axis" in plan["embed"]["reason"]


def test_default_keeps_the_table_float_and_a_non_gather_reader_is_left_alone():
    rng = np.random.default_rng(1)
    table, w1, head = _weights(rng)
    result = WeightOnlyPass(algorithm="rtn").call(model := to_ir(lm(table, w1, head)))
    assert "quantized.embeddings" not in result.stats and op_types(model)[0] == "Gather"
    # near miss: the table is also read by an Add (not an embedding table); nothing else to quantize either
    g = helper.make_graph([helper.make_node("Gather", ["E", "ids"], ["x"]), helper.make_node("Add", ["x", "E"], ["y"])],
                          "g", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [V])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [V, H])],
                          [numpy_helper.from_array(table, "E")])
    assert_untouched(WeightOnlyPass(algorithm="rtn", embedding_precision="bits"),
                     helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


@pytest.mark.parametrize("bits,symmetric", [(4, False), (4, True), (8, False), (8, True)])
def test_ort_lowering_matches_the_function_body_and_the_reference(bits, symmetric):
    rng = np.random.default_rng(2)
    table = (rng.standard_normal((V, H)) * 0.05).astype(np.float32)
    proto = lm(table, (rng.standard_normal((H, H)) * 0.05).astype(np.float32),
               (rng.standard_normal((H, V)) * 0.05).astype(np.float32))
    model = to_ir(proto)
    WeightOnlyPass(algorithm="rtn", bits=bits, symmetric=symmetric, block_size=64, embedding_precision="bits").call(model)
    feeds = _feeds(rng)
    canonical = run_ort(to_proto(model), feeds)[0]
    node = model.graph.node(0)
    data, scales, zp = (node.inputs[i].const_value.numpy() for i in (0, 2, 3))
    attrs = {k: a.as_int() for k, a in node.attributes.items()}
    # the numpy reference is the dequantized table's rows; RTN error within half a step of each block
    ids = feeds["input_ids"]
    np.testing.assert_array_equal(reference(data, ids, scales, zp, **attrs)[0],
                                  dequantize_table(data, scales, zp, H, bits)[ids])
    step = np.repeat(scales, 64, axis=1)
    assert np.all(np.abs(dequantize_table(data, scales, zp, H, bits) - table) <= step * 0.5001 + 1e-7)
    m = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    result = lower_model(m, "ort", registry=get_registry())
    assert result.stats["lowered.BlockQuantizedGather"] == 1
    assert result.stats["gather_block.symmetric" if symmetric else "gather_block.asymmetric"] == 1
    assert op_types(m) == ["com.microsoft.GatherBlockQuantized", "com.microsoft.MatMulNBits", "MatMul"]
    gbq = m.graph.node(0)
    assert len(gbq.inputs) == (3 if symmetric else 4) and gbq.inputs[0].const_value.shape == (V, H * bits // 8)
    np.testing.assert_allclose(run_ort(to_proto(m), feeds)[0], canonical, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", ["same", "copy"])
def test_tied_head_shares_the_quantized_data(tied):
    rng = np.random.default_rng(3)
    table, w1, _ = _weights(rng)
    proto = lm(table, w1, None, tied=tied)
    feeds = _feeds(rng)
    ref = run_ort(proto, feeds)[0]
    model = to_ir(proto)
    result = WeightOnlyPass(algorithm="rtn", embedding_precision="bits", output_projection="bits").call(model)
    assert result.stats["quantized.embeddings"] == 1 and result.stats["embeddings.shared_with_head"] == 1
    gather, head = model.graph.node(0), [n for n in model.graph if n.name == "lm_head"][0]
    assert gather.inputs[0] is head.inputs[1] and gather.inputs[2] is head.inputs[2]  # one copy of codes and scales
    assert "E" not in model.graph.initializers and "Whead" not in model.graph.initializers
    np.testing.assert_allclose(run_ort(to_proto(model), feeds)[0], ref, rtol=1e-4, atol=1e-5)
    lower_model(model, "ort", registry=get_registry())
    ops = op_types(model)
    assert "com.microsoft.GatherBlockQuantized" in ops and ops.count("com.microsoft.MatMulNBits") == 2
    codes = [v for v in model.graph.initializers.values() if v.const_value.dtype == ir.DataType.UINT8
             and v.const_value.nbytes == V * H // 2]
    assert len(codes) == 1  # the lowered file holds the table's codes once (the Gather reads them reshaped)
    np.testing.assert_allclose(run_ort(to_proto(model), feeds)[0], ref, rtol=1e-4, atol=1e-5)


def test_table_that_is_the_float_heads_own_weight_stays_float():
    rng = np.random.default_rng(4)
    table, w1, _ = _weights(rng)
    result = WeightOnlyPass(algorithm="rtn", embedding_precision="bits").call(model := to_ir(lm(table, w1, None, tied="same")))
    assert "quantized.embeddings" not in result.stats and op_types(model)[0] == "Gather"
    entry = next(e for e in result.details["plan"]["nodes"] if e["node"] == "embed")
    assert entry["precision"] == "float" and "would add size" in entry["reason"]


def test_cuda_recipe_quantizes_embeddings_and_says_speed_is_not_measured():
    assert resolve(["int4"], {}, "cuda").options["embedding_precision"] == "bits"
    assert resolve(["int4"], {"embedding_precision": "float"}, "cuda").options["embedding_precision"] == "float"
    assert "embedding_precision" not in resolve(["int4"], {}, "cpu").options
    assert "GPU speed: not measured" in PLACEMENT["cuda"]["embeddings"][1]
    table = EMBEDDINGS["cuda"]
    assert table["size"] == "measured" and table["gpu_speed"] == "not measured" and table["command"]
    b = table["bytes"]
    assert b[("untied", "bits", "float")] < b[("untied", "float", "float")]
    assert b[("tied", "bits", "bits")] < b[("tied", "bits", "float")] < b[("tied", "float", "float")]


def test_plan_entry_of_the_gather_decides():
    rng = np.random.default_rng(5)
    table, w1, head = _weights(rng, bits=8)
    plan = {"pass": "weight-only", "nodes": [{"node": "embed", "precision": "int8", "reason": "edited"}]}
    result = WeightOnlyPass(algorithm="rtn", precision_plan=plan).call(model := to_ir(lm(table, w1, head)))
    assert result.stats["quantized.embeddings"] == 1
    node = model.graph.node(0)
    assert node.op_type == "BlockQuantizedGather" and node.attributes["bits"].as_int() == 8
    entry = next(e for e in result.details["plan"]["nodes"] if e["node"] == "embed")
    assert entry["precision"] == "int8" and entry["reason"].startswith("from plan")


def test_hidden_size_not_a_multiple_of_the_block_stays_float():
    rng = np.random.default_rng(6)
    table = (rng.standard_normal((V, 200)) * 0.05).astype(np.float32)
    proto = lm(table, (rng.standard_normal((200, 200)) * 0.05).astype(np.float32),
               (rng.standard_normal((200, V)) * 0.05).astype(np.float32))
    result = WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits").call(model := to_ir(proto))
    assert "quantized.embeddings" not in result.stats and op_types(model)[0] == "Gather"
    entry = next(e for e in result.details["plan"]["nodes"] if e["node"] == "embed")
    assert entry["precision"] == "float" and "not a multiple of --block-size" in entry["reason"]


def test_function_body_dequantizes_only_the_gathered_rows():
    """The body (what ONNX Runtime runs before the ``ort`` lowering, e.g. in the fp16 pass's measuring sessions)
    gathers the rows first: it once dequantized the whole table at every run (4.7 GB on Gemma 3's table)."""
    from mograph.passes.quant.gather_block_op import function_body

    body = function_body(18)
    data = body.inputs[0]
    assert [(u.node.op_type, u.idx) for u in data.uses()] == [("Gather", 0)]  # the packed codes: only gathered
    for v in body.inputs[2:]:
        assert [u.node.op_type for u in v.uses()] == ["Gather", "CastLike"] if v.name == "scales" \
            else [u.node.op_type for u in v.uses()] == ["Gather"]
    rng = np.random.default_rng(5)
    table = (rng.standard_normal((V, H)) * 0.05).astype(np.float32)
    model = to_ir(lm(table, (rng.standard_normal((H, H)) * 0.05).astype(np.float32), None, tied="copy"))
    WeightOnlyPass(algorithm="rtn", block_size=64, embedding_precision="bits", output_projection="bits").call(model)
    node = model.graph.node(0)
    data_, scales, zp = (node.inputs[i].const_value.numpy() for i in (0, 2, 3))
    # any shape of ids, negative ones too (Gather counts them from the end): the body equals the reference
    ids = np.array([[[0, V - 1, -1], [7, -V, 3]]], np.int64)
    want = reference(data_, ids % V, scales, zp, K=H, bits=4, block_size=64)[0]
    proto = to_proto(model)  # its functions and initializers; one node reading 3-D ids
    proto.graph.ClearField("node")
    proto.graph.ClearField("input")
    proto.graph.input.extend([helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, None)])
    proto.graph.node.extend([helper.make_node("BlockQuantizedGather", [node.inputs[0].name, "input_ids",
                                              node.inputs[2].name, node.inputs[3].name], ["y"], domain="mograph",
                                              K=H, bits=4, block_size=64)])
    proto.graph.ClearField("output")
    proto.graph.output.extend([helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    got = run_ort(proto, {"input_ids": ids})[0]
    assert got.shape == (1, 2, 3, H)
    np.testing.assert_array_equal(got, want)


def test_random_feeds_index_a_block_quantized_table_within_its_rows():
    """Random calibration and verification feeds bound token ids by the embedding table's rows.  A table
    made ``mograph.BlockQuantizedGather`` by weight-only (the ``cuda`` recipe, ``int4 --device cuda``, then
    calibrates fp16 on it) was not recognised: ids up to 100 into a 32-row table (g2p-id's BERT) and the
    model refused its random calibration feed (exit 2).  Its ONNX Runtime lowering counts too."""
    from mograph.passes.quant.calibration import RandomSource

    from mograph.validate import make_feeds

    rng = np.random.default_rng(0)
    table, w1, head = _weights(rng)
    rows = 32
    proto = lm(np.ascontiguousarray(table[:rows]), w1, head)
    before = to_ir(proto)
    assert max(int(f["input_ids"].max()) for f in RandomSource(before, 8, {"input_ids": (2, 64)})) < rows
    for target in (None, "ort"):
        model = to_ir(proto)
        WeightOnlyPass(algorithm="rtn", embedding_precision="bits").call(model)
        if target:
            lower_model(model, target, registry=get_registry())
        kinds = {(n.domain, n.op_type) for n in model.graph}
        assert (("mograph", "BlockQuantizedGather") if target is None else ("com.microsoft", "GatherBlockQuantized")) in kinds
        feeds = list(RandomSource(model, 8, {"input_ids": (2, 64)}))
        ids = np.concatenate([f["input_ids"].ravel() for f in feeds])
        assert ids.max() < rows and ids.max() >= rows // 2  # the whole table's range, not a guess below it
        verify_ids = make_feeds(model, shapes={"input_ids": (2, 64)})[0]["input_ids"]
        assert 0 <= verify_ids.min() and rows // 2 <= verify_ids.max() < rows  # not "unknown use: 0..7"
        want = run_ort(proto, feeds[0])[0]
        np.testing.assert_allclose(run_ort(to_proto(model), feeds[0])[0], want, rtol=1e-4, atol=1e-3)
