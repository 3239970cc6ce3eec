"""Parameter and multiply-accumulate counts, for the before/after figures of the pruning report.

Parameters are the elements of every floating-point constant of the main graph (initializers and
``Constant`` nodes).  Multiply-accumulates are those of ``MatMul``, ``Gemm`` and ``Conv`` nodes, from
the output shape and the reduction size; a symbolic or unknown dimension (batch, sequence) counts as 1,
so for a transformer the figure is per token of a one-token sequence for the projections (attention
score products scale with the sequence length and are reported at length 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import onnx_ir as ir
from mograph.passes.prune._deps import ShapeInfo, const_tensor

__all__ = ["count_params", "node_macs", "total_macs", "param_count"]

_FLOAT = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


def param_count(value: ir.Value) -> int:
    """Elements of a floating-point constant value (0 for anything else)."""
    tensor = const_tensor(value)
    if tensor is None or tensor.dtype not in _FLOAT:
        return 0
    return int(math.prod(int(d) for d in tensor.shape))


def count_params(model: ir.Model) -> int:
    """Elements of all floating-point constants of the main graph."""
    total = sum(param_count(v) for v in model.graph.initializers.values())
    for node in model.graph:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            total += param_count(node.outputs[0])
    return total


def _numel(dims: list | None) -> int | None:
    if dims is None:
        return None
    return int(np.prod([d if isinstance(d, int) else 1 for d in dims], dtype=np.int64))


def node_macs(node: ir.Node, shapes: ShapeInfo) -> int:
    """Multiply-accumulates of one MatMul/Gemm/Conv node (0 for other ops or unknown shapes)."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm", "Conv"):
        return 0
    out = _numel(shapes.dims(node.outputs[0]))
    a = shapes.dims(node.inputs[0])
    b = shapes.dims(node.inputs[1])
    if out is None or a is None or b is None:
        return 0
    if node.op_type == "MatMul":
        k = a[-1] if len(a) >= 1 else None
    elif node.op_type == "Gemm":
        trans_a = node.attributes.get("transA")
        k = a[0] if trans_a is not None and trans_a.value else a[-1]
    else:
        k = math.prod(d if isinstance(d, int) else 1 for d in b[1:]) if len(b) > 1 else None
    return out * k if isinstance(k, int) else 0


def total_macs(nodes: Iterable[ir.Node], shapes: ShapeInfo) -> int:
    return sum(node_macs(n, shapes) for n in nodes)
