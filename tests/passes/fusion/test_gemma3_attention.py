"""Gemma 3's attention (issue 31): RMSNorms on the split Q and K heads (``q_norm`` / ``k_norm``, before the rotary),
a scale of ``query_pre_attn_scalar ** -0.5`` split over Q and K, sliding-window and global layers, grouped-query.

Before the fix ``fuse-attention`` stopped at the query side ("expected Transpose perm [0, 2, 1, 3] splitting heads,
got RMSNorm"), so a Gemma 3 export kept every Softmax.  The trace now follows a norm over each head's last axis
(:func:`mograph.passes.fusion._attention_trace._head_norm`) and the rewrite applies the same norm to the ``[B, S, N, D]``
view of the projection (:func:`mograph.passes.fusion.attention.head_norm`).

The model: ``Gemma3ForCausalLM`` from a small config in code (seeded random weights, nothing downloaded), two layers
(one sliding over 4 positions, one global), 4 query / 1 key-value heads of 32, exported with TorchScript at opset 17
as ``tools/bench_real_llm.py`` exports the real Gemma 3 270M (sdpa, ``input_ids, attention_mask -> logits``, no cache).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from mograph.passes.fusion.attention import FuseAttentionPass  # noqa: E402

import mograph  # noqa: E402
from mograph.plugins import get_registry  # noqa: E402
from mograph.testing import assert_untouched, check_pass, op_counts, to_ir, to_proto  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch]

HEADS, KV_HEADS, HEAD_DIM, VOCAB, WINDOW = 4, 1, 32, 128, 4


def _export(path: Path) -> Path:
    import torch
    import transformers as tf

    cfg = tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, sliding_window=WINDOW, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=48, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the norms' weights start at 0 (scale 1 + w): give them, and the rest, values
        for _, p in sorted(model.named_parameters()):
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids = torch.tensor([[2, 5, 7, 9, 11, 13, 17, 19]], dtype=torch.int64)
    with torch.no_grad():
        torch.onnx.export(Logits().eval(), (ids, torch.ones_like(ids)), str(path), opset_version=17, dynamo=False,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          do_constant_folding=True,
                          dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                        "logits": {0: "batch", 1: "seq"}})
    return path


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("gemma3") / "gemma3.onnx")


@pytest.fixture(scope="module")
def normed(export: Path) -> onnx.ModelProto:
    """The export after ``cleanup`` and the norm fusions: what ``fuse-attention`` sees in the ``fuse`` preset."""
    model = to_ir(onnx.load(str(export)))
    reg = get_registry()
    plan = "cleanup,fuse-layernorm,fuse-rmsnorm,fuse-skip-layernorm,fuse-gelu"
    options = {"target": "mograph"}  # the fused norms stay mograph ops (no lower step inlines them)
    for p in reg.instantiate(reg.plan(plan, options), options):
        p.call(model)
    return to_proto(model, with_data=True)


def _feeds(batch: int, seq: int, padding: str = "none", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(batch, seq), dtype=np.int64)
    mask = np.ones_like(ids)
    if padding == "right":
        mask[1, -3:] = 0
    elif padding == "left":
        mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _head_norms(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The RMSNorms on the split heads (their input is a Transpose)."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    return [n for n in proto.graph.node if n.op_type == "RMSNorm" and producer[n.input[0]].op_type == "Transpose"]


def test_attention_with_head_norms_fuses(normed: onnx.ModelProto) -> None:
    """Both layers fuse (the sliding one too: its mask is a bias like any other); the four head RMSNorms are made
    again on the projections, so the RMSNorm count stays; equal to the original on 12 tokens (more than the window)."""
    before = op_counts(to_ir(normed))
    assert len(_head_norms(normed)) == 4 and before["Softmax"] == 2, before
    model = check_pass(FuseAttentionPass(), normed, feeds=_feeds(1, 12),
                       stats={"AttentionFusion": 2, "AttentionFusion.mul-qk.mask.gqa.rotary": 2})
    left = op_counts(model)
    assert left["mograph.Attention"] == 2 and left["mograph.RotaryEmbedding"] == 4, left
    assert left["mograph.RMSNorm"] == before["mograph.RMSNorm"], (left, before)
    for gone in ("Softmax", "Transpose", "Neg", "IsNaN"):
        assert gone not in left, left
    for feeds in (_feeds(2, 9, "right", seed=1), _feeds(2, 9, "left", seed=2), _feeds(1, 3, seed=3)):
        ref, got = _run(normed, feeds), _run(to_proto(model, with_data=True), feeds)
        keep = feeds["attention_mask"].astype(bool)  # a padded position's row is not read
        assert float(np.abs(ref - got)[keep].max()) < 1e-5 * max(1.0, float(np.abs(ref).max()))


def test_per_head_scale_is_a_near_miss(normed: onnx.ModelProto) -> None:
    """A query norm whose scale is per head ([N, 1, D] over [B, N, S, D]) cannot move to the [B, S, N, D] view:
    the pass leaves the graph as it is and says why."""
    proto = onnx.ModelProto()
    proto.CopyFrom(normed)
    inits = {i.name: i for i in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    changed = 0
    for node in _head_norms(proto):
        if "q_proj" not in _source(producer, node):
            continue
        scale = numpy_helper.to_array(inits[node.input[1]])
        per_head = np.stack([scale * (1.0 + 0.1 * h) for h in range(HEADS)])[:, None, :]  # [N, 1, D]
        name = f"{node.input[1]}_per_head_{changed}"
        proto.graph.initializer.append(numpy_helper.from_array(per_head.astype(np.float32), name))
        node.input[1] = name
        changed += 1
    assert changed == 2
    result = assert_untouched(FuseAttentionPass(explain="true"), proto)
    reasons = {e["reason"] for e in result.details["unfused_softmax"]}
    assert all(r.startswith("query: RMSNorm") and r.endswith("has a scale or bias that is not 1-D") for r in reasons), \
        reasons


def _source(producer: dict[str, onnx.NodeProto], node: onnx.NodeProto) -> str:
    """The name of the projection MatMul under a head norm (Transpose <- Reshape <- MatMul)."""
    cur = node
    for _ in range(3):
        cur = producer[cur.input[0]]
    return cur.name


def test_ort_target_keeps_the_numbers(export: Path) -> None:
    """``cleanup,fuse --target ort``: no Softmax left in the main graph (both layers GroupQueryAttention behind the
    padding check, the sliding layer's window as its ``local_window_size``; each exact branch MultiHeadAttention with
    the mask as the bias), the same logits as the export with no, right and left padding.  (Before the window became
    ``local_window_size`` the sliding layer stayed MultiHeadAttention in the main graph: one If, one branch GQA.)"""
    original = onnx.load(str(export))
    model, report = mograph.optimize(original, passes=["cleanup", "fuse"], options={"target": "ort"})
    fused = next(p for p in report.passes if p.name == "fuse-attention")
    assert fused.stats["AttentionFusion"] == 2, fused.stats
    ops = Counter(n.op_type for n in model.graph.node)
    branches = Counter(n.op_type for node in model.graph.node for a in node.attribute if a.type == a.GRAPH
                       for n in a.g.node)
    assert ops["Softmax"] == 0 and ops["MultiHeadAttention"] == 0 and ops["If"] == 2, ops
    assert branches["GroupQueryAttention"] == 2 and branches["MultiHeadAttention"] == 2, branches
    for feeds in (_feeds(1, 12), _feeds(2, 9, "right", seed=1), _feeds(2, 9, "left", seed=2)):
        ref, got = _run(original, feeds), _run(model, feeds)
        keep = feeds["attention_mask"].astype(bool)
        assert float(np.abs(ref - got)[keep].max()) < 1e-5 * max(1.0, float(np.abs(ref).max()))
