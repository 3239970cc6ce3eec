"""SmoothQuant-style smoothing: move the per-channel range of an activation into the weights that read it.

A MatMul ``Y = X W`` (``X [.., K]``, ``W [K, N]``) is unchanged when ``X`` is divided by a positive
per-channel vector ``s`` and the rows of ``W`` are multiplied by it: ``Y = (X / s) (diag(s) W)``.
Transformer activations have a few channels whose values are tens of times larger than the rest (the
LayerNorm outputs of BERT-style encoders reach 30 in one or two of 384 channels while most stay within
±3); one per-tensor INT8 scale for all of them spends almost all of its 256 levels on those channels.
Dividing channel ``k`` by

    s_k = max|X_k| ** alpha / max|W_k,:| ** (1 - alpha)

(Xiao et al., *SmoothQuant*, 2022) evens the activation's channels out and gives the weights, which are
quantized per output channel and are easy to quantize, a share of the range: ``alpha = 0`` leaves the
activation as it is, ``alpha = 1`` moves all of its range into the weights.  Since ``X`` is often read by
other nodes too (the residual ``Add`` of a post-LN encoder reads the LayerNorm output), ``X / s`` is a new
tensor made by one ``Mul`` in front of the quantized consumers only, unless the producer of ``X`` can make
``X / s`` itself, exactly, and nothing else reads ``X`` (:func:`fold_target`): a LayerNorm's gamma and
beta, a MatMul/Gemm's weight columns and bias, or, for an attention context, the value projection's
columns (the Mul costs about a LayerNorm's time on ONNX Runtime CPU); every consumer of one quantized
activation (the Q, K and V projections of one hidden state) shares the same ``s``, so they keep sharing
one Q/DQ pair.  In float the model computes exactly what it did (up to rounding).

``alpha`` is chosen per activation (``alpha="auto"``) from a few values by the error of the group's
quantized outputs on calibration samples (the layer inputs of the float model, fake-quantized as the
inserted Q/DQ will do), or fixed by the user.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from mograph.passes.quant._qdq import Candidate, Scheme, const_tensor, fake_quant_activation, fake_quant_weight

from mograph import _spill
from mograph.foreign_ops import affine_inputs
from mograph.irutil import fresh_name
from mograph.shapes import ShapeQuery

if TYPE_CHECKING:
    from mograph.custom_ops import Declarations

__all__ = [
    "SmoothGroup",
    "smoothing_groups",
    "smoothing_scale",
    "choose_alpha",
    "apply_smoothing",
    "apply_bias_correction",
    "bias_add",
    "fold_target",
    "ALPHAS",
    "MIN_GAIN",
    "MAX_COLUMNS",
]

logger = logging.getLogger(__name__)

#: The values ``alpha="auto"`` tries.
ALPHAS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: ``alpha="auto"`` smooths an activation only if that divides its group's error by at least this much.
MIN_GAIN = 1.1
#: ``alpha="auto"`` judges a weight wider than this many output channels on this many of them (:func:`choose_alpha`).
MAX_COLUMNS = 8192


@dataclass
class SmoothGroup:
    """One activation and the weight MatMul/Gemm candidates that read it (smoothed together)."""

    value: ir.Value
    cands: list[Candidate]
    alpha: float = 0.0
    scale: np.ndarray | None = None
    smoothed: ir.Value | None = None
    errors: dict[float, float] = field(default_factory=dict)
    #: per candidate key: mean output shift (quantized - float) per output channel at the chosen alpha
    bias_shift: dict[str, np.ndarray] = field(default_factory=dict)
    #: where ``X / s`` is computed when it was folded into the producer (see :func:`fold_target`), else None
    folded: str | None = None

    @property
    def name(self) -> str:
        return self.value.name or ""


def _row_axis(c: Candidate) -> int | None:
    """Axis of the weight of ``c`` that runs along the activation's channels (K), or None when unsupported."""
    w = const_tensor(c.node.inputs[c.weight_input]) if c.weight_input is not None else None
    if w is None or len(w.shape) != 2 or w.dtype != ir.DataType.FLOAT:
        return None
    if c.node.op_type == "MatMul":
        return 0
    if c.node.op_type == "Gemm":
        ta = c.node.attributes.get("transA")
        if ta is not None and ta.as_int() == 1:
            return None
        tb = c.node.attributes.get("transB")
        return 1 if tb is not None and tb.as_int() == 1 else 0
    return None


