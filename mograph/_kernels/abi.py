"""ctypes binding of ``libmograph_kernels.so``: the C ABI of ``include/mograph_kernels.h``, in Python.

This is the single Python statement of the ABI (names, argument types, status codes, flags). The tests
check it against the header and against the built library, and any ctypes caller (the GPU tests, the
benchmark, a TensorRT plugin's enqueue written in Python) loads the library through :func:`load`, so every
function has its ``argtypes``/``restype`` set and a wrong argument count fails in Python instead of on the
GPU.

Every launch function takes raw device pointers (ints or ``None`` for an optional one), sizes, and the
CUDA stream as an int (``torch.cuda.current_stream().cuda_stream``, ``cupy.cuda.get_current_stream().ptr``;
0 is the legacy default stream). It enqueues work and returns a status int; :func:`check` turns a non-zero
status into :class:`KernelError`. This module needs only the standard library.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = [
    "ABI_VERSION",
    "DTYPES",
    "ERR_CUDA_BASE",
    "ERR_INVALID_ARGUMENT",
    "ERR_UNSUPPORTED",
    "EXPORTED_SYMBOLS",
    "GELU_TANH",
    "OK",
    "OPS",
    "SIGNATURES",
    "KernelError",
    "check",
    "load",
    "symbol",
]

ABI_VERSION = 1

OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_UNSUPPORTED = 2
ERR_CUDA_BASE = 1000

GELU_TANH = 1
"""Flag of the gelu and bias_gelu functions: tanh approximation instead of the exact erf form."""

DTYPES = ("f32", "f16", "bf16")
"""Name suffixes: float32, IEEE float16, bfloat16."""

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_f = ctypes.c_float
_u32 = ctypes.c_uint32

#: Type of each scalar parameter, by name (the header uses one name for one meaning); the rest are
#: device pointers (``void*``; the stream is a ``cudaStream_t``, passed as a pointer-sized int).
_SCALARS: dict[str, type] = {"rows": _i64, "hidden": _i64, "n": _i64, "eps": _f, "flags": _u32}


def _params(names: str) -> list[tuple[str, type]]:
    return [(name, _SCALARS.get(name, _p)) for name in names.split()]


OPS: dict[str, list[tuple[str, type]]] = {
    "layer_norm": _params("x gamma beta y rows hidden eps flags stream"),
    "rms_norm": _params("x gamma y rows hidden eps flags stream"),
    "skip_layer_norm": _params("x skip bias gamma beta y sum_out rows hidden eps flags stream"),
    "skip_rms_norm": _params("x skip bias gamma y sum_out rows hidden eps flags stream"),
    "gelu": _params("x y n flags stream"),
    "bias_gelu": _params("x bias y rows hidden flags stream"),
}
"""Per op: the parameters of ``mograph_<op>_<dtype>`` in order, as (name, ctypes type)."""


def symbol(op: str, dtype: str) -> str:
    """C name of an op's launch function for one dtype suffix, e.g. ``symbol("gelu", "f16")``."""
    if op not in OPS or dtype not in DTYPES:
        raise ValueError(f"unknown op or dtype: {op!r}, {dtype!r}")
    return f"mograph_{op}_{dtype}"


SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "mograph_kernels_abi_version": (ctypes.c_int, []),
    "mograph_kernels_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    **{symbol(op, dt): (ctypes.c_int, [t for _, t in params]) for op, params in OPS.items() for dt in DTYPES},
}
"""Every exported function: name -> (restype, argtypes)."""

EXPORTED_SYMBOLS = tuple(SIGNATURES)


class KernelError(RuntimeError):
    """A launch function returned a non-zero status; ``status`` holds it."""

    def __init__(self, name: str, status: int, message: str):
        super().__init__(f"{name} failed with status {status}: {message}")
        self.status = status


def load(path: str | Path) -> ctypes.CDLL:
    """Load the library and set ``argtypes``/``restype`` of every function in :data:`SIGNATURES`.

    Raises:
        OSError: the library cannot be loaded.
        AttributeError: it lacks one of the functions (an old or foreign build).
        RuntimeError: its ABI version differs from :data:`ABI_VERSION`.
    """
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    version = lib.mograph_kernels_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {version}, expected {ABI_VERSION}; rebuild the kernels")
    return lib


def check(lib: ctypes.CDLL, name: str, status: int) -> None:
    """Raise :class:`KernelError` (with the library's description) if ``status`` is not OK."""
    if status != OK:
        raw = lib.mograph_kernels_status_string(status)
        raise KernelError(name, status, raw.decode() if raw else "unknown status")
