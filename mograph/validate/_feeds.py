"""Feeds: the user's arrays, or seeded random ones that respect each input's dtype and meaning.

Part of :mod:`mograph.validate` (which documents the rules and re-exports the public names).
"""

from __future__ import annotations

import ast
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from mograph.errors import ModelError, UsageError
from mograph.validate._tolerances import dtype_class

__all__ = ["load_feeds", "graph_inputs", "make_feeds"]


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
        hint = ""
        if "allow_pickle" in str(exc):
            hint = "; save strings as a unicode array (np.asarray(texts, dtype=str)), not dtype=object"
        raise UsageError(f"feeds file {path}: not a readable .npz archive ({exc}){hint}") from exc


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


#: Gathers whose data is a block-quantized table: ``mograph.BlockQuantizedGather`` and ONNX Runtime's
#: ``com.microsoft.GatherBlockQuantized``; their indices (input 1) pick rows of the data (input 0).
_BLOCK_QUANTIZED_GATHERS = frozenset({("mograph", "BlockQuantizedGather"), ("com.microsoft", "GatherBlockQuantized")})


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
            elif (node.domain, node.op_type) in _BLOCK_QUANTIZED_GATHERS and idx == 1 and node.inputs[0] is not None:
                # an embedding table stored block-quantized (weight-only's, or ONNX Runtime's lowering of it):
                # its rows are the data's gather axis, whatever the packing of the other axis
                axis = _attr_int(node, "gather_axis", 0) if node.domain == "com.microsoft" else 0
                found = _static_dim(node.inputs[0], axis)
                if found is not None:
                    what = f"indices of {_node_ref(node)} ({found} entries)"
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


def _decoder_mask_lengths(inputs: list[ir.Value], fixed: set[str]) -> dict[str, ast.expr]:
    """A decoder's mask length that its exporter named by a symbol of its own (``total``, ``mask_len``: a
    TorchScript export's ``dynamic_axes``), read as ``past + seq``: the mask covers the cached tokens and the new
    ones, so sized alone (16, beside a past of 64) the original model itself fails on the feeds.  Only where the
    graph is a decoder step without doubt: a rank-2 mask-named input whose last dim's symbol no other input
    carries, a rank-4 ``past``-named input whose dim 2 is a symbol, and a rank-2 integer token input whose dim 1
    is another symbol.  ``fixed``: names sized by the user, left alone."""

    def symbol(value: ir.Value, axis: int, rank: int) -> str | None:
        if value.shape is None or len(value.shape) != rank:
            return None
        dim = value.shape[axis]
        return None if isinstance(dim, int) else dim.value

    names = {str(v.name): v for v in inputs}
    past = {s for n, v in names.items() if "past" in n.lower() and (s := symbol(v, 2, 4)) is not None}
    seq = {s for n, v in names.items() if not _is_mask(n) and v.dtype is not None
           and dtype_class(v.dtype.numpy()) == "int" and (s := symbol(v, 1, 2)) is not None}
    if len(past) != 1 or len(seq) != 1 or past == seq:
        return {}
    out: dict[str, ast.expr] = {}
    for n, v in names.items():
        total = symbol(v, 1, 2)
        if not _is_mask(n) or n in fixed or total is None or total in past | seq or _dim_expression(total):
            continue
        elsewhere = any(not isinstance(d, int) and d.value == total for m, w in names.items() if m != n
                        for d in (w.shape or ()))
        if not elsewhere:
            out[total] = ast.BinOp(left=ast.Name(id=next(iter(past))), op=ast.Add(), right=ast.Name(id=next(iter(seq))))
    return out


def _dim_expression(symbol: str | None) -> ast.expr | None:
    """The parsed ``symbol`` if it is an arithmetic expression of other dims (``past_sequence_length +
    sequence_length``, as optimum names a decoder's mask length): names and integers joined by ``+``, ``-``, ``*``;
    else None (a plain name, or anything else)."""
    if not symbol or not any(op in symbol for op in "+-*"):
        return None
    try:
        tree = ast.parse(symbol, mode="eval").body
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            continue
        if isinstance(node, (ast.Add, ast.Sub, ast.Mult, ast.Load)):
            continue
        if isinstance(node, ast.Name) or (isinstance(node, ast.Constant) and type(node.value) is int):
            continue
        return None
    return tree if isinstance(tree, ast.BinOp) else None


def _evaluate(tree: ast.expr, bindings: Mapping[str, int]) -> int | None:
    """The value of a :func:`_dim_expression` tree with its names bound, else None (a name not bound)."""
    if isinstance(tree, ast.Constant):
        return tree.value if isinstance(tree.value, int) else None
    if isinstance(tree, ast.Name):
        return bindings.get(tree.id)
    assert isinstance(tree, ast.BinOp)
    a, b = _evaluate(tree.left, bindings), _evaluate(tree.right, bindings)
    if a is None or b is None:
        return None
    return a + b if isinstance(tree.op, ast.Add) else a - b if isinstance(tree.op, ast.Sub) else a * b


