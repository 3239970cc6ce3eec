"""Lowering of the fused ``mograph`` ops to what each target runs natively.

``--target`` (an option of every fusion pass, default ``onnx``):

``mograph``
    keep the ``mograph`` ops; each carries its ONNX function body (runs anywhere, no speed-up by
    itself; for tools and runtimes that load mograph's kernels).
``onnx`` (default)
    standard ops where the model's opset has them: ``LayerNormalization`` (opset >= 17),
    ``RMSNormalization`` (>= 23), ``Gelu`` with ``approximate`` (>= 20).  (``fuse-skip-layernorm`` and
    ``fuse-bias-gelu`` do nothing for ``onnx`` where the standard ops exist: their standard form is the
    unfused one.)  Everything else stays a ``mograph`` op with its function
    body, so the model stays valid standard ONNX plus local functions.  The opset is not changed
    unless ``--upgrade-opset`` asks for it (``N`` or ``auto``): then a pass that fused an op whose
    standard form needs a newer opset first raises the model's opset (:mod:`._opset`, through
    ``onnx.version_converter``, node by node, numerics unchanged) and lowers to the standard op.
    ONNX Runtime 1.32's CPU provider has kernels for ``Gelu``-20 and ``RMSNormalization``-23.
``ort``
    ONNX Runtime's own kernels: ``LayerNormalization`` and ``SimplifiedLayerNormalization`` (ORT
    registers both in the default domain at every opset), ``com.microsoft`` ``SkipLayerNormalization``,
    ``SkipSimplifiedLayerNormalization``, ``Gelu``, ``FastGelu``, ``QuickGelu``, ``BiasGelu``.  The result
    runs in ONNX Runtime only.
``tensorrt``
    native TensorRT layers where the ONNX parser has them (``LayerNormalization`` at opset >= 17,
    ``Gelu`` at >= 20, pointwise ops for ``QuickGelu``); otherwise a plugin node: op type = plugin
    name (``LayerNorm``, ``RMSNorm``, ``SkipLayerNorm``, ``SkipRMSNorm``, ``Gelu``, ``BiasGelu``), attributes
    ``plugin_namespace="mograph"``, ``plugin_version="1"`` and the plugin's own attributes
    (``epsilon``; ``approximate`` = ``"none"``/``"tanh"`` for the GELUs; ``sum_output``).  Plugin
    nodes carry no function body, so the parser falls back to the plugin registry instead of
    inlining a body.  They are emitted in the form the plugins take
    (:data:`mograph.backends.tensorrt_plugins.PLUGINS`), so ``build_engine`` has nothing to legalize:
    Scale/B/Bias are ``[hidden]`` vectors (a one-element constant is widened), a zero B or Bias is
    left off when nothing after it is kept (else zeros ``[hidden]``: no empty input names), and a
    SkipLayerNorm / SkipRMSNorm has its ``Sum`` output (``sum_output=1``) only when something reads the sum.

A lowering that cannot apply (dynamic hidden size where a 1-D scale must be built, shapes that the
runtime's kernel does not accept) leaves the ``mograph`` op in place; it is never an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION
from mograph.patterns import constant_array, remove_dead_producers

__all__ = ["TARGETS", "DEFAULT_TARGET", "ONNX_STANDARD_OPSET", "lower_nodes", "ensure_functions", "lowerings_for",
           "PLUGIN_VERSION"]

logger = logging.getLogger(__name__)

TARGETS = ("mograph", "onnx", "ort", "tensorrt")
DEFAULT_TARGET = "onnx"
PLUGIN_NAMESPACE = "mograph"
PLUGIN_VERSION = "1"
MS_DOMAIN = "com.microsoft"

Lowering = Callable[[ir.Node, ir.Model], bool]

#: The default-domain opset from which a fused op has a standard ONNX form (``--target onnx``).
ONNX_STANDARD_OPSET = {"LayerNorm": 17, "Gelu": 20, "FastGelu": 20, "RMSNorm": 23}


def _opset(model: ir.Model) -> int:
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))


def _attr(node: ir.Node, name: str, default: object) -> object:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _hidden(x: ir.Value) -> int | None:
    if x.shape is None or len(x.shape) == 0:
        return None
    d = x.shape[-1]
    return d if isinstance(d, int) else None


def _unique_name(graph: ir.Graph, base: str) -> str:
    name, i = base, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    return name


def _initializer(graph: ir.Graph, base: str, arr: np.ndarray) -> ir.Value:
    name = _unique_name(graph, base)
    value = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                     const_value=ir.tensor(arr, name=name))
    graph.register_initializer(value)
    return value


def is_zero(value: ir.Value | None) -> bool:
    """True for a missing input or a constant of zeros."""
    if value is None:
        return True
    arr = constant_array(value)
    return arr is not None and not np.any(arr)


def _vector(graph: ir.Graph, value: ir.Value, x: ir.Value, base: str) -> ir.Value | None:
    """``value`` as a 1-D ``[hidden]`` tensor of x's dtype, materialised if it is a constant."""
    hidden = _hidden(x)
    arr = constant_array(value)
    if arr is None:
        if value.shape is not None and len(value.shape) == 1 and value.dtype == x.dtype:
            return value
        return None
    if hidden is None:
        if arr.ndim == 1 and arr.size > 1 and value.const_value is not None:
            return value
        return None
    dtype = x.dtype.numpy() if x.dtype is not None else arr.dtype
    if arr.size == 1:
        arr = np.full((hidden,), arr.reshape(()), dtype=dtype)
    elif arr.size == hidden:
        if arr.ndim == 1 and arr.dtype == dtype and value.const_value is not None and value.is_initializer():
            return value
        arr = arr.reshape(hidden).astype(dtype)
    else:
        return None
    return _initializer(graph, f"{base}_{hidden}", arr)


