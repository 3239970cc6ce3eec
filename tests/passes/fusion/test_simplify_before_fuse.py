"""``simplify-shapes`` before the fusions: ``cleanup,simplify-shapes,fuse`` fuses what ``cleanup,fuse`` fuses.

``simplify-shapes`` rebuilds every dynamic shape vector from the first value carrying each dim
(``Shape(x, end=2)`` for a batch and sequence pair), drops no-op reshapes and merges reshape chains; the
fusions must read those forms as they read the exporters' own ``Gather(Shape(x), i)`` chains, and the dims
it rebuilds must not be read from a value inside a pattern a fusion takes whole.  Each case
is a TorchScript export of the attention corpus (:mod:`models.attention_corpus`) where this once lost a
fusion; the fused model must give the export's numbers on ONNX Runtime CPU (optimizations off).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from mograph.passes.fusion._attention_reads import _read_axes
from mograph.passes.fusion._common import GraphShapes
from mograph.passes.fusion.attention import FuseAttentionPass

from mograph.testing import assert_untouched, check_pass, feeds_for, parse, to_ir
from tools.fusions_after_simplify import fusions

#: the reshape target pieces simplify-shapes writes, and what the attention readers see in them
_TARGETS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, S, 64] x) => (float[B, S, 4, 16] y, float[B, S, 4, 16] z, float[B, S, 4, 16] w) {
    two = Shape <end = 2> (x)
    tail = Constant <value = int64[2] {4, 16}> ()
    t1 = Concat <axis = 0> (two, tail)
    y = Reshape (x, t1)
    mid = Shape <start = 1, end = 2> (x)
    b = Shape <end = 1> (x)
    t2 = Concat <axis = 0> (b, mid, tail)
    z = Reshape (x, t2)
    whole = Shape (x)
    t3 = Concat <axis = 0> (whole, tail)
    w = Reshape (x, t3)
}
"""


def test_read_axes_of_multi_element_shape_pieces() -> None:
    """``Shape(x, end=2)`` is axes 0 and 1, ``Shape(x, end=1)`` axis 0 (``start`` left out), ``Shape(x, start=1,
    end=2)`` axis 1; a whole ``Shape(x)`` of a rank-3 ``x`` is axes 0, 1, 2 (the rank from the query)."""
    model = to_ir(parse(_TARGETS))
    shapes = GraphShapes(model.graph)
    targets = {n.outputs[0].name: n.inputs[1] for n in model.graph if n.op_type == "Reshape"}
    assert _read_axes(targets["y"], shapes) == [0, 1, None, None]
    assert _read_axes(targets["z"], shapes) == [0, 1, None, None]
    assert _read_axes(targets["w"], shapes) == [0, 1, 2, None, None]


def _decode_step(seq: str) -> str:
    """One attention of a decode step, query ``[B, seq, 64]`` over keys ``[B, T, 64]``, 4 heads of 16, its heads
    merged by ``Reshape(ctx, [0, 64])`` as ``simplify-shapes`` leaves ``[B, 1, 64] -> [-1, 64]``."""
    return f"""
<ir_version: 8, opset_import: ["" : 17]>
g (float[B, {seq}, 64] q, float[B, T, 64] k, float[B, T, 64] v) => (float[B, 64] y)
  <int64[4] split = {{0, 0, 4, 16}}, int64[2] flat = {{0, 64}}, float sc = {{4.0}}> {{
    q4 = Reshape (q, split)
    k4 = Reshape (k, split)
    v4 = Reshape (v, split)
    qh = Transpose <perm = [0, 2, 1, 3]> (q4)
    kt = Transpose <perm = [0, 2, 3, 1]> (k4)
    vh = Transpose <perm = [0, 2, 1, 3]> (v4)
    mm = MatMul (qh, kt)
    s = Div (mm, sc)
    p = Softmax <axis = -1> (s)
    o = MatMul (p, vh)
    ot = Transpose <perm = [0, 2, 1, 3]> (o)
    y = Reshape (ot, flat)
}}
"""


def test_merged_heads_to_batch_rows_when_seq_is_one() -> None:
    """``Reshape(ctx, [0, 64])`` on a ``[B, 1, 4, 16]`` context is ``[B * 1, 64]``: the shape query proves it, so the
    attention fuses (its ``[B, 1, 64]`` output flattened again) and gives the same numbers."""
    proto = parse(_decode_step("1"))
    check_pass(FuseAttentionPass(), proto, feeds=feeds_for(proto, dims={"B": 3, "T": 7}),
               stats={"AttentionFusion": 1, "AttentionFusion.div.nomask": 1},
               ops_left=["mograph.Attention", "Reshape"])


def test_merged_heads_to_batch_rows_needs_seq_one() -> None:
    """The same ``[0, 64]`` merge where the query's sequence is a symbol ``S`` (``[B, S*64]`` only when ``S`` is 1):
    nothing proves ``[B, 64]`` is ``[B * S, 64]``, so it is not fused."""
    assert_untouched(FuseAttentionPass(), parse(_decode_step("S")))


def _fusions(model, passes: str) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Per-rule fusion counts (the counting of ``tools/fusions_after_simplify.py``)."""
    return fusions(model, passes)[0]


# (case, the fusions both pipelines make)
_CASES = [
    (("whisper-dec", "torchscript", "sdpa", "pad"),
     {"SkipLayerNormFusion": 7, "GeluFusion": 2, "BiasGeluFusion": 2, "AttentionFusion": 4}),
    # a decode step: seq 1 fixed, so simplify-shapes merges the heads' [B, 1, 64] into the next [-1, 64] as [0, 64]
    (("gpt2", "torchscript", "sdpa", "cache"),
     {"SkipLayerNormFusion": 1, "SkipLayerNormGemmBiasFusion": 4, "GeluTanhFusion": 2, "GemmBiasGeluFusion": 2,
      "AttentionFusion": 2}),
    # the embeddings' sum carries a dim first (position ids sliced to the sequence): rebuilt masks read it from the
    # LayerNorm output, as the export does, not from the sum EmbedLayerNorm takes whole
    (("bert", "torchscript", "sdpa", "pad"),
     {"EmbedLayerNormFusion": 1, "SkipLayerNormFusion": 4, "GeluFusion": 2, "BiasGeluFusion": 2, "AttentionFusion": 2}),
]


@pytest.mark.torch
@pytest.mark.parametrize(("spec", "expected"), [pytest.param(s, e, id="-".join(s)) for s, e in _CASES])
def test_corpus_export_fuses_after_simplify_shapes(export_dir: Path, spec: tuple, expected: dict) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import attention_corpus as corpus
    from mograph.testing import assert_close, op_counts, run_ort, to_proto

    case = corpus.Case(*spec)
    path = export_dir / f"{case.name}.onnx"
    if not path.exists():
        corpus.export(case, path)
    proto = onnx.load(str(path))
    reference = to_ir(proto)
    assert _fusions(reference, "cleanup,fuse") == expected  # the reference: fusion on the export's shapes
    model = to_ir(proto)
    assert _fusions(model, "cleanup,simplify-shapes,fuse") == expected
    left = op_counts(model)
    # the shapes simplified twice (before the fusions, after lower) are no more nodes than once
    assert sum(left.values()) <= sum(op_counts(reference).values()), (left, op_counts(reference))
    assert "Softmax" not in left, left
    kernels = sum(left[f"com.microsoft.{k}"] for k in ("Attention", "MultiHeadAttention", "GroupQueryAttention"))
    assert kernels == case.attention_count, left
    assert_close(run_ort(proto, corpus.feeds(case)), run_ort(to_proto(model), corpus.feeds(case)), 1e-4)
