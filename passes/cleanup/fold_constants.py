"""Constant folding: evaluate nodes whose inputs are all constant and store the result.

Exporters leave many computations on constants — shape arithmetic (``Shape → Gather → Concat``
once shapes are known), transposed or reshaped weights, ``Cast`` of literals.  Folding them makes the
graph smaller and unblocks pattern matching.  The evaluation is onnxscript's constant folder (it runs
the reference ONNX evaluator on small inputs); this pass bounds the tensor sizes it will fold so a
model never balloons: a folded output larger than ``--fold-limit`` elements is left as computation.

One exception comes from the folder itself: a ``Transpose`` of a constant that nothing else reads is
folded whatever its size, since the result replaces its input and the model does not grow.  That
exception never applies to external data: a node reading an external-data tensor larger than the
limit is never folded, because evaluating it would pull the tensor into memory (a model above 2 GB
must be optimizable with memory far below its size).

The folder checks the size of a result only once it has computed it, and small inputs can ask for
a huge result: ``ConstantOfShape([100000, 100000])``, an ``Expand`` or ``Tile`` to a large shape, a
``Range`` with a tiny step, ``[N, 1] + [1, M]``.  So before a node is evaluated, its output shape is
inferred from its constant inputs (ONNX shape inference with their values, ignoring any shape the
model declares for the output, which may lie); a node whose result would exceed the limit and be
larger than its largest input is not evaluated, nor is one whose result size cannot be inferred,
unless its op never makes a result larger than its inputs.

Before it tries to fold a node, the folder infers the node's output types with ONNX (one call per node of the
graph, with the node, its input types and its small constant inputs serialized each time).  A stack of identical
layers asks the same question thousands of times, so :class:`_Folder` remembers each answer by what the call
sends (op, opset, attributes, input types and shapes, small constant inputs) and applies it as the folder does.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import onnx
import onnx_ir as ir
from mograph.passes.cleanup._util import op_histogram, removed_by_op
from onnxscript.optimizer import _constant_folding as cf

from mograph.irutil import constants_as_tensors
from mograph.pass_infra import Option, Pass, PassResult, graph_fingerprint

__all__ = ["FoldConstantsPass"]

#: Ops whose result never has more elements than their largest input (checked without inference).
_NEVER_GROW = frozenset(
    "Abs Acos Acosh Asin Asinh Atan Atanh Cast CastLike Ceil Cos Cosh Erf Exp Floor Identity IsInf IsNaN Log "
    "Neg Not Reciprocal Relu Round Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Tan Tanh Reshape Flatten "
    "Squeeze Unsqueeze Transpose Shape Size ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceL1 "
    "ReduceL2 ReduceLogSum ReduceLogSumExp ReduceSumSquare ArgMax ArgMin Slice Softmax LogSoftmax "
    "Clip Dropout".split()
)

#: Constant inputs handed to shape inference as values (shape vectors, repeats, scalars) up to this size.
_INFERENCE_DATA_LIMIT = 4096


def _result_elements(node: ir.Node, opset: int) -> int | None:
    """Elements of the node's largest output, inferred from its constant inputs; None if unknown."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        types: dict[str, onnx.TypeProto] = {}
        data: dict[str, onnx.TensorProto] = {}
        for value in node.inputs:
            if value is None or value.const_value is None:
                continue
            tensor = value.const_value
            types[value.name or ""] = onnx.helper.make_tensor_type_proto(tensor.dtype.value, list(tensor.shape.numpy()))
            if tensor.size <= _INFERENCE_DATA_LIMIT and not isinstance(tensor, ir.ExternalTensor):
                data[value.name or ""] = ir.serde.serialize_tensor(tensor)
        inferred = onnx.shape_inference.infer_node_outputs(schema, ir.serde.serialize_node(node), types, data)
    except Exception:  # noqa: BLE001 - no schema, or inference refused the node: size unknown
        return None
    sizes = []
    for value in node.outputs:
        type_proto = inferred.get(value.name or "")
        if type_proto is None or not type_proto.tensor_type.HasField("shape"):
            return None
        dims = type_proto.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            return None
        sizes.append(math.prod(d.dim_value for d in dims))
    return max(sizes, default=0)


