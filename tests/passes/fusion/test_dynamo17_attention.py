"""Attention from ``torch.onnx.export(dynamo=True, opset_version=17)`` (torch's default exporter): its SDPA
decomposition flattens the key heads (``Reshape(K_h, [-1, T, D])``, ``Transpose [0, 2, 1]``, ``Reshape [B, N, D,
T]``) with targets computed from ``Shape(K_h)`` slices, which ONNX shape inference leaves as unknown dims.
The rule reads those targets instead; the near-miss message no longer tells the user to run infer-shapes,
which had already run.

The model (``tests/data/corpus/nearmiss_torch_dynamo17_bert-attn.onnx``, 200 KB): transformers 5.24
``BertModel(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
intermediate_size=128, max_position_embeddings=64))`` in eval mode, exported by torch 2.13 with
``dynamo=True, opset_version=17`` and dynamic ``batch``/``seq`` on both inputs; weights random (not a
download).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import mograph
from mograph.testing import op_counts, run_ort

MODEL = Path(__file__).resolve().parents[2] / "data" / "corpus" / "nearmiss_torch_dynamo17_bert-attn.onnx"


def _feeds(batch: int = 2, seq: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    mask = np.ones((batch, seq), np.int64)
    mask[1, 5:] = 0  # right padding in the second row
    return {"input_ids": rng.integers(0, 100, (batch, seq)).astype(np.int64), "attention_mask": mask}


@pytest.mark.parametrize("target", ["mograph", "ort"])
def test_dynamo_opset17_bert_attention_fuses(target):
    pytest.importorskip("onnxruntime")
    model, report = mograph.optimize(str(MODEL), ["cleanup", "fuse"], options={"target": target, "explain": True})
    attention = next(p for p in report.passes if p.name == "fuse-attention")
    assert attention.stats == {"AttentionFusion": 1, "AttentionFusion.mul-qk.mask": 1}
    rule = attention.details["rules"]["AttentionFusion"]
    assert rule["near_misses"] == 0 and attention.details.get("unfused_softmax") == []
    ops = op_counts(model)
    if target == "mograph":
        assert ops["mograph.Attention"] == 1 and "Softmax" not in ops
    else:
        assert ops["com.microsoft.Attention"] + ops.get("com.microsoft.MultiHeadAttention", 0) == 1
        assert "Softmax" not in ops
    if target == "mograph":
        return  # ORT has no kernel for mograph.*; the numbers are checked through the ort target
    feeds = _feeds()
    ref = run_ort(onnx.load(str(MODEL)), feeds)
    got = run_ort(model, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_a_near_miss_there_never_blames_a_step_that_ran():
    """Outer target [B, N, T, D] instead of [B, N, D, T]: no proof, a near miss whose reason says what could not
    be proved (the old one said 'run infer-shapes first', though infer-shapes had run)."""
    proto = onnx.load(str(MODEL))
    concat = next(n for n in proto.graph.node if n.op_type == "Concat" and len(n.input) == 3  # [B, N] [D] [T]
                  and any(r.op_type == "Reshape" and r.input[1] == n.output[0]
                          and _producer_op(proto, r.input[0]) == "Transpose" for r in proto.graph.node))
    concat.input[1], concat.input[2] = concat.input[2], concat.input[1]
    model, report = mograph.optimize(proto, ["cleanup", "fuse"], options={"target": "mograph", "explain": True})
    attention = next(p for p in report.passes if p.name == "fuse-attention")
    assert attention.stats == {} and attention.modified is False
    (miss,) = attention.details["rules"]["AttentionFusion"]["near_miss_list"]
    assert "cannot prove Reshape" in miss["reason"] and "not read from the key heads' own shape" in miss["reason"]
    assert "infer-shapes" not in miss["reason"]


def _producer_op(proto: onnx.ModelProto, name: str) -> str:
    return next((n.op_type for n in proto.graph.node if name in n.output), "")
