"""The kernels' frozen launch table (``mograph/_kernels/src/launch_table.cuh``), read as the data it is.

The table holds the sm_90 launch choices of the benchmarked cases (one norm row per dtype, op and benchmarked
row size; one Gelu row per dtype and form) and the defaults every other shape and architecture takes. These
tests need no compiler: they check that every benchmarked case has exactly one row, that every value is one the
kernels accept, and that the defaults exist. nvcc checks the rest when it builds (``norm.cuh``'s static_asserts:
each row's size has a register-kernel launch shape, no two rows set one shape and coverage), and
``test_build.py`` / ``test_gpu.py`` build and run every launch shape.
"""

from __future__ import annotations

import re

from mograph._kernels import build

TABLE = (build.KERNELS_DIR / "src" / "launch_table.cuh").read_text()
BENCHMARKS = (build.KERNELS_DIR / "BENCHMARKS.md").read_text()

DTYPES = {"kF32": "f32", "kF16": "f16", "kBf16": "bf16"}
KINDS = {"kLN": "layer_norm", "kRMS": "rms_norm", "kSkipLN": "skip_layer_norm", "kSkipRMS": "skip_rms_norm"}
HINTS = {"kPlain", "kStream", "kL2LastCs"}
LAYOUT_BITS = {"kGammaEarly", "kMerged", "kOnePass"}
SIZES = (768, 1024, 4096, 8192)

_NORM_ROW = re.compile(r"^\s*\{(kF32|kF16|kBf16),\s*(k\w+),\s*(\d+),\s*(k\w+),\s*(\d+),\s*(\d+),\s*([^}]*)\},", re.M)
_GELU_ROW = re.compile(r"^\s*\{(kF32|kF16|kBf16),\s*([0-2]),\s*(k\w+),\s*(\d+),\s*(\d+)\},", re.M)


def _section(name: str) -> str:
    start = TABLE.index(name)
    return TABLE[start : TABLE.index("};", start)]


def norm_rows() -> list[tuple[str, str, int, str, int, int, str]]:
    return [
        (DTYPES[d], KINDS[k], int(h), hints, int(cap), int(block), layout.strip())
        for d, k, h, hints, cap, block, layout in _NORM_ROW.findall(_section("kNormSm90[]"))
    ]


def gelu_rows() -> list[tuple[str, int, str, int, int]]:
    return [(DTYPES[d], int(op), h, int(cap), int(g)) for d, op, h, cap, g in _GELU_ROW.findall(_section("kGeluSm90[]"))]


def test_every_benchmarked_norm_case_has_one_row():
    keys = [(d, k, h) for d, k, h, *_ in norm_rows()]
    assert len(keys) == len(set(keys))
    assert set(keys) == {(d, k, h) for d in DTYPES.values() for k in KINDS.values() for h in SIZES}


def test_norm_rows_hold_legal_values():
    for d, k, h, hints, cap, block, layout in norm_rows():
        where = f"{k} {d} {h}"
        assert hints in HINTS, where
        assert cap in (0, 1024, 1280, 1536), where  # resident threads per SM; 0: no register cap
        assert block in (64, 128), where
        bits = {b.strip() for b in layout.split("|")} - {"0"}
        assert bits <= LAYOUT_BITS, where
        assert "kMerged" not in bits or k in ("layer_norm", "skip_layer_norm"), where  # only centered norms merge
        assert h % (4 if d == "f32" else 8) == 0, where  # whole 16-byte packs: the register kernel


def test_every_gelu_form_has_one_row_with_legal_values():
    rows = gelu_rows()
    assert sorted((d, op) for d, op, *_ in rows) == sorted((d, op) for d in DTYPES.values() for op in (0, 1, 2))
    for d, op, hints, cap, group in rows:
        assert hints in HINTS and cap in (0, 1024) and group in (1, 4, 8), (d, op)


def test_defaults_cover_every_other_shape_and_architecture():
    assert re.search(r"constexpr NormTune kNormDefault = \{kL2LastCs, 0, 128, kOnePass\};", TABLE)
    assert re.search(r"constexpr GeluTune kGeluDefault = \{kStream, 0, 1\};", TABLE)
    assert "cc_major == 9 ? kArchSm90 : kArchDefault" in TABLE  # only sm_90 reads the measured rows


def test_the_rows_are_the_benchmarked_sizes():
    for rows, hidden in ((16384, 768), (65536, 1024), (16384, 4096), (4096, 8192)):
        assert f"| {rows}x{hidden} |" in BENCHMARKS
