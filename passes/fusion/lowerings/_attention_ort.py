"""ONNX Runtime forms of ``mograph.Attention``: ``com.microsoft`` Attention (packed QKV), MultiHeadAttention
(bias, key lengths or raw mask; past/present), GroupQueryAttention for a causal mask or an unmasked grouped decode
step, and the helpers that build their inputs once per run.  When which form is taken:
:mod:`mograph.passes.fusion.lowerings.attention`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.lowerings.attention_proofs import (
    Shapes,
    Shared,
    _keep,
    _kv_cache,
    _producer,
    _seq_dim,
    _splits_last_dim,
)

from mograph.cuda_graph import HOST_INPUTS
from mograph.irutil import add_initializer, attr_value, is_zero
from mograph.lowering import LoweringContext, replace_node
from mograph.patterns import constant_array, remove_dead_producers
from mograph.shapes import Dim

logger = logging.getLogger(__name__)


MS_DOMAIN = "com.microsoft"


def _bias_for_kernel(bias: ir.Value, seq_of: ir.Value, new_nodes: list[ir.Node], shapes: Shapes,
                     shared: Shared | None = None) -> ir.Value:
    """The additive bias as ONNX Runtime's kernels take it: rank 4 with dim 2 = the query length.

    The kernels broadcast dims 0 and 1 of ``attention_bias`` but not dim 2, so a key-padding bias
    ``[B, 1, 1, T]`` is expanded to ``[B, 1, S, T]`` (exactly the same values).  With ``shared``, an
    expansion of the same bias to a query length known to be equal (same static or symbolic dim)
    is built once and reused by every layer.  Whether dim 2 already is the query length, and which lengths are
    known equal: the shape query's.
    """
    bias_dims, seq_dims = shapes.dims(bias), shapes.dims(seq_of)
    if bias_dims is not None and len(bias_dims) == 4 and seq_dims is not None and len(seq_dims) >= 2 \
            and bias_dims[2] is not None and bias_dims[2] == seq_dims[1]:
        return bias
    # Keyed by the query length as spelled on ``seq_of`` (a literal or a dim name, else this value's alone).  The
    # query's own proof (``spelled=False``) would also share an expansion where the rules derive the lengths equal
    # without shape inference (dynamic bert_tiny: one for both layers, 6 nodes fewer, the same outputs).
    key = ("bias_expansions", id(bias), shapes.dim_key(seq_of, 1, spelled=True))
    if shared is not None and key in shared:
        return shared[key]

    ones = _const(new_nodes, np.array([1, 1], dtype=np.int64))
    one = _const(new_nodes, np.array([1], dtype=np.int64))
    seq = _add(new_nodes, "Gather", [_add(new_nodes, "Shape", [seq_of]), one], axis=0)
    out = _add(new_nodes, "Expand", [bias, _add(new_nodes, "Concat", [ones, seq, one], axis=0)])
    if shared is not None:
        shared[key] = out
    return out


def host_computed(value: ir.Value) -> bool:
    """Whether ``value``'s data is computed from shape values (a ``Shape``/``Size`` read, or a ``Range``) through
    inputs that ONNX Runtime's CUDA kernels read from device memory (:data:`mograph.cuda_graph.HOST_INPUTS` names
    the others: a shape given to ``Expand`` or ``Reshape`` costs no copy).  Such a value is built on the host and
    copied to the device (a ``Memcpy``): a graph that holds it cannot be captured as a CUDA graph."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        node = stack.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        if domain == "" and node.op_type in ("Shape", "Size", "Range"):
            return True
        host = HOST_INPUTS.get((domain, node.op_type), frozenset())
        stack.extend(v for i, v in enumerate(node.inputs) if v is not None and i not in host)
    return False


def device_padding_bias(bias: ir.Value, new_nodes: list[ir.Node], shapes: Shapes, shared: Shared | None
                        ) -> ir.Value | None:
    """``bias = Where(keep, a, b)`` whose ``keep`` is proved to be ``mask[b, t] != 0`` for every head and query
    (:func:`~.attention_proofs._keep`: a bool cast of the 2-D mask input, or transformers' index-based padding lookup
    as TorchScript or dynamo trace it, And-ed with provably all-true terms) as ``Where(Unsqueeze(bool(mask), [1,
    2]), a, b)`` ``[B, 1, 1, T]``, with ``a`` and ``b`` the very values of ``bias`` (any constants, ``-inf`` too): the
    same numbers, built from the mask input on the device (once per bias).  None where ``bias`` is not such a
    ``Where``."""
    where = _producer(bias, "Where")
    if where is None or where.inputs[1] is None or where.inputs[2] is None:
        return None
    key = ("device_padding_bias", id(bias))
    if shared is not None and key in shared:
        return shared[key]  # type: ignore[no-any-return]
    mask = _keep(where.inputs[0], shapes)
    if mask is None:
        return None
    keep = mask if mask.dtype == ir.DataType.BOOL else _add(new_nodes, "Cast", [mask], to=ir.DataType.BOOL.value)
    keep = _add(new_nodes, "Unsqueeze", [keep, _const(new_nodes, np.array([1, 2], dtype=np.int64))])
    out = _add(new_nodes, "Where", [keep, where.inputs[1], where.inputs[2]])
    out.type = bias.type

    def unit(v: ir.Value) -> bool:
        return v.shape is not None and all(d == 1 for d in v.shape)

    if mask.shape is not None and len(mask.shape) == 2 and unit(where.inputs[1]) and unit(where.inputs[2]):
        out.shape = ir.Shape([mask.shape[0], 1, 1, mask.shape[1]])  # (larger a / b broadcast it further)
    if shared is not None:
        shared[key] = out
    return out


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


