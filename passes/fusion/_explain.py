"""``--explain`` for what did not fuse: regions that look like a norm or a GELU, and where each match failed.

A region is anchored at a node that only norms and GELUs are made of, left unfused after the rules ran:

* ``norm`` passes: a reduction (``ReduceMean``, ``ReduceSum``, ``GlobalAveragePool``) over the last
  axis, with kept dims or not, the mean or mean square a LayerNorm / RMSNorm starts from (a
  ``ReduceSum`` when a ``Sqrt``, ``Reciprocal``, ``Pow`` or ``Div`` is within reach below it: a
  softmax's sum is no norm);
* ``gelu`` pass: ``Erf``, ``Tanh`` or ``Sigmoid`` (the core of each GELU form).

For each anchor, every rule of the pass is matched (read-only) at each node up to
:data:`_REACH` steps downstream of it, and the deepest failed match that reached the anchor is
reported (preferring, among the deepest, one that reached the anchor): the rule, the root it was
tried from, the **first node where the match failed** and the
matcher's reason, which says what was expected there ("constant 'c' is 0.9, expected 0.797885",
"reduction 'r' is not over the last axis (axis 1)"), plus, as ``constants_off``, every constant any
alternative found off its value.  Anchors no match reached are listed too, so a
region is never silently absent from the explanation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from mograph.patterns import Rule

__all__ = ["unfused_regions"]

_ANCHORS = {
    "norm": ("ReduceMean", "ReduceSum", "GlobalAveragePool"),
    "gelu": ("Erf", "Tanh", "Sigmoid"),
}
#: How far downstream of an anchor roots are tried (a LayerNorm's root is ~8 nodes below its mean).
_REACH = 10


#: Ops below a reduction that make it look like a norm's (a root of the variance, or its inverse).
_ROOTS = ("Sqrt", "Reciprocal", "Pow", "Div")


def _last_axis(node: ir.Node) -> bool:
    """Whether ``node`` reduces the last axis only, with kept dims or not (jax2tf and Flax reduce without
    them and reshape back)."""
    x = node.inputs[0] if node.inputs else None
    rank = len(x.shape) if x is not None and x.shape is not None else None
    if node.op_type == "GlobalAveragePool":
        return rank == 3
    from mograph.passes.fusion._common import _axes_of

    axes = _axes_of(node)
    if not isinstance(axes, list) or len(axes) != 1:
        return False
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def _looks_like_norm(anchor: ir.Node) -> bool:
    """A mean (``ReduceMean``, ``GlobalAveragePool``) is a region as such; a ``ReduceSum`` only with a
    root or a division by one within reach below it (a sum-based mean or mean square), so the sum of
    a softmax is not one."""
    if anchor.op_type != "ReduceSum":
        return True
    return any(n.op_type in _ROOTS and n.domain in ("", "ai.onnx") for n in _downstream(anchor, _REACH))


def _downstream(node: ir.Node, reach: int) -> list[ir.Node]:
    seen: dict[int, ir.Node] = {}
    frontier = [node]
    for _ in range(reach):
        nxt = []
        for n in frontier:
            for out in n.outputs:
                for user, _ in out.uses():
                    if id(user) not in seen:
                        seen[id(user)] = user
                        nxt.append(user)
        frontier = nxt
    return list(seen.values())


def unfused_regions(model: ir.Model, rules: list[Rule], kind: str,
                    origin: Callable[[ir.Node], str | None] | None = None) -> list[dict[str, Any]]:
    """One entry per unfused anchor of ``kind`` ('norm' or 'gelu') in the main graph, with the deepest failure.

    ``origin(node)`` names the exporter's node a canonical node stands for (None for the exporter's own).
    """
    graph = model.graph
    index = {id(n): i for i, n in enumerate(graph)}

    def name(node: ir.Node) -> str:
        own = origin(node) if origin is not None else None
        if own is not None:
            return f"{own} (canonical {node.op_type})"
        return node.name or f"{node.op_type}#{index.get(id(node), '?')}"

    out: list[dict[str, Any]] = []
    for anchor in list(graph):
        if anchor.domain not in ("", "ai.onnx") or anchor.op_type not in _ANCHORS[kind]:
            continue
        if kind == "norm" and not (_last_axis(anchor) and _looks_like_norm(anchor)):
            continue
        best: tuple[int, dict[str, Any]] | None = None
        constants: list[str] = []
        for root in [anchor, *_downstream(anchor, _REACH)]:
            for rule in rules:
                if rule.min_candidate_nodes >= 10**6:  # the absorption rules: they start from a fused op
                    continue
                for _gp, matcher, _tag in rule.compiled():
                    match = matcher.match(model, graph, root, remove_nodes=False)
                    if match:
                        continue
                    constants += [c for c in matcher.constant_misses if c not in constants]
                    # deepest first; among equals, a match that reached the anchor
                    depth = matcher.best_depth * 2 + (anchor in matcher.best_nodes)
                    if matcher.best_depth > 0 and (best is None or depth > best[0]):
                        at = matcher.best_node
                        best = (depth, {
                            "rule": rule.name,
                            "root": name(root),
                            "failed_at": name(at) if at is not None else None,
                            "failed_at_op": at.op_type if at is not None else None,
                            "reason": matcher.best_reason or match.reason,
                            "nodes_matched": matcher.best_depth,
                        })
        entry: dict[str, Any] = {"anchor": name(anchor), "op": anchor.op_type}
        if best is None:
            entry["reason"] = (f"no {kind} rule matched as far as this {anchor.op_type} from any node up to "
                               f"{_REACH} steps below it")
        else:
            entry.update(best[1])
        if constants:  # constants some alternative expected otherwise (a GELU with a wrong constant ...)
            entry["constants_off"] = constants
        out.append(entry)
    return out
