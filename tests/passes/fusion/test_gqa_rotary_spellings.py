"""The rotary angle table spelled as an outer product (transformers 5.17's LLaMA rotary, as the H200's image exports it):
``Transpose(MatMul(Expand(inv_freq[1, D/2, 1], [B, D/2, 1]), positions[B, 1, S]), perm=[0, 2, 1])`` instead of
``Mul(positions[B, S, 1], inv_freq[D/2])``.  Before the fix every ``--kv-cache shared`` decode step of such an export
failed in ``lower`` ("the rotary angles are not provably (past + s) * inv_freq").

The test rewrites today's export into that spelling (the values are the same: checked first on ORT CPU), so it does
not need the old transformers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

import mograph  # noqa: E402
from models import decoder_export as de  # noqa: E402

pytestmark = pytest.mark.slow

CFG = {"hidden": 128, "heads": 4, "kv_heads": 2}


def _outer_product_rotary(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace the (one) ``Mul(Cast(pos)[.., S, 1], inv_freq[D/2])`` feeding the rotary Concat by the 5.17 form."""
    g = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in g.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    consts.update(inits)
    producer = {o: n for n in g.node for o in n.output}
    cos = next(n for n in g.node if n.op_type == "Cos")
    concat = producer[cos.input[0]]
    mul = producer[concat.input[0]]
    assert mul.op_type == "Mul", mul.op_type
    data, inv_name = (mul.input[0], mul.input[1]) if mul.input[1] in consts else (mul.input[1], mul.input[0])
    inv = consts[inv_name]
    assert inv.ndim == 1
    cast = producer[data]  # Cast(Unsqueeze(pos[B, S], -1)) -> [B, S, 1]
    unsq = producer[cast.input[0]]
    assert cast.op_type == "Cast" and unsq.op_type == "Unsqueeze", (cast.op_type, unsq.op_type)
    new = [
        helper.make_node("Unsqueeze", [unsq.input[0], "rot_axis"], ["pos_u"], name="rot_unsqueeze"),  # [B, 1, S]
        helper.make_node("Cast", ["pos_u"], ["pos_t"], to=onnx.TensorProto.FLOAT, name="rot_cast"),
        helper.make_node("Shape", ["pos_u"], ["pos_shape"], start=0, end=1, name="rot_b"),
        helper.make_node("Concat", ["pos_shape", "rot_tail"], ["inv_shape"], axis=0, name="rot_shape"),
        helper.make_node("Expand", ["rot_inv", "inv_shape"], ["inv_b"], name="rot_expand"),  # [B, D/2, 1]
        helper.make_node("MatMul", ["inv_b", "pos_t"], ["angles_t"], name="rot_matmul"),  # [B, D/2, S]
        helper.make_node("Transpose", ["angles_t"], [mul.output[0]], perm=[0, 2, 1], name="rot_transpose"),
    ]
    g.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), "rot_axis")])
    g.initializer.extend([numpy_helper.from_array(inv.reshape(1, -1, 1).astype(np.float32), "rot_inv"),
                          numpy_helper.from_array(np.array([inv.size, 1], np.int64), "rot_tail")])
    at = list(g.node).index(mul)
    g.node.remove(mul)
    for k, node in enumerate(new):
        g.node.insert(at + k, node)
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("mask_format", ["lengths", "shared"])
def test_outer_product_rotary_decode_becomes_gqa(tmp_path: Path, mask_format: str) -> None:
    cfg = de.config("llama", **CFG)
    path = de.export(cfg, "decode", "torchscript", tmp_path / "decode.onnx")
    feeds = de.feeds(cfg, "decode", batch=2, seq=1, past=7)
    original = onnx.load(path)
    spelled = _outer_product_rotary(onnx.load(path))
    assert _max_diff(_run(original, feeds), _run(spelled, feeds)) < 1e-5  # the same model, spelled the 5.17 way
    options = {"target": "ort", "mask_format": "lengths"} if mask_format == "lengths" else \
        {"target": "ort", "kv_cache": "shared"}
    model, _ = mograph.optimize(spelled, passes=["cleanup", "fuse"], options=options)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["MultiHeadAttention"] == 0, ops
    for gone in ("Cos", "Sin", "MatMul"):
        if gone == "MatMul":
            assert ops[gone] == 11, ops  # the rotary MatMul is gone: packed QKV, o_proj, 3 MLP per layer, lm_head
        else:
            assert ops[gone] == 0, ops
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: helper.get_attribute_value(a) for a in gqa.attribute}["do_rotary"] == 1
    if mask_format == "lengths":  # the same I/O as the export: compare directly (the shared form is checked below)
        assert _max_diff(_run(original, feeds), _run(model, feeds)) < 1e-5
    again, report = mograph.optimize(model, passes=["cleanup", "fuse"], options=options)
    assert not any(p["modified"] for p in report.to_dict()["passes"] if p["name"] == "lower")
    assert Counter(n.op_type for n in again.graph.node) == ops


