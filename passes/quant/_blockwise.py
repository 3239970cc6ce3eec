"""Block-wise weight-only quantization in numpy: RTN, activation-aware (AWQ-style) and GPTQ-style.

A MatMul weight ``W`` is ``[K, N]`` (``Y = X @ W``).  It is cut along ``K`` into blocks of
``block_size`` rows (the last block zero-padded); every (block, column) pair gets one scale ``s`` and
one unsigned zero point ``z``, and holds unsigned codes ``q`` in ``[0, 2^bits - 1]``::

    W_hat[k, n] = (q[k, n] - z[b(k), n]) * s[b(k), n]

* **symmetric**: ``z = 2^(bits-1)`` (8 for 4 bits) and ``s = max|w| / (2^(bits-1) - 1)``;
* **asymmetric**: the block's range ``[min(w, 0), max(w, 0)]`` is mapped onto ``[0, 2^bits - 1]``.

Algorithms (each returns the same :class:`BlockQuantized`):

``rtn``
    round to nearest with the block's full range.
``awq``
    activation-aware: a per-input-channel scale ``a`` (``a = mean|x|^alpha``, ``alpha`` searched on a
    grid) is multiplied into the weight rows before quantization and divided out of the activations
    (the caller inserts or folds ``X / a``); then a clip search picks, for every block and column,
    the range shrink ``r`` in ``[0.5, 1]`` that minimises the activation-weighted error
    ``sum_k E[x_k^2] (w - w_hat)^2``.  Both searches are measured on the layer's calibration inputs.
``gptq``
    error compensation from the layer inputs' Hessian ``H = E[x x^T]`` (Frantar et al., 2022):
    rows are quantized one at a time and the rounding error of each is spread over the rows not yet
    quantized through the Cholesky factor of ``H^-1``; ``damp`` (fraction of ``mean(diag H)`` added
    to the diagonal) keeps ``H`` invertible, ``act_order`` quantizes rows by decreasing ``diag H``
    (block parameters are then fixed beforehand, from the clip search, so blocks stay contiguous in
    ``K`` as the kernels need).

Codes are packed as ONNX Runtime's ``MatMulNBits`` stores them (:func:`pack_nbits`): ``[N, blocks,
block_size * bits / 8]`` bytes, 4-bit codes two to a byte, the lower ``k`` in the low nibble.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BlockQuantized",
    "QuantSpec",
    "awq_scales",
    "cholesky_of_inverse",
    "GptqFactor",
    "gptq",
    "gptq_factor",
    "pack_nbits",
    "quantize",
    "rtn",
    "search_params",
    "unpack_nbits",
]

CLIP_GRID = tuple(float(r) for r in np.linspace(1.0, 0.5, 21))
AWQ_GRID = tuple(float(a) for a in np.linspace(0.0, 1.0, 21)[:-1])


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    block_size: int = 128
    symmetric: bool = False

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    @property
    def mid(self) -> int:
        return 1 << (self.bits - 1)


@dataclass
class BlockQuantized:
    """Codes ``q`` ``[K_padded, N]`` (uint8), ``scale`` ``[blocks, N]`` (float32), ``zero`` ``[blocks, N]`` (uint8)."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    k: int
    spec: QuantSpec

    def dequantize(self) -> np.ndarray:
        bs = self.spec.block_size
        s = np.repeat(self.scale, bs, axis=0)
        z = np.repeat(self.zero.astype(np.float32), bs, axis=0)
        return ((self.q.astype(np.float32) - z) * s)[: self.k]


