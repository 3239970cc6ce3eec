"""Numeric validation: do two models compute the same numbers?

A pass may only change *how* a model computes, never *what*.  The check that enforces it runs the
original and the rewritten model on the same inputs and compares every output:

* **Runtime.**  ONNX Runtime on CPU with its own graph optimizations **off** (``ORT_DISABLE_ALL``):
  with them on, ONNX Runtime could fuse the original and a wrongly rewritten model into the same
  kernels and hide the difference.
* **Feeds.**  The user's own (an ``.npz`` whose keys are input names), or seeded random ones that
  respect each input's dtype and meaning: an integer input that indexes a ``Gather`` (token ids into
  an embedding table) gets values in ``[0, rows)``, ``*mask*`` inputs get ``{0, 1}`` (mostly 1),
  token-type / segment ids get ``{0, 1}``, floats are uniform in ``[-1, 1)``.  Dynamic dimensions
  take the sizes the user gave (``{"input_ids": (1, 128)}``; a symbolic dim bound by one input is
  reused by every input sharing the symbol) or a default — 1 for a leading (batch) dim, 64 for the
  spatial dims of an image-like input, else 16 — and the check reports what it chose.
* **Metrics.**  Per output, Polygraphy's comparator computes the maximum absolute and relative
  error (element-wise verdict ``|a-b| <= atol or |a-b| <= rtol*|ref|``) and the cosine similarity;
  mograph adds what Polygraphy lacks: tolerances chosen by dtype and by pass family, NaNs at the
  same place counting as equal, the fraction of differing elements for integer outputs, checks that
  the output names and shapes did not change, and one-line explanations.
* **Tolerances** (:data:`FAMILY_TOLERANCES`).  Passes that must be exact up to rounding
  (``cleanup``, ``shape``, ``fusion``) get tight element-wise bounds, tighter for float32 than for
  float16/bfloat16, and exact equality for integers.  Passes that change the numbers by design
  (``quant``, ``prune``) are judged by cosine similarity.  A check covering several families uses
  the loosest bound that applies; ``atol``/``rtol``/``min_cosine`` override the table for floating
  outputs.

A failed check is an error, not a log line: :func:`mograph.api.run_passes` raises
:class:`~mograph.errors.VerificationError` from ``check["passed"]``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph import ir_io
from mograph.errors import BackendUnavailableError, ModelError, UsageError

__all__ = [
    "Tolerance",
    "FAMILY_TOLERANCES",
    "TIGHT",
    "tolerance_for",
    "dtype_class",
    "load_feeds",
    "make_feeds",
    "FEED_LIMIT_BYTES",
    "graph_inputs",
    "Verifier",
    "diff_models",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Tolerances


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
            parts.append(f"atol {self.atol:g}, rtol {self.rtol or 0:g}")
        if self.min_cosine is not None:
            parts.append(f"cosine >= {self.min_cosine:g}")
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


# --------------------------------------------------------------------------------------------------
# Feeds

#: Ops whose output carries their first input's values unchanged (searched through for index uses).
_VALUE_PRESERVING = {"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose", "Tile"}


def load_feeds(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Read user feeds: an ``.npz`` file whose keys are input names, or a dict of arrays."""
    if isinstance(source, Mapping):
        return {str(k): np.asarray(v) for k, v in source.items()}
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise UsageError(f"feeds file {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise UsageError(f"feeds file {path}: expected an .npz archive whose keys are input names")
            return {k: np.asarray(data[k]) for k in data.files}
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - numpy raises several unrelated types on bad files
        raise UsageError(f"feeds file {path}: not a readable .npz archive ({exc})") from exc


def graph_inputs(model: ir.Model) -> list[ir.Value]:
    """The inputs a caller feeds (graph inputs that are not also initializers)."""
    return [v for v in model.graph.inputs if not v.is_initializer()]


def _np_dtype(value: ir.Value) -> np.dtype:
    dtype = value.dtype
    if dtype is None:
        raise UsageError(f"input '{value.name}' has no element type: give its values with --feeds")
    if dtype == ir.DataType.STRING:
        raise UsageError(f"input '{value.name}' is a string tensor: random feeds cannot make one; give --feeds")
    try:
        return np.dtype(dtype.numpy())
    except Exception as exc:  # noqa: BLE001 - dtypes numpy cannot hold
        raise UsageError(f"input '{value.name}' has type {dtype.name}, which random feeds cannot make") from exc


def _static_dim(value: ir.Value, axis: int) -> int | None:
    shape: Any = value.shape
    if shape is None and value.const_value is not None:
        shape = value.const_value.shape
    if shape is None:
        return None
    rank = len(shape)
    if axis < 0:
        axis += rank
    if not 0 <= axis < rank:
        return None
    dim = shape[axis]
    return dim if isinstance(dim, int) else None


def _attr_int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return attr.as_int() if attr is not None else default


def _index_bound(value: ir.Value) -> tuple[int | None, str]:
    """Exclusive upper bound for an integer input used as indices, and why (``None``: no such use)."""
    bound: int | None = None
    why = ""
    seen: set[int] = set()
    frontier = [(value, 0)]
    while frontier:
        val, depth = frontier.pop()
        if id(val) in seen:
            continue
        seen.add(id(val))
        for use in val.uses():
            node, idx = use.node, use.idx
            found: int | None = None
            what = ""
            if node.domain in ("", "ai.onnx"):
                if node.op_type in ("Gather", "GatherElements") and idx == 1 and node.inputs[0] is not None:
                    found = _static_dim(node.inputs[0], _attr_int(node, "axis", 0))
                    if found is not None:
                        what = f"indices of {_node_ref(node)} ({found} entries)"
                elif node.op_type == "OneHot" and idx == 0 and node.inputs[1] is not None:
                    depth_t = node.inputs[1].const_value
                    if depth_t is not None:
                        found = int(np.asarray(depth_t.numpy()).reshape(-1)[0])
                        what = f"indices of {_node_ref(node)} (depth {found})"
                elif node.op_type in _VALUE_PRESERVING and idx == 0 and depth < 4:
                    frontier.extend((out, depth + 1) for out in node.outputs)
            if found is not None and found > 0 and (bound is None or found < bound):
                bound, why = found, what
    return bound, why


def _node_ref(node: ir.Node) -> str:
    return f"{node.op_type} '{node.name}'" if node.name else f"a {node.op_type}"


def _is_mask(name: str) -> bool:
    return "mask" in name.lower()


def _is_segment(name: str) -> bool:
    low = name.lower()
    return "token_type" in low or "segment" in low


def _random_tensor(
    rng: np.random.Generator, value: ir.Value, shape: tuple[int, ...], dtype: np.dtype
) -> tuple[np.ndarray, dict[str, Any]]:
    """One seeded random feed that respects the input's dtype and apparent meaning."""
    name = value.name or ""
    info: dict[str, Any] = {}
    cls = dtype_class(dtype)
    if _is_mask(name) and cls in ("int", "bool", "float32", "float16", "float64", "bfloat16"):
        # Mostly ones, never an all-masked row: a fully masked attention row is NaN in any model.
        mask = rng.random(shape) < 0.85
        if mask.ndim:
            mask[..., 0] = True
        info.update(range=[0, 1], why="mask-like name: values in {0, 1}, mostly 1")
        return mask.astype(dtype), info
    if cls == "bool":
        info.update(range=[0, 1], why="boolean")
        return rng.random(shape) < 0.5, info
    if cls == "int":
        bound, why = _index_bound(value)
        if _is_segment(name):
            hi = min(2, bound) if bound else 2
            info.update(range=[0, hi - 1], why="token-type/segment-like name" + (f"; {why}" if why else ""))
        elif bound is not None:
            hi = bound
            info.update(range=[0, hi - 1], why=why)
        elif dtype.itemsize == 1:
            iinfo = np.iinfo(dtype)
            lo, hi = int(iinfo.min), int(iinfo.max) + 1
            info.update(range=[lo, hi - 1], why="8-bit integer: full range")
            return rng.integers(lo, hi, size=shape).astype(dtype), info
        else:
            hi = 8
            info.update(range=[0, hi - 1], why="integer of unknown use: small non-negative values")
        return rng.integers(0, hi, size=shape).astype(dtype), info
    if cls in ("float64", "float32", "float16", "bfloat16", "float8"):
        info.update(range=[-1.0, 1.0], why="uniform")
        return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32).astype(dtype), info
    raise UsageError(f"input '{name}' has dtype {dtype}, which random feeds cannot make; give --feeds")


