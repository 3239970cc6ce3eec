"""What the fusion passes share: the pass skeleton, options, sub-patterns and checks.

A fusion pass = an ordered list of :class:`mograph.patterns.Rule` s, applied in one sweep over the
graph, then the lowering of the ops it created for ``--target``, then the function bodies of the
``mograph`` ops left in the model.  Stats count rewrites per rule (``{"LayerNormFusion": 5}``) and
per variant (``"LayerNormFusion.div-sqrt"``) plus ``lowered.<op>``; details list per rule the
candidates, fused count and, with ``--explain``, every near miss with its node names and reason.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._opset import OpsetUpgradeError, upgrade_opset
from mograph.passes.fusion.lowering import DEFAULT_TARGET, ONNX_STANDARD_OPSET, TARGETS, ensure_functions, lower_nodes
from mograph.passes.fusion.ops import FLOAT_TYPES, body_supports

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION
from mograph.errors import OptionError
from mograph.pass_infra import Option, Pass, PassResult, stamp
from mograph.patterns import MatchResult as MatchResult
from mograph.patterns import OrValue, Rule, RuleReport, any_value, apply_rules, const, constant_array, scalar_value

logger = logging.getLogger(__name__)

__all__ = ["FusionPass", "flag", "opset_level", "mean_last", "square", "check_reduction", "norm_attrs"]


def flag(raw: str) -> bool:
    """Parse a boolean option value (``true/false/1/0/yes/no/on/off``)."""
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


TARGET_OPTION = Option(
    "target",
    str,
    DEFAULT_TARGET,
    "what fused ops lower to: onnx (standard ops where the opset has them, else mograph ops with "
    "function bodies), ort (ONNX Runtime contrib ops), tensorrt (native layers or mograph plugins), "
    "mograph (mograph ops with function bodies)",
    choices=TARGETS,
)
EXPLAIN_OPTION = Option("explain", flag, False, "list near misses and why each rule did not apply")


def opset_level(raw: object) -> int | str:
    """Parse ``--upgrade-opset``: a positive opset number or ``auto``."""
    if isinstance(raw, str):
        text = raw.strip().lower()
        if text == "auto":
            return "auto"
        value = int(text)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    else:
        raise ValueError("expected an opset number or 'auto'")
    if value < 1:
        raise ValueError("an opset is a positive number")
    return value


UPGRADE_OPTION = Option(
    "upgrade-opset",
    opset_level,
    None,
    "with --target onnx: raise the model's opset (to N, or 'auto': the lowest that has the standard op) "
    "when a fused op's standard form needs it (LayerNormalization 17, Gelu 20, RMSNormalization 23); "
    "by default the opset never changes",
    metavar="N|auto",
)


class FusionPass(Pass):
    """Base of the fusion passes: rules, then lowering, then function bodies."""

    family = "fusion"
    options: ClassVar[tuple[Option, ...]] = (TARGET_OPTION, EXPLAIN_OPTION, UPGRADE_OPTION)
    rules: ClassVar[tuple[type[Rule], ...]] = ()

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        raw = self.config.get("upgrade_opset")
        if raw is not None:  # values given from Python arrive unconverted
            try:
                self.config["upgrade_opset"] = opset_level(raw)
            except ValueError as exc:
                raise OptionError(f"{self.name}: bad value for --upgrade-opset: {raw!r} ({exc})") from exc

    def make_rules(self) -> list[Rule]:
        return [cls() for cls in self.rules]

    #: With ``--target onnx`` at this opset or above, the fused op would lower back to exactly the
    #: standard ops it was fused from, so the pass does nothing (it stays idempotent).
    onnx_noop_opset: ClassVar[int | None] = None
    #: The same for ``--target tensorrt`` (whose lowering also prefers standard ops TensorRT has).
    tensorrt_noop_opset: ClassVar[int | None] = None

    def call(self, model: ir.Model) -> PassResult:
        target = self.config["target"]
        upgrade = self.config.get("upgrade_opset") if target == "onnx" else None
        noop = {"onnx": self.onnx_noop_opset, "tensorrt": self.tensorrt_noop_opset}.get(target)
        if noop is not None:
            reach = _opset(model)
            if upgrade is not None:
                reach = max(reach, noop if upgrade == "auto" else int(upgrade))
            if reach >= noop:
                reason = (f"target {target} at opset >= {noop}"
                          f"{' (reachable by --upgrade-opset)' if reach > _opset(model) else ''}: "
                          f"the standard-op form is already the {target} form")
                return PassResult(modified=False, details={"skipped": reason, "target": target})
        rules = self.make_rules()
        for rule in rules:
            rule.model_opset = _opset(model)  # type: ignore[attr-defined]
        names = {n.name for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.name}
        counter = itertools.count()

        def namer(node: ir.Node, rule: Rule) -> None:
            while True:
                name = f"{rule.name}_{next(counter)}"
                if name not in names:
                    break
            names.add(name)
            node.name = name
            stamp(node, self.name, rule.name)

        snapshot = _infer_types(model)
        report: RuleReport = apply_rules(model, rules, namer=namer)
        stats: dict[str, int | float] = {k: int(v) for k, v in sorted(report.stats.items())}
        modified = report.count > 0
        if not modified:
            for value, type_, shape in snapshot:
                value.type, value.shape = type_, shape
        details: dict[str, Any] = {"rules": report.details(rules, bool(self.config.get("explain"))),
                                   "target": self.config["target"]}
        if modified:
            if upgrade is not None:
                _upgrade_for(model, report.new_nodes, upgrade, stats, details)
            stats.update(lower_nodes(model, report.new_nodes, self.config["target"]))
            ensure_functions(model)
            _drop_unused_functions(model)
        return PassResult(modified=modified, stats=stats, details=details)


def _upgrade_for(model: ir.Model, new_nodes: list[ir.Node], upgrade: int | str, stats: dict[str, int | float],
                 details: dict[str, Any]) -> None:
    """Raise the opset when a fused op of this run needs it for its standard form; record what happened.

    Stats ``opset_upgrade.from`` / ``.to`` / ``.rewritten`` (nodes the converter rewrote) when it did;
    ``details["opset_upgrade"]`` says what was done or why not.
    """
    current = _opset(model)
    needs: dict[str, int] = {}
    for node in new_nodes:
        need = ONNX_STANDARD_OPSET.get(node.op_type)
        if node.graph is not None and node.domain == DOMAIN and need is not None and need > current:
            needs[node.op_type] = need
    if not needs:
        details["opset_upgrade"] = {"done": False, "reason": f"not needed at opset {current}"}
        return
    want = max(needs.values())
    to = want if upgrade == "auto" else int(upgrade)
    ops = ", ".join(f"{k} ({v})" for k, v in sorted(needs.items()))
    if to < want:
        reason = f"--upgrade-opset {to} is below the opset the standard form of {ops} needs"
        details["opset_upgrade"] = {"done": False, "reason": reason}
        return
    try:
        done = upgrade_opset(model, to)
    except OpsetUpgradeError as exc:
        logger.warning("opset not raised to %d: %s", to, exc)
        details["opset_upgrade"] = {"done": False, "reason": f"cannot raise opset {current} to {to}: {exc}"}
        return
    stats["opset_upgrade.from"] = done.from_opset
    stats["opset_upgrade.to"] = done.to_opset
    stats["opset_upgrade.rewritten"] = sum(done.rewritten.values())
    details["opset_upgrade"] = {"done": True, "from": done.from_opset, "to": done.to_opset, "for": ops,
                                "rewritten": dict(done.rewritten)}


def _infer_types(model: ir.Model) -> list[tuple[ir.Value, Any, Any]]:
    """Annotate values with inferred types and shapes; return what they had, to restore if unused.

    Exporters (TorchScript in particular) leave intermediate values without types; the rules need
    dtypes and ranks.  A pass that changes nothing restores the annotations, so it stays a no-op.
    """
    from onnx_ir.passes.common import ShapeInferencePass

    snapshot = []
    for graph in model.graphs():
        for v in list(graph.inputs) + list(graph.initializers.values()):
            snapshot.append((v, v.type, v.shape))
        for node in graph:
            for v in node.outputs:
                snapshot.append((v, v.type, v.shape))
    quiet = logging.getLogger("onnx_ir.passes.common.shape_inference")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    orders = [(g, list(g.initializers.values())) for g in model.graphs()]
    try:
        ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    except Exception:  # noqa: BLE001 - inference is best effort; rules fail with a reason without it
        logger.debug("shape inference failed", exc_info=True)
    finally:
        quiet.setLevel(level)
        for g, inits in orders:  # the inference call re-registers initializers: keep their order
            if list(g.initializers.values()) != inits:
                g.initializers.clear()
                for v in inits:
                    g.register_initializer(v)
    return snapshot


def _drop_unused_functions(model: ir.Model) -> None:
    used = {(n.domain, n.op_type) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
    for key in list(model.functions):
        if key[0] == DOMAIN and (key[0], key[1]) not in used:
            del model.functions[key]
    if DOMAIN in model.opset_imports and not any(d == DOMAIN for d, _ in used):
        del model.opset_imports[DOMAIN]


def _opset(model: ir.Model) -> int:
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))


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
