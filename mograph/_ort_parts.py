"""ONNX Runtime's load of a very large graph, made in consecutive parts (the output check's step 2).

Why: the time of ONNX Runtime's session creation grows with the square of the number of nodes.  Its
execution planner (``PlannerImpl::BuildExecutionPlan``), for every node and every producer of its
inputs, searches the list of the nodes before it for that producer; on the 100k-node stack of
``tools/bench_core.py`` the load took 4.1-4.4 CPU-s where ten 10k-node loads take 2.2.  The output check
creates a session only to prove that ONNX Runtime accepts the graph; it never runs it.

What a part is: the graph's nodes are cut, in the file's (topological) order, into runs of about
:data:`PART_NODES` nodes.  Each run becomes a model with the same opsets, IR version and functions:

* its nodes, copied, and the ``value_info`` of the values they produce;
* as initializers, the initializers its nodes (and their subgraphs) read (external tensors stay
  references to the same files: nothing is read here);
* as inputs, the graph inputs it reads, as declared, and the values it reads that an earlier part
  produced, **declared as ONNX Runtime's load of that earlier part reported them** (its session's output
  type and inferred shape): the types and shapes a node sees are those ONNX Runtime inferred for the whole
  graph, so a type or shape error across a cut is still found;
* as outputs, the graph outputs it produces (declared as in the graph: ONNX Runtime checks the inferred
  type against them), and the values a later part reads.

Each part is loaded with the check's options and freed before the next one is made.  What a part's load
proves is what the whole load proves for its nodes: every node resolved against its schema or ONNX
Runtime's contrib kernel, the inferred types and shapes merged, every node's CPU kernel created.  What
is not made is the one execution plan of the whole graph (a plan per part is).  The caller falls back to
the whole load (:func:`load_in_parts` returns ``False``) where the cut cannot be made as above: a node
that reads a value produced after it, a name read that nothing defines, or a value read across a cut
whose type ONNX Runtime reports as other than a tensor and that the graph does not declare.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import onnx

__all__ = ["PART_NODES", "load_in_parts", "outer_names"]

logger = logging.getLogger(__name__)

#: Nodes of the main graph per part; graphs of at most twice this are loaded whole.
PART_NODES = 8192

_ELEM_TYPES = {name.lower(): value for name, value in onnx.TensorProto.DataType.items()}


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def outer_names(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph`` (a subgraph) and its own subgraphs read from an enclosing scope."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    outer: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                outer.add(name)
        for sub in _subgraphs(node):
            outer |= {name for name in outer_names(sub) if name not in defined}
        defined.update(o for o in node.output if o)
    outer |= {v.name for v in graph.output if v.name not in defined}
    return outer


def _reads(node: onnx.NodeProto) -> list[str]:
    names = [name for name in node.input if name]
    for sub in _subgraphs(node):
        names.extend(sorted(outer_names(sub)))
    return names


def _declared(name: str, ort_type: str, shape: list[Any] | None, scalar: bool = False) -> onnx.ValueInfoProto | None:
    """A tensor ``ValueInfoProto`` from a session's ``NodeArg`` (type string, shape), or ``None``.

    ONNX Runtime reports the same empty shape for a scalar and for a tensor whose shape nothing knows:
    an empty shape is declared as a scalar only when ``scalar`` (the graph says so), else as unknown (a
    declaration with less than ONNX Runtime knew can only let a part through that the whole would
    refuse for a shape, never refuse one the whole accepts)."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        return None
    elem = _ELEM_TYPES.get(ort_type[len("tensor("):-1])
    if elem is None:
        return None
    info = onnx.ValueInfoProto(name=name)
    tensor = info.type.tensor_type
    tensor.elem_type = elem
    if shape is not None and (len(shape) or scalar):
        dims = tensor.shape.dim
        del dims[:]
        tensor.shape.SetInParent()
        for d in shape:
            dim = dims.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif isinstance(d, str) and d:
                dim.dim_param = d
    return info


def _is_scalar(info: onnx.ValueInfoProto | None) -> bool:
    if info is None or info.type.WhichOneof("value") != "tensor_type":
        return False
    tensor = info.type.tensor_type
    return tensor.HasField("shape") and not tensor.shape.dim