def _default_dim(value: ir.Value, axis: int, symbol: str | None, dtype: np.dtype, batch: int) -> int:
    rank = len(value.shape) if value.shape is not None else 0
    if axis == 0 or (symbol and "batch" in symbol.lower()):
        return batch
    if rank == 4 and axis >= 2 and dtype_class(dtype) not in ("int", "bool"):
        return 64  # spatial dims of an image-like NCHW input: room for a few stride-2 stages
    return 16


def _bind(value: ir.Value, shape: tuple[int, ...], bindings: dict[str, int], what: str) -> None:
    """Check ``shape`` against the input's declared dims; bind its symbolic dims."""
    declared = value.shape
    if declared is None:
        return
    if len(declared) != len(shape):
        raise UsageError(
            f"{what} for input '{value.name}' has rank {len(shape)} {tuple(shape)}, "
            f"but the model declares rank {len(declared)} {_shape_str(declared)}"
        )
    for axis, (dim, size) in enumerate(zip(declared, shape)):
        if isinstance(dim, int):
            if dim != size:
                raise UsageError(
                    f"{what} for input '{value.name}' is {tuple(shape)}, but dim {axis} is fixed at {dim} "
                    f"in the model {_shape_str(declared)}"
                )
        elif dim.value is not None:
            if dim.value in bindings and bindings[dim.value] != size:
                raise UsageError(
                    f"{what} for input '{value.name}' sets '{dim.value}' to {size}, but another input "
                    f"already set it to {bindings[dim.value]}"
                )
            bindings[dim.value] = size


