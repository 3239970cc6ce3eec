"""Declarative rewrite rules: pattern / check / rewrite, over the onnxscript rewriter.

A fusion is written as a :class:`Rule`: three methods, nothing else::

    class GeluSigmoidFusion(Rule):
        def pattern(self, op, x):
            return op.Mul(x, op.Sigmoid(op.Mul(x, const(1.702))))

        def check(self, context, x, **_):
            if x.dtype not in FLOATS:
                return self.fail("input is not a floating-point tensor", x)
            return self.ok()

        def rewrite(self, op, x, **_):
            return op.QuickGelu(x, alpha=1.702, _domain="mograph")

The pattern language is onnxscript's (``op.Xxx(...)`` node patterns, :func:`OrValue` alternatives,
named variables, ``_outputs=[...]`` to bind intermediate values).  This module adds what exporter
variety needs and the stock matcher lacks:

* **Commutation without blow-up.** ``Add``/``Mul``/``Max``/``Min`` inputs are tried in both orders
  at the node being matched (local backtracking), instead of cloning the whole pattern 2^k times.
* **Alternatives at the root.** ``pattern`` may return an :func:`OrValue`; each alternative is
  tried as its own root, and its tag (``tag_var``) is bound for ``check``/``rewrite``.
* **Constants with tolerance, in any form.** :func:`const` matches a single-element tensor close to
  a value (relative tolerance), whether it is an initializer, a ``Constant`` node, or a small chain
  of ``Cast``/``Identity``/``Reshape``/``Sqrt``/... over constants (:func:`constant_array`).
* **Eager value checks.** A ``Var(name, check=...)`` is checked while matching, so a failed check
  makes the matcher try the next alternative or input order instead of failing the whole match.
* **Reasons.** A failed match keeps the reason of the deepest partial match, and a match that would
  delete a value still read outside the pattern fails with a reason naming the value and its reader.

:func:`apply_rules` runs a list of rules over a model (the main graph and its subgraphs, never
model-local functions: those are the fused ops' own bodies), and returns a :class:`RuleReport`
with exact counts per rule and variant and, per rule, the near misses and why they failed.

The matcher builds on private modules of onnxscript (``_matcher``, ``_pattern_ir``, ``_basics``),
pinned by the installed onnxscript version; this module is the one place that knows about them (with
:mod:`mograph.pattern_explain`, which follows the rules' patterns from their :class:`Anchor` s for ``--explain``).
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _basics, _matcher, _pattern_ir
from onnxscript.rewriter._rewrite_rule import ReplacementPatternFunction, RewriteRuleClassBase

from mograph.irutil import attr_constant, constant_array, scalar_value
from mograph.metadata import LOWERED_FOR

__all__ = [
    "Anchor",
    "MatchResult",
    "OrValue",
    "any_value",
    "attr_constant",
    "Rule",
    "RuleReport",
    "Var",
    "apply_rules",
    "const",
    "constant_array",
    "remove_dead_producers",
    "scalar_value",
    "shape_dependents",
]

logger = logging.getLogger(__name__)

MatchResult = _basics.MatchResult
OrValue = _pattern_ir.OrValue
Var = _pattern_ir.Var

#: Binary ops of the default domain whose two inputs may be swapped.
COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "Sum", "And", "Or", "Equal"})


# ---------------------------------------------------------------------------------------------
# constants (the readers, :func:`constant_array` and friends, live in :mod:`mograph.irutil`)
# ---------------------------------------------------------------------------------------------


class _ApproxConstant(_pattern_ir.Constant):
    """A single-element constant matched with a relative tolerance, in any constant form."""

    def __init__(self, value: float, rel_tol: float, abs_tol: float) -> None:
        super().__init__(value, rel_tol, abs_tol)

    def clone(self, node_map: dict) -> _ApproxConstant:
        del node_map
        return _ApproxConstant(self._value, self._rel_tol, self._abs_tol)  # type: ignore[arg-type]


def any_value() -> _pattern_ir.ValuePattern:
    """An anonymous pattern matching any one value (each call is a different one)."""
    return _pattern_ir.ValuePattern(None)


def const(value: float, rel_tol: float = 1e-3, abs_tol: float = 1e-7) -> _pattern_ir.Constant:
    """A pattern matching a single-element constant within ``rel_tol`` of ``value``.

    The default tolerance accepts the value rounded to float16 (0.044715 -> 0.04471).
    """
    return _ApproxConstant(float(value), rel_tol, abs_tol)


# ---------------------------------------------------------------------------------------------
# matcher
# ---------------------------------------------------------------------------------------------


def _merge_partial(match: MatchResult) -> None:
    """Merge the innermost partial match into its parent, node and value bindings included."""
    inner = match._partial_matches.pop()
    outer = match._partial_matches[-1]
    outer._bindings.update(inner._bindings)
    outer._value_bindings.update(inner._value_bindings)
    outer._node_bindings.update(inner._node_bindings)
    outer._matched_nodes.extend(inner._matched_nodes)


#: onnxscript's matcher messages that --explain shows, in the words of a user's graph
_PLAIN_REASONS = {
    "Mismatch: Computed node pattern does not match uncomputed IR value.":
        "an input the pattern expects to be computed by a node is a graph input or a constant here",
}


class _Matcher(_matcher.SimplePatternMatcher):
    """onnxscript's matcher plus commutation, tolerant constants, eager checks and deepest reasons."""

    def _init_match(self, verbose: int) -> None:
        super()._init_match(verbose)
        self.best_depth = -1
        self.best_reason = ""
        self.best_nodes: list[ir.Node] = []
        self.best_node: ir.Node | None = None
        self.constant_misses: list[str] = []  # every constant that was off, for --explain

    def fail(self, reason: str, node: ir.Node | None = None) -> bool:
        reason = _PLAIN_REASONS.get(reason, reason)
        depth = self._match.num_matched_nodes()
        if depth >= self.best_depth:
            self.best_depth = depth
            self.best_reason = reason
            self.best_node = node or self._current_node
            nodes: list[ir.Node] = []
            for partial in self._match._partial_matches:
                nodes.extend(partial._matched_nodes)
            self.best_nodes = nodes
        self._match.fail(reason, node or self._current_node)
        return False

    def _match_constant(self, pattern_constant: _pattern_ir.Constant, value: ir.Value) -> bool:
        if not isinstance(pattern_constant, _ApproxConstant):
            return super()._match_constant(pattern_constant, value)
        arr = constant_array(value)
        expected = pattern_constant.value
        if arr is None:
            return self.fail(f"'{value.name}' is not a constant (expected {expected})")
        if arr.size != 1:
            return self.fail(f"'{value.name}' has shape {list(arr.shape)}, expected a single value {expected}")
        got = float(arr.reshape(()))
        tol = max(pattern_constant._abs_tol, pattern_constant._rel_tol * abs(float(expected)))  # type: ignore[arg-type]
        if not abs(got - float(expected)) <= tol:  # type: ignore[arg-type]
            reason = f"constant '{value.name}' is {got:g}, expected {expected}"
            self.constant_misses.append(reason)
            return self.fail(reason)
        return True

    def _match_value(self, pattern_value: _pattern_ir.ValuePattern, value: ir.Value | None) -> bool:
        if isinstance(pattern_value, _pattern_ir.BacktrackingOr):
            if not self._match.bind_value(pattern_value, value):
                return False
            for i, choice in enumerate(pattern_value._values):
                self._match.enter_new_match()
                if self._match_value(choice, value):
                    if pattern_value.tag_var is not None:
                        self._match.bind(pattern_value.tag_var, pattern_value._tag_values[i])
                    _merge_partial(self._match)
                    return True
                self._match.abandon_current_match()
            return self.fail(self.best_reason or "none of the alternatives matched")
        ok = super()._match_value(pattern_value, value)
        if ok and type(pattern_value) in (_pattern_ir.Var, _pattern_ir.ValuePattern):
            check = pattern_value.check_method
            if check is not None and value is not None:
                result = check(None, value)
                if not result:
                    reason = getattr(result, "reason", "") or f"check on '{pattern_value}' failed"
                    return self.fail(f"{reason} ('{value.name}')")
        return ok

    def _match_inputs(self, patterns: Sequence[Any], values: Sequence[ir.Value | None]) -> bool:
        for arg_value, arg_pattern in zip(values, patterns):
            if arg_pattern is None:
                if arg_value is None:
                    continue
                return self.fail("(optional) input is expected to be missing")
            if not self._match_value(arg_pattern, arg_value):
                return False
        return True

    def _match_node(self, pattern_node: _pattern_ir.NodePattern, node: ir.Node) -> bool:
        self._current_node = node
        bound = self._match.lookup_node(pattern_node)
        if bound is not None:
            return True if bound is node else self.fail("one pattern node matched to two graph nodes")
        match = self._match
        if not pattern_node.matches(node, match):
            return self.fail(match.reason, node)
        match.bind_node(pattern_node, node)
        patterns = list(pattern_node.inputs)
        values = list(node.inputs)
        if len(values) > len(patterns):
            if not pattern_node.allow_other_inputs:
                return self.fail(f"{node.op_type} has {len(values)} inputs, expected {len(patterns)}", node)
            values = values[: len(patterns)]
        values += [None] * (len(patterns) - len(values))
        if node.op_type in COMMUTATIVE and node.domain in ("", "ai.onnx") and len(values) == 2:
            reasons: list[str] = []
            for order in (values, values[::-1]):
                match.enter_new_match()
                if self._match_inputs(patterns, order):
                    _merge_partial(match)
                    break
                if match.reason and match.reason not in reasons:
                    reasons.append(match.reason)
                match.abandon_current_match()
                if values[0] is values[1]:
                    return self.fail(self.best_reason or "inputs do not match", node)
            else:
                # say why each order failed at this node (a wrong constant, an unexpected op ...)
                why = "; ".join(reasons)
                return self.fail(f"inputs of {node.op_type} '{node.name}' match in neither order ({why})" if why
                                 else self.best_reason or "inputs do not match in either order", node)
        elif not self._match_inputs(patterns, values):
            return False
        for i, output_pattern in enumerate(pattern_node.outputs):
            if i >= len(node.outputs):
                return self.fail(f"{node.op_type} has fewer outputs than the pattern", node)
            if not match.bind_value(output_pattern, node.outputs[i]):
                return False
        return True


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Anchor:
    """Where ``--explain`` looks for what a rule did not fuse (:attr:`Rule.anchors`).

    A node of one of ``ops`` (default domain) that ``admits`` (when given) is a region the rule's computation
    would hold; after the rules ran, each such node left is reported with the rule's deepest failed match
    around it (:mod:`mograph.pattern_explain`).

    Attributes:
        ops: the op types of the anchor node.
        kind: what the region is, for people (``"norm"``, ``"gelu"``, ``"attention"``).
        value: the name of the pattern value (``_outputs=[...]``) the anchor node writes.  With it, the region
            is found by the pattern itself: the part of the pattern below that value must match at the anchor
            whole, and the pattern is followed from the anchor to the rule's root, so a failure between the
            anchor and the root (where no root is reached) is reported too.  Without it the rule is matched
            at every node up to ``reach`` steps below the anchor.
        admits: which nodes of ``ops`` are regions (``None``: all of them).
        reach: how far below the anchor roots are tried (without ``value``).
        skip: how many nodes not of the pattern the anchor's region may hold next to the anchor (with
            ``value``): a node where the pattern expects another is reported, and the region is still found.
    """

    ops: tuple[str, ...]
    kind: str
    value: str | None = None
    admits: Callable[[ir.Node], bool] | None = None
    reach: int = 10
    skip: int = 2

    def takes(self, node: ir.Node) -> bool:
        """Whether ``node`` is an anchor of this kind."""
        return (node.op_type in self.ops and node.domain in ("", "ai.onnx")
                and (self.admits is None or self.admits(node)))


