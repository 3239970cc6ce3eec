"""The TensorRT plugins' enqueue path on a GPU, against the numpy reference (``mograph._kernels.reference``).

TensorRT itself does not run on the GPU machine, so this calls what ``enqueue`` calls —
:func:`mograph.backends.tensorrt_plugins.launch`, with the device pointers of torch CUDA tensors and torch's
current stream — and, where a TensorRT module is importable too, the plugin objects' ``enqueue`` itself with
hand-made ``PluginTensorDesc`` objects. Tolerance as for the kernels: ``|out - ref| <= tol * (|ref| +
rms(ref))``, tol 1e-5 for float32 and 1e-2 for float16/bfloat16.

Skips, with the reason, without torch CUDA, without the kernel library (built here with nvcc when
``mograph._kernels.build`` finds nvcc), or (bfloat16 only) without ml_dtypes.
"""

from __future__ import annotations

import numpy as np
import pytest

from mograph._kernels import build as kernels_build
from mograph._kernels import reference as kernels_reference
from mograph.backends import _trt_loader
from mograph.backends.tensorrt_plugins import PLUGINS, kernel_library_path, launch, load_kernels

try:
    import torch

    HAVE_CUDA = bool(torch.cuda.is_available())
    WHY = "torch sees no CUDA GPU"
except ImportError:  # pragma: no cover - depends on the machine
    torch = None
    HAVE_CUDA = False
    WHY = "torch is not installed"

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason=WHY)]

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


@pytest.fixture(scope="module")
def lib():
    path = kernel_library_path()
    if not path.exists():
        if kernels_build.find_nvcc() is None:
            pytest.skip(f"{path} is not built and nvcc is not found")
        kernels_build.build()
    return load_kernels()


@pytest.fixture(scope="module")
def ref():
    return kernels_reference


# ------------------------------------------------------------------------------------------- helpers


