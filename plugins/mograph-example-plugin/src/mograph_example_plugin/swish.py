"""The custom op ``example.BetaSwish`` and the pass ``fuse-swish`` that fuses into it.

``BetaSwish(X; beta) = X * sigmoid(beta * X)`` elementwise (SiLU when ``beta = 1``), for float16, float32
and float64 tensors; the output has the dtype and shape of ``X``.  Exporters spell it
``Mul(X, Sigmoid(X))`` (PyTorch's ``silu``) or ``Mul(X, Sigmoid(Mul(X, beta)))`` with ``beta`` a
one-element constant; both operand orders of each ``Mul`` are matched.  (ONNX opset 24 has a
standard ``Swish`` with ``alpha``; the plugin's op has its own name so that no tool that looks an op
up by type alone, such as ``onnx.reference``, mistakes one for the other.)

The op is declared once, in :data:`SWISH` (a :class:`mograph.CustomOp` in the plugin's own domain
``example``), with everything mograph needs to treat it like a built-in ``mograph.*`` op:

* ``reference`` — :func:`swish` in numpy (computed in float32 or float64, result in the input dtype);
* ``function`` — an ONNX function body in standard ops (``CastLike``, so opset >= 15), so every ONNX
  runtime runs a fused model as it is;
* ``infer_shapes`` — the output is typed and shaped like ``X``;
* ``lowerings`` — ``onnx`` and ``ort``: back to standard ``Sigmoid``/``Mul`` (ONNX Runtime has no Swish
  kernel, so the standard form is the one its own fusions and kernels see).  The ``lower`` step
  (``--target``, or a backend's first act) calls it for every ``example.BetaSwish`` node.

``fuse-swish`` is one declarative rule, :class:`SwishFusion` (a :class:`mograph.patterns.Rule`: pattern with
the exporter spellings as alternatives, check, rewrite), applied by :func:`mograph.patterns.apply_rules`, and
gives the model the op's function body with :func:`mograph.lowering.ensure_functions`: the same doors as
mograph's built-in fusions.  It leaves alone, as a near miss with its reason: a ``Sigmoid`` (or ``beta`` ``Mul``) whose
output is read elsewhere (fusing would remove nothing), a ``beta`` that is not a one-element constant,
and a model whose default opset is below 15 (the function body needs ``CastLike``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

import mograph
from mograph.lowering import LoweringContext, ensure_functions, replace_node
from mograph.patterns import MatchResult, OrValue, Rule, apply_rules

__all__ = ["DOMAIN", "DOMAIN_VERSION", "SWISH", "FuseSwishPass", "SwishFusion", "swish", "swish_function", "lower_swish"]

#: The plugin's own op domain and its version.
DOMAIN = "example"
DOMAIN_VERSION = 1
_MIN_OPSET = 15
_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE}


def swish(x: np.ndarray, beta: float = 1.0) -> np.ndarray:
    """``x * sigmoid(beta * x)``, computed in float32 (float64 for float64 input), in ``x``'s dtype."""
    xf = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    b = xf.dtype.type(beta)
    return (xf / (1 + np.exp(-b * xf))).astype(x.dtype)


def _reference(x: np.ndarray, beta: float = 1.0) -> tuple[np.ndarray]:
    return (swish(np.asarray(x), float(beta)),)


def swish_function(opset: int = 17) -> ir.Function:
    """The ONNX function body of ``example.BetaSwish`` for a model of default-domain ``opset`` (>= 15)."""
    x = ir.Value(name="X")
    beta = ir.Node(
        "", "Constant", inputs=[], attributes=[ir.RefAttr("value_float", "beta", ir.AttributeType.FLOAT)]
    )
    cast = ir.node("CastLike", [beta.outputs[0], x])
    scaled = ir.node("Mul", [x, cast.outputs[0]])
    gate = ir.node("Sigmoid", [scaled.outputs[0]])
    y = ir.node("Mul", [x, gate.outputs[0]])
    y.outputs[0].name = "Y"
    graph = ir.Graph([x], [y.outputs[0]], nodes=[beta, cast, scaled, gate, y], opset_imports={"": opset})
    return ir.Function(DOMAIN, "BetaSwish", "", graph=graph, attributes=[ir.AttrFloat32("beta", 1.0)])


def _infer_shapes(node: ir.Node) -> None:
    x = node.inputs[0]
    if x is None:
        return
    out = node.outputs[0]
    if x.type is not None:
        out.type = x.type
    if x.shape is not None:
        out.shape = x.shape


def _shape_dims(node: ir.Node, query: Any) -> list[Any]:
    """The symbolic shape rule mograph's shape query asks: ``Y`` has ``X``'s dims."""
    return [query.dims(node.inputs[0])]


def _beta(node: ir.Node) -> float:
    attr = node.attributes.get("beta")
    return 1.0 if attr is None else float(attr.as_float())