class Rule(RewriteRuleClassBase):
    """A declarative rewrite rule: ``pattern``, ``check`` (returns a reason on failure), ``rewrite``.

    Subclasses implement:

    * ``pattern(self, op, *vars)`` — the computation to find; may return an :func:`OrValue` of
      alternatives for the root. Parameters become pattern variables bound by name.
    * ``check(self, context, **bindings) -> MatchResult`` — conditions the pattern cannot say
      (constants, axes, dtypes, shapes). Return :meth:`ok` or :meth:`fail` with a reason a person
      understands ("epsilon is not a constant").
    * ``rewrite(self, op, **bindings)`` — build the replacement with ``op.Xxx(...)``; return one
      value per pattern output (``None`` for an output nothing reads).
    * ``variant(self, bindings) -> str | None`` — optional label counted in stats as
      ``"<Rule>.<variant>"``.

    Class attribute ``min_candidate_nodes``: a failed match that got at least this many nodes deep
    counts as a *near miss* (reported with its reason).  ``remove_shape_readers``: ``Shape`` nodes
    outside the pattern that read its values and whose computation feeds only the pattern
    (:func:`shape_dependents`) are deleted with it instead of blocking the rewrite; other ``Shape``
    readers of its values are rewired to ``rule.shape_of(value) -> (new nodes, shape tensor) | None``
    (called after a successful ``check``), which computes the same shape from values that survive.
    """

    min_candidate_nodes: int = 3
    #: Report a pattern that matched ``min_candidate_nodes`` deep but not whole as a near miss; ``False``
    #: reports only whole matches refused (by a node check, a value read outside, or :meth:`check`),
    #: for a pattern so small that a partial match says nothing.
    structural_near_misses: bool = True
    remove_shape_readers: bool = False
    #: Where ``--explain`` looks for regions of this rule left unfused (:class:`Anchor`); none: it reports
    #: only the near misses of the rules' sweep.
    anchors: tuple[Anchor, ...] = ()
    #: Names for people of the pattern's values (``{"vh": "V"}``), used in ``--explain``'s reasons.
    labels: dict[str, str] = {}  # noqa: RUF012 - read-only, declared by subclasses

    def __init__(self) -> None:
        super().__init__(type(self).__name__)
        self._compiled: list[tuple[_pattern_ir.GraphPattern, _Matcher, tuple[str, Any] | None]] | None = None

    # -- helpers for check -------------------------------------------------------------------
    @staticmethod
    def ok() -> MatchResult:
        return MatchResult()

    @staticmethod
    def fail(reason: str, *sources: ir.Node | ir.Value | None) -> MatchResult:
        return MatchResult().fail(reason, [s for s in sources if s is not None])

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return None

    # -- compilation -------------------------------------------------------------------------
    def compiled(self) -> list[tuple[_pattern_ir.GraphPattern, _Matcher, tuple[str, Any] | None]]:
        """One (graph pattern, matcher, root tag) per root alternative of ``pattern``."""
        if self._compiled is not None:
            return self._compiled
        import inspect

        params = list(inspect.signature(self.pattern).parameters)
        inputs = [_pattern_ir.Var(p) for p in params[1:]]
        builder = _pattern_ir.OpsetPatternBuilder("", record=True)
        with _pattern_ir.pattern_builder(builder):
            out = self.pattern(builder, *inputs)
        outputs = list(out) if isinstance(out, (list, tuple)) else [out]
        roots: list[tuple[_pattern_ir.ValuePattern, tuple[str, Any] | None]] = []
        first = outputs[0]
        if isinstance(first, _pattern_ir.OpIdDispatchOr):
            for tag, alt in first._op_to_pattern.values():
                roots.append((alt, (first.tag_var, tag) if first.tag_var else None))
        elif isinstance(first, _pattern_ir.BacktrackingOr):
            for tag, alt in zip(first._tag_values, first._values):
                roots.append((alt, (first.tag_var, tag) if first.tag_var else None))
        else:
            roots.append((first, None))
        compiled = []
        for root, tag in roots:
            gp = _pattern_ir.GraphPattern(inputs, [root, *outputs[1:]], builder.nodes())
            compiled.append((gp, _Matcher(gp), tag))
        self._compiled = compiled
        return compiled


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