def _shape_str(shape: Any) -> str:
    dims = []
    for d in shape:
        dims.append(str(d) if isinstance(d, int) else (d.value or "?"))
    return "[" + ", ".join(dims) + "]"


#: Default bound on the random verification feeds, in bytes (all inputs together).
FEED_LIMIT_BYTES = 1 << 30


def make_feeds(
    model: ir.Model,
    *,
    shapes: Mapping[str, Iterable[int]] | None = None,
    feeds: str | os.PathLike | Mapping[str, Any] | None = None,
    seed: int = 0,
    batch: int = 1,
    limit_bytes: int | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Build the feeds for ``model``'s inputs: the user's, then seeded random ones for the rest.

    ``batch`` is the size given to dynamic leading (batch) dims that neither ``shapes`` nor
    ``feeds`` sized.  ``limit_bytes`` (default :data:`FEED_LIMIT_BYTES`) bounds the random feeds
    together; it is checked before anything is allocated.

    Returns:
        ``(feeds, info)``: arrays by input name, and for the report ``info["inputs"]`` (per input:
        shape, dtype, source ``file``/``random``, value range and why) and ``info["defaulted_dims"]``
        (dynamic dims nobody sized, and the size chosen).

    Raises:
        UsageError: a shape or feed names an unknown input, contradicts a fixed dim, an input
            cannot be made at random (string, unknown rank), or the feeds would pass the limit.
        ModelError: an input declares a negative dimension.
    """
    limit = FEED_LIMIT_BYTES if limit_bytes is None else int(limit_bytes)
    random_bytes = 0
    inputs = graph_inputs(model)
    by_name = {str(v.name): v for v in inputs}
    sizes = {k: tuple(int(d) for d in v) for k, v in (shapes or {}).items()}
    given = load_feeds(feeds) if feeds is not None else {}
    known = ", ".join(by_name) or "none"
    for kind, names in (("shape", list(sizes)), ("feed", list(given))):
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise UsageError(f"{kind} given for unknown input(s) {unknown}; the model's inputs are: {known}")
    bindings: dict[str, int] = {}
    out: dict[str, np.ndarray] = {}
    report: dict[str, Any] = {}
    notes: list[str] = []
    for name, array in given.items():
        value = by_name[name]
        want = _np_dtype(value)
        if array.dtype != want:
            src, dst = dtype_class(array.dtype), dtype_class(want)
            same_kind = (src == dst) or (src not in ("int", "bool", "other") and dst not in ("int", "bool", "other"))
            if not same_kind:
                raise UsageError(f"feed '{name}' has dtype {array.dtype}, but the model's input is {want}")
            notes.append(f"feed '{name}' cast from {array.dtype} to {want}")
            array = array.astype(want)
        _bind(value, tuple(array.shape), bindings, "feed")
        out[name] = array
    for name, shape in sizes.items():
        if name in given:
            if tuple(given[name].shape) != shape:
                raise UsageError(f"input '{name}': --shape {shape} contradicts the feed's shape {given[name].shape}")
            continue
        _bind(by_name[name], shape, bindings, "shape")
    defaulted: dict[str, int] = {}
    rng = np.random.default_rng(seed)
    for value in inputs:
        name = str(value.name)
        dtype = _np_dtype(value)
        if name in out:
            report[name] = {"shape": list(out[name].shape), "dtype": str(out[name].dtype), "source": "file"}
            continue
        if name in sizes:
            dims = list(sizes[name])
        else:
            if value.shape is None:
                raise UsageError(
                    f"input '{name}' has no declared shape: give one with --shape {name}:D1xD2... "
                    "(or shapes={...} in Python)"
                )
            dims = []
            for axis, dim in enumerate(value.shape):
                if isinstance(dim, int):
                    dims.append(dim)
                    continue
                symbol = dim.value
                if symbol is not None and symbol in bindings:
                    dims.append(bindings[symbol])
                    continue
                size = _default_dim(value, axis, symbol, dtype, batch)
                if symbol is not None:
                    bindings[symbol] = size
                    defaulted[symbol] = size
                else:
                    defaulted[f"{name}[{axis}]"] = size
                dims.append(size)
        if any(d < 0 for d in dims):
            raise ModelError(f"input '{name}' declares a negative dimension: {dims}")
        random_bytes += math.prod(dims) * dtype.itemsize
        if random_bytes > limit:
            given_by = "--shape" if name in sizes else "the model's declared shape"
            raise UsageError(
                f"the random verification feed for input '{name}' ({'x'.join(map(str, dims)) or 'scalar'} "
                f"{dtype}, from {given_by}) brings the feeds to {random_bytes:,} bytes, past the limit of "
                f"{limit:,}: give smaller sizes with --shape, or raise --feed-limit"
            )
        array, info = _random_tensor(rng, value, tuple(dims), dtype)
        array = np.asarray(array)  # numpy makes a scalar, not an array, for shape (): ONNX Runtime wants arrays
        out[name] = array
        report[name] = {"shape": list(array.shape), "dtype": str(array.dtype), "source": "random", **info}
    return out, {"inputs": report, "defaulted_dims": defaulted, "notes": notes}


# --------------------------------------------------------------------------------------------------
# Comparison


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
            entry["mean_abs"] = _num(s.mean_absdiff)
            cos = None if c is None or isinstance(c, bool) else c.cosine_similarity
            entry["cosine"] = _num(cos)
            exact = dtype_class(reference[name].dtype) in ("int", "bool")
            if tol.atol is not None and not bool(s) and exact:
                differ = int(np.count_nonzero(ref_cmp[name] != act_cmp[name]))
                entry["failures"].append(f"{differ} of {ref_cmp[name].size} elements differ (exact match required)")
            elif tol.atol is not None and not bool(s):
                entry["failures"].append(
                    f"elements beyond both atol {tol.atol:g} and rtol {tol.rtol or 0:g} "
                    f"(max abs {_fmt(entry['max_abs'])}, max rel {_fmt(entry['max_rel'])})"
                )
            if tol.min_cosine is not None and not exact:
                floor = tol.atol if tol.atol else 1e-6
                ref_peak = float(np.max(np.abs(ref_cmp[name]))) if ref_cmp[name].size else 0.0
                act_peak = float(np.max(np.abs(act_cmp[name]))) if act_cmp[name].size else 0.0
                signal = ref_peak > floor or act_peak > floor or not (math.isfinite(ref_peak) and math.isfinite(act_peak))
                if signal and (cos is None or not (cos >= tol.min_cosine)):
                    entry["failures"].append(f"cosine {_fmt(entry['cosine'], 6)} < {tol.min_cosine:g}")
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


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "nan"
    return f"{x:.{digits}g}" if digits < 6 else f"{x:.6f}"


# --------------------------------------------------------------------------------------------------
# The verifier


def _feeds_brief(info: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {'x'.join(map(str, i['shape'])) or 'scalar'}" for n, i in info.items())


_NP_OF_ORT = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
}


class Verifier:
    """Checks rewritten versions of one model against it, on fixed feeds.

    The feeds and the original's outputs are computed at construction: the model given is usually
    rewritten in place by the passes that follow, so it is run right away.

    Args:
        original: the model as it is now (``onnx_ir.Model``, path, bytes or ``onnx.ModelProto``).
        shapes: sizes of dynamic dims by input name, ``{"input_ids": (1, 128)}``.
        feeds: the user's feeds: ``.npz`` path (keys are input names) or a dict of arrays; inputs
            it lacks get random feeds.
        seed: seed of the random feeds.
        atol, rtol, min_cosine: override the tolerance table for floating outputs.
        threads: ONNX Runtime intra-op threads (default: ONNX Runtime's choice).
        feed_limit: bound on the random feeds in bytes (default :data:`FEED_LIMIT_BYTES`).

    Raises:
        UsageError: bad shapes or feeds, or feeds past ``feed_limit``.
        ModelError: ONNX Runtime cannot load or run the original model.
        BackendUnavailableError: onnxruntime or polygraphy is missing.
    """

    def __init__(
        self,
        original: Any,
        *,
        shapes: Mapping[str, Iterable[int]] | None = None,
        feeds: str | os.PathLike | Mapping[str, Any] | None = None,
        seed: int = 0,
        atol: float | None = None,
        rtol: float | None = None,
        min_cosine: float | None = None,
        threads: int | None = None,
        feed_limit: int | None = None,
    ) -> None:
        from mograph.backends import ort

        _polygraphy()  # fail early, before any pass runs, when polygraphy is missing
        self.seed = int(seed)
        self.atol, self.rtol, self.min_cosine = atol, rtol, min_cosine
        self.threads = threads
        model = original if isinstance(original, ir.Model) else ir_io.load_model(original, check=False)
        self.feeds, self.feed_info = make_feeds(
            model, shapes=shapes, feeds=feeds, seed=self.seed, limit_bytes=feed_limit
        )
        try:
            session = ort.make_session(original, optimizations=False, threads=threads)
        except ModelError as exc:
            raise ModelError(f"cannot run the original model for verification: {exc}") from exc
        self.output_names = [o.name for o in session.get_outputs()]
        try:
            self.reference = ort.run(session, self.feeds, self.output_names)
        except ModelError as exc:
            raise ModelError(
                f"the original model fails on the verification feeds ({_feeds_brief(self.feed_info['inputs'])}): "
                f"{exc}; give realistic inputs with --feeds or sizes with --shape"
            ) from exc
        self.backend = f"onnxruntime {ort.ort_version()} (CPU, graph optimizations off)"
        del session
        logger.info("verification feeds: %s (seed %d)", _feeds_brief(self.feed_info["inputs"]), self.seed)

    def tolerances(self, family: str | Iterable[str] | None) -> dict[str, Tolerance]:
        return {
            name: tolerance_for(arr.dtype, family, atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine)
            for name, arr in self.reference.items()
        }

    def _base(self, family: str | Iterable[str] | None) -> dict[str, Any]:
        return {
            "passed": False,
            "summary": "",
            "reason": None,
            "family": _families(family),
            "outputs": {},
            "feeds": self.feed_info["inputs"],
            "defaulted_dims": self.feed_info["defaulted_dims"],
            "seed": self.seed,
            "backend": self.backend,
        }

    def _fail(self, check: dict[str, Any], reason: str) -> dict[str, Any]:
        check.update(passed=False, reason=reason, summary=f"FAILED: {reason}")
        logger.info("verification: %s", check["summary"])
        return check

    def check(self, model: Any, family: str | Iterable[str] | None = None) -> dict[str, Any]:
        """Run ``model`` on the feeds and compare with the original's outputs.

        Args:
            model: the rewritten model (same forms as the original).
            family: the family of the pass(es) that produced it, or a set of families; selects the
                tolerances (loosest applicable).  ``None``: tight tolerances.

        Returns:
            A JSON-serialisable dict: ``passed``, ``summary`` (one line), ``reason`` (set when the
            model could not be compared at all), ``outputs`` (per output: ``max_abs``,
            ``max_rel``, ``cosine``, ``passed``, ``atol``, ``rtol``, ``min_cosine`` and
            ``failures``), ``feeds`` (what was fed), ``defaulted_dims``, ``seed``, ``family``.
        """
        from mograph.backends import ort

        check = self._base(family)
        try:
            session = ort.make_session(model, optimizations=False, threads=self.threads)
        except ModelError as exc:
            return self._fail(check, f"the optimized model cannot be loaded: {exc}")
        names = [o.name for o in session.get_outputs()]
        if names != self.output_names:
            if len(names) != len(self.output_names):
                what = f"output count changed from {len(self.output_names)} to {len(names)}"
            elif set(names) == set(self.output_names):
                what = "output order changed"
            else:
                what = "output names changed"
            return self._fail(check, f"{what}: original {self.output_names}, optimized {names}")
        feeds: dict[str, np.ndarray] = {}
        notes: list[str] = []
        for inp in session.get_inputs():
            if inp.name not in self.feeds:
                return self._fail(check, f"the optimized model has an input '{inp.name}' the original does not have")
            arr = self.feeds[inp.name]
            want = _NP_OF_ORT.get(inp.type)
            if want is not None and arr.dtype != want and dtype_class(arr.dtype) not in ("int", "bool"):
                notes.append(f"input '{inp.name}' fed as {np.dtype(want)} (the optimized model's type)")
                arr = arr.astype(want)
            feeds[inp.name] = arr
        dropped = sorted(set(self.feeds) - set(feeds))
        if dropped:
            notes.append(f"the optimized model no longer takes input(s) {dropped}")
        if notes:
            check["notes"] = notes
        try:
            outputs = ort.run(session, feeds, names)
        except ModelError as exc:
            return self._fail(check, f"the optimized model fails on the verification feeds: {exc}")
        tolerances = self.tolerances(family)
        for name, arr in outputs.items():
            ref_dtype = self.reference[name].dtype
            if arr.dtype != ref_dtype and dtype_class(arr.dtype) not in ("int", "bool", "other"):
                # e.g. a precision pass made a float32 output float16: judge it at the lower precision
                tolerances[name] = tolerances[name].loosest(
                    tolerance_for(arr.dtype, family, atol=self.atol, rtol=self.rtol, min_cosine=self.min_cosine)
                )
        entries = compare_outputs(self.reference, outputs, tolerances)
        check["outputs"] = entries
        check["passed"] = all(e["passed"] for e in entries.values())
        check["summary"] = self._summary(check)
        logger.info("verification: %s", check["summary"])
        return check

    @staticmethod
    def _worst(outputs: Mapping[str, dict[str, Any]]) -> str | None:
        if not outputs:
            return None

        def key(item: tuple[str, dict[str, Any]]) -> tuple[Any, ...]:
            _, e = item
            cos = e.get("cosine")
            return (e["passed"], cos if cos is not None else (2.0 if e["passed"] else -2.0), -(e.get("max_abs") or 0.0))

        return min(outputs.items(), key=key)[0]

    def _summary(self, check: Mapping[str, Any]) -> str:
        outputs = check["outputs"]
        worst = self._worst(outputs)
        n_fail = sum(not e["passed"] for e in outputs.values())
        head = f"passed ({len(outputs)} outputs)" if check["passed"] else f"FAILED ({n_fail} of {len(outputs)} outputs)"
        if worst is None:
            return f"{head}: the model has no outputs"
        e = outputs[worst]
        return (
            f"{head}: worst output '{worst}' max abs {_fmt(e['max_abs'])}, max rel {_fmt(e['max_rel'])}, "
            f"cosine {_fmt(e['cosine'], 6)}"
        )

    def describe_failure(self, check: Mapping[str, Any]) -> str:
        """One line saying what failed and on which feeds."""
        where = f" [feeds: {_feeds_brief(check.get('feeds', {}))}; seed {check.get('seed')}]"
        if check.get("reason"):
            return str(check["reason"]) + where
        parts = []
        for name, e in check.get("outputs", {}).items():
            if not e["passed"]:
                parts.append(f"output '{name}' ({e['dtype']}): " + "; ".join(e.get("failures", [])))
        fam = check.get("family") or []
        fam_s = f" (tolerances of {', '.join(fam)})" if fam else ""
        return ("; ".join(parts) or "no output failed") + fam_s + where


def diff_models(
    a: Any,
    b: Any,
    *,
    shapes: Mapping[str, Iterable[int]] | None = None,
    feeds: str | os.PathLike | Mapping[str, Any] | None = None,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    min_cosine: float | None = None,
    family: str | Iterable[str] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Compare model ``b`` against model ``a`` (the reference) on the same feeds.

    Returns the check dict of :meth:`Verifier.check` (``passed``, ``summary``, ``outputs`` ...);
    does not raise when the numbers differ: the caller decides (``mograph diff`` exits 5).
    """
    if isinstance(b, (str, os.PathLike)):
        ir_io.load_model(b, check=False)  # a missing or unreadable B is a ModelError, not a difference
    verifier = Verifier(a, shapes=shapes, feeds=feeds, seed=seed, atol=atol, rtol=rtol, min_cosine=min_cosine, threads=threads)
    check = verifier.check(b, family=family)
    if not check["passed"]:
        check["failure"] = verifier.describe_failure(check)
    check["tolerances"] = {n: asdict(t) for n, t in verifier.tolerances(family).items()}
    return check