def _repeat_heads_bnsh(x: ir.Value, heads: int, rep: int, new_nodes: list[ir.Node], shared: Shared | None,
                       shapes: Shapes) -> ir.Value:
    """``[B, G, T, D]`` (a KV cache's Concat, the exporter's own layout) -> ``[B, G*rep, T, D]``, each head
    repeated ``rep`` times in place: MultiHeadAttention reads 4-D K/V as ``[B, N, T, D]``, so the cache is not
    transposed to ``[B, T, N*D]`` first."""
    key = ("kv_repeats", id(x), rep)
    if shared is not None and key in shared:
        return shared[key]
    x5 = _add(new_nodes, "Unsqueeze", [x, _const(new_nodes, np.array([2], dtype=np.int64))])  # [B, G, 1, T, D]
    big = _add(new_nodes, "Expand", [x5, _const(new_nodes, np.array([1, 1, rep, 1, 1], dtype=np.int64))])
    dim = shapes.static_dim(x, 3) if len(shapes.dims(x) or ()) == 4 else None
    dim = -1 if dim is None else dim
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


def _heads_to_bsh(new: ir.Value, new_nodes: list[ir.Node], shapes: Shapes) -> ir.Value:
    """``[B, G, S, D]`` heads as ``[B, S, G*D]``: the exporter's own ``[B, S, G*D]`` value where the heads are
    ``Transpose(Reshape(x, [0, 0, G, D]), [0, 2, 1, 3])`` of it, else Transpose + Reshape."""
    transpose = _producer(new, "Transpose")
    reshape = _producer(transpose.inputs[0], "Reshape") if transpose is not None else None
    if transpose is not None and reshape is not None and list(attr_value(transpose, "perm", [])) == [0, 2, 1, 3]:
        x = reshape.inputs[0]
        if x is not None and _splits_last_dim(x, reshape.inputs[1], shapes):
            return x
    t = _add(new_nodes, "Transpose", [new], perm=[0, 2, 1, 3])
    return _add(new_nodes, "Reshape", [t, _const(new_nodes, np.array([0, 0, -1], dtype=np.int64))])


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
    Concats (or other present computations), which are removed (with what only they read).  A kernel lowered inside
    a subgraph (the exact branch of a right-padding check) takes the place of a Concat of the outer graph only for
    the readers in its own graph: the outer graph's outputs are the If's to set (they stay the Concat here).  A
    reader the kernel itself depends on keeps the Concat: optimum's Whisper decoder takes the present keys' Shape
    for its mask, and reading the kernel's own output there was a cycle (a graph the checker refused, exit 4)."""
    upstream = _ancestors(kernel)
    for old, new in zip(concats, news if news is not None else kernel.outputs[1:3]):
        new.shape = old.shape
        if old.dtype is not None:
            new.dtype = old.dtype
        maker = old.producer()
        here = maker is None or maker.graph is kernel.graph
        if old.is_graph_output() and here:
            name = old.name
            old.name = f"{name}_replaced"
            new.name = name
            owner = kernel.graph if kernel.graph is not None else graph
            outputs = owner.outputs
            outputs[[i for i, v in enumerate(outputs) if v is old][0]] = new
        for use in list(old.uses()):
            if id(use.node) not in upstream and (here or use.node.graph is kernel.graph):
                use.node.replace_input_with(use.idx, new)
    remove_dead_producers(graph, list(concats))


def _ancestors(node: ir.Node) -> set[int]:
    """``id``s of the nodes ``node`` reads from, directly or not (its own graph)."""
    seen: set[int] = set()
    stack = [v.producer() for v in node.inputs if v is not None]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        stack.extend(v.producer() for v in n.inputs if v is not None)
    return seen


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


def _gqa_head_ok(q: ir.Value, heads: int, ctx: LoweringContext) -> bool:
    width = _seq_dim(q, ctx, ctx.shared, axis=2)
    n = width.value if width is not None else None
    return n is not None and n % heads == 0 and (n // heads) % GQA_HEAD_MULTIPLE == 0


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
    if kv_heads != heads and not (is_zero(bias) and _seq_dim(q, ctx, ctx.shared) == Dim.lit(1)
                                  and _gqa_head_ok(q, heads, ctx)):
        return False  # (nothing built yet: what is built lands in ``shared``)
    new_nodes: list[ir.Node] = []
    ab = None if is_zero(bias) else _bias_for_kernel(bias, q, new_nodes, ctx, ctx.shared)
    k_new, v_new = _heads_to_bsh(ck[1], new_nodes, ctx), _heads_to_bsh(cv[1], new_nodes, ctx)
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
