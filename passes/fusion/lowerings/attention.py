"""Lowerings of ``mograph.Attention``.

``ort``
    self-attention whose Q, K, V are ``x @ W (+ b)`` of one ``x`` with constant weights (and as many K/V heads as
    query heads) becomes ``com.microsoft.Attention`` with the three projections packed into one
    ``[hidden, 3*H*D]`` GEMM inside the op (what ONNX Runtime's transformers optimizer emits: one kernel per
    layer instead of three MatMuls and three bias Adds); anything else (cross-attention, a KV cache, grouped
    query heads, projections read elsewhere) gets ``com.microsoft.MultiHeadAttention`` with separate Q, K, V
    (cuDNN flash attention on CUDA: the kernels BENCHMARKS-GPU.md names, session 4).  How a mask gets
    there is the node's :data:`~mograph.passes.fusion.attention_op.MASK_FORMAT_KEY` hint (the
    ``fuse-attention`` option ``--mask-format``):

    ``bias`` (default)
        ``M`` as ``attention_bias`` (of either op), expanded to ``[B|1, H|1, S, T]`` where the kernel needs it (one
        expansion per bias and query length, shared by every layer).  Exact for every mask (left or right
        padding, causal, anything additive), and an additive bias still reaches flash attention on CUDA.
    ``lengths``
        where ``M`` is provably a key-padding bias of a 2-D ``[B, T]`` ``attention_mask`` input (0 where the
        mask is 1, a negative constant ``c`` where it is 0: ``(1 - mask) * c``, ``Where(mask, 0, c)``, or
        ``transformers``' index-based padding lookup as TorchScript exports it), the key lengths
        ``ReduceSum(mask, 1)`` (int32 ``[B]``, built once) go to ``key_padding_mask`` (the 1-D ``mask_index`` of
        the packed ``Attention``) and the float bias is
        dropped: the fastest form, but it equals the original **only for right-padded masks** (ones, then
        zeros); a left-padded row attends to its first ``length`` keys instead.  Other biases stay ``bias``.
    ``raw``
        the traced mask itself, cast once to int32, as a 2-D ``mask_index`` (``com.microsoft.Attention`` with
        the three projections packed into one ``[hidden, 3*H*D]`` GEMM when Q, K, V are ``x @ W + b`` of one
        ``x`` with constant weights, else ``MultiHeadAttention``'s ``key_padding_mask``), with
        ``mask_filter_value = c``: exact for 0/1 masks, even a fully padded row, but ONNX Runtime CUDA runs it
        with its slow unfused ``SoftmaxWithRawMask`` kernel.

    Where Q, K, V are the three equal parts of one ``Split`` of ``Reshape(Gemm(x, W, b))`` or ``Add(y, b)``
    (GPT-2's Conv1D) read by nothing else, ``b`` goes to ``MultiHeadAttention``'s ``bias`` input (stat
    ``attention.qkv_bias``) and the Gemm loses its ``C``: ONNX Runtime's CUDA Gemm writes a broadcast bias
    into its output before every GEMM (``BroadcastBiasKernel``, 0.46 ms of 2.5 for GPT-2 at 32x128 on the
    H200), the kernel adds it while it splits the heads.

    ``nan_to_zero`` adds ``Where(IsNaN(Y), 0, Y)`` after the kernel (a fully ``-inf``-masked row gives NaN
    there, 0 in the original).

    Causal masks: where ``M`` is provably ``Where(kv_idx <= q_idx, 0, c)`` (one ``Range(0, S)`` as key and
    query index, its length provably the query and key length; more ``And``-ed terms only if provably all
    true), the kernel's own causal mask replaces it: ``unidirectional=1`` (Attention / MultiHeadAttention, no
    bias), or for grouped K/V heads ``GroupQueryAttention`` (``seqlens_k = S - 1``, ``total_sequence_length =
    S``; head size a multiple of 8, as its CPU kernel requires).  Causal + a key-padding term does so only
    with ``lengths`` (right padding: key lengths, ``seqlens_k = lengths - 1``); ``bias`` and ``raw`` keep the
    dense bias there (exact for left padding and fully padded rows).  Exporters' other causal forms (the
    TorchScript ``Trilu`` of ``sdpa``, two Ranges of lengths not provably equal) keep the bias too.

    KV cache: where K and V are ``Concat(past, new, axis=2)`` of ``[B, G, P, D]`` graph inputs (the decode
    step of an export with ``past_key_values``), the past goes into the kernel and its ``present_key`` /
    ``present_value`` outputs replace the Concats (names kept): ``MultiHeadAttention`` with ``M`` as
    ``attention_bias`` (exact), or for grouped heads ``GroupQueryAttention`` when there is no ``M`` and the step
    is provably one token (its causal mask then hides nothing; its CUDA kernel refuses ``attention_bias``, so a
    masked grouped decode step keeps the Concat and repeats the cache in its own ``[B, G, P+1, D]`` layout,
    Unsqueeze/Expand/Reshape to ``[B, N, P+1, D]``, which ``MultiHeadAttention`` reads as 4-D K/V: the cache is
    never transposed).  Other grouped-query attention repeats K and V per head in their ``[B, T, Hkv*D]`` layout
    (Reshape/Expand/Reshape, as ``repeat_kv`` does), then ``MultiHeadAttention`` as above.  A step's new K/V go
    in as the exporter's own ``[B, S, H]`` projections where the head split is provably a split of the last dim
    (``[b, s, G, D]`` with ``0``, ``-1``, the static dims or ``Shape`` reads of the same tensor).
    Decoders (checked first): causal self-attention whose Q and K are ``com.microsoft.RotaryEmbedding`` kernels
    (lowered just before, from one angle table ``f``) becomes ``GroupQueryAttention`` with the rotary inside
    (``do_rotary=1``, ``cos_cache``/``sin_cache`` ``[GQA_MAX_LENGTH, D/2]`` initializers computed as the export
    does, float32 ``p * inv_freq``) where it is provably the standard one: ``f = Cast(pos) * inv_freq`` laid out
    ``[1, S, D/2]`` with ``inv_freq`` a constant and ``pos`` the query positions ``Range(0, S, 1)`` (+ the past
    length ``Shape(past_key)[2]`` of a decode step); the bias ``Where(kv_idx <= pos[s] [& mask[b, kv_idx]], 0, c)``
    with ``kv_idx`` a ``Range`` of the key count (the padding lookup as TorchScript's flat ``Gather`` or
    dynamo's ``GatherND`` of that very index); head size a multiple of 8.  Q/K/V that are projections of one
    tensor are packed (``x @ [Wq|Wk|Wv] (+ [bq|bk|bv])``, ``key``/``value`` empty); the cache is the kernel's past
    and present (the exporter's Concat removed), and a prefill's present outputs (the exporter's own rotated keys
    and split values) become the kernel's.  Lengths: ``seqlens_k = ReduceSum(int32(mask), 1) - 1``,
    ``total_sequence_length = int32(Shape(mask)[1])`` (as ONNX Runtime GenAI builds them) -- which assume RIGHT
    padding, so with a padding term the form is taken only with ``lengths`` (or ``--kv-cache shared``,
    :data:`~mograph.passes.fusion.attention_op.KV_CACHE_KEY`: past and present then carry the dim
    ``max_sequence_length``, bound to one buffer); without a mask input it is exact and taken by default.  No
    NaN guard: the causal mask leaves every query its own key.  Stats ``attention.gqa_rotary``,
    ``attention.packed_qkv``, ``attention.kv_cache_shared``; the two rotary kernels taken in are subtracted from
    ``rotary.kernel``.  Why a node did not take this form is logged at DEBUG (``-vv``).
``RotaryEmbedding``
    ``ort``: ``com.microsoft.RotaryEmbedding`` where the export's cos/sin are provably ``Cos/Sin(Concat(f, f))``
    of one per-token angle table ``f`` ``[Bc, S, D/2]`` (transformers' ``rotary_emb``, times its scaling
    constant): ONNX Runtime's kernel takes position-indexed caches, so the caches are that table itself
    (``Cos(f)``, ``Sin(f)`` reshaped to ``[Bc*S, D/2]``, built once per table) and each token's position id is its
    own row ``b*S + s``: exact whatever positions the export used.  Otherwise, and for the other targets, the
    body is inlined (X rotated in its ``[B, S, N, D]`` view; only cos/sin are transposed).
    Where the attention after it becomes ``GroupQueryAttention`` with ``do_rotary`` (above), the kernel is
    absorbed into it.
``onnx``
    the standard ``Attention`` (3-D form, ``q_num_heads``, ``kv_num_heads``; ``M`` as ``attn_mask``, expanded
    the same way, since ONNX Runtime does not broadcast its dim -2) at opset >= 23; below that ONNX has no
    attention op: the lowering declines and the ``lower`` step inlines the function body.
``tensorrt``
    the function body, inlined: mograph has no TensorRT plugin for attention yet, and TensorRT's ONNX
    parser would take a node named ``Attention`` for its own op and refuse it; TensorRT fuses the
    decomposed attention itself.

Lowerings of one ``lower`` run share what they build for the same input (the expanded bias, the int32
mask, the key lengths, GroupQueryAttention's ``seqlens_k``/``total_sequence_length``: stats ``bias_expansions``,
``mask_index_casts``, ``mask_lengths``, ``gqa_lengths``) through :attr:`~mograph.lowering.LoweringContext.shared`;
stats ``attention.causal`` and ``attention.kv_cache`` count the nodes whose causal mask / KV cache went into the
kernel, ``rotary.kernel`` the rotary embeddings lowered to ``com.microsoft.RotaryEmbedding`` (``rotary_caches``:
their tables).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.attention_op import KV_CACHE_KEY, MASK_FORMAT_KEY
from mograph.passes.fusion.ops import FLOAT_TYPES

from mograph.custom_ops import Lowering
from mograph.errors import PassFailedError
from mograph.irutil import add_initializer, attr_value, is_zero, same_dim
from mograph.lowering import LoweringContext, replace_node
from mograph.patterns import constant_array, remove_dead_producers, scalar_value

__all__ = ["is_zero_bias", "LOWERINGS"]

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
ONNX_ATTENTION_OPSET = 23

def _projection(value: ir.Value, user: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray] | None:
    """``(x, W, b)`` if ``value`` is ``x @ W + b`` (or ``x @ W``: b = 0) with constant 2-D W and 1-D b, read
    only by ``user``."""
    add = value.producer()
    if add is None or add.domain != "" or value.is_graph_output():
        return None
    if any(c is not user for c, _ in value.uses()):
        return None
    if add.op_type == "MatMul":  # a projection without bias (Whisper's k_proj)
        w, x = constant_array(add.inputs[1]), add.inputs[0]
        if w is None or x is None or w.ndim != 2:
            return None
        return x, w, np.zeros(w.shape[1], dtype=w.dtype)
    if add.op_type != "Add":
        return None
    for mm_in, b_in in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mm = mm_in.producer() if mm_in is not None else None
        if mm is None or mm.op_type != "MatMul" or mm.domain != "" or mm_in is None:
            continue
        if mm_in.is_graph_output() or len(mm_in.uses()) != 1:
            continue
        w, b = constant_array(mm.inputs[1]), constant_array(b_in)
        x = mm.inputs[0]
        if w is None or b is None or x is None or w.ndim != 2 or b.ndim != 1 or b.shape[0] != w.shape[1]:
            continue
        return x, w, b
    return None


def _packed(node: ir.Node) -> tuple[ir.Value, np.ndarray, np.ndarray] | None:
    """One ``x`` and the packed ``[W_q | W_k | W_v]``, ``[b_q | b_k | b_v]`` if Q, K, V are its projections."""
    parts = [_projection(v, node) if v is not None else None for v in node.inputs[:3]]
    if any(p is None for p in parts):
        return None
    xs = {id(p[0]) for p in parts if p is not None}
    widths = {p[1].shape[1] for p in parts if p is not None}
    if len(xs) != 1 or len(widths) != 1 or len({id(v) for v in node.inputs[:3]}) != 3:
        return None
    x = parts[0][0]  # type: ignore[index]
    if x.shape is None or len(x.shape) != 3 or x.dtype is None:
        return None
    dtype = x.dtype.numpy()
    w = np.concatenate([p[1] for p in parts], axis=1).astype(dtype)  # type: ignore[index]
    b = np.concatenate([p[2] for p in parts]).astype(dtype)  # type: ignore[index]
    return x, w, b


#: Lowerings of one pass run share what they build for the same input: key -> value.
Shared = dict[tuple[Any, ...], Any]


def _dim_key(dim: Any, owner: ir.Value) -> tuple[Any, ...]:
    """A key equal for two dims known to be equal: the int, the symbolic name, else the owning value."""
    if isinstance(dim, int):
        return ("int", dim)
    name = getattr(dim, "value", None)
    return ("sym", name) if name is not None else ("value", id(owner))


def _bias_for_kernel(bias: ir.Value, seq_of: ir.Value, new_nodes: list[ir.Node],
                     shared: Shared | None = None) -> ir.Value:
    """The additive bias as ONNX Runtime's kernels take it: rank 4 with dim 2 = the query length.

    The kernels broadcast dims 0 and 1 of ``attention_bias`` but not dim 2, so a key-padding bias
    ``[B, 1, 1, T]`` is expanded to ``[B, 1, S, T]`` (exactly the same values).  With ``shared``, an
    expansion of the same bias to a query length known to be equal (same static or symbolic dim)
    is built once and reused by every layer.
    """
    shape = bias.shape
    if shape is not None and len(shape) == 4 and seq_of.shape is not None and same_dim(shape[2], seq_of.shape[1]):
        return bias
    seq_dim = seq_of.shape[1] if seq_of.shape is not None and len(seq_of.shape) >= 2 else None
    key = ("bias_expansions", id(bias), *_dim_key(seq_dim, seq_of))
    if shared is not None and key in shared:
        return shared[key]

    ones = _const(new_nodes, np.array([1, 1], dtype=np.int64))
    one = _const(new_nodes, np.array([1], dtype=np.int64))
    seq = _add(new_nodes, "Gather", [_add(new_nodes, "Shape", [seq_of]), one], axis=0)
    out = _add(new_nodes, "Expand", [bias, _add(new_nodes, "Concat", [ones, seq, one], axis=0)])
    if shared is not None:
        shared[key] = out
    return out


# ---------------------------------------------------------------------------------------------
# key-padding masks: the additive bias traced back to a 2-D attention_mask input
# ---------------------------------------------------------------------------------------------

_INT_TYPES = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8,
              ir.DataType.BOOL}


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _unsqueeze_axes(node: ir.Node) -> list[int] | None:
    if "axes" in node.attributes:
        return [int(a) for a in node.attributes["axes"].value]
    arr = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if arr is None else [int(a) for a in arr.reshape(-1)]


def _mask_input(value: ir.Value | None, layout: tuple[str, ...]) -> ir.Value | None:
    """The 2-D ``[B, T]`` integer/bool graph input ``value`` is, through Cast and Unsqueeze, laid out as ``layout``.

    ``layout`` names the dims of ``value``: ``"b"``, ``"t"`` (the input's two dims) and ``"1"`` (an
    inserted unit dim).  Casts are allowed as the values they carry are 0/1 masks (every cast keeps 0
    and 1 apart).
    """
    dims: list[str] = list(layout)
    while value is not None and not value.is_graph_input():
        node = value.producer()
        if node is None or node.domain != "" or node.op_type not in ("Cast", "Unsqueeze"):
            return None
        if node.op_type == "Unsqueeze":
            axes = _unsqueeze_axes(node)
            if axes is None:
                return None
            axes = sorted(a + len(dims) if a < 0 else a for a in axes)
            if any(a >= len(dims) or dims[a] != "1" for a in axes):
                return None
            for a in reversed(axes):
                del dims[a]
        value = node.inputs[0]
    if value is None or dims != ["b", "t"] or value.dtype not in _INT_TYPES:
        return None
    if value.shape is not None and len(value.shape) != 2:
        return None
    return value


def _is_range_from_zero(value: ir.Value | None) -> ir.Node | None:
    """The ``Range(0, n, 1)`` node ``value`` is (through Unsqueeze only), else None."""
    while (node := _producer(value, "Unsqueeze")) is not None:
        value = node.inputs[0]
    rng = _producer(value, "Range")
    if rng is None or scalar_value(rng.inputs[0]) != 0 or scalar_value(rng.inputs[2]) != 1:
        return None
    return rng


def _all_true(value: ir.Value | None) -> bool:
    """Whether ``value`` is provably all true: a constant, ``And`` of such, ``Range(0, n, 1) >= 0``, an
    ``Expand``/``Unsqueeze``/``Reshape`` of such."""
    arr = constant_array(value)
    if arr is not None:
        return arr.dtype == np.bool_ and bool(arr.all())
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return False
    if node.op_type == "ConstantOfShape":
        fill = node.attributes.get("value")
        return fill is not None and fill.value.dtype == ir.DataType.BOOL and bool(fill.value.numpy().all())
    if node.op_type == "And":
        return _all_true(node.inputs[0]) and _all_true(node.inputs[1])
    if node.op_type in ("Expand", "Unsqueeze", "Reshape"):  # copies of the values (transformers 5.17 ViT's mask)
        return _all_true(node.inputs[0])
    if node.op_type == "Cast" and int(attr_value(node, "to", 0)) == ir.DataType.BOOL.value:
        return _all_true(node.inputs[0])  # true stays true
    if node.op_type == "GreaterOrEqual":
        bound = scalar_value(node.inputs[1])
        return bound is not None and bound <= 0 and _is_range_from_zero(node.inputs[0]) is not None
    return False


def is_zero_bias(value: ir.Value | None) -> bool:
    """Whether the additive bias ``value`` is provably all zero: a float constant of zeros, or
    ``Where(all true, zeros, _)`` (a key mask of only ones turned into a bias, as transformers 5.17 exports ViT)."""
    arr = constant_array(value)
    if arr is not None:
        return arr.dtype.kind == "f" and not np.any(arr)
    node = _producer(value, "Where")
    if node is None or not _all_true(node.inputs[0]):
        return False
    zero = constant_array(node.inputs[1])
    return zero is not None and zero.dtype.kind == "f" and not np.any(zero)


def _dim_of(value: ir.Value | None, axis: int) -> ir.Value | None:
    """The tensor whose dim ``axis`` the scalar ``value`` is (``Gather(Shape(x), axis)``), through Cast."""
    while (cast := _producer(value, "Cast")) is not None:
        value = cast.inputs[0]
    gather = _producer(value, "Gather")
    if gather is None or scalar_value(gather.inputs[1]) != axis or int(attr_value(gather, "axis", 0)) != 0:
        return None
    shape = _producer(gather.inputs[0], "Shape")
    if shape is None or "start" in shape.attributes or "end" in shape.attributes:
        return None
    x = shape.inputs[0]
    while (cast := _producer(x, "Cast")) is not None:
        x = cast.inputs[0]
    return x


def _gathered_padding(value: ir.Value | None) -> ir.Value | None:
    """The mask input of ``transformers``' index-based padding lookup, ``mask[b, t]`` laid out ``[B, 1, 1, T]``.

    ``Reshape(Reshape(Gather(Flatten(Cast(mask, bool), axis=2), b * T + t), [-1]), Shape(b * T + t))``
    where ``b`` is ``Range(0, B, 1)`` on axis 0 and ``t`` is ``Range(0, T, 1)`` on axis 3 of a
    rank-4 index, ``T`` the mask's dim 1 (``Flatten`` makes ``[B*T, 1]``).
    """
    outer = _producer(value, "Reshape")
    inner = _producer(outer.inputs[0], "Reshape") if outer is not None else None
    gather = _producer(inner.inputs[0], "Gather") if inner is not None else None
    if outer is None or inner is None or gather is None or int(attr_value(gather, "axis", 0)) != 0:
        return None
    flat = constant_array(inner.inputs[1])
    target = outer.inputs[1]
    if (concat := _producer(target, "Concat")) is not None and len(concat.inputs) == 1:
        target = concat.inputs[0]  # a Concat of one input is that input
    shape_of = _producer(target, "Shape")
    if flat is None or flat.reshape(-1).tolist() != [-1] or shape_of is None or shape_of.inputs[0] is not gather.inputs[1]:
        return None
    flatten = _producer(gather.inputs[0], "Flatten")
    if flatten is None or int(attr_value(flatten, "axis", 1)) != 2:
        return None
    cast = _producer(flatten.inputs[0], "Cast")
    if cast is None or int(attr_value(cast, "to", 0)) != ir.DataType.BOOL.value:
        return None
    mask = _mask_input(cast.inputs[0], ("b", "t"))
    add = _producer(gather.inputs[1], "Add")
    if mask is None or add is None:
        return None
    for t_idx, bt in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mul = _producer(bt, "Mul")
        if mul is None:
            continue
        for b_idx, t_len in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            t_rng, b_rng = _is_range_from_zero(t_idx), _is_range_from_zero(b_idx)
            if t_rng is None or b_rng is None or _range_axis(t_idx) != 3 or _range_axis(b_idx) != 0:
                continue
            if _dim_of(t_len, 1) is mask and _dim_of(t_rng.inputs[1], 1) is mask:
                return mask
    return None


def _range_axis(value: ir.Value | None) -> int | None:
    """The axis the 1-D ``Range`` under ``value`` lands on after the Unsqueezes between them (rank 4)."""
    unsqueezes = []
    while (node := _producer(value, "Unsqueeze")) is not None:
        unsqueezes.append(node)
        value = node.inputs[0]
    dims = ["r"]
    for node in reversed(unsqueezes):  # innermost first
        axes = _unsqueeze_axes(node)
        if axes is None:
            return None
        rank = len(dims) + len(axes)
        for ax in sorted(x + rank if x < 0 else x for x in axes):
            dims.insert(ax, "1")
    return dims.index("r") if len(dims) == 4 else None


def _keep(value: ir.Value | None) -> ir.Value | None:
    """The mask input if ``value`` (bool, broadcastable to ``[B, 1, S, T]``) is ``mask[b, t] != 0`` for every s."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return None
    if node.op_type == "Expand":  # broadcasting copies values; the kernel broadcasts over S and heads itself
        return _keep(node.inputs[0])
    if node.op_type == "And":
        a, b = node.inputs[0], node.inputs[1]
        if _all_true(a):
            return _keep(b)
        if _all_true(b):
            return _keep(a)
        return None
    if node.op_type == "Cast" and int(attr_value(node, "to", 0)) == ir.DataType.BOOL.value:
        # a cast of a keep mask to bool keeps it; a cast of the mask to bool is mask != 0
        return _keep(node.inputs[0]) or _mask_input(node.inputs[0], ("b", "1", "1", "t"))
    if node.op_type == "Unsqueeze" and value is not None and value.dtype == ir.DataType.BOOL:
        return _mask_input(value, ("b", "1", "1", "t"))  # a bool mask input
    return _gathered_padding(value)


