"""Numpy reference implementations of mograph's fused ops: the ground truth for kernels and lowerings.

This is the one numpy reference of each op: ``CustomOp.reference`` of the ``mograph`` domain
(``mograph.passes.fusion.ops``) calls these functions, and the CUDA kernels' tests compare against them.

Semantics shared with the CUDA kernels (``include/mograph_kernels.h``):

* All ops work over the last axis; leading axes are rows. Inputs of any float dtype numpy can cast
  (float32, float16, ``ml_dtypes.bfloat16``) are upcast to float32, computed, and the result is cast back
  to the input's dtype once (round to nearest even). float64 inputs are computed in float64 (no kernel
  takes them; the ONNX function bodies do).
* Reductions (mean, variance, mean of squares) accumulate in float32; the variance is the population
  variance of the deviations from the mean (two-pass, no E[x^2] - E[x]^2 cancellation).
* SkipLayerNorm rounds ``s = x + skip (+ bias)`` to the input dtype before normalizing, as the unfused
  Add -> LayerNorm graph does; the optional second output is that rounded ``s``. The float32 sum is taken
  as ``(x + bias) + skip``, the order of the ops' ONNX function bodies (the kernels add ``skip`` first: the two
  differ by the float32 rounding of one addition).
* BiasGelu adds the bias in float32 and does not round the sum before the gelu.
* Gelu is elementwise: it is evaluated in float64 from the float32 input and rounded once (numpy has no
  erf, so the module carries its own float64 erfc; float64 also keeps the negative tail exact, where
  ``1 + erf`` and ``1 + tanh`` cancel). QuickGelu (``x sigmoid(alpha x)``, no kernel) is computed in float32.
* gamma, beta and bias are ``[hidden]`` vectors or single elements broadcast over the row; gamma may be
  ``None`` (no scale), as in a fusion without one.

Pure numpy, no torch: it must run wherever mograph's tests run.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

__all__ = [
    "QUICK_GELU_ALPHA",
    "bias_gelu",
    "erfc",
    "gelu",
    "layer_norm",
    "quick_gelu",
    "rms_norm",
    "skip_layer_norm",
    "skip_rms_norm",
]

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_TANH_K = math.sqrt(2.0 / math.pi)
QUICK_GELU_ALPHA = 1.702


def erfc(z: np.ndarray | float) -> np.ndarray:
    """Complementary error function in float64, relative error below 1e-12 wherever the result is normal.

    |z| < 2: 1 - erf(z) with erf from its Maclaurin series (32 terms; at |z| = 2 the terms cancel from
    about 30 down, costing under two of sixteen digits). |z| >= 2: the continued fraction
    erfc(z) = exp(-z^2) / sqrt(pi) / (z + (1/2) / (z + 1 / (z + (3/2) / (z + ...)))), evaluated backwards
    from depth 40, which has converged there; erfc(-z) = 2 - erfc(z). Each branch runs on its own
    elements only.
    """
    z = np.asarray(z, dtype=np.float64)
    out = np.empty_like(z)
    large = np.abs(z) >= 2.0

    zs = z[~large]
    if zs.size:
        z2 = zs * zs
        term = zs.copy()
        series = zs.copy()
        for n in range(1, 33):
            term *= z2
            term *= -1.0 / n
            series += term / (2 * n + 1)
        out[~large] = 1.0 - (2.0 * _INV_SQRT_PI) * series

    zl = z[large]
    if zl.size:
        a = np.abs(zl)
        frac = a.copy()
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            for k in range(40, 0, -1):
                frac = a + (0.5 * k) / frac
            tail = np.exp(-a * a) * _INV_SQRT_PI / frac
        out[large] = np.where(zl > 0, tail, 2.0 - tail)
    return out


def _check_vector(name: str, v: np.ndarray | None, hidden: int, ctype: np.dtype) -> np.ndarray | None:
    """``v`` as a ``[hidden]`` (or one-element, broadcast) vector of the compute dtype; None stays None."""
    if v is None:
        return None
    v = np.asarray(v)
    if v.size in (hidden, 1):
        return v.reshape(-1).astype(ctype)
    raise ValueError(f"{name} must have shape ({hidden},) or one element, got {v.shape}")


def _ctype(x: np.ndarray) -> np.dtype:
    """The compute dtype: float64 for float64 inputs, float32 for every other one."""
    return np.dtype(np.float64 if x.dtype == np.float64 else np.float32)


def _f32(x: np.ndarray) -> np.ndarray:
    """``x`` in its compute dtype (float32; float64 stays float64)."""
    x = np.asarray(x)
    return x.astype(_ctype(x))


def _layer_norm_f32(
    s: np.ndarray, gamma: np.ndarray | None, beta: np.ndarray | None, eps: float
) -> np.ndarray:
    mean = np.mean(s, axis=-1, keepdims=True, dtype=s.dtype)
    d = s - mean
    var = np.mean(d * d, axis=-1, keepdims=True, dtype=s.dtype)
    y = d / np.sqrt(var + np.asarray(eps, dtype=s.dtype))
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def _rms_norm_f32(s: np.ndarray, gamma: np.ndarray | None, eps: float) -> np.ndarray:
    ms = np.mean(s * s, axis=-1, keepdims=True, dtype=s.dtype)
    y = s / np.sqrt(ms + np.asarray(eps, dtype=s.dtype))
    return y * gamma if gamma is not None else y


def _residual_sum(x: np.ndarray, skip: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``x + skip (+ bias)`` in the compute dtype, rounded to x's dtype (SkipLayerNorm / SkipRMSNorm)."""
    if skip.shape != x.shape:
        raise ValueError(f"skip must have x's shape {x.shape}, got {skip.shape}")
    s = _f32(x)
    bi = _check_vector("bias", bias, x.shape[-1], _ctype(x))
    if bi is not None:
        s = s + bi
    return (s + np.asarray(skip).astype(_ctype(x))).astype(x.dtype)