def test_outer_product_with_a_non_constant_factor_stays_unproven(tmp_path: Path) -> None:
    """Near miss: the same spelling but ``inv_freq`` computed from a graph input is not provably the standard
    rotary, so the rotary does not go inside GroupQueryAttention (``do_rotary`` 0): ONNX Runtime's RotaryEmbedding
    kernels over the export's own angles stay in front of it, and the numbers are the export's (before the
    rotary-outside form, ``--kv-cache shared`` refused it with the named reason)."""
    cfg = de.config("llama", **CFG)
    path = de.export(cfg, "decode", "torchscript", tmp_path / "decode.onnx")
    spelled = _outer_product_rotary(onnx.load(path))
    g = spelled.graph
    # rot_inv = rot_inv * (1 + 0 * first element of the mask as float): the same values, not a constant any more
    g.node.insert(0, helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=onnx.TensorProto.FLOAT))
    g.node.insert(1, helper.make_node("ReduceMax", ["mask_f"], ["mask_max"], keepdims=0))
    g.node.insert(2, helper.make_node("Mul", ["rot_inv", "mask_max"], ["rot_inv_dyn"]))
    for n in g.node:
        if n.name == "rot_expand":
            n.input[0] = "rot_inv_dyn"
    feeds = de.feeds(cfg, "decode", batch=2, seq=1, past=7)
    for options in ({"target": "ort", "mask_format": "lengths"}, {"target": "ort", "kv_cache": "shared"}):
        model, _ = mograph.optimize(spelled, passes=["cleanup", "fuse"], options=options)
        ops = Counter(n.op_type for n in model.graph.node)
        assert ops["GroupQueryAttention"] == 2 and ops["RotaryEmbedding"] == 2 and ops["MultiHeadAttention"] == 0, ops  # one kernel over Q and K per layer
        gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
        assert {a.name: helper.get_attribute_value(a) for a in gqa.attribute}["do_rotary"] == 0
        if "mask_format" in options:  # the same I/O as the export
            assert _max_diff(_run(spelled, feeds), _run(model, feeds)) < 1e-5


REAL_517 = Path(__file__).resolve().parents[2] / "data" / "decoders" / "llama_ts_decode_transformers517.onnx"


def test_transformers_517_export_keeps_the_rotary_inside_under_fp16(tmp_path: Path) -> None:
    """A real TorchScript export by transformers 5.17 (the H200 image's; 1 layer, hidden 64, seeded random weights,
    made by ``tools/bench_llm.py``'s ``export``): its inv_freq is a Constant node times ``Cast(pos)`` after
    cleanup. fp16 keeps both float32, so ``--kv-cache shared`` still puts the rotary inside GroupQueryAttention
    (without the rule for the constant side: a float16 inv_freq cast back, the rotary-outside form)."""
    model = onnx.load(REAL_517)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 100, (2, 1)), "attention_mask": np.ones((2, 9), np.int64),
             "past_0_key": rng.standard_normal((2, 2, 8, 16)).astype(np.float32),
             "past_0_value": rng.standard_normal((2, 2, 8, 16)).astype(np.float32)}
    np.savez(tmp_path / "calib.npz", **feeds)
    opt, report = mograph.optimize(model, passes=["cleanup", "fuse", "fp16"],
                                   options={"target": "ort", "kv_cache": "shared", "fp16_io": "yes",
                                            "calibration_data": str(tmp_path / "calib.npz")})
    lower = next(p for p in report.to_dict()["passes"] if p["name"] == "lower")["stats"]
    assert lower["attention.gqa_rotary"] == 1 and "attention.gqa_external_rotary" not in lower, lower
    ops = Counter(n.op_type for n in opt.graph.node)
    assert ops["RotaryEmbedding"] == 0 and ops["Cos"] == 0 and ops["GroupQueryAttention"] == 1, ops
