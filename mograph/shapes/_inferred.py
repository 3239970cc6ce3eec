"""Concrete shapes from a full shape inference, and the constant entries of shape vectors.

The symbolic side of the shape facility is :class:`~mograph.shapes.ShapeQuery`; this module is its
numeric side, for passes that need sizes as numbers (how many channels a weight has, how many entries a
reshape target holds) and where each constant entry of a shape vector is stored, so it can be edited:

- :class:`InferredShapes`: dims of every value from shape inference on a serialized copy;
- :func:`const_tensor` / :func:`int_vector`: constant tensors, seen through ``Constant`` and ``Identity``;
- :func:`shape_literals`: a reshape target entry by entry, with the constant that holds each entry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Union

import onnx_ir as ir

if TYPE_CHECKING:
    import onnx

__all__ = ["DimSize", "InferredShapes", "ShapeLiteral", "const_tensor", "int_vector", "owns_tensor", "shape_literals"]

logger = logging.getLogger(__name__)

#: A concrete dim: a number, a ``dim_param`` name, or ``None`` (unknown).
DimSize = Union[int, str, None]


def const_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """The tensor of an initializer, of a ``Constant`` node's ``value`` attribute, or of an ``Identity``
    of either (exporters deduplicate equal weights and hand the copies out through Identity nodes)."""
    if value.const_value is not None and (value.is_initializer() or value.producer() is None):
        return value.const_value
    node = value.producer()
    if node is not None and node.domain in ("", "ai.onnx"):
        if node.op_type == "Constant":
            attr = node.attributes.get("value")
            if attr is not None and isinstance(attr.value, ir.TensorProtocol):
                return attr.value
        if node.op_type == "Identity" and node.inputs and node.inputs[0] is not None:
            return const_tensor(node.inputs[0])
    return None


def owns_tensor(value: ir.Value) -> bool:
    """Whether the constant's tensor is stored on ``value`` itself (not behind an Identity)."""
    node = value.producer()
    return node is None or node.op_type == "Constant"


def _symbolic_inference(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """ONNX Runtime's symbolic shape inference, when installed: it follows run-time shape arithmetic
    (an attention mask built by ``Expand`` keeps its broadcast 1 on the head axis) where ONNX's own
    inference gives up."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:
        return None
    try:
        return SymbolicShapeInference.infer_shapes(proto, auto_merge=True, guess_output_rank=False)
    except Exception as exc:  # noqa: BLE001 - fall back to ONNX's inference
        logger.info("symbolic shape inference failed (%s)", exc)
        return None


class InferredShapes:
    """Concrete shapes of the values of one graph: inferred on a serialized copy, then the values' own shapes.

    Where :class:`~mograph.shapes.ShapeQuery` reasons symbolically about one graph's shape computation,
    this asks a full shape inference for numbers: ONNX Runtime's symbolic inference when onnxruntime is
    installed (it follows run-time shape arithmetic), else ONNX's own with data propagation.  A dim is an
    int, a ``dim_param`` name, or ``None``.  The model is never mutated; inference is a help, not a
    requirement (a failure is logged and the values' own shapes are used).
    """

    def __init__(self, model: ir.Model) -> None:
        self._by_name: dict[str, list[DimSize]] = {}
        try:
            import onnx

            from mograph import _spill

            # Shapes need no weights: above the protobuf limit they are left out (types and shapes kept).
            proto = _spill.shape_proto(model) if _spill.too_big(model) else ir.serde.serialize_model(model)
            inferred = _symbolic_inference(proto) or onnx.shape_inference.infer_shapes(proto, data_prop=True)
            for vi in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]:
                tt = vi.type.tensor_type
                if not tt.HasField("shape"):
                    continue
                dims: list[DimSize] = []
                for d in tt.shape.dim:
                    if d.HasField("dim_value"):
                        dims.append(d.dim_value)
                    elif d.HasField("dim_param"):
                        dims.append(d.dim_param)
                    else:
                        dims.append(None)
                self._by_name[vi.name] = dims
        except Exception as exc:  # noqa: BLE001 - inference is a help, not a requirement
            logger.info("shape inference failed (%s); using the shapes on the values", exc)

    def dims(self, value: ir.Value | None) -> list[DimSize] | None:
        if value is None:
            return None
        tensor = const_tensor(value)
        if tensor is not None:
            return [int(d) for d in tensor.shape.numpy()]
        own = None
        if value.shape is not None:
            own = [d if isinstance(d, int) else (d.value if d.value is not None else None) for d in value.shape]
        inferred = self._by_name.get(value.name or "")
        if own is None:
            return list(inferred) if inferred is not None else None
        if inferred is not None and len(inferred) == len(own):
            return [o if isinstance(o, int) else (i if i is not None else o) for o, i in zip(own, inferred)]
        return own

    def rank(self, value: ir.Value | None) -> int | None:
        dims = self.dims(value)
        return None if dims is None else len(dims)

    def size(self, value: ir.Value, axis: int) -> DimSize:
        dims = self.dims(value)
        return None if dims is None or not 0 <= axis < len(dims) else dims[axis]

    def refine(self, value: ir.Value, dims: list[DimSize]) -> None:
        """Fill unknown sizes of ``value`` with sizes derived by a rule (a Reshape's ``-1``)."""
        known = self.dims(value)
        if known is None or len(known) != len(dims):
            self._by_name[value.name or ""] = list(dims)
            return
        self._by_name[value.name or ""] = [k if isinstance(k, int) else d for k, d in zip(known, dims)]

    def set_size(self, value: ir.Value, axis: int, size: int) -> None:
        """Record a pruned size (used after pruning to recount multiply-accumulates)."""
        dims = self.dims(value)
        if dims is not None and 0 <= axis < len(dims):
            dims[axis] = size
            self._by_name[value.name or ""] = dims


def int_vector(value: ir.Value | None) -> list[int] | None:
    """The values of a constant 1-D (or scalar) integer tensor."""
    if value is None:
        return None
    tensor = const_tensor(value)
    if tensor is None:
        return None
    arr = tensor.numpy()
    if arr.dtype.kind not in "iu" or arr.ndim > 1:
        return None
    return [int(x) for x in arr.reshape(-1)]


#: A literal of a shape vector: its value (None when computed at run time) and where it is stored.
ShapeLiteral = tuple[Union[int, None], Union[ir.Value, None], int, Union[ir.Node, None], int]


def shape_literals(value: ir.Value, shapes: InferredShapes) -> list[ShapeLiteral] | None:
    """A 1-D int64 shape vector element by element: ``(value, holder, index, reader, reader_input)``.

    Handles a constant and a ``Concat`` (axis 0) of constants and run-time parts (``Unsqueeze`` of a
    ``Gather`` of ``Shape`` ...), as exporters write dynamic Reshape targets.
    """
    ints = int_vector(value)
    if ints is not None:
        return [(x, value, i, None, -1) for i, x in enumerate(ints)]
    node = value.producer()
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx"):
        return None
    out: list[ShapeLiteral] = []
    for idx, part in enumerate(node.inputs):
        if part is None:
            return None
        part_ints = int_vector(part)
        if part_ints is not None:
            out.extend((x, part, i, node, idx) for i, x in enumerate(part_ints))
            continue
        dims = shapes.dims(part)
        if dims is None or len(dims) != 1 or not isinstance(dims[0], int):
            return None
        out.extend((None, None, 0, None, -1) for _ in range(dims[0]))
    return out