@dataclass
class NearMiss:
    """A subgraph a rule almost matched, and why it did not."""

    rule: str
    root: str
    nodes: list[str]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "nodes": self.nodes, "reason": self.reason}


@dataclass
class RuleReport:
    """What :func:`apply_rules` did.

    ``stats`` counts rewrites per rule (``{"LayerNormFusion": 5}``) and per rule variant
    (``"LayerNormFusion.div-sqrt"``); ``candidates`` counts root nodes where a rule matched at least
    its ``min_candidate_nodes`` (fused or not); ``near_misses`` explains the ones not fused.
    ``new_nodes`` are the nodes the rules created, in creation order.  With ``record`` (a read-only
    :meth:`mograph.pass_infra.Pass.candidates` asks for it), ``rewrites`` lists every rewrite as
    ``(rule name, nodes it replaced, nodes it made)``; otherwise it stays empty.
    """

    stats: Counter = field(default_factory=Counter)
    candidates: Counter = field(default_factory=Counter)
    near_misses: list[NearMiss] = field(default_factory=list)
    new_nodes: list[ir.Node] = field(default_factory=list)
    record: bool = False
    rewrites: list[tuple[str, list[ir.Node], list[ir.Node]]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(v for k, v in self.stats.items() if "." not in k)

    def details(self, rules: Iterable[Rule], explain: bool) -> dict[str, Any]:
        """Per-rule summary for ``PassResult.details`` (near-miss lists only with ``explain``)."""
        out: dict[str, Any] = {}
        for rule in rules:
            name = rule.name
            misses = [m for m in self.near_misses if m.rule == name]
            entry: dict[str, Any] = {
                "candidates": int(self.stats.get(name, 0)) + len(misses),
                "fused": int(self.stats.get(name, 0)),
                "near_misses": len(misses),
            }
            variants = {k.split(".", 1)[1]: v for k, v in self.stats.items() if k.startswith(name + ".")}
            if variants:
                entry["variants"] = variants
            if explain and misses:
                entry["near_miss_list"] = [m.to_dict() for m in misses]
            out[name] = entry
        return out


#: Ops a shape computation is made of (what reads a tensor's shape, not its values, and computes on it).
_SHAPE_OPS = frozenset({"Shape", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast", "Reshape", "Mul",
                        "Add", "Sub", "Div", "Constant", "Identity"})
_MAX_SHAPE_DEPENDENTS = 32


def shape_dependents(nodes: Sequence[ir.Node], bound: Iterable[ir.Value] = ()) -> list[ir.Node]:
    """Nodes outside ``nodes`` that die with them: ``Shape`` readers of their values whose results feed only them.

    An exporter often computes a reshape target from ``Shape`` of a value inside the pattern
    (``x.size()[:-2] + (n,)``); that ``Shape`` reads only the value's shape, and when its whole
    computation flows only into the pattern's nodes, deleting the pattern deletes it too.  Values in
    ``bound`` (read by the rewrite) are never given up.  Returns those nodes (empty when there are none).
    """
    node_set = set(nodes)
    keep = set(bound)
    out: list[ir.Node] = []
    for n in nodes:
        for v in n.outputs:
            for consumer, _ in v.uses():
                if consumer in node_set or consumer.op_type != "Shape" or consumer.domain not in ("", "ai.onnx"):
                    continue
                chain = _dies_with(consumer, node_set, keep)
                if chain is None or len(out) + len(chain) > _MAX_SHAPE_DEPENDENTS:
                    continue
                for c in chain:
                    if c not in node_set:
                        node_set.add(c)
                        out.append(c)
    return out


def _dies_with(start: ir.Node, node_set: set[ir.Node], keep: set[ir.Value]) -> list[ir.Node] | None:
    """``start`` and what it feeds, if all of that flows only into ``node_set`` (within a few shape ops)."""
    chain: list[ir.Node] = []
    stack = [start]
    seen: set[ir.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op_type not in _SHAPE_OPS or n.domain not in ("", "ai.onnx") or len(seen) > _MAX_SHAPE_DEPENDENTS:
            return None
        chain.append(n)
        for v in n.outputs:
            if v.is_graph_output() or v in keep:
                return None
            for consumer, _ in v.uses():
                if consumer not in node_set:
                    stack.append(consumer)
    return chain


def shape_readers(nodes: Sequence[ir.Node], outputs: Sequence[ir.Value]) -> list[ir.Node]:
    """``Shape`` nodes outside ``nodes`` that read one of their intermediate values."""
    node_set = set(nodes)
    keep = set(outputs)
    out = []
    for n in nodes:
        for v in n.outputs:
            if v in keep:
                continue
            for consumer, _ in v.uses():
                if consumer not in node_set and consumer.op_type == "Shape" and consumer.domain in ("", "ai.onnx"):
                    out.append(consumer)
    return list(dict.fromkeys(out))


def _rewire_shape_reader(rule: Rule, graph: ir.Graph, reader: ir.Node) -> bool:
    """Replace ``Shape(v)`` (v inside the pattern) by the rule's computation of v's shape from surviving values."""
    shape_of = getattr(rule, "shape_of", None)
    value = reader.inputs[0]
    made = shape_of(value) if shape_of is not None and value is not None else None
    if made is None:
        return False
    new_nodes, full = made
    start = reader.attributes.get("start")
    end = reader.attributes.get("end")
    if start is not None or end is not None:
        lo = int(start.value) if start is not None else 0
        hi = int(end.value) if end is not None else 2**62
        consts = [ir.node("Constant", [], attributes={"value": ir.tensor(np.array([x], dtype=np.int64))}) for x in (lo, hi)]
        sl = ir.node("Slice", [full, consts[0].outputs[0], consts[1].outputs[0]])
        new_nodes = [*new_nodes, *consts, sl]
        full = sl.outputs[0]
    for i, n in enumerate(new_nodes):  # (the shape of a value of several dims reads several Shapes: one name each)
        n.name = f"{reader.name or 'Shape'}/{n.op_type}_{len(graph)}_{i}"
    graph.insert_before(reader, new_nodes)
    ir.convenience.replace_all_uses_with(reader.outputs[0], full)
    full.shape, full.type = reader.outputs[0].shape, reader.outputs[0].type
    graph.remove(reader, safe=True)
    return True


def _removal_blocker(nodes: Sequence[ir.Node], outputs: Sequence[ir.Value],
                     allowed: Iterable[ir.Node] = ()) -> str | None:
    """Why deleting ``nodes`` would lose a value read outside them (``None`` when it would not);
    readers in ``allowed`` do not count."""
    node_set = set(nodes) | set(allowed)
    keep = set(outputs)
    for n in nodes:
        for v in n.outputs:
            if v in keep:
                continue
            if v.is_graph_output():
                return f"intermediate value '{v.name}' is also a graph output"
            for consumer, _ in v.uses():
                if consumer not in node_set:
                    return (
                        f"intermediate value '{v.name}' is also read by '{consumer.name}' "
                        f"({consumer.op_type}) outside the pattern"
                    )
    return None


def remove_dead_producers(
    graph: ir.Graph, values: Iterable[ir.Value | None], on_delete: Callable[[str], None] | None = None
) -> None:
    """Remove producers of ``values`` that nothing reads any more (transitively).

    ``on_delete(name)`` is called for each initializer removed (the sweep's :class:`_InitializerNames`
    learns which names are free again)."""
    stack = [v for v in values if v is not None]
    while stack:
        v = stack.pop()
        node = v.producer()
        if node is None:
            if (
                v.is_initializer()
                and not v.uses()
                and not v.is_graph_input()
                and not v.is_graph_output()
                and v.name is not None
                and v.name in graph.initializers
                and graph.initializers[v.name] is v
            ):
                del graph.initializers[v.name]
                if on_delete is not None:
                    on_delete(v.name)
            continue
        if node.graph is not graph:
            continue
        if any(o.uses() or o.is_graph_output() for o in node.outputs):
            continue
        inputs = list(node.inputs)
        graph.remove(node, safe=True)
        stack.extend(i for i in inputs if i is not None)


def _bind_defaults(rule: Rule, gp: _pattern_ir.GraphPattern, match: MatchResult) -> None:
    for var in gp.inputs:
        if var.name is not None and var.name not in match.bindings:
            match.bind(var.name, None)


def _node_checks(match: MatchResult, context: _basics.MatchContext) -> str | None:
    for pattern_node, node in match.node_bindings.items():
        check = pattern_node.check_method
        if check is None:
            continue
        try:
            result = check(context, node)
        except _basics.MatchFailureError as exc:
            return exc.reason
        if not result:
            return getattr(result, "reason", "") or f"check failed on node '{node.name}'"
    return None


class _InitializerNames:
    """Names for the initializers a sweep over one graph adds: for a rewrite's ``base`` (``mograph_one``),
    ``base`` itself if free, else the first of ``base_1``, ``base_2`` ... that no initializer has.

    Probing from ``base_1`` at every rewrite costs as many lookups as there are such names already, which
    over a sweep grows with the square of the graph (a placeholder per fused norm).  So the first index
    not yet probed is kept per base, and the indices below it that became free during the sweep (an
    initializer removed through :meth:`deleted`) are kept aside: the name chosen is the same as probing
    from 1 would choose, provided every removal during the sweep is reported (the sweep's removals go
    through :func:`remove_dead_producers`, which reports them).
    """

    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.cursor: dict[str, int] = {}  # base -> every base_i with 0 < i < cursor was taken when probed
        self.freed: dict[str, list[int]] = {}  # base -> indices below the cursor removed since (a heap)
        self.probes = 0  # names looked up (the regression test counts them)

    def fresh(self, name: str | None) -> str:
        taken = self.graph.initializers
        self.probes += 1
        if name and name not in taken:
            return name
        base = name or "mograph_const"
        heap = self.freed.get(base)
        while heap:  # a name freed below the cursor (left in place: the next call finds it taken if used)
            self.probes += 1
            if f"{base}_{heap[0]}" not in taken:
                return f"{base}_{heap[0]}"
            heapq.heappop(heap)
        i = self.cursor.get(base, 1)
        while True:
            self.probes += 1
            candidate = f"{base}_{i}"
            if candidate not in taken:
                self.cursor[base] = i
                return candidate
            i += 1

    def deleted(self, name: str) -> None:
        """Learn that the initializer ``name`` was removed (its name may be given again)."""
        base, sep, index = name.rpartition("_")
        if sep and index.isdigit() and str(int(index)) == index and int(index) > 0:
            i = int(index)
            heap = self.freed.setdefault(base, [])
            if i < self.cursor.get(base, 1) and i not in heap:
                heapq.heappush(heap, i)


@dataclass
class _Verdict:
    """One root alternative of a rule tried at a node: matched whole and passed every check (``reason`` None),
    or why not, with the nodes it got through and the node it stopped at."""

    match: MatchResult
    nodes: list[ir.Node]
    reason: str | None
    structural: bool  # failed while matching (else: a node check, a value read outside, or the rule's check)
    failed_at: ir.Node | None = None


def _judge(rule: Rule, model: ir.Model, graph: ir.Graph, node: ir.Node, gp: _pattern_ir.GraphPattern,
           matcher: _Matcher, tag: tuple[str, Any] | None, *, rewire: bool) -> _Verdict | None:
    """Match one root alternative of ``rule`` at ``node`` and run its checks; ``None`` for a lowered form.

    ``rewire``: rewire the ``Shape`` readers outside the pattern once the check passed (what a rewrite needs);
    without it nothing in the graph changes (a reader counts as rewirable when the rule can compute its shape).
    """
    match = matcher.match(model, graph, node, remove_nodes=False)
    if not match:
        return _Verdict(match, list(matcher.best_nodes), matcher.best_reason or match.reason, True, matcher.best_node)
    if tag is not None:
        match.bind(tag[0], tag[1])
    _bind_defaults(rule, gp, match)
    nodes = list(dict.fromkeys(match.nodes))
    if any(LOWERED_FOR in n.metadata_props for n in nodes):
        # a target's form written by the lower step (an inlined body, x * sigmoid(a x) for TensorRT's
        # QuickGelu, ...): rules fuse to canonical ops and never take a lowered form back
        return None
    readers: list[ir.Node] = []
    if getattr(rule, "remove_shape_readers", False):  # Shape readers that die with the pattern go with it
        nodes += shape_dependents(nodes, [v for v in match.bindings.values() if isinstance(v, ir.Value)])
        readers = shape_readers(nodes, match.outputs)  # the others are rewired once the check passed
    context = _basics.MatchContext(model, graph, node, match)
    failed: MatchResult | None = None
    reason = _node_checks(match, context)
    if reason is None:
        reason = _removal_blocker(nodes, match.outputs, readers)
    if reason is None:
        try:
            result = rule.check(context, **match.bindings)
        except _basics.MatchFailureError as exc:
            result = MatchResult().fail(exc.reason)
        if not result:
            reason = getattr(result, "reason", "") or "check failed"
            failed = result
    if reason is None and readers:
        if rewire:
            stuck = [r for r in readers if not _rewire_shape_reader(rule, graph, r)]
        else:
            shape_of = getattr(rule, "shape_of", None)
            stuck = [r for r in readers if shape_of is None or r.inputs[0] is None or shape_of(r.inputs[0]) is None]
        if stuck:
            reason = _removal_blocker(nodes, match.outputs, () if rewire else [r for r in readers if r not in stuck])
    return _Verdict(match, nodes, reason, False, _failure_node(failed) or node if reason is not None else None)


def _failure_node(result: MatchResult | None) -> ir.Node | None:
    """The node a failed check names (a value's producer for a value), if any."""
    for source in (result.failure_nodes_and_values if result is not None else []):
        if isinstance(source, ir.Node):
            return source
        producer = source.producer()
        if producer is not None:
            return producer
    return None


def _try(
    rule: Rule,
    model: ir.Model,
    graph: ir.Graph,
    node: ir.Node,
    report: RuleReport,
    fused_nodes: set[ir.Node],
    names: _InitializerNames,
) -> list[ir.Node] | None:
    """Try ``rule`` at root ``node``; on success rewrite and return the new nodes."""
    best_miss: tuple[int, str, list[ir.Node]] | None = None
    for gp, matcher, tag in rule.compiled():
        root_op = gp.output_nodes[0].op_identifier()
        if root_op is not None and root_op[1] != node.op_type:
            continue  # the root's op type differs: the matcher would fail at depth 0 (no near miss)
        verdict = _judge(rule, model, graph, node, gp, matcher, tag, rewire=True)
        if verdict is None:
            continue
        match, nodes, reason = verdict.match, verdict.nodes, verdict.reason
        if verdict.structural:
            depth = matcher.best_depth
            if (rule.structural_near_misses and depth >= rule.min_candidate_nodes
                    and (best_miss is None or depth > best_miss[0])):
                best_miss = (depth, reason or "", nodes)
            continue
        if reason is not None:
            if len(nodes) >= rule.min_candidate_nodes and (best_miss is None or len(nodes) + 1000 > best_miss[0]):
                best_miss = (len(nodes) + 1000, reason, nodes)
            continue
        label = rule.variant(match.bindings)
        replacement = ReplacementPatternFunction(rule.rewrite).get_replacement(match)
        if replacement is None:
            if len(nodes) >= rule.min_candidate_nodes:
                best_miss = (len(nodes) + 1000, match.reason or "rewrite declined", nodes)
            continue
        new_outputs = list(replacement.new_outputs)
        if len(new_outputs) != len(match.outputs):
            raise ValueError(f"{rule.name}: rewrite returned {len(new_outputs)} values for {len(match.outputs)} outputs")
        for domain, version in replacement.used_opsets:
            if domain not in model.opset_imports:
                model.opset_imports[domain] = version if version is not None else 1
        for init in replacement.new_initializers:
            init.name = names.fresh(init.name)
            graph.register_initializer(init)
        old_vals, new_vals = [], []
        node_set = set(nodes)
        for old, new in zip(match.outputs, new_outputs):
            if new is None:
                if old.is_graph_output() or any(c not in node_set for c, _ in old.uses()):
                    raise ValueError(f"{rule.name}: rewrite dropped output '{old.name}' that is still read")
                continue
            old_vals.append(old)
            new_vals.append(new)
        inputs_read = [v for n in nodes for v in n.inputs]
        ir.convenience.replace_nodes_and_values(graph, node, nodes, replacement.new_nodes, old_vals, new_vals)
        remove_dead_producers(graph, inputs_read, names.deleted)
        report.stats[rule.name] += 1
        report.candidates[rule.name] += 1
        if label:
            report.stats[f"{rule.name}.{label}"] += 1
        fused_nodes.update(nodes)
        if report.record:
            report.rewrites.append((rule.name, nodes, list(replacement.new_nodes)))
        return list(replacement.new_nodes)
    if best_miss is not None:
        report.candidates[rule.name] += 1
        report.near_misses.append(
            NearMiss(rule.name, node.name or node.op_type, [n.name or n.op_type for n in best_miss[2]], best_miss[1])
        )
    return None


def _needs_sort(graph: ir.Graph, new_nodes: Sequence[ir.Node]) -> bool:
    position = {id(n): i for i, n in enumerate(graph)}
    for n in new_nodes:
        here = position.get(id(n))
        if here is None:
            continue
        for out in n.outputs:
            for consumer, _ in out.uses():
                if consumer.graph is graph and position.get(id(consumer), here + 1) < here:
                    return True
    return False


def _rules_by_root_op(rules: Sequence[Rule]) -> dict[str | None, list[Rule]]:
    """For each root op type, the rules (in order) that may match at a node of that type.

    A rule whose every root alternative names its op type is tried only at nodes of those types;
    one with a root of any op type (``None``) is tried everywhere.  The ``None`` key holds the rules
    tried at a node whose op type no root names.  This keeps a sweep at one dict lookup per node
    and rule family instead of one matcher call per node, rule and alternative.
    """
    roots: list[set[str] | None] = []
    for rule in rules:
        ops: set[str] | None = set()
        for gp, _, _ in rule.compiled():
            ident = gp.output_nodes[0].op_identifier()
            if ident is None or ops is None:
                ops = None
            else:
                ops.add(ident[1])
        roots.append(ops)
    named = {op for ops in roots if ops is not None for op in ops}
    table: dict[str | None, list[Rule]] = {
        op: [r for r, ops in zip(rules, roots) if ops is None or op in ops] for op in named
    }
    table[None] = [r for r, ops in zip(rules, roots) if ops is None]
    return table


def _apply_graph(
    model: ir.Model,
    graph: ir.Graph,
    rules: Sequence[Rule],
    report: RuleReport,
    namer: Callable[[ir.Node, Rule], None] | None,
) -> None:
    fused: set[ir.Node] = set()
    created: list[ir.Node] = []
    by_op = _rules_by_root_op(rules)
    names = _InitializerNames(graph)
    for node in graph:
        if node in fused:
            continue
        for rule in by_op.get(node.op_type, by_op[None]):
            new_nodes = _try(rule, model, graph, node, report, fused, names)
            if new_nodes is not None:
                if namer is not None:
                    for n in new_nodes:
                        namer(n, rule)
                created.extend(new_nodes)
                report.new_nodes.extend(new_nodes)
                break
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                _apply_graph(model, attr.value, rules, report, namer)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    _apply_graph(model, sub, rules, report, namer)
    if created and _needs_sort(graph, created):
        graph.sort()
    # A near miss whose nodes were fused later by another rule or root is not a miss.
    fused_names = {n.name for n in fused if n.name}
    report.near_misses = [m for m in report.near_misses if not (set(m.nodes) & fused_names)]


def apply_rules(
    model: ir.Model,
    rules: Sequence[Rule],
    *,
    namer: Callable[[ir.Node, Rule], None] | None = None,
    record: bool = False,
) -> RuleReport:
    """Apply ``rules`` once over every node of the main graph and its subgraphs, in graph order.

    At each node the rules are tried in the given order and the first that matches, passes its
    check and rewrites wins.  Nodes created by a rewrite are seen by later nodes' matches, so a
    rule may build on what an earlier rule produced in the same sweep.  ``namer(node, rule)`` is
    called for every created node (to name it and stamp provenance); ``record`` keeps each rewrite's
    replaced and created nodes in ``RuleReport.rewrites``.
    """
    report = RuleReport(record=record)
    _apply_graph(model, model.graph, rules, report, namer)
    # Remove near-miss duplicates: the same nodes reported from several roots keep the first.
    seen: set[tuple[str, tuple[str, ...]]] = set()
    unique = []
    for m in report.near_misses:
        key = (m.rule, tuple(sorted(m.nodes)))
        if key in seen:
            continue
        seen.add(key)
        unique.append(m)
    report.near_misses = unique
    return report
