"""Load-time checks of what a model declares: element types, dims, and cycles inside subgraphs.

:func:`check_declarations` refuses, with a :class:`~mograph.errors.ModelError` naming the value, what
the ONNX IR does not allow and what nothing downstream can work with:

* an element type ``UNDEFINED`` (0) on a graph input or output, a node's output, an initializer or a
  tensor attribute (a ``Constant``'s value): no tensor can be made of it, so folding, random feeds
  and ONNX Runtime all fail on it, each in its own way;
* a ``dim_value`` below -1: no meaning anywhere.  A ``-1`` is what some converters write for
  "unknown" (ONNX spells that as a named or unset dim; ONNX Runtime reads -1 as unknown too), so it is
  not refused: it becomes an unset dim, with one warning per model, before any consumer of the shape
  (random verification feeds first) could take it as a size;
* a cycle inside a subgraph (``If`` / ``Loop`` / ``Scan`` bodies); the main graph's cycles are found by
  the structure check in :mod:`mograph.ir_io`.

Checked once, at load, so a pass never meets them and they are exit code 3, never a crash in a pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import onnx_ir as ir

from mograph.errors import ModelError

__all__ = ["check_declarations"]

logger = logging.getLogger(__name__)


def check_declarations(model: ir.Model) -> None:
    """Raise :class:`ModelError` for the first UNDEFINED element type, dim below -1, or subgraph cycle.

    A ``-1`` dim is made an unset (unknown) dim in place, with a warning naming the first value that had one.
    """
    unknown: list[str] = []
    for graph, owner in _graphs(model.graph):
        for role, value in _declared_values(graph):
            _check_value(value, role, unknown)
        for name, init in graph.initializers.items():
            tensor = init.const_value
            if tensor is not None and tensor.dtype == ir.DataType.UNDEFINED:
                raise ModelError(f"initializer '{name}' has element type UNDEFINED: a tensor needs an element type")
        for node in graph:
            _check_tensor_attributes(node)
        if owner is not None:
            stuck = _cycle(list(graph))
            if stuck:
                raise ModelError(
                    f"subgraph '{graph.name}' of node '{_node_name(owner)}' has a cycle through nodes {stuck}"
                )
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


def _check_tensor_attributes(node: ir.Node) -> None:
    for name, attr in node.attributes.items():
        if attr.type == ir.AttributeType.TENSOR:
            tensors = [attr.value]
        elif attr.type == ir.AttributeType.TENSORS:
            tensors = list(attr.value)
        else:
            continue
        if any(t is not None and t.dtype == ir.DataType.UNDEFINED for t in tensors):
            raise ModelError(
                f"attribute '{name}' of node '{_node_name(node)}' ({node.op_type}) is a tensor of element type "
                "UNDEFINED: a tensor needs an element type"
            )


def _cycle(nodes: list[ir.Node]) -> list[str]:
    """Names of up to five nodes on or behind a cycle among ``nodes``, ``[]`` if there is none.

    Edges from outside ``nodes`` (values a subgraph captures from its outer graph) do not count.
    """
    members = {id(n): n for n in nodes}
    pending = {id(n): {id(p) for p in n.predecessors() if id(p) in members} for n in nodes}
    consumers: dict[int, list[int]] = {key: [] for key in members}
    for key, producers in pending.items():
        for producer in producers:
            consumers[producer].append(key)
    free = [key for key, producers in pending.items() if not producers]
    while free:  # take away every node whose producers are all taken; a cycle is what stays
        key = free.pop()
        for consumer in consumers[key]:
            pending[consumer].discard(key)
            if not pending[consumer]:
                free.append(consumer)
        del pending[key]
    return [_node_name(members[key]) for key in pending][:5]


def _node_name(node: ir.Node) -> str:
    return node.name or node.op_type
