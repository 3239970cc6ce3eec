"""Weight-only encoders (BERT): the quantized Q/K/V of each ``MultiHeadAttention`` lowered to ONE ``MatMulNBits``, a
``Split`` and the three biases in the kernel's ``bias`` input, with the numbers of the three separate nodes (ONNX
Runtime CPU, optimizations off, feeds with right, left and full padding); near misses keep their three nodes, counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import mograph.passes.fusion.lowerings.attention as attention_lowering
import numpy as np
import onnx
import onnx_ir as ir
import pytest

import mograph
from models.builders import bert_feeds, bert_tiny
from mograph.lowering import lower_model
from mograph.plugins import get_registry
from mograph.testing import run_ort, to_ir, to_proto

pytest.importorskip("onnxruntime")

LAYERS = 2
Q0 = "/encoder/layer.0/attention/self/query/MatMul"


def feeds() -> dict[str, np.ndarray]:
    """Right padding, a fully padded row and left padding: the masked softmax is exercised."""
    f = bert_feeds(4, 16)
    mask = np.ones((4, 16), dtype=np.int64)
    mask[1, 5:] = 0
    mask[2, :] = 0
    mask[3, :3] = 0
    f["attention_mask"] = mask
    return f


def build(pack: bool, monkeypatch: pytest.MonkeyPatch, device: str | None = None, passes: str = "weight-only",
          **options: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """``cleanup,fuse,<passes> --target ort`` of bert_tiny (RTN); ``pack=False``: the same with the packing switched off
    (the reference: three MatMulNBits and three bias Adds per attention)."""
    opts: dict[str, Any] = {"target": "ort", "algorithm": "rtn", **options}
    if device == "cuda":
        opts.update(fp16_io=True, accuracy_budget="off", calibration_data=[bert_feeds(2, 8, seed=5)])
    with monkeypatch.context() as mp:
        if not pack:
            mp.setattr(attention_lowering, "pack_nbits_qkv", lambda *args, **kwargs: None)
        model, report = mograph.optimize(bert_tiny(batch=4), passes=["cleanup", "fuse", passes], options=opts,
                                         device=device)
    lower = next(p for p in report.passes if p.name == "lower")
    return model, dict(lower.stats)


def ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def qkv_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if "qkv" in k}


@pytest.mark.parametrize(("device", "options", "rel"), [
    (None, {"bits": 8}, 1e-6), (None, {"bits": 4, "block_size": 32}, 1e-6),
    (None, {"bits": 8, "symmetric": True}, 1e-6),
    ("cuda", {}, 1e-3),  # the GPU int8 recipe (weight-only 8-bit, then fp16, float16 IO), run on the CPU provider
], ids=["int8", "int4-block32", "int8-symmetric", "cuda-recipe"])
def test_encoder_packs_qkv_with_the_numbers_of_three(monkeypatch: pytest.MonkeyPatch, device: str | None,
                                                     options: dict[str, Any], rel: float) -> None:
    passes = "int8" if device == "cuda" else "weight-only"
    packed, stats = build(True, monkeypatch, device, passes, **options)
    separate, stats_separate = build(False, monkeypatch, device, passes, **options)
    # per layer one packed QKV node instead of three; its Split; the three bias Adds gone into the kernel
    assert ops(separate)["MatMulNBits"] - ops(packed)["MatMulNBits"] == 2 * LAYERS
    assert ops(separate)["MatMulNBits"] == ops(packed)["MatMulNBits"] + 2 * LAYERS
    assert ops(packed)["Split"] == LAYERS and ops(separate)["Split"] == 0
    assert ops(separate)["Add"] - ops(packed)["Add"] == 3 * LAYERS
    # the rest is the same, but the bias expansion's Shape read: of the layer input, not of each layer's query
    assert (ops(packed) - Counter({"Split": LAYERS, "Constant": 1, "Shape": 99})
            == ops(separate) - Counter({"MatMulNBits": 2 * LAYERS, "Add": 3 * LAYERS, "Shape": 99}))
    assert ops(packed)["Shape"] <= ops(separate)["Shape"]
    assert ops(packed)["MultiHeadAttention"] == LAYERS and ops(packed)["MatMul"] == ops(separate)["MatMul"]
    assert qkv_stats(stats) == {"attention.packed_qkv": LAYERS, "attention.packed_qkv.nbits": LAYERS,
                                "attention.qkv_bias": LAYERS}
    assert qkv_stats(stats_separate) == {}
    producers = {o: n for n in packed.graph.node for o in n.output}
    for mha in (n for n in packed.graph.node if n.op_type == "MultiHeadAttention"):
        split = producers[mha.input[0]]
        assert split.op_type == "Split" and list(mha.input[:3]) == list(split.output)
        nbits = producers[split.input[0]]
        assert nbits.op_type == "MatMulNBits"
        n = next(a.i for a in nbits.attribute if a.name == "N")
        k = next(a.i for a in nbits.attribute if a.name == "K")
        assert n == 3 * k  # [W_q | W_k | W_v]
        assert mha.input[3] in {i.name for i in packed.graph.initializer}  # [b_q | b_k | b_v]
    f = feeds()
    got, ref = run_ort(packed, f)[0], run_ort(separate, f)[0]
    assert got.shape == ref.shape and np.isfinite(ref).all()
    diff = float(np.abs(got.astype(np.float64) - ref).max())
    assert diff <= rel * max(float(np.abs(ref).max()), 1.0), diff
    # lowering the lowered model again finds nothing to do
    assert lower_model(to_ir(packed), "ort", registry=get_registry()).modified is False


@pytest.mark.parametrize("mask_format", ["raw", "lengths"])
def test_packed_qkv_with_a_key_padding_mask(monkeypatch: pytest.MonkeyPatch, mask_format: str) -> None:
    """The mask as MultiHeadAttention's key_padding_mask (2-D raw mask or 1-D lengths) next to the packed Q/K/V and
    the bias input: the numbers of the unpacked form (right-padded feeds: what ``lengths`` promises)."""
    packed, stats = build(True, monkeypatch, bits=8, mask_format=mask_format)
    separate, _ = build(False, monkeypatch, bits=8, mask_format=mask_format)
    assert qkv_stats(stats)["attention.packed_qkv.nbits"] == LAYERS
    for mha in (n for n in packed.graph.node if n.op_type == "MultiHeadAttention"):
        assert mha.input[3] and mha.input[4]  # bias and key_padding_mask
    f = bert_feeds(4, 16)
    f["attention_mask"] = np.ones((4, 16), dtype=np.int64)
    for row in range(1, 4):
        f["attention_mask"][row, 16 - 3 * row:] = 0
    got, ref = run_ort(packed, f)[0], run_ort(separate, f)[0]
    assert float(np.abs(got - ref).max()) <= 1e-6 * max(float(np.abs(ref).max()), 1.0)


@pytest.mark.parametrize(("precision", "why"), [("int4", "mixed_precision"), ("float", "mixed_precision")])
def test_layer_with_a_different_precision_keeps_three(monkeypatch: pytest.MonkeyPatch, precision: str,
                                                      why: str) -> None:
    """The plan gives layer 0's query another precision: layer 0 keeps its three projections (counted), layer 1 is
    packed; the numbers still are the unpacked model's."""
    plan = {"nodes": [{"node": Q0, "precision": precision}]}
    packed, stats = build(True, monkeypatch, bits=8, precision_plan=plan)
    separate, _ = build(False, monkeypatch, bits=8, precision_plan=plan)
    assert qkv_stats(stats) == {"attention.packed_qkv": 1, "attention.packed_qkv.nbits": 1, "attention.qkv_bias": 1,
                                f"attention.unpacked_qkv.{why}": 1}
    assert ops(separate)["MatMulNBits"] - ops(packed)["MatMulNBits"] == 2 and ops(packed)["Split"] == 1
    names = {n.name for n in packed.graph.node}
    assert Q0 in names and Q0.replace("query", "key") in names  # layer 0's own projections are still there
    f = feeds()
    got, ref = run_ort(packed, f)[0], run_ort(separate, f)[0]
    assert float(np.abs(got - ref).max()) <= 1e-6 * max(float(np.abs(ref).max()), 1.0)


