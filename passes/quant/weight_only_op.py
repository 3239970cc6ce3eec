"""``mograph.WeightOnlyMatMul``: a MatMul whose weight is stored block-quantized (4 or 8 bits), and its lowerings.

::

    Y = A @ W,   W[k, n] = (q[k, n] - zero_points[n, k // block_size]) * scales[n, k // block_size]

Inputs: ``A`` (float ``[..., K]``), ``B`` (uint8 ``[N, blocks, block_size * bits / 8]``: the codes of
column ``n``, block after block, 4-bit codes two to a byte with the lower ``k`` in the low nibble — the
layout of ONNX Runtime's ``MatMulNBits``), ``scales`` (``[N, blocks]``, A's dtype) and ``zero_points``
(uint8 ``[N, blocks]``, one code each; ``2^(bits-1)`` everywhere for a symmetric weight).  Attributes
``K``, ``N``, ``bits`` (4 or 8), ``block_size`` (a power of two, 16 or more).  Rows past ``K`` in the
last block are padding.

The function body unpacks the nibbles (``BitShift``, ``Mod``), dequantizes, transposes and multiplies,
in default-domain ops of opset 13 or later, so the canonical op runs anywhere and the file keeps the
packed bytes (4 bits a weight on disk).

Lowerings (called by the ``lower`` step only):

``ort``
    ``com.microsoft.MatMulNBits`` (CPU and CUDA kernels), zero points packed two to a byte for 4 bits
    and left off when symmetric (the kernel's default is ``2^(bits-1)``).
``onnx`` and ``tensorrt``
    at opset >= 21: a constant ``[K, N]`` INT4/UINT4 (INT8/UINT8) weight, a blocked
    ``DequantizeLinear`` (``axis=0``, ``block_size``) and a ``MatMul``; symmetric weights become signed
    codes without zero point (the form TensorRT's weight-only INT4 takes).  TensorRT takes only
    symmetric blocked weights: an asymmetric node stays the canonical op there.  Below opset 21 the
    lowering declines (``--upgrade-opset 21`` or ``auto`` raises the opset for ``--target onnx``) and
    the step inlines the function body.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.custom_ops import DOMAIN, DOMAIN_VERSION, CustomOp, Lowering
from mograph.irutil import add_initializer
from mograph.lowering import LoweringContext, replace_node
from mograph.patterns import constant_array
from mograph.shapes import Dim, Dims, ShapeQuery

__all__ = ["OP_NAME", "BODY_OPSET", "FLOAT_GENERIC_OPSET", "weight_only_matmul_op", "reference", "function_body", "MS_DOMAIN"]

logger = logging.getLogger(__name__)

OP_NAME = "WeightOnlyMatMul"
MS_DOMAIN = "com.microsoft"
#: Opset of the blocked ``DequantizeLinear`` (INT4/UINT4 and ``block_size``).
BLOCKED_DQ_OPSET = 21
#: Lowest default-domain opset of the function bodies (``Unsqueeze`` with its axes as an input); the
#: ``weight-only`` pass raises an older model's opset to it.
BODY_OPSET = 13
#: Lowest opset at which the bodies compute in A's dtype (their ``CastLike``); below it they compute float32,
#: so the pass raises a model with float16 activations to it.
FLOAT_GENERIC_OPSET = 15


def _attr(node: ir.Node, name: str, default: int = 0) -> int:
    a = node.attributes.get(name)
    return int(a.as_int()) if a is not None else default


def dequantize(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, k: int, bits: int,
               block_size: int) -> np.ndarray:
    """The float weight ``[K, N]`` of a node's constant inputs."""
    if bits == 4:
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], b.shape[1], -1)
    else:
        codes = b
    w = (codes.astype(np.float32) - zero_points.astype(np.float32)[..., None]) * scales.astype(np.float32)[..., None]
    return w.reshape(b.shape[0], -1)[:, :k].T


def reference(a: np.ndarray, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, *, K: int, N: int,
              bits: int = 4, block_size: int = 128) -> tuple[np.ndarray]:
    """numpy reference: dequantize, then ``A @ W`` in float32, result in A's dtype."""
    w = dequantize(b, scales, zero_points, K, bits, block_size)
    return ((a.astype(np.float32) @ w).astype(a.dtype),)