def _padding_mask(bias: ir.Value) -> tuple[ir.Value, float] | None:
    """``(mask, c)`` if ``bias[b, :, s, t]`` is 0 where the 2-D input ``mask[b, t]`` is 1 and ``c`` where it is 0.

    The forms traced: ``(1 - float(mask[:, None, None, :])) * c`` (``transformers`` before 4.48) and
    ``Where(keep, 0, c)`` with ``keep`` a bool cast of ``mask[:, None, None, :]`` or ``transformers``'
    index-based padding lookup, possibly And-ed with provably all-true terms and expanded.  ``c`` must
    be a negative scalar.  Exact for 0/1 masks, the contract of ``attention_mask``.
    """
    node = bias.producer()
    if node is None or node.domain != "" or bias.dtype not in FLOAT_TYPES:
        return None
    mask: ir.Value | None = None
    c: float | None = None
    if node.op_type == "Mul":
        for x, k in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            sub = _producer(x, "Sub")
            c = scalar_value(k)
            if sub is None or c is None or scalar_value(sub.inputs[0]) != 1.0:
                continue
            if sub.inputs[1] is not None and sub.inputs[1].dtype == bias.dtype:
                mask = _mask_input(sub.inputs[1], ("b", "1", "1", "t"))
            if mask is not None:
                break
    elif node.op_type == "Where" and scalar_value(node.inputs[1]) == 0.0:
        c = scalar_value(node.inputs[2])
        mask = _keep(node.inputs[0])
    if mask is None or c is None or not c < 0 or not math.isfinite(c):
        return None
    return mask, c


