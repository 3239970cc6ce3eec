"""The kernels' build and ABI: the library compiles with nvcc and exports exactly the documented C functions.

The header, the ctypes binding (``mograph._kernels.abi``) and ``mograph/_kernels/README.md`` must name the same functions;
that part needs no compiler. Building needs nvcc on PATH (skipped otherwise) but no GPU, and neither do the
argument checks at the end: an entry point rejects bad arguments before it touches CUDA.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mograph._kernels import abi, build

KERNELS = build.KERNELS_DIR

NVCC = build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH (nor NVCC / CUDA_HOME): cannot build")


def test_header_declares_exactly_the_binding():
    header = (KERNELS / "include" / "mograph_kernels.h").read_text()
    declared = re.findall(r"MOGRAPH_API\s+[\w\s\*]+?\b(mograph_\w+)\s*\(", header)
    assert sorted(declared) == sorted(abi.EXPORTED_SYMBOLS)
    assert f"#define MOGRAPH_KERNELS_ABI_VERSION {abi.ABI_VERSION}" in header
    assert f"#define MOGRAPH_GELU_TANH {abi.GELU_TANH}u" in header


def test_header_parameter_counts_match_the_binding():
    header = (KERNELS / "include" / "mograph_kernels.h").read_text()
    for name, (_, argtypes) in abi.SIGNATURES.items():
        match = re.search(rf"\b{name}\s*\(([^)]*)\)", header)
        assert match, name
        params = [p for p in match.group(1).split(",") if p.strip() and p.strip() != "void"]
        assert len(params) == len(argtypes), name


def test_production_sources_have_no_experiment_switches():
    """Tuning is frozen: the only preprocessor switch of the sources is MOGRAPH_NO_PDL (plain launches)."""
    switches = set()
    for path in sorted((KERNELS / "src").iterdir()):
        switches |= set(re.findall(r"#\s*(?:if|ifdef|ifndef|elif)\b[^\n]*?\b(MOGRAPH_\w+)", path.read_text()))
        switches |= set(re.findall(r"defined\((MOGRAPH_\w+)\)", path.read_text()))
    assert switches == {"MOGRAPH_NO_PDL"}


def test_readme_documents_every_symbol():
    readme = (KERNELS / "README.md").read_text()
    for op in abi.OPS:
        assert f"mograph_{op}_<dtype>" in readme or all(abi.symbol(op, d) in readme for d in abi.DTYPES), op
    assert "mograph_kernels_abi_version" in readme
    assert "mograph_kernels_status_string" in readme


@pytest.fixture
def library(kernel_library) -> Path:
    """The library built from scratch once per test run (the session fixture in ``tests/conftest.py``)."""
    return kernel_library


@pytest.mark.slow
@needs_nvcc
def test_build_exports_every_symbol_through_ctypes(library):
    lib = abi.load(library)  # sets argtypes of every symbol; AttributeError if one is missing
    assert lib.mograph_kernels_abi_version() == abi.ABI_VERSION


@pytest.mark.slow
@needs_nvcc
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) not installed")
def test_build_exports_nothing_else(library):
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if line.split()[-2:-1] == ["T"]}
    assert set(abi.EXPORTED_SYMBOLS) <= exported
    assert {s for s in exported if s.startswith("mograph")} == set(abi.EXPORTED_SYMBOLS)


@pytest.mark.slow
@needs_nvcc
def test_bad_arguments_are_rejected_without_a_gpu(library):
    lib = abi.load(library)
    bad = abi.ERR_INVALID_ARGUMENT
    fake = 0x1000  # never dereferenced: the checks come first
    for dt in abi.DTYPES:
        ln = getattr(lib, abi.symbol("layer_norm", dt))
        assert ln(None, fake, None, fake, 4, 8, 1e-5, 0, None) == bad  # x missing
        assert ln(fake, None, None, fake, 4, 8, 1e-5, 0, None) == bad  # gamma missing
        assert ln(fake, fake, None, fake, 4, 0, 1e-5, 0, None) == bad  # hidden 0
        assert ln(fake, fake, None, fake, -1, 8, 1e-5, 0, None) == bad  # negative rows
        assert ln(fake, fake, None, fake, 4, 8, 1e-5, 1, None) == bad  # unknown flag
        assert ln(fake, fake, None, fake, 4, 1 << 31, 1e-5, 0, None) == abi.ERR_UNSUPPORTED
        assert ln(None, None, None, None, 0, 8, 1e-5, 0, None) == abi.OK  # nothing to do
        rms = getattr(lib, abi.symbol("rms_norm", dt))
        assert rms(fake, fake, None, 4, 8, 1e-5, 0, None) == bad
        sln = getattr(lib, abi.symbol("skip_layer_norm", dt))
        assert sln(fake, None, None, fake, None, fake, None, 4, 8, 1e-5, 0, None) == bad  # skip missing
        srn = getattr(lib, abi.symbol("skip_rms_norm", dt))
        assert srn(fake, None, None, fake, fake, None, 4, 8, 1e-5, 0, None) == bad  # skip missing
        assert srn(fake, fake, None, None, fake, None, 4, 8, 1e-5, 0, None) == bad  # gamma missing
        assert srn(None, None, None, None, None, None, 0, 8, 1e-5, 0, None) == abi.OK  # nothing to do
        gelu = getattr(lib, abi.symbol("gelu", dt))
        assert gelu(fake, None, 16, 0, None) == bad
        assert gelu(fake, fake, 16, 2, None) == bad  # unknown flag
        assert gelu(None, None, 0, abi.GELU_TANH, None) == abi.OK
        bias_gelu = getattr(lib, abi.symbol("bias_gelu", dt))
        assert bias_gelu(fake, None, fake, 4, 8, 0, None) == bad
    assert lib.mograph_kernels_status_string(abi.OK) == b"ok"
    assert b"invalid" in lib.mograph_kernels_status_string(bad)
    with pytest.raises(abi.KernelError, match="status 1"):
        abi.check(lib, "mograph_layer_norm_f32", bad)
