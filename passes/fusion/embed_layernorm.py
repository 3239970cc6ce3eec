"""``fuse-embed-layernorm``: BERT's embedding layer -> one ``mograph.EmbedLayerNorm``.

The math matched::

    s = (Word[ids] + Segment[segment_ids]) + Position[position_ids]     three Gathers on axis 0 of 2-D
                                                                         tables, the Adds in any order
    y = LayerNorm(s)                    a ``mograph.LayerNorm`` (from ``fuse-layernorm``) or the standard
                                        ``LayerNormalization`` over the last axis (opset >= 17 exports)

The tables share their hidden size and dtype (float); the ids are int32 or int64 and may broadcast against
each other (TorchScript exports of BERT slice ``position_ids`` ``[1, S]`` from a buffer).  Which lookup is
the position one is decided here, for the lowering: the one whose ids have a leading 1 where the others do
not, else the one whose ids are a constant or sliced from one; the other two are interchangeable in the
math (word + segment), the larger table is called the word table.  Nothing else may read the partial sums
or the sum (ONNX Runtime's kernel would have to return it).

Runs before ``fuse-skip-layernorm``, which would otherwise take the last Add and the norm.  The ``lower``
step turns the op into ``com.microsoft.EmbedLayerNormalization`` (``ort``: ids cast to int32, position ids
left off when they provably are ``0 .. S-1``, segment ids and table left off when the ids provably are one id,
whose row goes into the position table) or back into the Gathers, Adds and ``LayerNormalization``
(``onnx``, ``tensorrt``).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from mograph.passes.fusion._common import FusionPass, is_float, mograph_op
from mograph.passes.fusion.ops import body_supports
from mograph.passes.fusion.skip_layernorm import check_standard_norm, ln_attrs, norm_beta

from mograph.custom_ops import DOMAIN
from mograph.patterns import MatchResult, OrValue, Rule, Var, constant_array

__all__ = ["EmbedLayerNormFusion", "FuseEmbedLayerNormPass"]

_INT_IDS = (ir.DataType.INT32, ir.DataType.INT64)


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


def _position_index(ids: list[ir.Value]) -> int:
    """Which of the three lookups is the position one (module docstring)."""
    lead = [i for i, v in enumerate(ids) if _leading_one(v)]
    if len(lead) == 1 and not all(_leading_one(v) for v in ids):
        return lead[0]
    const = [i for i, v in enumerate(ids) if _from_constant(v)]
    if len(const) == 1:
        return const[0]
    return 2


class EmbedLayerNormFusion(Rule):
    """LayerNorm(W[ids] + S[seg] + P[pos]) -> mograph.EmbedLayerNorm(ids, seg, pos, W, S, P, scale, beta)."""

    min_candidate_nodes = 4

    def pattern(self, op: Any, scale: Any) -> Any:
        s = op.Add(op.Add(_lookup(op, 0), _lookup(op, 1)), _lookup(op, 2), _outputs=["sum"])
        return OrValue(
            [
                op.LayerNorm(s, scale, Var("beta"), _domain=DOMAIN, _outputs=["ln_out"]),
                op.LayerNormalization(s, scale, _allow_other_inputs=True, _outputs=["ln_out"]),
            ],
            tag_var="norm", tag_values=["mograph", "standard"],
        )

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              ln_out: ir.Value, sum: ir.Value, **kw: Any) -> MatchResult:
        node = ln_out.producer()
        assert node is not None
        failed = check_standard_norm(self, node, "LayerNormalization", "mean or inverse std", sum)
        if failed is not None:
            return failed
        tables = [kw[f"table{i}"] for i in range(3)]
        hidden = set()
        for i in range(3):
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
        if len(hidden) != 1:
            return self.fail(f"the embedding tables differ in hidden size ({sorted(hidden)})", sum)
        if not is_float(sum) or any(t.dtype != sum.dtype for t in tables):
            return self.fail("the embedding tables are not all of the sum's float dtype", sum)
        if not body_supports(getattr(self, "model_opset", 17), sum.dtype):
            return self.fail("an fp16/bf16 embedding LayerNorm needs opset >= 15", sum)
        if sum.shape is None or len(sum.shape) != 3:
            return self.fail("the embedding sum is not [batch, seq, hidden]", sum)
        return self.ok()

    def rewrite(self, op: Any, ln_out: ir.Value, sum: ir.Value, scale: ir.Value, **kw: Any) -> Any:
        node = ln_out.producer()
        assert node is not None
        attrs = ln_attrs(node)
        ids = [kw[f"ids{i}"] for i in range(3)]
        tables = [kw[f"table{i}"] for i in range(3)]
        p = _position_index(ids)
        rest = sorted((i for i in range(3) if i != p), key=lambda i: -int(tables[i].shape[0])
                      if isinstance(tables[i].shape[0], int) else 0)
        w, s = rest
        beta = norm_beta(op, node, sum)
        return mograph_op(op, "EmbedLayerNorm", ids[w], ids[s], ids[p], tables[w], tables[s], tables[p], scale, beta,
                          **attrs)

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return bindings.get("norm")


class FuseEmbedLayerNormPass(FusionPass):
    """Fuse BERT-style word + segment + position embedding lookups and their LayerNorm into one op."""

    name = "fuse-embed-layernorm"

    def make_rules(self) -> list[Rule]:
        return [EmbedLayerNormFusion()]