def smoothing_groups(cands: Sequence[Candidate]) -> list[SmoothGroup]:
    """Group the weight MatMul/Gemm candidates (float32 weights, 2-D) by the activation they read.

    An activation some candidate reads in a form smoothing does not handle (a Conv, a 3-D weight, an
    activation x activation MatMul) is left out: its Q/DQ pair is shared, so its scale must stay.
    """
    by_value: dict[int, SmoothGroup] = {}
    blocked: set[int] = set()
    for c in cands:
        for i in c.act_inputs:
            v = c.node.inputs[i]
            if v is None:
                continue
            ok = c.has_weight and i == 0 and _row_axis(c) is not None and v.dtype in (ir.DataType.FLOAT, None)
            if not ok:
                blocked.add(id(v))
                continue
            by_value.setdefault(id(v), SmoothGroup(v, [])).cands.append(c)
    return [g for k, g in by_value.items() if k not in blocked]


def _weight_rows_amax(g: SmoothGroup) -> np.ndarray:
    """Largest |w| per input channel over every weight of the group."""
    out = None
    for c in g.cands:
        tensor = const_tensor(c.node.inputs[c.weight_input])  # type: ignore[index]
        w = tensor.numpy().astype(np.float32)  # type: ignore[union-attr]
        _spill.release_pages(tensor)  # a copy was made: the mapped float weights need not stay resident
        amax = np.abs(w).max(axis=1 - int(_row_axis(c)))  # type: ignore[arg-type]
        out = amax if out is None else np.maximum(out, amax)
    assert out is not None
    return out


def smoothing_scale(act_amax: np.ndarray, weight_amax: np.ndarray, alpha: float) -> np.ndarray:
    """``s = act_amax**alpha / weight_amax**(1-alpha)``, normalised to geometric mean 1, kept in [1e-4, 1e4].

    Channels never seen non-zero (or with all-zero weights) get 1.  The normalisation does not change
    what smoothing achieves (a common factor moves between the two per-tensor/per-channel scales) but
    keeps the numbers near 1.
    """
    a = np.asarray(act_amax, np.float64)
    w = np.asarray(weight_amax, np.float64)
    good = (a > 0) & (w > 0) & np.isfinite(a) & np.isfinite(w)
    s = np.ones_like(a)
    s[good] = a[good] ** alpha / w[good] ** (1.0 - alpha)
    if good.any():
        s[good] /= np.exp(np.log(s[good]).mean())
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def _group_error(g: SmoothGroup, x: np.ndarray, refs: list[np.ndarray], weights: list[np.ndarray],
                 s: np.ndarray, scheme: Scheme) -> float:
    """Relative error of the group's outputs with smoothed, fake-quantized input ``x`` (rows) and weights."""
    x_s = x / s
    xq = fake_quant_activation(x_s, float(x_s.min()), float(x_s.max()), scheme)
    num = den = 0.0
    for w, y in zip(weights, refs):
        yq = xq @ fake_quant_weight(w * s[:, None], 1, scheme)  # weights per output channel (N)
        num += float(((yq - y) ** 2).sum())
        den += float((y**2).sum())
    return (num / den) ** 0.5 if den > 0 else 0.0


