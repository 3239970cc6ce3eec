"""Comparison of two sets of outputs, output by output, through Polygraphy's comparator.

Part of :mod:`mograph.validate`, which re-exports the public names.  Polygraphy is imported when a
comparison is first made, never at import.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from mograph.errors import BackendUnavailableError
from mograph.validate._tolerances import Tolerance, dtype_class

__all__ = ["compare_outputs"]


def _num(x: Any) -> float | None:
    """A JSON-safe float: ``None`` for NaN/inf."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _polygraphy() -> Any:
    try:
        from polygraphy.comparator import Comparator, RunResults
        from polygraphy.comparator.compare import CosineSimilarityCompareFunc, SimpleCompareFunc
        from polygraphy.comparator.struct import IterationResult
        from polygraphy.logger import G_LOGGER
    except ImportError as exc:
        raise BackendUnavailableError("polygraphy", "polygraphy") from exc
    return Comparator, RunResults, IterationResult, SimpleCompareFunc, CosineSimilarityCompareFunc, G_LOGGER


def _cosine_func(base: type) -> type:
    """Polygraphy's cosine-similarity functor with the metric computed in numpy.

    Same thresholds and result objects; the metric is computed in float64 numpy because
    Polygraphy's array helpers probe for torch (importing it) when handed a Python number.
    """

    class NumpyCosine(base):  # type: ignore[misc, valid-type]
        def _compute_metric(self, out0: Any, out1: Any) -> float:
            a = np.asarray(out0, dtype=np.float64).ravel()
            b = np.asarray(out1, dtype=np.float64).ravel()
            na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
            if na == 0.0 and nb == 0.0:
                return 1.0
            if na == 0.0 or nb == 0.0:
                return 0.0
            value = float(np.dot(a, b) / (na * nb))
            return value if math.isnan(value) else max(-1.0, min(1.0, value))

    return NumpyCosine


@contextlib.contextmanager
def _quiet_polygraphy(G_LOGGER: Any) -> Iterator[None]:
    """Silence Polygraphy's logger, and keep it from importing torch.

    With its default array-swap setting (-1), Polygraphy asks of every output "is this a torch
    tensor?", which imports torch when it is installed (seconds, and hundreds of MB).  A
    non-negative threshold skips that question; this one is high enough never to swap to disk.
    """
    from polygraphy import config

    saved = config.ARRAY_SWAP_THRESHOLD_MB
    config.ARRAY_SWAP_THRESHOLD_MB = 1 << 30
    try:
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL), np.errstate(all="ignore"):
            yield
    finally:
        config.ARRAY_SWAP_THRESHOLD_MB = saved


def _as_comparable(a: np.ndarray) -> np.ndarray:
    cls = dtype_class(a.dtype)
    if cls in ("float16", "bfloat16", "float8"):
        return a.astype(np.float32)
    return a


