"""``mograph.BlockQuantizedGather``: an embedding lookup whose table is stored block-quantized (4 or 8 bits).

::

    Y[i..., h] = (q[ids[i...], h] - zero_points[ids[i...], h // block_size]) * scales[ids[i...], h // block_size]

Inputs: ``data`` (uint8 ``[rows, blocks, block_size * bits / 8]``: each row's codes block after block, 4-bit
codes two to a byte with the lower ``h`` in the low nibble), ``indices`` (int32/int64, any shape),
``scales`` (``[rows, blocks]``, the output's float dtype) and ``zero_points`` (uint8 ``[rows, blocks]``, one
code each; ``2^(bits-1)`` everywhere for a symmetric table).  Attributes ``K`` (the hidden size), ``bits``
(4 or 8), ``block_size``.  Output ``[*indices.shape, K]``.

The layout is the one :mod:`mograph.passes.quant.weight_only_op` gives a weight ``[K, N]`` (``B``, ``scales``,
``zero_points`` with ``N`` rows): an LM head tied to the embedding table (``logits = x @ E^T``, so its weight's
``N`` columns are the table's rows) and the table can therefore share the same quantized initializers.

The function body gathers the looked-up rows' codes, scales and zero points and dequantizes those rows only
(a reference form in default-domain ops, opset 13 or later; never a float copy of the whole table).

Lowerings (called by the ``lower`` step only):

``ort``
    ``com.microsoft.GatherBlockQuantized`` (``gather_axis=0``, ``quantize_axis=1``, ``bits``, ``block_size``):
    the data as ``[rows, K * bits / 8]`` uint8 (the same bytes; a ``Reshape`` of the shared initializer when an
    LM head reads it too), zero points packed two to a byte for 4 bits and left off when symmetric (the
    kernel's default is ``2^(bits-1)`` for uint8 data).  Run and checked on ONNX Runtime 1.31.1 and 1.32 CPU.
    Declines (the body is inlined) when ``K`` is not a multiple of ``block_size`` (the kernel has no padding).
``onnx`` and ``tensorrt``
    decline: the step inlines the function body.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant.weight_only_op import dequantized_rows

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION, CustomOp, Lowering
from mograph.irutil import add_initializer
from mograph.lowering import LoweringContext, replace_node
from mograph.patterns import constant_array

__all__ = ["OP_NAME", "block_quantized_gather_op", "reference", "function_body", "dequantize_table"]

OP_NAME = "BlockQuantizedGather"
MS_DOMAIN = "com.microsoft"


def _attr(node: ir.Node, name: str, default: int = 0) -> int:
    a = node.attributes.get(name)
    return int(a.as_int()) if a is not None else default


def dequantize_table(data: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, k: int, bits: int) -> np.ndarray:
    """The float32 table ``[rows, K]`` of a node's constant inputs."""
    codes = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(data.shape[0], data.shape[1], -1) if bits == 4 else data
    w = (codes.astype(np.float32) - zero_points.astype(np.float32)[..., None]) * scales.astype(np.float32)[..., None]
    return w.reshape(data.shape[0], -1)[:, :k]


def reference(data: np.ndarray, indices: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, *, K: int,
              bits: int = 4, block_size: int = 128) -> tuple[np.ndarray]:
    """numpy reference: dequantize the gathered rows, result in the scales' dtype."""
    rows = dequantize_table(data[indices.reshape(-1)], scales[indices.reshape(-1)],
                            zero_points[indices.reshape(-1)], K, bits)
    return (rows.reshape(*indices.shape, K).astype(scales.dtype),)


def function_body(opset: int) -> ir.Function:
    """The body in default-domain ops (opset >= 13): ``Gather`` the rows' codes, scales and zero points, then
    dequantize those rows only."""
    nodes: list[ir.Node] = []

    def op(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attrs)
        nodes.append(node)
        return node.outputs[0]

    def ints(*values: int) -> ir.Value:
        return op("Constant", value=ir.tensor(np.array(values, np.int64)))

    data, ids, scales, zp = (ir.Value(name=n) for n in ("data", "indices", "scales", "zero_points"))
    # the looked-up rows first, then dequantize only those: a body that dequantized the whole table (what an
    # ONNX Runtime session runs before the ``ort`` lowering, e.g. the fp16 pass's measuring sessions) made
    # a float32 copy of it, and its integer temporaries, at every run (Gemma 3's 262,144 x 640: 4.7 GB peak)
    flat = op("Reshape", ids, ints(-1))
    rows = dequantized_rows(op, ints, op("Gather", data, flat, axis=0), op("Gather", scales, flat, axis=0),
                            op("Gather", zp, flat, axis=0))
    k = op("Constant", value_int=ir.RefAttr("value_int", "K", ir.AttributeType.INT))
    shape = op("Concat", op("Shape", ids), op("Unsqueeze", k, ints(0)), axis=0)
    y = op("Reshape", op("CastLike", rows, scales) if opset >= 15 else rows, shape)
    graph = ir.Graph([data, ids, scales, zp], [y], nodes=nodes, opset_imports={"": opset})
    attrs = [ir.AttrInt64("K", 0), ir.AttrInt64("bits", 4), ir.AttrInt64("block_size", 128)]
    return ir.Function(DOMAIN, OP_NAME, "", graph=graph, attributes=attrs)


