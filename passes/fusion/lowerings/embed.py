"""Lowerings of ``EmbedLayerNorm`` (BERT's word + segment + position lookups and LayerNorm).

A layer of two lookups (word + position: DistilBERT) carries the neutral segment lookup that
``fuse-embed-layernorm`` writes (:func:`absent_segment`: a table of negative zeros, one id); every target leaves
it out: ``ort`` passes no segment inputs (stat ``embed_no_segment``), ``onnx``/``tensorrt`` write two ``Gather``
and one ``Add``.

``ort``
    ``com.microsoft.EmbedLayerNormalization``: ``input_ids``, ``segment_ids`` (int32, one shape ``[B, S]``),
    the three tables, ``gamma``/``beta`` as ``[hidden]`` vectors, no ``mask``; ``position_ids`` left off when
    they provably are ``0 .. S-1`` (what the kernel uses without them: a constant ``arange`` of the ids'
    static length, or a ``Slice`` from 0 with step 1 of a constant ``[1, L]`` ``arange`` buffer whose end is
    the ids' dim 1, read by ``Shape``/``Gather`` of the ids or of an input declared with the same dim, such as
    the ``attention_mask`` dynamo reads it from, or ``Range(0, S, 1)`` of such an ``S``, unsqueezed to ``[1, S]`` or
    expanded to ``Shape(input_ids)``: ``torch.arange``), else passed as int32 ``[1, S]`` or ``[B, S]``.  Segment ids that are
    provably one id ``k`` everywhere (:func:`uniform_ids`: ``BertEmbeddings``' zero ``token_type_ids`` buffer, sliced,
    gathered and expanded -- a shape subgraph ONNX Runtime's CUDA provider runs on the host and copies to the
    device, which blocks CUDA graph capture) are left off with the segment table: row ``k`` of that table is added
    into a new position table (float32 sum, rounded once; stat ``embed_segment_folded``).  Segment (and
    passed position) ids whose shape is not provably the input ids' (static or symbolic dims, or an ``Expand`` to
    ``Shape(input_ids)`` as TorchScript writes BERT's buffered ``token_type_ids``) get
    ``Expand(ids, Shape(input_ids))`` (exact where the original's sum broadcast them).  Ids are cast to int32 (constant ids are stored as int32).  The ``mask_index`` output is declared (the CUDA kernel
    writes it) and read by nothing.  Declines (the op is inlined) when the ids are not rank 2 of those
    shapes or a vector cannot be built.
``onnx`` / ``tensorrt``
    the standard ops again: three ``Gather``, two ``Add`` (two and one without a segment lookup) and
    ``LayerNormalization`` (opset >= 17; below, the step inlines the function body).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.custom_ops import Lowering
from mograph.irutil import add_initializer, attr_value, fresh_name, is_zero
from mograph.lowering import LoweringContext, as_vector, replace_node
from mograph.patterns import constant_array

__all__ = ["LOWERINGS", "MS_DOMAIN", "absent_segment", "arange_slice", "fold_segment_row", "is_arange_positions",
           "uniform_ids"]

MS_DOMAIN = "com.microsoft"


def _same_dims_at(a: ir.Value, b: ir.Value, i: int, ctx: LoweringContext) -> bool:
    """Whether dim ``i`` of ``a`` and of ``b`` are one dim for the shape query."""
    da, db = ctx.dims(a), ctx.dims(b)
    return da is not None and db is not None and i < len(da) and i < len(db) and da[i] is not None and da[i] == db[i]


def _const(value: ir.Value | None) -> np.ndarray | None:
    """:func:`constant_array`, also through ``ConstantOfShape`` of a constant shape and ``Mul`` of such values."""
    arr = constant_array(value)
    node = value.producer() if value is not None and arr is None else None
    if node is None or node.domain != "":
        return arr
    if node.op_type == "ConstantOfShape":
        shape = constant_array(node.inputs[0])
        fill = node.attributes.get("value")
        if shape is None or shape.size > 8 or int(np.prod(shape)) > 64:
            return None
        element = fill.value.numpy().reshape(-1)[0] if fill is not None else np.float32(0)
        return np.full(shape.astype(np.int64), element)
    if node.op_type == "Mul" and len(node.inputs) == 2:
        a, b = _const(node.inputs[0]), _const(node.inputs[1])
        return None if a is None or b is None else np.asarray(a * b)
    return None


def _is_shape_of(value: ir.Value | None, ids: ir.Value, ctx: LoweringContext) -> bool:
    """Whether ``value`` provably holds ``Shape(ids)`` (rank 2), however the graph spells it (the shape query's
    elements: ``Shape`` itself, a ``Concat`` of its dims, a ``Reshape`` to ``[-1]``, the ``Where(Equal(s, -1), 1, s)``
    of ``torch.expand`` sizes, a no-op on a shape, whose values are never negative)."""
    vec, dims = ctx.values(value), ctx.dims(ids)
    return vec is not None and not vec[0] and dims is not None and len(dims) == 2 and vec[1] == dims


def _is_seq_of(value: ir.Value | None, ids: ir.Value, ctx: LoweringContext) -> bool:
    """Whether the one-element ``value`` is dim 1 of ``ids`` at run time, however read from a shape (the shape
    query's elements: ``Gather(Shape(x), 1)``, ``Slice(Shape(x), 1, 2)``, ``Shape<start=1, end=2>(x)`` of an ``x``
    whose dim 1 is the ids', through Unsqueeze/Reshape/Cast/Squeeze)."""
    vec, dims = ctx.values(value), ctx.dims(ids)
    return (vec is not None and len(vec[1]) == 1 and vec[1][0] is not None and dims is not None and len(dims) == 2
            and vec[1][0] == dims[1])


def _is_arange_row(arr: np.ndarray) -> bool:
    return arr.ndim == 2 and arr.shape[0] == 1 and np.array_equal(arr[0], np.arange(arr.shape[1]))


def arange_slice(pos: ir.Value) -> tuple[int, ir.Value] | None:
    """``(L, end)`` where ``pos`` is ``Slice(A, [0], end, [1], [1])`` of a constant ``[1, L]`` ``arange`` buffer ``A``
    (the position ids TorchScript slices from ``BertEmbeddings``' buffer): ``[[0 .. min(end, L) - 1]]``."""
    node = pos.producer()
    if node is None or node.op_type != "Slice" or node.domain != "" or len(node.inputs) < 3 or node.inputs[2] is None:
        return None
    buffer = constant_array(node.inputs[0])
    if buffer is None or not _is_arange_row(buffer):
        return None
    starts = constant_array(node.inputs[1])
    axes = constant_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = constant_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or starts.size != 1 or int(starts.reshape(-1)[0]) != 0:
        return None
    if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) not in (1, -1):
        return None
    if steps is not None and (steps.size != 1 or int(steps.reshape(-1)[0]) != 1):
        return None
    return int(buffer.shape[1]), node.inputs[2]


