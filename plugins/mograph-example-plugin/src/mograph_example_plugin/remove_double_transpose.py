"""Remove ``Transpose`` pairs that cancel, and merge pairs that do not into one ``Transpose``.

``Transpose(perm=p)`` makes output axis ``k`` out of input axis ``p[k]``.  Two in a row,
``Transpose(Transpose(x, p1), p2)``, therefore make output axis ``k`` out of axis ``p1[p2[k]]`` of
``x``: the pair is one transpose with the composed permutation ``c[k] = p1[p2[k]]``.

* ``c`` is the identity (``p2`` undoes ``p1``, e.g. NCHW -> NHWC -> NCHW around a layout-agnostic op
  that a previous rewrite removed): both nodes go and the readers of the pair read ``x``.
* otherwise the pair becomes one ``Transpose(x, perm=c)`` — one data movement instead of two.

Exporters and layout conversions leave such pairs behind; they cost a full copy of the tensor each.

A ``Transpose`` without ``perm`` reverses the axes; its rank is taken from the other node of the pair
(two of them always cancel, whatever the rank).

The rewrite is exact (it moves elements, never computes), for every dtype.  It leaves alone, and
reports as a near miss:

* a non-cancelling pair whose first ``Transpose`` has other readers (merging would remove nothing);
* a cancelling pair whose output is a graph output while ``x`` cannot take its name (``x`` is a graph
  input, an initializer, another graph output, or comes from an outer graph): the graph's interface
  never changes.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

import mograph

__all__ = ["RemoveDoubleTransposePass"]


def _yes_no(text: str) -> bool:
    """Parse a yes/no option value given on the command line."""
    value = text.strip().lower()
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    raise ValueError("expected yes or no")


def _is_transpose(node: ir.Node | None) -> bool:
    return node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx")


def _perm(node: ir.Node) -> list[int] | None:
    """The node's ``perm`` attribute; ``None`` for the default (reversed axes, rank-dependent)."""
    attr = node.attributes.get("perm")
    return None if attr is None else list(attr.as_ints())


def _perms(first: ir.Node, second: ir.Node) -> tuple[list[int], list[int]]:
    """Both permutations, a missing one sized by the other (two missing ones reverse twice: identity)."""
    p1, p2 = _perm(first), _perm(second)
    if p1 is None and p2 is None:
        return [0], [0]
    if p1 is None:
        p1 = list(reversed(range(len(p2 or []))))
    if p2 is None:
        p2 = list(reversed(range(len(p1))))
    return p1, p2


class RemoveDoubleTransposePass(mograph.Pass):
    """Remove back-to-back Transposes that cancel; merge the others into one Transpose."""

    name = "remove-double-transpose"
    family = "cleanup"
    options = (
        mograph.Option(
            "transpose-merge",
            _yes_no,
            True,
            "also merge Transpose pairs that do not cancel into a single Transpose (yes/no)",
            metavar="YES|NO",
        ),
    )

    def call(self, model: ir.Model) -> mograph.PassResult:
        merge = bool(self.config["transpose_merge"])
        cancelled = merged = 0
        near_misses: list[dict[str, Any]] = []

        def miss(node: ir.Node, reason: str) -> None:
            near_misses.append({"node": node.name or node.op_type, "reason": reason})

        for second in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if second.graph is None or not _is_transpose(second):
                continue  # removed earlier in this loop, or not a Transpose
            mid = second.inputs[0]
            first = None if mid is None else mid.producer()
            if not _is_transpose(first):
                continue
            assert first is not None and mid is not None
            graph = second.graph
            if first.graph is not graph:
                miss(second, "the first Transpose is in an outer graph")
                continue
            p1, p2 = _perms(first, second)
            if sorted(p1) != list(range(len(p1))) or sorted(p2) != sorted(p1):
                miss(second, f"permutations {p1} and {p2} do not compose")
                continue
            src = first.inputs[0]
            out = second.outputs[0]
            composed = [p1[k] for k in p2]
            first_shared = len(mid.uses()) > 1 or mid.is_graph_output()
            if composed == list(range(len(composed))):
                if out.is_graph_output() and not self._can_take_name(src, graph):
                    miss(second, "the pair's output is a graph output and its input cannot be renamed")
                    continue
                self._bypass(graph, second, out, src)
                cancelled += 1
            else:
                if not merge:
                    continue
                if first_shared:
                    miss(second, "the first Transpose has other readers; merging would remove nothing")
                    continue
                node = ir.node("Transpose", inputs=[src], attributes={"perm": composed})
                mograph.stamp(node, self.name, "TransposePair")
                ir.convenience.replace_nodes_and_values(graph, second, [second], [node], [out], node.outputs)
                merged += 1
            if not mid.uses() and not mid.is_graph_output():
                graph.remove(first, safe=True)

        details = {"near_misses": near_misses} if near_misses else {}
        stats = {"cancelled_pairs": cancelled, "merged_pairs": merged}
        return mograph.PassResult(modified=bool(cancelled or merged), stats=stats, details=details)

    @staticmethod
    def _can_take_name(src: ir.Value | None, graph: ir.Graph) -> bool:
        if src is None:
            return False
        producer = src.producer()
        return (
            producer is not None
            and producer.graph is graph
            and not src.is_graph_output()
            and not src.is_graph_input()
            and not src.is_initializer()
        )

    @staticmethod
    def _bypass(graph: ir.Graph, second: ir.Node, out: ir.Value, src: ir.Value | None) -> None:
        """Make every reader of ``out`` (graph outputs included) read ``src``; drop ``second``."""
        assert src is not None
        name = out.name
        was_output = out.is_graph_output()
        ir.convenience.replace_all_uses_with(out, src, replace_graph_outputs=True)
        graph.remove(second, safe=True)
        if was_output:
            src.name = name  # the graph's interface keeps its names
