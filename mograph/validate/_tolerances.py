"""Tolerances: when an output counts as unchanged, by output dtype and by pass family.

Passes that must be exact up to rounding (``cleanup``, ``shape``, ``fusion``) get tight element-wise
bounds (:data:`TIGHT`), tighter for float32 than for float16/bfloat16, exact for integers; passes that
change the numbers by design (``quant``, ``prune``) are judged by cosine similarity.  Part of
:mod:`mograph.validate`, which re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

__all__ = ["Tolerance", "TIGHT", "FAMILY_TOLERANCES", "dtype_class", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """When an output counts as unchanged.

    Attributes:
        atol, rtol: element-wise bound (an element passes when ``|a-b| <= atol`` or
            ``|a-b| <= rtol*|ref|``); ``None`` for both: not checked element-wise.
        min_cosine: minimum cosine similarity of the flattened outputs; ``None``: not checked.
        max_mismatch: largest fraction of elements allowed to differ at all (integer and boolean
            outputs of lossy passes); ``None``: not checked.
    """

    atol: float | None = None
    rtol: float | None = None
    min_cosine: float | None = None
    max_mismatch: float | None = None

    def loosest(self, other: Tolerance) -> Tolerance:
        """The bound that accepts whatever either accepts (per criterion)."""
        elementwise = self.atol is not None and other.atol is not None
        return Tolerance(
            atol=max(self.atol, other.atol) if elementwise else None,  # type: ignore[type-var]
            rtol=max(self.rtol or 0.0, other.rtol or 0.0) if elementwise else None,
            min_cosine=_pick(min, self.min_cosine, other.min_cosine),
            max_mismatch=_pick(max, self.max_mismatch, other.max_mismatch),
        )

    def describe(self) -> str:
        parts = []
        if self.atol is not None:
            parts.append(f"atol {_bound(self.atol)}, rtol {_bound(self.rtol or 0)}")
        if self.min_cosine is not None:
            parts.append(f"cosine >= {_bound(self.min_cosine)}")
        if self.max_mismatch is not None:
            parts.append(f"<= {self.max_mismatch:.0%} of elements differ")
        return "; ".join(parts) or "not checked"


def _pick(fn: Any, a: float | None, b: float | None) -> float | None:
    vals = [v for v in (a, b) if v is not None]
    return fn(vals) if vals else None


#: Exact up to rounding: cleanup, shape and fusion passes.
TIGHT: dict[str, Tolerance] = {
    "float64": Tolerance(atol=1e-6, rtol=1e-5, min_cosine=0.99999),
    "float32": Tolerance(atol=1e-4, rtol=1e-3, min_cosine=0.9999),
    "float16": Tolerance(atol=1e-2, rtol=1e-2, min_cosine=0.999),
    "bfloat16": Tolerance(atol=5e-2, rtol=5e-2, min_cosine=0.995),
    "float8": Tolerance(atol=0.25, rtol=0.125, min_cosine=0.98),
    "int": Tolerance(atol=0.0, rtol=0.0),
    "bool": Tolerance(atol=0.0, rtol=0.0),
}


def _lossy(min_cosine: float, max_mismatch: float) -> dict[str, Tolerance]:
    floats = {k: Tolerance(min_cosine=min_cosine) for k in ("float64", "float32", "float16", "bfloat16", "float8")}
    return {**floats, "int": Tolerance(max_mismatch=max_mismatch), "bool": Tolerance(max_mismatch=max_mismatch)}


#: Tolerances by pass family, then by output dtype class (see :func:`dtype_class`).  A family not
#: listed here (a plugin's own) gets :data:`TIGHT`.
FAMILY_TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "cleanup": TIGHT,
    "shape": TIGHT,
    "fusion": TIGHT,
    "quant": _lossy(min_cosine=0.99, max_mismatch=0.01),
    "prune": _lossy(min_cosine=0.95, max_mismatch=0.05),
}


def dtype_class(dtype: Any) -> str:
    """``float64``/``float32``/``float16``/``bfloat16``/``float8``/``int``/``bool``, or ``other``."""
    dt = np.dtype(dtype)
    if dt.name in ("float64", "float32", "float16", "bfloat16"):
        return dt.name
    if dt.name.startswith("float8"):
        return "float8"
    if dt.kind in "iu":
        return "int"
    if dt.kind == "b":
        return "bool"
    return "other"


def _families(family: str | Iterable[str] | None) -> list[str]:
    if family is None:
        return []
    if isinstance(family, str):
        return [family]
    return sorted(set(family))


def tolerance_for(
    dtype: Any,
    family: str | Iterable[str] | None = None,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    min_cosine: float | None = None,
) -> Tolerance:
    """The tolerance for an output of ``dtype`` after passes of ``family`` (loosest of several).

    ``atol``/``rtol``/``min_cosine`` override the table for floating outputs; giving one of
    ``atol``/``rtol`` to a family judged by cosine alone adds an element-wise check with the other
    bound at 0 (only the given one counts).
    """
    cls = dtype_class(dtype)
    if cls == "other":  # strings and the like: exact
        return Tolerance(atol=0.0, rtol=0.0)
    tables = [FAMILY_TOLERANCES.get(f, TIGHT) for f in _families(family)] or [TIGHT]
    picked = [table.get(cls, table.get("float32", TIGHT["float32"])) for table in tables]
    tol = picked[0]
    for other in picked[1:]:
        tol = tol.loosest(other)
    if cls not in ("int", "bool"):
        if atol is not None or rtol is not None:
            new_atol = atol if atol is not None else (tol.atol if tol.atol is not None else 0.0)
            new_rtol = rtol if rtol is not None else (tol.rtol if tol.rtol is not None else 0.0)
            tol = replace(tol, atol=new_atol, rtol=new_rtol)
        if min_cosine is not None:
            tol = replace(tol, min_cosine=min_cosine)
    return tol


def _bound(x: float) -> str:
    """A threshold at its own precision (``0.9999999``, not ``1``)."""
    if float(x).is_integer() and abs(x) < 1e6:
        return str(int(x))
    return repr(float(x)) if 1e-4 <= abs(x) < 1e6 else f"{x:.12g}"