def _scalar_const(value: ir.Value | None) -> int | None:
    arr = constant_array(value)
    return int(arr.reshape(-1)[0]) if arr is not None and arr.size == 1 and arr.dtype.kind in "iu" else None


def _arange_range(pos: ir.Value, ids: ir.Value, ctx: LoweringContext) -> bool:
    """Whether ``pos`` is ``Range(0, S, 1)`` with ``S`` dim 1 of ``ids``, as it is (``[S]``), unsqueezed on axis 0
    (``[1, S]``) and then, maybe, expanded to ``Shape(ids)`` (``torch.arange(S).unsqueeze(0).expand_as(ids)``)."""
    node = pos.producer()
    if node is not None and node.op_type == "Expand" and node.domain == "" and _is_shape_of(node.inputs[1], ids, ctx):
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is not None and node.op_type == "Unsqueeze" and node.domain == "":
        axes = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None and "axes" in node.attributes:  # opset < 13
            axes = np.asarray(node.attributes["axes"].value)
        if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) != 0 or node.inputs[0] is None:
            return False
        node = node.inputs[0].producer()
    if node is None or node.op_type != "Range" or node.domain != "" or len(node.inputs) != 3:
        return False
    start, limit, delta = node.inputs
    return _scalar_const(start) == 0 and _scalar_const(delta) == 1 and _is_seq_of(limit, ids, ctx)


