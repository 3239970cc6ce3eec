"""A model above 2 GB goes through ``mograph optimize --passes cleanup`` with memory far below its size.

The model is made here, on disk, without ever holding it in memory: three 768 MiB initializers
(2.25 GiB in all, past protobuf's 2 GB limit) live in one external-data file that a small ``.onnx``
file points at.  To keep the test quick the file is sparse: a 1 MiB stripe every 32 MiB (and at each
tensor's end) holds values given by a formula of the element index — different per tensor — and the
rest is a hole that reads as zeros.  Every stripe of the output is compared with the formula and a few
holes with zero, which catches a wrong offset, order, length or tensor anywhere in the copy.  If a pass
read the weights, holes included, its pages would count in the peak memory just the same.

Peak memory is the optimizing process's own high-water mark (``VmHWM`` of ``/proc/self/status``),
read inside the child.  ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` would be wrong here: Linux carries a
process's peak across ``exec``, so a child spawned from a large pytest process starts out "using"
the parent's memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytestmark = pytest.mark.slow

ROWS, COLS = 196_608, 1024  # 192 Mi elements, 768 MiB per tensor
N = ROWS * COLS
STRIDE, STRIPE = 1 << 23, 1 << 18  # elements: a 1 MiB stripe of data every 32 MiB
TENSORS = {"W0": np.float32, "W1": np.int32, "W2": np.int32}
MODEL_BYTES = len(TENSORS) * N * 4

PEAK_SCRIPT = r"""
import json, resource, sys
from mograph.cli import main
code = main(sys.argv[1:])
peak = None
try:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
except OSError:
    pass
if peak is None:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = rss if sys.platform == "darwin" else rss * 1024
sys.stderr.write("PEAK_RSS %d\n" % peak)
sys.exit(code)
"""


def expected(name: str, start: int, stop: int) -> np.ndarray:
    """Element ``k`` of tensor ``name`` (flattened) inside a stripe, for ``start <= k < stop``."""
    k = np.arange(start, stop, dtype=np.int64)
    if name == "W0":
        return (k % (1 << 24)).astype(np.float32)  # exact in float32
    offset = {"W1": 1 << 28, "W2": 1 << 29}[name]
    return (k + offset).astype(np.int32)


def stripes() -> list[int]:
    """First element of every data stripe of a tensor (the last one ends the tensor)."""
    return [*range(0, N - STRIPE, STRIDE), N - STRIPE]


def _write_weights(path: Path) -> dict[str, tuple[int, int]]:
    """Write every tensor's stripes, leaving holes between them; return name -> (offset, length) in bytes."""
    layout = {}
    with open(path, "wb") as f:
        for i, name in enumerate(TENSORS):
            base = i * N * 4
            layout[name] = (base, N * 4)
            for start in stripes():
                f.seek(base + start * 4)
                f.write(expected(name, start, start + STRIPE).tobytes())
        f.truncate(len(TENSORS) * N * 4)
    return layout


