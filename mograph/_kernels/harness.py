"""Correctness harness for the CUDA kernels: run one op on the GPU and compare it with :mod:`.reference`.

Shared by ``tests/kernels/test_gpu.py`` and ``tools/gpu_kernels.py`` so both check the same thing the same
way. A :class:`Case` names an op, a dtype, a shape and the op's options; :func:`check_case` draws seeded
inputs, runs the kernel through the ctypes binding of :mod:`.abi` on device memory owned by torch (or
CuPy when torch has no CUDA), and compares every output with the numpy reference.

What a check guards against: outputs are poisoned with NaN before the launch, so an element the kernel
never writes fails; inputs are shifted away from zero mean, so a variance computed as E[x^2] - E[x]^2 would
show; ``misalign`` offsets every pointer by one element, which forces the scalar generic path.

Tolerance: ``|out - ref| <= tol * (|ref| + rms(ref))`` elementwise, with tol 1e-5 for fp32 and 1e-2 for
fp16/bf16 (a relative bound, softened near zero by the output's scale, where a relative bound means
nothing). bf16 needs ``ml_dtypes`` on the host (numpy has no bfloat16).

Nothing here imports torch or CuPy until a backend is asked for, so the module loads on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mograph._kernels import abi, reference

__all__ = [
    "TOLERANCE",
    "Case",
    "CaseResult",
    "check_case",
    "find_backend",
    "host_dtype",
    "make_grid",
]

TOLERANCE = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}
ROW_OPS = ("layer_norm", "rms_norm", "skip_layer_norm", "skip_rms_norm", "bias_gelu")
ALL_OPS = ("layer_norm", "rms_norm", "skip_layer_norm", "skip_rms_norm", "gelu", "bias_gelu")


def host_dtype(dtype: str) -> np.dtype:
    """numpy dtype for a kernel dtype suffix; bf16 needs ml_dtypes (ImportError otherwise)."""
    if dtype == "f32":
        return np.dtype(np.float32)
    if dtype == "f16":
        return np.dtype(np.float16)
    if dtype == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"unknown dtype {dtype!r}")


# ---- device backends -------------------------------------------------------------------------------------------
class _TorchBackend:
    name = "torch"

    def __init__(self, torch):
        self.torch = torch

    def upload(self, a: np.ndarray):
        t = self.torch
        raw = np.ascontiguousarray(a)
        if raw.dtype.itemsize == 2 and raw.dtype != np.float16:  # bf16: move the bits
            return t.from_numpy(raw.view(np.int16)).cuda().view(t.bfloat16)
        return t.from_numpy(raw).cuda()

    def empty(self, n: int, dtype: np.dtype):
        t = self.torch
        tdt = {np.dtype(np.float32): t.float32, np.dtype(np.float16): t.float16}.get(np.dtype(dtype), t.bfloat16)
        return t.full((n,), float("nan"), dtype=tdt, device="cuda")

    def download(self, d, dtype: np.dtype) -> np.ndarray:
        t = self.torch
        if d.dtype == t.bfloat16:
            return d.view(t.int16).cpu().numpy().view(dtype)
        return d.cpu().numpy()

    def ptr(self, d, offset_elems: int = 0) -> int:
        return d.data_ptr() + offset_elems * d.element_size()

    def stream(self) -> int:
        return self.torch.cuda.current_stream().cuda_stream

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()


class _CupyBackend:
    name = "cupy"

    def __init__(self, cupy):
        self.cp = cupy

    def upload(self, a: np.ndarray):
        raw = np.ascontiguousarray(a)
        if raw.dtype.itemsize == 2 and raw.dtype != np.float16:
            raw = raw.view(np.uint16)
        return self.cp.asarray(raw)

    def empty(self, n: int, dtype: np.dtype):
        if np.dtype(dtype) in (np.dtype(np.float32), np.dtype(np.float16)):
            return self.cp.full((n,), np.nan, dtype=dtype)
        return self.cp.full((n,), 0x7FC0, dtype=np.uint16)  # bf16 NaN bits

    def download(self, d, dtype: np.dtype) -> np.ndarray:
        return self.cp.asnumpy(d).view(dtype)

    def ptr(self, d, offset_elems: int = 0) -> int:
        return d.data.ptr + offset_elems * d.itemsize

    def stream(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()


def find_backend() -> tuple[Any | None, str]:
    """A device backend (torch first, then CuPy) and a description; (None, why) when no CUDA GPU is usable."""
    reasons = []
    try:
        import torch

        if torch.cuda.is_available():
            return _TorchBackend(torch), f"torch {torch.__version__} on {torch.cuda.get_device_name()}"
        reasons.append(f"torch {torch.__version__} sees no CUDA device")
    except ImportError:
        reasons.append("torch is not installed")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return _CupyBackend(cupy), f"cupy {cupy.__version__}"
        reasons.append("cupy sees no CUDA device")
    except ImportError:
        reasons.append("cupy is not installed")
    except Exception as exc:  # cupy raises its own runtime error type when there is no driver
        reasons.append(f"cupy cannot reach a GPU ({exc.__class__.__name__}: {exc})")
    return None, "no CUDA GPU: " + "; ".join(reasons)


# ---- cases --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One kernel invocation to check.

    ``options`` (key, value) pairs: beta, bias, with_sum, inplace (bool: y written over x), special (bool:
    the first inputs are infinities, NaN, zeros and extremes), approximate ("none" or "tanh"). ``misalign`` offsets every device pointer by one element.
    """

    op: str
    dtype: str
    rows: int
    hidden: int
    misalign: bool = False
    options: tuple[tuple[str, Any], ...] = ()

    def opt(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        mis = ",misaligned" if self.misalign else ""
        return f"{self.op}[{self.dtype},{self.rows}x{self.hidden}{mis}{',' + opts if opts else ''}]"


@dataclass
class CaseResult:
    case: Case
    ok: bool
    max_scaled_err: float  # max over outputs of max |out - ref| / (|ref| + rms(ref)); pass when <= tolerance
    tolerance: float
    message: str = ""
    outputs: dict[str, float] = field(default_factory=dict)


def make_grid(
    hiddens=(64, 768, 1000, 1024, 4096, 8192, 33),
    dtypes=("f32", "f16", "bf16"),
    rows: int = 67,
    extra_hiddens=(1, 7, 8193),
) -> list[Case]:
    """The correctness grid: every op x dtype x hidden, each op's options varied, plus misaligned and odd sizes.

    rows is deliberately not a multiple of the rows-per-block of any configuration, so partial blocks run.
    """
    cases: list[Case] = []
    for dt in dtypes:
        for h in (*hiddens, *extra_hiddens):
            cases.append(Case("layer_norm", dt, rows, h, options=(("beta", True),)))
            cases.append(Case("layer_norm", dt, rows, h, options=(("beta", False),)))
            cases.append(Case("rms_norm", dt, rows, h))
            cases.append(
                Case("skip_layer_norm", dt, rows, h, options=(("bias", True), ("beta", True), ("with_sum", True)))
            )
            cases.append(
                Case("skip_layer_norm", dt, rows, h, options=(("bias", False), ("beta", False), ("with_sum", False)))
            )
            cases.append(Case("skip_rms_norm", dt, rows, h, options=(("bias", True), ("with_sum", True))))
            cases.append(Case("skip_rms_norm", dt, rows, h, options=(("bias", False), ("with_sum", False))))
            for approx in ("none", "tanh"):
                cases.append(Case("gelu", dt, rows, h, options=(("approximate", approx),)))
                cases.append(Case("bias_gelu", dt, rows, h, options=(("approximate", approx),)))
        for approx in ("none", "tanh"):
            cases.append(Case("gelu", dt, 3, 40, options=(("approximate", approx), ("special", True))))
        for h in (768, 4096):  # aligned sizes through the generic path
            cases.append(Case("layer_norm", dt, 5, h, misalign=True, options=(("beta", True),)))
            cases.append(Case("rms_norm", dt, 5, h, misalign=True))
            cases.append(
                Case(
                    "skip_layer_norm",
                    dt,
                    5,
                    h,
                    misalign=True,
                    options=(("bias", True), ("beta", True), ("with_sum", True)),
                )
            )
            cases.append(Case("skip_rms_norm", dt, 5, h, misalign=True, options=(("bias", True), ("with_sum", True))))
            cases.append(Case("gelu", dt, 5, h, misalign=True, options=(("approximate", "none"),)))
            cases.append(Case("bias_gelu", dt, 5, h, misalign=True, options=(("approximate", "tanh"),)))
    for dt in dtypes:
        cases.append(Case("layer_norm", dt, 3001, 1024, options=(("beta", True),)))  # many blocks, many waves
        cases.append(
            Case("skip_layer_norm", dt, 3001, 768, options=(("bias", True), ("beta", True), ("with_sum", True)))
        )
        cases.append(Case("skip_rms_norm", dt, 3001, 4096, options=(("bias", True), ("with_sum", True))))
        cases.append(Case("layer_norm", dt, rows, 768, options=(("beta", True), ("inplace", True))))
        cases.append(Case("gelu", dt, rows, 1000, options=(("approximate", "tanh"), ("inplace", True))))
    return cases


def _inputs(case: Case, dtype: np.dtype, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    r, h = case.rows, case.hidden
    if case.op in ("gelu", "bias_gelu"):
        x = rng.standard_normal((r, h)) * 3.0  # reaches both tails of the gelu
    else:
        # shifted rows (mean 2..4, std 0.5..2): a cancelling variance formula would show
        x = rng.standard_normal((r, h)) * rng.uniform(0.5, 2.0, (r, 1)) + rng.uniform(2.0, 4.0, (r, 1))
    if case.opt("special", False):  # infinities, NaN, signed zeros, tiny and huge values, then random
        special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 8.0, -8.0, 30.0, -30.0,
                            60000.0, -60000.0])  # fmt: skip
        flat = x.reshape(-1)
        flat[: special.size] = special[: flat.size]
    out = {"x": x.astype(np.float32).astype(dtype)}
    if case.op in ("layer_norm", "rms_norm", "skip_layer_norm", "skip_rms_norm"):
        out["gamma"] = (1.0 + 0.25 * rng.standard_normal(h)).astype(np.float32).astype(dtype)
        if case.op in ("layer_norm", "skip_layer_norm") and case.opt("beta", True):
            out["beta"] = (0.5 * rng.standard_normal(h)).astype(np.float32).astype(dtype)
    if case.op in ("skip_layer_norm", "skip_rms_norm"):
        out["skip"] = rng.standard_normal((r, h)).astype(np.float32).astype(dtype)
        if case.opt("bias", False):
            out["bias"] = (0.5 * rng.standard_normal(h)).astype(np.float32).astype(dtype)
    if case.op == "bias_gelu":
        out["bias"] = rng.standard_normal(h).astype(np.float32).astype(dtype)
    return out


