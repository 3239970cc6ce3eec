"""Peak memory of the precision passes stays within twice the weights (issue 25 item 3, issue 27 item 3).

Two checks that fail when a pass holds a second full copy of the weights:

* in process, ``tracemalloc`` (numpy arrays and Python bytes are traced; ONNX Runtime's own memory and
  the pages of memory-mapped weights are not): the largest traced memory while ``fp16`` and ``int4``
  (``--algorithm rtn``, its accuracy-budget search included) run with ``--verify`` on a 29 MB decoder
  whose weights are in external data, ``MOGRAPH_PROTO_LIMIT`` lowered so the model takes the paths of a
  model above 2 GB (as in ``test_large_model_passes.py``).  Measured before the fixes: fp16 2.43x the
  weights (a float16 copy of the model left to the garbage collector beside the next one, sessions
  given bytes), int4 2.10x (every dequantized weight of both widths kept through the budget search);
  after: 1.34x and 1.17x.
* in a subprocess, the peak resident size (``VmHWM``) of ``mograph optimize --passes fp16 --verify`` on
  a 150 MB model: less the interpreter and imports, at most 2x the weights.
  ``tools/bench_memory.py`` measures every pass and command the same way.

Both are slow (20-60 s on two cores).
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest

import mograph

pytest.importorskip("onnxruntime")

from models.large import decoder_bytes, decoder_feeds, write_decoder  # noqa: E402

SMALL = dict(hidden=256, ffn=1024, vocab=2048, layers=8)
HEADS = 4


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    folder = tmp_path_factory.mktemp("peak")
    path = write_decoder(folder, heads=HEADS, **SMALL)
    feeds = folder / "feeds.npz"
    np.savez(feeds, **decoder_feeds(heads=HEADS, **SMALL))
    return path, feeds, decoder_bytes(**SMALL)


#: traced peak over the weights, by pass: (bound, options)
BOUNDS = {"fp16": (1.8, {}), "int4": (1.6, {"algorithm": "rtn"})}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BOUNDS))
def test_a_pass_does_not_hold_a_second_copy_of_the_weights(small, name, monkeypatch):
    path, feeds, weights = small
    monkeypatch.setenv("MOGRAPH_PROTO_LIMIT", str(64 * 1024))  # the paths of a model above 2 GB
    bound, options = BOUNDS[name]
    tracemalloc.start()
    try:
        _, report = mograph.optimize(str(path), [name], options={"calibration_data": str(feeds), **options},
                                     verify=True, verify_options={"feeds": str(feeds)})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.verification is not None and report.verification["passed"]
    main = next(p for p in report.passes if p.name not in ("eliminate-dead", "lower"))
    assert main.modified, (name, main.stats)
    assert peak <= bound * weights, f"{name}: traced peak {peak / weights:.2f}x the weights"


_PEAK = (
    "import sys\nfrom mograph.cli import main\ncode = main(sys.argv[1:])\n"
    "peak = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "sys.stderr.write('PEAK_RSS %d\\n' % peak)\nsys.exit(code)\n"
)
_FLOOR = (
    "import mograph.api, onnxruntime, onnx, numpy\n"
    "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')))\n"
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_fp16_verify_peak_resident_memory_within_twice_the_weights(tmp_path):
    sizes = dict(hidden=512, ffn=2048, vocab=32768, layers=3)
    weights = decoder_bytes(**sizes)
    path = write_decoder(tmp_path, heads=8, **sizes)
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, **decoder_feeds(heads=8, **sizes))
    floor = int(subprocess.run([sys.executable, "-c", _FLOOR], capture_output=True, text=True, check=True).stdout)
    proc = subprocess.run([sys.executable, "-c", _PEAK, "optimize", str(path), "-o", str(tmp_path / "out.onnx"),
                           "--passes", "fp16", "--calibration-data", str(feeds), "--verify", "--feeds", str(feeds)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(next(line for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS")).split()[1])
    assert peak - floor <= 2 * weights, f"peak {peak / 2**20:.0f} MiB, floor {floor / 2**20:.0f} MiB, " \
                                        f"weights {weights / 2**20:.0f} MiB: {(peak - floor) / weights:.2f}x"


def test_int8_output_between_the_spill_and_save_limits_loads_again(tmp_path, monkeypatch):
    # The after-run of tools/bench_memory.py on a 411 MB decoder: int8 left 103 MB of weights, all in
    # memory.  That is past the spill limit (the model reached ONNX Runtime as a spilled file, so nothing
    # serialized it in memory) and below the external-data limit of a save, which then streamed its
    # large initializers one at a time, unnamed: the file's DequantizeLinear read a missing
    # '..._quantized' initializer, written with exit 0, refused on the next load (sweep: exit 4).
    # Both limits are lowered so a 0.7 MB decoder takes the same paths.
    from mograph import _spill, ir_io
    from mograph.cli import main

    sizes = dict(hidden=64, ffn=256, vocab=512, layers=2)
    path = write_decoder(tmp_path / "ext", heads=HEADS, **sizes)
    src = tmp_path / "inline.onnx"
    onnx.save(onnx.load(str(path)), str(src))  # weights inside the protobuf: int8 leaves nothing external
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, **decoder_feeds(heads=HEADS, **sizes))
    monkeypatch.setattr(_spill, "SPILL_BYTES", 4096)
    monkeypatch.setattr(ir_io, "_STREAMED_BYTES", 4096)
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(src), "-o", str(out), "--passes", "int8", "--calibration-data", str(feeds),
                 "--verify", "--feeds", str(feeds)])
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ext", "feeds.npz", "inline.onnx", "out.onnx"]  # inline
    proto = onnx.load(str(out))
    streamed = [t.name for t in proto.graph.initializer if t.ByteSize() >= 4096]
    assert any(name.endswith("_quantized") for name in streamed), streamed
    assert all(streamed), streamed  # every streamed initializer is named
    model = ir_io.load_model(out)  # no dangling input
    assert any(n.op_type == "DequantizeLinear" for n in model.graph)
