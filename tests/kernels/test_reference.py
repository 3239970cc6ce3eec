"""The numpy references of ``mograph._kernels.reference`` against independent formulations.

Each op is recomputed here another way (float64, textbook formulas, ``math.erf``, known values), so a
mistake in the ground truth the kernels are tested against cannot hide behind the kernels agreeing with it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mograph._kernels import reference as ref


def _close(got, want, tol):
    """|got - want| <= tol * (|want| + rms(want)), the same measure the GPU tests use."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    scale = np.sqrt(np.mean(want * want))
    err = np.max(np.abs(got - want) / (np.abs(want) + scale + 1e-30))
    assert err <= tol, f"scaled error {err:.3g} > {tol}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_erfc_matches_math_erfc():
    z = np.concatenate([np.linspace(-8, 26, 20001), [0.0, 1.99999999, 2.0, -2.0, 3.0]])
    got = ref.erfc(z)
    want = np.array([math.erfc(v) for v in z])
    assert np.all(np.abs(got - want) <= 1e-12 * want)


def test_erfc_edges():
    got = ref.erfc(np.array([np.inf, -np.inf, 0.0, np.nan]))
    assert got[0] == 0.0 and got[1] == 2.0 and got[2] == 1.0 and np.isnan(got[3])


def test_gelu_exact_known_values():
    # Phi(1), Phi(2), Phi(-3) of the standard normal distribution
    x = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 10.0, -10.0], dtype=np.float32)
    want = [
        0.0,
        0.8413447460685429,
        -0.15865525393145707,
        2 * 0.9772498680518208,
        -3 * 0.0013498980316301,
        10.0,
        -10 * 7.619853024160527e-24,
    ]
    np.testing.assert_allclose(ref.gelu(x).astype(np.float64), want, rtol=1e-6, atol=0)


def test_gelu_exact_matches_math_erf(rng):
    x = (rng.standard_normal(5000) * 4).astype(np.float32)
    want = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.astype(np.float64)])
    _close(ref.gelu(x), want, 1e-6)


def test_gelu_tanh_matches_the_tanh_formula(rng):
    x = (rng.standard_normal(5000) * 4).astype(np.float64)
    want = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    _close(ref.gelu(x.astype(np.float32), approximate="tanh"), want, 1e-6)


def test_gelu_tanh_is_close_to_exact(rng):
    x = np.linspace(-6, 6, 1001).astype(np.float32)
    assert np.max(np.abs(ref.gelu(x, "tanh") - ref.gelu(x))) < 1e-3


def test_gelu_limits_and_nan():
    x = np.array([np.inf, -np.inf, np.nan, 0.0], dtype=np.float32)
    exact = ref.gelu(x)
    assert exact[0] == np.inf and np.isnan(exact[1]) and np.isnan(exact[2]) and exact[3] == 0.0  # -inf * 0
    tanh = ref.gelu(x, "tanh")
    assert tanh[0] == np.inf and np.isnan(tanh[2]) and tanh[3] == 0.0


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        ref.gelu(np.zeros(3, np.float32), approximate="erf")


def test_quick_gelu_is_x_sigmoid_alpha_x(rng):
    x = (rng.standard_normal(1000) * 4).astype(np.float32)
    x64 = x.astype(np.float64)
    _close(ref.quick_gelu(x), x64 / (1.0 + np.exp(-1.702 * x64)), 1e-6)
    np.testing.assert_array_equal(ref.gelu(x, "sigmoid"), ref.quick_gelu(x))
    _close(ref.quick_gelu(x, alpha=1.0), x64 / (1.0 + np.exp(-x64)), 1e-6)


def test_optional_scale_and_one_element_vectors(rng):
    """What a fusion without a scale (None) or with a one-element constant passes: broadcast over the row."""
    x = rng.standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_array_equal(ref.layer_norm(x), ref.layer_norm(x, np.ones(16, np.float32)))
    np.testing.assert_array_equal(ref.rms_norm(x, None, 1e-6), ref.rms_norm(x, np.ones(16, np.float32), 1e-6))
    np.testing.assert_array_equal(
        ref.layer_norm(x, np.array([2.0], np.float32), np.array(0.5, np.float32)),
        ref.layer_norm(x, np.full(16, 2.0, np.float32), np.full(16, 0.5, np.float32)),
    )
    np.testing.assert_array_equal(ref.bias_gelu(x, np.array([0.25], np.float32)), ref.gelu(x + np.float32(0.25)))


def test_float64_inputs_are_computed_in_float64(rng):
    x = rng.standard_normal((4, 256)) + 1e3  # fp32 would leave ~1e-4 of error in the deviations
    y = ref.layer_norm(x, eps=0.0)
    assert y.dtype == np.float64
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True))
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-9)


def test_layer_norm_matches_float64_textbook(rng):
    x = (rng.standard_normal((16, 768)) * 2 + 5).astype(np.float32)
    g = rng.standard_normal(768).astype(np.float32)
    b = rng.standard_normal(768).astype(np.float32)
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * g + b
    _close(ref.layer_norm(x, g, b, eps=1e-5), want, 1e-5)


