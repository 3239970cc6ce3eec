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
Projections with a bias (Qwen2's Q/K/V: ``MatMulNBits`` then ``Add`` of a constant ``[N]``) are packed by
:func:`pack_nbits_biased`: the packed node, then one ``Add`` of ``[b_q | b_k | b_v]`` (zeros for one without); ONNX
Runtime folds that ``Add`` into the kernel's bias as it did each of the three (stat ``attention.packed_qkv.bias``).

The decision stays per layer: the precision plan still names ``q_proj``, ``k_proj``, ``v_proj`` one by one,
and projections the plan gives different precisions (one ``float``, or ``int4`` next to ``int8``, or another
block size) are left as they are.  Stats: ``attention.packed_qkv.nbits`` (packed; also counted in
``attention.packed_qkv``), ``attention.unpacked_qkv.<why>`` with ``why`` one of ``mixed_precision`` (float
next to quantized, or different ``bits``), ``block_size``, ``accuracy_level``, ``other`` (different inputs,
a ``g_idx`` or ``bias`` input, weights that are not constants, bits other than 4 and 8).

Encoders (:func:`pack_nbits_qkv`, BERT-like self-attention lowered to ``MultiHeadAttention``): Q, K, V are ``x @ W +
b`` of one ``x``, each ``MatMulNBits`` then a bias ``Add``.  The three nodes become the packed one, then ``Split``
(constant sizes ``[N_q, N_k, N_v]``, last axis) gives ``MultiHeadAttention`` its ``query``, ``key``, ``value``, and
``[b_q | b_k | b_v]`` goes to its ``bias`` input (a projection without bias adds zeros): one ``MatMulNBits`` per layer
instead of three, and the three bias ``Add`` nodes go into the kernel.  Not ``MultiHeadAttention``'s packed query
``[B, S, N, 3, H]`` (``key``/``value`` empty, no Split; ONNX Runtime's CUDA kernel takes it with ``bias``): the CPU
kernel refuses it ("Packed QKV of shape (B, L, N, 3, H) not implemented for CPU", onnxruntime 1.32), so that form
could not be checked on CPU; the Split form runs on both providers.  Exact: the packed node computes the three's
columns as they did, and the kernel adds each bias as the ``Add`` did (the same float additions).

Considered only: three projections (``MatMulNBits`` or float ``MatMul`` of a constant 2-D weight, optionally plus a
constant 1-D bias) of one input, at least one of them quantized.  A projection read by anything but the attention
(or a ``MatMulNBits`` read by anything but its ``Add``), biases of different types, or an opset below 13 (``Split``
without its sizes input) count ``attention.unpacked_qkv.other``; the reasons of :func:`pack_nbits_projections` count
as above.  Cross-attention (different inputs) and Q/K/V that are not projections (rotated by a rotary embedding)
are not its business: nothing is counted.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from mograph.irutil import add_initializer
from mograph.lowering import LoweringContext
from mograph.patterns import constant_array

__all__ = ["MS_DOMAIN", "PackedQKV", "pack_nbits_biased", "pack_nbits_projections", "pack_nbits_qkv"]

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


class PackedQKV(NamedTuple):
    """What :func:`pack_nbits_qkv` built: ``x`` (the input the three projections read), ``q``, ``k``, ``v`` (the
    ``Split`` of the packed node: MultiHeadAttention's query, key and value) and ``bias`` (``[b_q | b_k | b_v]`` for its
    ``bias`` input; None where no projection had one)."""

    x: ir.Value
    q: ir.Value
    k: ir.Value
    v: ir.Value
    bias: ir.Value | None


def _projection(value: ir.Value) -> tuple[ir.Value, np.ndarray | None, ir.Value, int] | None:
    """``(y, b, x, n)`` where ``value`` is ``y + b`` (either order, ``b`` a constant ``[n]``) or ``y`` itself, and ``y`` is
    ``MatMulNBits(x)`` or a float ``MatMul(x, W)`` with a constant 2-D ``W`` (``n`` output columns); None otherwise."""
    y, b = value, None
    add = value.producer()
    if add is not None and add.domain == "" and add.op_type == "Add" and len(add.inputs) == 2:
        for i in (0, 1):
            arr, other = constant_array(add.inputs[1 - i]), add.inputs[i]
            if arr is not None and arr.ndim == 1 and other is not None and other.producer() is not None:
                y, b = other, arr
                break
        else:
            return None
    mm = y.producer()
    if mm is None or mm.inputs[0] is None:
        return None
    if _nbits_node(y) is not None:
        n = _int_attr(mm, "N", 0)
    elif mm.domain == "" and mm.op_type == "MatMul" and (w := constant_array(mm.inputs[1])) is not None and w.ndim == 2:
        n = int(w.shape[1])
    else:
        return None
    if b is not None and b.shape[0] != n:
        return None
    return y, b, mm.inputs[0], n


def _only_read_by(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and all(u.node is reader for u in value.uses())


def pack_nbits_qkv(q: ir.Value, k: ir.Value, v: ir.Value, reader: ir.Node, graph: ir.Graph, new_nodes: list[ir.Node],
                   ctx: LoweringContext) -> PackedQKV | None:
    """Q, K, V of a self-attention ``reader`` as the ``Split`` of one packed ``MatMulNBits`` and one
    ``[b_q | b_k | b_v]`` (the encoder form of the module docstring); the new nodes are appended to ``new_nodes``.

    None, and nothing built, where Q, K, V are not three projections of one input with at least one
    ``MatMulNBits`` (nothing counted), or where they cannot be packed exactly (counted as
    ``attention.unpacked_qkv.<why>``).  The old projections are left for the caller's dead-producer sweep.
    """
    values = (q, k, v)
    if len({id(x) for x in values}) != 3:
        return None
    parts = [_projection(x) for x in values]
    if any(p is None for p in parts):
        return None
    ps = [p for p in parts if p is not None]
    if all(_nbits_node(y) is None for y, *_ in ps) or len({id(x) for _, _, x, _ in ps}) != 1:
        return None  # no quantized projection, or not self-attention
    biases = [b for _, b, _, _ in ps if b is not None]
    dtype = q.dtype.numpy() if q.dtype is not None else biases[0].dtype if biases else None
    readers_ok = all(_only_read_by(x, reader) for x in values) and all(
        y is x or _only_read_by(y, x.producer())  # type: ignore[arg-type]
        for x, (y, *_) in zip(values, ps))
    if not readers_ok or any(b.dtype != dtype for b in biases) or graph.opset_imports.get("", 13) < 13:
        ctx.count("attention.unpacked_qkv.other")  # read elsewhere, biases of another type, no Split sizes input
        logger.debug("%s: Q/K/V projections not packed: read elsewhere, or biases of another type", reader.name)
        return None
    packed = pack_nbits_projections([y for y, *_ in ps], graph, new_nodes, ctx)
    if packed is None:
        return None
    sizes = [n for *_, n in ps]
    const = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(sizes, dtype=np.int64))})
    split = ir.node("Split", [packed, const.outputs[0]], attributes={"axis": -1}, num_outputs=3)
    new_nodes += [const, split]
    for out, old in zip(split.outputs, values):
        if old.dtype is not None:
            out.dtype = old.dtype
        out.shape = ir.Shape(list(old.shape)) if old.shape is not None else None
    bias = None
    if biases:
        assert dtype is not None
        b_all = np.concatenate([b if b is not None else np.zeros(n, dtype) for _, b, _, n in ps]).astype(dtype)
        bias = add_initializer(graph, "mograph_qkv_bias", b_all)
    return PackedQKV(ps[0][2], split.outputs[0], split.outputs[1], split.outputs[2], bias)