def choose_alpha(g: SmoothGroup, xs: list[np.ndarray], act_amax: np.ndarray, scheme: Scheme,
                 alphas: Sequence[float] = ALPHAS, max_rows: int = 2048, min_gain: float = MIN_GAIN,
                 max_columns: int = MAX_COLUMNS, bias_shift: bool = True) -> float:
    """The ``alpha`` of ``alphas`` whose smoothed, fake-quantized group output is closest to float on ``xs``.

    ``xs`` are the group's activation on a few calibration samples (float model); at most ``max_rows``
    of their rows (tokens), evenly spaced, are used.  ``alpha = 0`` (no smoothing) is among the
    candidates, and smoothing is chosen only where it divides the error by at least ``min_gain``: its
    ``Mul`` costs about as much time as a LayerNorm on ONNX Runtime CPU.

    A weight wider than ``max_columns`` output channels (an LLM's LM head: 262,144 on Gemma 3) is judged on
    ``max_columns`` of its columns, evenly spaced: weights are quantized per output channel, so each column's
    error depends on that column and the shared activation only, and the subset's error estimates the whole
    one's (``s`` itself still comes from every column's range; with ``bias_shift`` every column is used, as the
    shift is wanted for each).  Without it one such group costs more than
    every other group together (Gemma 3 270M: 2,048 x 640 x 262,144 multiply-adds per alpha, and two 2 GB
    output copies).  ``bias_shift``: also measure the mean output shift per channel at the chosen alpha
    (``g.bias_shift``, for ``--bias-correction``; one more product of the group, so off when not wanted).
    """
    rows = np.concatenate([x.reshape(-1, x.shape[-1]) for x in xs]).astype(np.float32)
    if len(rows) > max_rows:
        rows = rows[np.linspace(0, len(rows) - 1, max_rows).astype(np.int64)]
    weights = []
    for c in g.cands:
        tensor = const_tensor(c.node.inputs[c.weight_input])  # type: ignore[index]
        w = tensor.numpy().astype(np.float32)  # type: ignore[union-attr]
        _spill.release_pages(tensor)
        w = w if _row_axis(c) == 0 else w.T  # [K, N]
        if w.shape[1] > max_columns and not bias_shift:
            w = w[:, np.linspace(0, w.shape[1] - 1, max_columns).astype(np.int64)]
        weights.append(np.ascontiguousarray(w))
    refs = [rows @ w for w in weights]
    w_amax = _weight_rows_amax(g)
    best, best_err = 0.0, float("inf")
    for a in alphas:
        err = _group_error(g, rows, refs, weights, smoothing_scale(act_amax, w_amax, a), scheme)
        g.errors[float(a)] = err
        if err < best_err - 1e-12:
            best, best_err = float(a), err
    if best > 0 and 0.0 in g.errors and best_err * min_gain > g.errors[0.0]:
        best = 0.0  # the Mul costs time (about a LayerNorm's): not worth it for a small gain
    if not bias_shift:
        return best
    g.bias_shift = _mean_shift(rows, refs, weights, smoothing_scale(act_amax, w_amax, best) if best > 0 else None,
                               scheme, [c.key for c in g.cands])
    return best


def _mean_shift(x: np.ndarray, refs: list[np.ndarray], weights: list[np.ndarray], s: np.ndarray | None,
                scheme: Scheme, keys: list[str]) -> dict[str, np.ndarray]:
    """Per output channel, the mean of (quantized - float) output over the rows: the bias the quantization adds."""
    s = np.ones(x.shape[-1], np.float32) if s is None else s
    x_s = x / s
    xq = fake_quant_activation(x_s, float(x_s.min()), float(x_s.max()), scheme)
    return {k: (xq @ fake_quant_weight(w * s[:, None], 1, scheme) - y).mean(axis=0)
            for k, w, y in zip(keys, weights, refs)}


def bias_add(c: Candidate) -> tuple[ir.Node, int] | None:
    """The ``Add`` that adds a constant 1-D bias to the output of MatMul candidate ``c`` (node, bias input)."""
    if c.node.op_type != "MatMul":
        return None
    uses = list(c.node.outputs[0].uses())
    if len(uses) != 1 or c.node.outputs[0].is_graph_output():
        return None
    add, idx = uses[0]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
        return None
    other = add.inputs[1 - idx]
    t = const_tensor(other)
    if t is None or len(t.shape) != 1 or t.dtype != ir.DataType.FLOAT:
        return None
    return add, 1 - idx