def _mask_index(mask: ir.Value, new_nodes: list[ir.Node], shared: Shared | None) -> ir.Value:
    """``mask`` as the int32 ``mask_index`` ONNX Runtime's Attention takes (built once per mask)."""
    if mask.dtype == ir.DataType.INT32:
        return mask
    key = ("mask_index_casts", id(mask))
    if shared is not None and key in shared:
        return shared[key]
    out = _add(new_nodes, "Cast", [mask], to=ir.DataType.INT32.value)
    if shared is not None:
        shared[key] = out
    return out


def _replace(node: ir.Node, new_nodes: list[ir.Node], ctx: LoweringContext) -> None:
    """The last new node gives the op's output (the ones before it build its inputs)."""
    for i, n in enumerate(new_nodes[:-1]):
        n.name = f"{node.name or node.op_type}/{i}"
    last = new_nodes[-1]
    replace_node(node, new_nodes, [last.outputs[0]], ctx.target)
    last.name = node.name or node.op_type


def _key_lengths(mask: ir.Value, new_nodes: list[ir.Node], shared: Shared | None) -> ir.Value:
    """``ReduceSum(mask, axis 1)`` as int32 ``[B]``: the key lengths of a right-padded 0/1 mask (built once)."""
    key = ("mask_lengths", id(mask))
    if shared is not None and key in shared:
        return shared[key]
    as_int = _mask_index(mask, new_nodes, shared)
    out = _add(new_nodes, "ReduceSum", [as_int, _const(new_nodes, np.array([1], dtype=np.int64))], keepdims=0)
    if shared is not None:
        shared[key] = out
    return out