#: What :meth:`_Folder._inferred` remembers for a node whose inference failed (the folder then leaves it as it is).
_FAILED = object()
#: The folder sends a constant input's data to the node's inference up to this many elements (its own bound).
_FOLDER_DATA_LIMIT = 20
#: How a remembered answer writes the i-th named dim of the node it was computed for (``<prefix>i``): no name a
#: model has starts with it (a node whose dims do is not remembered).
_PLACEHOLDER = "\x00mograph-dim:"


def _attribute_key(node: ir.Node) -> tuple | None:
    """The node's attributes as a hashable key (name, type, value), or ``None`` for one the key does not cover
    (a tensor, a graph, a type, a reference): such a node's inference is not remembered."""
    out: list[tuple] = []
    for name, attr in node.attributes.items():
        if attr.is_ref():
            return None
        kind, value = attr.type, attr.value
        if kind in (ir.AttributeType.INT, ir.AttributeType.STRING):
            out.append((name, kind, value))
        elif kind == ir.AttributeType.FLOAT:
            out.append((name, kind, repr(float(value))))  # repr: -0.0 and 0.0 differ, as the sent bytes do
        elif kind in (ir.AttributeType.INTS, ir.AttributeType.STRINGS):
            out.append((name, kind, tuple(value)))
        elif kind == ir.AttributeType.FLOATS:
            out.append((name, kind, tuple(repr(float(v)) for v in value)))
        else:
            return None
    return tuple(out)


