"""Can ONNX Runtime's CUDA provider capture this graph as a CUDA graph?  A static answer, from op types and dtypes.

ONNX Runtime refuses ``enable_cuda_graph`` when a node runs on a provider other than CUDA/CPU or when the
partitioned graph holds a ``Memcpy`` node ("all compute graph nodes have not been partitioned to the
CUDAExecutionProvider").  CPU nodes are allowed as long as no copy between host and device is needed: ORT puts
shape subgraphs on the CPU itself.  This module predicts that partitioning the way ORT's CUDA provider does it,
approximately:

1. ``Shape`` and ``Size`` run on the CUDA provider but write their output to **host** memory.
2. A node all of whose tensor inputs are in host memory (constants count as either) and whose outputs are integer
   or bool tensors goes to the CPU (ORT's "CPU preferred" shape-subgraph heuristic); its outputs are in host memory.
3. Some inputs of CUDA kernels are read from host memory (``Reshape``'s shape, ``Slice``'s starts/ends/axes/steps,
   ``Expand``/``Tile``/``ConstantOfShape``/``Range``/``Unsqueeze``/``Squeeze``/``Reduce*`` axes,
   ``GroupQueryAttention``'s ``total_sequence_length``, ...): a host value there needs no copy.
4. A host value feeding any other input of a CUDA node, or a device value (a graph input, bound on the device,
   or a CUDA node's output) feeding a CPU node, needs a ``Memcpy``: that node **blocks** capture.
5. Ops with no CUDA kernel for their dtype (a short list, :data:`NO_CUDA_KERNEL`), and control flow (``If``,
   ``Loop``, ``Scan``: the condition / trip count is read on the host) block capture too.

It is a heuristic: it does not know every kernel's registration, ORT's graph optimizations (off or on) can
change the graph, and capture also needs the caller to keep every input shape and address fixed between
replays (``--kv-cache shared`` makes a decode step's shapes static).  The answer names the first blocking nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from mograph.foreign_ops import BUILTIN_FOREIGN_OPS

__all__ = ["CaptureReport", "HOST_INPUTS", "NO_CUDA_KERNEL", "cuda_graph_check"]

#: (domain, op) -> indices of inputs the CUDA kernel reads from host memory
HOST_INPUTS: dict[tuple[str, str], frozenset[int]] = {
    ("", "Reshape"): frozenset({1}),
    ("", "Expand"): frozenset({1}),
    ("", "Tile"): frozenset({1}),
    ("", "ConstantOfShape"): frozenset({0}),
    ("", "Range"): frozenset({0, 1, 2}),
    ("", "CumSum"): frozenset({1}),
    ("", "Slice"): frozenset({1, 2, 3, 4}),
    ("", "Unsqueeze"): frozenset({1}),
    ("", "Squeeze"): frozenset({1}),
    ("", "Split"): frozenset({1}),
    ("", "TopK"): frozenset({1}),
    ("", "OneHot"): frozenset({1}),
    ("", "Pad"): frozenset({1, 2, 3}),
    ("", "Resize"): frozenset({1, 2, 3}),
    ("", "Upsample"): frozenset({1}),
    **{("", op): frozenset({1}) for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                                           "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                                           "ReduceSumSquare")},
    # the foreign ops' records say which of their inputs their kernels read on the host
    **{op.key: frozenset(op.host_inputs) for op in BUILTIN_FOREIGN_OPS if op.host_inputs},
}

#: ops whose output ONNX Runtime's CUDA kernels write to host memory
HOST_OUTPUT_OPS = {("", "Shape"), ("", "Size")}

#: ops ONNX Runtime's CUDA provider has no kernel for (a short list of the ones met in exported models)
NO_CUDA_KERNEL = {("", op) for op in ("Unique", "StringNormalizer", "TfIdfVectorizer", "RegexFullMatch",
                                      "StringConcat", "StringSplit", "Det", "NonMaxSuppression", "Col2Im",
                                      "CenterCropPad", "DFT", "STFT", "Bernoulli", "Multinomial", "RandomNormal",
                                      "RandomUniform", "RandomNormalLike", "RandomUniformLike")}

CONTROL_FLOW = {("", "If"), ("", "Loop"), ("", "Scan")}

_SMALL = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL, ir.DataType.INT8, ir.DataType.UINT8,
          ir.DataType.INT16}


@dataclass
class CaptureReport:
    """The answer: ``capturable``, and for each blocking node its name, op and why."""

    capturable: bool
    blockers: list[dict[str, str]] = field(default_factory=list)
    cpu_nodes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"capturable": self.capturable, "blockers": self.blockers, "cpu_shape_nodes": self.cpu_nodes}


def _domain(node: ir.Node) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _dtype(value: ir.Value, node: ir.Node, known: dict[int, ir.DataType | None]) -> ir.DataType | None:
    """``value``'s element type; where it is not recorded: a Cast's ``to``, Shape/Size's int64, else the type its
    inputs share (the shape ops: Gather, Concat, Squeeze, Add, ...); ConstantOfShape's fill value's type."""
    if value.dtype is not None:
        return value.dtype
    if node.op_type == "Cast" and "to" in node.attributes:
        return ir.DataType(int(node.attributes["to"].value))
    if node.op_type in ("Shape", "Size"):
        return ir.DataType.INT64
    if node.op_type == "ConstantOfShape":  # its ``value``'s type (float32 without one), not its shape input's
        fill = node.attributes.get("value")
        return getattr(fill.value, "dtype", None) if fill is not None else ir.DataType.FLOAT
    if node.op_type in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or"):
        return ir.DataType.BOOL
    types = {v.dtype if v.dtype is not None else known.get(id(v)) for v in node.inputs[:1] if v is not None}
    return types.pop() if len(types) == 1 else None


def cuda_graph_check(model: ir.Model, limit: int = 10) -> CaptureReport:
    """Predict ONNX Runtime CUDA placement of ``model``'s main graph (see the module docstring)."""
    graph = model.graph
    constant: set[int] = {id(v) for v in graph.initializers.values()}
    host: set[int] = set()  # values in host memory
    cpu_nodes = 0
    blockers: list[dict[str, str]] = []
    dtypes: dict[int, ir.DataType | None] = {}

    def block(node: ir.Node, why: str) -> None:
        if len(blockers) < limit:
            blockers.append({"node": node.name or "", "op": node.op_type, "reason": why})

    for node in graph:  # topological order
        key = (_domain(node), node.op_type)
        if key == ("", "Constant"):
            constant.update(id(o) for o in node.outputs)
            tensor = node.attributes.get("value")  # an untyped Constant (made by a rewrite) still has its dtype
            if tensor is not None and node.outputs[0].dtype is None:
                dtypes[id(node.outputs[0])] = getattr(tensor.value, "dtype", None)
            continue
        inputs = [v for v in node.inputs if v is not None]
        if key in CONTROL_FLOW:
            block(node, "control flow: its condition / trip count is read on the host")
            continue
        if key in NO_CUDA_KERNEL:
            block(node, "no CUDA kernel: runs on the CPU between device tensors (Memcpy)")
            continue
        live = [v for v in inputs if id(v) not in constant]
        outs_small = all(_dtype(o, node, dtypes) in _SMALL for o in node.outputs)
        for o in node.outputs:
            dtypes[id(o)] = _dtype(o, node, dtypes)
        on_cpu = key not in HOST_OUTPUT_OPS and bool(live) and all(id(v) in host for v in live) and outs_small
        if on_cpu:
            cpu_nodes += 1
            host.update(id(o) for o in node.outputs)
            continue
        if key in HOST_OUTPUT_OPS:
            host.update(id(o) for o in node.outputs)
            continue
        host_slots = HOST_INPUTS.get(key, frozenset())
        for i, v in enumerate(node.inputs):
            if v is not None and id(v) in host and i not in host_slots:
                block(node, f"input {i} ('{v.name}') is computed on the host (a shape subgraph): Memcpy to the device")
                break
    # a host value that is a graph output is copied back to the caller's device buffer
    for out in graph.outputs:
        if id(out) in host:
            producer = out.producer()
            if producer is not None and len(blockers) < limit:
                blockers.append({"node": producer.name or "", "op": producer.op_type,
                                 "reason": f"graph output '{out.name}' is computed on the host"})
    return CaptureReport(capturable=not blockers, blockers=blockers, cpu_nodes=cpu_nodes)
