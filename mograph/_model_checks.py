"""Load-time checks: what a model's values declare (element types and dims), and its structure.

:func:`check_declarations` refuses, with a :class:`~mograph.errors.ModelError` naming the value:

* an element type ``UNDEFINED`` (0) on a graph input or output or a node's output: no tensor can be
  made of it, so random feeds and ONNX Runtime fail on it, each in its own way;
* a ``dim_value`` below -1: no meaning anywhere.  A ``-1`` is what some converters write for
  "unknown" (ONNX spells that as a named or unset dim; ONNX Runtime reads -1 as unknown too), so it is
  not refused: it becomes an unset dim, with one warning per model, before any consumer of the shape
  (random verification feeds first) could take it as a size.  A dim named ``?`` is read the same
  way: paddle2onnx writes that name for every unknown dim, so an image input ``[-1, 3, ?, ?]`` would
  otherwise say that its height and width are one size (ONNX: equal names, equal sizes), and a
  ``--shape x:1x3x48x192`` would be refused.

:func:`check_structure` refuses a graph without outputs, a value read but never made, a cycle in any
graph or function, and standard ops whose attributes or required inputs are not their schema's.  Tensors
(initializers, attribute tensors) are checked by :mod:`mograph.ir_io`.  Checked once, at load, so a pass
never meets them and they are exit code 3, never a crash in a pass.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator

import onnx
import onnx_ir as ir

from mograph._traverse import graphs_and_functions, iter_nodes
from mograph.errors import ModelError

__all__ = ["check_declarations", "check_structure", "UNKNOWN_DIM_NAME"]

logger = logging.getLogger(__name__)

#: A dim name that means "unknown", not a symbol shared by every dim that has it (paddle2onnx's).
UNKNOWN_DIM_NAME = "?"


def check_declarations(model: ir.Model) -> None:
    """Raise :class:`ModelError` for the first value with an UNDEFINED element type or a dim below -1.

    A ``-1`` dim, or a dim named :data:`UNKNOWN_DIM_NAME`, is made an unset (unknown) dim in place, with a
    warning naming the first value that had one.
    """
    unknown: list[str] = []
    for graph, _owner in _graphs(model.graph):
        for role, value in _declared_values(graph):
            _check_value(value, role, unknown)
    if unknown:
        logger.warning("%d value(s) declare a dimension of -1 or '?' (first: %s); read as unknown dimensions",
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
    if any(_unknown(d) for d in dims):
        unknown.append(f"{role} '{value.name}'")
        value.shape = ir.Shape([None if _unknown(d) else d for d in dims])


def _unknown(dim: object) -> bool:
    """A dim a converter wrote for "unknown": ``-1``, or the name :data:`UNKNOWN_DIM_NAME`."""
    if isinstance(dim, int):
        return dim == -1
    return isinstance(dim, ir.SymbolicDim) and dim.value == UNKNOWN_DIM_NAME


def check_structure(model: ir.Model) -> None:
    """Refuse models whose structure no pass can work on: no outputs, dangling references and cycles."""
    graph = model.graph
    if not graph.outputs:
        raise ModelError("the graph has no outputs: there is nothing to compute")
    for node in iter_nodes(graph):
        for inp in node.inputs:
            if inp is None:
                continue
            if inp.producer() is None and not inp.is_graph_input() and not inp.is_initializer():
                # Values captured from an outer scope are fine inside subgraphs.
                if node.graph is graph:
                    raise ModelError(
                        f"node '{node.name or node.op_type}' reads '{inp.name}', which is neither a "
                        "graph input, an initializer nor the output of any node (missing initializer?)"
                    )
    for owner in graphs_and_functions(model):
        _check_acyclic(owner)
    _check_attributes(model)


def _reads(node: ir.Node) -> set[int]:
    """Ids of the values ``node`` reads, its subgraphs' reads (captured from outer scopes) included."""
    values = {id(v) for v in node.inputs if v is not None}
    for attr in node.attributes.values():
        if attr.is_ref():
            continue
        graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
            list(attr.value) if attr.type == ir.AttributeType.GRAPHS else []
        )
        for sub in graphs:
            for inner in iter_nodes(sub):
                values.update(id(v) for v in inner.inputs if v is not None)
    return values


