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

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BlockQuantized",
    "QuantSpec",
    "awq_scales",
    "blas_threads",
    "cholesky_of_inverse",
    "GptqFactor",
    "inverse_upper_factor",
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
#: numpy's BLAS threads for GPTQ's factor and row updates (:func:`blas_threads` says why one)
GPTQ_BLAS_THREADS = 1


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


def _extremes(wb: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per (block, column) of blocked weights ``[nb, bs, N]``: ``(max|w|, max|w|)`` (symmetric) or
    ``(max(w, 0), min(w, 0))``, the range :func:`_params` shrinks."""
    if spec.symmetric:
        amax = np.abs(wb).max(axis=1)
        return amax, amax
    return np.maximum(wb.max(axis=1), 0.0), np.minimum(wb.min(axis=1), 0.0)


def _params(wb: np.ndarray, spec: QuantSpec, ratio: np.ndarray | float = 1.0,
            extremes: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point per (block, column) of blocked weights ``[nb, bs, N]``, range shrunk by ``ratio``
    (``extremes``: :func:`_extremes` of ``wb``, made once for many ratios)."""
    top, bottom = _extremes(wb, spec) if extremes is None else extremes
    if spec.symmetric:
        amax = top * ratio
        scale = amax / (spec.mid - 1)
        zero = np.full(scale.shape, spec.mid, np.float32)
    else:
        hi = top * ratio
        lo = bottom * ratio
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
    ext = _extremes(wb, spec)
    t = np.empty_like(wb)  # one scratch buffer for every ratio; the same operations as _codes and the error
    for r in grid:
        s, z = _params(wb, spec, r, ext)
        s3, z3 = s[:, None, :], z[:, None, :]
        np.divide(wb, s3, out=t)
        t += z3
        np.round(t, out=t)
        np.clip(t, 0, spec.qmax, out=t)  # the codes q
        t -= z3
        t *= s3
        np.subtract(wb, t, out=t)
        np.square(t, out=t)
        t *= db
        err = t.sum(axis=1)
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
    with blas_threads(GPTQ_BLAS_THREADS):
        try:
            hinv = inverse_upper_factor(h)  # upper Cholesky factor of H^-1
        except np.linalg.LinAlgError:
            h[np.diag_indices(k)] += 10 * damp * float(np.mean(diag))
            hinv = inverse_upper_factor(h)
    return GptqFactor(perm, hinv, diag, dead)


@functools.lru_cache(maxsize=1)
def _numpy_openblas() -> Any:
    """The scipy-openblas64 library numpy's wheels bundle, as this process has loaded it for numpy's own
    ``linalg`` (found among the process's maps: only the library numpy already runs, never another one), or
    ``None`` where numpy's BLAS is another library or cannot be found."""
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
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def _numpy_lapack() -> tuple[Any, Any, Any] | None:
    """``dgesv``, ``dpotrf`` and ``dtrtri`` of the LAPACK numpy's own ``linalg`` calls (:func:`_numpy_openblas`,
    64-bit integers), or ``None`` where it is not that library or cannot be found (then
    :func:`cholesky_of_inverse` and :func:`inverse_upper_factor` use numpy itself)."""
    lib = _numpy_openblas()
    try:
        return (lib.scipy_dgesv_64_, lib.scipy_dpotrf_64_, lib.scipy_dtrtri_64_) if lib is not None else None
    except AttributeError:
        return None


@contextlib.contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """numpy's BLAS (:func:`_numpy_openblas`) at ``n`` threads inside the block, its own count restored after;
    nothing where that library is not found.  A product's numbers are the same at any count (OpenBLAS splits
    it by blocks of the output); ``dpotrf`` and ``dtrtri`` block differently with threads, so GPTQ's factor
    now comes out the same whatever the machine's thread count (rounding apart, it did before too).

    GPTQ's factor and row updates run at one thread: on the 2-core development machine shared with other
    work (load 5-9), the factor of a 576-wide Hessian took 2.4 s of wall at OpenBLAS's 2 threads and 0.05 s
    at one, a 2048 x 8192 layer's update 12.3 s and 7.2 s, a 4096-wide factor 7.2 s and 3.5 s: the
    threads wait on each other (OpenBLAS spins) for products too small to share (``benchmarks/quantize-time.md``).
    """
    lib = _numpy_openblas()
    get = getattr(lib, "scipy_openblas_get_num_threads64_", None) if lib is not None else None
    put = getattr(lib, "scipy_openblas_set_num_threads64_", None) if lib is not None else None
    if get is None or put is None:
        yield
        return
    before = int(get())
    if before == n:
        yield
        return
    put(ctypes.c_int(n))
    try:
        yield
    finally:
        put(ctypes.c_int(before))


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
    gesv, potrf = routines[:2]
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


def inverse_upper_factor(h: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor ``U`` of ``H^-1`` (``U^T U = H^-1``; ``cholesky_of_inverse(h).T``, F order)
    from the Cholesky factor of ``h`` itself, without forming ``H^-1``.

    With ``J`` the order-reversing permutation, the Cholesky factor ``L`` of ``J H J`` gives ``H = V V^T`` with
    ``V = J L J`` upper, so ``H^-1 = (V^-1)^T V^-1`` and ``U = V^-1 = J L^-1 J`` (both factors are unique with
    a positive diagonal): one ``dpotrf`` and one ``dtrtri`` (``2/3 K^3`` flops) where inverting ``h`` with
    ``dgesv`` and factoring the inverse take ``3 K^3``, in two ``[K, K]`` buffers with ``h`` (left as it
    was).  The same matrix up to rounding (a different order of the same sums; the tests bound the
    difference).  Raises ``np.linalg.LinAlgError`` where ``h`` is not positive definite.
    """
    h = np.asarray(h, np.float64)
    n = h.shape[0]
    routines = _numpy_lapack() if h.ndim == 2 and n == h.shape[1] else None
    if routines is None or n == 0:
        low = np.linalg.cholesky(np.ascontiguousarray(h[::-1, ::-1]))  # J H J = L L^T
        inv = np.linalg.inv(low)
        return np.asfortranarray(np.triu(inv[::-1, ::-1]))
    _, potrf, trtri = routines
    a = np.empty((n, n), np.float64, order="F")
    flat = a.reshape(-1, order="F")  # a view: a's own buffer
    # J H J in a's buffer: h's numbers in reversed flat order (h is symmetric, so its rows are its columns)
    flat[:] = np.ascontiguousarray(h).reshape(-1)[::-1]
    ptr = ctypes.c_void_p
    size, info = ctypes.c_int64(n), ctypes.c_int64(0)
    lower, non_unit = ctypes.c_char(b"L"), ctypes.c_char(b"N")
    potrf(ctypes.byref(lower), ctypes.byref(size), a.ctypes.data_as(ptr), ctypes.byref(size), ctypes.byref(info),
          ctypes.c_size_t(1))
    if info.value > 0:
        raise np.linalg.LinAlgError("Matrix is not positive definite")
    if info.value == 0:
        trtri(ctypes.byref(lower), ctypes.byref(non_unit), ctypes.byref(size), a.ctypes.data_as(ptr),
              ctypes.byref(size), ctypes.byref(info), ctypes.c_size_t(1), ctypes.c_size_t(1))
        if info.value > 0:
            raise np.linalg.LinAlgError("Singular matrix")
    if info.value < 0:  # pragma: no cover - an argument LAPACK refused: numpy's own path says what
        return np.asfortranarray(cholesky_of_inverse(h).T)
    for j in range(1, n):  # the upper triangle (J H J's numbers, untouched): zeros
        a[:j, j] = 0.0
    half = flat.size // 2  # J L^-1 J: the buffer reversed in place (two halves that do not overlap)
    if half:
        tail = flat[flat.size - half:][::-1].copy()
        flat[flat.size - half:] = flat[:half][::-1]
        flat[:half] = tail
    return a


def gptq(w: np.ndarray, h: np.ndarray | None, spec: QuantSpec, *, damp: float = 0.01, act_order: bool = False,
         importance: np.ndarray | None = None, step: int = 128, factor: GptqFactor | None = None,
         sub_step: int = 16) -> BlockQuantized:
    """GPTQ of ``w`` ``[K, N]`` given the inputs' Hessian ``h`` ``[K, K]`` (``E[x x^T]``, any positive scale).

    Block parameters come from :func:`search_params` (activation-weighted clip search) on the weights as
    they stand when a block is reached (without ``act_order``), or on the original weights (with it).
    ``factor``: :func:`gptq_factor` of ``h`` made beforehand (with the same ``damp`` and ``act_order``); ``h``
    is then not read and may be ``None``.

    Rows go ``step`` at a time (the other rows get their errors in one product per step, Frantar et al.'s
    lazy batch) and, inside a step, ``sub_step`` at a time: each row's error goes to the rest of its
    sub-step at once (a rank-1 update ``sub_step`` rows tall, not ``step``), the sub-step's errors to the rest
    of the step in one product.  ``sub_step = step`` is the plain lazy batch; any ``sub_step`` adds the same
    terms in another order (codes equal but for a value within rounding of a code boundary).
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
    sub = max(1, min(sub_step, step))
    with blas_threads(GPTQ_BLAS_THREADS):  # small products: one thread is faster (blas_threads)
        for i1 in range(0, k, step):
            i2 = min(i1 + step, k)
            w1 = w[i1:i2].copy()
            err1 = np.zeros_like(w1)
            hinv1 = hinv[i1:i2, i1:i2]
            for j0 in range(0, i2 - i1, sub):
                # rows [j0, j1) one at a time, each one's error spread over the rest of [j0, j1) at once; the
                # errors of rows [sent, j) reach the rows past j1 in one product (when a block starts, or at j1)
                j1 = min(j0 + sub, i2 - i1)
                sent = j0
                for j in range(j0, j1):
                    row = perm[i1 + j]
                    b = row // bs
                    if not fixed and not have[b]:
                        if j > sent:  # the block's rows past j1 as they stand with the errors so far
                            w1[j1:] -= hinv1[sent:j, j1:].T @ err1[sent:j]
                            sent = j
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
                    e = (col - (qc - zero[b]) * scale[b]) / hinv1[j, j]
                    if j + 1 < j1:
                        w1[j + 1:j1] -= hinv1[j, j + 1:j1, None] * e
                    err1[j] = e
                if j1 > sent and j1 < i2 - i1:
                    w1[j1:] -= hinv1[sent:j1, j1:].T @ err1[sent:j1]
            if i2 < k:
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
