"""GPTQ's arithmetic made cheaper without changing what it computes (issue 26 item 5).

* :func:`inverse_upper_factor` (the upper Cholesky factor of ``H^-1`` from one ``dpotrf`` and one ``dtrtri`` of
  the reversed ``H``) is :func:`cholesky_of_inverse` transposed up to rounding, in the same layout, through
  LAPACK or numpy alike, and raises where ``H`` is not positive definite;
* :func:`gptq`'s blocked update (rank-1 updates ``sub_step`` rows tall, the rest in products) gives the codes,
  scales and zero points of the plain row-by-row algorithm written out here, with and without ``act_order``,
  for steps that do and do not line up with the quantization blocks;
* :func:`search_params` (extremes made once, one scratch buffer) is the plain grid search bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from mograph.passes.quant import _blockwise as bw


def _spd(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3 * n, n)) * rng.uniform(0.2, 3.0, n)
    h = x.T @ x / (3 * n)
    h[np.diag_indices(n)] += 0.01 * float(np.mean(np.diag(h)))
    return h


@pytest.mark.parametrize("n", [1, 2, 7, 130, 513])
@pytest.mark.parametrize("lapack", [True, False])
def test_inverse_upper_factor_is_the_cholesky_of_the_inverse(monkeypatch, n, lapack):
    if not lapack:
        monkeypatch.setattr(bw, "_numpy_lapack", lambda: None)
    elif bw._numpy_lapack() is None:
        pytest.skip("numpy's LAPACK is not the bundled scipy-openblas64 here")
    h = _spd(n, n)
    before = h.copy()
    got = bw.inverse_upper_factor(h)
    want = bw.cholesky_of_inverse(h).T
    assert got.shape == want.shape and got.dtype == np.float64
    assert got.flags.f_contiguous  # the layout gptq's products had
    assert np.array_equal(got, np.triu(got))  # upper, zeros below
    assert np.all(np.diag(got) > 0)
    assert np.max(np.abs(got - want)) <= 1e-13 * np.max(np.abs(want))  # the same matrix up to rounding
    assert np.allclose(got.T @ got, np.linalg.inv(h), rtol=1e-9, atol=1e-12 * np.abs(np.linalg.inv(h)).max())
    assert np.array_equal(h, before)  # the caller's matrix is left as it was


@pytest.mark.parametrize("h", [np.ones((4, 4)), -np.eye(3), np.zeros((5, 5))])
@pytest.mark.parametrize("lapack", [True, False])
def test_inverse_upper_factor_raises_where_not_positive_definite(monkeypatch, h, lapack):
    if not lapack:
        monkeypatch.setattr(bw, "_numpy_lapack", lambda: None)
    with pytest.raises(np.linalg.LinAlgError):
        bw.inverse_upper_factor(h)


def _plain_gptq(w: np.ndarray, factor: bw.GptqFactor, spec: bw.QuantSpec, imp: np.ndarray, act_order: bool,
                step: int) -> bw.BlockQuantized:
    """Frantar et al.'s algorithm without lazy batches: each row's error goes to every later row at once.  A
    block's clip search (without ``act_order``) sees the rows past the current ``step`` as they stood when
    the step began, as the lazy batch has them then."""
    k, n = w.shape
    bs = spec.block_size
    nb = -(-k // bs)
    perm, hinv, dead = factor.perm, factor.hinv, factor.dead
    scale = np.ones((nb, n), np.float32)
    zero = np.zeros((nb, n), np.float32)
    if act_order:
        w0 = np.array(w, np.float32)
        w0[dead] = 0.0
        scale, zero = bw.search_params(w0, spec, imp)
    ww = np.asarray(w)[perm].astype(np.float64)
    ww[dead[perm]] = 0.0
    q = np.zeros((k, n), np.float32)
    have = np.zeros(nb, bool)
    for i in range(k):
        if i % step == 0:
            start = ww.copy()
        b = perm[i] // bs
        if not act_order and not have[b]:
            end = i - i % step + step
            blk = np.concatenate([ww[i:end], start[end:]])[: min(bs, k - i)]
            s, z = bw.search_params(blk.astype(np.float32), bw.QuantSpec(spec.bits, blk.shape[0], spec.symmetric),
                                    imp[perm[i: i + blk.shape[0]]])
            scale[b], zero[b] = s[0], z[0]
            have[b] = True
        qc = np.clip(np.round(ww[i] / scale[b] + zero[b]), 0, spec.qmax)
        q[perm[i]] = qc
        e = (ww[i] - (qc - zero[b]) * scale[b]) / hinv[i, i]
        ww[i + 1:] -= np.outer(hinv[i, i + 1:], e)
    codes = np.zeros((nb * bs, n), np.uint8)
    codes[:k] = q.astype(np.uint8)
    codes[k:] = np.clip(np.round(zero[-1]), 0, spec.qmax).astype(np.uint8)
    return bw.BlockQuantized(codes, scale, zero.astype(np.uint8), k, spec)


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("step,sub_step", [(128, 16), (128, 128), (48, 5), (48, 1), (40, 16)])
def test_blocked_update_gives_the_plain_algorithms_codes(act_order, step, sub_step):
    rng = np.random.default_rng(7)
    k, n = 150, 24  # 150 rows: 5 blocks of 32, the last padded; steps 48 / 40 start blocks mid-step
    x = rng.standard_normal((400, k)) * rng.uniform(0.1, 3.0, k)
    x[:, 11] = 0.0  # a dead input channel
    h = x.T @ x / 400
    w = rng.standard_normal((k, n)).astype(np.float32)
    spec = bw.QuantSpec(4, 32, False)
    factor = bw.gptq_factor(h.copy(), damp=0.1, act_order=act_order)
    want = _plain_gptq(w, factor, spec, np.diag(h), act_order, step)
    got = bw.gptq(w, None, spec, damp=0.1, act_order=act_order, importance=np.diag(h), factor=factor, step=step,
                  sub_step=sub_step)
    for field in ("q", "scale", "zero"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field
    assert np.array_equal(got.dequantize(), want.dequantize())


def _plain_search(w: np.ndarray, spec: bw.QuantSpec, importance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    wb = bw._blocks(w.astype(np.float32), spec.block_size)
    db = bw._blocks(importance.astype(np.float32)[:, None], spec.block_size)
    best_err = np.full((wb.shape[0], wb.shape[2]), np.inf, np.float32)
    best_s, best_z = np.ones_like(best_err), np.zeros_like(best_err)
    for r in bw.CLIP_GRID:
        if spec.symmetric:
            s = np.abs(wb).max(axis=1) * r / (spec.mid - 1)
            z = np.full(s.shape, spec.mid, np.float32)
        else:
            hi, lo = np.maximum(wb.max(axis=1), 0.0) * r, np.minimum(wb.min(axis=1), 0.0) * r
            s = (hi - lo) / spec.qmax
            z = np.clip(np.round(-lo / np.where(s > 0, s, 1.0)), 0, spec.qmax)
        s, z = np.where(s > 0, s, 1.0).astype(np.float32), z.astype(np.float32)
        q = np.clip(np.round(wb / s[:, None, :] + z[:, None, :]), 0, spec.qmax)
        err = (db * (wb - (q - z[:, None, :]) * s[:, None, :]) ** 2).sum(axis=1)
        better = err < best_err
        best_err, best_s, best_z = np.where(better, err, best_err), np.where(better, s, best_s), np.where(better, z, best_z)
    return best_s, best_z


@pytest.mark.parametrize("symmetric", [False, True])
def test_search_params_is_the_plain_grid_search_bit_for_bit(symmetric):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((200, 33)) * 0.05).astype(np.float32)
    w[:, 3] = 0.0  # a silent column: scale 1
    imp = rng.uniform(0.0, 2.0, 200)
    spec = bw.QuantSpec(4, 64, symmetric)
    for got, want in zip(bw.search_params(w, spec, imp), _plain_search(w, spec, imp)):
        assert np.array_equal(got, want)


def test_blas_threads_restores_the_count_and_keeps_products_equal():
    lib = bw._numpy_openblas()
    if lib is None or not hasattr(lib, "scipy_openblas_get_num_threads64_"):
        pytest.skip("numpy's BLAS is not the bundled scipy-openblas64 here: nothing to set")
    get, put = lib.scipy_openblas_get_num_threads64_, lib.scipy_openblas_set_num_threads64_
    before = int(get())
    put(2)
    try:
        x = np.random.default_rng(0).standard_normal((300, 200))
        want = x.T @ x
        with bw.blas_threads(1):
            assert int(get()) == 1
            got = x.T @ x
        assert int(get()) == 2
        assert np.array_equal(got, want)
        with pytest.raises(RuntimeError), bw.blas_threads(1):
            raise RuntimeError("restored on the way out too")
        assert int(get()) == 2
    finally:
        put(before)


def test_hessian_sums_are_the_plain_sums_bit_for_bit():
    from mograph.passes.quant._wo_segments import _hessian_factor

    rng = np.random.default_rng(4)
    states = [{"x": rng.standard_normal((1, n, 40)).astype(np.float32)} for n in (7, 16, 3)]
    want = sum(np.asarray(st["x"], np.float64).reshape(-1, 40).T @ np.asarray(st["x"], np.float64).reshape(-1, 40)
               for st in states) / 26
    diag, factor = _hessian_factor(states, "x", 0.1, True)
    assert np.array_equal(diag, np.diag(want))
    plain = bw.gptq_factor(want.copy(), damp=0.1, act_order=True)
    assert np.array_equal(factor.perm, plain.perm) and np.array_equal(factor.hinv, plain.hinv)