def apply_bias_correction(model: ir.Model, g: SmoothGroup) -> list[str]:
    """Subtract the measured mean output shift (:func:`choose_alpha`) from each candidate's bias ``Add``.

    Only a bias read by that ``Add`` alone is changed (a new initializer); returns the keys corrected.
    """
    done = []
    for c in g.cands:
        shift = g.bias_shift.get(c.key)
        found = bias_add(c)
        if shift is None or found is None:
            continue
        add, i = found
        old = add.inputs[i]
        assert old is not None
        b = const_tensor(old).numpy().astype(np.float32)  # type: ignore[union-attr]
        if b.shape != shift.shape:
            continue
        home = add.graph or model.graph
        name, k = f"{old.name or 'bias'}_corrected", 1
        taken = set(home.initializers) | {o.name for n in home for o in n.outputs if o.name}
        while name in taken:
            k += 1
            name = f"{old.name or 'bias'}_corrected_{k}"
        new = ir.Value(name=name, const_value=ir.tensor((b - shift).astype(np.float32)))
        new.shape, new.dtype = ir.Shape([int(b.shape[0])]), ir.DataType.FLOAT
        home.register_initializer(new)
        add.replace_input_with(i, new)
        _drop_if_unused(old, home)
        done.append(c.key)
    return done


def _drop_if_unused(value: ir.Value, home: ir.Graph) -> None:
    if value.uses() or value.is_graph_output():
        return
    if value.is_initializer() and value.name:
        (value.graph or home).initializers.pop(value.name, None)
        return
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.graph is not None:
        producer.graph.remove(producer, safe=True)


def apply_smoothing(model: ir.Model, g: SmoothGroup, act_amax: np.ndarray, alpha: float,
                    observed: Collection[str] = (), reobserve: set[str] | None = None,
                    norms: Mapping[tuple[str, str], tuple[int, int]] | None = None) -> bool:
    """Make ``X / s`` for the group's candidates and scale their weights' rows by ``s``.

    ``X / s`` is folded into the producer of ``X`` where that is exact (:func:`fold_target`: a LayerNorm's
    gamma and beta, a MatMul/Gemm's weight columns and bias; ``g.folded`` says where), else computed by
    a new ``Mul(X, 1/s)`` read by the candidates only.  ``observed``: the tensors whose calibrated ranges
    are taken already (a fold must not change them, unless ``reobserve`` collects them to be observed
    again: see :func:`fold_target`).  ``norms``: the affine norms a fold may use (:func:`affine_norms`;
    default: the built-in declarations').

    A weight that other nodes read as well is copied, not changed in place.  Returns False (nothing
    changed) when ``alpha`` is 0 or no channel would be scaled.
    """
    if alpha <= 0:
        return False
    s = smoothing_scale(act_amax, _weight_rows_amax(g), alpha)
    if np.allclose(s, 1.0):
        return False
    x = g.value
    home = x.graph or model.graph
    names = {n for n in home.initializers} | {o.name for node in home for o in node.outputs if o.name}
    names |= {v.name for v in home.inputs if v.name}
    fresh = functools.partial(fresh_name, names)

    pending: set[str] | None = set() if reobserve is not None else None
    fold = fold_target(g, int(s.shape[0]), observed, pending, norms)
    if fold is not None:
        if reobserve is not None and pending:
            reobserve.update(pending)
        where, targets = fold
        inv_s = (1.0 / s).astype(np.float32)
        for node, idx, axis in targets:
            old = node.inputs[idx]
            assert old is not None
            t = const_tensor(old).numpy().astype(np.float32)  # type: ignore[union-attr]
            if axis is None:
                t = t * inv_s
            else:
                t = t * (inv_s[None, :] if axis == 1 else inv_s[:, None])
            new = ir.Value(name=fresh(f"{old.name or 'const'}_smooth_folded"), const_value=ir.tensor(t.astype(np.float32)))
            new.shape, new.dtype = ir.Shape(list(t.shape)), ir.DataType.FLOAT
            home.register_initializer(new)
            node.replace_input_with(idx, new)
            _drop_if_unused(old, home)
        out = x
        g.folded = where
    else:
        out = _insert_mul(x, s, home, fresh)
    for c in g.cands:
        axis = int(_row_axis(c))  # type: ignore[arg-type]
        w_val = c.node.inputs[c.weight_input]  # type: ignore[index]
        assert w_val is not None
        tensor = const_tensor(w_val)
        w = tensor.numpy().astype(np.float32)  # type: ignore[union-attr]
        _spill.release_pages(tensor)
        ws = w * (s[:, None] if axis == 0 else s[None, :])
        new = ir.Value(name=fresh(f"{w_val.name or 'weight'}_smoothed"), const_value=ir.tensor(ws.astype(np.float32)))
        new.shape = ir.Shape(list(ws.shape))
        new.dtype = ir.DataType.FLOAT
        home.register_initializer(new)
        c.node.replace_input_with(c.weight_input, new)  # type: ignore[arg-type]
        _drop_if_unused(w_val, home)
        c.node.replace_input_with(0, out)
    g.alpha, g.scale, g.smoothed = alpha, s, out
    return True