def pack_nbits_biased(xs: list[ir.Value], graph: ir.Graph, new_nodes: list[ir.Node],
                      ctx: LoweringContext) -> tuple[bool, ir.Value | None]:
    """:func:`pack_nbits_projections` for projections of which at least one adds a constant bias after its
    ``MatMulNBits`` (``y + b``): the packed node, then one ``Add`` of ``[b_q | b_k | b_v]``.

    ``(False, None)``: not this form (no bias ``Add`` after a ``MatMulNBits``; nothing counted, the caller may try
    :func:`pack_nbits_projections`); ``(True, None)``: this form but not packed (the reason counted); ``(True, out)``:
    packed.  Each ``MatMulNBits`` output must be read by its ``Add`` only (the caller checks ``xs``' readers).
    """
    parts = [_projection(x) for x in xs]
    if any(p is None for p in parts):
        return False, None
    ps = [p for p in parts if p is not None]
    if all(b is None for _, b, _, _ in ps) or not any(
            b is not None and _nbits_node(y) is not None for y, b, _, _ in ps):
        return False, None
    biases = [b for _, b, _, _ in ps if b is not None]
    dtype = xs[0].dtype.numpy() if xs[0].dtype is not None else biases[0].dtype
    if any(y is not x and not _only_read_by(y, x.producer()) for x, (y, *_) in zip(xs, ps)) or any(  # type: ignore[arg-type]
            b.dtype != dtype for b in biases):
        ctx.count("attention.unpacked_qkv.other")  # a product also read elsewhere, or biases of another type
        return True, None
    packed = pack_nbits_projections([y for y, *_ in ps], graph, new_nodes, ctx)
    if packed is None:
        return True, None
    b_all = np.concatenate([b if b is not None else np.zeros(n, dtype) for _, b, _, n in ps]).astype(dtype)
    add = ir.node("Add", [packed, add_initializer(graph, "mograph_qkv_bias", b_all)])
    if packed.dtype is not None:
        add.outputs[0].dtype = packed.dtype
    add.outputs[0].shape = packed.shape
    new_nodes.append(add)
    ctx.count("attention.packed_qkv.bias")
    return True, add.outputs[0]