def _expression_names(tree: ast.expr) -> list[str]:
    return [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]


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
    named_dims: Mapping[str, int] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Build the feeds for ``model``'s inputs: the user's, then seeded random ones for the rest.

    ``batch`` is the size given to dynamic leading (batch) dims that neither ``shapes`` nor
    ``feeds`` sized.  ``named_dims`` sizes named dims in every input (fix-shapes' ``--dim batch=2``).  ``limit_bytes`` (default :data:`FEED_LIMIT_BYTES`) bounds the random feeds
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
    bindings: dict[str, int] = {str(k): int(v) for k, v in (named_dims or {}).items()}
    out: dict[str, np.ndarray] = {}
    report: dict[str, Any] = {}
    notes: list[str] = []
    for name, array in given.items():
        value = by_name[name]
        if value.dtype == ir.DataType.STRING:  # only a feed can give one (random feeds cannot make strings)
            if array.dtype.kind not in "USO":
                raise UsageError(f"feed '{name}' has dtype {array.dtype}, but the model's input is a string tensor")
            _bind(value, tuple(array.shape), bindings, "feed")
            out[name] = array.astype(object)
            continue
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
    # A dim named by an expression of other dims (optimum's 'past_sequence_length + sequence_length' on a decoder's
    # attention_mask) is sized from them: inputs with one come after the others, which bind its names.
    implied = _decoder_mask_lengths(inputs, set(sizes) | set(given))

    def expression(symbol: str | None) -> ast.expr | None:
        return implied.get(symbol or "") or _dim_expression(symbol)

    order = sorted(inputs, key=lambda v: v.shape is not None and str(v.name) not in sizes and any(
        not isinstance(d, int) and d.value not in bindings and expression(d.value) is not None
        for d in v.shape))
    for value in order:
        name = str(value.name)
        if name in out:
            report[name] = {"shape": list(out[name].shape), "dtype": str(out[name].dtype), "source": "file"}
            continue
        dtype = _np_dtype(value)
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
                tree = expression(symbol)
                if tree is not None:
                    for part in _expression_names(tree):  # a name no other input carries: the default size
                        if part not in bindings:
                            bindings[part] = defaulted[part] = _default_dim(value, axis, part, dtype, batch)
                    total = _evaluate(tree, bindings)
                    if total is not None and total >= 0:
                        assert symbol is not None
                        bindings[symbol] = total
                        dims.append(total)
                        if symbol in implied:
                            notes.append(f"input '{name}': dim '{symbol}' sized {total} as "
                                         f"{' + '.join(_expression_names(implied[symbol]))} (a decoder's mask covers the past and "
                                         "the new tokens)")
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
                f"the random feed for input '{name}' ({'x'.join(map(str, dims)) or 'scalar'} "
                f"{dtype}, from {given_by}) brings the feeds to {random_bytes:,} bytes, past the limit of "
                f"{limit:,}: give smaller sizes with --shape, or raise --feed-limit"
            )
        array, info = _random_tensor(rng, value, tuple(dims), dtype)
        array = np.asarray(array)  # numpy makes a scalar, not an array, for shape (): ONNX Runtime wants arrays
        out[name] = array
        report[name] = {"shape": list(array.shape), "dtype": str(array.dtype), "source": "random", **info}
    out = {str(v.name): out[str(v.name)] for v in inputs}  # the model's input order
    report = {str(v.name): report[str(v.name)] for v in inputs}
    return out, {"inputs": report, "defaulted_dims": defaulted, "notes": notes}


#: The optimize options whose graphs ASSUME something of a decoder's inputs (README: "LLM decoders"), as the
#: verifier names them: GroupQueryAttention's lengths mean right padding; ``--position-ids cache`` reads each
#: token's position as its cache position.
DECODER_ASSUMPTIONS = {
    "mask_format": ("lengths", "--mask-format lengths"),
    "kv_cache": ("shared", "--kv-cache shared"),
    "position_ids": ("cache", "--position-ids cache"),
}


def decoder_assumptions(options: Mapping[str, Any]) -> list[str]:
    """The flags of ``options`` (optimize's, underscored) that make a decoder graph assume right padding or
    cache positions: the verifier's random feeds must keep those assumptions to compare like with like."""
    return [flag for key, (value, flag) in DECODER_ASSUMPTIONS.items() if options.get(key) == value]


def keep_decoder_assumptions(feeds: dict[str, np.ndarray], info: dict[str, Any], assumptions: Iterable[str]) -> None:
    """Make random feeds keep what ``assumptions`` (:func:`decoder_assumptions`) assume, in place.

    A random mask has holes (mostly ones): a graph optimized under ``--mask-format lengths`` or ``--kv-cache
    shared`` reads a mask as right padding and gives other numbers there, as documented, so the verifier would
    fail an exact rewrite.  Random mask-like inputs become all ones (no padding: right padding's simplest
    case), and a random 2-D integer ``position_ids`` input ``[B, S]`` becomes each token's cache position
    ``P + s`` (``P`` the past length: the 2-D mask's length minus ``S``, else 0).  Feeds the user gave stay
    as given; the report says what changed and why."""
    flags = list(assumptions)
    if not flags:
        return
    why = f"{', '.join(flags)} assume{'s' if len(flags) == 1 else ''}"
    rows = info.get("inputs", {})
    masks = [n for n in feeds if _is_mask(n) and rows.get(n, {}).get("source") == "random"]
    for name in masks:
        feeds[name] = np.ones_like(feeds[name])
        rows[name].update(range=[1, 1], why=f"all ones: {why} right padding")
    mask_len = next((int(a.shape[1]) for n, a in feeds.items() if _is_mask(n) and a.ndim == 2), None)
    for name, array in list(feeds.items()):
        if ("position_ids" not in name.lower() or rows.get(name, {}).get("source") != "random" or array.ndim != 2
                or dtype_class(array.dtype) != "int"):
            continue
        b, s = array.shape
        past = max(mask_len - s, 0) if mask_len is not None else 0
        feeds[name] = np.tile(np.arange(past, past + s, dtype=array.dtype), (b, 1))
        rows[name].update(range=[past, past + s - 1], why=f"each token's cache position past + s: {why} right padding")