def _host(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("ml_dtypes not installed: numpy has no bfloat16 for the reference")
        return a.astype(ml_dtypes.bfloat16)
    return a.astype(dtype)


def _dev(a: np.ndarray):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _back(t, like: np.ndarray) -> np.ndarray:
    t = t.cpu()
    if like.dtype.name == "bfloat16":
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _check(out: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    o = out.astype(np.float64)
    r = expected.astype(np.float64)
    scale = np.sqrt(np.mean(r * r)) if r.size else 0.0
    err = np.abs(o - r) / (np.abs(r) + scale + 1e-30)
    assert out.shape == expected.shape
    assert float(err.max()) <= TOL[dtype], f"scaled error {err.max():.3g} > {TOL[dtype]}"


def _stream() -> int:
    return int(torch.cuda.current_stream().cuda_stream)


def _case(dtype: str, shape: tuple[int, ...], seed: int = 0):
    """A seeded generator, the X input of ``shape`` in ``dtype``, and a maker of [hidden] vectors around a value."""
    rng = np.random.default_rng(seed)
    hidden = shape[-1]
    x = _host(rng.normal(0, 1, shape).astype(np.float32), dtype)

    def vec(loc: float) -> np.ndarray:
        return _host((loc + rng.normal(0, 0.1, hidden)).astype(np.float32), dtype)

    return rng, x, vec


DTYPES = ["float32", "float16", "bfloat16"]
SHAPES = [(4, 64), (2, 8, 768), (3, 1000), (5, 33), (2, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_beta", [True, False])
def test_layer_norm(lib, ref, dtype, shape, with_beta):
    _rng, x, vec = _case(dtype, shape)
    gamma, beta = vec(1.0), vec(0.0)
    attrs = {"epsilon": 1e-5}
    ins = [x, gamma] + ([beta] if with_beta else [])
    dev = [_dev(a) for a in ins]
    y = torch.empty_like(dev[0])
    launch(
        "LayerNorm",
        attrs,
        [t.data_ptr() for t in dev],
        [y.data_ptr()],
        [a.shape for a in ins],
        dtype,
        _stream(),
        lib=lib,
    )
    torch.cuda.synchronize()
    _check(_back(y, x), ref.layer_norm(x, gamma, beta if with_beta else None, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm(lib, ref, dtype, shape):
    _rng, x, vec = _case(dtype, shape)
    gamma = vec(1.0)
    dev = [_dev(x), _dev(gamma)]
    y = torch.empty_like(dev[0])
    launch(
        "RMSNorm",
        {"epsilon": 1e-6},
        [t.data_ptr() for t in dev],
        [y.data_ptr()],
        [x.shape, gamma.shape],
        dtype,
        _stream(),
        lib=lib,
    )
    torch.cuda.synchronize()
    _check(_back(y, x), ref.rms_norm(x, gamma, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "skip_shape"),
    [((4, 64), None), ((2, 8, 768), None), ((3, 1000), None), ((3, 16, 64), (1, 16, 64)), ((2, 4096), None)],
    ids=["4x64", "2x8x768", "3x1000", "broadcast-skip", "2x4096"],
)
@pytest.mark.parametrize("variant", ["full+sum", "no-bias", "no-beta-no-bias"])
def test_skip_layer_norm(lib, ref, dtype, shape, skip_shape, variant):
    rng, x, vec = _case(dtype, shape)
    skip = _host(rng.normal(0, 1, skip_shape or shape).astype(np.float32), dtype)
    gamma, beta, bias = vec(1.0), vec(0.0), vec(0.0)
    with_sum = variant == "full+sum"
    ins = [x, skip, gamma] + {"full+sum": [beta, bias], "no-bias": [beta], "no-beta-no-bias": []}[variant]
    dev = [_dev(a) for a in ins]
    y = torch.empty_like(dev[0])
    s = torch.empty_like(dev[0])
    outs = [y.data_ptr()] + ([s.data_ptr()] if with_sum else [])
    attrs = {"epsilon": 1e-5, "sum_output": int(with_sum)}
    launch("SkipLayerNorm", attrs, [t.data_ptr() for t in dev], outs, [a.shape for a in ins], dtype, _stream(), lib=lib)
    torch.cuda.synchronize()
    full_skip = np.broadcast_to(skip, x.shape).copy()
    expected = ref.skip_layer_norm(
        x,
        full_skip,
        gamma,
        beta if variant != "no-beta-no-bias" else None,
        bias if variant == "full+sum" else None,
        1e-5,
        return_sum=True,
    )
    _check(_back(y, x), expected[0], dtype)
    if with_sum:
        _check(_back(s, x), expected[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "skip_shape"),
    [((4, 64), None), ((2, 8, 4096), None), ((3, 1000), None), ((3, 16, 64), (1, 16, 64))],
    ids=["4x64", "2x8x4096", "3x1000", "broadcast-skip"],
)
@pytest.mark.parametrize("variant", ["bias+sum", "no-bias"])
def test_skip_rms_norm(lib, ref, dtype, shape, skip_shape, variant):
    rng, x, vec = _case(dtype, shape)
    skip = _host(rng.normal(0, 1, skip_shape or shape).astype(np.float32), dtype)
    gamma, bias = vec(1.0), vec(0.0)
    with_sum = variant == "bias+sum"
    ins = [x, skip, gamma] + ([bias] if with_sum else [])
    dev = [_dev(a) for a in ins]
    y = torch.empty_like(dev[0])
    s = torch.empty_like(dev[0])
    outs = [y.data_ptr()] + ([s.data_ptr()] if with_sum else [])
    attrs = {"epsilon": 1e-6, "sum_output": int(with_sum)}
    launch("SkipRMSNorm", attrs, [t.data_ptr() for t in dev], outs, [a.shape for a in ins], dtype, _stream(), lib=lib)
    torch.cuda.synchronize()
    full_skip = np.broadcast_to(skip, x.shape).copy()
    expected = ref.skip_rms_norm(x, full_skip, gamma, bias if with_sum else None, 1e-6, return_sum=True)
    _check(_back(y, x), expected[0], dtype)
    if with_sum:
        _check(_back(s, x), expected[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 64), (3, 1000), (7,), (2, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(lib, ref, dtype, shape, approximate):
    _rng, x, _vec = _case(dtype, shape)
    dx = _dev(x)
    y = torch.empty_like(dx)
    launch("Gelu", {"approximate": approximate}, [dx.data_ptr()], [y.data_ptr()], [x.shape], dtype, _stream(), lib=lib)
    torch.cuda.synchronize()
    _check(_back(y, x), ref.gelu(x, approximate), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 64), (2, 8, 3072), (3, 1000), (5, 33)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(lib, ref, dtype, shape, approximate):
    _rng, x, vec = _case(dtype, shape)
    bias = vec(0.0)
    dev = [_dev(x), _dev(bias)]
    y = torch.empty_like(dev[0])
    launch(
        "BiasGelu",
        {"approximate": approximate},
        [t.data_ptr() for t in dev],
        [y.data_ptr()],
        [x.shape, bias.shape],
        dtype,
        _stream(),
        lib=lib,
    )
    torch.cuda.synchronize()
    _check(_back(y, x), ref.bias_gelu(x, bias, approximate), dtype)


# ------------------------------------------------------------- the plugin objects' enqueue (needs TensorRT)


@pytest.mark.skipif(
    _trt_loader.find_trt_module() is None, reason="no TensorRT module on this machine (launch() is tested above)"
)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_plugin_enqueue_with_tensor_descs(lib, ref, dtype):
    from mograph.backends.tensorrt_plugins import register_plugins

    trt = _trt_loader.import_trt()
    register_plugins(trt)
    trt_type = {"float32": trt.DataType.FLOAT, "float16": trt.DataType.HALF}[dtype]
    registry = trt.get_plugin_registry()

    def desc(shape):
        d = trt.PluginTensorDesc()
        d.dims = trt.Dims(tuple(shape))
        d.type = trt_type
        d.format = trt.TensorFormat.LINEAR
        return d

    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (6, 256)).astype(dtype)
    gamma = (1 + rng.normal(0, 0.1, 256)).astype(dtype)
    beta = rng.normal(0, 0.1, 256).astype(dtype)
    fc = trt.PluginFieldCollection(
        [trt.PluginField("epsilon", np.array([1e-5], np.float32), trt.PluginFieldType.FLOAT32)]
    )
    plugin = registry.get_creator("LayerNorm", "1", "mograph").create_plugin("ln", fc, trt.TensorRTPhase.RUNTIME)
    dev = [_dev(a) for a in (x, gamma, beta)]
    y = torch.empty_like(dev[0])
    plugin.enqueue(
        [desc(a.shape) for a in (x, gamma, beta)],
        [desc(x.shape)],
        [t.data_ptr() for t in dev],
        [y.data_ptr()],
        0,
        _stream(),
    )
    torch.cuda.synchronize()
    _check(_back(y, x), ref.layer_norm(x, gamma, beta, 1e-5), dtype)
    assert set(PLUGINS) == {"LayerNorm", "RMSNorm", "SkipLayerNorm", "SkipRMSNorm", "Gelu", "BiasGelu"}