def _replace(node: ir.Node, new_nodes: list[ir.Node], new_outputs: list[ir.Value | None]) -> None:
    graph = node.graph
    assert graph is not None
    model_opsets = graph.opset_imports
    for n in new_nodes:
        if n.domain == MS_DOMAIN and MS_DOMAIN not in model_opsets:
            model_opsets[MS_DOMAIN] = 1
    olds, news = [], []
    for old, new in zip(node.outputs, new_outputs):
        if new is None:
            continue
        olds.append(old)
        news.append(new)
    for n in new_nodes:
        n.metadata_props.update(node.metadata_props)
    base = node.name or node.op_type
    for i, n in enumerate(new_nodes):
        n.name = base if len(new_nodes) == 1 else f"{base}/{i}"
    inputs = list(node.inputs)
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, olds, news)
    remove_dead_producers(graph, inputs)


def _used(value: ir.Value) -> bool:
    return bool(value.uses()) or value.is_graph_output()


# ---------------------------------------------------------------------------------------------
# per op, per target
# ---------------------------------------------------------------------------------------------


def _layer_norm_node(graph: ir.Graph, node: ir.Node, x: ir.Value, scale: ir.Value, beta: ir.Value | None,
                     domain: str = "") -> ir.Node | None:
    s = _vector(graph, scale, x, "mograph_ln_scale")
    if s is None:
        return None
    inputs = [x, s]
    if not is_zero(beta):
        assert beta is not None
        b = _vector(graph, beta, x, "mograph_ln_bias")
        if b is None:
            return None
        inputs.append(b)
    return ir.node(
        "LayerNormalization",
        inputs,
        attributes={"axis": -1, "epsilon": float(_attr(node, "epsilon", 1e-5)),  # type: ignore[arg-type]
                    "stash_type": int(_attr(node, "stash_type", 1))},  # type: ignore[call-overload]
        domain=domain,
    )


def _ln_to_standard(node: ir.Node, model: ir.Model) -> bool:
    x, scale, beta = node.inputs
    assert node.graph is not None and x is not None and scale is not None
    new = _layer_norm_node(node.graph, node, x, scale, beta)
    if new is None:
        return False
    _replace(node, [new], [new.outputs[0]])
    return True