def is_arange_positions(pos: ir.Value, ids: ir.Value, ctx: LoweringContext) -> bool:
    """Whether position ids ``pos`` are provably ``[[0, 1, .., S-1]]`` (or rows of it, or ``[0 .. S-1]``) with
    ``S`` dim 1 of ``ids`` ``[B, S]``."""
    if _arange_range(pos, ids, ctx):
        return True
    dims = ctx.dims(ids)
    seq = dims[1].value if dims is not None and len(dims) == 2 and dims[1] is not None else None
    arr = constant_array(pos)
    if arr is not None:
        if arr.ndim == 1:
            arr = arr[None]
        return _is_arange_row(arr) and isinstance(seq, int) and arr.shape[1] == seq
    sliced = arange_slice(pos)
    if sliced is None:
        return False
    ends = sliced[1]
    end = constant_array(ends)
    if end is not None:
        return end.size == 1 and isinstance(seq, int) and int(end.reshape(-1)[0]) == seq
    return _is_seq_of(ends, ids, ctx)


def _int32(graph: ir.Graph, value: ir.Value, nodes: list[ir.Node], ctx: LoweringContext) -> ir.Value:
    """``value`` as int32: itself, a new int32 initializer for a constant, or a Cast (one per value and run)."""
    if value.dtype == ir.DataType.INT32:
        return value
    key = ("embed_ids_int32", id(value))
    if key in ctx.shared:
        return ctx.shared[key]
    # unique: the segment and position ids are often unnamed Expand outputs (made by _like_ids), and two
    # "ids_int32" broke SSA (exit 4 on a TorchScript BERT at opset 12, --target ort)
    name = fresh_name(_taken(graph, ctx), f"{value.name or 'ids'}_int32")
    arr = constant_array(value)
    if arr is not None:
        out = ir.Value(name=name, const_value=ir.tensor(arr.astype(np.int32), name=name))
        graph.register_initializer(out)
    else:
        cast = ir.node("Cast", [value], attributes={"to": ir.DataType.INT32.value})
        nodes.append(cast)
        out = cast.outputs[0]
        out.name = name
        out.type, out.shape = ir.TensorType(ir.DataType.INT32), value.shape
    ctx.shared[key] = out
    return out


def _taken(graph: ir.Graph, ctx: LoweringContext) -> set[str]:
    """The value names of ``graph`` (its inputs, initializers and node outputs), gathered once per lowering."""
    key = (None, "embed_names", id(graph))  # not a str first: not a kind counted in the stats
    if key not in ctx.shared:
        names = {v.name for v in graph.inputs} | set(graph.initializers)
        names |= {o.name for n in graph for o in n.outputs}
        ctx.shared[key] = {n for n in names if n}
    taken: set[str] = ctx.shared[key]
    return taken


def _rank2(v: ir.Value) -> bool:
    return v.shape is not None and len(v.shape) == 2


def _same_dims(a: ir.Value, b: ir.Value, ctx: LoweringContext) -> bool:
    """Whether ``a`` and ``b`` provably have one shape (the shape query's dims)."""
    da, db = ctx.dims(a), ctx.dims(b)
    return da is not None and db is not None and len(da) == len(db) and all(
        _same_dims_at(a, b, i, ctx) for i in range(len(da)))


def _like_ids(graph: ir.Graph, v: ir.Value, ids: ir.Value, nodes: list[ir.Node], ctx: LoweringContext) -> ir.Value:
    """``v`` in the shape of ``ids``: itself when provably so, else ``Expand(v, Shape(ids))`` (exact: ``v``
    broadcasts against ``ids`` in the original sum; the kernel rejects anything larger)."""
    if _same_dims(v, ids, ctx):
        return v
    expand = v.producer()
    if expand is not None and expand.op_type == "Expand" and _is_shape_of(expand.inputs[1], ids, ctx):
        return v  # broadcast to Shape(ids): ids' shape, or larger (which the kernel rejects: an error, never wrong)
    key = ("embed_ids_shape", id(ids))
    shape = ctx.shared.get(key)
    if shape is None:
        node = ir.node("Shape", [ids])
        nodes.append(node)
        shape = node.outputs[0]
        shape.type, shape.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([2])
        ctx.shared[key] = shape
    expand = ir.node("Expand", [v, shape])
    nodes.append(expand)
    out = expand.outputs[0]
    out.type, out.shape = v.type, ids.shape
    ctx.count("embed_ids_expanded")
    return out