def load_in_parts(proto: onnx.ModelProto, load: Callable[[onnx.ModelProto], Any],
                  part_nodes: int | None = None) -> int:
    """Load ``proto`` in parts (module docstring) with ``load`` (a part's ``ModelProto`` -> its session).

    ``part_nodes``: nodes per part (default :data:`PART_NODES`).

    Returns:
        the number of parts loaded, or ``0`` when the graph is loaded whole instead (at most twice
        ``part_nodes`` nodes, or a cut that cannot be made: the caller then loads the whole graph).
    Raises:
        whatever ``load`` raises for a part ONNX Runtime refuses.
    """
    if part_nodes is None:
        part_nodes = PART_NODES
    graph = proto.graph
    nodes = graph.node
    count = len(nodes)
    if part_nodes < 1 or count <= 2 * part_nodes:
        return 0
    initializers = {t.name: t for t in graph.initializer}
    sparse = {t.values.name: t for t in graph.sparse_initializer}
    inputs = {v.name: v for v in graph.input}
    outputs = {v.name: v for v in graph.output}
    value_info = {v.name: v for v in graph.value_info}
    position: dict[str, int] = {}
    last_read: dict[str, int] = {}
    reads: list[list[str]] = []
    made: list[list[str]] = []
    for i, node in enumerate(nodes):
        names = _reads(node)
        for name in names:
            if name in position:
                last_read[name] = i
            elif name not in initializers and name not in sparse and name not in inputs:
                logger.debug("output check: %r is read before it is produced; loading the graph whole", name)
                return 0
        reads.append(names)
        made.append(outs := [name for name in node.output if name])
        for name in outs:
            position[name] = i
    for name in outputs:
        if name not in position and name not in inputs and name not in initializers:
            return 0
    cuts = list(range(0, count, part_nodes))
    if count - cuts[-1] < part_nodes // 2:
        cuts.pop()  # a short last run joins the one before it
    cuts.append(count)
    reported: dict[str, onnx.ValueInfoProto] = {}
    read_anywhere = {name for names in reads for name in names}
    for k in range(len(cuts) - 1):
        start, end = cuts[k], cuts[k + 1]
        part = onnx.ModelProto()
        part.ir_version = proto.ir_version
        part.opset_import.extend(proto.opset_import)
        part.functions.extend(proto.functions)
        g = part.graph
        g.name = f"{graph.name or 'graph'}_part{k}"
        g.node.extend(nodes[start:end])
        seen: set[str] = set()
        for i in range(start, end):
            for name in reads[i]:
                if name in seen or start <= position.get(name, -1) < end:
                    continue
                seen.add(name)
                if name in initializers:
                    g.initializer.append(initializers[name])
                    if name in inputs:
                        g.input.append(inputs[name])
                elif name in sparse:
                    g.sparse_initializer.append(sparse[name])
                elif name in inputs:
                    g.input.append(inputs[name])
                else:
                    g.input.append(reported[name])
        if k == 0:  # what no node reads (unused initializers and inputs), and graph outputs no node makes
            for name, t in initializers.items():
                if name not in read_anywhere:
                    g.initializer.append(t)
                    if name in inputs:
                        g.input.append(inputs[name])
            for name, t in sparse.items():
                if name not in read_anywhere:
                    g.sparse_initializer.append(t)
            for name, info in inputs.items():
                if name not in read_anywhere and name not in initializers:
                    g.input.append(info)
            for name, info in outputs.items():
                if name not in position:  # an input or an initializer, declared above (read or not)
                    if name in read_anywhere and name not in seen:
                        if name in initializers:
                            g.initializer.append(initializers[name])
                        if name in inputs:
                            g.input.append(inputs[name])
                    g.output.append(info)
        later: list[str] = []
        for i in range(start, end):
            for name in made[i]:
                if name in value_info:
                    g.value_info.append(value_info[name])
                crosses = last_read.get(name, -1) >= end
                if name in outputs:
                    g.output.append(outputs[name])
                elif crosses:
                    g.output.append(onnx.ValueInfoProto(name=name))
                if crosses:
                    later.append(name)
        session = load(part)
        if later:
            args = {arg.name: arg for arg in session.get_outputs()}
            for name in later:
                arg = args[name]
                info = _declared(name, arg.type, arg.shape, _is_scalar(value_info.get(name) or outputs.get(name)))
                if info is None:
                    declared = outputs.get(name) or value_info.get(name)
                    if declared is None or not declared.type.ListFields():
                        logger.debug("output check: %r crosses a cut as %s; loading the graph whole", name, arg.type)
                        return 0
                    info = declared
                reported[name] = info
        del session, part
    return len(cuts) - 1
