"""Semi-structured 2:4 sparsity: in every group of four consecutive weights along the reduction axis,
zero the two of smallest magnitude.

NVIDIA sparse tensor cores (Ampere and later) run a GEMM twice as fast when each group of four
consecutive elements along K holds at most two non-zeros.  This pass writes that pattern into the
weights by magnitude; the graph is unchanged (a runtime that knows the pattern, such as TensorRT with
sparse weights enabled, picks the sparse kernels).  Accuracy usually needs fine-tuning afterwards.

Which weights, and which axis groups them:

- ``MatMul`` with a constant 2-D ``B [K, N]``: groups run along ``K`` (axis 0) for every column;
- ``Gemm`` with a constant ``B``: along ``K`` (axis 0, or axis 1 with ``transB=1``);
- ``Conv`` (group 1) with a constant ``W [O, I, kh, kw]``: along the input channels ``I`` for every
  output channel and kernel position (the layout sparse convolution kernels use).

A weight qualifies when its reduction size is a multiple of 4 and it is floating point; others are
left alone and listed with the reason.  Ties keep the earlier element.  The report gives, per layer,
the weights that qualify and how many were actually zeroed (already-zero weights are not counted), so
a second run masks nothing and reports ``modified=False``.  ``details["output_check"]`` gives the masked
model's smallest output cosine against the original on seeded random feeds: reported, never judged (a
healthy 2:4 model reads far below the precision passes' floor before fine-tuning).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.prune._deps import const_tensor
from mograph.passes.prune.structured import EXCLUDE_OPTION, FIGURE_OPTION, start_figure

from mograph.pass_infra import Pass, PassResult

__all__ = ["Sparsity2to4Pass", "mask_2to4"]

logger = logging.getLogger(__name__)


def mask_2to4(arr: np.ndarray, axis: int) -> np.ndarray:
    """Boolean keep-mask of ``arr``: in each run of 4 along ``axis``, the 2 largest magnitudes."""
    moved = np.moveaxis(arr, axis, -1)
    groups = np.abs(moved.astype(np.float64)).reshape(*moved.shape[:-1], moved.shape[-1] // 4, 4)
    # Stable sort on -|w|: the two largest, the earlier one first among equals.
    order = np.argsort(-groups, axis=-1, kind="stable")
    keep = np.zeros(groups.shape, dtype=bool)
    np.put_along_axis(keep, order[..., :2], True, axis=-1)
    return np.moveaxis(keep.reshape(moved.shape), -1, axis)


def _reduction_axis(node: ir.Node, w: ir.TensorProtocol) -> int | str:
    rank = len(w.shape)
    if node.op_type == "MatMul":
        return 0 if rank == 2 else "weight is not 2-D"
    if node.op_type == "Gemm":
        trans_b = node.attributes.get("transB")
        return 1 if trans_b is not None and trans_b.value else 0
    group = node.attributes.get("group")
    if group is not None and group.value != 1:
        return f"grouped convolution (group={group.value})"
    return 1 if rank >= 3 else "weight rank below 3"


class Sparsity2to4Pass(Pass):
    """Zero the 2 smallest of every 4 consecutive MatMul/Gemm/Conv weights along the reduction axis (the
    output's cosine against the original is reported)."""

    name = "sparsity-2to4"
    family = "prune"
    options = (EXCLUDE_OPTION, FIGURE_OPTION)

    def call(self, model: ir.Model) -> PassResult:
        patterns: list[str] = self.config["exclude"] or []
        layers: list[dict[str, Any]] = []
        skipped: list[dict[str, str]] = []
        done: set[int] = set()
        qualify_total = masked_total = 0
        figure: Any = None
        started = False
        for node in model.graph:
            if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm", "Conv"):
                continue
            value = node.inputs[1] if len(node.inputs) > 1 else None
            tensor = const_tensor(value) if value is not None else None
            if value is None or tensor is None:
                continue
            label = {"node": node.name or node.op_type, "weight": value.name or ""}
            if any(fnmatch.fnmatchcase(n, p) for n in label.values() for p in patterns):
                skipped.append({**label, "reason": "excluded"})
                continue
            if id(value) in done:
                continue
            axis = _reduction_axis(node, tensor)
            if isinstance(axis, str):
                skipped.append({**label, "reason": axis})
                continue
            if not tensor.dtype.is_floating_point():
                skipped.append({**label, "reason": f"{tensor.dtype} weight"})
                continue
            k = int(tensor.shape[axis])
            if k % 4:
                skipped.append({**label, "reason": f"reduction size {k} is not a multiple of 4"})
                continue
            done.add(id(value))
            arr = tensor.numpy()
            keep = mask_2to4(arr, axis)
            masked = int(np.count_nonzero(arr[~keep]))
            qualify_total += arr.size
            masked_total += masked
            layers.append({**label, "qualifying": int(arr.size), "masked": masked})
            if masked and not started:  # the original's side of the output figure, before the first change
                figure, started = start_figure(self, model), True
            if masked:
                new = np.where(keep, arr, np.zeros((), dtype=arr.dtype)).astype(arr.dtype)
                _replace(value, new)
        stats: dict[str, int | float] = {
            "layers": len(layers),
            "layers_skipped": len(skipped),
            "weights_qualifying": qualify_total,
            "weights_masked": masked_total,
        }
        details: dict[str, Any] = {"layers": layers}
        if skipped:
            details["skipped"] = skipped
        if figure is not None:
            figure.finish(model, stats, details)
        logger.info("sparsity-2to4: %d weights masked in %d layers", masked_total, len(layers))
        return PassResult(modified=masked_total > 0, stats=stats, details=details)


def _replace(value: ir.Value, arr: np.ndarray) -> None:
    tensor = ir.Tensor(np.ascontiguousarray(arr), name=value.name)
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant":
        producer.attributes["value"] = ir.AttrTensor("value", tensor)
        if value.type is None:
            value.type = ir.TensorType(tensor.dtype)
    else:
        value.const_value = tensor
