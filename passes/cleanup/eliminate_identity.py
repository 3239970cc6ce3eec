"""Identity elimination: bypass ``Identity`` nodes.

Exporters emit ``Identity`` to rename values or to expose a weight twice.  Each one costs a copy in
some runtimes and breaks pattern matching, so every reader is rewired to the Identity's input.  An
Identity whose output is a graph output keeps the output's name (the graph's interface never
changes): it is removed only where the renaming can be moved onto the producer safely — the input is
made by a node of the same graph and is not itself a graph output, a graph input or an initializer.
(onnx-ir's own identity pass also renames an input that is already a graph output, which merges two
outputs into one name, so this pass carries its own rule.)
"""

from __future__ import annotations

import onnx_ir as ir

from mograph._traverse import iter_nodes
from mograph.pass_infra import Pass, PassResult

__all__ = ["EliminateIdentityPass"]


def _renamable(value: ir.Value, graph: object) -> bool:
    """Whether ``value`` may take a graph output's name."""
    producer = value.producer()
    return producer is not None and producer.graph is graph and not value.is_graph_output()


def _merged_shape(a: ir.Shape | None, b: ir.Shape | None) -> ir.Shape | None:
    """``a`` completed by ``b``: known sizes win over symbols, a named symbol over an unknown one."""
    if a is None or b is None or a.rank() != b.rank():
        return a if a is not None else b
    dims = []
    for x, y in zip(a, b):
        if isinstance(x, int) or (not isinstance(y, int) and x.value is not None):
            dims.append(x)
        else:
            dims.append(y)
    return ir.Shape(dims)


def _eliminate(node: ir.Node) -> bool:
    if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.inputs) != 1 or len(node.outputs) != 1 or node.inputs[0] is None:
        return False
    x, y = node.inputs[0], node.outputs[0]
    graph = node.graph
    is_output = y.is_graph_output()
    if is_output and not _renamable(x, graph):
        return False
    x.shape = _merged_shape(x.shape, y.shape)
    if x.type is None:
        x.type = y.type
    ir.convenience.replace_all_uses_with(y, x, replace_graph_outputs=True)
    if is_output:
        x.name = y.name
    assert graph is not None
    graph.remove(node, safe=True)
    return True


class EliminateIdentityPass(Pass):
    """Remove Identity nodes, rewiring their readers to the Identity's input."""

    name = "eliminate-identity"
    family = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        removed = 0
        graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
        for graph in graphs:
            for node in list(iter_nodes(graph)):
                removed += _eliminate(node)
        return PassResult(modified=removed > 0, stats={"removed_identities": removed})
