"""The canonicalization engine: apply the rules at every node, then commit or undo each edit.

Every rewrite is an edit that keeps what it replaced: the replaced nodes stay in the graph, detached (no
inputs, a private domain, so no rule matches them), until the fusion rules have run.  Then each edit is
**committed** if a fusion consumed what it made (the replaced nodes are deleted), or **undone** otherwise
(the replaced nodes get their inputs back, their readers are wired back to them, and what the edit made
is removed), in reverse order, so a graph where nothing fused comes back exactly as it was.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._common import GraphShapes
from mograph.passes.fusion.canonicalize._base import STD, Build, CanonRule, Miss
from mograph.passes.fusion.canonicalize._layout import LAYOUT_RULES
from mograph.passes.fusion.canonicalize._rules import RULES

from mograph.errors import InternalError
from mograph.patterns import remove_dead_producers

__all__ = ["Canonicalizer"]

logger = logging.getLogger(__name__)

_DETACHED = "mograph.canonicalize.detached"


@dataclass
class _Edit:
    """One rewrite: ``old`` (its root first) replaced by ``new_value`` (made by ``new_nodes``)."""

    rule: str
    old_value: ir.Value
    new_value: ir.Value
    detached: list[tuple[ir.Node, list[ir.Value | None], str]]  # node, its inputs, its domain
    new_nodes: list[ir.Node]
    new_inits: list[ir.Value]
    moved: list[tuple[ir.Node, int]]  # readers rewired from old_value to new_value
    outputs: list[int]  # graph output slots rewired
    direct: list[ir.Node] = field(default_factory=list)  # readers new_value had before the edit
    names: tuple[str | None, str | None] | None = None  # (old, new) names before a swap




class Canonicalizer:
    """Apply the rewrites to a graph (:meth:`apply`), then keep those a fusion used (:meth:`resolve`).

    ``shapes``: the shape query the rules that must prove two shapes equal ask (``expand-noop``, ``keepdims``,
    ``neutral``); by default one over ``graph`` with the built-in rules.  It tracks int32 shape vectors: the
    exporters whose spellings these rules undo (jax2tf through tf2onnx) compute a dynamic batch dim's shape in
    int32, and the rewrites are exact for every dim that int32 holds, as the exported graph itself is.  Swept
    on the first ask, so a graph no such rule looks at is not swept; a value an edit made is visited when asked
    (:class:`~mograph.passes.fusion._common.GraphShapes`); an edit keeps the shapes of what it replaces, so what
    was swept stays true.
    """

    def __init__(self, graph: ir.Graph, opset: int, rules: tuple[str, ...] | None = None,
                 shapes: GraphShapes | None = None) -> None:
        self.graph = graph
        self.shapes = shapes if shapes is not None else GraphShapes(graph, int32=True)
        self.opset = opset
        # every algebraic rewrite by default; the layout ones (:mod:`._layout`) only where named
        self.rules: list[CanonRule] = (list(RULES) if rules is None else
                                       [r for r in (*RULES, *LAYOUT_RULES) if r.name in rules])
        self._by_op: dict[str, list[CanonRule]] = {}  # root op type -> its rules, in RULES' order
        for rule in self.rules:
            for op in rule.ops:
                self._by_op.setdefault(op, []).append(rule)
        self.edits: list[_Edit] = []
        self.position: dict[int, int] = {}
        self.original: set[ir.Node] = set()
        self.memo: dict[tuple[int, tuple[object, ...]], tuple[ir.Value, ir.Value]] = {}
        #: nodes a kept edit deleted, with their inputs and domain: an earlier edit undone after it may read them
        self._removed: dict[int, tuple[ir.Node, list[ir.Value | None], str]] = {}
        self._n = 0

    # -- building blocks ------------------------------------------------------------------
    def node(self, op: str, inputs: list[ir.Value], like: ir.Value, **attrs: object) -> ir.Node:
        """A new default-domain node whose output has ``like``'s dtype and shape."""
        node = ir.node(op, inputs, attributes=attrs)  # type: ignore[arg-type]
        self._n += 1
        node.name = f"mograph_canon_{self._n}"
        out = node.outputs[0]
        out.name = f"{like.name or 'v'}_canon{self._n}"
        out.type, out.shape = like.type, like.shape
        return node

    def constant(self, arr: np.ndarray, like_name: str | None) -> ir.Value:
        self._n += 1
        name = f"{like_name or 'c'}_canon{self._n}"
        while name in self.graph.initializers:
            self._n += 1
            name = f"{like_name or 'c'}_canon{self._n}"
        value = ir.Value(name=name, const_value=ir.tensor(arr, name=name))
        value.dtype = ir.DataType.from_numpy(arr.dtype)
        value.shape = ir.Shape(list(arr.shape))
        return value

    # -- applying ------------------------------------------------------------------------
    def apply(self) -> Counter:
        """Rewrite every node of the graph (in order) until no rule applies to it; counts per rule."""
        counts: Counter = Counter()
        self.position = {id(n): i for i, n in enumerate(self.graph)}
        self.original = set(self.graph)  # (held, so ids of removed nodes are not reused meanwhile)
        for node in list(self.graph):
            current: ir.Node | None = node
            for _ in range(8):  # a node's rewrites chain (a + Neg(b) -> a - b -> ...); bounded
                if current is None or current.graph is not self.graph or current.domain not in STD:
                    break
                if len(current.outputs) != 1:
                    break
                done = None
                for rule in self._by_op.get(current.op_type, ()):
                    build = rule.apply(self, current)
                    if isinstance(build, Build) and self._commit_edit(rule.name, current, build):
                        counts[rule.name] += 1
                        done = build
                        break
                if done is None:
                    break
                current = done.value.producer() if done.nodes else None
        return counts

    def _commit_edit(self, rule: str, root: ir.Node, build: Build) -> bool:
        graph, old = self.graph, root.outputs[0]
        new = build.value
        if old.is_graph_output() and not build.nodes:
            return False  # a graph output needs a node of its own to keep its name
        if build.nodes:
            graph.insert_before(root, build.nodes)
        for init in build.inits:
            graph.register_initializer(init)
        if new.type is None:
            new.type = old.type
        if new.shape is None:
            new.shape = old.shape
        edit = _Edit(rule, old, new, [], list(build.nodes), list(build.inits), [], [])
        edit.moved = [(user, i) for user, i in old.uses()]
        edit.direct = [user for user, _ in new.uses() if user is not root]
        edit.outputs = [i for i, v in enumerate(graph.outputs) if v is old]
        if edit.outputs:
            edit.names = (old.name, new.name)
            name = old.name
            old.name = f"{name}__mograph_canon_replaced"
            new.name = name
        for user, i in edit.moved:
            user.replace_input_with(i, new)
        for i in edit.outputs:
            graph.outputs[i] = new
        self._detach(root, edit)
        self.edits.append(edit)
        return True

    def _detach(self, root: ir.Node, edit: _Edit) -> None:
        """Detach ``root`` and every producer that only it read (so no rule sees a reader that is gone)."""
        stack = [root]
        while stack:
            node = stack.pop()
            inputs = list(node.inputs)
            edit.detached.append((node, inputs, node.domain))
            for i in range(len(inputs)):
                node.replace_input_with(i, None)
            node.domain = _DETACHED
            for v in inputs:
                p = v.producer() if v is not None else None
                if (p is not None and p.graph is self.graph and p.domain in STD
                        and not any(o.uses() or o.is_graph_output() for o in p.outputs)):
                    stack.append(p)

    def why_not(self, node: ir.Node) -> dict[str, str]:
        """Per rule, why it does not rewrite ``node`` now ("" where it would): for diagnostics only.

        Nothing is committed, but a rule that applies builds its nodes (left unattached) and takes
        names from the same counter, so call this after :meth:`apply`, not between its rewrites."""
        reasons: dict[str, str] = {}
        for rule in self.rules:
            if node.graph is not self.graph:
                reasons[rule.name] = "the node is not in the graph"
                continue
            if len(node.outputs) != 1:
                reasons[rule.name] = "the node has more than one output"
                continue
            result = rule.apply(self, node)
            if isinstance(result, Miss):
                reasons[rule.name] = result.reason
            elif node.outputs[0].is_graph_output() and not result.nodes:
                reasons[rule.name] = "a graph output needs a node of its own to keep its name"
            else:
                reasons[rule.name] = ""
        return reasons

    def origin(self, node: ir.Node) -> str | None:
        """The name of the exporter's node a node made here stands for (None for any other node)."""
        for edit in self.edits:
            if any(n is node for n in edit.new_nodes):
                root = edit.detached[0][0]
                return root.name or edit.old_value.name or root.op_type
        return None

    # -- resolving -----------------------------------------------------------------------
    def resolve(self) -> tuple[Counter, Counter]:
        """Commit the edits a fusion consumed, undo the others (newest first); (committed, undone) per rule."""
        kept: Counter = Counter()
        undone: Counter = Counter()
        graph = self.graph
        made = {id(n) for e in self.edits for n in e.new_nodes}
        dead: list[ir.Value | None] = []
        for edit in reversed(self.edits):
            outs = [v for n in edit.new_nodes for v in n.outputs]
            if edit.new_nodes or edit.new_value in edit.new_inits:
                # what the edit made, or a reader it rewired, went into a fusion; or a fused op reads what it
                # made (fuse-attention takes a projection as its input and leaves the split it traced through
                # to die: the split is still in the graph here, unread)
                used = any(n.graph is not graph for n in edit.new_nodes) or any(
                    u.graph is not graph for u, _ in edit.moved) or any(
                    u.graph is graph and u not in self.original and id(u) not in made
                    for v in outs for u, _ in v.uses()) or self._cached(outs, made)
            else:
                # an existing value stands in for the node (Identity, no-op Cast ...): the edit was used
                # only if that value itself went into a fusion; a fusion that merely reads it (its
                # input) is rewired to the original node on undo
                used = self._stand_in_used(edit) or self._cached([edit.new_value], made)
            if used:
                dead.extend(self._keep(edit))
                kept[edit.rule] += 1
            else:
                self._undo(edit)
                undone[edit.rule] += 1
        # once every edit is resolved: an earlier edit undone may read again what a kept one left unread
        remove_dead_producers(graph, dead)
        self.edits.clear()
        self._removed.clear()
        self._check()
        return kept, undone

    def _cached(self, values: list[ir.Value], made: set[int]) -> bool:
        """Whether what an edit made (``values``) reaches a fusion through the exporter's KV-cache ``Concat``.

        GPT-NeoX's and Falcon's new V heads (``head-slice``, ``group-slice``) are the ``new`` of the cache's
        ``Concat(past, new)``, the present, which stays (a graph output); the fused op reads it through what the
        fusion built after it, not directly.  Up to two exporter's Transpose / Reshape nodes of the heads may sit
        between the edit and the Concat (Falcon's ``.transpose(1, 2).reshape(B, H, S, D)``)."""
        graph = self.graph
        stack = [(v, 0) for v in values]
        while stack:  # (through the exporter's Transpose / Reshape of the heads in front of the Concat: Falcon's)
            v, depth = stack.pop()
            for u, _ in v.uses():
                if u.graph is not graph or u not in self.original or u.domain not in STD:
                    continue
                if u.op_type == "Concat" and any(w.graph is graph and w not in self.original and id(w) not in made
                                                 for w, _ in u.outputs[0].uses()):
                    return True
                if u.op_type in ("Transpose", "Reshape") and depth < 2:
                    stack.append((u.outputs[0], depth + 1))
        return False

    def _stand_in_used(self, edit: _Edit) -> bool:
        """Whether an edit that let an existing value stand in for a node went into a fusion.

        Yes if that value's producer was fused away, or if the fusion consumed both a reader the edit
        rewired and a reader the value had anyway (the fusion needed the two paths to be one value:
        ``x - 0`` and ``x * x``, two Casts of one input).  Otherwise the fusion merely reads the value
        as its input, and the node (an Identity, a no-op Cast) goes back in front of it.
        """
        graph, value = self.graph, edit.new_value
        p = value.producer()
        if p is not None and p.graph is not graph:
            return True
        moved_gone = any(u.graph is not graph for u, _ in edit.moved)
        return moved_gone and any(u.graph is not graph for u in edit.direct)

    def _keep(self, edit: _Edit) -> list[ir.Value | None]:
        """Delete what the edit replaced; the values those nodes read (to remove once nothing reads them)."""
        graph = self.graph
        inputs = [v for _, ins, _ in edit.detached for v in ins]
        for node, ins, domain in edit.detached:
            if node.graph is graph:
                graph.remove(node)
                self._removed[id(node)] = (node, ins, domain)
        if edit.names is not None:  # the replaced value is gone: give it its name back for the record
            edit.old_value.name = edit.names[0] + "__mograph_canon_removed" if edit.names[0] else None
        return inputs

    def _undo(self, edit: _Edit) -> None:
        graph = self.graph
        for node, inputs, domain in reversed(edit.detached):
            node.domain = domain
            for i, v in enumerate(inputs):
                self._restore(v, node)
                p = v.producer() if v is not None else None
                if (v is not None and p is None and v.const_value is not None and v.name
                        and v.name not in graph.initializers and not v.is_graph_input()):
                    graph.register_initializer(v)  # a fusion dropped it once nothing else read it
                elif p is not None and p.graph is None and p.op_type == "Constant" and not p.inputs:
                    graph.insert_before(node, p)  # likewise a Constant node (e.g. a shared 1.0 a norm took)
                node.replace_input_with(i, v)
        for user, i in edit.moved:
            if user.graph is graph and user.inputs[i] is edit.new_value:
                user.replace_input_with(i, edit.old_value)
        if not edit.new_nodes and edit.new_value not in edit.new_inits:
            for user, i in list(edit.new_value.uses()):  # fused ops made since, reading the stand-in
                if user.graph is graph and user not in self.original and user.domain != _DETACHED:
                    user.replace_input_with(i, edit.old_value)
        for i in edit.outputs:
            graph.outputs[i] = edit.old_value
        if edit.names is not None:
            edit.new_value.name, edit.old_value.name = edit.names[1], edit.names[0]
        if edit.new_nodes:
            live = [n for n in edit.new_nodes if n.graph is graph]
            for n in live:
                for i in range(len(n.inputs)):
                    n.replace_input_with(i, None)
            graph.remove(live)
        for init in edit.new_inits:
            name = init.name
            if name is not None and not init.uses() and graph.initializers.get(name) is init:
                del graph.initializers[name]

    def _restore(self, value: ir.Value | None, reader: ir.Node) -> None:
        """Put back (before ``reader``) the producer of ``value`` if a kept edit deleted it: a producer that only
        the roots of two edits read goes with the later one, and the earlier one, undone, reads it again."""
        p = value.producer() if value is not None else None
        held = self._removed.pop(id(p), None) if p is not None and p.graph is None else None
        if held is None:
            return
        node, inputs, domain = held
        self.graph.insert_before(reader, node)
        node.domain = domain
        for i, v in enumerate(inputs):
            self._restore(v, node)
            node.replace_input_with(i, v)

    def _check(self) -> None:
        """Every input is produced in the graph, an initializer, a graph input or an outer value."""
        for node in self.graph:
            if node.domain == _DETACHED:
                raise InternalError("canonicalize", f"node '{node.name}' was left detached")


