"""Shape inference: give every value the dtype and shape ONNX's inference can derive.

Fusion checks (is the reduction over the last axis?), quantization and pruning need shapes.  This runs
ONNX's shape inference with data propagation through onnx-ir (which keeps large initializers out of
the protobuf it builds, so big models work) and merges the results back.  Declared shapes that the
inference contradicts are replaced by the inferred ones: exporters sometimes declare wrong output
shapes, and inference is derived from the computation itself.

ONNX's inference trusts a declared shape over the one it computes (and propagates a wrong one
downstream), so the shapes declared on outputs of standard operators are set aside while it runs.
Afterwards each declared shape comes back where inference knows less: a dimension inference left
unknown or symbolic keeps its declared size or name, and a value inference could not type at all
(outputs of custom-domain ops are never cleared) keeps its declared shape whole.

Below opset 14 ONNX's inference of a ``Reshape`` to a target computed at run time gives no shape at all (not
even a rank), so nothing after it has one; such a ``Reshape`` gets the dims the shape rules prove and ONNX infers
again from them (:func:`mograph.irutil.run_shape_inference`), as it infers at 14.

Data propagation computes the values of a ``Range`` with constant bounds, whatever its length: a
``Range(0, 5e8, 1)`` costs gigabytes inside ONNX's C++ inference.  When a ``Range`` would produce more
than :data:`DATA_PROP_RANGE_LIMIT` elements (or its step is zero), inference runs without data
propagation.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import onnx_ir as ir

from mograph._traverse import iter_nodes
from mograph.irutil import remember_inference, run_shape_inference
from mograph.pass_infra import Pass, PassResult

__all__ = ["InferShapesPass"]

logger = logging.getLogger(__name__)


def _typed_values(model: ir.Model) -> dict[int, tuple[object, object]]:
    out: dict[int, tuple[object, object]] = {}
    for node in iter_nodes(model.graph):
        for v in node.outputs:
            out[id(v)] = (v.type, None if v.shape is None else tuple(v.shape))
    for v in model.graph.outputs:
        out[id(v)] = (v.type, None if v.shape is None else tuple(v.shape))
    return out


#: Longest ``Range`` with constant bounds that data propagation may compute.
DATA_PROP_RANGE_LIMIT = 1 << 20


def _long_range(model: ir.Model) -> bool:
    """Whether a ``Range`` with constant scalar bounds would be longer than the limit (or endless)."""
    for node in iter_nodes(model.graph):
        if node.op_type != "Range" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
            continue
        bounds = []
        for value in node.inputs:
            tensor = None if value is None else value.const_value
            if tensor is None or tensor.size != 1:
                break
            bounds.append(float(np.asarray(tensor.numpy()).reshape(-1)[0]))
        else:
            start, limit, delta = bounds
            if delta == 0 or not all(map(math.isfinite, bounds)):
                return True
            if math.ceil((limit - start) / delta) > DATA_PROP_RANGE_LIMIT:
                return True
    return False


def _has_schema(node: ir.Node) -> bool:
    return onnx.defs.has(node.op_type, node.domain if node.domain != "ai.onnx" else "")


def _merge(declared: ir.Shape, inferred: ir.Shape) -> tuple[ir.Shape, bool]:
    """The inferred shape, with declared dims where inference is vaguer; and whether they contradict."""
    if declared.rank() != inferred.rank():
        return inferred, True
    dims: list[int | ir.SymbolicDim] = []
    contradicts = False
    for d, i in zip(declared, inferred):
        if isinstance(i, int):
            contradicts |= isinstance(d, int) and d != i
            dims.append(i)
        else:
            dims.append(d)  # declared size or name beats an unknown or invented symbol
    return ir.Shape(dims), contradicts


class InferShapesPass(Pass):
    """Infer dtypes and shapes of every value (ONNX shape inference with data propagation)."""

    name = "infer-shapes"
    family = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        before = _typed_values(model)
        declared: list[tuple[ir.Value, ir.Shape]] = []
        for node in iter_nodes(model.graph):
            if _has_schema(node):
                for v in node.outputs:
                    if v.shape is not None:
                        declared.append((v, v.shape))
                        v.shape = None
        data_prop = not _long_range(model)
        if not data_prop:
            logger.info("a Range is longer than %d elements: shape inference runs without data propagation", DATA_PROP_RANGE_LIMIT)
        completed = False
        try:
            run_shape_inference(model, data_prop=data_prop)
            completed = True
        except Exception as exc:  # noqa: BLE001 - as onnx_ir's pass: the model is left as it was
            logger.warning("Shape inference failed: %s. Model is left unchanged", exc)
        finally:
            corrected = 0
            # Whether the types are a fixed point of the inference: each value read by a node has the type the
            # inference gave it (a value nothing reads may keep its declared dims: its producer's inference merges
            # into them unchanged, and no other node's inference reads it).
            as_inferred = True
            for v, shape in declared:
                if v.shape is None:
                    v.shape = shape
                    as_inferred = as_inferred and not v.uses()
                    continue
                merged, contradicts = _merge(shape, v.shape)
                as_inferred = as_inferred and (merged == v.shape or not v.uses())
                v.shape = merged
                if contradicts:
                    corrected += 1
                    logger.info("value %s: declared shape %s contradicts the inferred %s", v.name, shape, v.shape)
        if completed and data_prop and as_inferred:
            # A whole-model inference's result as it left it: the first fusion pass's inference may confirm it by
            # inferring only what the passes between changed (:func:`mograph.irutil.infer_types`).
            remember_inference(model)
        after = _typed_values(model)
        changed = sum(1 for k, v in after.items() if before.get(k) != v)
        known = sum(1 for t, s in after.values() if t is not None and s is not None)
        return PassResult(
            modified=changed > 0,
            stats={"values_changed": changed, "values_with_shape": known, "declared_shapes_corrected": corrected},
        )
