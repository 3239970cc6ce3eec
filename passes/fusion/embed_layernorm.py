"""``fuse-embed-layernorm``: BERT's embedding layer -> one ``mograph.EmbedLayerNorm``.

The math matched::

    s = (Word[ids] + Segment[segment_ids]) + Position[position_ids]     three Gathers on axis 0 of 2-D
                                                                         tables, the Adds in any order
    s = Word[ids] + Position[position_ids]                              or two (DistilBERT, and any
                                                                         BERT-like layer without segments)
    y = LayerNorm(s)                    a ``mograph.LayerNorm`` (from ``fuse-layernorm``) or the standard
                                        ``LayerNormalization`` over the last axis (opset >= 17 exports)

A layer of two lookups gets the op's segment inputs from :func:`no_segment`: a ``[1, hidden]`` table of
negative zeros read at ids ``[[0]]`` -- exact in the function body (``x + -0.0`` is ``x`` for every float ``x``,
a zero of either sign included) and recognised by every lowering, which leaves the lookup out (``ort``: no
segment inputs, which ONNX Runtime's kernel takes as optional; ``onnx``/``tensorrt``: two Gathers and one Add,
the graph matched).  Its variants are counted as ``mograph.no-segment`` / ``standard.no-segment``.

The tables share their hidden size and dtype (float); the ids are int32 or int64 and may broadcast against
each other (TorchScript exports of BERT slice ``position_ids`` ``[1, S]`` from a buffer).  Which lookup is
the position one is decided here, for the lowering: the one whose ids have a leading 1 where the others do
not, else the one whose ids are a constant or sliced from one, else the one whose ids are a ``Range``
(``torch.arange``, unsqueezed or expanded), else (of two) the one of the smaller table, else the last; the
other two are interchangeable in the math (word + segment), the larger table is called the word table.  (With
two lookups either choice is the same math: the kernel adds the word and the position row, in either order the
same float.)  Nothing else may read the partial sums or the sum (ONNX Runtime's kernel would have to return
it); a ``Shape`` of a looked-up row (DistilBERT reads the sequence length as ``inputs_embeds.size(1)``) is
rewired to ``Shape(ids)`` and the hidden size.

Runs before ``fuse-skip-layernorm``, which would otherwise take the last Add and the norm.  The ``lower``
step turns the op into ``com.microsoft.EmbedLayerNormalization`` (``ort``: ids cast to int32, position ids
left off when they provably are ``0 .. S-1``, segment ids and table left off when the lookup is the neutral one
or the ids provably are one id, whose row goes into the position table) or back into the Gathers, Adds and
``LayerNormalization`` (``onnx``, ``tensorrt``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op
from mograph.passes.fusion.ops import body_supports
from mograph.passes.fusion.skip_layernorm import check_standard_norm, ln_attrs, norm_beta

from mograph.custom_ops import DOMAIN
from mograph.patterns import MatchResult, OrValue, Rule, Var, constant_array

__all__ = ["EmbedLayerNormFusion", "FuseEmbedLayerNormPass", "NO_SEGMENT"]

_INT_IDS = (ir.DataType.INT32, ir.DataType.INT64)
#: The variant suffix of a layer of two lookups (word + position): no segment table.
NO_SEGMENT = "no-segment"
#: Ops that only lay out their input 0's elements, followed back from position ids to a ``Range``.
_LAYOUT = frozenset({"Expand", "Unsqueeze", "Reshape", "Squeeze", "Cast", "Identity"})


def _lookup(op: Any, i: int) -> Any:
    return op.Gather(Var(f"table{i}"), Var(f"ids{i}"), _outputs=[f"rows{i}"])


def _leading_one(v: ir.Value) -> bool:
    return v.shape is not None and len(v.shape) > 0 and v.shape[0] == 1


def _from_constant(v: ir.Value) -> bool:
    """Whether ``v`` is a constant or a Slice of one (a position buffer)."""
    if constant_array(v) is not None:
        return True
    p = v.producer()
    return p is not None and p.op_type == "Slice" and constant_array(p.inputs[0]) is not None


def _from_range(v: ir.Value) -> bool:
    """Whether ``v`` is a ``Range`` laid out by :data:`_LAYOUT` ops
    (``torch.arange(S).unsqueeze(0).expand_as(ids)``)."""
    for _ in range(8):
        p = v.producer()
        if p is None or p.domain not in ("", "ai.onnx") or not p.inputs or p.inputs[0] is None:
            return False
        if p.op_type == "Range":
            return True
        if p.op_type not in _LAYOUT:
            return False
        v = p.inputs[0]
    return False


def _rows(table: ir.Value) -> int:
    dim = table.shape[0] if table.shape is not None else None
    return dim if isinstance(dim, int) else 0


def _position_index(ids: list[ir.Value], tables: list[ir.Value]) -> int:
    """Which of the two or three lookups is the position one (module docstring)."""
    lead = [i for i, v in enumerate(ids) if _leading_one(v)]
    if len(lead) == 1 and not all(_leading_one(v) for v in ids):
        return lead[0]
    for test in (_from_constant, _from_range):
        found = [i for i, v in enumerate(ids) if test(v)]
        if len(found) == 1:
            return found[0]
    if len(ids) == 2 and _rows(tables[0]) != _rows(tables[1]):
        return 0 if _rows(tables[0]) < _rows(tables[1]) else 1  # the larger table is the word table
    return len(ids) - 1


class EmbedLayerNormFusion(Rule):
    """LayerNorm(W[ids] + S[seg] + P[pos]) -> mograph.EmbedLayerNorm(ids, seg, pos, W, S, P, scale, beta);
    LayerNorm(W[ids] + P[pos]) -> the same op with the neutral segment lookup of :func:`no_segment`."""

    min_candidate_nodes = 4
    remove_shape_readers = True  # DistilBERT: Shape(Word[ids]) gives the sequence length its positions are sliced to

    def pattern(self, op: Any, scale: Any) -> Any:
        sums = [op.Add(op.Add(_lookup(op, 0), _lookup(op, 1)), _lookup(op, 2), _outputs=["sum"]),
                op.Add(_lookup(op, 0), _lookup(op, 1), _outputs=["sum"])]
        alternatives, tags = [], []
        for s, suffix in zip(sums, ("", f".{NO_SEGMENT}")):
            alternatives += [op.LayerNorm(s, scale, Var("beta"), _domain=DOMAIN, _outputs=["ln_out"]),
                             op.LayerNormalization(s, scale, _allow_other_inputs=True, _outputs=["ln_out"])]
            tags += [f"mograph{suffix}", f"standard{suffix}"]
        return OrValue(alternatives, tag_var="norm", tag_values=tags)

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              ln_out: ir.Value, sum: ir.Value, **kw: Any) -> MatchResult:
        node = ln_out.producer()
        assert node is not None
        failed = check_standard_norm(self, node, "LayerNormalization", "mean or inverse std", sum)
        if failed is not None:
            return failed
        n = 3 if kw.get("table2") is not None else 2
        tables = [kw[f"table{i}"] for i in range(n)]
        hidden = set()
        self._row_shapes: dict[int, tuple[ir.Value, int]] = {}  # id(rows) -> (ids, hidden): for shape_of
        for i in range(n):
            gather = kw[f"rows{i}"].producer()
            axis = gather.attributes.get("axis")
            if axis is not None and int(axis.value) != 0:
                return self.fail(f"Gather '{gather.name}' is not a row lookup (axis {int(axis.value)})", gather)
            table, ids = tables[i], kw[f"ids{i}"]
            if table.shape is None or len(table.shape) != 2 or not isinstance(table.shape[1], int):
                return self.fail(f"the table of Gather '{gather.name}' is not 2-D with a static hidden size", gather)
            if ids.dtype not in _INT_IDS:
                return self.fail(f"the ids of Gather '{gather.name}' are not int32/int64 ({ids.dtype})", gather)
            hidden.add(table.shape[1])
            self._row_shapes[id(kw[f"rows{i}"])] = (ids, int(table.shape[1]))
        if len(hidden) != 1:
            return self.fail(f"the embedding tables differ in hidden size ({sorted(hidden)})", sum)
        if not is_float(sum) or any(t.dtype != sum.dtype for t in tables):
            return self.fail("the embedding tables are not all of the sum's float dtype", sum)
        if not body_supports(getattr(self, "model_opset", 17), sum.dtype):
            return self.fail("an fp16/bf16 embedding LayerNorm needs opset >= 15", sum)
        if sum.shape is None or len(sum.shape) != 3:
            return self.fail("the embedding sum is not [batch, seq, hidden]", sum)
        return self.ok()

    def shape_of(self, value: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
        """The shape of a looked-up row tensor, ``Concat(Shape(ids), [hidden])`` (for ``Shape`` readers)."""
        found = self._row_shapes.get(id(value))
        if found is None:
            return None
        ids, hidden = found
        shape = ir.node("Shape", [ids])
        h = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([hidden], dtype=np.int64))})
        concat = ir.node("Concat", [shape.outputs[0], h.outputs[0]], attributes={"axis": 0})
        return [shape, h, concat], concat.outputs[0]

    def rewrite(self, op: Any, ln_out: ir.Value, sum: ir.Value, scale: ir.Value, **kw: Any) -> Any:
        node = ln_out.producer()
        assert node is not None
        attrs = ln_attrs(node)
        n = 3 if kw.get("table2") is not None else 2
        ids = [kw[f"ids{i}"] for i in range(n)]
        tables = [kw[f"table{i}"] for i in range(n)]
        p = _position_index(ids, tables)
        beta = norm_beta(op, node, sum)
        if n == 2:
            w = 1 - p
            seg_ids, segment = no_segment(op, sum.dtype, int(tables[w].shape[1]))
            return mograph_op(op, "EmbedLayerNorm", ids[w], seg_ids, ids[p], tables[w], segment, tables[p], scale,
                              beta, **attrs)
        rest = sorted((i for i in range(3) if i != p), key=lambda i: -_rows(tables[i]))
        w, s = rest
        return mograph_op(op, "EmbedLayerNorm", ids[w], ids[s], ids[p], tables[w], tables[s], tables[p], scale, beta,
                          **attrs)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return bindings.get("norm")


def no_segment(op: Any, dtype: ir.DataType | None, hidden: int) -> tuple[ir.Value, ir.Value]:
    """The neutral segment lookup of a layer of two lookups: ids ``[[0]]`` (int64, broadcast against the others)
    and a ``[1, hidden]`` table of negative zeros of ``dtype`` (module docstring;
    :func:`mograph.passes.fusion.lowerings.embed.absent_segment` recognises it)."""
    np_dtype = dtype.numpy() if dtype is not None else np.float32
    ids = op.initializer(ir.tensor(np.zeros((1, 1), dtype=np.int64)), name="mograph_no_segment_ids")
    table = op.initializer(ir.tensor(np.full((1, hidden), -0.0, dtype=np_dtype)), name="mograph_no_segment")
    return ids, table


class FuseEmbedLayerNormPass(FusionPass):
    """Fuse BERT-style word + segment + position (or word + position) embedding lookups and their LayerNorm
    into one op."""

    name = "fuse-embed-layernorm"

    def make_rules(self) -> list[Rule]:
        return [EmbedLayerNormFusion()]