def _infer(node: ir.Node) -> None:
    ids, scales, out = node.inputs[1], node.inputs[2], node.outputs[0]
    if scales is not None and scales.type is not None:
        out.type = scales.type
    k = _attr(node, "K")
    if ids is not None and ids.shape is not None and k:
        out.shape = ir.Shape([*list(ids.shape), k])


def _ort(node: ir.Node, ctx: LoweringContext) -> bool:
    data_v = node.inputs[0]
    arrays = [constant_array(v) if v is not None else None for v in (data_v, node.inputs[2], node.inputs[3])]
    if data_v is None or node.graph is None or any(a is None for a in arrays):
        return False
    data, _scales, zp = arrays  # type: ignore[misc]
    assert data is not None and zp is not None
    bits, k, bs = _attr(node, "bits", 4), _attr(node, "K"), _attr(node, "block_size", 128)
    if k % bs or data.ndim != 3:
        return False
    graph = node.graph
    base = (node.name or "gather").replace("/", "_")
    rows = data.shape[0]
    if all(u.node is node for u in data_v.uses()) and not data_v.is_graph_output():
        flat = add_initializer(graph, f"{base}_data", data.reshape(rows, -1))  # the same bytes, 2-D
        extra: list[ir.Node] = []
    else:  # shared with a tied LM head: one initializer in the file, reshaped here
        shape = add_initializer(graph, f"{base}_data_shape", np.array([rows, -1], np.int64))
        reshape = ir.node("Reshape", [data_v, shape])
        flat = reshape.outputs[0]
        flat.type, flat.shape = ir.TensorType(ir.DataType.UINT8), ir.Shape([rows, k * bits // 8])
        extra = [reshape]
        ctx.count("gather_block.shared_data")
    inputs: list[ir.Value | None] = [flat, node.inputs[1], node.inputs[2]]
    if not np.all(zp == (1 << (bits - 1))):
        if bits == 4:
            if zp.shape[1] % 2:
                zp = np.concatenate([zp, np.zeros((zp.shape[0], 1), np.uint8)], axis=1)
            zp = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
        inputs.append(add_initializer(graph, f"{base}_zero_points_packed", np.ascontiguousarray(zp, np.uint8)))
        ctx.count("gather_block.asymmetric")
    else:
        ctx.count("gather_block.symmetric")
    new = ir.node("GatherBlockQuantized", inputs, domain=MS_DOMAIN,
                  attributes={"bits": bits, "block_size": bs, "gather_axis": 0, "quantize_axis": 1})
    new.outputs[0].type, new.outputs[0].shape = node.outputs[0].type, node.outputs[0].shape
    replace_node(node, [*extra, new], [new.outputs[0]], ctx.target)
    if not extra and not data_v.uses() and data_v.name and data_v.name in graph.initializers:
        graph.initializers.pop(data_v.name)  # replaced by its 2-D form
    return True


LOWERINGS: dict[str, Lowering] = {"ort": _ort}


def block_quantized_gather_op() -> CustomOp:
    """The declaration contributed through ``mograph_add_custom_ops``."""
    return CustomOp(
        name=OP_NAME,
        domain=DOMAIN,
        version=DOMAIN_VERSION,
        doc="Gather from a block-quantized (4/8-bit) table: rows dequantized as (q - zero_points) * scales, "
            "blocks along the hidden axis.",
        inputs=("data", "indices", "scales", "zero_points"),
        outputs=("Y",),
        attributes={"K": 0, "bits": 4, "block_size": 128},
        reference=reference,
        function=function_body,
        infer_shapes=_infer,
        lowerings=dict(LOWERINGS),
        float_generic_opset=15,  # the body's CastLike; below it the body computes float32
    )