def _nan_to_zero(y: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    """``Where(IsNaN(y), 0, y)``: a query row whose every key is masked with -inf gives 0, as in the original.

    The zero has ``y``'s element type (float16 after the ``fp16`` pass), so ``y.dtype`` must be set.
    """
    dtype = y.dtype.numpy() if y.dtype is not None else np.float32
    zero = _const(new_nodes, np.array(0, dtype=dtype))
    return _add(new_nodes, "Where", [_add(new_nodes, "IsNaN", [y]), zero, y])


def _repeat_heads(x: ir.Value, groups: int, rep: int, new_nodes: list[ir.Node], shared: Shared | None) -> ir.Value:
    """``[B, T, G*D]`` -> ``[B, T, G*rep*D]``, each head repeated ``rep`` times in place."""
    key = ("kv_repeats", id(x), rep)
    if shared is not None and key in shared:
        return shared[key]

    def const(vals: list[int]) -> ir.Value:
        return _const(new_nodes, np.array(vals, dtype=np.int64))

    x5 = _add(new_nodes, "Reshape", [x, const([0, 0, groups, 1, -1])])  # [B, T, G, 1, D]
    big = _add(new_nodes, "Expand", [x5, const([1, 1, 1, rep, 1])])  # broadcast: [B, T, G, rep, D]
    out = _add(new_nodes, "Reshape", [big, const([0, 0, -1])])
    if shared is not None:
        shared[key] = out
    return out


def _repeat_heads_bnsh(x: ir.Value, heads: int, rep: int, new_nodes: list[ir.Node], shared: Shared | None) -> ir.Value:
    """``[B, G, T, D]`` (a KV cache's Concat, the exporter's own layout) -> ``[B, G*rep, T, D]``, each head
    repeated ``rep`` times in place: MultiHeadAttention reads 4-D K/V as ``[B, N, T, D]``, so the cache is not
    transposed to ``[B, T, N*D]`` first."""
    key = ("kv_repeats", id(x), rep)
    if shared is not None and key in shared:
        return shared[key]
    x5 = _add(new_nodes, "Unsqueeze", [x, _const(new_nodes, np.array([2], dtype=np.int64))])  # [B, G, 1, T, D]
    big = _add(new_nodes, "Expand", [x5, _const(new_nodes, np.array([1, 1, rep, 1, 1], dtype=np.int64))])
    dim = x.shape[3] if x.shape is not None and len(x.shape) == 4 and isinstance(x.shape[3], int) else -1
    if dim == -1:  # head size unknown statically: merge (G, rep) by the element count, keeping T from the input
        t = _add(new_nodes, "Shape", [x], start=2)
        target_v = _add(new_nodes, "Concat", [_const(new_nodes, np.array([0, heads], dtype=np.int64)), t], axis=0)
    else:
        target_v = _const(new_nodes, np.array([0, heads, -1, dim], dtype=np.int64))
    out = _add(new_nodes, "Reshape", [big, target_v])
    if shared is not None:
        shared[key] = out
    return out


def _add(new_nodes: list[ir.Node], op_type: str, inputs: list[ir.Value], **attrs: Any) -> ir.Value:
    """A new default-domain node appended to ``new_nodes``; its first output."""
    n = ir.node(op_type, inputs, attributes=attrs)
    new_nodes.append(n)
    return n.outputs[0]


def _const(new_nodes: list[ir.Node], arr: np.ndarray) -> ir.Value:
    return _add(new_nodes, "Constant", [], value=ir.tensor(arr))


# ---------------------------------------------------------------------------------------------
# causal masks, KV caches: what the kernels do themselves
# ---------------------------------------------------------------------------------------------


def _and_leaves(value: ir.Value | None) -> list[ir.Value | None]:
    """The terms of a tree of ``And`` (an ``Expand`` only broadcasts: looked through)."""
    node = value.producer() if value is not None else None
    if node is not None and node.domain == "" and node.op_type == "Expand":
        return _and_leaves(node.inputs[0])
    if node is not None and node.domain == "" and node.op_type == "And":
        return _and_leaves(node.inputs[0]) + _and_leaves(node.inputs[1])
    return [value]


def _seq_dim(value: ir.Value | None, shared: Shared | None = None, axis: int = 1) -> Any:
    """Dim ``axis`` of a ``[B, S, .]`` value, looking through rotary embeddings (which keep the shape): a
    ``mograph.RotaryEmbedding`` node, or one inlined in this run (noted in ``shared``)."""
    for _ in range(8):
        if value is None:
            return None
        x = shared.get(("rotary_outputs", id(value))) if shared is not None else None
        node = value.producer()
        if x is None and node is not None and node.op_type == "RotaryEmbedding":
            x = node.inputs[0]
        if x is None:
            break
        value = x
    return value.shape[axis] if value is not None and value.shape is not None and len(value.shape) == 3 else None


def _is_causal_term(term: ir.Value | None, q: ir.Value, k: ir.Value, shared: Shared | None) -> bool:
    """Whether ``term`` is ``kv_idx <= q_idx`` over ``[1, 1, S, S]``, both ``Range(0, S, 1)`` of one S.

    ``kv_idx`` lies on axis 3, ``q_idx`` on axis 2 (Unsqueezes of a 1-D Range); the two Ranges are one node,
    share their end, or each has a length provably the query length, which is provably the key length (same
    static or symbolic dim), so the term is exactly the lower-triangular mask a causal kernel applies.
    """
    node = term.producer() if term is not None else None
    if node is None or node.domain != "" or node.op_type not in ("LessOrEqual", "GreaterOrEqual"):
        return False
    kv_idx, q_idx = node.inputs[0], node.inputs[1]
    if node.op_type == "GreaterOrEqual":
        kv_idx, q_idx = q_idx, kv_idx
    kv_rng, q_rng = _is_range_from_zero(kv_idx), _is_range_from_zero(q_idx)
    if kv_rng is None or q_rng is None or _range_axis(kv_idx) != 3 or _range_axis(q_idx) != 2:
        return False
    s_q, s_k = _seq_dim(q, shared), _seq_dim(k, shared)
    if not same_dim(s_q, s_k) or not any(same_dim(n, s_q) for n in _range_lengths(q_rng)):
        return False
    return kv_rng is q_rng or kv_rng.inputs[1] is q_rng.inputs[1] or any(
        same_dim(n, s_q) for n in _range_lengths(kv_rng))


def _range_lengths(rng: ir.Node) -> list[Any]:
    """Dims known equal to the length of ``Range(0, n, 1)``: its output's dim, and the dim ``n`` is read from
    (``Gather(Shape(x), i)`` or ``Shape(x, start=i, end=i+1)``, through Cast/Squeeze/Unsqueeze/Reshape)."""
    out = [rng.outputs[0].shape[0]] if rng.outputs[0].shape is not None and len(rng.outputs[0].shape) == 1 else []
    end = rng.inputs[1]
    while (node := end.producer() if end is not None else None) is not None and node.domain == "" and \
            node.op_type in ("Cast", "Squeeze", "Unsqueeze", "Reshape"):
        end = node.inputs[0]
    node = end.producer() if end is not None else None
    if node is not None and node.domain == "" and node.op_type == "Shape":
        start, stop = node.attributes.get("start"), node.attributes.get("end")
        x = node.inputs[0]
        if start is not None and stop is not None and int(stop.value) == int(start.value) + 1 and x is not None \
                and x.shape is not None and 0 <= int(start.value) < len(x.shape):
            out.append(x.shape[int(start.value)])
    x = _dim_of(end, 1)
    if x is not None and x.shape is not None and len(x.shape) >= 2:
        out.append(x.shape[1])
    return out


def _causal(bias: ir.Value, q: ir.Value, k: ir.Value, shared: Shared | None) -> tuple[ir.Value | None] | None:
    """``(mask,)`` if ``bias`` is ``Where(causal & keep, 0, c)`` with ``c < 0``: ``mask`` the 2-D key-padding input
    that ``keep`` reads (``None``: causal only, every other term provably all true); else None."""
    node = bias.producer()
    if node is None or node.domain != "" or node.op_type != "Where" or scalar_value(node.inputs[1]) != 0.0:
        return None
    c = scalar_value(node.inputs[2])
    if c is None or not c < 0:
        return None
    leaves = [t for t in _and_leaves(node.inputs[0]) if not _all_true(t)]
    causal = [t for t in leaves if _is_causal_term(t, q, k, shared)]
    rest = [t for t in leaves if t not in causal]
    if not causal or len(rest) > 1:
        return None
    if not rest:
        return (None,)
    mask = _keep(rest[0])
    return None if mask is None else (mask,)


def _kv_cache(kv: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """``(past, new, concat)`` if ``kv`` is ``Reshape(Transpose(Concat(past, new, axis=2), [0, 2, 1, 3]), [0, 0, -1])``:
    a KV cache, ``past`` a ``[B, G, P, D]`` graph input, ``new`` the step's ``[B, G, S, D]`` heads."""
    reshape = _producer(kv, "Reshape")
    transpose = _producer(reshape.inputs[0], "Transpose") if reshape is not None else None
    if reshape is None or transpose is None or list(attr_value(transpose, "perm", [])) != [0, 2, 1, 3]:
        return None
    target = constant_array(reshape.inputs[1])
    if target is None or target.reshape(-1).tolist() != [0, 0, -1]:
        return None
    concat = _producer(transpose.inputs[0], "Concat")
    if concat is None or len(concat.inputs) != 2 or int(attr_value(concat, "axis", 0)) not in (2, -2):
        return None
    past, new = concat.inputs
    if past is None or new is None or not past.is_graph_input() or past.shape is None or len(past.shape) != 4:
        return None
    return past, new, concat.outputs[0]


def _heads_to_bsh(new: ir.Value, new_nodes: list[ir.Node]) -> ir.Value:
    """``[B, G, S, D]`` heads as ``[B, S, G*D]``: the exporter's own ``[B, S, G*D]`` value where the heads are
    ``Transpose(Reshape(x, [0, 0, G, D]), [0, 2, 1, 3])`` of it, else Transpose + Reshape."""
    transpose = _producer(new, "Transpose")
    reshape = _producer(transpose.inputs[0], "Reshape") if transpose is not None else None
    if transpose is not None and reshape is not None and list(attr_value(transpose, "perm", [])) == [0, 2, 1, 3]:
        x = reshape.inputs[0]
        target = _shape_entries(reshape.inputs[1])
        if x is not None and target is not None and _splits_last_dim(x, target):
            return x
    t = _add(new_nodes, "Transpose", [new], perm=[0, 2, 1, 3])
    return _add(new_nodes, "Reshape", [t, _const(new_nodes, np.array([0, 0, -1], dtype=np.int64))])


def _shape_entries(target: ir.Value | None) -> list[Any] | None:
    """The entries of a Reshape target: ints where constant, ``(z, i)`` where an entry is ``Gather(Shape(z), i)``
    (through Unsqueeze, inside a Concat of 1-D pieces); None when neither."""
    arr = constant_array(target)
    if arr is not None:
        return [int(a) for a in arr.reshape(-1)]
    concat = _producer(target, "Concat")
    if concat is None:
        return None
    out: list[Any] = []
    for piece in concat.inputs:
        arr = constant_array(piece)
        if arr is not None:
            out.extend(int(a) for a in arr.reshape(-1))
            continue
        v = piece
        while (node := _producer(v, "Unsqueeze")) is not None:
            v = node.inputs[0]
        sliced = _producer(v, "Shape")  # Shape(z, start=i, end=i+1): dynamo's read of one dim
        if sliced is not None and "start" in sliced.attributes and "end" in sliced.attributes:
            start, end = int(attr_value(sliced, "start", 0)), int(attr_value(sliced, "end", 0))
            if start >= 0 and end == start + 1:
                out.append((sliced.inputs[0], start))
                continue
        gather = _producer(v, "Gather")
        shape = _producer(gather.inputs[0], "Shape") if gather is not None else None
        axis = scalar_value(gather.inputs[1]) if gather is not None else None
        if shape is None or axis is None or "start" in shape.attributes or "end" in shape.attributes:
            return None
        out.append((shape.inputs[0], int(axis)))
    return out


def _same_leading_dim(z: ir.Value | None, x: ir.Value, i: int) -> bool:
    """Whether dim ``i`` of ``z`` is dim ``i`` of ``x``: the same value, outputs of one Split on another
    axis, or one static / named dim."""
    if z is None:
        return False
    if z is x:
        return True
    split = z.producer()
    if split is not None and split is x.producer() and split.op_type == "Split" and split.domain == "":
        axis = int(attr_value(split, "axis", 0))
        rank = len(x.shape) if x.shape is not None else None
        return rank is not None and (axis + rank if axis < 0 else axis) != i
    return (z.shape is not None and x.shape is not None and i < len(z.shape) and i < len(x.shape)
            and same_dim(z.shape[i], x.shape[i]) and not str(x.shape[i]).startswith("unk__"))


def _splits_last_dim(x: ir.Value, target: list[Any]) -> bool:
    """Whether ``Reshape(x, target)`` of a ``[B, S, G*D]`` ``x`` only splits its last dim: ``target`` is
    ``[b, s, g, d]`` where ``b``/``s`` are each ``0``, the static dim, or ``x``'s own dim read by ``Shape``
    (:func:`_same_leading_dim`), or one of them ``-1`` then determined, and ``g * d`` is the (static) last dim
    (one of ``g``/``d`` may be ``-1`` when ``b`` and ``s`` are both kept)."""
    if x.shape is None or len(x.shape) != 3 or len(target) != 4:
        return False
    last = x.shape[2]
    if not isinstance(last, int) or last <= 0:
        return False
    kept = [t == 0 or (isinstance(t, int) and isinstance(x.shape[i], int) and t == x.shape[i])
            or (isinstance(t, tuple) and _same_leading_dim(t[0], x, i)) for i, t in enumerate(target[:2])]
    g, d = target[2], target[3]
    if not isinstance(g, int) or not isinstance(d, int):
        return False
    if g > 0 and d > 0:
        return g * d == last and (all(kept) or (sum(t == -1 for t in target[:2]) == 1 and any(kept)))
    if all(kept) and sorted([g, d])[0] == -1 and max(g, d) > 0:
        return last % max(g, d) == 0
    return False


def _gqa_lengths(q: ir.Value, total_of: ir.Value, total_axis: int, extra: ir.Value | None,
                 lengths: ir.Value | None, new_nodes: list[ir.Node], shared: Shared | None) -> tuple[ir.Value, ir.Value]:
    """GroupQueryAttention's ``seqlens_k`` (int32 ``[B]``: keys per row minus one) and ``total_sequence_length``
    (int32 scalar): the total is dim ``total_axis`` of ``total_of`` (plus dim 1 of ``extra``: the step's
    length after a cache), ``seqlens_k`` is ``lengths - 1`` (right-padding key lengths) or ``total - 1`` for
    every row.  Built once per total / lengths."""
    key = ("gqa_lengths", id(total_of), total_axis, id(extra), id(lengths))
    if shared is not None and key in shared:
        return shared[key]  # type: ignore[no-any-return]
    total = _add(new_nodes, "Gather", [_add(new_nodes, "Shape", [total_of]),
                                        _const(new_nodes, np.array(total_axis, dtype=np.int64))], axis=0)
    if extra is not None:
        step = _add(new_nodes, "Gather", [_add(new_nodes, "Shape", [extra]), _const(new_nodes, np.array(1, dtype=np.int64))],
                    axis=0)
        total = _add(new_nodes, "Add", [total, step])
    total = _add(new_nodes, "Cast", [total], to=ir.DataType.INT32.value)
    one = _const(new_nodes, np.array(1, dtype=np.int32))
    if lengths is not None:
        seqlens = _add(new_nodes, "Sub", [lengths, one])
    else:
        batch = _add(new_nodes, "Slice", [_add(new_nodes, "Shape", [q]), _const(new_nodes, np.array([0], dtype=np.int64)),
                                          _const(new_nodes, np.array([1], dtype=np.int64))])
        seqlens = _add(new_nodes, "Expand", [_add(new_nodes, "Sub", [total, one]), batch])
    if shared is not None:
        shared[key] = (seqlens, total)
    return seqlens, total


def _present_outputs(graph: ir.Graph, kernel: ir.Node, concats: tuple[ir.Value, ...],
                     news: tuple[ir.Value, ...] | None = None) -> None:
    """The kernel's ``present_key`` / ``present_value`` (or ``news``) take the place (and names) of the exporter's
    Concats (or other present computations), which are removed (with what only they read)."""
    for old, new in zip(concats, news if news is not None else kernel.outputs[1:3]):
        new.shape = old.shape
        if old.dtype is not None:
            new.dtype = old.dtype
        if old.is_graph_output():
            name = old.name
            old.name = f"{name}_replaced"
            new.name = name
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    remove_dead_producers(graph, list(concats))


def _finish(node: ir.Node, kernel: ir.Node, q: ir.Value, new_nodes: list[ir.Node], ctx: LoweringContext) -> bool:
    """Append the kernel (its output typed as ``q``; the NaN guard where asked) and replace ``node``."""
    if q.dtype is not None:  # ONNX's inference does not know contrib ops; the Where after it needs it
        kernel.outputs[0].dtype = q.dtype
    new_nodes.append(kernel)
    if int(attr_value(node, "nan_to_zero", 0)):
        _nan_to_zero(kernel.outputs[0], new_nodes)
    _replace(node, new_nodes, ctx)
    return True


def _kernel(op_type: str, inputs: list[ir.Value | None], attrs: dict[str, Any], outputs: int = 1) -> ir.Node:
    while inputs and inputs[-1] is None:
        inputs.pop()
    return ir.node(op_type, inputs, attributes=attrs, domain=MS_DOMAIN, num_outputs=outputs)


#: GroupQueryAttention's CPU kernel takes head sizes that are multiples of 8 only
GQA_HEAD_MULTIPLE = 8


def _gqa_head_ok(q: ir.Value, heads: int, shared: Shared | None) -> bool:
    width = _seq_dim(q, shared, axis=2)
    return isinstance(width, int) and width % heads == 0 and (width // heads) % GQA_HEAD_MULTIPLE == 0


def _lower_cached(node: ir.Node, ctx: LoweringContext, heads: int, kv_heads: int, attrs: dict[str, Any]) -> bool:
    """A decode step over a KV cache: the past goes into the kernel, whose present outputs replace the Concats.

    ``MultiHeadAttention(q, k_new, v_new, attention_bias=M, past_key, past_value)`` when every query head has
    its K/V head (exact: ``M`` is the bias itself); ``GroupQueryAttention`` for grouped heads only when there is
    no bias and the step is provably one token (its implicit causal mask then hides nothing: the one query sees
    all ``P + 1`` keys).  GroupQueryAttention's ``attention_bias`` would be exact on CPU, but ONNX Runtime's CUDA
    kernel refuses that input, and ``seqlens_k`` is exact for no padding pattern a decode step has (a left-padded
    row's new key sits after its padding), so a masked grouped step declines (False): the exporter's Concat
    and the K/V repeat stay."""
    q, k, v, bias = node.inputs
    assert q is not None and k is not None and v is not None and bias is not None
    ck, cv = _kv_cache(k), _kv_cache(v)
    if ck is None or cv is None:
        return False
    if kv_heads != heads and not (is_zero(bias) and same_dim(_seq_dim(q, ctx.shared), 1)
                                  and _gqa_head_ok(q, heads, ctx.shared)):
        return False  # (nothing built yet: what is built lands in ``shared``)
    new_nodes: list[ir.Node] = []
    ab = None if is_zero(bias) else _bias_for_kernel(bias, q, new_nodes, ctx.shared)
    k_new, v_new = _heads_to_bsh(ck[1], new_nodes), _heads_to_bsh(cv[1], new_nodes)
    if kv_heads == heads:
        kernel = _kernel("MultiHeadAttention", [q, k_new, v_new, None, None, ab, ck[0], cv[0]], attrs, outputs=3)
    else:
        seqlens, total = _gqa_lengths(q, ck[0], 2, q, None, new_nodes, ctx.shared)
        kernel = _kernel("GroupQueryAttention", [q, k_new, v_new, ck[0], cv[0], seqlens, total],
                         {**attrs, "kv_num_heads": kv_heads}, outputs=3)
    graph = node.graph
    assert graph is not None
    _finish(node, kernel, q, new_nodes, ctx)  # first: the old K/V reshapes read the Concats, and die with the node
    _present_outputs(graph, kernel, (ck[2], cv[2]))
    ctx.count("attention.kv_cache")
    return True


def _lower_ort(node: ir.Node, ctx: LoweringContext) -> bool:
    """``com.microsoft`` Attention / MultiHeadAttention / GroupQueryAttention (see the module docstring)."""
    q, k, v, bias = node.inputs
    graph = node.graph
    assert graph is not None and q is not None and k is not None and v is not None and bias is not None
    heads = int(attr_value(node, "num_heads", 1))
    kv_heads = int(attr_value(node, "kv_num_heads", 0)) or heads
    attrs: dict[str, Any] = {"num_heads": heads, "scale": float(attr_value(node, "scale", 1.0))}
    if _lower_gqa(node, ctx, heads, kv_heads, attrs["scale"]):
        return True
    if node.metadata_props.get(KV_CACHE_KEY) == "shared" and _kv_cache(k) is not None:
        raise PassFailedError("lower", f"--kv-cache shared: attention '{node.name}' over a KV cache cannot become "
                              "GroupQueryAttention with rotary inside (run with -vv for why; after fp16 the past inputs must feed it "
                              "directly: --fp16-io yes); drop --kv-cache shared")
    if _lower_cached(node, ctx, heads, kv_heads, attrs):
        return True
    fmt = node.metadata_props.get(MASK_FORMAT_KEY, "bias")
    new_nodes: list[ir.Node] = []
    causal = None if is_zero(bias) else _causal(bias, q, k, ctx.shared)
    if causal is not None and kv_heads != heads and not _gqa_head_ok(q, heads, ctx.shared):
        causal = None
    if causal is not None and causal[0] is not None and fmt != "lengths":
        causal = None  # causal + key padding: a kernel mask only as (right-padding) lengths
    lengths = _key_lengths(causal[0], new_nodes, ctx.shared) if causal is not None and causal[0] is not None else None
    if causal is not None:  # the kernel's own causal mask replaces the bias
        ctx.count("attention.causal")
        if kv_heads != heads:
            seqlens, total = _gqa_lengths(q, k, 1, None, lengths, new_nodes, ctx.shared)
            kernel = _kernel("GroupQueryAttention", [q, k, v, None, None, seqlens, total],
                             {**attrs, "kv_num_heads": kv_heads}, outputs=3)
            return _finish(node, kernel, q, new_nodes, ctx)
        attrs["unidirectional"] = 1
        bias = None
    elif kv_heads != heads:  # MultiHeadAttention has one K/V head per query head: repeat them (as repeat_kv does)
        ck, cv = _kv_cache(k), _kv_cache(v)
        if ck is not None and cv is not None:  # a (masked) decode step: the cache itself, [B, G, P+S, D]
            k = _repeat_heads_bnsh(ck[2], heads, heads // kv_heads, new_nodes, ctx.shared)
            v = _repeat_heads_bnsh(cv[2], heads, heads // kv_heads, new_nodes, ctx.shared)
        else:
            k = _repeat_heads(k, kv_heads, heads // kv_heads, new_nodes, ctx.shared)
            v = _repeat_heads(v, kv_heads, heads // kv_heads, new_nodes, ctx.shared)
    padding = None if bias is None or is_zero(bias) or fmt == "bias" else _padding_mask(bias)
    if padding is not None:  # raw: the [B, T] mask, masked scores filled with mask_filter_value;
        mask, attrs["mask_filter_value"] = padding  # lengths: the 1-D [B] right-padding key lengths
        lengths = (_key_lengths(mask, new_nodes, ctx.shared) if fmt == "lengths"
                   else _mask_index(mask, new_nodes, ctx.shared))
    packed = _packed(node) if kv_heads == heads else None
    seq_of = packed[0] if packed is not None else q
    ab = None if bias is None or is_zero(bias) or padding is not None else _bias_for_kernel(bias, seq_of, new_nodes,
                                                                                             ctx.shared)
    if packed is not None:  # self-attention: one [hidden, 3*H*D] GEMM for Q, K and V inside the kernel
        x, w, b = packed
        wv = add_initializer(graph, "mograph_qkv_weight", w)
        bv = add_initializer(graph, "mograph_qkv_bias", b)
        kernel = _kernel("Attention", [x, wv, bv, lengths, None, ab], attrs)
    else:
        qkv_bias = _split_bias(node, q, k, v) if kv_heads == heads else None
        kernel = _kernel("MultiHeadAttention", [q, k, v, qkv_bias, lengths, ab], attrs)
        if qkv_bias is not None:
            ctx.count("attention.qkv_bias")
    return _finish(node, kernel, q, new_nodes, ctx)


def _split_bias(node: ir.Node, q: ir.Value, k: ir.Value, v: ir.Value) -> ir.Value | None:
    """MultiHeadAttention's ``bias`` input (``[3*H]``, added to Q, K, V inside the kernel) taken off the
    projection, where Q, K, V are the three equal parts of one ``Split`` on the last axis of ``Reshape(Gemm(x, W,
    b))`` or ``Add(y, b)`` (GPT-2's Conv1D: ONNX Runtime's CUDA Gemm copies a bias into its output before each
    GEMM, a full extra pass over ``[B*S, 3*H]``), with ``b`` a constant ``[3*H]`` and nothing but this node (and
    ``Shape`` reads) reading the parts: the Gemm loses its ``C`` (or the Add its use) and the kernel adds ``b``.
    Mutates the graph only when it returns the bias."""
    split = q.producer()
    if (split is None or split.op_type != "Split" or split.domain != "" or len(split.outputs) != 3
            or list(split.outputs) != [q, k, v]):
        return None
    x = split.inputs[0]
    if x is None or x.shape is None or not isinstance(x.shape[-1], int) or x.shape[-1] % 3:
        return None
    width = x.shape[-1]
    axis = int(attr_value(split, "axis", 0))
    if axis not in (-1, len(x.shape) - 1):
        return None
    parts = constant_array(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
    if parts is None and "split" in split.attributes:  # opset < 13: the sizes are an attribute
        parts = np.array(list(split.attributes["split"].value))
    if len(split.inputs) > 1 and split.inputs[1] is not None and parts is None:
        return None  # sizes computed at run time
    if parts is not None and parts.reshape(-1).tolist() != [width // 3] * 3:
        return None
    for out in split.outputs:
        if any(u.node is not node and u.node.op_type != "Shape" for u in out.uses()):
            return None

    def sole_reader(value: ir.Value, reader: ir.Node) -> bool:
        return all(u.node is reader or u.node.op_type == "Shape" for u in value.uses()) and not value.is_graph_output()

    def bias_of(value: ir.Value | None) -> np.ndarray | None:
        arr = constant_array(value)
        return arr if arr is not None and arr.ndim == 1 and arr.shape[0] == width else None

    producer = x.producer()
    if producer is not None and producer.op_type == "Add" and producer.domain == "" and sole_reader(x, split):
        for i in (0, 1):
            b = bias_of(producer.inputs[1 - i])
            y = producer.inputs[i]
            if b is not None and y is not None and y.shape is not None and list(y.shape) == list(x.shape):
                split.replace_input_with(0, y)
                return _bias_value(node, b)
        return None
    if producer is None or producer.op_type != "Reshape" or producer.inputs[0] is None:
        return None
    gemm = producer.inputs[0].producer()
    if (gemm is None or gemm.op_type != "Gemm" or gemm.domain != "" or len(gemm.inputs) != 3
            or not sole_reader(x, split) or not sole_reader(gemm.outputs[0], producer)
            or int(attr_value(gemm, "transA", 0)) or float(attr_value(gemm, "alpha", 1.0)) != 1.0
            or float(attr_value(gemm, "beta", 1.0)) != 1.0):
        return None
    b = bias_of(gemm.inputs[2])
    if b is None:
        return None
    gemm.resize_inputs(2)
    return _bias_value(node, b)


def _bias_value(node: ir.Node, b: np.ndarray) -> ir.Value:
    graph = node.graph
    assert graph is not None
    return add_initializer(graph, "mograph_qkv_bias", b)


def _decomposed(node: ir.Node, ctx: LoweringContext) -> bool:
    """Below opset 23: the computation written out for this call's attributes (heads split by ``Reshape``
    with 0-copied dims, no grouped-head repeat, no NaN guard unless asked), as small as an exporter's own
    graph; grouped-query calls take the general function body instead."""
    q, k, v, bias = (list(node.inputs) + [None] * 4)[:4]
    heads = int(attr_value(node, "num_heads", 1))
    qdtype = q.dtype if q is not None else None
    if q is None or k is None or v is None or qdtype is None or qdtype not in FLOAT_TYPES:
        return False
    if (int(attr_value(node, "kv_num_heads", 0)) or heads) != heads:
        return False
    dtype = qdtype.numpy()
    new_nodes: list[ir.Node] = []

    def add(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        return _add(new_nodes, op_type, list(inputs), **attrs)

    def const(arr: np.ndarray) -> ir.Value:
        return _const(new_nodes, arr)

    split = const(np.array([0, 0, heads, -1], dtype=np.int64))
    qh = add("Transpose", add("Reshape", q, split), perm=[0, 2, 1, 3])
    kt = add("Transpose", add("Reshape", k, split), perm=[0, 2, 3, 1])
    vh = add("Transpose", add("Reshape", v, split), perm=[0, 2, 1, 3])
    scores = add("MatMul", qh, kt)
    scale = float(attr_value(node, "scale", 1.0))
    if scale != 1.0:
        scores = add("Mul", scores, const(np.array(scale, dtype=dtype)))
    if bias is not None and not is_zero(bias):
        scores = add("Add", scores, bias)
    probs = add("Softmax", scores, axis=-1)
    if int(attr_value(node, "nan_to_zero", 0)):
        probs = add("Where", add("IsNaN", probs), const(np.array(0, dtype=dtype)), probs)
    out = add("Transpose", add("MatMul", probs, vh), perm=[0, 2, 1, 3])
    y = add("Reshape", out, const(np.array([0, 0, -1], dtype=np.int64)))
    y.dtype = qdtype
    _replace(node, new_nodes, ctx)
    return True


def _lower_onnx(node: ir.Node, ctx: LoweringContext) -> bool:
    """The standard ``Attention`` (opset >= 23), 3-D inputs, additive ``attn_mask``; below 23 the
    computation written out (:func:`_decomposed`)."""
    if ctx.opset < ONNX_ATTENTION_OPSET:
        return _decomposed(node, ctx)
    q, k, v, bias = node.inputs
    assert q is not None
    heads = int(attr_value(node, "num_heads", 1))
    new_nodes: list[ir.Node] = []
    inputs: list[ir.Value | None] = [q, k, v]
    if not is_zero(bias):
        inputs.append(_bias_for_kernel(bias, q, new_nodes, ctx.shared))  # type: ignore[arg-type]
    kv_heads = int(attr_value(node, "kv_num_heads", 0)) or heads
    att = ir.node("Attention", inputs, attributes={"q_num_heads": heads, "kv_num_heads": kv_heads,
                                                   "scale": float(attr_value(node, "scale", 1.0))})
    return _finish(node, att, q, new_nodes, ctx)


def _inline(node: ir.Node, ctx: LoweringContext) -> bool:
    return ctx.inline(node)


def _note_rotary(node: ir.Node, uses: list[Any], x: ir.Value | None, ctx: LoweringContext) -> None:
    """Note which value now stands for the rotated X (``rotary_outputs`` in ``ctx.shared``): the attention
    lowering after it reads X's shape (the result's, by the op's contract) to prove a causal mask's length."""
    if x is not None and uses:
        user, index = uses[0]
        new = user.inputs[index]
        if new is not None:
            ctx.shared[("rotary_outputs", id(new))] = x


def _half_angles(t: ir.Value | None) -> tuple[ir.Value, str, float | None] | None:
    """``(f, "Cos"|"Sin", c)`` if ``t`` is ``Unsqueeze(Cos(Concat(f, f, axis=-1)) [* c], axis 1)``: the rank-3
    ``[Bc, S, D/2]`` angles ``f`` of an export's rotary table laid out ``[Bc, 1, S, D]`` (``c`` a scalar constant,
    transformers' ``attention_scaling``), so ``cos[..., :D/2] == cos[..., D/2:] == Cos(f) * c``."""
    unsq = _producer(t, "Unsqueeze")
    if unsq is None or _unsqueeze_axes(unsq) != [1]:
        return None
    value, c = unsq.inputs[0], None
    if (mul := _producer(value, "Mul")) is not None:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            k = scalar_value(b)
            prod = a.producer() if a is not None else None
            if k is not None and prod is not None and prod.op_type in ("Cos", "Sin"):
                value, c = a, k
                break
        else:
            return None
    trig = value.producer() if value is not None else None
    if trig is None or trig.domain != "" or trig.op_type not in ("Cos", "Sin"):
        return None
    concat = _producer(trig.inputs[0], "Concat")
    if concat is None or len(concat.inputs) != 2 or concat.inputs[0] is not concat.inputs[1]:
        return None
    f = concat.inputs[0]
    if f is None or f.shape is None or len(f.shape) != 3 or int(attr_value(concat, "axis", 0)) not in (-1, 2):
        return None
    return f, trig.op_type, c


def _removed(value: ir.Value) -> bool:
    """Whether the node that computed ``value`` was taken out of the graph."""
    node = value.producer()
    return node is not None and node.graph is None


def _lower_rotary_ort(node: ir.Node, ctx: LoweringContext) -> bool:
    """``com.microsoft.RotaryEmbedding`` where the export's cos/sin are provably ``Cos/Sin(Concat(f, f))`` of
    one rank-3 angle table ``f`` ``[Bc, S, D/2]`` (laid out ``[Bc, 1, S, D]``): the caches are ``Cos(f)``,
    ``Sin(f)`` (times the scaling constant) reshaped to ``[Bc*S, D/2]``, and each token's position id is its
    row in them (``b*S + s``, expanded over the batch when ``Bc`` is 1), so every token gets exactly the cos/sin
    the export computed, whatever its positions were.  Else the body, inlined."""
    x, cos, sin = node.inputs
    uses = list(node.outputs[0].uses())
    heads = int(attr_value(node, "num_heads", 1))
    hc, hs = _half_angles(cos), _half_angles(sin)
    width = x.shape[2] if x is not None and x.shape is not None and len(x.shape) == 3 else None
    half_dim = hc[0].shape[2] if hc is not None and hc[0].shape is not None else None
    if (x is None or hc is None or hs is None or hc[0] is not hs[0] or hc[1] != "Cos" or hs[1] != "Sin"
            or hc[2] != hs[2] or not isinstance(width, int) or width % heads
            or not isinstance(half_dim, int) or 2 * half_dim != width // heads):
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
            caches.append(_add(new_nodes, "Reshape", [t, flat]))
        cos_cache, sin_cache = caches
        lead = _add(new_nodes, "Slice", [_add(new_nodes, "Shape", [f]), _const(new_nodes, np.array([0], dtype=np.int64)),
                                         _const(new_nodes, np.array([2], dtype=np.int64))])  # [Bc, S]
        rows = _add(new_nodes, "ReduceProd", [lead], keepdims=0)
        ids = _add(new_nodes, "Range", [_const(new_nodes, np.array(0, dtype=np.int64)), rows,
                                        _const(new_nodes, np.array(1, dtype=np.int64))])
        positions = _add(new_nodes, "Reshape", [ids, lead])  # [Bc, S]: row b*S + s
        ctx.shared[key] = (cos_cache, sin_cache, positions)
    batch_seq = _add(new_nodes, "Slice", [_add(new_nodes, "Shape", [x]), _const(new_nodes, np.array([0], dtype=np.int64)),
                                          _const(new_nodes, np.array([2], dtype=np.int64))])
    pos = _add(new_nodes, "Expand", [positions, batch_seq])
    kernel = _kernel("RotaryEmbedding", [x, pos, cos_cache, sin_cache], {"num_heads": heads, "interleaved": 0})
    kernel.outputs[0].shape = x.shape
    if x.dtype is not None:
        kernel.outputs[0].dtype = x.dtype
    new_nodes.append(kernel)
    _replace(node, new_nodes, ctx)
    ctx.count("rotary.kernel")
    if kernel.outputs[0].shape is None:  # the replaced output's unknown shape came over: the op keeps X's
        kernel.outputs[0].shape = x.shape
    _notes(ctx)[id(kernel.outputs[0])] = (x, f, scale, heads)
    _note_rotary(node, uses, x, ctx)
    return True


# ---------------------------------------------------------------------------------------------
# decoders: GroupQueryAttention with the rotary embedding inside (do_rotary)
# ---------------------------------------------------------------------------------------------

#: rows of the cos/sin caches GroupQueryAttention's ``do_rotary`` reads (positions 0 .. MAX-1): option ``--max-length``
GQA_MAX_LENGTH = 4096


def _notes(ctx: LoweringContext) -> dict[int, Any]:
    """ONNX Runtime RotaryEmbedding kernels built in this run: id(output) -> (x, f, scale, num_heads)."""
    notes = getattr(ctx, "_rotary_kernels", None)
    if notes is None:
        notes = {}
        setattr(ctx, "_rotary_kernels", notes)  # noqa: B010  # a per-run note, not a field of the context
    return notes


def _through_unsqueeze(value: ir.Value | None, base: ir.Value, rank: int) -> int | None:
    """The axis that the 1-D ``base`` lands on in ``value`` (``Unsqueeze``s of ``base``, rank ``rank``), else None."""
    chain = []
    while value is not None and value is not base:
        node = _producer(value, "Unsqueeze")
        if node is None:
            return None
        chain.append(node)
        value = node.inputs[0]
    if value is None:
        return None
    dims = ["r"]
    for node in reversed(chain):
        axes = _unsqueeze_axes(node)
        if axes is None:
            return None
        new_rank = len(dims) + len(axes)
        for ax in sorted(a + new_rank if a < 0 else a for a in axes):
            dims.insert(ax, "1")
    return dims.index("r") if len(dims) == rank else None


#: in-memory note on a past input renamed to ``max_sequence_length`` (``--kv-cache shared``): its dim before
_PAST_DIM_META = "mograph.past_dim"


def _past_length_of(value: ir.Value | None, past: ir.Value | None) -> bool:
    """Whether the scalar ``value`` is dim 2 (the past length) of a ``[B, G, P, D]`` graph input whose P is the
    same dim as ``past``'s."""
    while (cast := _producer(value, "Cast")) is not None:
        value = cast.inputs[0]
    node = value.producer() if value is not None else None
    src: ir.Value | None = None
    if node is not None and node.domain == "" and node.op_type == "Squeeze":
        value = node.inputs[0]
        node = value.producer() if value is not None else None
        if node is not None and node.op_type == "Shape" and int(attr_value(node, "start", 0)) == 2 \
                and int(attr_value(node, "end", 0)) == 3:
            src = node.inputs[0]
    elif node is not None and node.domain == "" and node.op_type == "Gather" and scalar_value(node.inputs[1]) == 2:
        shape = _producer(node.inputs[0], "Shape")
        if shape is not None and not shape.attributes and int(attr_value(node, "axis", 0)) == 0:
            src = shape.inputs[0]
    if src is None or past is None or not src.is_graph_input() or src.shape is None or len(src.shape) != 4:
        return False
    if past.shape is None or len(past.shape) != 4:
        return False
    return same_dim(src.meta.get(_PAST_DIM_META, src.shape[2]), past.meta.get(_PAST_DIM_META, past.shape[2]))


def _positions(pos: ir.Value | None, q: ir.Value, past: ir.Value | None) -> bool:
    """Whether the 1-D ``pos`` is ``P + s`` for every query position ``s``: ``Range(0, S, 1)`` (no cache) or
    ``Range(0, S, 1) + P`` with ``P`` the cache's past length, ``S`` provably the query length."""
    rng = _producer(pos, "Range")
    offset = None
    if rng is None and (add := _producer(pos, "Add")) is not None and past is not None:
        for a, b in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            if _producer(a, "Range") is not None and _past_length_of(b, past):
                rng, offset = _producer(a, "Range"), b
                break
    if rng is None or scalar_value(rng.inputs[0]) != 0 or scalar_value(rng.inputs[2]) != 1:
        return False
    if (offset is None) != (past is None):
        return False
    return any(same_dim(n, _seq_dim(q)) for n in _range_lengths(rng))


def _angle_factors(f: ir.Value) -> list[tuple[ir.Value, np.ndarray, int]]:
    """The ways the angle table ``f`` ``[B, S, D/2]`` may be ``positions x inv_freq``: ``(value, inv_freq, axis)``
    with ``value`` the float positions laid out with S on ``axis``.  Two spellings: ``Mul(pos[B, S, 1], inv[D/2])``
    and the outer product ``Transpose(MatMul(inv[1, D/2, 1], pos[B, 1, S]), perm=[0, 2, 1])`` (transformers 5.17's
    rotary, ``inv`` ``Expand``-ed over the batch: a matrix product over an inner dimension of one, the same values in
    every batch row)."""
    out = []
    mul = _producer(f, "Mul")
    if mul is not None:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            inv = constant_array(b)
            if a is not None and inv is not None and inv.ndim == 1:
                out.append((a, inv, 1))
    tr = _producer(f, "Transpose")
    if tr is not None and list(attr_value(tr, "perm", [])) == [0, 2, 1]:
        mm = _producer(tr.inputs[0], "MatMul")
        left = mm.inputs[0] if mm is not None else None
        if (ex := _producer(left, "Expand")) is not None:  # inv broadcast over the batch: the same values per row
            left = ex.inputs[0]
        inv = constant_array(left) if left is not None else None
        if mm is not None and mm.inputs[1] is not None and inv is not None and inv.ndim == 3 \
                and inv.shape[0] == 1 and inv.shape[2] == 1:
            out.append((mm.inputs[1], inv.reshape(-1), 2))
    return out


def _rotary_positions(f: ir.Value, q: ir.Value, past: ir.Value | None) -> tuple[ir.Value, np.ndarray] | None:
    """``(pos, inv_freq)`` if the angle table ``f`` ``[1, S, D/2]`` is ``pos[s] * inv_freq[i]`` (``Cast(pos)`` laid
    out ``[1, S, 1]`` times a constant 1-D ``inv_freq``, or the outer-product spelling of :func:`_angle_factors`)
    with ``pos`` the query positions ``P + s``."""
    for factor, inv, axis in _angle_factors(f):
        if inv.dtype not in (np.float32, np.float16):
            continue
        cast = _producer(factor, "Cast")  # (float16 after the fp16 pass)
        if cast is None or int(attr_value(cast, "to", 0)) not in (ir.DataType.FLOAT.value, ir.DataType.FLOAT16.value):
            continue
        value = cast.inputs[0]
        pos = value
        while (un := _producer(pos, "Unsqueeze")) is not None:
            pos = un.inputs[0]
        if pos is None or _through_unsqueeze(value, pos, 3) != axis or not _positions(pos, q, past):
            continue
        return pos, inv
    return None


def _gathernd_padding(value: ir.Value | None, kv_idx: ir.Value) -> ir.Value | None:
    """The mask input of dynamo's padding lookup ``GatherND(Cast(mask, bool), [b, t])`` where the index pairs are
    ``Concat(Unsqueeze(Expand(b_idx), -1), Unsqueeze(Expand(kv_idx), -1), axis=-1)``: ``b_idx`` a ``Range(0, B, 1)``
    on axis 0 and ``kv_idx`` the causal term's own key index (axis 3)."""
    node = _producer(value, "GatherND")
    if node is None or int(attr_value(node, "batch_dims", 0)) != 0:
        return None
    cast = _producer(node.inputs[0], "Cast")
    if cast is None or int(attr_value(cast, "to", 0)) != ir.DataType.BOOL.value:
        return None
    mask = _mask_input(cast.inputs[0], ("b", "t"))
    concat = _producer(node.inputs[1], "Concat")
    if mask is None or concat is None or len(concat.inputs) != 2 or int(attr_value(concat, "axis", 0)) != -1:
        return None
    picked = []
    for piece in concat.inputs:
        un = _producer(piece, "Unsqueeze")
        ex = _producer(un.inputs[0], "Expand") if un is not None else None
        if un is None or ex is None or _unsqueeze_axes(un) != [-1]:
            return None
        picked.append(ex.inputs[0])
    b_idx, t_idx = picked
    if t_idx is not kv_idx or _is_range_from_zero(b_idx) is None or _range_axis(b_idx) != 0:
        return None
    return mask


def _query_length_of(value: ir.Value | None, q: ir.Value) -> bool:
    """Whether the scalar ``value`` reads dim 1 of a tensor whose dim 1 is the query length (``Gather(Shape(z), 1)``
    or ``Shape(z, start=1, end=2)``, through Cast/Squeeze/Unsqueeze)."""
    while (node := value.producer() if value is not None else None) is not None and node.domain == "" and \
            node.op_type in ("Cast", "Squeeze", "Unsqueeze"):
        value = node.inputs[0]
    node = value.producer() if value is not None else None
    z = None
    if node is not None and node.op_type == "Shape" and int(attr_value(node, "start", 0)) == 1 \
            and int(attr_value(node, "end", 0)) == 2:
        z = node.inputs[0]
    elif node is not None and node.op_type == "Gather":
        z = _dim_of(value, 1)
    return z is not None and z.shape is not None and len(z.shape) >= 2 and same_dim(z.shape[1], _seq_dim(q))


def _past_plus_query(rng: ir.Node, past: ir.Value | None, q: ir.Value) -> bool:
    """Whether ``Range(0, n, 1)``'s ``n`` is ``P + S``: the cache's past length plus the query length."""
    add = _producer(rng.inputs[1], "Add")
    if add is None or past is None:
        return False
    a, b = add.inputs[0], add.inputs[1]
    return (_past_length_of(a, past) and _query_length_of(b, q)) or (_past_length_of(b, past) and _query_length_of(a, q))


def _causal_from(bias: ir.Value, pos: ir.Value, keys: Any, past: ir.Value | None = None,
                 q: ir.Value | None = None) -> tuple[ir.Value | None] | None:
    """``(mask,)`` if ``bias`` is ``Where(kv_idx <= pos[s] [& mask[b, kv_idx]] [& all true], 0, c)``, ``c < 0``, with
    ``pos`` the query positions (on axis 2) and ``kv_idx`` a ``Range(0, n, 1)`` on axis 3 whose length is provably
    ``keys`` (the key count) or is the same dim; ``mask`` is None when there is no padding term."""
    node = _producer(bias, "Where")
    if node is None or scalar_value(node.inputs[1]) != 0.0:
        return None
    c = scalar_value(node.inputs[2])
    if c is None or not c < 0:
        return None
    leaves = [t for t in _and_leaves(node.inputs[0]) if not _all_true(t)]
    kv_idx = None
    rest = []
    for leaf in leaves:
        le = leaf.producer() if leaf is not None else None
        if le is not None and le.domain == "" and le.op_type in ("LessOrEqual", "GreaterOrEqual") and kv_idx is None:
            a, b = le.inputs[0], le.inputs[1]
            if le.op_type == "GreaterOrEqual":
                a, b = b, a
            rng = _is_range_from_zero(a)
            if (rng is not None and _range_axis(a) == 3 and b is not None and _through_unsqueeze(b, pos, 4) == 2
                    and (any(same_dim(n, keys) for n in _range_lengths(rng)) or q is not None and _past_plus_query(rng, past, q))):
                kv_idx = a
                continue
        rest.append(leaf)
    if kv_idx is None or len(rest) > 1:
        return None
    if not rest:
        return (None,)
    mask = _keep(rest[0])
    if mask is None:  # dynamo's GatherND lookup of the key index the causal term uses
        mask = _gathernd_padding(rest[0], kv_idx)
    if mask is None:  # TorchScript's flat lookup, its Reshapes merged by cleanup
        mask = _flat_padding(rest[0], kv_idx)
    return None if mask is None else (mask,)


def _flat_padding(value: ir.Value | None, kv_idx: ir.Value) -> ir.Value | None:
    """The mask input of ``Reshape(Gather(Flatten(Cast(mask, bool), axis=2), kv_idx + b_idx * T), [0, 1, 1, 0])``
    (``allowzero`` 0; or TorchScript's ``Reshape(Reshape(., [-1]), Shape(index))``): ``mask[b, t]`` laid out
    ``[B, 1, 1, T]`` with ``kv_idx`` the causal term's key index (axis 3),
    ``b_idx`` a ``Range(0, B, 1)`` on axis 0 and ``T`` the mask's dim 1."""
    reshape = _producer(value, "Reshape")
    if reshape is None or int(attr_value(reshape, "allowzero", 0)):
        return None
    target = constant_array(reshape.inputs[1])
    inner = _producer(reshape.inputs[0], "Reshape")
    flat = constant_array(inner.inputs[1]) if inner is not None else None
    if inner is not None and flat is not None and flat.reshape(-1).tolist() == [-1]:
        gather = _producer(inner.inputs[0], "Gather")  # Reshape(Reshape(g, [-1]), Shape(index)): the index's shape
        outer_target = reshape.inputs[1]
        if (concat := _producer(outer_target, "Concat")) is not None and len(concat.inputs) == 1:
            outer_target = concat.inputs[0]
        shape_of = _producer(outer_target, "Shape")
        if gather is None or shape_of is None or shape_of.attributes or shape_of.inputs[0] is not gather.inputs[1]:
            return None
    elif target is not None and target.reshape(-1).tolist() == [0, 1, 1, 0]:
        gather = _producer(reshape.inputs[0], "Gather")  # [B, 1, 1, T, 1] -> [B, 1, 1, T]
    else:
        return None
    flatten = _producer(gather.inputs[0], "Flatten") if gather is not None else None
    cast = _producer(flatten.inputs[0], "Cast") if flatten is not None else None
    if gather is None or flatten is None or cast is None or int(attr_value(gather, "axis", 0)) != 0 \
            or int(attr_value(flatten, "axis", 1)) != 2 or int(attr_value(cast, "to", 0)) != ir.DataType.BOOL.value:
        return None
    mask = _mask_input(cast.inputs[0], ("b", "t"))
    add = _producer(gather.inputs[1], "Add")
    if mask is None or add is None:
        return None
    for t_idx, bt in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mul = _producer(bt, "Mul")
        if t_idx is not kv_idx or mul is None:
            continue
        for b_idx, t_len in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            if _is_range_from_zero(b_idx) is None or _range_axis(b_idx) != 0:
                continue
            shape = _producer(t_len, "Shape")
            if shape is not None and shape.inputs[0] is mask and int(attr_value(shape, "start", 0)) == 1 \
                    and int(attr_value(shape, "end", 2)) == 2:
                return mask
            if _dim_of(t_len, 1) is mask:
                return mask
    return None


def _projection_of(x: ir.Value) -> tuple[ir.Value, np.ndarray, np.ndarray | None] | None:
    """``(h, W, b)`` if ``x`` is ``h @ W`` or ``h @ W + b`` with constant 2-D ``W`` (and 1-D ``b``)."""
    node = x.producer()
    if node is None or node.domain != "":
        return None
    bias = None
    if node.op_type == "Add":
        for mm_in, b_in in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            if _producer(mm_in, "MatMul") is not None and constant_array(b_in) is not None:
                bias = constant_array(b_in)
                node = mm_in.producer()  # type: ignore[union-attr]
                break
        else:
            return None
    if node is None or node.op_type != "MatMul" or node.domain != "":
        return None
    w = constant_array(node.inputs[1])
    h = node.inputs[0]
    if w is None or h is None or w.ndim != 2 or (bias is not None and (bias.ndim != 1 or bias.shape[0] != w.shape[1])):
        return None
    return h, w, bias


def _packed_qkv(xs: list[ir.Value], graph: ir.Graph, new_nodes: list[ir.Node]) -> ir.Value | None:
    """One ``h @ [W_q | W_k | W_v] (+ [b_q | b_k | b_v])`` where Q, K, V are projections of one ``h``, read by
    nothing else than what this lowering replaces (checked by the caller)."""
    parts = [_projection_of(x) for x in xs]
    if any(p is None for p in parts) or len({id(p[0]) for p in parts if p is not None}) != 1:
        return None
    h = parts[0][0]  # type: ignore[index]
    if h.dtype is None:
        return None
    dtype = h.dtype.numpy()
    w = np.concatenate([p[1] for p in parts], axis=1).astype(dtype)  # type: ignore[index]
    out = _add(new_nodes, "MatMul", [h, add_initializer(graph, "mograph_qkv_weight", w)])
    if any(p[2] is not None for p in parts):  # type: ignore[index]
        b = np.concatenate([p[2] if p[2] is not None else np.zeros(p[1].shape[1], dtype)  # type: ignore[index]
                            for p in parts]).astype(dtype)
        out = _add(new_nodes, "Add", [out, add_initializer(graph, "mograph_qkv_bias", b)])
    return out


def _present_value_output(graph: ir.Graph, v: ir.Value) -> ir.Value | None:
    """The graph output that is ``Transpose(Reshape(v, [b, s, G, D]), [0, 2, 1, 3])``: the prefill's present value."""
    return next((out for out in graph.outputs if _is_head_split(out, v)), None)


def _is_head_split(x: ir.Value, v: ir.Value) -> bool:
    """``x`` is ``Transpose(Reshape(v, [b, s, G, D]), [0, 2, 1, 3])`` with the Reshape only splitting ``v``'s last dim."""
    tr = _producer(x, "Transpose")
    rs = _producer(tr.inputs[0], "Reshape") if tr is not None else None
    if tr is None or rs is None or list(attr_value(tr, "perm", [])) != [0, 2, 1, 3] or rs.inputs[0] is not v:
        return False
    target = _shape_entries(rs.inputs[1])
    return target is not None and _splits_last_dim(v, target)


def _present_key_output(graph: ir.Graph, k: ir.Value, f: ir.Value, scale: float | None) -> ir.Value | None:
    """The graph output that is the exporter's rotated ``[B, G, S, D]`` keys: ``rotate(Transpose(Reshape(k)))`` with
    cos/sin ``Unsqueeze(Cos/Sin(Concat(f, f)) [* c], 1)`` of the same angle table: the prefill's present key."""
    from mograph.passes.fusion.attention import _rotary  # the fusion's own proof of transformers' rotate_half form

    for out in graph.outputs:
        rot = _rotary(out) if out.producer() is not None else None
        if rot is None:
            continue
        x, cos, sin = rot
        hc, hs = _half_angles(cos), _half_angles(sin)
        if hc is None or hs is None or hc[0] is not f or hs[0] is not f or (hc[1], hs[1]) != ("Cos", "Sin"):
            continue
        if hc[2] != scale or hs[2] != scale:
            continue
        if _is_head_split(x, k):
            return out
    return None


def _rotated_split(heads: ir.Value, notes: dict[int, Any]) -> ir.Value | None:
    """The rotated ``[B, S, G*D]`` keys ``r`` if ``heads`` is ``Transpose(Reshape(r, [0, 0, G, D]), [0, 2, 1, 3])``
    (as the fusion rebuilds a decode step's new keys) with ``r`` a noted RotaryEmbedding kernel's output."""
    tr = _producer(heads, "Transpose")
    rs = _producer(tr.inputs[0], "Reshape") if tr is not None else None
    if tr is None or rs is None or list(attr_value(tr, "perm", [])) != [0, 2, 1, 3]:
        return None
    r, target = rs.inputs[0], constant_array(rs.inputs[1])
    note = notes.get(id(r)) if r is not None else None
    if note is None or target is None or int(attr_value(rs, "allowzero", 0)):
        return None
    x = note[0]
    width = x.shape[2] if x.shape is not None and len(x.shape) == 3 else None
    t = target.reshape(-1).tolist()
    if len(t) != 4 or t[:2] != [0, 0] or not isinstance(width, int) or t[2] * t[3] != width or min(t[2:]) <= 0:
        return None
    return r


def _no_gqa(node: ir.Node, why: str) -> bool:
    logger.debug("%s: no GroupQueryAttention with rotary: %s", node.name, why)
    return False


def _lower_gqa(node: ir.Node, ctx: LoweringContext, heads: int, kv_heads: int, scale: float) -> bool:
    """A decoder's causal self-attention with rotary embeddings on Q and K -> ``GroupQueryAttention`` with the
    rotary inside (``do_rotary``, cos/sin caches as initializers), Q/K/V packed into one MatMul where they are
    projections of one tensor, the KV cache (if any) as its past/present, ``seqlens_k`` / ``total_sequence_length``
    from the ``attention_mask``.  See the module docstring for when it applies and what it assumes."""
    q, k, v, bias = node.inputs
    graph = node.graph
    assert graph is not None and q is not None and k is not None and v is not None and bias is not None
    shared = node.metadata_props.get(KV_CACHE_KEY) == "shared"
    fmt = "lengths" if shared else node.metadata_props.get(MASK_FORMAT_KEY, "bias")
    if fmt == "raw" or heads % kv_heads:
        return _no_gqa(node, "--mask-format raw, or query heads not a multiple of the K/V heads")
    ck, cv = _kv_cache(k), _kv_cache(v)
    if (ck is None) != (cv is None):
        return _no_gqa(node, "only one of K and V comes from a cache")
    notes = _notes(ctx)
    k_rot = _rotated_split(ck[1], notes) if ck is not None else k
    if k_rot is None:
        return _no_gqa(node, "the step's new keys are not a plain head split of the rotated projection")
    new_nodes: list[ir.Node] = []
    v_new = _heads_to_bsh(cv[1], new_nodes) if cv is not None else v  # (a Transpose + Reshape where not provable)
    rq, rk = notes.get(id(q)), notes.get(id(k_rot))
    if rq is None or rk is None or rq[1] is not rk[1] or rq[2] != rk[2] or (rq[3], rk[3]) != (heads, kv_heads):
        return _no_gqa(node, "Q and K are not rotated by ONNX Runtime RotaryEmbedding kernels of one angle table")
    xq, f, rscale, _ = rq
    xk = rk[0]
    if xq.shape is None or len(xq.shape) != 3 or not isinstance(xq.shape[2], int) or xq.dtype is None:
        return _no_gqa(node, "the query's hidden size is not static")
    head_size = xq.shape[2] // heads
    if head_size % GQA_HEAD_MULTIPLE or f.shape is None or len(f.shape) != 3 or f.shape[2] != head_size // 2:
        return _no_gqa(node, f"head size {head_size} not a multiple of {GQA_HEAD_MULTIPLE}, or a partial rotary")
    past = ck[0] if ck is not None else None
    rp = _rotary_positions(f, xq, past)
    if rp is None:  # (found: f is [1, S, D/2] by construction, a 1-D pos unsqueezed to rank 3 times a 1-D inv_freq)
        return _no_gqa(node, "the rotary angles are not provably (past + s) * inv_freq")
    pos, inv = rp
    keys = ck[2].shape[2] if ck is not None and ck[2].shape is not None else _seq_dim(xq)
    causal = _causal_from(bias, pos, keys, past, xq)
    if causal is None:
        return _no_gqa(node, "the bias is not provably causal (and a key-padding mask)")
    mask = causal[0]
    if mask is not None and fmt != "lengths":
        return _no_gqa(node, "a padding mask: GroupQueryAttention's lengths assume it all ones (--mask-format lengths)")
    if mask is None and ck is not None:
        return _no_gqa(node, "a cache step without a mask to take the lengths from")
    # the caches: cos/sin of position p (rows 0 .. max-1), computed as the export does (float32 p * inv_freq)
    max_len = int(node.metadata_props.get("mograph.gqa_max_length", GQA_MAX_LENGTH))
    key = ("gqa_rotary_caches", id(f), rscale)
    if key not in ctx.shared:
        angles = np.arange(max_len, dtype=np.float32)[:, None] * inv.astype(np.float32)[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        if rscale is not None:
            cos, sin = cos * np.float32(rscale), sin * np.float32(rscale)
        dtype = xq.dtype.numpy()
        ctx.shared[key] = (add_initializer(graph, "mograph_gqa_cos_cache", cos.astype(dtype)),
                           add_initializer(graph, "mograph_gqa_sin_cache", sin.astype(dtype)))
    cos_cache, sin_cache = ctx.shared[key]
    if mask is not None:
        seqlens, total = _mask_lengths_for_gqa(mask, new_nodes, ctx.shared)
    else:  # no padding: every row holds all S keys
        seqlens, total = _gqa_lengths(xq, xq, 1, None, None, new_nodes, ctx.shared)
    present_k = _present_key_output(graph, xk, f, rscale) if ck is None else None
    present_v = _present_value_output(graph, v_new) if ck is None else None
    logger.debug("%s: present outputs found: key %s, value %s", node.name, present_k, present_v)
    packed = _packed_qkv([xq, xk, v_new], graph, new_nodes)
    qkv: list[ir.Value | None] = [packed, None, None] if packed is not None else [xq, xk, v_new]
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": scale, "do_rotary": 1, "rotary_interleaved": 0}
    kernel = _kernel("GroupQueryAttention", [*qkv, past, cv[0] if cv is not None else None, seqlens, total,
                                             cos_cache, sin_cache], attrs, outputs=3)
    # no NaN guard: the causal mask leaves every query row its own key (a row of length 0 is outside the contract)
    for out in kernel.outputs:
        out.dtype = xq.dtype
    new_nodes.append(kernel)
    _replace(node, new_nodes, ctx)
    if ck is not None and cv is not None:
        _present_outputs(graph, kernel, (ck[2], cv[2]))
        ctx.count("attention.kv_cache")
        if shared:  # one [B, G, max_sequence_length, D] buffer bound as both past and present
            for past_v, present in ((ck[0], kernel.outputs[1]), (cv[0], kernel.outputs[2])):
                for val in (past_v, present):
                    if val.shape is not None and len(val.shape) == 4:
                        dims = list(val.shape)
                        val.meta[_PAST_DIM_META] = dims[2]  # the other layers' proofs compare past lengths
                        dims[2] = ir.SymbolicDim("max_sequence_length")
                        val.shape = ir.Shape(dims)
            ctx.count("attention.kv_cache_shared")
    else:
        for old, new in ((present_k, kernel.outputs[1]), (present_v, kernel.outputs[2])):
            if old is not None:
                _present_outputs(graph, kernel, (old,), (new,))
    ctx.count("attention.gqa_rotary")
    if packed is not None:
        ctx.count("attention.packed_qkv")
    ctx.stats["rotary.kernel"] = ctx.stats.get("rotary.kernel", 0) - 2  # both went into the kernel
    return True


def _mask_lengths_for_gqa(mask: ir.Value, new_nodes: list[ir.Node], shared: Shared) -> tuple[ir.Value, ir.Value]:
    """``seqlens_k = ReduceSum(int32(mask), 1) - 1`` and ``total_sequence_length = int32(Shape(mask)[1])``, built once
    per mask (as ONNX Runtime GenAI feeds them)."""
    key = ("gqa_mask_lengths", id(mask))
    if key in shared:
        return shared[key]  # type: ignore[no-any-return]
    lengths = _key_lengths(mask, new_nodes, shared)
    seqlens = _add(new_nodes, "Sub", [lengths, _const(new_nodes, np.array(1, dtype=np.int32))])
    total = _add(new_nodes, "Cast", [_add(new_nodes, "Shape", [mask], start=1, end=2)], to=ir.DataType.INT32.value)
    total = _add(new_nodes, "Squeeze", [total, _const(new_nodes, np.array([0], dtype=np.int64))])
    shared[key] = (seqlens, total)
    return seqlens, total


LOWERINGS: dict[str, dict[str, Lowering]] = {
    "Attention": {"ort": _lower_ort, "onnx": _lower_onnx, "tensorrt": _inline},
    # ort: com.microsoft.RotaryEmbedding over the export's own angle table where it is provably one; else (and
    # for the other targets) the body, rotating X in its [B, S, N, D] view (no transpose of X)
    "RotaryEmbedding": {"ort": _lower_rotary_ort, "onnx": _inline, "tensorrt": _inline},
}
