"""Per-layer sensitivity analysis: keep the fewest layers in higher precision that meets an accuracy budget.

Given a budget on the model outputs (``cosine>=0.995``: the smallest per-sample cosine similarity between
the quantized and the float outputs; ``max-abs<=X``: the largest absolute difference), measured on the
first calibration samples:

1. every candidate layer is quantized *alone* and the budget metric measured — its sensitivity;
2. layers are ranked from most to least sensitive, and a binary search finds the smallest ``k`` such that
   quantizing everything except the ``k`` most sensitive layers meets the budget (the metric is close to
   monotone in ``k``; the final choice is measured, never assumed).

Each evaluation builds a quantized copy from the untouched float model and runs it with ONNX Runtime, its
optimizations off, so the measurement sees exactly the Q/DQ graph the pass will write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mograph.passes.quant._qdq import QdqWriter, Scheme, find_candidates
from mograph.passes.quant.calibration import Feed, run_model
from mograph.passes.quant.plan import Budget

__all__ = ["SensitivityResult", "analyse"]

logger = logging.getLogger(__name__)


@dataclass
class SensitivityResult:
    alone: dict[str, float] = field(default_factory=dict)  # metric with only this layer quantized
    keep: list[str] = field(default_factory=list)  # layers kept in higher precision
    final: float = float("nan")  # metric of the chosen mix
    met: bool = False
    evaluations: int = 0


def _metric(budget: Budget, refs: list[list[np.ndarray]], outs: list[list[np.ndarray]]) -> float:
    values = []
    for ref, out in zip(refs, outs):
        r = np.concatenate([np.asarray(a, np.float64).ravel() for a in ref if np.issubdtype(a.dtype, np.floating)])
        o = np.concatenate([np.asarray(a, np.float64).ravel() for a in out if np.issubdtype(a.dtype, np.floating)])
        if budget.metric == "cosine":
            values.append(float(r @ o / (np.linalg.norm(r) * np.linalg.norm(o) + 1e-30)))
        else:
            values.append(float(np.abs(r - o).max()))
    return min(values) if budget.metric == "cosine" else max(values)


def analyse(
    model: ir.Model,
    keys: Iterable[str],
    ranges: dict[str, tuple[float, float]],
    scheme: Scheme,
    samples: list[Feed],
    budget: Budget,
    *,
    fixed: Iterable[str] = (),
    progress: Callable[[int, int | None], None] | None = None,
) -> SensitivityResult:
    """Choose which of ``keys`` to keep in float so the budget holds; ``fixed`` are quantized regardless."""
    keys = list(keys)
    fixed = set(fixed)
    base = ir.serde.serialize_model(model)
    refs = list(run_model(base.SerializeToString(), samples))
    result = SensitivityResult()

    def evaluate(quantized: set[str]) -> float:
        m = ir.serde.deserialize_model(base)
        cands, _ = find_candidates(m)
        writer = QdqWriter(m, scheme, ranges)
        for c in cands:
            if c.key in quantized:
                writer.quantize(c)
        outs = list(run_model(ir.serde.serialize_model(m).SerializeToString(), samples))
        result.evaluations += 1
        return _metric(budget, refs, outs)

    total = len(keys)
    for i, key in enumerate(keys):
        result.alone[key] = evaluate({key} | fixed)
        if progress is not None:
            progress(i + 1, total)
        logger.info("sensitivity %d/%d: %s %s=%.6f", i + 1, total, key, budget.metric, result.alone[key])

    worst_first = sorted(keys, key=lambda k: result.alone[k], reverse=budget.metric != "cosine")
    cache: dict[int, float] = {}

    def with_k(k: int) -> float:
        if k not in cache:
            cache[k] = evaluate(set(worst_first[k:]) | fixed)
            logger.info("sensitivity: keeping %d layer(s) in float gives %s=%.6f", k, budget.metric, cache[k])
        return cache[k]

    lo, hi = 0, len(worst_first)
    if budget.met(with_k(0)):
        hi = 0
    else:
        while lo + 1 < hi:  # invariant: with_k(lo) fails, with_k(hi) meets (k = n quantizes nothing extra)
            mid = (lo + hi) // 2
            if budget.met(with_k(mid)):
                hi = mid
            else:
                lo = mid
    result.keep = worst_first[:hi]
    result.final = with_k(hi)
    result.met = budget.met(result.final)
    return result
