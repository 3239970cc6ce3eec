"""Rules that grow a freshly fused norm over what surrounds it: Casts, the scale, the bias.

The core rules fuse only the normalisation (``(x - mean) / sqrt(var + eps)``, ``x / rms``) into a
``mograph`` norm with a placeholder scale of 1 (and bias of 0).  These rules then absorb, in graph
order, whatever the exporter put around it:

* ``Cast(norm(Cast(x0, to=float32)), to=dtype(x0))`` -> ``norm(x0, stash_type=float32)`` (fp16/bf16
  graphs that reduce in float32), and ``Cast`` to the dtype the norm already has (a no-op);
* ``norm(x) * scale`` -> ``norm(x, scale)`` when the norm's scale is still the placeholder 1 and
  ``scale`` broadcasts over the last axis only;
* ``norm(x, scale) + bias`` -> ``norm(x, scale, bias)`` likewise for a placeholder bias 0.

Splitting the fusion this way covers every order exporters use (scale before or after the cast
back, with or without scale or bias) with one core pattern.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion._common import is_float, mograph_op, norm_attrs
from mograph.passes.fusion.ops import body_supports

from mograph.custom_ops import DOMAIN
from mograph.patterns import MatchResult, OrValue, Rule, constant_array

__all__ = ["NormCastFusion", "NormScaleFusion", "NormBiasFusion"]


def _norm(op: Any, kinds: tuple[str, ...], x: Any, s0: Any, b0: Any) -> Any:
    alts = []
    for kind in kinds:
        if kind == "LayerNorm":
            alts.append(op.LayerNorm(x, s0, b0, _domain=DOMAIN, _outputs=["norm_out"]))
        else:
            alts.append(op.RMSNorm(x, s0, _domain=DOMAIN, _outputs=["norm_out"]))
    return alts[0] if len(alts) == 1 else OrValue(alts)


def _all(value: ir.Value | None, fill: float) -> bool:
    if value is None:
        return fill == 0.0
    arr = constant_array(value)
    return arr is not None and bool(np.all(arr == fill))


def _broadcast_vector(x: ir.Value, v: ir.Value) -> MatchResult | np.ndarray | ir.Value:
    """``v`` if it broadcasts over x's last axis only: a constant array (1-D) or a 1-D value."""
    arr = constant_array(v)
    rank_x = len(x.shape) if x.shape is not None else None
    hidden = x.shape[-1] if x.shape is not None and rank_x else None
    if arr is not None:
        if arr.ndim > 1 and any(d != 1 for d in arr.shape[:-1]):
            return MatchResult().fail(f"'{v.name}' does not broadcast over the last axis only", v)
        if rank_x is not None and arr.ndim > rank_x:
            return MatchResult().fail(f"'{v.name}' has a higher rank than the input", v)
        if isinstance(hidden, int) and arr.size not in (1, hidden):
            return MatchResult().fail(f"'{v.name}' has {arr.size} elements, the last axis {hidden}", v)
        return arr.reshape(-1)
    if v.shape is not None and len(v.shape) == 1:
        return v
    return MatchResult().fail(f"'{v.name}' is not a constant and not 1-D", v)


def _as_input(op: Any, arr_or_value: np.ndarray | ir.Value, dtype: ir.DataType | None, base: str) -> Any:
    if isinstance(arr_or_value, ir.Value):
        return arr_or_value
    arr = arr_or_value.astype(dtype.numpy() if dtype is not None else arr_or_value.dtype)
    return op.initializer(ir.tensor(arr), name=f"{base}_{arr.size}")


class _NormRule(Rule):
    min_candidate_nodes = 10**6  # absorption never reports near misses: the core rule does

    def __init__(self, kinds: tuple[str, ...] = ("LayerNorm", "RMSNorm")) -> None:
        super().__init__()
        self.kinds = kinds
        if len(kinds) == 1:
            self.name = type(self).__name__.replace("Norm", kinds[0], 1)

    @staticmethod
    def _rebuild(op: Any, node: ir.Node, x: Any, scale: Any, bias: Any, **overrides: Any) -> Any:
        attrs = norm_attrs(node)
        attrs.update(overrides)
        if node.op_type == "LayerNorm":
            return mograph_op(op, "LayerNorm", x, scale, bias, **attrs)
        return mograph_op(op, "RMSNorm", x, scale, **attrs)