def _reference(ref, case: Case, inp: dict[str, np.ndarray], eps: float) -> dict[str, np.ndarray]:
    if case.op == "layer_norm":
        return {"y": ref.layer_norm(inp["x"], inp["gamma"], inp.get("beta"), eps)}
    if case.op == "rms_norm":
        return {"y": ref.rms_norm(inp["x"], inp["gamma"], eps)}
    if case.op == "skip_layer_norm":
        y, s = ref.skip_layer_norm(
            inp["x"], inp["skip"], inp["gamma"], inp.get("beta"), inp.get("bias"), eps, return_sum=True
        )
        return {"y": y, "sum_out": s} if case.opt("with_sum", False) else {"y": y}
    if case.op == "skip_rms_norm":
        y, s = ref.skip_rms_norm(inp["x"], inp["skip"], inp["gamma"], inp.get("bias"), eps, return_sum=True)
        return {"y": y, "sum_out": s} if case.opt("with_sum", False) else {"y": y}
    if case.op == "gelu":
        return {"y": ref.gelu(inp["x"], case.opt("approximate", "none"))}
    if case.op == "bias_gelu":
        return {"y": ref.bias_gelu(inp["x"], inp["bias"], case.opt("approximate", "none"))}
    raise ValueError(f"unknown op {case.op!r}")


