"""``fuse-attention --explain`` (:mod:`.attention`): every Softmax that looks like attention and did not fuse, and why.

A Softmax looks like attention when its input comes from a MatMul (through ``Add``/``Div``/``Mul``/``Where``/
``Cast``/``Identity``) and its output feeds one.  Each is reported with the rule's near miss that reached it, or
else the first node below it that is not what the rule expects.  Read-only.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from mograph.passes.fusion._attention_reads import _perm

__all__ = ["explain_unfused"]


def _looks_like_attention(softmax: ir.Node) -> bool:
    """A Softmax whose input comes (through Add/Div/Mul/Where) from a MatMul and whose output feeds a MatMul."""
    value = softmax.inputs[0]
    for _ in range(4):
        node = value.producer() if value is not None else None
        if node is None:
            return False
        if node.op_type == "MatMul":
            break
        if node.op_type not in ("Add", "Div", "Mul", "Where", "Cast", "Identity"):
            return False
        value = node.inputs[0] if node.op_type != "Where" else node.inputs[2]
        if node.op_type == "Add" and value is not None and value.producer() is None:
            value = node.inputs[1]
    else:
        return False
    return _feeds_matmul(softmax.outputs[0], 3)


def _feeds_matmul(value: ir.Value, depth: int) -> bool:
    for c, _ in value.uses():
        if c.op_type == "MatMul":
            return True
        if depth > 0 and c.op_type in ("Where", "IsNaN", "Cast", "Add", "Mul", "Div") and any(_feeds_matmul(o, depth - 1) for o in c.outputs):
            return True
    return False


def _first_mismatch_below(softmax: ir.Node) -> str:
    """Walk the attention output from the softmax; name the first node that is not what the rule expects."""
    value = softmax.outputs[0]
    uses = [c for c, _ in value.uses()]
    where = next((c for c in uses if c.op_type == "Where"), None)
    if where is not None and len(uses) <= 2:
        value = where.outputs[0]
        uses = [c for c, _ in value.uses()]
    mm = next((c for c in uses if c.op_type == "MatMul" and c.inputs[0] is value), None)
    if mm is None:
        got = ", ".join(f"{c.op_type} '{c.name}'" for c in uses) or "nothing"
        return f"expected MatMul(probabilities, V) after Softmax '{softmax.name}', got {got}"
    value = mm.outputs[0]
    for step, (op_type, what) in enumerate((("Transpose", "perm [0, 2, 1, 3] merging the heads"),
                                             ("Reshape", "to [batch, seq, heads * head_dim]"))):
        users = [c for c, _ in value.uses()]
        if len(users) != 1:
            got = ", ".join(f"{c.op_type} '{c.name}'" for c in users) or "nothing (a graph output)"
            return f"expected one {op_type} {what} after '{value.name}', got {got}"
        nxt = users[0]
        if step == 0 and nxt.op_type == "Reshape":  # sdpa's no-op reshape before the merge
            value = nxt.outputs[0]
            users = [c for c, _ in value.uses()]
            nxt = users[0] if len(users) == 1 else nxt
        if nxt.op_type != op_type or (op_type == "Transpose" and _perm(nxt) != [0, 2, 1, 3]):
            return f"expected {op_type} {what} after '{value.name}', got {nxt.op_type} '{nxt.name}'"
        value = nxt.outputs[0]
    return "the attention output matched; the scores, mask or Q/K/V side did not (see near_miss_list)"


def explain_unfused(model: ir.Model, details: dict[str, Any]) -> list[dict[str, str]]:
    """For every Softmax left that looks like attention: the near miss that reached it, or the first mismatch."""
    misses = details.get("rules", {}).get("AttentionFusion", {}).get("near_miss_list", [])
    out = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx") or not _looks_like_attention(node):
            continue
        key = node.name or node.op_type  # near misses list unnamed nodes by op type
        hit = next((m for m in misses if key in m["nodes"]), None)
        reason = hit["reason"] if hit is not None else _first_mismatch_below(node)
        out.append({"softmax": node.name or "", "reason": reason})
    return out
