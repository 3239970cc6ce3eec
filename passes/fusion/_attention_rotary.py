"""Rotary embeddings that ``fuse-attention`` follows on the Q/K heads (:mod:`.attention`).

Two forms, each recognised read-only and returned as ``(x, cos, sin)``: transformers' decomposed
``apply_rotary_pos_emb`` (:func:`_rotary`: ``x * cos + rotate_half(x) * sin``, the halves cut by ``Slice`` with
constant or ``D / 2`` bounds) and opset 23's standard ``RotaryEmbedding`` over whole heads, halves rotated
(:func:`_standard_rotary`).  The trace (:mod:`._attention_trace`) records them on the heads; the attention
lowering's proofs use :func:`_rotary` too.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._attention_reads import _producer

from mograph.patterns import constant_array
from mograph.shapes import Dims


class RotaryShapes(Protocol):
    """What the rotary readers ask the core's shape query (a fusion's ``GraphShapes``, a ``LoweringContext``)."""

    def dims(self, value: ir.Value | None) -> Dims | None: ...

    def static_dim(self, value: ir.Value | None, axis: int) -> int | None: ...

    def literals(self, value: ir.Value | None) -> list[int | None] | None: ...


def _slice_of(value: ir.Value | None, shapes: RotaryShapes, x: ir.Value | None = None
              ) -> tuple[ir.Value, int, int] | None:
    """``(input, start, end)`` of a ``Slice`` of the last of 4 axes with step 1 (``x``: it must slice ``x``); a bound
    that is not a constant counts where the shape query proves it one (TorchScript's ``D / 2``:
    ``Unsqueeze(Div(Gather(Shape(x), 3), 2))`` of a static ``D``)."""
    node = _producer(value, "Slice")
    if node is None or len(node.inputs) < 4 or (x is not None and node.inputs[0] is not x):
        return None
    vals = [constant_array(node.inputs[i]) if i < len(node.inputs) else None for i in (1, 2, 3, 4)]
    for i in (0, 1):
        if vals[i] is None:
            vals[i] = _static_bound(node.inputs[i + 1], shapes)
    if any(v is None or v.size != 1 for v in vals[:3]):
        return None
    if vals[3] is not None and int(vals[3].reshape(())) != 1:  # type: ignore[union-attr]
        return None
    if int(vals[2].reshape(())) not in (-1, 3):  # type: ignore[union-attr]
        return None
    return node.inputs[0], int(vals[0].reshape(())), int(vals[1].reshape(()))  # type: ignore[union-attr,return-value]


def _static_bound(value: ir.Value | None, shapes: RotaryShapes) -> np.ndarray | None:
    """The one-element shape vector ``value`` as a constant, where the shape query proves it a literal."""
    ints = shapes.literals(value)
    if ints is None or len(ints) != 1 or ints[0] is None:
        return None
    return np.array([ints[0]])


def _rotary(value: ir.Value, shapes: RotaryShapes) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(x, cos, sin)`` if ``value = x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = Concat(Neg(x[..., D/2:]), x[..., :D/2], axis=-1)`` (transformers' ``apply_rotary_pos_emb``)."""
    add = _producer(value, "Add")
    if add is None:
        return None
    for a, b in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        m_rot, m_x = _producer(b, "Mul"), _producer(a, "Mul")
        if m_rot is None or m_x is None:
            continue
        for rot, sin in ((m_rot.inputs[0], m_rot.inputs[1]), (m_rot.inputs[1], m_rot.inputs[0])):
            cat = _producer(rot, "Concat")
            if cat is None or len(cat.inputs) != 2 or int(cat.attributes["axis"].value) not in (-1, 3):
                continue
            neg = _producer(cat.inputs[0], "Neg")
            second = _slice_of(neg.inputs[0], shapes) if neg is not None else None
            if second is None:
                continue
            x = second[0]
            first = _slice_of(cat.inputs[1], shapes, x)
            d = shapes.static_dim(x, 3) if len(shapes.dims(x) or ()) == 4 else None
            if first is None or d is None or d % 2:
                continue
            if (first[1], first[2]) != (0, d // 2) or second[1] != d // 2 or second[2] < d:
                continue
            for xx, cos in ((m_x.inputs[0], m_x.inputs[1]), (m_x.inputs[1], m_x.inputs[0])):
                if xx is x and cos is not None and sin is not None and cos.shape is not None and len(cos.shape) == 4:
                    return x, cos, sin
    return None


def _standard_rotary(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(x, cos, sin)`` if ``value`` is opset 23's ``RotaryEmbedding(x [B, N, S, D], cos, sin)`` over the whole
    head, halves rotated (``interleaved=0``), without ``position_ids``: ``cos``/``sin`` are ``[B, S, D/2]``."""
    node = _producer(value, "RotaryEmbedding")
    if node is None or len(node.inputs) < 3 or any(v is not None for v in node.inputs[3:]):
        return None
    if any(int(node.attributes[k].value) for k in ("interleaved", "rotary_embedding_dim") if k in node.attributes):
        return None
    x, cos, sin = node.inputs[0], node.inputs[1], node.inputs[2]
    if x is None or cos is None or sin is None or x.shape is None or len(x.shape) != 4:
        return None
    return x, cos, sin