def unsmooth(model: ir.Model, g: SmoothGroup, keys: Collection[str]) -> list[str]:
    """Give the candidates of a ``Mul``-smoothed group named in ``keys`` (those that stay float) ``X`` and their
    own weights back: ``(X / s) (s W) = X W``, so the ``Mul`` is not computed for them; the ``Mul`` goes when
    no candidate reads it any more.  Folded groups are left alone (a fold costs nothing).  Returns the keys
    changed back."""
    if g.folded or g.smoothed is None or g.scale is None or g.smoothed is g.value:
        return []
    x, home = g.value, g.value.graph or model.graph
    names = {n for n in home.initializers} | {o.name for node in home for o in node.outputs if o.name}
    fresh = functools.partial(fresh_name, names)
    done = []
    for c in g.cands:
        if c.key not in keys or c.node.inputs[0] is not g.smoothed:
            continue
        axis = int(_row_axis(c))  # type: ignore[arg-type]
        w_val = c.node.inputs[c.weight_input]  # type: ignore[index]
        assert w_val is not None
        w = const_tensor(w_val).numpy().astype(np.float32)  # type: ignore[union-attr]
        orig = w / (g.scale[:, None] if axis == 0 else g.scale[None, :])
        new = ir.Value(name=fresh(f"{w_val.name or 'weight'}_unsmoothed"), const_value=ir.tensor(orig.astype(np.float32)))
        new.shape, new.dtype = ir.Shape(list(orig.shape)), ir.DataType.FLOAT
        home.register_initializer(new)
        c.node.replace_input_with(c.weight_input, new)  # type: ignore[arg-type]
        _drop_if_unused(w_val, home)
        c.node.replace_input_with(0, x)
        done.append(c.key)
    mul = g.smoothed.producer()
    if done and mul is not None and not g.smoothed.uses() and not g.smoothed.is_graph_output():
        inv = mul.inputs[1]
        home.remove(mul, safe=True)
        if inv is not None:
            _drop_if_unused(inv, home)
        g.smoothed = None
    return done


def _insert_mul(x: ir.Value, s: np.ndarray, home: ir.Graph, fresh: Callable[[str], str]) -> ir.Value:
    """A new ``Mul(X, 1/s)`` right after the producer of ``X`` (first in ``home`` for an input); its output."""
    base = x.name or "act"
    inv = ir.Value(name=fresh(f"{base}_smooth_inv_scale"), const_value=ir.tensor((1.0 / s).astype(np.float32)))
    home.register_initializer(inv)
    mul = ir.node("Mul", [x, inv], name=fresh(f"{base}_Smooth"))
    out = mul.outputs[0]
    out.name = fresh(f"{base}_smoothed")
    if x.dtype is not None:
        out.dtype, out.shape = x.dtype, x.shape
    producer = x.producer()
    if producer is not None and producer.graph is home:
        home.insert_after(producer, mul)
    else:
        first = next(iter(home), None)
        if first is None:
            home.append(mul)
        else:
            home.insert_before(first, mul)
    return out