#: ops whose output holds only values of their input 0 (indices, shapes and slice bounds pick, never compute)
_PICKS = {"Expand", "Gather", "GatherElements", "GatherND", "Slice", "Reshape", "Unsqueeze", "Squeeze", "Tile",
          "Transpose", "Flatten", "Identity"}


def uniform_ids(value: ir.Value | None) -> int | None:
    """The one integer every element of ``value`` provably holds, else None: a constant all of one value (or a
    ``ConstantOfShape`` of one), through ops that only pick or lay out input 0's elements (:data:`_PICKS`) and
    integer Casts -- as ``BertEmbeddings`` builds token type ids from its zero buffer (TorchScript: Slice and
    Expand; transformers 5: ``GatherElements`` of it by the sliced position ids, then Expand)."""
    narrowed = False  # an int32 Cast on the way: the value must fit (a wrapped id would be another row)
    for _ in range(32):
        if value is None:
            return None
        arr = constant_array(value)
        node = value.producer() if arr is None else None
        if node is not None and node.domain == "" and node.op_type == "ConstantOfShape":
            fill = node.attributes.get("value")
            arr = fill.value.numpy() if fill is not None else np.zeros(1, np.float32)
        if arr is not None:
            flat = np.asarray(arr).reshape(-1)
            if flat.size == 0 or flat.dtype.kind not in "iu" or np.any(flat != flat[0]):
                return None
            first = int(flat[0])
            return None if narrowed and not -2**31 <= first < 2**31 else first
        if node is None or node.domain != "" or not node.inputs:
            return None
        if node.op_type == "Cast":
            to = ir.DataType(int(attr_value(node, "to", 0)))
            if to not in (ir.DataType.INT32, ir.DataType.INT64):
                return None
            narrowed |= to == ir.DataType.INT32
        if node.op_type not in _PICKS and node.op_type != "Cast":
            return None
        value = node.inputs[0]
    return None


def absent_segment(seg: ir.Value | None, segment: ir.Value | None) -> bool:
    """Whether the segment lookup adds nothing: the neutral one ``fuse-embed-layernorm`` writes for a layer of two
    lookups, a constant table all negative zeros (``x + -0.0`` is ``x`` for every ``x``) read at ids that are
    provably one valid row (a zero table of a model's own, of positive zeros, is not taken: ``-0.0 + 0.0`` is
    ``+0.0``)."""
    table = constant_array(segment)
    row = uniform_ids(seg)
    if table is None or row is None or table.ndim != 2 or not 0 <= row < table.shape[0] or table.dtype.kind != "f":
        return False
    flat = table.astype(np.float32)
    return not np.any(flat) and bool(np.all(np.signbit(flat)))


def fold_segment_row(graph: ir.Graph, position: ir.Value, segment: ir.Value, row: int,
                     shared: dict[tuple[Any, ...], Any] | None = None) -> ir.Value | None:
    """A new position table ``position + segment[row]`` (summed in float32, rounded once to the tables' dtype),
    for segment ids that are all ``row``: the segment lookup is then not needed.  None where a table is not a
    constant or ``row`` is not one of the segment table's.  Built once per ``shared`` dict."""
    key = (None, "embed_folded_positions", id(position), id(segment), row)  # not a str first: not a stat
    if shared is not None and key in shared:
        return shared[key]  # type: ignore[no-any-return]
    pos, seg = constant_array(position), constant_array(segment)
    if pos is None or seg is None or pos.ndim != 2 or seg.ndim != 2 or not 0 <= row < seg.shape[0]:
        return None
    folded = (pos.astype(np.float32) + seg[row].astype(np.float32)).astype(pos.dtype)
    out = add_initializer(graph, f"{position.name or 'position'}_with_segment_{row}", folded)
    if shared is not None:
        shared[key] = out
    return out