def _plugin(node: ir.Node, name: str, inputs: list[ir.Value], num_outputs: int = 1, **attrs: Any) -> ir.Node:
    """A plugin node in the form the mograph TensorRT plugins take (:data:`~mograph.backends.tensorrt_plugins.PLUGINS`).

    The attributes are the plugin's own (its table fills in defaults, namespace and version and refuses
    unknown ones); ``inputs`` must already be legal: vectors ``[hidden]``, optional ones only left off
    the end.  The caller replaces ``node`` with it.
    """
    from mograph.backends.tensorrt_plugins import plugin_attributes

    return ir.node(name, inputs, attributes=plugin_attributes(name, **attrs), domain=DOMAIN, num_outputs=num_outputs)


def _plugin_vectors(node: ir.Node, x: ir.Value, values: list[tuple[ir.Value | None, str, bool]]) -> list[ir.Value] | None:
    """Legal vector inputs of a plugin node: each ``(value, base name, optional)`` in order.

    A vector must be ``[hidden]`` (a one-element constant is widened); an optional one that is zero is
    left off when nothing after it is kept, else it becomes zeros ``[hidden]`` (the parser refuses
    empty input names).  None if one cannot be built (unknown hidden size).
    """
    graph = node.graph
    assert graph is not None
    keep = [not (optional and is_zero(v)) for v, _, optional in values]
    while keep and not keep[-1]:
        keep.pop()
    out: list[ir.Value] = []
    for (value, base, _), _keep in zip(values, keep):
        if value is None:
            hidden = _hidden(x)
            if hidden is None:
                return None
            dtype = x.dtype.numpy() if x.dtype is not None else np.float32
            out.append(_initializer(graph, f"{base}_{hidden}", np.zeros((hidden,), dtype=dtype)))
            continue
        vec = _vector(graph, value, x, base)
        if vec is None or (_hidden(x) is None and (vec.shape is None or len(vec.shape) != 1)):
            return None
        out.append(vec)
    return out


def _ln_onnx(node: ir.Node, model: ir.Model) -> bool:
    return _opset(model) >= 17 and _ln_to_standard(node, model)


def _ln_ort(node: ir.Node, model: ir.Model) -> bool:
    return _ln_to_standard(node, model)


def _ln_trt(node: ir.Node, model: ir.Model) -> bool:
    if _opset(model) >= 17 and _ln_to_standard(node, model):
        return True
    x, scale, beta = node.inputs
    assert x is not None
    vectors = _plugin_vectors(node, x, [(scale, "mograph_ln_scale", False), (beta, "mograph_ln_bias", True)])
    if vectors is None:
        return False
    new = _plugin(node, "LayerNorm", [x, *vectors], epsilon=float(_attr(node, "epsilon", 1e-5)))  # type: ignore[arg-type]
    _replace(node, [new], [new.outputs[0]])
    return True


def _rms(node: ir.Node, model: ir.Model, op_type: str, domain: str = "") -> bool:
    x, scale = node.inputs
    assert node.graph is not None and x is not None and scale is not None
    s = _vector(node.graph, scale, x, "mograph_rms_scale")
    if s is None:
        return False
    new = ir.node(op_type, [x, s], attributes={
        "axis": -1, "epsilon": float(_attr(node, "epsilon", 1e-6)),  # type: ignore[arg-type]
        "stash_type": int(_attr(node, "stash_type", 1))}, domain=domain)  # type: ignore[call-overload]
    _replace(node, [new], [new.outputs[0]])
    return True


def _rms_onnx(node: ir.Node, model: ir.Model) -> bool:
    return _opset(model) >= 23 and _rms(node, model, "RMSNormalization")


def _rms_ort(node: ir.Node, model: ir.Model) -> bool:
    return _rms(node, model, "SimplifiedLayerNormalization")


