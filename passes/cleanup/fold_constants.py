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
"""

from __future__ import annotations

import math

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
        result = cf.FoldConstantsPass(
            shape_inference=True,
            input_size_limit=max(limit, 1),
            output_size_limit=limit,
            should_fold=keep_external_lazy,
        )(model)
        legal = constants_as_tensors(model)  # the folder's Constant(value_ints=...) is opset 12
        after = op_histogram(model)
        removed = removed_by_op(before, after)
        stats: dict[str, int | float] = {"folded_nodes": sum(removed.values())}
        stats.update({f"removed.{op}": n for op, n in removed.items()})
        if legal:
            stats["constants_as_tensors"] = legal
        # The folder also types the values it visits, but does not always count that as a change.
        modified = bool(result.modified) or graph_fingerprint(model) != fingerprint
        return PassResult(modified=modified, stats=stats)