def affine_norms(declarations: Declarations | None = None) -> dict[tuple[str, str], tuple[int, int]]:
    """The norms whose output is ``normalised * gamma + beta`` over the last axis: ``(domain, op type)`` ->
    ``(gamma, beta)`` inputs, read off the declarations (:func:`mograph.foreign_ops.affine_inputs`): the
    registry's when given, else the built-in foreign-op records and the built-in fused ops'."""
    if declarations is not None:
        return affine_inputs(declarations.custom_ops.values(), declarations.foreign_ops)
    from mograph.passes.fusion._common import fused_ops

    return affine_inputs(fused_ops().values())


def _const_1d(v: ir.Value | None, n: int) -> np.ndarray | None:
    """The float32 values of constant ``v`` as a vector of length ``n`` (a 1-D ``[n]`` tensor only), else None."""
    t = const_tensor(v) if v is not None else None
    if t is None or t.dtype != ir.DataType.FLOAT or list(t.shape) != [n]:
        return None
    return t.numpy().astype(np.float32)


def fold_target(g: SmoothGroup, n: int, observed: Collection[str] = (), reobserve: set[str] | None = None,
                norms: Mapping[tuple[str, str], tuple[int, int]] | None = None,
                ) -> tuple[str, list[tuple[ir.Node, int, int | None]]] | None:
    """Where ``X / s`` can be computed exactly by the producer of the group's activation ``X``, or None.

    ``n`` is the number of channels (the length of ``s``); a fold that would change a tensor named in
    ``observed`` besides ``X`` (one whose calibrated range is already taken) is refused, unless
    ``reobserve`` is given: then the fold is made and those names are added to it (the caller observes
    them again).  Returns a description and the ``(node, input, axis)`` constants to divide by ``s`` (``axis`` None for a
    1-D vector, else the axis of a 2-D weight that runs along ``X``'s channels).  A fold needs every reader
    of ``X`` to be one of the group's candidates (input 0), ``X`` not a graph output, and the producer one of

    * a LayerNorm over the last axis (``LayerNormalization``, ``mograph.LayerNorm``, ``mograph.SkipLayerNorm``,
      ``com.microsoft.SkipLayerNormalization``; ``X`` its output 0): ``LN(x) * g + b`` divided by ``s`` is
      ``LN(x) * (g / s) + b / s``; the other outputs (the sum, mean, inverse deviation) do not depend on them;
    * a ``MatMul`` with a constant 2-D weight (``X`` its output, or the output of the ``Add`` of a constant
      1-D bias that alone reads it): ``(x W + b) / s = x (W / s) + b / s``, column by column;
    * a ``Gemm`` (``transA`` 0) with a constant 2-D ``B`` and no ``C`` or a 1-D one, likewise;
    * the context of an attention, ``Reshape(Transpose(P @ Transpose(Reshape(V, [.., H, D]))), [.., H*D])``
      with ``V`` the output of such a MatMul/Gemm and every tensor on the way read once: the value
      projection's columns are divided (:func:`_attention_value_fold`).
    """
    x = g.value
    if x.is_graph_output():
        return None
    mine = {id(c.node) for c in g.cands}
    if any(id(node) not in mine or idx != 0 for node, idx in x.uses()):
        return None
    p = x.producer()
    if p is None or p.graph is not g.cands[0].node.graph:
        return None
    key = (p.domain, p.op_type)
    norms = affine_norms() if norms is None else norms
    if key in norms and p.outputs[0] is x:
        gi, bi = norms[key]
        axis = p.attributes.get("axis")
        if axis is not None and axis.as_int() != -1:
            return None
        if _const_1d(p.inputs[gi] if len(p.inputs) > gi else None, n) is None:
            return None
        targets: list[tuple[ir.Node, int, int | None]] = [(p, gi, None)]
        if len(p.inputs) > bi and p.inputs[bi] is not None:
            if _const_1d(p.inputs[bi], n) is None:
                return None
            targets.append((p, bi, None))
        return f"{p.op_type} {p.name} gamma/beta", targets
    is_context = p.op_type == "Reshape" and p.domain in ("", "ai.onnx")
    found = _attention_value_fold(p, n) if is_context else _producer_columns(p, x, n)
    if found is None:
        return None
    stale = {name for name in found[2] if name in observed}
    if stale and reobserve is None:
        return None
    if reobserve is not None:
        reobserve.update(stale)
    return found[0], found[1]


