"""Load-time checks of what a model's values declare: element types and dims.

:func:`check_declarations` refuses, with a :class:`~mograph.errors.ModelError` naming the value:

* an element type ``UNDEFINED`` (0) on a graph input or output or a node's output: no tensor can be
  made of it, so random feeds and ONNX Runtime fail on it, each in its own way;
* a ``dim_value`` below -1: no meaning anywhere.  A ``-1`` is what some converters write for
  "unknown" (ONNX spells that as a named or unset dim; ONNX Runtime reads -1 as unknown too), so it is
  not refused: it becomes an unset dim, with one warning per model, before any consumer of the shape
  (random verification feeds first) could take it as a size.

Tensors (initializers, attribute tensors), cycles in any graph and the ops' schemas are checked by
the structure checks of :mod:`mograph.ir_io`.  Checked once, at load, so a pass never meets them and
they are exit code 3, never a crash in a pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import onnx_ir as ir

from mograph.errors import ModelError

__all__ = ["check_declarations"]

logger = logging.getLogger(__name__)


def check_declarations(model: ir.Model) -> None:
    """Raise :class:`ModelError` for the first value with an UNDEFINED element type or a dim below -1.

    A ``-1`` dim is made an unset (unknown) dim in place, with a warning naming the first value that had one.
    """
    unknown: list[str] = []
    for graph, _owner in _graphs(model.graph):
        for role, value in _declared_values(graph):
            _check_value(value, role, unknown)
    if unknown:
        logger.warning("%d value(s) declare a dimension of -1 (first: %s); read as unknown dimensions",
                       len(unknown), unknown[0])


def _graphs(main: ir.Graph) -> Iterator[tuple[ir.Graph, ir.Node | None]]:
    """Every graph of the model with the node that owns it (``None`` for the main graph), outer first."""
    todo: list[tuple[ir.Graph, ir.Node | None]] = [(main, None)]
    while todo:
        graph, owner = todo.pop()
        yield graph, owner
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    todo.append((attr.value, node))
                elif attr.type == ir.AttributeType.GRAPHS:
                    todo.extend((g, node) for g in attr.value)


def _declared_values(graph: ir.Graph) -> Iterable[tuple[str, ir.Value]]:
    for v in graph.inputs:
        yield "graph input", v
    for v in graph.outputs:
        yield "graph output", v
    for node in graph:
        for v in node.outputs:
            if not v.is_graph_output():  # named once, as an output
                yield "value", v


def _check_value(value: ir.Value, role: str, unknown: list[str]) -> None:
    if value.dtype == ir.DataType.UNDEFINED:
        raise ModelError(f"{role} '{value.name}' has element type UNDEFINED: a tensor needs an element type")
    if value.shape is None:
        return
    dims = list(value.shape.dims)
    for axis, dim in enumerate(dims):
        if isinstance(dim, int) and dim < -1:
            raise ModelError(
                f"{role} '{value.name}' dimension {axis} is {dim}: a dimension is a size >= 0 or a name "
                "(an unknown size is a named or unset dim)"
            )
    if any(isinstance(d, int) and d == -1 for d in dims):
        unknown.append(f"{role} '{value.name}'")
        value.shape = ir.Shape([None if isinstance(d, int) and d == -1 else d for d in dims])
