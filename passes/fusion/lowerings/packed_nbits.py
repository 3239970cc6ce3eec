"""Q, K and V projections already lowered to ``com.microsoft.MatMulNBits`` packed into one, for the attention lowerings.

The float path packs ``x @ W_q``, ``x @ W_k``, ``x @ W_v`` into ``x @ [W_q | W_k | W_v]`` (one GEMM, the packed
``query`` input of ``GroupQueryAttention``).  A weight-only quantized model reaches the attention lowering
with each projection already a ``MatMulNBits`` (the ``lower`` step goes in graph order, and the
``mograph.WeightOnlyMatMul`` nodes come first), so this module does the same concatenation on the quantized
form::

    B[n, b, :]        the codes of output column n, block b (blocks cut along K)
    scales[n, b]      its scale
    zero_points[n, .] its zero points (4-bit: two blocks a byte; absent: 2^(bits-1))

Every array is indexed by the output column first, and a column's codes, scales and zero points depend on
that column's weights only (block quantization runs along K per column).  So stacking the three nodes'
arrays along N *is* quantizing ``[W_q | W_k | W_v]`` with the same per-column blocks: the packed node
computes exactly what the three compute, provided ``K``, ``bits``, ``block_size`` and ``accuracy_level``
agree and all three read the same ``A``.  A node without zero points (symmetric) next to one with them gets
its default zero points written out (``0x88`` per byte at 4 bits, ``128`` at 8 bits), which changes nothing.

The decision stays per layer: the precision plan still names ``q_proj``, ``k_proj``, ``v_proj`` one by one,
and projections the plan gives different precisions (one ``float``, or ``int4`` next to ``int8``, or another
block size) are left as they are.  Stats: ``attention.packed_qkv.nbits`` (packed; also counted in
``attention.packed_qkv``), ``attention.unpacked_qkv.<why>`` with ``why`` one of ``mixed_precision`` (float
next to quantized, or different ``bits``), ``block_size``, ``accuracy_level``, ``other`` (different inputs,
a ``g_idx`` or ``bias`` input, weights that are not constants, bits other than 4 and 8).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from mograph.irutil import add_initializer
from mograph.lowering import LoweringContext
from mograph.patterns import constant_array

__all__ = ["MS_DOMAIN", "pack_nbits_projections"]

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
PACKED_FROM_KEY = "mograph.packed_from"


def _nbits_node(x: ir.Value) -> ir.Node | None:
    node = x.producer()
    if node is None or node.domain != MS_DOMAIN or node.op_type != "MatMulNBits":
        return None
    return node


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    a = node.attributes.get(name)
    return int(a.as_int()) if a is not None else default


def _why_not(nodes: list[ir.Node | None]) -> str | None:
    """Why these producers cannot be packed (a stat suffix), or None when they can."""
    if any(n is None for n in nodes):
        return "mixed_precision"  # a float (or otherwise computed) projection next to a quantized one
    ns: list[ir.Node] = [n for n in nodes if n is not None]
    if len({_int_attr(n, "bits", 4) for n in ns}) != 1:
        return "mixed_precision"
    if len({_int_attr(n, "block_size", 0) for n in ns}) != 1:
        return "block_size"
    if len({_int_attr(n, "accuracy_level", 0) for n in ns}) != 1:
        return "accuracy_level"
    if _int_attr(ns[0], "bits", 4) not in (4, 8) or len({_int_attr(n, "K", 0) for n in ns}) != 1:
        return "other"
    if len({id(n.inputs[0]) for n in ns}) != 1 or any(len(n.inputs) > 4 and any(v is not None for v in n.inputs[4:])
                                                       for n in ns):
        return "other"  # different inputs, or a g_idx / bias input
    return None


def _rows(arr: np.ndarray, n: int) -> np.ndarray:
    """``arr`` with its output-column axis first: ``[N, ...]`` (scales and zero points may be stored flat)."""
    return arr.reshape(n, -1)


def pack_nbits_projections(xs: list[ir.Value], graph: ir.Graph, new_nodes: list[ir.Node],
                           ctx: LoweringContext) -> ir.Value | None:
    """One ``MatMulNBits`` computing ``[xs[0] | xs[1] | ...]`` where each of ``xs`` is a ``MatMulNBits`` of the same
    input with the same quantization (see the module docstring); the node is appended to ``new_nodes``.

    None (and nothing built) when none of ``xs`` is a ``MatMulNBits``, or when they cannot be packed exactly
    (the reason counted as ``attention.unpacked_qkv.<why>``).  The caller makes sure ``xs`` are read by
    nothing but what it replaces (the old nodes are then removed as dead producers).
    """
    nodes = [_nbits_node(x) for x in xs]
    if all(n is None for n in nodes):
        return None
    why = _why_not(nodes)
    ns: list[ir.Node] = [n for n in nodes if n is not None]
    arrays = []
    if why is None:
        for n in ns:
            b, s = constant_array(n.inputs[1]), constant_array(n.inputs[2])
            z = constant_array(n.inputs[3]) if len(n.inputs) > 3 and n.inputs[3] is not None else None
            if b is None or s is None or (len(n.inputs) > 3 and n.inputs[3] is not None and z is None):
                why = "other"
                break
            arrays.append((b, s, z, _int_attr(n, "N", 0)))
    if why is None and (len({s.dtype for _, s, _, _ in arrays}) != 1 or any(
            n_ <= 0 or b.size % n_ or s.size % n_ or (b.size // n_, s.size // n_, b.ndim, s.ndim)
            != (arrays[0][0].size // arrays[0][3], arrays[0][1].size // arrays[0][3], arrays[0][0].ndim,
                arrays[0][1].ndim) for b, s, _, n_ in arrays)):
        why = "other"  # scales of different types, or arrays that do not hold N rows of one layout
    if why is None and any(z is not None and z.dtype != np.uint8 for _, _, z, _ in arrays):
        why = "other"  # float zero points (another writer's layout): not packed
    if why is not None:
        ctx.count(f"attention.unpacked_qkv.{why}")
        logger.debug("Q/K/V projections %s not packed: %s", [n.name if n else None for n in nodes], why)
        return None
    first = ns[0]
    bits = _int_attr(first, "bits", 4)
    total = sum(n_ for *_, n_ in arrays)
    b0, s0 = arrays[0][0], arrays[0][1]  # the packed arrays keep the first node's layout (K, bits, block agree)
    b_all = np.concatenate([b.reshape((n_, *b0.shape[1:])) for b, _, _, n_ in arrays])
    s_all = np.concatenate([_rows(s, n_) for _, s, _, n_ in arrays]).reshape((-1, *s0.shape[1:]))
    inputs: list[ir.Value | None] = [first.inputs[0], add_initializer(graph, "mograph_qkv_nbits_weight", b_all),
                                     add_initializer(graph, "mograph_qkv_nbits_scales", s_all)]
    if any(z is not None for _, _, z, _ in arrays):
        width = next(_rows(z, n_).shape[1] for _, _, z, n_ in arrays if z is not None)
        default = 0x88 if bits == 4 else 0x80  # 2^(bits-1) in every code slot of a byte
        zs = [_rows(z, n_) if z is not None else np.full((n_, width), default, np.uint8) for _, _, z, n_ in arrays]
        if len({z.shape[1] for z in zs}) != 1:
            ctx.count("attention.unpacked_qkv.other")
            return None
        z0 = next(z for _, _, z, _ in arrays if z is not None)
        inputs.append(add_initializer(graph, "mograph_qkv_nbits_zero_points",
                                      np.concatenate(zs).reshape((-1, *z0.shape[1:]))))
    attrs = {"K": _int_attr(first, "K", 0), "N": total, "bits": bits, "block_size": _int_attr(first, "block_size", 0)}
    if "accuracy_level" in first.attributes:
        attrs["accuracy_level"] = _int_attr(first, "accuracy_level", 0)
    node = ir.node("MatMulNBits", inputs, attributes=attrs, domain=MS_DOMAIN)
    node.metadata_props[PACKED_FROM_KEY] = ",".join(n.name or "?" for n in ns)
    out = node.outputs[0]
    if xs[0].dtype is not None:
        out.dtype = xs[0].dtype
    shape = xs[0].shape
    if shape is not None and len(shape) >= 1:
        out.shape = ir.Shape([*list(shape)[:-1], total])
    new_nodes.append(node)
    ctx.count("attention.packed_qkv.nbits")
    return out