def mixed_blocks() -> onnx.ModelProto:
    """bert_tiny fused and weight-only quantized (4-bit, blocks of 32, canonical ops), with layer 0's value projection
    taken from the same model quantized in blocks of 16 (as another block size for one node would write it)."""
    def quantized(block: int) -> onnx.ModelProto:
        model, _ = mograph.optimize(bert_tiny(batch=4), passes=["cleanup", "fuse", "weight-only"],
                                    options={"target": "mograph", "algorithm": "rtn", "bits": 4, "block_size": block})
        return model

    model, other = quantized(32), quantized(16)
    v0 = Q0.replace("query", "value")
    (node,) = [n for n in model.graph.node if n.name == v0]
    (node16,) = [n for n in other.graph.node if n.name == v0]
    swap = {i: next(t for t in other.graph.initializer if t.name == i) for i in node16.input[1:] if i}
    for i, t in enumerate(model.graph.initializer):
        if t.name in swap:
            model.graph.initializer[i].CopyFrom(swap[t.name])
    assert set(swap) <= set(node.input)
    next(a for a in node.attribute if a.name == "block_size").i = 16
    return model


def test_different_block_sizes_keep_three(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0's value projection in blocks of 16 next to blocks of 32: layer 0 not packed (counted), layer 1 packed; the
    numbers are the unpacked lowering's."""
    model = to_ir(mixed_blocks())
    result = lower_model(model, "ort", registry=get_registry())
    assert result.modified
    assert qkv_stats(result.stats) == {"attention.packed_qkv": 1, "attention.packed_qkv.nbits": 1,
                                       "attention.qkv_bias": 1, "attention.unpacked_qkv.block_size": 1}
    reference = to_ir(mixed_blocks())
    with monkeypatch.context() as mp:
        mp.setattr(attention_lowering, "pack_nbits_qkv", lambda *args, **kwargs: None)
        assert lower_model(reference, "ort", registry=get_registry()).modified
    packed, separate = to_proto(model), to_proto(reference)
    assert ops(packed)["Split"] == 1 and ops(separate)["MatMulNBits"] - ops(packed)["MatMulNBits"] == 2
    blocks = {n.name: next(a.i for a in n.attribute if a.name == "block_size") for n in packed.graph.node
              if n.op_type == "MatMulNBits"}
    assert blocks[Q0.replace("query", "value")] == 16 and blocks[Q0] == 32  # layer 0's three are still there
    f = feeds()
    got, ref = run_ort(packed, f)[0], run_ort(separate, f)[0]
    assert float(np.abs(got - ref).max()) <= 1e-6 * max(float(np.abs(ref).max()), 1.0)


def test_projection_read_elsewhere_keeps_three(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0's query (after its bias) is also a graph output: its projections stay (counted ``other``), layer 1 is
    packed; the numbers (both outputs) are the unpacked lowering's."""
    def canonical() -> ir.Model:
        model, _ = mograph.optimize(bert_tiny(batch=4), passes=["cleanup", "fuse", "weight-only"],
                                    options={"target": "mograph", "algorithm": "rtn", "bits": 8})
        (att,) = [n for n in model.graph.node if n.op_type == "Attention" and n.name == "AttentionFusion_0"]
        model.graph.output.append(onnx.helper.make_tensor_value_info(att.input[0], onnx.TensorProto.FLOAT, None))
        return to_ir(model)

    model, reference = canonical(), canonical()
    result = lower_model(model, "ort", registry=get_registry())
    assert qkv_stats(result.stats) == {"attention.packed_qkv": 1, "attention.packed_qkv.nbits": 1,
                                       "attention.qkv_bias": 1, "attention.unpacked_qkv.other": 1}
    with monkeypatch.context() as mp:
        mp.setattr(attention_lowering, "pack_nbits_qkv", lambda *args, **kwargs: None)
        lower_model(reference, "ort", registry=get_registry())
    packed, separate = to_proto(model), to_proto(reference)
    assert ops(packed)["Split"] == 1 and ops(separate)["MatMulNBits"] - ops(packed)["MatMulNBits"] == 2
    f = feeds()
    for got, ref in zip(run_ort(packed, f), run_ort(separate, f)):
        assert float(np.abs(got - ref).max()) <= 1e-6 * max(float(np.abs(ref).max()), 1.0)


def test_projections_without_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0's three projections without their bias Add (no ``bias`` input then), layer 1's key without it (zeros in
    its part of ``[b_q | b_k | b_v]``, as Whisper's k_proj): both packed, with the unpacked lowering's numbers."""
    def canonical() -> ir.Model:
        model, _ = mograph.optimize(bert_tiny(batch=4), passes=["cleanup", "fuse", "weight-only"],
                                    options={"target": "mograph", "algorithm": "rtn", "bits": 8})
        producers = {o: n for n in model.graph.node for o in n.output}
        for att in (n for n in model.graph.node if n.op_type == "Attention"):
            for i in (0, 1, 2) if att.name == "AttentionFusion_0" else (1,):
                add = producers[att.input[i]]
                assert add.op_type == "Add"
                att.input[i] = next(x for x in add.input if x in producers)  # the projection before its bias
                model.graph.node.remove(add)
        return to_ir(model)

    model, reference = canonical(), canonical()
    result = lower_model(model, "ort", registry=get_registry())
    assert qkv_stats(result.stats) == {"attention.packed_qkv": 2, "attention.packed_qkv.nbits": 2,
                                       "attention.qkv_bias": 1}
    with monkeypatch.context() as mp:
        mp.setattr(attention_lowering, "pack_nbits_qkv", lambda *args, **kwargs: None)
        lower_model(reference, "ort", registry=get_registry())
    packed, separate = to_proto(model), to_proto(reference)
    assert ops(packed)["Split"] == 2 and ops(separate)["MatMulNBits"] - ops(packed)["MatMulNBits"] == 4
    mha = {n.name: n for n in packed.graph.node if n.op_type == "MultiHeadAttention"}
    assert len(mha["AttentionFusion_0"].input) < 4 or not mha["AttentionFusion_0"].input[3]  # no bias input
    bias = next(t for t in packed.graph.initializer if t.name == mha["AttentionFusion_1"].input[3])
    b = onnx.numpy_helper.to_array(bias)
    assert b.shape == (3 * 64,) and not b[64:128].any() and b[:64].any() and b[128:].any()
    f = feeds()
    got, ref = run_ort(packed, f)[0], run_ort(separate, f)[0]
    assert float(np.abs(got - ref).max()) <= 1e-6 * max(float(np.abs(ref).max()), 1.0)