def _rms_trt(node: ir.Node, model: ir.Model) -> bool:
    x, scale = node.inputs
    assert x is not None
    vectors = _plugin_vectors(node, x, [(scale, "mograph_rms_scale", False)])
    if vectors is None:
        return False
    new = _plugin(node, "RMSNorm", [x, *vectors], epsilon=float(_attr(node, "epsilon", 1e-6)))  # type: ignore[arg-type]
    _replace(node, [new], [new.outputs[0]])
    return True


def _skip_order(x: ir.Value, skip: ir.Value) -> tuple[ir.Value, ir.Value] | None:
    """(input, skip) as ORT's SkipLayerNormalization needs them, or None if it cannot take them.

    The kernel broadcasts ``skip`` (``[1, S, H]`` or ``[S, H]``) over ``input`` ``[B, S, H]`` but
    never the other way, and gives a wrong shape if ``input`` is the smaller one.  A static 1 in a
    dim of one operand where the other has a different dim makes that operand the skip; symbolic dims
    of the two operands are taken to be equal (both are residual-stream activations).
    """
    x_shape, s_shape = x.shape, skip.shape
    if x_shape is None or s_shape is None:
        return None
    if len(x_shape) < len(s_shape):
        x, skip = skip, x
        x_shape, s_shape = s_shape, x_shape
    if len(x_shape) not in (2, 3) or len(s_shape) not in (2, 3):
        return None
    if not isinstance(x_shape[-1], int) or x_shape[-1] != s_shape[-1]:
        return None
    if len(x_shape) == len(s_shape):
        x_ones = any(d == 1 and e != 1 for d, e in zip(x_shape, s_shape))
        s_ones = any(e == 1 and d != 1 for d, e in zip(x_shape, s_shape))
        if x_ones and s_ones:
            return None
        if x_ones:
            x, skip = skip, x
    return x, skip


Vectors = list[tuple[ir.Value | None, str, bool]]  # (value, base name of a built vector, optional)


def _skip_to_ort(node: ir.Node, op_type: str, vectors: Vectors, epsilon: float) -> bool:
    """``com.microsoft`` ``op_type`` (SkipLayerNormalization and its RMS form): input, skip, then ``vectors``
    as ``[hidden]`` tensors (a zero optional one left empty); the sum, when read, as output 3."""
    x, skip = node.inputs[0], node.inputs[1]
    graph = node.graph
    assert graph is not None and x is not None and skip is not None
    order = _skip_order(x, skip)
    if order is None:
        return False
    x, skip = order
    inputs: list[ir.Value | None] = [x, skip]
    for value, base, optional in vectors:
        if optional and is_zero(value):
            inputs.append(None)
            continue
        assert value is not None
        vec = _vector(graph, value, x, base)
        if vec is None:
            return False
        inputs.append(vec)
    while inputs[-1] is None:
        inputs.pop()
    want_sum = len(node.outputs) > 1 and _used(node.outputs[1])
    new = ir.node(op_type, inputs, attributes={"epsilon": float(_attr(node, "epsilon", epsilon))},  # type: ignore[arg-type]
                  domain=MS_DOMAIN, num_outputs=4 if want_sum else 1)
    if want_sum:
        for i in (1, 2):
            new.outputs[i].name = ""
    outs: list[ir.Value | None] = [new.outputs[0]]
    if len(node.outputs) > 1:
        outs.append(new.outputs[3] if want_sum else None)
    _replace(node, [new], outs)
    return True