def _build(folder: Path) -> Path:
    layout = _write_weights(folder / "weights.bin")
    initializers = []
    for name, dtype in TENSORS.items():
        offset, length = layout[name]
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=[ROWS, COLS])
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(length))):
            t.external_data.add(key=key, value=value)
        initializers.append(t)
    nodes = [
        helper.make_node("Identity", ["W0"], ["W0_alias"]),  # eliminate-identity
        helper.make_node("Gather", ["W0_alias", "idx"], ["rows0"]),
        helper.make_node("Gather", ["W1", "idx"], ["rows1"]),
        helper.make_node("Gather", ["W1", "idx"], ["rows1_again"]),  # cse
        helper.make_node("Add", ["rows1", "rows1_again"], ["sum1"]),
        # A transpose of a 768 MiB weight nothing else reads: onnxscript's folder would fold it
        # whatever its size, reading it all; fold-constants must leave external data alone.
        helper.make_node("Transpose", ["W2"], ["W2_t"], perm=[1, 0]),
        helper.make_node("Gather", ["W2_t", "idx"], ["cols2"]),
        helper.make_node("Relu", ["rows0"], ["unused"]),  # eliminate-dead
    ]
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [4])],
        [
            helper.make_tensor_value_info("rows0", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("sum1", TensorProto.INT32, None),
            helper.make_tensor_value_info("cols2", TensorProto.INT32, None),
        ],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "big.onnx"
    onnx.save(model, path)  # a few hundred bytes: the weights stay in weights.bin
    return path


def _check_data(model_path: Path) -> int:
    """Compare every stripe of every saved initializer with the formula, and some holes with zero."""
    model = onnx.load(str(model_path), load_external_data=False)
    checked = 0
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        assert t.data_location == TensorProto.EXTERNAL and info["location"] == model_path.name + ".data"
        assert int(info["length"]) == N * 4
        dtype = np.dtype(TENSORS[t.name])
        data = np.memmap(model_path.parent / info["location"], dtype=dtype, mode="r", offset=int(info["offset"]),
                         shape=(N,))
        for start in stripes():
            np.testing.assert_array_equal(data[start:start + STRIPE], expected(t.name, start, start + STRIPE))
            checked += 1
        for hole in (STRIPE, STRIDE + 3 * STRIPE, N - 2 * STRIPE):
            assert not data[hole:hole + 1024].any()
        del data
    return checked


def test_model_above_2gb_round_trips_with_low_memory(tmp_path):
    if shutil.disk_usage(tmp_path).free < 3 * MODEL_BYTES:
        pytest.skip("needs about 5 GB of free disk in the temporary folder")
    folder = tmp_path / "big"
    folder.mkdir()
    try:
        t0 = time.perf_counter()
        src = _build(folder)
        made = time.perf_counter() - t0
        assert MODEL_BYTES > 2**31
        weights = folder / "weights.bin"
        stat_before = weights.stat()
        out = folder / "out" / "big.opt.onnx"
        out.parent.mkdir()  # -o never creates folders
        cmd = [sys.executable, "-c", PEAK_SCRIPT, "optimize", str(src), "-o", str(out), "--passes", "cleanup", "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - t0
        assert proc.returncode == 0, proc.stderr
        peak = int(next(line for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS")).split()[1])
        print(
            f"\nmodel {MODEL_BYTES / 2**30:.2f} GiB (made in {made:.1f}s), optimize took {took:.1f}s, "
            f"peak RSS {peak / 2**20:.0f} MiB = {100 * peak / MODEL_BYTES:.1f}% of the model"
        )
        assert peak < 0.5 * MODEL_BYTES

        report = json.loads(proc.stdout)
        stats = {p["name"]: p["stats"] for p in report["passes"]}
        assert stats["eliminate-identity"] == {"removed_identities": 1}
        assert stats["cse"]["merged_nodes"] == 1
        assert stats["eliminate-dead"]["removed_nodes"] == 1
        assert stats["fold-constants"]["folded_nodes"] == 0  # nothing big was pulled into memory

        saved = onnx.load(str(out), load_external_data=False)
        assert sorted(n.op_type for n in saved.graph.node) == ["Add", "Gather", "Gather", "Gather", "Transpose"]
        assert [o.name for o in saved.graph.output] == ["rows0", "sum1", "cols2"]
        assert (out.parent / "big.opt.onnx.data").stat().st_size == MODEL_BYTES
        assert _check_data(out) == len(stripes()) * len(TENSORS)

        stat_after = weights.stat()  # the input is untouched
        assert (stat_after.st_size, stat_after.st_mtime_ns) == (stat_before.st_size, stat_before.st_mtime_ns)
        assert sorted(os.listdir(out.parent)) == ["big.opt.onnx", "big.opt.onnx.data"]  # no temporary files
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # pytest keeps old temporary folders; 5 GB must not linger