def compare_outputs(
    reference: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    tolerances: Mapping[str, Tolerance],
) -> dict[str, dict[str, Any]]:
    """Compare ``actual`` with ``reference`` output by output (names must already agree).

    Polygraphy's comparator computes max abs / max rel error with its element-wise verdict, and the
    cosine similarity; this adds NaN-at-the-same-place equality, dtype and shape checks, the
    fraction of differing elements, and a reason for every failure.
    """
    Comparator, RunResults, IterationResult, SimpleCompareFunc, CosineFunc, G_LOGGER = _polygraphy()
    entries: dict[str, dict[str, Any]] = {}
    ref_cmp: dict[str, np.ndarray] = {}
    act_cmp: dict[str, np.ndarray] = {}
    for name, ref in reference.items():
        ref = np.asarray(ref)
        act = np.asarray(actual[name])
        tol = tolerances[name]
        entry: dict[str, Any] = {
            "dtype": str(ref.dtype),
            "shape": list(ref.shape),
            "max_abs": None,
            "max_rel": None,
            "cosine": None,
            "passed": False,
            "atol": tol.atol,
            "rtol": tol.rtol,
            "min_cosine": tol.min_cosine,
            "failures": [],
        }
        entries[name] = entry
        if act.dtype != ref.dtype:
            entry["actual_dtype"] = str(act.dtype)
        if act.shape != ref.shape:
            entry["failures"].append(f"shape {tuple(act.shape)} differs from the original's {tuple(ref.shape)}")
            continue
        rc, ac = dtype_class(ref.dtype), dtype_class(act.dtype)
        if rc == "other" and ac == "other" and ref.dtype.kind in "OUS" and act.dtype.kind in "OUS":
            differ = int(np.count_nonzero(ref != act))  # strings: exact match
            if differ:
                entry["failures"].append(f"{differ} of {ref.size} strings differ")
            continue
        if (rc in ("int", "bool")) != (ac in ("int", "bool")) or "other" in (rc, ac):
            entry["failures"].append(f"dtype {act.dtype} cannot be compared with the original's {ref.dtype}")
            continue
        if ref.size == 0:  # nothing to compare, and nothing the comparator's reductions accept
            entry.update(max_abs=0.0, max_rel=0.0, cosine=1.0)
            continue
        ref_c, act_c = _as_comparable(ref), _as_comparable(act)
        if ref_c.dtype.kind == "f" or act_c.dtype.kind == "f":
            ref_nan, act_nan = np.isnan(ref_c), np.isnan(act_c)
            both = ref_nan & act_nan
            if both.any():  # NaN where the original has NaN too is agreement, not error
                entry["nan_both"] = int(both.sum())
            same_inf = np.isinf(ref_c) & (ref_c == act_c)
            both |= same_inf
            if both.any():
                ref_c, act_c = np.where(both, 0, ref_c), np.where(both, 0, act_c)
            lone = int((ref_nan ^ act_nan).sum())
            if lone:
                entry["nan_mismatches"] = lone
                entry["failures"].append(f"NaN in {lone} element(s) where the other model has a number")
        if tol.max_mismatch is not None:
            frac = float(np.count_nonzero(ref_c != act_c)) / max(ref_c.size, 1)
            entry["mismatch_fraction"] = frac
            entry["max_mismatch"] = tol.max_mismatch
            if frac > tol.max_mismatch:
                entry["failures"].append(f"{frac:.2%} of elements differ (allowed {tol.max_mismatch:.2%})")
        ref_cmp[name], act_cmp[name] = ref_c, act_c

    if ref_cmp:
        # Thresholds as numpy scalars: a Python float would make Polygraphy probe for torch (slow).
        simple = SimpleCompareFunc(
            check_error_stat="elemwise",
            atol={n: np.float64(tolerances[n].atol if tolerances[n].atol is not None else np.inf) for n in ref_cmp},
            rtol={n: np.float64(tolerances[n].rtol if tolerances[n].atol is not None else np.inf) for n in ref_cmp},
        )
        cosine = _cosine_func(CosineFunc)(cosine_similarity_threshold={n: (tolerances[n].min_cosine or -1.0) for n in ref_cmp})
        with _quiet_polygraphy(G_LOGGER):
            runs = RunResults()
            runs.append(("optimized", [IterationResult(act_cmp, runner_name="optimized")]))
            runs.append(("original", [IterationResult(ref_cmp, runner_name="original")]))
            results = Comparator.compare_accuracy(runs, compare_func=[simple, cosine])
        simple_res = _first_iteration(results[0])
        cosine_res = _first_iteration(results[1])
        for name in ref_cmp:
            entry, tol = entries[name], tolerances[name]
            s, c = simple_res.get(name), cosine_res.get(name)
            if s is None or isinstance(s, bool):
                entry["failures"].append("the comparator could not compare this output")
                continue
            entry["max_abs"], entry["max_rel"] = _num(s.max_absdiff), _num(s.max_reldiff)
            if entry["max_abs"] == 0.0:  # identical: 0, not the 0/0 of an output holding zeros (printed "nan")
                entry["max_rel"] = 0.0
            entry["mean_abs"] = _num(s.mean_absdiff)
            cos = None if c is None or isinstance(c, bool) else c.cosine_similarity
            entry["cosine"] = _num(cos)
            exact = dtype_class(reference[name].dtype) in ("int", "bool")
            if tol.atol is not None and not bool(s) and exact:
                differ = int(np.count_nonzero(ref_cmp[name] != act_cmp[name]))
                entry["failures"].append(f"{differ} of {ref_cmp[name].size} elements differ (exact match required)")
            elif tol.atol is not None and not bool(s):
                entry["failures"].append(
                    f"elements beyond both atol {bound_text(tol.atol)} and rtol {bound_text(tol.rtol or 0)} "
                    f"(max abs {_fmt(entry['max_abs'])}, max rel {_fmt(entry['max_rel'])})"
                )
            if tol.min_cosine is not None and not exact:
                floor = tol.atol if tol.atol else 1e-6
                ref_peak = float(np.max(np.abs(ref_cmp[name]))) if ref_cmp[name].size else 0.0
                act_peak = float(np.max(np.abs(act_cmp[name]))) if act_cmp[name].size else 0.0
                signal = ref_peak > floor or act_peak > floor or not (math.isfinite(ref_peak) and math.isfinite(act_peak))
                if signal and (cos is None or not (cos >= tol.min_cosine)):
                    places = max(6, _decimals(tol.min_cosine) + 1)  # the value shown as precisely as the bound
                    shown = "nan" if entry["cosine"] is None else f"{entry['cosine']:.{places}f}"
                    entry["failures"].append(f"cosine {shown} < {bound_text(tol.min_cosine)}")
    for entry in entries.values():
        entry["passed"] = not entry["failures"]
        if entry["passed"]:
            del entry["failures"]
    return entries


def _first_iteration(acc: Any) -> dict[str, Any]:
    for _pair, iterations in acc.items():
        for it in iterations:
            return dict(it.items())
    return {}


def bound_text(x: float) -> str:
    """A threshold as given, at its own precision (``0.9999999``, not ``1``; ``1e-05``)."""
    if float(x).is_integer() and abs(x) < 1e6:
        return str(int(x))
    return repr(float(x)) if 1e-4 <= abs(x) < 1e6 else f"{x:.12g}"


def _decimals(bound: float) -> int:
    """Decimal places of ``bound`` as written (``0.9999999`` -> 7)."""
    text = repr(float(bound))
    return len(text.split(".")[1]) if "." in text and "e" not in text else 6


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "nan"
    return f"{x:.{digits}g}" if digits < 6 else f"{x:.6f}"