def _skip_to_plugin(node: ir.Node, plugin: str, vectors: Vectors, epsilon: float) -> bool:
    """The ``plugin`` node (SkipLayerNorm, SkipRMSNorm): ``Sum`` as a second output (``sum_output=1``) only
    when it is read."""
    x, skip = node.inputs[0], node.inputs[1]
    assert x is not None and skip is not None
    if x.shape is None or skip.shape is None or len(x.shape) != len(skip.shape):
        return False  # the plugin broadcasts Skip over leading axes of the same rank only
    legal = _plugin_vectors(node, x, vectors)
    if legal is None:
        return False
    want_sum = len(node.outputs) > 1 and _used(node.outputs[1])
    new = _plugin(node, plugin, [x, skip, *legal], num_outputs=2 if want_sum else 1,
                  epsilon=float(_attr(node, "epsilon", epsilon)), sum_output=int(want_sum))  # type: ignore[arg-type]
    outs: list[ir.Value | None] = [new.outputs[0]]
    if len(node.outputs) > 1:
        outs.append(new.outputs[1] if want_sum else None)
    _replace(node, [new], outs)
    return True


def _skip_ln_vectors(node: ir.Node) -> Vectors:
    _x, _skip, scale, beta, bias = node.inputs
    return [(scale, "mograph_ln_scale", False), (beta, "mograph_ln_bias", True), (bias, "mograph_skip_bias", True)]


def _skip_rms_vectors(node: ir.Node) -> Vectors:
    _x, _skip, scale, bias = node.inputs
    return [(scale, "mograph_rms_scale", False), (bias, "mograph_skip_bias", True)]


def _skip_ort(node: ir.Node, model: ir.Model) -> bool:
    return _skip_to_ort(node, "SkipLayerNormalization", _skip_ln_vectors(node), 1e-5)


def _skip_rms_ort(node: ir.Node, model: ir.Model) -> bool:
    return _skip_to_ort(node, "SkipSimplifiedLayerNormalization", _skip_rms_vectors(node), 1e-6)


def _skip_trt(node: ir.Node, model: ir.Model) -> bool:
    return _skip_to_plugin(node, "SkipLayerNorm", _skip_ln_vectors(node), 1e-5)


def _skip_rms_trt(node: ir.Node, model: ir.Model) -> bool:
    return _skip_to_plugin(node, "SkipRMSNorm", _skip_rms_vectors(node), 1e-6)


def _gelu_standard(node: ir.Node, model: ir.Model, approximate: str, with_bias: bool) -> bool:
    if _opset(model) < 20:
        return False
    nodes = []
    x = node.inputs[0]
    assert x is not None
    if with_bias:
        add = ir.node("Add", [x, node.inputs[1]])
        add.outputs[0].type, add.outputs[0].shape = x.type, x.shape
        nodes.append(add)
        x = add.outputs[0]
    gelu = ir.node("Gelu", [x], attributes={"approximate": approximate})
    nodes.append(gelu)
    _replace(node, nodes, [gelu.outputs[0]])
    return True


def _ms(node: ir.Node, op_type: str, inputs: list[ir.Value | None], **attrs: Any) -> bool:
    new = ir.node(op_type, inputs, attributes=attrs, domain=MS_DOMAIN)
    _replace(node, [new], [new.outputs[0]])
    return True


def _bias_1d(node: ir.Node) -> ir.Value | None:
    x, bias = node.inputs
    assert node.graph is not None and x is not None and bias is not None
    return _vector(node.graph, bias, x, "mograph_gelu_bias")


def _gelu_lowerings(name: str) -> dict[str, Lowering]:
    approximate = "tanh" if "Fast" in name else "none"
    with_bias = name.startswith("Bias")
    ms_name = {"Gelu": "Gelu", "FastGelu": "FastGelu", "BiasGelu": "BiasGelu", "BiasFastGelu": "FastGelu"}[name]

    def ort(node: ir.Node, model: ir.Model) -> bool:
        if with_bias:
            b = _bias_1d(node)
            return b is not None and _ms(node, ms_name, [node.inputs[0], b])
        return _ms(node, ms_name, [node.inputs[0]])

    def onnx(node: ir.Node, model: ir.Model) -> bool:
        return not with_bias and _gelu_standard(node, model, approximate, with_bias)

    def trt(node: ir.Node, model: ir.Model) -> bool:
        if _gelu_standard(node, model, approximate, with_bias):
            return True
        x = node.inputs[0]
        assert x is not None
        inputs = [x]
        if with_bias:
            vectors = _plugin_vectors(node, x, [(node.inputs[1], "mograph_gelu_bias", False)])
            if vectors is None:
                return False
            inputs += vectors
        new = _plugin(node, "BiasGelu" if with_bias else "Gelu", inputs, approximate=approximate)
        _replace(node, [new], [new.outputs[0]])
        return True

    return {"onnx": onnx, "ort": ort, "tensorrt": trt}