def layer_norm(
    x: np.ndarray, gamma: np.ndarray | None = None, beta: np.ndarray | None = None, eps: float = 1e-5
) -> np.ndarray:
    """y = (x - mean) / sqrt(var + eps) * gamma (+ beta) over the last axis; var is the population variance.

    Args:
        x: [..., hidden]; gamma, beta: [hidden] or one element (both optional); eps: added to the variance.
    Returns:
        y with x's shape and dtype.
    """
    x = np.asarray(x)
    ct, hidden = _ctype(x), x.shape[-1]
    g = _check_vector("gamma", gamma, hidden, ct)
    b = _check_vector("beta", beta, hidden, ct)
    return _layer_norm_f32(_f32(x), g, b, eps).astype(x.dtype)


def rms_norm(x: np.ndarray, gamma: np.ndarray | None = None, eps: float = 1e-5) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * gamma over the last axis; gamma: [hidden] (optional). Returns x's dtype."""
    x = np.asarray(x)
    g = _check_vector("gamma", gamma, x.shape[-1], _ctype(x))
    return _rms_norm_f32(_f32(x), g, eps).astype(x.dtype)


def skip_layer_norm(
    x: np.ndarray,
    skip: np.ndarray,
    gamma: np.ndarray | None = None,
    beta: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
    return_sum: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """s = x + skip (+ bias), rounded to x's dtype; y = layer_norm(s, gamma, beta, eps).

    Args:
        x, skip: [..., hidden] of one shape and dtype; gamma, beta, bias: [hidden] (all optional).
        return_sum: also return s (the op's optional second output).
    Returns:
        y, or (y, s) when return_sum; both with x's dtype.
    """
    x = np.asarray(x)
    s = _residual_sum(x, np.asarray(skip), bias)
    y = layer_norm(s, gamma, beta, eps)
    return (y, s) if return_sum else y


def skip_rms_norm(
    x: np.ndarray,
    skip: np.ndarray,
    gamma: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
    return_sum: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """s = x + skip (+ bias), rounded to x's dtype; y = rms_norm(s, gamma, eps). As skip_layer_norm, no beta."""
    x = np.asarray(x)
    s = _residual_sum(x, np.asarray(skip), bias)
    y = rms_norm(s, gamma, eps)
    return (y, s) if return_sum else y


def _gelu_f64(v: np.ndarray, approximate: str) -> np.ndarray:
    v = v.astype(np.float64)
    if approximate == "none":
        with np.errstate(invalid="ignore"):
            return 0.5 * v * erfc(-v / _SQRT_2)  # NaN at -inf (-inf * 0), as in PyTorch and the kernels
    if approximate == "tanh":
        u = _TANH_K * (v + 0.044715 * v * v * v)
        with np.errstate(over="ignore", invalid="ignore"):
            return v / (1.0 + np.exp(-2.0 * u))  # = 0.5 v (1 + tanh u), without the cancellation near -1
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def gelu(x: np.ndarray, approximate: Literal["none", "tanh", "sigmoid"] = "none") -> np.ndarray:
    """Gelu, elementwise. "none": 0.5 x (1 + erf(x / sqrt 2)); "tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    "sigmoid" is :func:`quick_gelu` with its default alpha. Returns x's shape and dtype.
    """
    x = np.asarray(x)
    if approximate == "sigmoid":
        return quick_gelu(x)
    return _gelu_f64(_f32(x), approximate).astype(x.dtype)


def quick_gelu(x: np.ndarray, alpha: float = QUICK_GELU_ALPHA) -> np.ndarray:
    """x sigmoid(alpha x), computed in float32 (float64 for float64 inputs). Returns x's shape and dtype."""
    x = np.asarray(x)
    xf = _f32(x)
    with np.errstate(over="ignore"):
        return (xf / (1.0 + np.exp(-alpha * xf))).astype(x.dtype)


def bias_gelu(x: np.ndarray, bias: np.ndarray, approximate: Literal["none", "tanh"] = "none") -> np.ndarray:
    """gelu(x + bias) with bias: [hidden] broadcast over the last axis; the sum is kept in float32."""
    x = np.asarray(x)
    b = _check_vector("bias", bias, x.shape[-1], _ctype(x))
    return gelu(_f32(x) + b, approximate).astype(x.dtype)
