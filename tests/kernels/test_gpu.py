"""Each CUDA kernel against the numpy reference on a GPU, over shapes, dtypes and options.

The grid (``mograph._kernels.harness``: ``make_grid``) covers every op x fp32/fp16/bf16 x hidden in
{64, 768, 1000, 1024, 4096, 8192, 33, 1, 7, 8193}, with and without the optional inputs and outputs, both
gelu forms, misaligned pointers (the generic path), in-place calls and many-block launches. Tolerance:
``|out - ref| <= tol * (|ref| + rms(ref))`` with tol 1e-5 for fp32 and 1e-2 for fp16/bf16.

The library is ``$MOGRAPH_KERNELS_LIB`` when set, else built here (``mograph._kernels.build``). Skipped, with the
reason, when no CUDA GPU is reachable through torch or CuPy, or when there is no library and nvcc is missing.
"""

from __future__ import annotations

import os

import pytest

from mograph._kernels import abi, build, harness

BACKEND, BACKEND_INFO = harness.find_backend()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(BACKEND is None, reason=BACKEND_INFO)]

try:
    import ml_dtypes  # noqa: F401

    HAVE_BF16 = True
except ImportError:
    HAVE_BF16 = False


@pytest.fixture(scope="module")
def lib():
    if os.environ.get(build.LIBRARY_ENV):
        return abi.load(build.library_path())
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found on PATH (nor NVCC / CUDA_HOME): cannot build the kernels")
    return abi.load(build.build())


CASES = harness.make_grid()


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_kernel_matches_reference(lib, case):
    if case.dtype == "bf16" and not HAVE_BF16:
        pytest.skip("ml_dtypes not installed: numpy has no bfloat16 for the reference")
    result = harness.check_case(lib, BACKEND, case, seed=hash(case.label) & 0xFFFF)
    assert result.ok, f"{case.label}: {result.message}"


def test_empty_launch_is_a_no_op(lib):
    for dt in abi.DTYPES:
        assert (
            getattr(lib, abi.symbol("layer_norm", dt))(None, None, None, None, 0, 768, 1e-5, 0, BACKEND.stream())
            == abi.OK
        )
        assert getattr(lib, abi.symbol("gelu", dt))(None, None, 0, 0, BACKEND.stream()) == abi.OK