def _ort(node: ir.Node, ctx: LoweringContext) -> bool:
    ids, seg, pos, word, segment, position, scale, beta = node.inputs
    graph = node.graph
    assert graph is not None and ids is not None and seg is not None and pos is not None
    assert word is not None and segment is not None and position is not None and scale is not None
    absent = absent_segment(seg, segment)
    implicit = _rank2(ids) and is_arange_positions(pos, ids, ctx)
    if not (_rank2(ids) and (absent or _rank2(seg)) and (implicit or _rank2(pos))):
        return False
    y = node.outputs[0]
    like = ir.Value(name="", type=word.type, shape=ir.Shape([word.shape[1] if word.shape is not None else None]))
    gamma = as_vector(graph, scale, like, "mograph_embed_ln_scale")
    b = as_vector(graph, beta, like, "mograph_embed_ln_bias") if beta is not None else None  # beta is required
    if gamma is None or b is None:
        return False
    nodes: list[ir.Node] = []
    row = uniform_ids(seg) if not absent else None
    folded = fold_segment_row(graph, position, segment, row, ctx.shared) if row is not None else None
    if absent:  # two lookups (word + position): the kernel's segment inputs are optional
        ctx.count("embed_no_segment")
        inputs: list[ir.Value | None] = [_int32(graph, ids, nodes, ctx), None, word, position, None, gamma, b]
    elif folded is not None:  # every token has segment ``row``: its embedding goes into the position table
        ctx.count("embed_segment_folded")
        inputs = [_int32(graph, ids, nodes, ctx), None, word, folded, None, gamma, b]
    else:
        seg = _like_ids(graph, seg, ids, nodes, ctx)
        inputs = [_int32(graph, ids, nodes, ctx), _int32(graph, seg, nodes, ctx), word, position, segment, gamma, b]
    if implicit:
        ctx.count("embed_implicit_positions")
    else:
        if not (pos.shape is not None and pos.shape[0] == 1 and _same_dims_at(pos, ids, 1, ctx)):
            pos = _like_ids(graph, pos, ids, nodes, ctx)
        inputs += [None, _int32(graph, pos, nodes, ctx)]
    new = ir.node("EmbedLayerNormalization", inputs, domain=MS_DOMAIN, num_outputs=2,
                  attributes={"epsilon": float(attr_value(node, "epsilon", 1e-5))})
    new.outputs[0].type, new.outputs[0].shape = y.type, y.shape
    mask_index = new.outputs[1]
    mask_index.name = f"{node.name or 'EmbedLayerNorm'}_mask_index"
    mask_index.type = ir.TensorType(ir.DataType.INT32)
    nodes.append(new)
    for i, n in enumerate(nodes[:-1]):
        n.name = f"{node.name or node.op_type}/{i}"
    replace_node(node, nodes, [new.outputs[0]], ctx.target)
    return True


def _standard(node: ir.Node, ctx: LoweringContext) -> bool:
    if ctx.opset < 17:
        return False
    ids, seg, pos, word, segment, position, scale, beta = node.inputs
    graph = node.graph
    assert graph is not None and scale is not None
    y = node.outputs[0]
    like = ir.Value(name="", type=y.type, shape=y.shape)
    gamma = as_vector(graph, scale, like, "mograph_embed_ln_scale")
    b = None if is_zero(beta) or beta is None else as_vector(graph, beta, like, "mograph_embed_ln_bias")
    if gamma is None or (b is None and not is_zero(beta)):
        return False
    nodes = [ir.node("Gather", [word, ids])]
    if not absent_segment(seg, segment):  # (a layer of two lookups: the graph fuse-embed-layernorm matched)
        nodes.append(ir.node("Gather", [segment, seg]))
        nodes.append(ir.node("Add", [nodes[0].outputs[0], nodes[1].outputs[0]]))
    nodes.append(ir.node("Gather", [position, pos]))
    nodes.append(ir.node("Add", [nodes[-2].outputs[0], nodes[-1].outputs[0]]))
    for n in nodes:
        n.outputs[0].type = y.type
    nodes[-1].outputs[0].shape = y.shape
    ln_inputs = [nodes[-1].outputs[0], gamma] + ([b] if b is not None else [])
    attrs = {"axis": -1, "epsilon": float(attr_value(node, "epsilon", 1e-5)),
             "stash_type": int(attr_value(node, "stash_type", 1))}
    nodes.append(ir.node("LayerNormalization", ln_inputs, attributes=attrs))
    replace_node(node, nodes, [nodes[-1].outputs[0]], ctx.target)
    return True


LOWERINGS: dict[str, dict[str, Lowering]] = {
    "EmbedLayerNorm": {"onnx": _standard, "ort": _ort, "tensorrt": _standard},
}