def test_layer_norm_statistics_and_optional_beta(rng):
    x = (rng.standard_normal((8, 1000)) * 3 - 7).astype(np.float32)
    y = ref.layer_norm(x, np.ones(1000, np.float32), None, eps=0.0).astype(np.float64)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-5)


def test_layer_norm_of_a_large_mean_row_does_not_cancel():
    # var = E[x^2] - E[x]^2 in fp32 would lose everything here; the two-pass form keeps it.
    x = (1e4 + np.arange(64, dtype=np.float64) * 1e-2).astype(np.float32)[None]
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean()) / np.sqrt(x64.var() + 1e-5)
    _close(ref.layer_norm(x, np.ones(64, np.float32), eps=1e-5), want, 1e-2)  # fp32 mean of 1e4: ulp 1e-3


def test_rms_norm_matches_float64_norm(rng):
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    g = rng.standard_normal(1024).astype(np.float32)
    x64 = x.astype(np.float64)
    rms = np.linalg.norm(x64, axis=-1, keepdims=True) / math.sqrt(1024)
    want = x64 / np.sqrt(rms**2 + 1e-6) * g
    _close(ref.rms_norm(x, g, eps=1e-6), want, 1e-5)


def test_skip_layer_norm_is_layer_norm_of_the_sum(rng):
    x, skip = (rng.standard_normal((2, 4, 64)).astype(np.float32) for _ in range(2))
    g, b, bias = (rng.standard_normal(64).astype(np.float32) for _ in range(3))
    y, s = ref.skip_layer_norm(x, skip, g, b, bias, eps=1e-5, return_sum=True)
    s64 = x.astype(np.float64) + skip + bias
    want = (s64 - s64.mean(-1, keepdims=True)) / np.sqrt(s64.var(-1, keepdims=True) + 1e-5) * g + b
    _close(y, want, 1e-5)
    _close(s, s64, 1e-6)
    assert ref.skip_layer_norm(x, skip, g).shape == x.shape  # bias and beta optional, one output


def test_skip_layer_norm_rounds_the_sum_to_the_dtype(rng):
    x, skip = (rng.standard_normal((4, 256)).astype(np.float16) for _ in range(2))
    g = np.ones(256, np.float16)
    y, s = ref.skip_layer_norm(x, skip, g, return_sum=True)
    rounded = (x.astype(np.float32) + skip.astype(np.float32)).astype(np.float16)
    assert s.dtype == np.float16 and np.array_equal(s, rounded)
    assert np.array_equal(y, ref.layer_norm(rounded, g))  # normalizes exactly the rounded sum


def test_skip_rms_norm_is_rms_norm_of_the_rounded_sum(rng):
    x, skip = (rng.standard_normal((4, 256)).astype(np.float16) for _ in range(2))
    g = (1 + 0.1 * rng.standard_normal(256)).astype(np.float16)
    bias = rng.standard_normal(256).astype(np.float16)
    y, s = ref.skip_rms_norm(x, skip, g, bias, eps=1e-6, return_sum=True)
    rounded = (x.astype(np.float32) + bias.astype(np.float32) + skip.astype(np.float32)).astype(np.float16)
    assert s.dtype == np.float16 and np.array_equal(s, rounded)
    assert np.array_equal(y, ref.rms_norm(rounded, g, 1e-6))
    s64 = rounded.astype(np.float64)
    _close(y.astype(np.float64), s64 / np.sqrt((s64 * s64).mean(-1, keepdims=True) + 1e-6) * g, 2e-3)
    assert ref.skip_rms_norm(x, skip, g).shape == x.shape  # bias optional, one output


def test_bias_gelu_is_gelu_of_the_fp32_sum(rng):
    x = rng.standard_normal((8, 96)).astype(np.float32)
    bias = rng.standard_normal(96).astype(np.float32)
    for approx in ("none", "tanh"):
        np.testing.assert_array_equal(ref.bias_gelu(x, bias, approx), ref.gelu(x + bias, approx))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_dtype_and_shape_are_kept(rng, dtype):
    x = rng.standard_normal((2, 3, 40)).astype(dtype)
    v = np.ones(40, dtype)
    for out in (
        ref.layer_norm(x, v, v),
        ref.rms_norm(x, v),
        ref.skip_layer_norm(x, x, v, v, v),
        ref.gelu(x),
        ref.bias_gelu(x, v),
    ):
        assert out.dtype == dtype and out.shape == x.shape


def test_bfloat16_inputs_when_ml_dtypes_is_present(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes not installed: numpy has no bfloat16")
    x = rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    g = np.ones(64, ml_dtypes.bfloat16)
    y = ref.layer_norm(x, g)
    assert y.dtype == ml_dtypes.bfloat16
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    _close(y, want, 1e-2)


def test_wrong_vector_shape_is_rejected():
    with pytest.raises(ValueError, match="gamma"):
        ref.layer_norm(np.zeros((2, 8), np.float32), np.ones(7, np.float32))
    with pytest.raises(ValueError, match="skip"):
        ref.skip_layer_norm(np.zeros((2, 8), np.float32), np.zeros((2, 7), np.float32), np.ones(8, np.float32))