class NormCastFusion(_NormRule):
    """Cast(norm(Cast(x0, to=f32)), to=dtype(x0)) -> norm(x0, stash_type=f32); no-op Casts dropped."""

    def pattern(self, op: Any, xin: Any, s0: Any, b0: Any, to: Any) -> Any:
        return op.Cast(_norm(op, self.kinds, xin, s0, b0), to=to)

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              xin: ir.Value, s0: ir.Value, b0: ir.Value | None, to: ir.Attr, norm_out: ir.Value,
              **_: Any) -> MatchResult:
        target = ir.DataType(to.value)
        self._x0 = None
        if target == xin.dtype:
            return self.ok()
        cast_in = xin.producer()
        if cast_in is None or cast_in.op_type != "Cast":
            return self.fail("the Cast after the norm does not undo a Cast before it", norm_out)
        x0 = cast_in.inputs[0]
        if x0 is None or x0.dtype != target or not is_float(x0):
            return self.fail("the Casts around the norm do not restore the input dtype", norm_out)
        if xin.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            return self.fail("the norm is not computed in float32 or float64", norm_out)
        if not body_supports(getattr(self, "model_opset", 17), x0.dtype):
            return self.fail("an fp16/bf16 norm needs opset >= 15", norm_out)
        for v in (s0, b0):
            if v is not None and constant_array(v) is None:
                return self.fail(f"'{v.name}' is not a constant, its dtype cannot follow the input's", v)
        self._x0 = x0
        return self.ok()

    def rewrite(self, op: Any, xin: ir.Value, s0: ir.Value, b0: ir.Value | None, norm_out: ir.Value,
                **_: Any) -> Any:
        node = norm_out.producer()
        assert node is not None
        if self._x0 is None:
            return self._rebuild(op, node, xin, s0, b0)
        x0 = self._x0
        s = _as_input(op, constant_array(s0).reshape(-1), x0.dtype, "mograph_norm_scale")  # type: ignore[union-attr]
        b = None if b0 is None else _as_input(op, constant_array(b0).reshape(-1), x0.dtype, "mograph_norm_bias")  # type: ignore[union-attr]
        return self._rebuild(op, node, x0, s, b, stash_type=int(xin.dtype))  # type: ignore[arg-type]

    def variant(self, bindings: dict[str, Any]) -> str | None:
        return "identity" if self._x0 is None else "stash"


class NormScaleFusion(_NormRule):
    """norm(x, 1) * scale -> norm(x, scale) for a scale broadcast over the last axis."""

    def pattern(self, op: Any, x: Any, s0: Any, b0: Any, scale: Any) -> Any:
        return op.Mul(_norm(op, self.kinds, x, s0, b0), scale)

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, s0: ir.Value, b0: ir.Value | None, scale: ir.Value, **_: Any) -> MatchResult:
        if not _all(s0, 1.0) or not _all(b0, 0.0):
            return self.fail("the norm already has a scale or bias", s0)
        if scale.dtype != x.dtype:
            return self.fail("scale's dtype differs from the input's", scale)
        vec = _broadcast_vector(x, scale)
        if isinstance(vec, MatchResult):
            return vec
        self._scale = vec
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, b0: ir.Value | None, norm_out: ir.Value, **_: Any) -> Any:
        node = norm_out.producer()
        assert node is not None
        s = _as_input(op, self._scale, x.dtype, "mograph_norm_scale")
        return self._rebuild(op, node, x, s, b0)


class NormBiasFusion(_NormRule):
    """LayerNorm(x, scale, 0) + bias -> LayerNorm(x, scale, bias)."""

    def __init__(self) -> None:
        super().__init__(("LayerNorm",))
        self.name = "LayerNormBiasFusion"

    def pattern(self, op: Any, x: Any, s0: Any, b0: Any, bias: Any) -> Any:
        return op.Add(_norm(op, self.kinds, x, s0, b0), bias)

    def check(self, context: Any,  # type: ignore[override]  # bindings come by keyword
              x: ir.Value, b0: ir.Value | None, bias: ir.Value, **_: Any) -> MatchResult:
        if not _all(b0, 0.0):
            return self.fail("the norm already has a bias", b0)
        if bias.dtype != x.dtype:
            return self.fail("bias dtype differs from the input's", bias)
        vec = _broadcast_vector(x, bias)
        if isinstance(vec, MatchResult):
            return vec
        self._bias = vec
        return self.ok()

    def rewrite(self, op: Any, x: ir.Value, s0: ir.Value, norm_out: ir.Value, **_: Any) -> Any:
        node = norm_out.producer()
        assert node is not None
        b = _as_input(op, self._bias, x.dtype, "mograph_norm_bias")
        return self._rebuild(op, node, x, s0, b)