def lower_swish(node: ir.Node, ctx: LoweringContext) -> bool:
    """Replace an ``example.BetaSwish`` node by ``Mul(X, Sigmoid(X))`` (``beta = 1``) or
    ``Mul(X, Sigmoid(Mul(X, beta)))``; ``False`` (node left) when ``X``'s float dtype is unknown.

    ``ctx`` is mograph's :class:`~mograph.lowering.LoweringContext` (the model, the target, ...)."""
    graph = node.graph
    x = node.inputs[0]
    if graph is None or x is None or x.dtype not in _FLOATS:
        return False
    beta = _beta(node)
    new: list[ir.Node] = []
    gate_in = x
    if beta != 1.0:
        const = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(beta, dtype=x.dtype.numpy()))})
        scaled = ir.node("Mul", [x, const.outputs[0]])
        new += [const, scaled]
        gate_in = scaled.outputs[0]
    gate = ir.node("Sigmoid", [gate_in])
    y = ir.node("Mul", [x, gate.outputs[0]])
    new += [gate, y]
    replace_node(node, new, [y.outputs[0]], ctx.target)
    return True


#: The declaration contributed through ``mograph_add_custom_ops``.
SWISH = mograph.CustomOp(
    name="BetaSwish",
    domain=DOMAIN,
    version=DOMAIN_VERSION,
    doc="Swish / SiLU: Y = X * sigmoid(beta * X), elementwise; float16/float32/float64; Y has X's dtype and shape.",
    inputs=("X",),
    outputs=("Y",),
    attributes={"beta": 1.0},
    reference=_reference,
    function=swish_function,
    infer_shapes=_infer_shapes,
    shape_dims=_shape_dims,
    lowerings={"onnx": lower_swish, "ort": lower_swish},
)


def _only_reader(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and all(use.node is reader for use in value.uses())


def _read_once(context: Any, node: ir.Node) -> MatchResult:
    """A node check of the pattern: the ``Sigmoid`` (or ``beta`` ``Mul``) must feed nothing but the swish."""
    value = node.outputs[0]
    uses = list(value.uses())
    if value.is_graph_output() or len(uses) != 1:
        return Rule.fail("the Sigmoid or its beta Mul has other readers; fusing would remove nothing", node)
    return Rule.ok()


class SwishFusion(Rule):
    """``X * Sigmoid(X)`` or ``X * Sigmoid(X * beta)`` (either operand order of each ``Mul``) -> ``example.BetaSwish``.

    The same door as mograph's built-in fusions (:class:`mograph.patterns.Rule`): a pattern with the two
    exporter spellings as alternatives, a check that says why it refuses, a rewrite to the canonical op.
    """

    min_candidate_nodes = 2
    structural_near_misses = False  # a Mul next to a Sigmoid is no near miss; a refused whole match is

    def pattern(self, op: Any, x: Any, beta: Any) -> Any:
        return OrValue(
            [op.Mul(x, op.Sigmoid(op.Mul(x, beta, _check=_read_once), _check=_read_once)),
             op.Mul(x, op.Sigmoid(x, _check=_read_once))],
            tag_var="form", tag_values=["scaled", "silu"],
        )

    def check(self, context: Any, x: ir.Value, beta: ir.Value | None = None,  # type: ignore[override]
              **_: Any) -> MatchResult:
        opset = getattr(self, "model_opset", 0)
        if opset < _MIN_OPSET:
            return self.fail(f"default opset {opset} < {_MIN_OPSET}: the function body needs CastLike", x)
        if beta is not None and _scalar(beta) is None:
            return self.fail("beta is not a one-element constant", beta)
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, beta: ir.Value | None = None, **_: Any) -> Any:
        value = 1.0 if beta is None else _scalar(beta)
        # beta is always written: some runtimes (onnx.reference) do not apply a function's defaults
        return op.BetaSwish(x, beta=float(value or 1.0), _domain=DOMAIN, _version=DOMAIN_VERSION)


def _scalar(value: ir.Value | None) -> float | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    array = np.asarray(tensor.numpy())
    return float(array.reshape(-1)[0]) if array.size == 1 else None


class FuseSwishPass(mograph.Pass):
    """Fuse X * Sigmoid(X) and X * Sigmoid(beta * X) into one example.BetaSwish node."""

    name = "fuse-swish"
    family = "fusion"
    #: It writes ``example.BetaSwish`` nodes: mograph appends the ``lower`` step (the plugin manual's rule).
    emits_custom_ops = True

    def call(self, model: ir.Model) -> mograph.PassResult:
        rule = SwishFusion()
        rule.model_opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))  # type: ignore[attr-defined]

        def namer(node: ir.Node, _rule: Rule) -> None:
            SWISH.infer_shapes(node)  # type: ignore[misc]
            mograph.stamp(node, self.name, "SwishFusion")

        report = apply_rules(model, [rule], namer=namer)
        fused = int(report.stats.get("SwishFusion", 0))
        if fused:  # the op's function body and domain import, as the built-in fusions give theirs
            ensure_functions(model, {SWISH.key: SWISH})
        misses = [{"node": m.root, "reason": m.reason} for m in report.near_misses]
        details = {"near_misses": misses} if misses else {}
        return mograph.PassResult(modified=fused > 0, stats={"SwishFusion": fused}, details=details)