def launch(lib, abi, case: Case, ptrs: dict[str, int | None], stream: int, eps: float = 1e-5) -> int:
    """Call the case's C function with device pointers ``ptrs`` (missing optional ones are NULL)."""
    fn = getattr(lib, abi.symbol(case.op, case.dtype))
    r, h = case.rows, case.hidden
    flags = abi.GELU_TANH if case.opt("approximate", "none") == "tanh" else 0
    p = ptrs.get
    if case.op == "layer_norm":
        return fn(p("x"), p("gamma"), p("beta"), p("y"), r, h, eps, 0, stream)
    if case.op == "rms_norm":
        return fn(p("x"), p("gamma"), p("y"), r, h, eps, 0, stream)
    if case.op == "skip_layer_norm":
        return fn(p("x"), p("skip"), p("bias"), p("gamma"), p("beta"), p("y"), p("sum_out"), r, h, eps, 0, stream)
    if case.op == "skip_rms_norm":
        return fn(p("x"), p("skip"), p("bias"), p("gamma"), p("y"), p("sum_out"), r, h, eps, 0, stream)
    if case.op == "gelu":
        return fn(p("x"), p("y"), r * h, flags, stream)
    if case.op == "bias_gelu":
        return fn(p("x"), p("bias"), p("y"), r, h, flags, stream)
    raise ValueError(f"unknown op {case.op!r}")