def _blocks(w: np.ndarray, bs: int) -> np.ndarray:
    k, n = w.shape
    nb = -(-k // bs)
    if nb * bs != k:
        w = np.concatenate([w, np.zeros((nb * bs - k, n), w.dtype)], axis=0)
    return w.reshape(nb, bs, n)


def _params(wb: np.ndarray, spec: QuantSpec, ratio: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point per (block, column) of blocked weights ``[nb, bs, N]``, range shrunk by ``ratio``."""
    if spec.symmetric:
        amax = np.abs(wb).max(axis=1) * ratio
        scale = amax / (spec.mid - 1)
        zero = np.full(scale.shape, spec.mid, np.float32)
    else:
        hi = np.maximum(wb.max(axis=1), 0.0) * ratio
        lo = np.minimum(wb.min(axis=1), 0.0) * ratio
        scale = (hi - lo) / spec.qmax
        safe = np.where(scale > 0, scale, 1.0)
        zero = np.clip(np.round(-lo / safe), 0, spec.qmax)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return scale, zero.astype(np.float32)


def _codes(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, spec: QuantSpec) -> np.ndarray:
    return np.clip(np.round(w / scale + zero), 0, spec.qmax)


def search_params(w: np.ndarray, spec: QuantSpec, importance: np.ndarray | None = None,
                  grid: tuple[float, ...] = CLIP_GRID) -> tuple[np.ndarray, np.ndarray]:
    """Per (block, column) the clip ratio of ``grid`` minimising ``sum_k importance_k (w - w_hat)^2``."""
    bs = spec.block_size
    wb = _blocks(w.astype(np.float32), bs)
    d = np.ones(w.shape[0], np.float32) if importance is None else importance.astype(np.float32)
    db = _blocks(d[:, None], bs)  # [nb, bs, 1]
    best_err = np.full((wb.shape[0], wb.shape[2]), np.inf, np.float32)
    best_s = np.ones_like(best_err)
    best_z = np.zeros_like(best_err)
    for r in grid:
        s, z = _params(wb, spec, r)
        q = _codes(wb, s[:, None, :], z[:, None, :], spec)
        err = (db * (wb - (q - z[:, None, :]) * s[:, None, :]) ** 2).sum(axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_z = np.where(better, z, best_z)
    return best_s, best_z


def quantize(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, spec: QuantSpec) -> BlockQuantized:
    """Codes of ``w`` ``[K, N]`` for given block parameters ``[blocks, N]``."""
    wb = _blocks(w.astype(np.float32), spec.block_size)
    q = _codes(wb, scale[:, None, :], zero[:, None, :], spec)
    return BlockQuantized(q.reshape(-1, w.shape[1]).astype(np.uint8), scale.astype(np.float32),
                          zero.astype(np.uint8), w.shape[0], spec)


def rtn(w: np.ndarray, spec: QuantSpec) -> BlockQuantized:
    """Round to nearest, full block range."""
    s, z = _params(_blocks(w.astype(np.float32), spec.block_size), spec)
    return quantize(w, s, z, spec)


def awq_scales(weights: list[np.ndarray], x: np.ndarray, spec: QuantSpec,
               grid: tuple[float, ...] = AWQ_GRID) -> tuple[np.ndarray, float]:
    """The per-input-channel scale ``a`` (``[K]``) for weights sharing input ``x`` (``[rows, K]``), and its alpha.

    ``a = mean|x|^alpha`` (normalised to geometric mean 1) for the ``alpha`` of ``grid`` that minimises
    ``sum_W ||x @ W - (x / a) @ Q(a W)||^2`` with RTN ``Q``; ``alpha = 0`` (``a = 1``) is in the grid, so the
    result is never worse than plain RTN on these rows.
    """
    x = x.astype(np.float32)
    mean_abs = np.abs(x).mean(axis=0) + 1e-8
    refs = [x @ w for w in weights]
    best = (np.inf, np.ones(x.shape[1], np.float32), 0.0)
    for alpha in grid:
        a = mean_abs ** alpha
        a = a / np.exp(np.log(a).mean())
        a = np.clip(a, 1e-4, 1e4).astype(np.float32)
        xs = x / a
        err = 0.0
        for w, ref in zip(weights, refs):
            dq = rtn(w * a[:, None], spec).dequantize()
            err += float(((xs @ dq - ref) ** 2).sum())
        if err < best[0]:
            best = (err, a, alpha)
    return best[1], best[2]


@dataclass
class GptqFactor:
    """What GPTQ needs of a Hessian ``H`` ``[K, K]``, made once for every layer sharing it (:func:`gptq_factor`):
    the row order ``perm``, the upper Cholesky factor ``hinv`` of the permuted, damped ``H^-1``, ``diag``
    (``diag H`` with dead rows set to 1) and ``dead`` (rows whose ``diag H <= 0``)."""

    perm: np.ndarray
    hinv: np.ndarray
    diag: np.ndarray
    dead: np.ndarray


def _permute(h: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """``h[np.ix_(perm, perm)]`` computed in ``h``'s own buffer (one row of scratch, not a second ``[K, K]``)."""
    k = h.shape[0]
    for i in range(k):
        h[i] = h[i, perm]
    done = perm == np.arange(k)
    for start in range(k):  # rows: new[i] = old[perm[i]], one cycle of the permutation at a time
        if done[start]:
            continue
        first = h[start].copy()
        i = start
        while True:
            done[i] = True
            j = int(perm[i])
            if j == start:
                h[i] = first
                break
            h[i] = h[j]
            i = j
    return h


def gptq_factor(h: np.ndarray, *, damp: float = 0.01, act_order: bool = False, consume: bool = False) -> GptqFactor:
    """:class:`GptqFactor` of ``h``: the figures :func:`gptq` computes from ``h`` itself, bit for bit.

    ``consume``: ``h`` (float64, C order) is the caller's to give away: it is changed in place (permuted and
    damped) instead of copied, so one ``[K, K]`` matrix fewer is alive at once (the Hessian of a
    14336-wide FFN input is 1.6 GB in float64).
    """
    k = h.shape[0]
    own = consume and h.dtype == np.float64 and h.flags.c_contiguous and h.flags.writeable
    h = h if own else np.array(h, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    diag = np.diag(h).copy()
    perm = np.argsort(-diag, kind="stable") if act_order else np.arange(k)
    h = _permute(h, perm)
    h[np.diag_indices(k)] += damp * float(np.mean(diag))
    try:
        hinv = cholesky_of_inverse(h).T  # upper Cholesky factor of H^-1
    except np.linalg.LinAlgError:
        h[np.diag_indices(k)] += 10 * damp * float(np.mean(diag))
        hinv = cholesky_of_inverse(h).T
    return GptqFactor(perm, hinv, diag, dead)


@functools.lru_cache(maxsize=1)
def _numpy_lapack() -> tuple[Any, Any] | None:
    """``dgesv`` and ``dpotrf`` of the LAPACK numpy's own ``linalg`` calls (the scipy-openblas64 library its
    wheels bundle, 64-bit integers), or ``None`` where it is not that library or cannot be found (then
    :func:`cholesky_of_inverse` uses numpy itself).  Found among this process's maps, after numpy's
    ``linalg`` has loaded it: only the library numpy already runs, never another one."""
    import numpy.linalg  # noqa: F401 - loads numpy's LAPACK

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if not (name.startswith("libscipy_openblas64_") and ".so" in name):
            continue
        try:
            lib = ctypes.CDLL(path)
            gesv, potrf = lib.scipy_dgesv_64_, lib.scipy_dpotrf_64_
        except (OSError, AttributeError):
            continue
        return gesv, potrf
    return None


def cholesky_of_inverse(h: np.ndarray) -> np.ndarray:
    """``np.linalg.cholesky(np.linalg.inv(h))`` (the lower factor, C order), bit for bit, in less memory.

    numpy's ``inv`` copies ``h`` and an identity into LAPACK's buffers and the result out of them, and
    ``cholesky`` copies again: four ``[K, K]`` float64 matrices at once with ``h`` (the Hessian of a
    4096-wide FFN input: 512 MiB).  Here the same LAPACK routines numpy calls (``dgesv`` on a copy of ``h``
    and the identity, then ``dpotrf`` on the inverse, in place) are called on buffers made once: three
    matrices at most, ``h`` left as it was.  Where numpy's LAPACK is not the library
    :func:`_numpy_lapack` knows, numpy itself.  Raises ``np.linalg.LinAlgError`` where numpy does (``h``
    singular, its inverse not positive definite).
    """
    routines = _numpy_lapack() if h.ndim == 2 and h.shape[0] == h.shape[1] and h.dtype == np.float64 else None
    if routines is None:
        return np.linalg.cholesky(np.linalg.inv(h))
    gesv, potrf = routines
    n = h.shape[0]
    ptr = ctypes.c_void_p
    size, info = ctypes.c_int64(n), ctypes.c_int64(0)
    a = np.array(h, order="F")  # LU factors: dgesv overwrites it
    b = np.eye(n, order="F")  # the identity, then H^-1
    pivots = np.empty(max(n, 1), np.int64)
    gesv(ctypes.byref(size), ctypes.byref(size), a.ctypes.data_as(ptr), ctypes.byref(size),
         pivots.ctypes.data_as(ptr), b.ctypes.data_as(ptr), ctypes.byref(size), ctypes.byref(info))
    del a
    if info.value > 0:
        raise np.linalg.LinAlgError("Singular matrix")
    if info.value < 0:  # pragma: no cover - an argument LAPACK refused: numpy's own path says what
        return np.linalg.cholesky(np.linalg.inv(h))
    lower = ctypes.c_char(b"L")
    potrf(ctypes.byref(lower), ctypes.byref(size), b.ctypes.data_as(ptr), ctypes.byref(size), ctypes.byref(info),
          ctypes.c_size_t(1))
    if info.value > 0:
        raise np.linalg.LinAlgError("Matrix is not positive definite")
    if info.value < 0:  # pragma: no cover
        return np.linalg.cholesky(np.linalg.inv(h))
    for j in range(1, n):  # the upper triangle (dpotrf leaves the inverse there): zeros, as numpy returns
        b[:j, j] = 0.0
    return np.ascontiguousarray(b)


def gptq(w: np.ndarray, h: np.ndarray | None, spec: QuantSpec, *, damp: float = 0.01, act_order: bool = False,
         importance: np.ndarray | None = None, step: int = 128, factor: GptqFactor | None = None) -> BlockQuantized:
    """GPTQ of ``w`` ``[K, N]`` given the inputs' Hessian ``h`` ``[K, K]`` (``E[x x^T]``, any positive scale).

    Block parameters come from :func:`search_params` (activation-weighted clip search) on the weights as
    they stand when a block is reached (without ``act_order``), or on the original weights (with it).
    ``factor``: :func:`gptq_factor` of ``h`` made beforehand (with the same ``damp`` and ``act_order``); ``h``
    is then not read and may be ``None``.
    """
    k, n = w.shape
    bs = spec.block_size
    nb = -(-k // bs)
    if factor is None:
        assert h is not None
        factor = gptq_factor(h, damp=damp, act_order=act_order)
    perm, hinv, diag, dead = factor.perm, factor.hinv, factor.diag, factor.dead
    imp = importance if importance is not None else diag
    scale = np.ones((nb, n), np.float32)
    zero = np.zeros((nb, n), np.float32)
    fixed = act_order
    if fixed:
        w32 = np.array(w, np.float32)  # the float64 copy below, dead rows zeroed, rounded back: the same numbers
        w32[dead, :] = 0.0
        scale, zero = search_params(w32, spec, imp)
        del w32
    # the rows permuted in the weight's own type, then widened: the same float64 numbers as widening first
    # and permuting, without two float64 copies at once (an LM head's: 2 x 160 MB at hidden 1024, vocab 19k)
    w = np.asarray(w)[perm].astype(np.float64, copy=False)  # [perm] is a new array: ours to change
    w[dead[perm], :] = 0.0
    q = np.zeros((k, n), np.float32)
    have = np.zeros(nb, bool)
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        w1 = w[i1:i2].copy()
        err1 = np.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            row = perm[i1 + j]
            b = row // bs
            if not fixed and not have[b]:
                # the block's rows in original order are perm[i: i + bs] when act_order is off
                lo = i1 + j
                blk = np.concatenate([w1[j:], w[i2:]], axis=0)[: min(bs, k - lo)]
                s, z = search_params(blk.astype(np.float32), QuantSpec(spec.bits, blk.shape[0], spec.symmetric),
                                     imp[perm[lo: lo + blk.shape[0]]])
                scale[b], zero[b] = s[0], z[0]
                have[b] = True
            col = w1[j]
            qc = np.clip(np.round(col / scale[b] + zero[b]), 0, spec.qmax)
            q[row] = qc
            dq = (qc - zero[b]) * scale[b]
            e = (col - dq) / hinv1[j, j]
            w1[j + 1:] -= np.outer(hinv1[j, j + 1:], e)
            err1[j] = e
        w[i2:] -= hinv[i1:i2, i2:].T @ err1
    codes = np.zeros((nb * bs, n), np.uint8)
    codes[:k] = q.astype(np.uint8)
    codes[k:] = np.clip(np.round(zero[-1]), 0, spec.qmax).astype(np.uint8)  # padding dequantizes to 0
    return BlockQuantized(codes, scale, zero.astype(np.uint8), k, spec)


def pack_nbits(bq: BlockQuantized) -> np.ndarray:
    """Codes as ``MatMulNBits`` input B: uint8 ``[N, blocks, block_size * bits / 8]``."""
    bs = bq.spec.block_size
    n = bq.q.shape[1]
    t = np.ascontiguousarray(bq.q.T).reshape(n, -1, bs)
    if bq.spec.bits == 8:
        return t.astype(np.uint8)
    return (t[..., 0::2] | (t[..., 1::2] << 4)).astype(np.uint8)


def unpack_nbits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_nbits`: codes ``[N, blocks, block_size]``."""
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)
