"""CPU tests of the tuning-table generator in tools/gpu_kernels.py (no GPU, no torch needed)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gk():
    name = "mograph_tools_gpu_kernels_under_test"
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("op", "dtype", "hidden", "shape"),
    [
        ("layer_norm", "f16", 768, (32, 3)),
        ("rms_norm", "bf16", 1024, (32, 4)),
        ("layer_norm", "f32", 1024, (64, 4)),
        ("skip_layer_norm", "f16", 8192, (512, 2)),
        ("layer_norm", "f16", 4096, (128, 4)),
        ("layer_norm", "f16", 1001, None),  # not a whole number of 16-byte packs: generic kernel
        ("layer_norm", "f16", 1000, (32, 4)),  # 125 packs: a row of 32 x 4 with the last 3 packs empty
    ],
)
def test_norm_launch_shape_mirrors_the_dispatch(gk, op, dtype, hidden, shape):
    assert gk.norm_launch_shape(op, dtype, hidden) == shape


def test_tuning_variants_cover_both_block_sizes(gk):
    blocks = {setting[0][2] for setting in gk.TUNING_VARIANTS.values()}
    assert blocks == {64, 128}
    assert gk.TUNING_VARIANTS["v1"][0] == (1, 0, 128)
    assert gk.TUNING_VARIANTS["v13"][0] == (1, 0, 64)
    assert "-DMOGRAPH_NORM_BLOCK=64" in gk.SWEEP_VARIANTS["v13"]


def _record(op, dtype, rows, hidden, times):
    return {"op": op, "dtype": dtype, "rows": rows, "hidden": hidden, **{n: {"s": t} for n, t in times.items()}}


GELU_TABLE = """// header
constexpr NormTune norm_table(int dtype, int kind, int tpr, int vpt, bool full) {
    return {kHintsStream, 0};
}

