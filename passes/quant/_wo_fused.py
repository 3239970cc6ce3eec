"""Fused embedding layers in ``weight-only`` (:mod:`mograph.passes.quant.weight_only`, ``--embedding-precision``).

``fuse-embed-layernorm`` turns BERT's embeddings into one ``mograph.EmbedLayerNorm`` that reads the word table
itself (lowered for ``ort`` to ``com.microsoft.EmbedLayerNormalization``, which takes a float table), so
weight-only never saw a ``Gather`` of that table: BERT-base's 30522 x 768 table stayed float16 while every
MatMul went to 8 bits.  When the table is to be quantized, :func:`expand_for_tables` puts the node's parts
back where it was::

    Word[InputIds] + Segment[SegmentIds] + Position[PositionIds]  ->  mograph.LayerNorm(., Scale, B)
    (three default-domain Gathers, two Adds in the function body's order, the op's epsilon / stash_type;
    two Gathers and one Add for a layer of two lookups, whose segment lookup is the neutral one: DistilBERT)

and the word table's ``Gather`` then goes the way of every embedding table (``mograph.BlockQuantizedGather``,
lowered to ``com.microsoft.GatherBlockQuantized``).  The math is the op's own function body, so the expanded
graph computes what the fused one did.  The segment and position lookups carry :data:`SMALL_TABLE` in their
metadata: their tables are small (2 x hidden and 512 x hidden on BERT), so they stay float by default (a plan
entry for their ``Gather`` still decides), which also keeps a second run from touching them.  Where no plan entry
names them, lookups whose ids are built on the host from shape values (``BertEmbeddings``' buffers: a Memcpy to
the device in ONNX Runtime's CUDA provider, so no CUDA graph) are written in device forms instead: token type ids
that are provably one id ``k`` fold ``Segment[k]`` into a new position table (no segment ``Gather``; stat
``embeddings.segment_folded``), position ids sliced from 0 of an ``arange`` buffer as long as the table become
``Unsqueeze(Slice(Position, 0, end), 0)`` (stat ``embeddings.positions_sliced``).

Measured (one run, 2026-12-03, random-weight BERT-base, ``python tools/bench_precision.py prepare --model bert-base
--variants fp16,int8-wo`` then ``time --device cpu`` / ``markdown``): the ``--device cuda`` int8 recipe wrote 130.9 MB
(0.630x the fp16 graph's 207.7 MB) with the fused table float16, 109.0 MB (0.525x) with it expanded and 8-bit;
ONNX Runtime CPU, optimizations off, 2x128 ids: cosine 0.999995 to the float-table model, 0.999981 to fp32.

A node is expanded only when its word table would be quantized: a float 2-D initializer read by nothing but
fused nodes, row ``Gather`` s or a weight layer tied to it (whose own precision is not float), asked for by
``--embedding-precision`` or by the plan's entry for the ``Gather`` the expansion names ``<node>/word``, and
with a hidden size that is a multiple of ``--block-size``.  Anything else leaves the fused node as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.lowerings.embed import absent_segment, arange_slice, fold_segment_row, uniform_ids
from mograph.passes.quant._wo_layers import _FLOAT_DTYPES, _Layer

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION
from mograph.irutil import add_initializer
from mograph.pass_infra import stamp
from mograph.patterns import remove_dead_producers

__all__ = ["SMALL_TABLE", "expand_for_tables", "word_gather_name"]

#: Metadata key on the segment / position ``Gather`` of an expanded embedding layer (value: which table).
SMALL_TABLE = "mograph.weight_only.small_table"


def word_gather_name(node: ir.Node) -> str:
    """The name the expansion gives the word table's ``Gather`` (the plan's key for it)."""
    base = node.name or f"EmbedLayerNorm->{node.outputs[0].name}"
    return f"{base}/word"


def _fused(node: ir.Node) -> bool:
    return node.domain == DOMAIN and node.op_type == "EmbedLayerNorm" and len(node.inputs) == 8


def _row_gather(node: ir.Node, idx: int) -> bool:
    axis = node.attributes.get("axis")
    return node.op_type == "Gather" and node.domain in ("", "ai.onnx") and idx == 0 and (axis is None or axis.as_int() == 0)


def _device_lookups(node: ir.Node, base: str, user: dict[str, str], stats: dict[str, int]
                    ) -> tuple[ir.Value, bool, list[ir.Node], ir.Node | None]:
    """The position table (with the segment row folded in where the segment ids are provably one id and no plan
    entry names ``<node>/segment``) and, where the position ids are a ``Slice`` from 0 of an ``arange`` buffer as
    long as the table and no plan entry names ``<node>/position``, their rows as ``Unsqueeze(Slice(table, 0,
    end), 0)``: both lookups read ids built on the host from shape values (a Memcpy to the device in ONNX
    Runtime's CUDA provider: no CUDA graph), the new forms read the host values only as Slice bounds.  Returns
    ``(position table, whether no segment lookup is left (its row folded in, or the neutral lookup of a layer of two
    lookups), nodes before the rows, the rows' node or None)``."""
    graph = node.graph
    assert graph is not None
    _, seg, pos, _, segment, position, _, _ = node.inputs
    assert seg is not None and pos is not None and segment is not None and position is not None
    folded = None
    if absent_segment(seg, segment):  # a layer of two lookups (word + position): no segment Gather, nothing to fold
        return _position_rows(node, position, pos, base, user, stats, True)
    row = uniform_ids(seg) if f"{base}/segment" not in user else None
    if row is not None:
        folded = fold_segment_row(graph, position, segment, row)
    table = folded if folded is not None else position
    if folded is not None:
        stats["embeddings.segment_folded"] = stats.get("embeddings.segment_folded", 0) + 1
    return _position_rows(node, table, pos, base, user, stats, folded is not None)


def _position_rows(node: ir.Node, table: ir.Value, pos: ir.Value, base: str, user: dict[str, str],
                   stats: dict[str, int], no_segment: bool) -> tuple[ir.Value, bool, list[ir.Node], ir.Node | None]:
    """:func:`_device_lookups`' answer for the position ``table`` (``no_segment``: no segment lookup is left)."""
    graph = node.graph
    assert graph is not None
    sliced = arange_slice(pos) if f"{base}/position" not in user else None
    rows = table.shape[0] if table.shape is not None and len(table.shape) == 2 else None
    if sliced is None or sliced[0] != rows:
        return table, no_segment, [], None
    zero = add_initializer(graph, f"{base}_zero", np.array([0], np.int64))
    cut = ir.node("Slice", [table, zero, sliced[1], zero], name=f"{base}/position_rows")
    rows_node = ir.node("Unsqueeze", [cut.outputs[0], zero], name=f"{base}/position")
    stats["embeddings.positions_sliced"] = stats.get("embeddings.positions_sliced", 0) + 1
    return table, no_segment, [cut], rows_node


def _expand(node: ir.Node, pass_name: str, user: dict[str, str] | None = None,
            stats: dict[str, int] | None = None) -> None:
    """Replace the fused ``node`` by its Gathers, Adds and ``mograph.LayerNorm`` (lookups on the device where
    :func:`_device_lookups` finds them)."""
    graph = node.graph
    ids, seg, pos, word, segment, position, scale, beta = node.inputs
    assert graph is not None and ids is not None and seg is not None and word is not None
    y = node.outputs[0]
    base = word_gather_name(node)[: -len("/word")]
    table, folded, extra, rows = _device_lookups(node, base, user or {}, stats if stats is not None else {})
    parts = {"word": ir.node("Gather", [word, ids], name=f"{base}/word")}
    if not folded:
        parts["segment"] = ir.node("Gather", [segment, seg], name=f"{base}/segment")
    parts["position"] = rows if rows is not None else ir.node("Gather", [table, pos], name=f"{base}/position")
    if "segment" in parts:
        first = ir.node("Add", [parts["word"].outputs[0], parts["segment"].outputs[0]], name=f"{base}/add")
        total = ir.node("Add", [first.outputs[0], parts["position"].outputs[0]], name=f"{base}/sum")
        adds = [first, total]
    else:
        total = ir.node("Add", [parts["word"].outputs[0], parts["position"].outputs[0]], name=f"{base}/sum")
        first, adds = total, [total]
    attrs = {k: a.value for k, a in node.attributes.items() if k in ("epsilon", "stash_type")}
    norm = ir.node("LayerNorm", [total.outputs[0], scale, beta], domain=DOMAIN, version=DOMAIN_VERSION,
                   attributes=attrs, name=f"{base}/norm")
    for n in (*parts.values(), *adds, *extra):
        n.outputs[0].type = y.type
    hidden = word.shape[1] if word.shape is not None else None
    for n in parts.values():  # rows: the ids' shape and the hidden size (what the fp16 pass's measurement sizes)
        rows_ids = n.inputs[1] if n.op_type == "Gather" else None
        if rows_ids is not None and rows_ids.shape is not None:
            n.outputs[0].shape = ir.Shape([*rows_ids.shape, hidden])
    if "segment" in parts and ids.shape is not None and seg.shape is not None and list(ids.shape) == list(seg.shape):
        first.outputs[0].shape = parts["word"].outputs[0].shape
    total.outputs[0].shape = y.shape
    for role in ("segment", "position"):
        if role in parts and parts[role].op_type == "Gather":
            parts[role].metadata_props[SMALL_TABLE] = role
    new_nodes = [*extra, *parts.values(), *adds, norm]
    for n in new_nodes:
        n.metadata_props.update({k: v for k, v in node.metadata_props.items() if k not in n.metadata_props})
        stamp(n, pass_name, "embedding-expand")
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, [y], [norm.outputs[0]])
    if folded or extra:  # the buffers' slices and the tables no node reads now
        remove_dead_producers(graph, [seg, pos, segment, position])


def expand_for_tables(model: ir.Model, layers: list[_Layer], decisions: dict[str, tuple[str, str]],
                      wanted: str, user: dict[str, str], block_size: int, pass_name: str,
                      stats: dict[str, int] | None = None) -> int:
    """Expand each ``mograph.EmbedLayerNorm`` of the main graph whose word table is to be quantized (module
    docstring): ``wanted`` is ``--embedding-precision``'s precision, ``user`` the plan's precision per node key,
    ``decisions`` the weight layers' (a tied head).  Returns how many nodes were expanded."""
    by_weight = {id(la.node): la for la in layers}
    expanded = 0
    for node in [n for n in model.graph if _fused(n)]:
        if node.graph is not model.graph:
            continue
        word = node.inputs[3]
        if (word is None or not word.is_initializer() or word.const_value is None or word.dtype not in _FLOAT_DTYPES
                or word.const_value.shape.rank() != 2 or word.is_graph_output()):
            continue
        hidden = int(word.const_value.shape.numpy()[1])
        prec = user.get(word_gather_name(node), wanted)
        if prec == "float" or hidden % block_size:
            continue
        readable = True
        for use in word.uses():
            if (_fused(use.node) and use.idx == 3) or _row_gather(use.node, use.idx):
                continue
            layer = by_weight.get(id(use.node))
            if layer is None or decisions[layer.key][0] == "float":
                readable = False  # not an embedding table, or the float head's own weight: it stays float
        if not readable:
            continue
        _expand(node, pass_name, user, stats)
        expanded += 1
    return expanded
