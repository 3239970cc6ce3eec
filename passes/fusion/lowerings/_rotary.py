"""``mograph.RotaryEmbedding`` for ``--target ort``: ``com.microsoft.RotaryEmbedding`` over the export's own angle
table where it is provably one, with a note of each kernel for the attention lowering after it (which may take
both kernels into ``GroupQueryAttention``).  See :mod:`mograph.passes.fusion.lowerings.attention`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.lowerings._attention_ort import _add, _const, _kernel, _replace
from mograph.passes.fusion.lowerings.attention_proofs import _half_angles

from mograph.irutil import attr_value
from mograph.lowering import LoweringContext

logger = logging.getLogger(__name__)


def _note_rotary(node: ir.Node, uses: list[Any], x: ir.Value | None, ctx: LoweringContext) -> None:
    """Note which value now stands for the rotated X (``rotary_outputs`` in ``ctx.shared``): the attention
    lowering after it reads X's shape (the result's, by the op's contract) to prove a causal mask's length."""
    if x is not None and uses:
        user, index = uses[0]
        new = user.inputs[index]
        if new is not None:
            ctx.shared[("rotary_outputs", id(new))] = x


def _removed(value: ir.Value) -> bool:
    """Whether the node that computed ``value`` was taken out of the graph."""
    node = value.producer()
    return node is not None and node.graph is None


def _lower_rotary_ort(node: ir.Node, ctx: LoweringContext) -> bool:
    """``com.microsoft.RotaryEmbedding`` where the export's cos/sin are provably ``Cos/Sin(Concat(f, f))`` of
    one rank-3 angle table ``f`` ``[Bc, S, D/2]`` (laid out ``[Bc, 1, S, D]``): the caches are ``Cos(f)``,
    ``Sin(f)`` (times the scaling constant) reshaped to ``[Bc*S, D/2]``, and each token's position id is its
    row in them (``b*S + s``, expanded over the batch when ``Bc`` is 1), so every token gets exactly the cos/sin
    the export computed, whatever its positions were.  A partial rotary (``rotary_dim`` R < D, ``f`` ``[Bc, S,
    R/2]``) is the kernel's ``rotary_embedding_dim`` R (measured on its CPU kernel: the first R values of each head
    rotated, the rest copied).  Else the body, inlined."""
    x, cos, sin = node.inputs
    uses = list(node.outputs[0].uses())
    heads, partial = int(attr_value(node, "num_heads", 1)), int(attr_value(node, "rotary_dim", 0))
    hc, hs = _half_angles(cos), _half_angles(sin)
    width = x.shape[2] if x is not None and x.shape is not None and len(x.shape) == 3 else None
    half_dim = hc[0].shape[2] if hc is not None and hc[0].shape is not None else None
    if (x is None or hc is None or hs is None or hc[0] is not hs[0] or hc[1] != "Cos" or hs[1] != "Sin"
            or hc[2] != hs[2] or not isinstance(width, int) or width % heads
            or not isinstance(half_dim, int) or 2 * half_dim != (partial or width // heads)
            or not 0 <= partial < width // heads):
        if not ctx.inline(node):
            return False
        _note_rotary(node, uses, x, ctx)
        return True
    f, _, scale = hc
    new_nodes: list[ir.Node] = []
    key = ("rotary_caches", id(f), scale)
    if key in ctx.shared and any(_removed(v) for v in ctx.shared[key]):
        del ctx.shared[key]  # a GroupQueryAttention took the kernels that read them (do_rotary): build them again
    if key in ctx.shared:
        cos_cache, sin_cache, positions = ctx.shared[key]
    else:
        half = int(half_dim)
        flat = _const(new_nodes, np.array([-1, half], dtype=np.int64))
        caches = []
        for trig in ("Cos", "Sin"):
            t = _add(new_nodes, trig, [f])
            if scale is not None and f.dtype is not None:
                t = _add(new_nodes, "Mul", [t, _const(new_nodes, np.array(scale, dtype=f.dtype.numpy()))])
            if x.dtype is not None and f.dtype is not None and f.dtype != x.dtype:
                t = _add(new_nodes, "Cast", [t], to=x.dtype.value)  # float32 angles (fp16) -> X's type
            caches.append(_add(new_nodes, "Reshape", [t, flat]))
        cos_cache, sin_cache = caches
        lead = _add(new_nodes, "Slice", [_add(new_nodes, "Shape", [f]), _const(new_nodes, np.array([0], dtype=np.int64)),
                                         _const(new_nodes, np.array([2], dtype=np.int64))])  # [Bc, S]
        # rows b*S + s counted on the device (an exclusive CumSum of ones, in float64: exact below 2**53), not
        # by a Range over shape values: those run on the host and their Memcpy would keep a decode step from
        # being captured as a CUDA graph
        ones = _add(new_nodes, "ConstantOfShape", [lead],
                    value=ir.tensor(np.array([1.0], dtype=np.float64)))
        flat_ones = _add(new_nodes, "Reshape", [ones, _const(new_nodes, np.array([-1], dtype=np.int64))])
        counted = _add(new_nodes, "CumSum", [flat_ones, _const(new_nodes, np.array(0, dtype=np.int64))], exclusive=1)
        ids = _add(new_nodes, "Cast", [counted], to=ir.DataType.INT64.value)
        positions = _add(new_nodes, "Reshape", [ids, lead])  # [Bc, S]: row b*S + s
        ctx.shared[key] = (cos_cache, sin_cache, positions)
    batch_seq = _add(new_nodes, "Slice", [_add(new_nodes, "Shape", [x]), _const(new_nodes, np.array([0], dtype=np.int64)),
                                          _const(new_nodes, np.array([2], dtype=np.int64))])
    pos = _add(new_nodes, "Expand", [positions, batch_seq])
    attrs = {"num_heads": heads, "interleaved": 0, **({"rotary_embedding_dim": partial} if partial else {})}
    kernel = _kernel("RotaryEmbedding", [x, pos, cos_cache, sin_cache], attrs)
    kernel.outputs[0].shape = x.shape
    if x.dtype is not None:
        kernel.outputs[0].dtype = x.dtype
    new_nodes.append(kernel)
    _replace(node, new_nodes, ctx)
    ctx.count("rotary.kernel")
    if kernel.outputs[0].shape is None:  # the replaced output's unknown shape came over: the op keeps X's
        kernel.outputs[0].shape = x.shape
    _notes(ctx)[id(kernel.outputs[0])] = (x, f, scale, heads, partial)
    _note_rotary(node, uses, x, ctx)
    return True


def _notes(ctx: LoweringContext) -> dict[int, Any]:
    """ONNX Runtime RotaryEmbedding kernels built in this run: id(output) -> (x, f, scale, num_heads, R) (R the
    rotated width of a partial rotary, ``rotary_embedding_dim``; 0: the whole head)."""
    notes = getattr(ctx, "_rotary_kernels", None)
    if notes is None:
        notes = {}
        setattr(ctx, "_rotary_kernels", notes)  # noqa: B010  # a per-run note, not a field of the context
    return notes