def _check_acyclic(owner: ir.Graph | ir.Function) -> None:
    """Kahn's algorithm; a subgraph reading a value of its own graph depends on its producer."""
    nodes = list(owner)
    members = {id(n) for n in nodes}
    producer = {id(v): id(n) for n in nodes for v in n.outputs}
    preds = {id(n): {producer[v] for v in _reads(n) if v in producer} & members for n in nodes}
    succs: dict[int, list[ir.Node]] = {id(n): [] for n in nodes}
    for n in nodes:
        for p in preds[id(n)]:
            succs[p].append(n)
    indeg = {k: len(v) for k, v in preds.items()}
    ready = [n for n in nodes if indeg[id(n)] == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for succ in succs[id(n)]:
            indeg[id(succ)] -= 1
            if indeg[id(succ)] == 0:
                ready.append(succ)
    if seen != len(nodes):
        stuck = [n.name or n.op_type for n in nodes if indeg[id(n)] > 0][:5]
        where = "the graph" if isinstance(owner, ir.Graph) and owner.name is None else f"graph '{owner.name}'"
        raise ModelError(f"{where} has a cycle through nodes {stuck}")


@functools.lru_cache(maxsize=4096)
def _schema(op_type: str, version: int) -> onnx.defs.OpSchema | None:
    """The default-domain schema of ``op_type`` at ``version`` (looked up once per op and opset)."""
    try:
        return onnx.defs.get_schema(op_type, version, "")
    except onnx.defs.SchemaError:
        return None


def _check_attributes(model: ir.Model) -> None:
    """Standard ops' attributes must be the ones their schema declares, of the declared type, with
    the required ones present, and their required inputs must be given: passes read them without
    second-guessing (``axes`` as a list, ``value`` as a tensor, ``Unsqueeze`` with data)."""
    for owner in graphs_and_functions(model):
        opsets = owner.opset_imports if isinstance(owner, ir.Function) else model.opset_imports
        for node in owner:
            if node.domain not in ("", "ai.onnx"):
                continue
            version = opsets.get("", opsets.get("ai.onnx", model.opset_imports.get("")))
            if version is None:
                raise ModelError(
                    f"node '{node.name or node.op_type}' is a standard {node.op_type}, but the model imports no "
                    "opset for the default domain"
                )
            schema = _schema(node.op_type, version)
            if schema is None:
                continue  # not a standard op at this opset: ONNX Runtime will say so
            label = f"node '{node.name or node.op_type}' ({node.op_type})"
            for name, attr in node.attributes.items():
                declared = schema.attributes.get(name)
                if declared is None:
                    raise ModelError(f"{label} has an attribute '{name}' that {node.op_type}-{version} does not define")
                if attr.is_ref():
                    continue
                want = ir.AttributeType(int(declared.type))  # type: ignore[call-overload]
                if attr.type != want:
                    raise ModelError(f"{label}: attribute '{name}' must be {want.name}, not {attr.type.name}")
            for name, declared in schema.attributes.items():
                if declared.required and name not in node.attributes:
                    raise ModelError(f"{label} lacks its required attribute '{name}'")
            inputs = list(node.inputs)
            if len(inputs) > schema.max_input:
                raise ModelError(f"{label} has {len(inputs)} inputs; {node.op_type}-{version} takes at most {schema.max_input}")
            single = onnx.defs.OpSchema.FormalParameterOption.Single
            for i, formal in enumerate(schema.inputs):
                if formal.option == single and (i >= len(inputs) or inputs[i] is None):
                    raise ModelError(f"{label} lacks its required input {i} ('{formal.name}')")
            for name in _DTYPE_ATTRIBUTES.get(node.op_type, ()):
                named = node.attributes.get(name)
                if named is not None and not named.is_ref() and not _is_dtype(named.value):
                    raise ModelError(f"{label}: attribute '{name}' = {named.value} is not an ONNX data type")


#: Attributes that name a data type (``TensorProto.DataType``), by op.
_DTYPE_ATTRIBUTES = {
    "Cast": ("to",),
    "EyeLike": ("dtype",),
    "RandomNormal": ("dtype",),
    "RandomUniform": ("dtype",),
    "RandomNormalLike": ("dtype",),
    "RandomUniformLike": ("dtype",),
    "Multinomial": ("dtype",),
    "Bernoulli": ("dtype",),
}


def _is_dtype(value: object) -> bool:
    try:
        return isinstance(value, int) and ir.DataType(value) != ir.DataType.UNDEFINED
    except ValueError:
        return False