_Fold = tuple[str, list[tuple[ir.Node, int, int | None]], list[str]]


def _producer_columns(p: ir.Node, x: ir.Value, n: int) -> _Fold | None:
    """``x`` as the output of a MatMul (+ bias Add) or Gemm with constant weights: the columns to divide
    and the names of the other tensors the fold changes."""
    if p.domain in ("", "ai.onnx") and p.op_type == "Add" and p.outputs[0] is x:
        for i in (0, 1):
            m, b = p.inputs[i], p.inputs[1 - i]
            mm = m.producer() if m is not None else None
            if (mm is None or mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or m is None
                    or len(m.uses()) != 1 or m.is_graph_output() or _const_1d(b, n) is None):
                continue
            w = const_tensor(mm.inputs[1])
            if w is not None and w.dtype == ir.DataType.FLOAT and len(w.shape) == 2 and w.shape[1] == n:
                return f"MatMul {mm.name} weight columns and bias", [(mm, 1, 1), (p, 1 - i, None)], [m.name or ""]
        return None
    if p.domain in ("", "ai.onnx") and p.op_type == "MatMul":
        w = const_tensor(p.inputs[1])
        if w is not None and w.dtype == ir.DataType.FLOAT and len(w.shape) == 2 and w.shape[1] == n:
            return f"MatMul {p.name} weight columns", [(p, 1, 1)], []
        return None
    if p.domain in ("", "ai.onnx") and p.op_type == "Gemm":
        ta, tb = p.attributes.get("transA"), p.attributes.get("transB")
        if ta is not None and ta.as_int() == 1:
            return None
        w = const_tensor(p.inputs[1])
        col = 0 if tb is not None and tb.as_int() == 1 else 1
        if w is None or w.dtype != ir.DataType.FLOAT or len(w.shape) != 2 or w.shape[col] != n:
            return None
        targets: list[tuple[ir.Node, int, int | None]] = [(p, 1, col)]
        if len(p.inputs) > 2 and p.inputs[2] is not None:
            if _const_1d(p.inputs[2], n) is None:
                return None
            targets.append((p, 2, None))
        return f"Gemm {p.name} weight columns and bias", targets, []
    return None


