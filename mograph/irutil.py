"""Small IR helpers shared by passes, lowerings and backends: attributes, initializers, constants.

Each is a one-liner's worth of logic that used to be written out in several modules; keeping them
here keeps their edge cases (a missing attribute, a taken initializer name, a dynamic last axis)
handled the same way everywhere.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.patterns import constant_array

__all__ = ["attr_value", "add_initializer", "unique_initializer_name", "is_zero", "static_last_dim", "value_used",
           "infer_types", "restore_types", "TypeSnapshot", "same_dim", "fresh_name"]

logger = logging.getLogger(__name__)

#: What :func:`infer_types` found on each value before it ran, for :func:`restore_types`.
TypeSnapshot = list[tuple[ir.Value, Any, Any]]


def attr_value(node: ir.Node, name: str, default: Any = None) -> Any:
    """The value of attribute ``name`` of ``node``, or ``default`` when it has none."""
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def fresh_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2`` ...: the first name not in ``taken``, which then holds it."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def unique_initializer_name(graph: ir.Graph, base: str) -> str:
    """``base``, or ``base_1``, ``base_2`` ... : the first name no initializer of ``graph`` has."""
    name, i = base, 0
    while name in graph.initializers:
        i += 1
        name = f"{base}_{i}"
    return name


def add_initializer(graph: ir.Graph, base: str, arr: np.ndarray) -> ir.Value:
    """Register ``arr`` as a new initializer of ``graph`` under a fresh name derived from ``base``."""
    name = unique_initializer_name(graph, base)
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


def static_last_dim(value: ir.Value | None) -> int | None:
    """The size of ``value``'s last axis when it is known statically, else None."""
    if value is None or value.shape is None or len(value.shape) == 0:
        return None
    dim = value.shape[-1]
    return dim if isinstance(dim, int) else None


def same_dim(a: Any, b: Any) -> bool:
    """Whether two dims of a shape are known to be equal: the same int, or the same symbolic name."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    va, vb = getattr(a, "value", None), getattr(b, "value", None)
    return va is not None and va == vb


def value_used(value: ir.Value) -> bool:
    """Whether anything reads ``value`` (a node or the graph's outputs)."""
    return bool(value.uses()) or value.is_graph_output()


def infer_types(model: ir.Model) -> TypeSnapshot:
    """Annotate values with inferred types and shapes (best effort); return what they had before.

    Exporters (TorchScript in particular) leave intermediate values without types; rules and
    lowerings need dtypes and ranks.  A pass that then changes nothing calls :func:`restore_types`,
    so it stays a no-op.
    """
    from onnx_ir.passes.common import ShapeInferencePass

    snapshot: TypeSnapshot = []
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


def restore_types(snapshot: TypeSnapshot) -> None:
    """Put back the types and shapes :func:`infer_types` found."""
    for value, type_, shape in snapshot:
        value.type, value.shape = type_, shape