// op: 0 Gelu, 1 Gelu (tanh), 2 BiasGelu, 3 BiasGelu (tanh; takes the exact form's entry).
constexpr GeluTune gelu_table(int dtype, int op) {
    if (dtype == 1 && op == 0) return {kHintsStream, 1024, 1};  // gelu f16
    return {kHintsStream, 0, 1};
}

}  // namespace mograph
"""


def test_emit_tuning_norm_only_sweep_keeps_gelu_entries(gk, tmp_path):
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    sweep = [
        # v14 (hints 1, 1024 threads, 64-thread blocks) is 3% faster than v1: chosen
        _record("layer_norm", "f16", 16384, 768, {"v1": 1.00e-5, "v5": 0.99e-5, "v14": 0.97e-5}),
        # nothing beats v1 by the margin: v1 stays
        _record("rms_norm", "f32", 16384, 4096, {"v1": 1.00e-4, "v2": 0.998e-4, "v13": 1.01e-4}),
    ]
    summary = gk.emit_tuning(sweep, out, "test sweep")
    text = out.read_text()
    assert "if (dtype == 1 && kind == 0 && tpr == 32 && vpt == 3 && full) return {kHintsStream, 1024, 64, false, false, true};" in text
    assert "if (dtype == 0 && kind == 1 && tpr == 256 && vpt == 4 && full) return {kHintsStream, 0, 128, false, false, true};" in text
    assert "// layer_norm f16 16384x768: v14, G0M0" in text
    # the Gelu entries of the replaced table are carried over verbatim, and said to be
    assert "if (dtype == 1 && op == 0) return {kHintsStream, 1024, 1};  // gelu f16" in text
    assert "kept from the table this one replaced" in text
    assert text.rstrip().endswith("}  // namespace mograph")
    assert f"time / v1 {math.exp(math.log(0.97)):.3f}" in summary


def test_emit_tuning_refuses_when_no_gelu_entries_to_keep(gk, tmp_path):
    out = tmp_path / "tuning_table.cuh"
    sweep = [_record("layer_norm", "f16", 16384, 768, {"v1": 1.00e-5})]
    with pytest.raises(ValueError, match="no Gelu"):
        gk.emit_tuning(sweep, out, "test sweep")
    assert not out.exists()


def test_emit_tuning_needs_the_untuned_variant(gk, tmp_path):
    with pytest.raises(ValueError, match="no v1"):
        gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"v2": 1e-5})], tmp_path / "t.cuh", "x")
    with pytest.raises(ValueError, match="no G0M0"):
        gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"G1M0": 1e-5})], tmp_path / "t.cuh", "x")
    with pytest.raises(ValueError, match="nothing to choose"):
        gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"nopdl": 1e-5})], tmp_path / "t.cuh", "x")


def test_emit_tuning_layout_sweep_keeps_the_other_settings(gk, tmp_path):
    # A sweep of LAYOUT_VARIANTS updates gamma_early/merged per launch shape and keeps each entry's hints,
    # register cap and block size (chosen by an earlier sweep of TUNING_VARIANTS); a second stage-1 sweep then
    # keeps the layout. RMSNorm kinds never get the merged form (they have one reduction).
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"v1": 1.00e-5, "v6": 0.97e-5})], out, "stage 1")
    layout = [
        _record("layer_norm", "f16", 16384, 768, {"G0M0": 1.00e-5, "G1M0": 0.96e-5, "G1M1": 0.97e-5}),
        _record("rms_norm", "f32", 16384, 4096, {"G0M0": 1.00e-4, "G0M1": 0.98e-4, "G1M0": 0.99e-4}),
        _record("skip_layer_norm", "f16", 16384, 768, {"G0M0": 1.00e-5, "G1M1": 0.998e-5}),  # within the margin
    ]
    summary = gk.emit_tuning(layout, out, "stage 2")
    text = out.read_text()
    assert "tpr == 32 && vpt == 3 && full) return {kHintsNone, 1024, 128, true, false, true};  // layer_norm f16 16384x768: v6, G1M0" in text
    assert "tpr == 256 && vpt == 4 && full) return {kHintsL2LastCs, 0, 128, true, false, true};  // rms_norm f32 16384x4096: v1, G1M0" in text
    assert "tpr == 64 && vpt == 2 && !full) return {kHintsL2LastCs, 0, 128, false, false, true};  // skip_layer_norm f16 16384x768: v1, G0M0" in text
    assert "time / G0M0 0.960" in summary
    gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"v1": 1.00e-5, "v14": 0.98e-5})], out, "stage 1 again")
    text = out.read_text()
    assert "return {kHintsStream, 1024, 64, true, false, true};  // layer_norm f16 16384x768: v14, G1M0" in text
    assert text.count("kept from the table this one replaced") == 1
    table = gk.read_norm_table(out)
    assert table[("f16", "layer_norm", (32, 3, True))]["gamma_early"] is True
    assert table[("f16", "layer_norm", (32, 3, True))]["cases"] == "16384x768"


def test_emit_tuning_hint_stage_changes_only_hints(gk, tmp_path):
    # The third stage compares the table as it is ("default") with HINT_VARIANTS forced on top of it: an entry
    # takes hints 4 only where that is TUNING_KEEP_MARGIN faster, keeps everything else, and says so in its note.
    # Sweep-only variants (h3) are not candidates. A later tuning-stage sweep sets the hints again.
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"v1": 1.00e-5, "v6": 0.97e-5})], out, "stage 1")
    hints = [
        _record("layer_norm", "f16", 16384, 768, {"default": 1.00e-5, "h3": 0.90e-5, "h4": 0.98e-5}),
        _record("rms_norm", "f32", 16384, 4096, {"default": 1.00e-4, "h4": 0.997e-4}),  # within the margin
    ]
    summary = gk.emit_tuning(hints, out, "stage 3")
    text = out.read_text()
    assert "return {kHintsL2LastCs, 1024, 128, false, false, true};  // layer_norm f16 16384x768: v6, G0M0, h4" in text
    assert "return {kHintsL2LastCs, 0, 128, false, false, true};  // rms_norm f32 16384x4096: v1, G0M0\n" in text
    assert "-> h4: time / default 0.980" in summary
    entry = gk.read_norm_table(out)[("f16", "layer_norm", (32, 3, True))]
    assert (entry["hints"], entry["min_threads"], entry["tuning"], entry["hint"]) == (4, 1024, "v6", "h4")
    gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"v1": 1.00e-5, "v2": 0.97e-5})], out, "stage 1 again")
    assert "return {kHintsStream, 1024, 128, false, false, true};  // layer_norm f16 16384x768: v2, G0M0\n" in out.read_text()
    with pytest.raises(ValueError, match="no default variant"):
        gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"h4": 1e-5})], out, "x")
    assert "-DMOGRAPH_NORM_HINTS=4" in gk.SWEEP_VARIANTS["h4"] and "h3" in gk.SWEEP_VARIANTS


def test_emit_tuning_hint_stage_with_cap_and_block(gk, tmp_path):
    # The h4m<min_threads>b<block> candidates set the register cap and block size with the hints; the layout
    # and the other entries stay.
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    gk.emit_tuning([_record("layer_norm", "f32", 16384, 4096, {"v1": 1.00e-4, "v2": 0.99e-4})], out, "stage 1")
    gk.emit_tuning([_record("layer_norm", "f32", 16384, 4096, {"G0M0": 1.00e-4, "G1M1": 0.99e-4})], out, "stage 2")
    sweep = [_record("layer_norm", "f32", 16384, 4096, {"default": 1.00e-4, "h4m0b128": 0.99e-4, "h4m1280b64": 0.98e-4})]
    gk.emit_tuning(sweep, out, "stage 3")
    assert "return {kHintsL2LastCs, 1280, 64, true, true, true};  // layer_norm f32 16384x4096: v2, G1M1, h4m1280b64" in (
        out.read_text()
    )
    assert gk.HINT_VARIANTS["h4m1024b128"] == (4, 1024, 128) and gk.HINT_VARIANTS["h4"] == (4, None, None)
    assert gk.SWEEP_VARIANTS["h4m1024b64"] == ["-DMOGRAPH_NORM_HINTS=4", "-DMOGRAPH_NORM_MIN_THREADS=1024",
                                               "-DMOGRAPH_NORM_BLOCK=64"]  # fmt: skip


def test_emit_tuning_one_pass_stage(gk, tmp_path):
    # NL (the register kernel without its grid-stride loop) is a third-stage candidate like the hint variants:
    # where it wins the entry gets one_pass (a sixth field, written only when true) and keeps the rest; a later
    # hint variant keeps one_pass and both names stay in the note; an entry where it loses is unchanged.
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE.replace("    return {kHintsStream, 0};", (
        "    if (dtype == 0 && kind == 0 && tpr == 512 && vpt == 4 && full) return {kHintsStream, 1024, 128, false, false};"
        "  // layer_norm f32 4096x8192: v2, G0M0\n"
        "    if (dtype == 1 && kind == 1 && tpr == 32 && vpt == 3 && full) return {kHintsStream, 0, 128, false, false};"
        "  // rms_norm f16 16384x768: v1, G0M0\n"
        "    return kNormUntuned;")))  # fmt: skip
    sweep = [
        _record("layer_norm", "f32", 4096, 8192, {"default": 1.00e-4, "NL": 0.98e-4, "h4": 0.99e-4}),
        _record("rms_norm", "f16", 16384, 768, {"default": 1.00e-5, "NL": 1.01e-5}),
    ]
    summary = gk.emit_tuning(sweep, out, "stage 3")
    text = out.read_text()
    assert "return {kHintsStream, 1024, 128, false, false, true};  // layer_norm f32 4096x8192: v2, G0M0, NL" in text
    assert "return {kHintsStream, 0, 128, false, false};  // rms_norm f16 16384x768: v1, G0M0\n" in text
    assert "-> NL: time / default 0.980" in summary
    assert gk.read_norm_table(out)[("f32", "layer_norm", (512, 4, True))]["one_pass"] is True
    assert gk.read_norm_table(out)[("f16", "rms_norm", (32, 3, True))]["one_pass"] is False
    gk.emit_tuning([_record("layer_norm", "f32", 4096, 8192, {"default": 1.00e-4, "h4": 0.98e-4})], out, "again")
    entry = gk.read_norm_table(out)[("f32", "layer_norm", (512, 4, True))]
    assert (entry["hints"], entry["min_threads"], entry["one_pass"], entry["hint"]) == (4, 1024, True, "h4+NL")
    assert gk.SWEEP_VARIANTS["NL"] == ["-DMOGRAPH_NORM_ONE_PASS=1"]


def test_emit_tuning_untuned_choice(gk, tmp_path):
    # Launch shapes without an entry get kNormUntuned (UNTUNED_NORM: hints 4, one pass), which an entry that a
    # sweep adds starts from.
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"default": 1.00e-5, "G0M0": 1.00e-5, "G1M0": 0.9e-5})],
                   out, "layout")  # fmt: skip
    text = out.read_text()
    assert "constexpr NormTune kNormUntuned = {kHintsL2LastCs, 0, 128, false, false, true};" in text
    assert "    return kNormUntuned;\n}" in text
    assert "return {kHintsL2LastCs, 0, 128, true, false, true};  // layer_norm f16 16384x768: v1, G1M0" in text


def test_emit_tuning_gelu_hint_stage_with_cap_and_group(gk, tmp_path):
    # gh4m<min_threads>g<group> set the Gelu register cap and group with the hints.
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    sweep = [_record("gelu", "f16", 16384, 768, {"default": 1.00e-5, "gh4": 0.99e-5, "gh4m0g8": 0.97e-5})]
    gk.emit_tuning(sweep, out, "gelu")
    assert gk.read_gelu_table(out)[("f16", "gelu")] == {"hints": 4, "min_threads": 0, "group": 8, "hint": "gh4m0g8"}
    assert gk.SWEEP_VARIANTS["gh4m1024g4"] == ["-DMOGRAPH_GELU_HINTS=4", "-DMOGRAPH_GELU_MIN_THREADS=1024",
                                              "-DMOGRAPH_GELU_GROUP=4"]  # fmt: skip
    assert gk.SWEEP_VARIANTS["gh4"] == ["-DMOGRAPH_GELU_HINTS=4"]


def test_emit_tuning_layout_stage_against_the_table(gk, tmp_path):
    # With "default" in a layout sweep, a layout replaces the entry's own only when TUNING_KEEP_MARGIN faster
    # than the table as it is (without it, against G0M0: an entry whose G1M0 ties G0M0 would go back to G0M0).
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"v1": 1.00e-5}),
                    _record("layer_norm", "f32", 16384, 4096, {"v1": 1.00e-4})], out, "stage 1")  # fmt: skip
    gk.emit_tuning([_record("layer_norm", "f16", 16384, 768, {"G0M0": 1.00e-5, "G1M0": 0.95e-5})], out, "stage 2")
    sweep = [
        _record("layer_norm", "f16", 16384, 768, {"default": 1.00e-5, "G0M0": 0.998e-5, "G1M0": 1.00e-5}),
        _record("layer_norm", "f32", 16384, 4096, {"default": 1.00e-4, "G0M0": 1.00e-4, "G0M1": 0.98e-4}),
    ]
    gk.emit_tuning(sweep, out, "stage 2 again")
    table = gk.read_norm_table(out)
    assert table[("f16", "layer_norm", (32, 3, True))]["layout"] == "G1M0"  # kept: G0M0 is within the margin
    assert table[("f32", "layer_norm", (256, 4, True))]["layout"] == "G0M1"
    assert table[("f32", "layer_norm", (256, 4, True))]["merged"] is True


@pytest.mark.parametrize(
    ("op", "dtype", "hidden", "key"),
    [
        ("skip_layer_norm", "f16", 768, (64, 2, False)),  # 96 packs in a 64 x 2 shape: covered in part
        ("skip_layer_norm", "f16", 1024, (64, 2, True)),
        ("layer_norm", "f32", 3584, (256, 4, False)),
        ("layer_norm", "f32", 4096, (256, 4, True)),
        ("layer_norm", "f16", 1001, None),
    ],
)
def test_norm_entry_shape_tells_full_from_partial_rows(gk, op, dtype, hidden, key):
    assert gk.norm_entry_shape(op, dtype, hidden) == key


def test_emit_tuning_full_and_partial_rows_get_their_own_entries(gk, tmp_path):
    # Sizes of one launch shape that it covers exactly and in part run different instances: each gets its own
    # entry, chosen on its own sizes.
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE)
    sweep = [
        _record("skip_layer_norm", "f16", 16384, 768, {"v1": 1.00e-5, "v2": 0.97e-5, "v3": 0.98e-5}),
        _record("skip_layer_norm", "f16", 65536, 1024, {"v1": 1.00e-4, "v2": 1.01e-4, "v3": 0.98e-4}),
    ]
    gk.emit_tuning(sweep, out, "stage 1")
    text = out.read_text()
    assert "tpr == 64 && vpt == 2 && !full) return {kHintsStream, 1024, 128, false, false, true};" in text
    assert "tpr == 64 && vpt == 2 && full) return {kHintsStream, 1280, 128, false, false, true};" in text
    table = gk.read_norm_table(out)
    assert table[("f16", "skip_layer_norm", (64, 2, False))]["cases"] == "16384x768"
    assert table[("f16", "skip_layer_norm", (64, 2, True))]["tuning"] == "v3"


def test_emit_tuning_gelu_hint_stage(gk, tmp_path):
    # Gelu hint variants change an entry's hints per dtype and form by the geometric mean over the sizes; the
    # untimed Gelu entries and every norm entry are kept; the table reads back.
    out = tmp_path / "tuning_table.cuh"
    out.write_text(GELU_TABLE.replace(
        "    return {kHintsStream, 0, 1};\n}",
        "    if (dtype == 0 && (op == 2 || op == 3)) return {kHintsStream, 1024, 4};  // bias_gelu f32\n"
        "    return {kHintsStream, 0, 1};\n}",
    ))  # fmt: skip
    sweep = [
        _record("gelu", "f16", 16384, 768, {"default": 1.00e-5, "gh4": 0.96e-5}),
        _record("gelu", "f16", 65536, 1024, {"default": 1.00e-4, "gh4": 1.01e-4}),  # mean 0.985: taken
        _record("bias_gelu", "f32", 16384, 768, {"default": 1.00e-5, "gh3": 0.90e-5, "gh4": 1.10e-5}),
    ]
    summary = gk.emit_tuning(sweep, out, "gelu hints")
    text = out.read_text()
    assert "if (dtype == 1 && op == 0) return {kHintsL2LastCs, 1024, 1};  // gelu f16: gh4" in text
    assert "if (dtype == 0 && (op == 2 || op == 3)) return {kHintsStream, 1024, 4};  // bias_gelu f32\n" in text
    assert "kept from the table" not in text
    assert "bias_gelu       f32   -> default" in summary
    assert gk.read_gelu_table(out)[("f16", "gelu")] == {"hints": 4, "min_threads": 1024, "group": 1, "hint": "gh4"}
    with pytest.raises(ValueError, match="no entry"):
        gk.emit_tuning([_record("gelu_tanh", "bf16", 16384, 768, {"default": 1e-5, "gh4": 0.9e-5})], out, "x")


def test_shipped_table_parses(gk):
    # Every norm entry of the committed table is one the generator can read back (so a sweep of one stage
    # keeps the other stage's choices).
    path = ROOT / "kernels" / "src" / "tuning_table.cuh"
    lines = [ln for ln in path.read_text().splitlines() if ln.strip().startswith("if (dtype")]
    entries = [ln for ln in lines if "kind ==" in ln]
    assert entries and len(gk.read_norm_table(path)) == len(entries)
    assert len(gk.read_gelu_table(path)) == len(lines) - len(entries) > 0


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "skip_layer_norm", "skip_rms_norm", "gelu", "bias_gelu"])
def test_bench_baselines_agree_on_cpu(gk, op):
    # The two torch baselines of the benchmark (torch.nn.functional and the decomposed formula given to
    # torch.compile) must compute the same op as our kernel: checked here on CPU tensors, in fp32.
    torch = pytest.importorskip("torch")

    class NoLib:  # the kernel library is not needed for the baselines
        def __getattr__(self, name):
            return None

    abi = gk._load("abi")
    b = gk.Bench(torch, NoLib(), abi, op, "f32", 8, 64, device="cpu")
    s = b.sets[0]
    want = b.eager(s)
    got = b.decomposed()(s)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want) == (2 if op in gk.SKIP_OPS else 1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert b.bytes == (4 if op in gk.SKIP_OPS else 2) * 8 * 64 * 4


def test_profile_case_prints_usage_without_arguments():
    # tools/profile_case.py (one case under an NVTX range, for Nsight Compute) needs a GPU to run; without its
    # five arguments it must say how to call it and fail, before importing torch.
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_case.py")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "usage: python tools/profile_case.py LIBRARY OP DTYPE ROWS HIDDEN" in proc.stderr


def test_shapes_option_parses_and_refuses_bad_input(gk):
    assert gk.parse_shapes("16384x768, 4096X8192") == [(16384, 768), (4096, 8192)]
    for bad in ("16384", "x768", "16384x0", "16384x7.5"):
        with pytest.raises(Exception, match="ROWSxHIDDEN"):
            gk.parse_shapes(bad)
