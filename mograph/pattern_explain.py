"""``--explain``: the regions a pass's rules left unfused, found from the anchors the rules declare.

A rule declares where its computation shows (:attr:`mograph.patterns.Rule.anchors`: a ``Softmax`` for attention,
a last-axis reduction for a norm, an ``Erf`` for a GELU).  After the rules ran, every anchor node left is a region
the rules did not fuse, reported with where the rule's own matching stopped: the rule, the root it was tried
from, the **first node where the match failed** and the matcher's (or the rule's check's) reason.  Read-only.

Two ways to reach the rule from an anchor:

* an anchor with a ``value`` (the pattern value the anchor node writes) is followed *through the pattern*: the
  part of the pattern below that value must match at the anchor whole (that is what makes the node a region),
  then the pattern's nodes above it are followed from the anchor, consumer by consumer, to the rule's root.  A
  node where the pattern expects another is the failure ("expected MatMul(probabilities, V) after Softmax 'p',
  got Add 'pb'"); a root reached is tried as the sweep tries it (:func:`attempt`: the match,
  the node checks, the values read outside and the rule's check), and its reason is reported.  So a near miss
  between the anchor and the root, which no root's match reaches, is reported too.  Up to ``Anchor.skip``
  nodes not of the pattern next to the anchor are looked through, so such a region is still found.
* an anchor without ``value`` is matched from every node up to ``Anchor.reach`` steps below it, and the deepest
  failed match is reported (preferring, among the deepest, one that reached the anchor), plus, as
  ``constants_off``, every constant an alternative found off its value.  An anchor no match reached is
  listed too, so a region is never silently absent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import _pattern_ir

from mograph._traverse import iter_nodes
from mograph.patterns import COMMUTATIVE, Anchor, MatchResult, Rule, _judge, _Matcher

__all__ = ["Attempt", "attempt", "downstream", "unfused_regions"]

Namer = Callable[[ir.Node], str]


def unfused_regions(model: ir.Model, rules: Sequence[Rule],
                    origin: Callable[[ir.Node], str | None] | None = None) -> list[dict[str, Any]]:
    """One entry per anchor left unfused, of every rule in ``rules`` that declares anchors, in graph order.

    ``origin(node)`` names the exporter's node a canonical node stands for (None for the exporter's own).
    Each entry: ``anchor`` (its name), ``op``, ``kind`` and, when a rule got somewhere, ``rule``, ``root``,
    ``failed_at`` / ``failed_at_op`` (the first node where the match failed), ``nodes_matched`` and ``reason``.
    """
    anchored = [r for r in rules if r.anchors]
    if not anchored:
        return []
    index = {id(n): i for i, n in enumerate(model.graph)}

    def name(node: ir.Node) -> str:
        own = origin(node) if origin is not None else None
        if own is not None:
            return f"{own} (canonical {node.op_type})"
        return node.name or f"{node.op_type}#{index.get(id(node), '?')}"

    out: list[dict[str, Any]] = []
    for node in list(iter_nodes(model.graph)):
        found = [(rule, a) for rule in anchored for a in rule.anchors if a.takes(node)]
        if not found:
            continue
        along = [(rule, a) for rule, a in found if a.value is not None]
        entry = _along_pattern(model, node, along, name) if along else _below(model, node, anchored, found[0][1], name)
        if entry is not None:
            out.append(entry)
    return out


@dataclass
class Attempt:
    """What :func:`attempt` found at a root: ``reason`` None when the rule would rewrite there, else the deepest
    failure: the nodes it got through, the node it stopped at and why."""

    reason: str | None
    nodes: list[ir.Node]
    failed_at: ir.Node | None = None
    #: the structural depth of a failed match; a whole match refused by a check ranks above every one
    rank: int = 0


def attempt(rule: Rule, model: ir.Model, graph: ir.Graph, node: ir.Node) -> Attempt | None:
    """Try ``rule`` at root ``node`` as :func:`mograph.patterns.apply_rules` would, read-only: whether it would
    rewrite there, or how far it got and why not (``None`` when no root alternative has ``node``'s op type)."""
    best: Attempt | None = None
    for gp, matcher, tag in rule.compiled():
        root_op = gp.output_nodes[0].op_identifier()
        if root_op is not None and root_op[1] != node.op_type:
            continue
        verdict = _judge(rule, model, graph, node, gp, matcher, tag, rewire=False)
        if verdict is None:
            continue
        if verdict.reason is None:
            return Attempt(None, verdict.nodes)
        rank = matcher.best_depth if verdict.structural else len(verdict.nodes) + 1000
        if best is None or rank > best.rank:
            best = Attempt(verdict.reason, verdict.nodes, verdict.failed_at, rank)
    return best


# ---------------------------------------------------------------------------------------------
# anchors without a value: the rules tried at the roots below
# ---------------------------------------------------------------------------------------------


def downstream(node: ir.Node, reach: int) -> list[ir.Node]:
    """The nodes up to ``reach`` steps below ``node`` (reading what it computes, directly or not)."""
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


def _below(model: ir.Model, anchor: ir.Node, rules: list[Rule], declared: Anchor, name: Namer) -> dict[str, Any]:
    """The deepest failed match of ``rules`` from the nodes up to ``declared.reach`` steps below ``anchor``."""
    graph = anchor.graph
    assert graph is not None
    best: tuple[int, dict[str, Any]] | None = None
    constants: list[str] = []
    for root in [anchor, *downstream(anchor, declared.reach)]:
        for rule in rules:
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
    entry: dict[str, Any] = {"anchor": name(anchor), "op": anchor.op_type, "kind": declared.kind}
    if best is None:
        entry["reason"] = (f"no {declared.kind} rule matched as far as this {anchor.op_type} from any node up to "
                           f"{declared.reach} steps below it")
    else:
        entry.update(best[1])
    if constants:  # constants some alternative expected otherwise (a GELU with a wrong constant ...)
        entry["constants_off"] = constants
    return entry


# ---------------------------------------------------------------------------------------------
# anchors with a value: the pattern followed from the anchor to the root
# ---------------------------------------------------------------------------------------------


def _alternatives(value: _pattern_ir.ValuePattern) -> list[_pattern_ir.ValuePattern]:
    """The values an input pattern may be: each alternative of an ``OrValue`` (nested ones too), else itself."""
    if isinstance(value, _pattern_ir.BacktrackingOr):
        return [a for v in value._values for a in _alternatives(v)]
    if isinstance(value, _pattern_ir.OpIdDispatchOr):
        return [a for _, v in value._op_to_pattern.values() for a in _alternatives(v)]
    return [value]


@dataclass
class _Shape:
    """A root alternative of a rule seen from its values: who reads each, and each node's distance to the root."""

    root: _pattern_ir.NodePattern
    uses: dict[int, list[tuple[_pattern_ir.NodePattern, int]]] = field(default_factory=dict)
    distance: dict[int, int] = field(default_factory=dict)
    named: dict[str, _pattern_ir.NodeOutputPattern] = field(default_factory=dict)


def _shape(gp: _pattern_ir.GraphPattern) -> _Shape:
    root = gp.output_nodes[0]
    shape = _Shape(root, distance={id(root): 0})
    queue = [root]
    while queue:
        node = queue.pop(0)
        for out in node.outputs:
            if out.name is not None:
                shape.named.setdefault(out.name, out)
        for i, value in enumerate(node.inputs):
            if value is None:
                continue
            for alt in _alternatives(value):
                shape.uses.setdefault(id(alt), []).append((node, i))
                producer = alt.producer()
                if producer is not None and id(producer) not in shape.distance:
                    shape.distance[id(producer)] = shape.distance[id(node)] + 1
                    queue.append(producer)
    return shape


@dataclass
class _Walk:
    """What following the pattern from the anchor found."""

    roots: list[ir.Node] = field(default_factory=list)  # roots reached with no node skipped
    covered: int = 0  # the most pattern nodes gone through (skipped nodes allowed)
    failure: tuple[int, ir.Node, str] | None = None  # (depth, node it stopped at, reason), with no node skipped


def _label(rule: Rule, value: _pattern_ir.ValuePattern | None) -> str:
    if value is None:
        return ""
    if isinstance(value, _pattern_ir.Constant):
        return str(value.value)
    name = value.name
    if name is not None and not isinstance(value, (_pattern_ir.BacktrackingOr, _pattern_ir.OpIdDispatchOr)):
        return rule.labels.get(name, name)
    producer = value.producer()
    return f"{producer.op_type}(...)" if producer is not None else "..."


def _describe(rule: Rule, node: _pattern_ir.NodePattern, at: int, came: str) -> str:
    """``MatMul(probabilities, V)``: the pattern node, input ``at`` being the value the walk came from."""
    args = [came if i == at else _label(rule, v) for i, v in enumerate(node.inputs)]
    attrs = [f"{k}={v}" for k, v in node.attributes.items()]
    return f"{node.op_type}({', '.join(args + attrs)})"


def _reads(node: _pattern_ir.NodePattern, consumer: ir.Node, j: int, i: int) -> bool:
    """Whether ``consumer`` reading the value as its input ``j`` may be pattern ``node`` reading it as input ``i``."""
    if j == i:
        return True
    return (consumer.op_type in COMMUTATIVE and consumer.domain in ("", "ai.onnx") and len(consumer.inputs) == 2
            and len(node.inputs) == 2)


def _follow(rule: Rule, shape: _Shape, value: _pattern_ir.ValuePattern, graph_value: ir.Value, prev: ir.Node,
            depth: int, skipped: int, skip: int, walk: _Walk, name: Namer) -> None:
    """Follow the pattern from ``value`` (written as ``graph_value`` by ``prev``) toward the root."""
    wants = shape.uses.get(id(value), [])
    if not wants:
        return
    matched = False
    why: dict[int, str] = {}
    for consumer, j in graph_value.uses():
        for node, i in wants:
            if not _reads(node, consumer, j, i):
                continue
            result = node.matches(consumer, MatchResult())
            if not result:
                if consumer.op_type == node.op_type:  # the op expected, but not as the pattern has it
                    why.setdefault(id(consumer), result.reason)
                continue
            matched = True
            walk.covered = max(walk.covered, depth + 1)
            if node is shape.root:
                if skipped == 0 and consumer not in walk.roots:
                    walk.roots.append(consumer)
                continue
            for k, out in enumerate(node.outputs):
                if id(out) in shape.uses and k < len(consumer.outputs):
                    _follow(rule, shape, out, consumer.outputs[k], consumer, depth + 1, skipped, skip, walk, name)
    if matched:
        return
    consumers = [c for c, _ in graph_value.uses()]
    if skipped == 0 and (walk.failure is None or depth > walk.failure[0]):
        came = _label(rule, value) if value.name is not None else f"the output of '{name(prev)}'"
        expected = sorted(wants, key=lambda w: shape.distance.get(id(w[0]), 0))
        texts = list(dict.fromkeys(_describe(rule, node, i, came) for node, i in expected))
        got = ", ".join(f"{c.op_type} '{name(c)}'" + (f" ({why[id(c)]})" if id(c) in why else "") for c in consumers)
        if not got:
            got = "nothing (a graph output)" if graph_value.is_graph_output() else "nothing"
        reason = f"expected {' or '.join(texts)} after {prev.op_type} '{name(prev)}', got {got}"
        walk.failure = (depth, consumers[0] if consumers else prev, reason)
    if skipped < skip:  # look through the node where the pattern expects another, to find the region
        for consumer in dict.fromkeys(consumers):
            for written in consumer.outputs:
                _follow(rule, shape, value, written, consumer, depth, skipped + 1, skip, walk, name)


def _below_matches(model: ir.Model, rule: Rule, gp: _pattern_ir.GraphPattern, value: _pattern_ir.NodeOutputPattern,
                   anchor: ir.Node, skip: int, name: Namer) -> tuple[int, tuple[ir.Node, str] | None]:
    """How many nodes the pattern below ``value`` matched at ``anchor`` whole (0: it did not), looking through up
    to ``skip`` nodes between the anchor and the pattern's next node; and the node looked through (the first
    node below the anchor where the pattern expects another) with what the pattern expected there."""
    graph = anchor.graph
    assert graph is not None
    matcher = _Matcher(_pattern_ir.GraphPattern(gp.inputs, [value], gp._nodes))
    if matcher.match(model, graph, anchor, remove_nodes=False):
        return len(matcher._match.nodes), None
    node = value.producer()
    if not node.matches(anchor, MatchResult()):
        return 0, None
    for i, graph_value in enumerate(anchor.inputs):
        stray = graph_value.producer() if graph_value is not None else None
        expected = node.inputs[i] if i < len(node.inputs) else None
        if expected is None or stray is None:
            continue
        frontier = [graph_value]
        for _ in range(skip):  # the inputs of a node not of the pattern, read in its place
            producers = [v.producer() for v in frontier if v is not None]
            frontier = [v for p in producers if p is not None for v in p.inputs]
            for seen in frontier:
                inputs = list(anchor.inputs)
                inputs[i] = seen
                matcher._init_match(0)
                if matcher._match_inputs(node.inputs, inputs):
                    wanted = [alt.producer() for alt in _alternatives(expected)]
                    texts = dict.fromkeys(_describe(rule, w, -1, "") for w in wanted if w is not None)
                    reason = (f"expected {' or '.join(texts)} before {anchor.op_type} '{name(anchor)}', got "
                              f"{stray.op_type} '{name(stray)}'")
                    return matcher._match.num_matched_nodes() + 1, (stray, reason)
    return 0, None


def _along_pattern(model: ir.Model, anchor: ir.Node, declared: list[tuple[Rule, Anchor]],
                   name: Namer) -> dict[str, Any] | None:
    """The entry of an anchor with a value: ``None`` when it is no region (the pattern below it does not match,
    or nothing of the pattern above it follows) or when the rule would fuse it."""
    best: tuple[tuple[int, int], dict[str, Any]] | None = None
    for rule, a in declared:
        for gp, _matcher, _tag in rule.compiled():
            shape = _shape(gp)
            value = shape.named.get(a.value or "")
            if value is None or value.output_index >= len(anchor.outputs):
                continue
            below, stray = _below_matches(model, rule, gp, value, anchor, a.skip, name)
            if not below:
                continue
            walk = _Walk()
            _follow(rule, shape, value, anchor.outputs[value.output_index], anchor, 0, 0, a.skip, walk, name)
            if walk.covered == 0:
                continue
            entry: dict[str, Any] = {"anchor": name(anchor), "op": anchor.op_type, "kind": a.kind, "rule": rule.name}
            rank: tuple[int, int]
            if walk.roots:
                tried = [(r, t) for r, t in ((r, attempt(rule, model, r.graph, r)) for r in walk.roots
                                             if r.graph is not None) if t is not None]
                if any(t.reason is None for _, t in tried):
                    return None  # the rule would fuse it (a form the sweep does not take back, e.g. lowered)
                if not tried:
                    continue
                root, got = max(tried, key=lambda rt: rt[1].rank)
                at, reason = (got.failed_at, got.reason) if stray is None else stray
                entry.update(root=name(root), failed_at=name(at) if at is not None else None,
                             failed_at_op=at.op_type if at is not None else None, nodes_matched=len(got.nodes),
                             reason=reason)
                rank = (2, got.rank)
            elif walk.failure is not None:
                depth, at, reason = walk.failure
                entry.update(root=None, failed_at=name(at), failed_at_op=at.op_type, nodes_matched=below + depth,
                             reason=reason)
                rank = (1, below + depth)
            else:
                continue
            if best is None or rank > best[0]:
                best = (rank, entry)
    return best[1] if best is not None else None