def dequantized_rows(op: Any, ints: Any, packed: ir.Value, scales: ir.Value, zp: ir.Value) -> ir.Value:
    """Body nodes, built with ``op``/``ints`` (a function body's node makers), that turn packed blocks
    ``[N, blocks, bytes]`` with their ``scales``/``zero_points`` ``[N, blocks]`` into float rows ``[N, K]``
    (attributes ``bits`` and ``K`` referenced from the function): shared by the weight-only MatMul and the
    block-quantized Gather, which store their tables in one layout."""
    # codes_j = (B >> (bits * j)) mod 2^bits for j < 8 / bits: one body for 4 and 8 bits
    nbits = op("Constant", value_int=ir.RefAttr("value_int", "bits", ir.AttributeType.INT))
    shifts = op("Cast", op("Range", op("Constant", value=ir.tensor(np.array(0, np.int64))),
                           op("Constant", value=ir.tensor(np.array(8, np.int64))), nbits), to=ir.DataType.UINT32)
    modulus = op("BitShift", op("Constant", value=ir.tensor(np.array([1], np.uint32))),
                 op("Cast", nbits, to=ir.DataType.UINT32), direction="LEFT")
    wide = op("Unsqueeze", op("Cast", packed, to=ir.DataType.UINT32), ints(-1))
    codes = op("Reshape", op("Mod", op("BitShift", wide, shifts, direction="RIGHT"), modulus), ints(0, 0, -1))
    centred = op("Sub", op("Cast", codes, to=ir.DataType.FLOAT), op("Unsqueeze", op("Cast", zp, to=ir.DataType.FLOAT), ints(-1)))
    rows = op("Reshape", op("Mul", centred, op("Unsqueeze", op("Cast", scales, to=ir.DataType.FLOAT), ints(-1))), ints(0, -1))
    k = op("Constant", value_int=ir.RefAttr("value_int", "K", ir.AttributeType.INT))
    return op("Slice", rows, ints(0), op("Unsqueeze", k, ints(0)), ints(1))


def function_body(opset: int) -> ir.Function:
    """The body in default-domain ops (opset >= 13)."""
    nodes: list[ir.Node] = []

    def op(op_type: str, *inputs: ir.Value, **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes=attrs)
        nodes.append(node)
        return node.outputs[0]

    def ints(*values: int) -> ir.Value:
        return op("Constant", value=ir.tensor(np.array(values, np.int64)))

    a, b, scales, zp = (ir.Value(name=n) for n in ("A", "B", "scales", "zero_points"))
    w_nk = dequantized_rows(op, ints, b, scales, zp)
    w = op("Transpose", w_nk, perm=[1, 0])
    y = op("MatMul", a, op("CastLike", w, a)) if opset >= FLOAT_GENERIC_OPSET else op("MatMul", a, w)
    graph = ir.Graph([a, b, scales, zp], [y], nodes=nodes, opset_imports={"": opset})
    attrs = [ir.AttrInt64("K", 0), ir.AttrInt64("N", 0), ir.AttrInt64("bits", 4), ir.AttrInt64("block_size", 128)]
    return ir.Function(DOMAIN, OP_NAME, "", graph=graph, attributes=attrs)


def _infer(node: ir.Node) -> None:
    a = node.inputs[0]
    out = node.outputs[0]
    if a is None:
        return
    out.type = a.type
    n = _attr(node, "N")
    if a.shape is not None and n:
        out.shape = ir.Shape([*list(a.shape)[:-1], n])


def _dims(node: ir.Node, q: ShapeQuery) -> list[Dims | None] | None:
    """Y: A's dims with the last replaced by ``N``."""
    a, n = q.dims(node.inputs[0]), _attr(node, "N")
    return None if a is None or not a or not n else [(*a[:-1], Dim.lit(int(n)))]


