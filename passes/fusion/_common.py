"""What the fusion passes share: the pass skeleton, options, sub-patterns and checks.

A fusion pass = an ordered list of :class:`mograph.patterns.Rule` s, applied in one sweep over the
graph; every rule emits canonical ``mograph`` ops (with their function bodies) and matches only
unfused computation or other ``mograph`` ops.  Nothing here lowers: the ``lower`` step
(:mod:`mograph.lowering`) does that once, for ``--target``.  Stats count rewrites per rule
(``{"LayerNormFusion": 5}``) and per variant (``"LayerNormFusion.div-sqrt"``); details list per rule the
candidates, fused count and, with ``--explain``, every near miss with its node names and reason.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.ops import FLOAT_TYPES, body_supports

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION, CustomOp
from mograph.errors import InternalError
from mograph.irutil import infer_types, inference_token, restore_types
from mograph.lowering import TARGET_OPTION, drop_unused_functions, ensure_functions
from mograph.opset import model_opset
from mograph.pass_infra import Candidate, Option, Pass, PassResult, iter_nodes, stamp
from mograph.pattern_explain import downstream, unfused_regions
from mograph.patterns import (
    Anchor,
    OrValue,
    Rule,
    RuleReport,
    any_value,
    apply_rules,
    const,
    constant_array,
    scalar_value,
)
from mograph.patterns import MatchResult as MatchResult
from mograph.shapes import Dim, Dims, ShapeQuery, ShapeReads, ShapeRules, Vector, rules_for
from mograph.specs import parse_bool

logger = logging.getLogger(__name__)

__all__ = ["FusionPass", "GraphShapes", "rule_shapes", "TARGET_OPTION", "ADOPT_STANDARD_TARGETS", "adopts_standard_ops", "mean_last", "square", "check_reduction", "norm_attrs", "fused_ops", "NORM_ANCHOR"]


EXPLAIN_OPTION = Option("explain", parse_bool, False, "list near misses and why each rule did not apply")

#: Targets for which a fusion pass also takes the standard fused ops an exporter wrote (``Attention``,
#: ``RMSNormalization`` of opset 23) into the canonical ``mograph`` op, so the ``lower`` step gives them the
#: target's faster kernel: ONNX Runtime's ``com.microsoft`` ops.  ``onnx`` keeps standard ops as they are;
#: TensorRT's forms of them are not measured here, so they stay too.
ADOPT_STANDARD_TARGETS = ("ort",)


def adopts_standard_ops(config: dict[str, Any]) -> bool:
    """Whether the pass (configured with ``--target``) takes exporter-written standard fused ops."""
    return config.get("target") in ADOPT_STANDARD_TARGETS


_FUSED_OPS: dict[tuple[str, str], CustomOp] = {}


def fused_ops() -> dict[tuple[str, str], CustomOp]:
    """The declarations of the ops the built-in fusion passes emit (built once)."""
    if not _FUSED_OPS:
        from mograph.passes.fusion import attention_op, ops

        _FUSED_OPS.update({op.key: op for op in ops.custom_ops() + attention_op.custom_ops()})
    return _FUSED_OPS


class GraphShapes(ShapeReads):
    """The shape query (:class:`mograph.shapes.ShapeQuery`) of the graph a fusion pass rewrites, as its rules'
    readers ask it: swept on the first ask, after canonicalization; a value that an earlier rewrite of the run
    wrote has the nodes written since visited (:meth:`ShapeQuery.refresh`; a rewrite keeps the values it does
    not replace, so what was swept stays true); a value of another graph (a function body, a subgraph) has the
    dims ONNX inference left on it, read the query's way.  ``int32``: the query tracks int32 shape vectors too
    (:class:`ShapeQuery`'s ``int32``)."""

    def __init__(self, graph: ir.Graph, rules: ShapeRules | None = None, *, int32: bool = False,
                 kept: _KeptSweep | None = None) -> None:
        self.graph = graph
        self.rules = rules
        self.int32 = int32
        self.kept = kept
        self._query: ShapeQuery | None = None

    def _swept(self) -> ShapeQuery:
        if self._query is None:
            query = self.kept.take(self) if self.kept is not None else None
            if query is None:
                query = ShapeQuery(self.graph, self.rules, int32=self.int32)
                if self.kept is not None:
                    self.kept.keep(self, query)
            self._query = query
        return self._query

    def dims(self, value: ir.Value | None) -> Dims | None:
        """The symbolic dims of ``value``; ``None`` if its rank is unknown."""
        if value is None:
            return None
        query = self._swept()
        if not query.knows(value) and value.graph is self.graph:
            query.refresh()
        return query.dims(value) if query.knows(value) else query.declared(value)

    def dim(self, value: ir.Value | None, axis: int) -> Dim | None:
        """Dim ``axis`` of ``value`` (negative counts from the end); ``None`` where its rank is unknown."""
        dims = self.dims(value)
        return dims[axis] if dims is not None and -len(dims) <= axis < len(dims) else None

    def values(self, value: ir.Value | None) -> Vector | None:
        """``(is_scalar, elements)`` of a small int64 shape vector of the graph (a reshape target); ``None`` if the
        query does not track it (as :meth:`ShapeQuery.values`)."""
        if value is None or value.graph is not self.graph:
            return None
        query = self._swept()
        if not query.knows(value):
            query.refresh()
        return query.values(value)


    def same_dim(self, a: ir.Value | None, axis_a: int, b: ir.Value | None, axis_b: int) -> bool:
        """Whether dim ``axis_a`` of ``a`` and dim ``axis_b`` of ``b`` are equal for every input the model accepts."""
        da, db = self.dims(a), self.dims(b)
        if da is None or db is None or not -len(da) <= axis_a < len(da) or not -len(db) <= axis_b < len(db):
            return False
        return da[axis_a] is not None and da[axis_a] == db[axis_b]


#: Where a fusion pass leaves the canonicalizer's sweep for the next one (:class:`_KeptSweep`), in ``model.meta``.
_KEPT_SWEEP_KEY = "mograph.fusion.kept_sweep"


class _KeptSweep:
    """The canonicalizer's sweep handed from one fusion pass to the next while the graph is as it was.

    ``fuse-layernorm``, ``fuse-rmsnorm`` and ``fuse-gelu`` each canonicalize the graph, and the shape rules
    (``expand-noop`` on a LLaMA's grouped-query ``Expand``) sweep it; a pass that fuses nothing and keeps no edit
    leaves the graph exactly as it was, so the next pass's sweep finds what the last one found (a tenth of a
    100k-node run's sweeps).  A sweep made before any edit of its pass, right after the pass's type inference
    (:func:`mograph.irutil.infer_types`), is kept as a copy with that inference's token
    (:func:`mograph.irutil.inference_token`) and the registry; the next pass takes a copy of it instead of
    sweeping when its own :func:`~mograph.irutil.infer_types` found the graph unchanged since that inference (the
    same token), it has made no edit yet either, and the registry and ``int32`` match.  At most one is kept, and
    each fusion pass takes it out of the model when it starts.
    """

    def __init__(self, model: ir.Model, registry: object, token: object | None) -> None:
        self.model = model
        self.registry = registry
        self.token = token
        #: the canonicalizer's list of edits (set once it is made; a reference to the list, not to the
        #: canonicalizer, which holds this object through its shape query: no reference cycle outlives the pass)
        self.edits: list[Any] | None = None
        self.previous = model.meta.pop(_KEPT_SWEEP_KEY, None)

    def pristine(self) -> bool:
        """Whether the canonicalizer exists and has made no edit yet (the graph is as the inference left it)."""
        return self.edits is not None and not self.edits

    def take(self, shapes: GraphShapes) -> ShapeQuery | None:
        kept, self.previous = self.previous, None
        if (kept is None or self.token is None or not self.pristine() or kept[0] is not self.token
                or kept[1] is not self.registry or kept[2] is not shapes.graph or kept[3].int32 != shapes.int32):
            return None
        query: ShapeQuery = kept[3].copy(shapes.rules if shapes.rules is not None else None)
        self.model.meta[_KEPT_SWEEP_KEY] = kept  # still true for the pass after, if this one changes nothing
        return query

    def keep(self, shapes: GraphShapes, query: ShapeQuery) -> None:
        if self.token is not None and self.pristine():
            self.model.meta[_KEPT_SWEEP_KEY] = (self.token, self.registry, shapes.graph, query.copy())


def rule_shapes(rule: Rule, value: ir.Value) -> GraphShapes:
    """The shape query a rule's check asks: the one its pass set for the run (:meth:`FusionPass._fuse`), else (a
    rule applied on its own) one for ``value``'s graph, kept on the rule."""
    shapes: GraphShapes | None = getattr(rule, "shapes", None)
    if shapes is not None:
        return shapes
    own: GraphShapes | None = getattr(rule, "own_shapes", None)
    if own is None or own.graph is not value.graph:
        if value.graph is None:
            raise InternalError(rule.name, f"value {value.name!r} is in no graph: no shape query to ask")
        own = GraphShapes(value.graph)
        rule.own_shapes = own  # type: ignore[attr-defined]
    return own


class FusionPass(Pass):
    """Base of the fusion passes: rules, then the function bodies of the ops they emitted."""

    family = "fusion"
    emits_custom_ops = True
    options: ClassVar[tuple[Option, ...]] = (EXPLAIN_OPTION,)
    rules: ClassVar[tuple[type[Rule], ...]] = ()
    #: Canonicalize the main graph before the rules (:mod:`.canonicalize`), keeping only what a fusion used.
    #: ``True`` for every rewrite, or the names of the rewrites to run.
    canonicalize: ClassVar[bool | tuple[str, ...]] = False
    #: With ``--explain``: the key of ``details`` listing the regions the rules' anchors found left unfused
    #: (:attr:`mograph.patterns.Rule.anchors`, :func:`mograph.pattern_explain.unfused_regions`).
    explain_key: ClassVar[str] = "unfused_regions"

    def make_rules(self) -> list[Rule]:
        return [cls() for cls in self.rules]

    def call(self, model: ir.Model) -> PassResult:
        return self._fuse(model)[0]

    def candidates(self, model: ir.Model) -> list[Candidate]:
        """What the rules would fuse in ``model`` and their near misses, ``model`` unchanged.

        The pass runs on a copy, recording each rewrite; a region is what one rewrite replaced plus what
        died with it, grown by the rewrites that took its fused op in (a scale, a bias); its ``kind`` is the
        ``computes`` of the op it became (:func:`fused_ops`).  Node names are the model's own.
        """
        from mograph.ir_io import copy_model

        copy = copy_model(model)
        originals, copies = list(iter_nodes(model.graph)), list(iter_nodes(copy.graph))
        if len(originals) != len(copies):
            raise InternalError(self.name, f"copying the model changed its nodes ({len(originals)} -> {len(copies)})")
        original_of = {id(c): o for c, o in zip(copies, originals)}
        report = self._fuse(copy, record=True)[1]
        return _regions(report, originals, copies, original_of, iter_nodes(copy.graph))

    def explained(self, regions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``--explain``'s entries as this pass reports them (under :attr:`explain_key`)."""
        return regions

    def _fuse(self, model: ir.Model, record: bool = False) -> tuple[PassResult, RuleReport]:
        rules = self.make_rules()
        if not self.canonicalize and not self.config.get("explain") and not _roots_present(model, rules):
            # Nothing to try anywhere (:func:`_roots_present`): the result of the sweep below, without the
            # whole-model type inference before it and the type restore after it.
            empty = RuleReport(record=record)
            return PassResult(modified=False, stats={}, details={"rules": empty.details(rules, False)}), empty
        shapes = GraphShapes(model.graph, rules_for(self.registry))  # swept on the first ask, after canonicalization
        for rule in rules:
            rule.model_opset = model_opset(model)  # type: ignore[attr-defined]
            rule.shapes = shapes  # type: ignore[attr-defined]
        names = {n.name for n in iter_nodes(model.graph) if n.name}
        counter = itertools.count()

        def namer(node: ir.Node, rule: Rule) -> None:
            while True:
                name = f"{rule.name}_{next(counter)}"
                if name not in names:
                    break
            names.add(name)
            node.name = name
            stamp(node, self.name, rule.name)

        snapshot = infer_types(model)
        canon = None
        was_sorted = bool(self.canonicalize) and _sorted(model.graph)  # (an input out of order is left so)
        if self.canonicalize:  # see :mod:`.canonicalize`: edits no fusion consumes are undone below
            from mograph.passes.fusion.canonicalize import Canonicalizer

            kinds = None if self.canonicalize is True else tuple(self.canonicalize)  # type: ignore[arg-type]
            handed = _KeptSweep(model, self.registry, inference_token(model))
            canon = Canonicalizer(model.graph, model_opset(model), kinds,
                                  GraphShapes(model.graph, rules_for(self.registry), int32=True, kept=handed))
            handed.edits = canon.edits
            canon.apply()
        else:
            model.meta.pop(_KEPT_SWEEP_KEY, None)
        try:
            report: RuleReport = apply_rules(model, rules, namer=namer, record=record)
            regions = None
            if self.config.get("explain") and any(rule.anchors for rule in rules):
                regions = self.explained(unfused_regions(model, rules, canon.origin if canon is not None else None))
        finally:  # also when a rule failed: no detached node may outlive the pass
            kept = canon.resolve()[0] if canon is not None else None
            if canon is not None and was_sorted and not _sorted(model.graph):
                model.graph.sort()  # an undo can rewire a fused op to a value made after it
        stats: dict[str, int | float] = {k: int(v) for k, v in sorted(report.stats.items())}
        modified = report.count > 0
        if not modified:
            restore_types(snapshot)
        details: dict[str, Any] = {"rules": report.details(rules, bool(self.config.get("explain")))}
        if kept:
            details["canonicalized"] = dict(sorted(kept.items()))
        if regions is not None:
            details[self.explain_key] = regions
        if modified:
            ensure_functions(model, fused_ops())
            drop_unused_functions(model, fused_ops())
        return PassResult(modified=modified, stats=stats, details=details), report


def _roots_present(model: ir.Model, rules: list[Rule]) -> bool:
    """Whether a node of the main graph or its subgraphs has the op type of a root of one of ``rules`` (or a
    rule has a root of any op type).

    :func:`mograph.patterns.apply_rules` tries a rule only at nodes of its roots' op types, so where this is
    ``False`` and the pass does not canonicalize (which could make such nodes), the sweep changes nothing and
    reports nothing, and the pass's result is known without inferring types first: on a LLaMA-style graph,
    ``fuse-embed-layernorm`` (no LayerNorm) and ``fuse-bias-gelu`` (no GELU) skip a walk of the whole model
    each, or a whole-model ONNX shape inference.
    """
    roots: set[str] = set()
    for rule in rules:
        for gp, _, _ in rule.compiled():
            ident = gp.output_nodes[0].op_identifier()
            if ident is None:
                return True
            roots.add(ident[1])
    return any(node.op_type in roots for node in iter_nodes(model.graph))


def _regions(report: RuleReport, originals: list[ir.Node], copies: list[ir.Node],
             original_of: dict[int, ir.Node], left: Any) -> list[Candidate]:
    """:meth:`FusionPass.candidates` from the recorded rewrites of the copy (``copies``, of ``originals``)."""
    kinds = {op.name: op.computes for op in fused_ops().values()}
    parent: list[int] = []  # union-find over rewrites: one that took in another's fused op joins its region

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    made_by: dict[int, int] = {}  # id(created node) -> the rewrite that made it
    rules: list[str] = []
    op_of: list[str | None] = []
    owner: dict[int, int] = {}  # id(original node) -> rewrite
    for i, (rule, replaced, made) in enumerate(report.rewrites):
        parent.append(i)
        rules.append(rule)
        fused = [n for n in made if n.domain == DOMAIN]
        op_of.append(fused[-1].op_type if fused else None)
        for n in replaced:
            if id(n) in made_by:
                parent[find(made_by[id(n)])] = i  # the later rewrite's op is the region's
            elif id(n) in original_of:
                owner[id(original_of[id(n)])] = i
        for n in made:
            made_by[id(n)] = i
    alive = {id(n) for n in left}
    # What else the rewrites removed (dead producers, the exporter's nodes a canonical form stood for) joins
    # the region its outputs fed.
    gone = [o for c, o in zip(copies, originals) if id(c) not in alive and id(o) not in owner]
    changed = True
    while gone and changed:
        changed = False
        for o in list(gone):
            fed = [owner[id(u)] for v in o.outputs for u, _ in v.uses() if id(u) in owner]
            if fed:
                owner[id(o)] = fed[0]
                gone.remove(o)
                changed = True
    members: dict[int, list[str]] = {}
    for o in originals:  # in graph order
        at = owner.get(id(o))
        if at is not None and o.op_type != "Constant":
            members.setdefault(find(at), []).append(o.name or o.op_type)
    out = [Candidate(rules[i], tuple(names), op_of[i], kinds.get(op_of[i] or ""))
           for i, names in members.items()]
    out += [Candidate(m.rule, tuple(m.nodes), reason=m.reason) for m in report.near_misses]
    return out


# ---------------------------------------------------------------------------------------------
# sub-patterns
# ---------------------------------------------------------------------------------------------


def _axes_of(node: ir.Node) -> list[int] | None | str:
    """Reduction axes of a Reduce* node: a list, ``None`` for 'all axes', or 'dynamic'."""
    attr = node.attributes.get("axes")
    if attr is not None:
        return [int(a) for a in attr.value]
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        arr = constant_array(node.inputs[1])
        if arr is None:
            return "dynamic"
        return [int(a) for a in arr.reshape(-1)]
    return None


def check_reduction(context: Any, node: ir.Node) -> MatchResult:
    """A Reduce* node of a norm must reduce only the last axis, keeping dims."""
    result = MatchResult()
    axes = _axes_of(node)
    if isinstance(axes, str):  # "dynamic"
        return result.fail(f"reduction '{node.name}' has axes that are not constant", node)
    keepdims = node.attributes.get("keepdims")
    if keepdims is not None and int(keepdims.value) == 0:
        return result.fail(f"reduction '{node.name}' does not keep dims", node)
    x = node.inputs[0]
    rank = len(x.shape) if x is not None and x.shape is not None else None
    if axes is None or len(axes) != 1:
        return result.fail(f"reduction '{node.name}' is not over the last axis (axes {axes})", node)
    axis = axes[0]
    if axis == -1 or (rank is not None and axis == rank - 1):
        return result
    if rank is None and axis >= 0:
        return result.fail(f"reduction '{node.name}' is over axis {axis} and the input rank is unknown", node)
    return result.fail(f"reduction '{node.name}' is not over the last axis (axis {axis})", node)


def check_mean_divisor(context: Any, node: ir.Node) -> MatchResult:
    """``ReduceSum(v) / N`` (or ``* 1/N``) is a mean only if N is the size of the last axis."""
    result = MatchResult()
    red = None
    other = None
    for i, v in enumerate(node.inputs):
        p = v.producer() if v is not None else None
        if p is not None and p.op_type == "ReduceSum" and red is None:
            red, other = p, node.inputs[1 - i]
    if red is None or other is None:
        return result.fail("mean by ReduceSum has no divisor", node)
    n = scalar_value(other)
    if n is None:
        return result.fail(f"divisor of ReduceSum '{red.name}' is not a constant", node)
    if node.op_type == "Mul":
        n = 1.0 / n if n != 0 else float("inf")
    x = red.inputs[0]
    dim = x.shape[-1] if x is not None and x.shape is not None and len(x.shape) else None
    if not isinstance(dim, int):
        return result.fail(f"cannot prove the divisor of '{red.name}' equals the last axis size (dynamic)", node)
    if abs(n - dim) > 1e-3 * dim:
        return result.fail(f"divisor {n:g} of '{red.name}' is not the last axis size {dim}", node)
    return result


#: Ops below a reduction that make a sum look like a norm's (a root of the variance, or its inverse).
_ROOTS = ("Sqrt", "Reciprocal", "Pow", "Div")


def _last_axis(node: ir.Node) -> bool:
    """Whether ``node`` reduces the last axis only, with kept dims or not (jax2tf and Flax reduce without
    them and reshape back)."""
    x = node.inputs[0] if node.inputs else None
    rank = len(x.shape) if x is not None and x.shape is not None else None
    if node.op_type == "GlobalAveragePool":
        return rank == 3
    axes = _axes_of(node)
    if not isinstance(axes, list) or len(axes) != 1:
        return False
    return axes[0] == -1 or (rank is not None and axes[0] == rank - 1)


def looks_like_norm(node: ir.Node) -> bool:
    """A last-axis reduction a LayerNorm / RMSNorm starts from (its mean or mean square): a mean
    (``ReduceMean``, ``GlobalAveragePool``) as such; a ``ReduceSum`` only with a root or a division within
    reach below it (a sum-based mean or mean square), so the sum of a softmax is not one."""
    if not _last_axis(node):
        return False
    if node.op_type != "ReduceSum":
        return True
    return any(n.op_type in _ROOTS and n.domain in ("", "ai.onnx") for n in downstream(node, NORM_ANCHOR.reach))


#: Where ``--explain`` looks for the norms left unfused: every last-axis reduction that looks like one.
NORM_ANCHOR = Anchor(("ReduceMean", "ReduceSum", "GlobalAveragePool"), "norm", admits=looks_like_norm)


def mean_last(op: Any, v: Any, tag: str | None = None) -> Any:
    """A mean over the last axis: ReduceMean (axes as attribute or input) or ReduceSum / N."""
    return OrValue(
        [
            op.ReduceMean(v, _allow_other_inputs=True, _check=check_reduction),
            op.Div(op.ReduceSum(v, _allow_other_inputs=True, _check=check_reduction), any_value(),
                   _check=check_mean_divisor),
            op.Mul(op.ReduceSum(v, _allow_other_inputs=True, _check=check_reduction), any_value(),
                   _check=check_mean_divisor),
        ],
        tag_var=tag,
        tag_values=["reducemean", "reducesum-div", "reducesum-mul"] if tag else None,
    )


def divide_by_root(op: Any, numerator: Any, radicand: Any) -> Any:
    """``numerator / sqrt(radicand)`` in every form exporters write it (tag ``norm``): ``Div`` by
    ``Sqrt``, ``Mul`` by ``Reciprocal(Sqrt)`` or by ``1 / Sqrt``, ``Mul`` by ``Pow(r, -0.5)``, ``Div`` by
    ``Pow(r, 0.5)``. Shared by the LayerNorm and RMSNorm rules."""
    root = op.Sqrt(radicand)
    return OrValue(
        [
            op.Div(numerator, root),
            op.Mul(numerator, op.Reciprocal(root)),
            op.Mul(numerator, op.Div(const(1.0), root)),
            op.Mul(numerator, op.Pow(radicand, const(-0.5))),
            op.Div(numerator, op.Pow(radicand, const(0.5))),
        ],
        tag_var="norm",
        tag_values=["div-sqrt", "mul-reciprocal", "mul-one-div", "mul-pow", "div-pow"],
    )


def square(op: Any, v: Any) -> Any:
    """``v * v`` or ``v ** 2``."""
    return OrValue([op.Mul(v, v), op.Pow(v, const(2.0))])


def norm_attrs(node: ir.Node) -> dict[str, Any]:
    return {k: a.value for k, a in node.attributes.items()}


def is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in FLOAT_TYPES


def epsilon_of(eps: ir.Value | None) -> float | None:
    if eps is None:
        return 0.0
    return scalar_value(eps)


def check_norm_input(rule: Rule, x: ir.Value, eps: ir.Value | None) -> MatchResult | float:
    """Common checks of LayerNorm/RMSNorm cores; returns epsilon on success."""
    if not is_float(x):
        return rule.fail(f"input '{x.name}' is not a floating-point tensor (dtype {x.dtype})", x)
    opset = getattr(rule, "model_opset", 17)
    if not body_supports(opset, x.dtype):
        return rule.fail(f"a {x.dtype} norm needs opset >= 15 for its function body (model has {opset})", x)
    if eps is not None and eps.dtype is not None and eps.dtype != x.dtype:
        return rule.fail("epsilon's dtype differs from the input's", eps)
    value = epsilon_of(eps)
    if value is None:
        return rule.fail("epsilon is not a constant", eps)
    if value < 0:
        return rule.fail(f"epsilon is negative ({value:g})", eps)
    return value


def placeholder(op: Any, value: float, like: ir.Value) -> Any:
    """A single-element constant of x's dtype (a scale of 1 or a bias of 0 before absorption)."""
    dtype = like.dtype.numpy() if like.dtype is not None else np.float32
    name = "mograph_one" if value == 1.0 else "mograph_zero"
    return op.initializer(ir.tensor(np.array([value], dtype=dtype)), name=name)


def mograph_op(op: Any, name: str, *inputs: Any, **attrs: Any) -> Any:
    return getattr(op, name)(*inputs, _domain=DOMAIN, _version=DOMAIN_VERSION, **attrs)


def _sorted(graph: ir.Graph) -> bool:
    """Whether every node of ``graph`` comes after the producers (in ``graph``) of its inputs."""
    seen: set[ir.Node] = set()
    add = seen.add
    for node in graph:
        for v in node.inputs:
            if v is not None:
                p = v.producer()
                # a producer seen already first: asking each for its graph (a property) cost more than the walk
                if p is not None and p not in seen and p.graph is graph:
                    return False
        add(node)
    return True
