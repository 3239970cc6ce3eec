"""Fused embedding layers in ``weight-only`` (:mod:`mograph.passes.quant.weight_only`, ``--embedding-precision``).

``fuse-embed-layernorm`` turns BERT's embeddings into one ``mograph.EmbedLayerNorm`` that reads the word table
itself (lowered for ``ort`` to ``com.microsoft.EmbedLayerNormalization``, which takes a float table), so
weight-only never saw a ``Gather`` of that table: BERT-base's 30522 x 768 table stayed float16 while every
MatMul went to 8 bits.  When the table is to be quantized, :func:`expand_for_tables` puts the node's parts
back where it was::

    Word[InputIds] + Segment[SegmentIds] + Position[PositionIds]  ->  mograph.LayerNorm(., Scale, B)
    (three default-domain Gathers, two Adds in the function body's order, the op's epsilon / stash_type)

and the word table's ``Gather`` then goes the way of every embedding table (``mograph.BlockQuantizedGather``,
lowered to ``com.microsoft.GatherBlockQuantized``).  The math is the op's own function body, so the expanded
graph computes what the fused one did.  The segment and position lookups carry :data:`SMALL_TABLE` in their
metadata: their tables are small (2 x hidden and 512 x hidden on BERT), so they stay float by default (a plan
entry for their ``Gather`` still decides), which also keeps a second run from touching them.

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

import onnx_ir as ir
from mograph.passes.quant._wo_layers import _FLOAT_DTYPES, _Layer

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION
from mograph.pass_infra import stamp

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


def _expand(node: ir.Node, pass_name: str) -> None:
    """Replace the fused ``node`` by its Gathers, Adds and ``mograph.LayerNorm``."""
    graph = node.graph
    ids, seg, pos, word, segment, position, scale, beta = node.inputs
    assert graph is not None and ids is not None and seg is not None and word is not None
    y = node.outputs[0]
    base = word_gather_name(node)[: -len("/word")]
    parts = {"word": ir.node("Gather", [word, ids], name=f"{base}/word"),
             "segment": ir.node("Gather", [segment, seg], name=f"{base}/segment"),
             "position": ir.node("Gather", [position, pos], name=f"{base}/position")}
    first = ir.node("Add", [parts["word"].outputs[0], parts["segment"].outputs[0]], name=f"{base}/add")
    total = ir.node("Add", [first.outputs[0], parts["position"].outputs[0]], name=f"{base}/sum")
    attrs = {k: a.value for k, a in node.attributes.items() if k in ("epsilon", "stash_type")}
    norm = ir.node("LayerNorm", [total.outputs[0], scale, beta], domain=DOMAIN, version=DOMAIN_VERSION,
                   attributes=attrs, name=f"{base}/norm")
    for n in (*parts.values(), first, total):
        n.outputs[0].type = y.type
    hidden = word.shape[1] if word.shape is not None else None
    for n in parts.values():  # rows: the ids' shape and the hidden size (what the fp16 pass's measurement sizes)
        rows_ids = n.inputs[1]
        if rows_ids is not None and rows_ids.shape is not None:
            n.outputs[0].shape = ir.Shape([*rows_ids.shape, hidden])
    if ids.shape is not None and seg.shape is not None and list(ids.shape) == list(seg.shape):
        first.outputs[0].shape = parts["word"].outputs[0].shape
    total.outputs[0].shape = y.shape
    for role in ("segment", "position"):
        parts[role].metadata_props[SMALL_TABLE] = role
    new_nodes = [*parts.values(), first, total, norm]
    for n in new_nodes:
        n.metadata_props.update({k: v for k, v in node.metadata_props.items() if k not in n.metadata_props})
        stamp(n, pass_name, "embedding-expand")
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, [y], [norm.outputs[0]])


def expand_for_tables(model: ir.Model, layers: list[_Layer], decisions: dict[str, tuple[str, str]],
                      wanted: str, user: dict[str, str], block_size: int, pass_name: str) -> int:
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
        _expand(node, pass_name)
        expanded += 1
    return expanded