def _constants(node: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    arrays = [constant_array(v) if v is not None else None for v in node.inputs[1:4]]
    if any(x is None for x in arrays):
        return None
    return arrays[0], arrays[1], arrays[2]  # type: ignore[return-value]


def _ort(node: ir.Node, ctx: LoweringContext) -> bool:
    consts = _constants(node)
    if consts is None or node.graph is None:
        return False
    b, scales, zp = consts
    bits, k, n, bs = _attr(node, "bits", 4), _attr(node, "K"), _attr(node, "N"), _attr(node, "block_size", 128)
    graph = node.graph
    base = (node.name or "wo").replace("/", "_")
    inputs: list[ir.Value | None] = [node.inputs[0], node.inputs[1], node.inputs[2]]
    if not np.all(zp == (1 << (bits - 1))):
        if bits == 4:
            if zp.shape[1] % 2:
                zp = np.concatenate([zp, np.zeros((zp.shape[0], 1), np.uint8)], axis=1)
            packed = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
        else:
            packed = zp.astype(np.uint8)
        inputs.append(add_initializer(graph, f"{base}_zero_points_packed", packed))
        ctx.count("weight_only.asymmetric")
    else:
        ctx.count("weight_only.symmetric")
    new = ir.node("MatMulNBits", inputs, attributes={"K": k, "N": n, "bits": bits, "block_size": bs},
                  domain=MS_DOMAIN)
    new.outputs[0].type, new.outputs[0].shape = node.outputs[0].type, node.outputs[0].shape
    replace_node(node, [new], [new.outputs[0]], ctx.target)
    return True


def _blocked_dq(node: ir.Node, ctx: LoweringContext, symmetric_only: bool) -> bool:
    if ctx.opset < BLOCKED_DQ_OPSET:
        return False
    consts = _constants(node)
    if consts is None or node.graph is None:
        return False
    import ml_dtypes

    b, scales, zp = consts
    bits, k, bs = _attr(node, "bits", 4), _attr(node, "K"), _attr(node, "block_size", 128)
    mid = 1 << (bits - 1)
    symmetric = bool(np.all(zp == mid))
    if symmetric_only and not symmetric:
        logger.info("%s: asymmetric weight-only node kept as %s (TensorRT takes symmetric blocked weights)",
                    node.name, OP_NAME)
        return False
    if bits == 4:
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)[:, :k].T
    else:
        codes = b.reshape(b.shape[0], -1)[:, :k].T
    graph = node.graph
    base = (node.name or "wo").replace("/", "_")
    if symmetric:
        signed = codes.astype(np.int16) - mid
        dtype = ml_dtypes.int4 if bits == 4 else np.int8
        w = ir.Tensor(np.ascontiguousarray(signed.astype(np.int8).astype(dtype)))
        zero = None
    else:
        dtype = ml_dtypes.uint4 if bits == 4 else np.uint8
        w = ir.Tensor(np.ascontiguousarray(codes.astype(np.uint8).astype(dtype)))
        zero = ir.Tensor(np.ascontiguousarray(zp.T.astype(np.uint8).astype(dtype)))
    w_val = _init(graph, f"{base}_w_q{bits}", w)
    s_val = add_initializer(graph, f"{base}_w_scales", np.ascontiguousarray(scales.T))
    dq_inputs = [w_val, s_val] + ([_init(graph, f"{base}_w_zero_points", zero)] if zero is not None else [])
    dq = ir.node("DequantizeLinear", dq_inputs, attributes={"axis": 0, "block_size": bs})
    mm = ir.node("MatMul", [node.inputs[0], dq.outputs[0]])
    mm.outputs[0].type, mm.outputs[0].shape = node.outputs[0].type, node.outputs[0].shape
    replace_node(node, [dq, mm], [mm.outputs[0]], ctx.target)
    return True


def _init(graph: ir.Graph, base: str, tensor: ir.Tensor) -> ir.Value:
    name, i = base, 1
    while name in graph.initializers:
        name, i = f"{base}_{i}", i + 1
    tensor.name = name
    value = ir.Value(name=name, const_value=tensor, type=ir.TensorType(tensor.dtype), shape=tensor.shape)
    graph.register_initializer(value)
    return value


LOWERINGS: dict[str, Lowering] = {
    "ort": _ort,
    "onnx": lambda node, ctx: _blocked_dq(node, ctx, symmetric_only=False),
    "tensorrt": lambda node, ctx: _blocked_dq(node, ctx, symmetric_only=True),
}


def weight_only_matmul_op() -> CustomOp:
    """The declaration contributed through ``mograph_add_custom_ops``."""
    return CustomOp(
        name=OP_NAME,
        domain=DOMAIN,
        version=DOMAIN_VERSION,
        doc="MatMul with a block-quantized (4/8-bit) weight: Y = A @ ((q - zero_points) * scales), blocks along K.",
        inputs=("A", "B", "scales", "zero_points"),
        outputs=("Y",),
        attributes={"K": 0, "N": 0, "bits": 4, "block_size": 128},
        reference=reference,
        function=function_body,
        infer_shapes=_infer,
        shape_dims=_dims,
        lowerings=dict(LOWERINGS),
        onnx_opset=BLOCKED_DQ_OPSET,
        float_generic_opset=FLOAT_GENERIC_OPSET,  # the body's CastLike; below it the body computes float32
    )