def _quick_ort(node: ir.Node, model: ir.Model) -> bool:
    return _ms(node, "QuickGelu", [node.inputs[0]], alpha=float(_attr(node, "alpha", 1.702)))  # type: ignore[arg-type]


def _quick_trt(node: ir.Node, model: ir.Model) -> bool:
    x = node.inputs[0]
    assert x is not None
    alpha = np.array(float(_attr(node, "alpha", 1.702)), dtype=x.dtype.numpy() if x.dtype else np.float32)  # type: ignore[arg-type]
    c = ir.node("Constant", [], attributes={"value": ir.tensor(alpha)})
    m = ir.node("Mul", [x, c.outputs[0]])
    s = ir.node("Sigmoid", [m.outputs[0]])
    y = ir.node("Mul", [x, s.outputs[0]])
    _replace(node, [c, m, s, y], [y.outputs[0]])
    return True


_LOWERINGS: dict[str, dict[str, Lowering]] = {
    "LayerNorm": {"onnx": _ln_onnx, "ort": _ln_ort, "tensorrt": _ln_trt},
    "RMSNorm": {"onnx": _rms_onnx, "ort": _rms_ort, "tensorrt": _rms_trt},
    "SkipLayerNorm": {"ort": _skip_ort, "tensorrt": _skip_trt},
    "SkipRMSNorm": {"ort": _skip_rms_ort, "tensorrt": _skip_rms_trt},
    "Gelu": _gelu_lowerings("Gelu"),
    "FastGelu": _gelu_lowerings("FastGelu"),
    "BiasGelu": _gelu_lowerings("BiasGelu"),
    "BiasFastGelu": _gelu_lowerings("BiasFastGelu"),
    "QuickGelu": {"ort": _quick_ort, "tensorrt": _quick_trt},
}


def lowerings_for(name: str) -> dict[str, Lowering]:
    return dict(_LOWERINGS.get(name, {}))


def is_plugin_node(node: ir.Node) -> bool:
    return node.domain == DOMAIN and "plugin_namespace" in node.attributes


def lower_nodes(model: ir.Model, nodes: Iterable[ir.Node], target: str) -> dict[str, int]:
    """Lower the given ``mograph`` nodes (still in the graph) for ``target``; count per op."""
    counts: dict[str, int] = {}
    if target == "mograph":
        return counts
    for node in list(nodes):
        if node.graph is None or node.domain != DOMAIN or is_plugin_node(node):
            continue
        lower = _LOWERINGS.get(node.op_type, {}).get(target)
        if lower is not None and lower(node, model):
            key = f"lowered.{node.op_type}"
            counts[key] = counts.get(key, 0) + 1
        else:
            logger.debug("%s: %s stays a mograph op for target %s", node.name, node.op_type, target)
    return counts


def ensure_functions(model: ir.Model) -> bool:
    """Give every ``mograph`` op used in the graph its function body; True if one was added."""
    from mograph.passes.fusion.ops import FUSED_OPS, function_for

    used: set[str] = set()
    any_mograph = False
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == DOMAIN:
            any_mograph = True
            if not is_plugin_node(node) and node.op_type in FUSED_OPS:
                used.add(node.op_type)
    changed = False
    if any_mograph and DOMAIN not in model.opset_imports:
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
        changed = True
    opset = _opset(model)
    for name in sorted(used):
        key = (DOMAIN, name, "")
        if key not in model.functions:
            model.functions[key] = function_for(name, opset)
            changed = True
    return changed