class _Folder(cf.FoldConstantsPass):
    """onnxscript's folder, its per-node ONNX inference remembered by what it sends (see the module docstring).

    The answer depends only on the op (domain, type, the model's opset for it), the attributes, each input's type
    and shape, the data of the constant inputs the folder sends (up to :data:`_FOLDER_DATA_LIMIT` elements), and
    which inputs are the same value; node and value names only label the inputs and outputs.  The answer is
    applied to the node's outputs as the folder applies it (its shape merged into the output's, its type set);
    a node the key does not cover (other types, denotations, tensor or graph attributes, unnamed or repeated
    names) goes to the folder's own inference.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._inferred: dict[tuple, Any] = {}

    def _do_inference(self, node: ir.Node) -> None:
        keyed = self._key(node)
        if keyed is None:
            super()._do_inference(node)
            return
        if keyed is False:
            return  # an input without a type: the folder infers nothing
        key, names = keyed
        answer = self._inferred.get(key)
        if answer is None:
            answer = self._infer(node, names)
            if answer is not _FAILED and answer[1]:  # named dims ONNX made up: not shared (see :meth:`_infer`)
                self._apply(node, answer[0], None)
                return
            self._inferred[key] = answer
        if answer is not _FAILED:
            self._apply(node, answer[0], names)

    @staticmethod
    def _apply(node: ir.Node, answer: tuple, names: list[str] | None) -> None:
        """Set the node's outputs' types and shapes from ``answer`` as the folder does; with ``names``, the
        answer's placeholders of named dims are this node's names first."""
        try:
            for output, type_proto in zip(node.outputs, answer):
                if type_proto is None:
                    continue
                if names is not None and type_proto.HasField("tensor_type"):
                    dims = type_proto.tensor_type.shape.dim
                    if any(d.dim_param.startswith(_PLACEHOLDER) for d in dims):
                        own = onnx.TypeProto()
                        own.CopyFrom(type_proto)
                        for d in own.tensor_type.shape.dim:
                            if d.dim_param.startswith(_PLACEHOLDER):
                                d.dim_param = names[int(d.dim_param[len(_PLACEHOLDER):])]
                        type_proto = own  # type: ignore[assignment]
                shape = ir.serde.deserialize_type_proto_for_shape(type_proto)
                output.shape = cf._merge_shapes(output.shape, shape)
                output.type = ir.serde.deserialize_type_proto_for_type(type_proto)
        except Exception:  # noqa: BLE001 - as the folder: an output it cannot merge ends the node's update
            return

    def _key(self, node: ir.Node) -> tuple[tuple, list[str]] | None | Literal[False]:
        """What the node's inference depends on, its named dims numbered by first appearance (the answer depends
        only on which dims share a name), and those names in that order; ``None`` where it is not covered,
        ``False`` where an input has no type (the folder then skips the node)."""
        if node.domain not in self._opset_imports:
            return None
        attrs = _attribute_key(node)
        if attrs is None:
            return None
        names: dict[str, ir.Value] = {}
        symbols: dict[str, int] = {}
        inputs: list[Any] = []
        untyped = False
        for value in node.inputs:
            if value is None:
                inputs.append(None)
                continue
            name = value.name
            if not name:
                return None
            seen = names.get(name)
            if seen is not None:
                if seen is not value:
                    return None  # two values of one name: the folder's dict keeps the last
                inputs.append(("again", list(names).index(name)))  # the same value again
                continue
            names[name] = value
            type_ = value.type
            if type_ is None:
                untyped = True
                continue
            if type(type_) is not ir.TensorType or type_.denotation:
                return None
            shape_key: tuple | None = None
            shape = value.shape
            if shape is not None:
                dims: list[Any] = []
                for i, dim in enumerate(shape):
                    if shape.get_denotation(i):
                        return None
                    if isinstance(dim, int):
                        dims.append(dim)
                        continue
                    symbol = dim.value
                    if symbol is None:
                        dims.append(("s", None))
                        continue
                    if symbol.startswith(_PLACEHOLDER):
                        return None
                    dims.append(("s", symbols.setdefault(symbol, len(symbols))))
                shape_key = tuple(dims)
            data = None
            tensor = value.const_value
            if tensor is not None and tensor.size <= _FOLDER_DATA_LIMIT:
                if tensor.dtype == ir.DataType.STRING:
                    return None
                try:
                    array = np.asarray(tensor.numpy())
                except Exception:  # noqa: BLE001 - (external data missing): the folder's own path decides
                    return None
                data = (tensor.dtype.value, tuple(tensor.shape.numpy()), array.tobytes())
            inputs.append((type_.dtype.value, shape_key, data))
        if untyped:
            return False
        outputs = [v.name for v in node.outputs]
        if not all(outputs) or len(set(outputs)) != len(outputs) or any(n in names for n in outputs):
            return None
        key = (node.domain, node.op_type, self._opset_imports[node.domain], attrs, tuple(inputs), len(outputs))
        return key, list(symbols)

    def _infer(self, node: ir.Node, symbols: list[str]) -> Any:
        """ONNX's inference of the node's outputs from what the folder would send, or :data:`_FAILED`:
        ``(answer, made_up)``, per output position its ``TypeProto`` (``None`` where it gives none); a named dim of
        the inputs (``symbols``) is written as its placeholder; ``made_up``: a named dim that is none of
        ``symbols`` appears (the answer then holds this node's names as they are)."""
        types: dict[str, onnx.TypeProto] = {}
        data: dict[str, onnx.TensorProto] = {}
        for value in node.inputs:
            if value is None or value.name in types:
                continue
            type_proto = ir.serde.serialize_type(value.type)  # type: ignore[arg-type]
            if value.shape is not None:
                ir.serde.serialize_shape_into(type_proto, value.shape)
            types[value.name] = type_proto  # type: ignore[index]
            tensor = value.const_value
            if tensor is not None and tensor.size <= _FOLDER_DATA_LIMIT:
                data[value.name] = ir.serde.serialize_tensor(tensor)  # type: ignore[index]
        try:
            schema = onnx.defs.get_schema(node.op_type, self._opset_imports[node.domain], node.domain)
            inferred = onnx.shape_inference.infer_node_outputs(schema, ir.serde.serialize_node(node), types, data)
        except Exception:  # noqa: BLE001 - no schema, or inference refused the node
            return _FAILED
        answer = tuple(inferred.get(v.name) for v in node.outputs)  # type: ignore[arg-type]
        index = {name: i for i, name in enumerate(symbols)}
        for inferred_type in answer:  # first whether every named dim is one of the inputs', then the placeholders
            if inferred_type is None:
                continue
            if inferred_type.WhichOneof("value") != "tensor_type":
                if "dim_param" in str(inferred_type):
                    return answer, True
                continue
            if any(d.dim_param and d.dim_param not in index for d in inferred_type.tensor_type.shape.dim):
                return answer, True
        for inferred_type in answer:
            if inferred_type is not None and inferred_type.WhichOneof("value") == "tensor_type":
                for d in inferred_type.tensor_type.shape.dim:
                    if d.dim_param:
                        d.dim_param = f"{_PLACEHOLDER}{index[d.dim_param]}"
        return answer, False


class FoldConstantsPass(Pass):
    """Fold nodes whose inputs are all constants into initializers (bounded by --fold-limit)."""

    name = "fold-constants"
    family = "cleanup"
    options = (
        Option(
            "fold-limit",
            int,
            1 << 20,
            "largest folded output, in elements; bigger results stay as computation",
            metavar="ELEMENTS",
        ),
    )

    def call(self, model: ir.Model) -> PassResult:
        limit = int(self.config["fold_limit"])
        if limit < 0:
            from mograph.errors import OptionError

            raise OptionError(f"{self.name}: --fold-limit must be >= 0, not {limit}")
        opsets = model.opset_imports

        def keep_external_lazy(node: ir.Node) -> bool | None:
            largest_input = 0
            for value in node.inputs:
                tensor = None if value is None else value.const_value
                if isinstance(tensor, ir.ExternalTensor) and tensor.size > limit:
                    return False  # never read a large external tensor into memory
                if tensor is not None:
                    largest_input = max(largest_input, tensor.size)
            if node.domain in ("", "ai.onnx") and node.op_type in _NEVER_GROW:
                return None
            result = _result_elements(node, opsets.get(node.domain, opsets.get("", 1)))
            if result is None or (result > limit and result > largest_input):
                return False  # never evaluate what could be (or is) a huge result
            return None  # the folder's own rules (size limits) decide

        before = op_histogram(model)
        fingerprint = graph_fingerprint(model)
        declared = [None if v.shape is None else list(v.shape.dims) for v in model.graph.outputs]
        result = _Folder(
            shape_inference=True,
            input_size_limit=max(limit, 1),
            output_size_limit=limit,
            should_fold=keep_external_lazy,
        )(model)
        legal = constants_as_tensors(model)  # the folder's Constant(value_ints=...) is opset 12
        kept = _keep_dynamic_output_dims(model, declared)
        after = op_histogram(model)
        removed = removed_by_op(before, after)
        stats: dict[str, int | float] = {"folded_nodes": sum(removed.values())}
        stats.update({f"removed.{op}": n for op, n in removed.items()})
        if legal:
            stats["constants_as_tensors"] = legal
        if kept:
            stats["dynamic_output_dims_kept"] = kept
        # The folder also types the values it visits, but does not always count that as a change.
        modified = bool(result.modified) or graph_fingerprint(model) != fingerprint
        return PassResult(modified=modified, stats=stats)


def _keep_dynamic_output_dims(model: ir.Model, declared: list[list | None]) -> int:
    """Put back the graph outputs' dynamic dims that the folder's per-node inference made static; return how many.

    The folder merges each node's inferred shape into its outputs, preferring a number: an exporter's wrong static
    declaration upstream (hummingbird declares an intermediate output ``[4, 3]``, its calibration batch, under a
    dynamic input) then turned a declared-dynamic output into ``[4]``, a model that declares one batch and runs
    another.  A dim the model names with a symbol of its inputs (the batch) is the input's size, never a number:
    cleanup keeps it.  An exporter's placeholder for an unknown dim (torch's ``Transposevariable_dim_1``) is
    narrowed as before.
    """
    input_syms = {
        d.value for v in model.graph.inputs if v.shape is not None for d in v.shape.dims
        if not isinstance(d, int) and d.value is not None
    }
    kept = 0
    for value, dims in zip(model.graph.outputs, declared):
        if dims is None or value.shape is None or len(value.shape) != len(dims):
            continue
        now = list(value.shape.dims)
        changed = False
        for axis, (old, new) in enumerate(zip(dims, now)):
            if not isinstance(old, int) and old.value in input_syms and isinstance(new, int):
                now[axis] = old
                changed = True
                kept += 1
        if changed:
            value.shape = ir.Shape(now)
    return kept
