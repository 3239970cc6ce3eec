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

``fuse-swish`` leaves alone, as a near miss with its reason: a ``Sigmoid`` (or ``beta`` ``Mul``) whose
output is read elsewhere (fusing would remove nothing), a ``beta`` that is not a one-element constant,
and a model whose default opset is below 15 (the function body needs ``CastLike``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

import mograph
from mograph.lowering import LoweringContext, ensure_functions, replace_node

__all__ = ["DOMAIN", "DOMAIN_VERSION", "SWISH", "FuseSwishPass", "swish", "swish_function", "lower_swish"]

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
    lowerings={"onnx": lower_swish, "ort": lower_swish},
)


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _only_reader(value: ir.Value, reader: ir.Node) -> bool:
    return not value.is_graph_output() and all(use.node is reader for use in value.uses())


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
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        fused = 0
        near_misses: list[dict[str, Any]] = []

        def miss(node: ir.Node, reason: str) -> None:
            near_misses.append({"node": node.name or node.op_type, "reason": reason})

        for mul in list(model.graph):
            if mul.graph is None or not _is(mul, "Mul"):
                continue
            match = self._match(mul)
            if match is None:
                continue
            x, gate, scale, beta = match
            if isinstance(beta, str):
                miss(mul, beta)
                continue
            if opset < _MIN_OPSET:
                miss(mul, f"default opset {opset} < {_MIN_OPSET}: the function body needs CastLike")
                continue
            if not _only_reader(gate.outputs[0], mul) or (scale is not None and not _only_reader(scale.outputs[0], gate)):
                miss(mul, "the Sigmoid or its beta Mul has other readers; fusing would remove nothing")
                continue
            # beta is always written: some runtimes (onnx.reference) do not apply a function's defaults
            node = ir.node("BetaSwish", [x], attributes={"beta": ir.AttrFloat32("beta", beta)}, domain=DOMAIN)
            SWISH.infer_shapes(node)  # type: ignore[misc]
            mograph.stamp(node, self.name, "SwishFusion")
            old = [n for n in (scale, gate, mul) if n is not None]
            ir.convenience.replace_nodes_and_values(model.graph, mul, old, [node], [mul.outputs[0]], node.outputs)
            fused += 1
        if fused:  # the op's function body and domain import, as the built-in fusions give theirs
            ensure_functions(model, {SWISH.key: SWISH})
        details = {"near_misses": near_misses} if near_misses else {}
        return mograph.PassResult(modified=fused > 0, stats={"SwishFusion": fused}, details=details)

    @staticmethod
    def _match(mul: ir.Node) -> tuple[ir.Value, ir.Node, ir.Node | None, float | str] | None:
        """``(x, sigmoid, beta_mul, beta)`` when ``mul`` is ``x * Sigmoid(x)`` or ``x * Sigmoid(x * beta)``;
        ``beta`` is the reason instead when only the constant is wrong; ``None`` when it is no Swish."""
        for gate_idx in (0, 1):
            x = mul.inputs[1 - gate_idx]
            gate_out = mul.inputs[gate_idx]
            gate = None if gate_out is None else gate_out.producer()
            if x is None or gate is None or not _is(gate, "Sigmoid"):
                continue
            inner = gate.inputs[0]
            if inner is x:
                return x, gate, None, 1.0
            scale = None if inner is None else inner.producer()
            if scale is None or not _is(scale, "Mul"):
                continue
            for x_idx in (0, 1):
                if scale.inputs[x_idx] is x:
                    beta = _scalar(scale.inputs[1 - x_idx])
                    return x, gate, scale, beta if beta is not None else "beta is not a one-element constant"
        return None