def _scaled_error(out: np.ndarray, ref: np.ndarray) -> float:
    o = out.astype(np.float64)
    rf = ref.astype(np.float64)
    if o.shape != rf.shape:
        return float("inf")
    if np.any(np.isnan(o) != np.isnan(rf)):
        return float("inf")
    if np.any(np.isinf(rf) & (o != rf)):
        return float("inf")
    finite = np.isfinite(rf)
    o, rf = o[finite], rf[finite]
    if rf.size == 0:
        return 0.0
    scale = np.sqrt(np.mean(rf * rf))
    return float(np.max(np.abs(o - rf) / (np.abs(rf) + scale + 1e-30)))


def check_case(lib, backend, case: Case, seed: int = 0, eps: float = 1e-5) -> CaseResult:
    """Run one case on the GPU and compare it with the reference; never raises for a numeric mismatch."""
    ref = reference
    tol = TOLERANCE[case.dtype]
    dtype = host_dtype(case.dtype)
    inp = _inputs(case, dtype, seed)
    expected = _reference(ref, case, inp, eps)
    off = 1 if case.misalign else 0

    keep = []  # device buffers must outlive the launch
    ptrs: dict[str, int | None] = {}
    for name, arr in inp.items():
        flat = arr.reshape(-1)
        if off:
            flat = np.concatenate([np.zeros(off, dtype=dtype), flat])
        d = backend.upload(flat)
        keep.append(d)
        ptrs[name] = backend.ptr(d, off)
    outs = {}
    for name, want in expected.items():
        if name == "y" and case.opt("inplace", False):  # y written over x
            outs[name] = keep[list(inp).index("x")]
        else:
            outs[name] = backend.empty(want.size + off, dtype)
            keep.append(outs[name])
        ptrs[name] = backend.ptr(outs[name], off)
    status = launch(lib, abi, case, ptrs, backend.stream(), eps)
    backend.synchronize()
    if status != abi.OK:
        msg = lib.mograph_kernels_status_string(status).decode()
        return CaseResult(case, False, float("inf"), tol, f"status {status}: {msg}")
    errs = {}
    for name, want in expected.items():
        got = backend.download(outs[name], dtype)[off:].reshape(want.shape)
        errs[name] = _scaled_error(got, want)
    worst = max(errs.values())
    ok = worst <= tol
    detail = ", ".join(f"{k}: {v:.3g}" for k, v in errs.items())
    return CaseResult(case, ok, worst, tol, "" if ok else f"scaled error {detail} > {tol}", errs)
