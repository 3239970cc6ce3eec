"""Numpy reference implementations of mograph's fused ops: the ground truth for kernels and lowerings.

Semantics shared with the CUDA kernels (``include/mograph_kernels.h``):

* All ops work over the last axis; leading axes are rows. Inputs of any float dtype numpy can cast
  (float32, float16, ``ml_dtypes.bfloat16``) are upcast to float32, computed, and the result is cast back
  to the input's dtype once (round to nearest even).
* Reductions (mean, variance, mean of squares) accumulate in float32; the variance is the population
  variance of the deviations from the mean (two-pass, no E[x^2] - E[x]^2 cancellation).
* SkipLayerNorm rounds ``s = x + skip (+ bias)`` to the input dtype before normalizing, as the unfused
  Add -> LayerNorm graph does; the optional second output is that rounded ``s``.
* BiasGelu adds the bias in float32 and does not round the sum before the gelu.
* Gelu is elementwise: it is evaluated in float64 from the float32 input and rounded once (numpy has no
  erf, so the module carries its own float64 erfc; float64 also keeps the negative tail exact, where
  ``1 + erf`` and ``1 + tanh`` cancel).

Pure numpy, no torch: it must run wherever mograph's tests run.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

__all__ = ["bias_gelu", "erfc", "gelu", "layer_norm", "rms_norm", "skip_layer_norm", "skip_rms_norm"]

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_TANH_K = math.sqrt(2.0 / math.pi)


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


def _check_vector(name: str, v: np.ndarray | None, hidden: int) -> np.ndarray | None:
    if v is None:
        return None
    v = np.asarray(v)
    if v.shape != (hidden,):
        raise ValueError(f"{name} must have shape ({hidden},), got {v.shape}")
    return v.astype(np.float32)


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _layer_norm_f32(s: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, eps: float) -> np.ndarray:
    mean = np.mean(s, axis=-1, keepdims=True, dtype=np.float32)
    d = s - mean
    var = np.mean(d * d, axis=-1, keepdims=True, dtype=np.float32)
    y = d / np.sqrt(var + np.float32(eps)) * gamma
    if beta is not None:
        y = y + beta
    return y


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None = None, eps: float = 1e-5) -> np.ndarray:
    """y = (x - mean) / sqrt(var + eps) * gamma (+ beta) over the last axis; var is the population variance.

    Args:
        x: [..., hidden]; gamma, beta: [hidden] (beta optional); eps: added to the variance.
    Returns:
        y with x's shape and dtype.
    """
    x = np.asarray(x)
    hidden = x.shape[-1]
    g = _check_vector("gamma", gamma, hidden)
    b = _check_vector("beta", beta, hidden)
    return _layer_norm_f32(_f32(x), g, b, eps).astype(x.dtype)


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * gamma over the last axis; gamma: [hidden]. Returns x's dtype."""
    x = np.asarray(x)
    g = _check_vector("gamma", gamma, x.shape[-1])
    x32 = _f32(x)
    ms = np.mean(x32 * x32, axis=-1, keepdims=True, dtype=np.float32)
    return (x32 / np.sqrt(ms + np.float32(eps)) * g).astype(x.dtype)


def skip_layer_norm(
    x: np.ndarray,
    skip: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
    return_sum: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """s = x + skip (+ bias), rounded to x's dtype; y = layer_norm(s, gamma, beta, eps).

    Args:
        x, skip: [..., hidden] of one shape and dtype; gamma, beta, bias: [hidden] (beta, bias optional).
        return_sum: also return s (the op's optional second output).
    Returns:
        y, or (y, s) when return_sum; both with x's dtype.
    """
    x = np.asarray(x)
    skip = np.asarray(skip)
    if skip.shape != x.shape:
        raise ValueError(f"skip must have x's shape {x.shape}, got {skip.shape}")
    hidden = x.shape[-1]
    g = _check_vector("gamma", gamma, hidden)
    b = _check_vector("beta", beta, hidden)
    bi = _check_vector("bias", bias, hidden)
    s32 = _f32(x) + _f32(skip)
    if bi is not None:
        s32 = s32 + bi
    s = s32.astype(x.dtype)
    y = _layer_norm_f32(_f32(s), g, b, eps).astype(x.dtype)
    return (y, s) if return_sum else y



def skip_rms_norm(
    x: np.ndarray,
    skip: np.ndarray,
    gamma: np.ndarray,
    bias: np.ndarray | None = None,
    eps: float = 1e-5,
    return_sum: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """s = x + skip (+ bias), rounded to x's dtype; y = rms_norm(s, gamma, eps). As skip_layer_norm, no beta."""
    x = np.asarray(x)
    skip = np.asarray(skip)
    if skip.shape != x.shape:
        raise ValueError(f"skip must have x's shape {x.shape}, got {skip.shape}")
    bi = _check_vector("bias", bias, x.shape[-1])
    s32 = _f32(x) + _f32(skip)
    if bi is not None:
        s32 = s32 + bi
    s = s32.astype(x.dtype)
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


def gelu(x: np.ndarray, approximate: Literal["none", "tanh"] = "none") -> np.ndarray:
    """Gelu, elementwise. "none": 0.5 x (1 + erf(x / sqrt 2)); "tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    Returns x's shape and dtype.
    """
    x = np.asarray(x)
    return _gelu_f64(_f32(x), approximate).astype(x.dtype)


def bias_gelu(x: np.ndarray, bias: np.ndarray, approximate: Literal["none", "tanh"] = "none") -> np.ndarray:
    """gelu(x + bias) with bias: [hidden] broadcast over the last axis; the sum is kept in float32."""
    x = np.asarray(x)
    b = _check_vector("bias", bias, x.shape[-1])
    return _gelu_f64(_f32(x) + b, approximate).astype(x.dtype)