def _is(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _only_reader(v: ir.Value | None) -> bool:
    return v is not None and len(v.uses()) == 1 and not v.is_graph_output()


def _shape_tail(shapes: ShapeQuery, v: ir.Value | None, k: int) -> list[int] | None:
    """The last ``k`` entries of a Reshape's shape input where the shape query proves them literals, else None."""
    ints = shapes.literals(v)
    if ints is None or len(ints) < k or any(i is None for i in ints[len(ints) - k:]):
        return None
    return ints[len(ints) - k:]  # type: ignore[return-value]


def _leading_dims_of(shape: ir.Value | None, sources: set[int]) -> bool:
    """``shape`` is ``Concat(dim 0 of t, dim 1 of t, .., c, c)`` with every leading entry
    ``Unsqueeze(Gather(Shape(t), i))`` at its own position ``i`` and ``t`` one of ``sources`` (ids)."""
    cat = shape.producer() if shape is not None else None
    if not _is(cat, "Concat") or len(cat.inputs) < 3:  # type: ignore[union-attr]
        return False
    for pos, entry in enumerate(cat.inputs[:-2]):  # type: ignore[union-attr]
        un = entry.producer() if entry is not None else None
        ga = un.inputs[0].producer() if _is(un, "Unsqueeze") and un.inputs[0] is not None else None  # type: ignore[union-attr]
        sh = ga.inputs[0].producer() if _is(ga, "Gather") and ga.inputs[0] is not None else None  # type: ignore[union-attr]
        idx = const_tensor(ga.inputs[1]) if ga is not None and len(ga.inputs) > 1 else None
        if (not _is(sh, "Shape") or idx is None or int(idx.numpy().reshape(-1)[0]) != pos
                or sh.attributes.get("start") is not None or id(sh.inputs[0]) not in sources):  # type: ignore[union-attr]
            return False
    return True


def _attention_value_fold(p: ir.Node, n: int) -> _Fold | None:
    """The attention context ``Reshape(Transpose(P @ Transpose(Reshape(x W_v + b_v, [.., H, D]))), [.., H*D])``:
    channel ``h*D + d`` of the context is ``P_h`` times channel ``h*D + d`` of the value projection (the two
    Reshapes split and merge the last axis the same way, the Transposes swap the sequence and head axes only),
    so dividing ``W_v``'s columns and ``b_v`` by ``s`` divides the context by ``s``, exactly."""
    perm = (0, 2, 1, 3)

    def tr(node: ir.Node | None) -> bool:
        a = node.attributes.get("perm") if node is not None else None
        return _is(node, "Transpose") and a is not None and tuple(a.as_ints()) == perm

    t1 = p.inputs[0].producer() if p.inputs[0] is not None else None
    if not tr(t1) or not _only_reader(p.inputs[0]):
        return None
    mm = t1.inputs[0].producer() if t1.inputs[0] is not None else None  # type: ignore[union-attr]
    if not _is(mm, "MatMul") or not _only_reader(t1.inputs[0]) or not _only_reader(mm.inputs[1]):  # type: ignore[union-attr]
        return None
    t2 = mm.inputs[1].producer()  # type: ignore[union-attr]
    if not tr(t2) or not _only_reader(t2.inputs[0]):  # type: ignore[union-attr]
        return None
    r2 = t2.inputs[0].producer()  # type: ignore[union-attr]
    if not _is(r2, "Reshape") or p.graph is None:
        return None
    # the shapes, asked once the nodes are an attention's: the query sweeps the graph as it is now (earlier folds of
    # the run may have written into it)
    shapes = ShapeQuery(p.graph)
    # the merge: its last axis is the n channels of X (measured), so [.., n] or [.., -1] merge (H, D) row-major
    if _shape_tail(shapes, p.inputs[1], 1) not in ([n], [-1]):
        return None
    hd = _shape_tail(shapes, r2.inputs[1], 2)  # type: ignore[union-attr]
    v = r2.inputs[0]  # type: ignore[union-attr]
    prod = v.producer() if v is not None else None
    if hd is None or hd[1] <= 0 or n % hd[1] or not _only_reader(v) or prod is None:
        return None
    if hd[0] == -1:  # [.., -1, D]: the split is (n / D, D) when the leading entries are v's own leading dims
        same = {id(v), *(id(i) for i in prod.inputs[:1] if i is not None)}
        mm_v = prod.inputs[1].producer() if prod.op_type == "Add" and prod.inputs[1] is not None else None
        mm_v = mm_v or (prod.inputs[0].producer() if prod.op_type == "Add" and prod.inputs[0] is not None else None)
        t = mm_v.inputs[0] if mm_v is not None else None
        while t is not None:  # the values' input, and what it is made of by a per-channel Mul (a smoothing)
            same.add(id(t))
            mul = t.producer()
            c = _const_1d(mul.inputs[1], n) if _is(mul, "Mul") and mul.inputs[1] is not None else None  # type: ignore[union-attr]
            t = mul.inputs[0] if c is not None else None  # type: ignore[union-attr]
        if not _leading_dims_of(r2.inputs[1], same):  # type: ignore[union-attr]
            return None
    elif hd[0] * hd[1] != n:
        return None
    # the value projection itself: MatMul, MatMul + bias, or Gemm (as in fold_target)
    found = _producer_columns(prod, v, n)  # type: ignore[arg-type]
    if found is None:
        return None
    where, targets, changed = found
    path = [v, r2.outputs[0], t2.outputs[0], mm.outputs[0], t1.outputs[0]]  # type: ignore[union-attr]
    return (f"{where}, through attention {mm.name}", targets,  # type: ignore[union-attr]
            changed + [t.name or "" for t in path if t is not None])
