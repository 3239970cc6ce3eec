"""Models too big for one protobuf go through every pass and command (issue 25, item 3).

A real model above 2 GB takes minutes per pass on a CI machine, so CI runs the same code paths on a small
one: ``MOGRAPH_PROTO_LIMIT`` lowers the size from which :mod:`mograph._spill` hands a model to ONNX
Runtime and shape inference as a file (64 KiB here; the model's weights are 640 KiB).  A guard makes the
test fail if anything serializes a ``ModelProto`` larger than that limit (``SerializeToString`` and
``onnx_ir.serde.serialize_model`` are wrapped): with the real limit that is the
``EncodeError: Failed to serialize proto`` of a 4 GB model.  A spy counts the spills, so a test also fails
if the large-model path was never taken.

The model (:func:`models.large.write_decoder`) is a decode step: embedding, two layers of attention over a
past/present KV cache and a ReLU FFN, an LM head; given once from its path (weights in external data:
memory-mapped) and once in memory (a ``ModelProto`` with its weights inside: everything is "too big" from
the start).  The real >2 GB run is ``test_real_model_above_2gb`` (opt-in: ``MOGRAPH_BIG_MODEL_TEST=1``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import mograph
from mograph import _spill
from mograph.cli import main as cli

pytest.importorskip("onnxruntime")

from models.large import decoder_bytes, decoder_feeds, write_decoder  # noqa: E402

SIZES = dict(hidden=64, ffn=256, vocab=512, layers=2)
HEADS = 4
LIMIT = 64 * 1024
#: (pass, extra options, what the output must hold)
PASSES = {
    "fp16": {},
    "int8": {},
    "qdq-fp8": {},
    "int4": {},
    "kv-cache-fp8": {},
    "prune": {"ratio": 0.5},
}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("large")
    path = write_decoder(folder, heads=HEADS, **SIZES)
    feeds = folder / "feeds.npz"
    np.savez(feeds, **decoder_feeds(heads=HEADS, **SIZES))
    return path, feeds


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Lower the protobuf limit; fail on any protobuf serialized above it; count spills."""
    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, str(LIMIT))
    seen = {"spills": 0, "largest": 0}
    to_string = onnx.ModelProto.SerializeToString
    serialize_model = ir.serde.serialize_model
    spill = _spill.spill

    def check(size: int, what: str) -> None:
        seen["largest"] = max(seen["largest"], size)
        if size > LIMIT:
            raise AssertionError(f"{what} of {size} bytes, above the lowered protobuf limit {LIMIT}")

    def guarded_to_string(self: onnx.ModelProto, *args: object, **kwargs: object) -> bytes:
        check(self.ByteSize(), "SerializeToString")
        return to_string(self, *args, **kwargs)

    def guarded_serialize(model: object, *args: object, **kwargs: object) -> onnx.ModelProto:
        proto = serialize_model(model, *args, **kwargs)
        check(proto.ByteSize(), "onnx_ir.serde.serialize_model")
        return proto

    def counted_spill(model: ir.Model) -> _spill.Spilled:
        seen["spills"] += 1
        return spill(model)

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", guarded_to_string)
    monkeypatch.setattr(ir.serde, "serialize_model", guarded_serialize)
    monkeypatch.setattr(_spill, "spill", counted_spill)
    return seen


def _in_memory(path: Path) -> onnx.ModelProto:
    proto = onnx.load(str(path))  # the weights read into the proto: 640 KiB of in-memory tensors
    assert proto.ByteSize() > 8 * LIMIT
    return proto


def test_the_guard_catches_a_plain_serialization(decoder, guarded):
    """The guard itself: serializing the in-memory model whole is refused (what a real 4 GB model hits)."""
    path, _ = decoder
    proto = _in_memory(path)
    with pytest.raises(AssertionError, match="above the lowered protobuf limit"):
        proto.SerializeToString()


@pytest.mark.parametrize("name", list(PASSES))
def test_every_pass_on_an_in_memory_model_above_the_limit(decoder, guarded, name):
    path, feeds = decoder
    proto = _in_memory(path)
    model = ir.serde.deserialize_model(proto)
    options = {"calibration_data": str(feeds), **PASSES[name]}
    out, report = mograph.optimize(model, [name], options=options, verify=True,
                                   verify_options={"feeds": str(feeds)})
    assert guarded["spills"] > 0, "the model never took the large-model path"
    assert guarded["largest"] <= LIMIT
    passes = {p.name: p for p in report.passes}
    main = next(p for p in report.passes if p.name not in ("eliminate-dead", "lower"))
    assert main.modified, (name, main.stats)
    assert report.verification is not None and report.verification["passed"], report.verification
    ops = {n.op_type for n in out.graph}
    if name == "fp16":
        assert main.stats["converted"] > 0 and main.stats["initializers_fp16"] > 0
        assert "Cast" in ops
    elif name in ("int8", "qdq-fp8", "kv-cache-fp8"):
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    elif name == "int4":
        assert main.stats["quantized"] > 0
    elif name == "prune":
        assert main.stats["ffn.pruned_groups"] > 0 and main.stats["params_after"] < main.stats["params_before"]
    del passes


def test_commands_on_a_model_above_the_limit(decoder, guarded, tmp_path, capsys):
    """optimize --verify (passes making in-memory weights past the limit), bench, validate, sweep."""
    path, feeds = decoder
    out = tmp_path / "fp16.onnx"
    assert cli(["optimize", str(path), "-o", str(out), "--passes", "fp16,int8", "--calibration-data", str(feeds),
                "--verify", "--feeds", str(feeds), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verification"]["passed"], report["verification"]
    assert guarded["spills"] > 0
    assert cli(["bench", str(out), "--feeds", str(feeds), "--iterations", "3", "--warmup", "1", "--json"]) == 0
    bench = json.loads(capsys.readouterr().out)
    assert bench
    assert cli(["validate", str(out), "--backend", "ort", "--feeds", str(feeds), "--json"]) == 0
    validated = json.loads(capsys.readouterr().out)
    assert validated
    config = tmp_path / "sweep.yaml"
    config.write_text("configurations:\n  - name: fp16\n    passes: [fp16]\n  - name: int8\n    passes: [int8]\n"
                      "eval_samples: 2\nwarmup: 1\niterations: 2\n")
    ledger = tmp_path / "runs.db"
    assert cli(["sweep", str(path), "--config", str(config), "--ledger", str(ledger), "--calibration-data",
                str(feeds), "--eval-data", str(feeds), "--json"]) == 0
    swept = json.loads(capsys.readouterr().out)
    assert guarded["largest"] <= LIMIT
    assert swept


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MOGRAPH_BIG_MODEL_TEST"), reason="set MOGRAPH_BIG_MODEL_TEST=1: writes "
                    "a 2.3 GB model and needs ~5 GB of memory and several minutes per pass")
def test_real_model_above_2gb(tmp_path):
    """The real thing: a 2.28 GB float32 decoder (above 2**31 bytes) through every pass, peak memory measured.

    Not run in CI, and as of this commit it FAILS its own bar (measured one pass per process, 2-core
    machine): fp16 peaks at 3.6x the weights, int8 at 3.8x (1063 s), int4 passed 4.7x inside its GPTQ
    loop and did not finish in 7.5 minutes; qdq-fp8 (cosine 0.9897 < 0.99) and prune at ratio 0.5
    (cosine 0.49) run but fail --verify on random weights (exit 5).  kv-cache-fp8 (1.1x) passes.
    """
    sizes = dict(hidden=2048, ffn=8192, vocab=65536, layers=6)
    weights = decoder_bytes(**sizes)
    assert weights > 2**31
    path = write_decoder(tmp_path, heads=16, **sizes)
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, **decoder_feeds(heads=16, hidden=2048, vocab=65536, layers=6))
    script = (
        "import sys\nfrom mograph.cli import main\ncode = main(sys.argv[1:])\n"
        "peak = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "sys.stderr.write('PEAK_RSS %d\\n' % peak)\nsys.exit(code)\n"
    )
    for name in PASSES:
        out = tmp_path / f"{name}.onnx"
        cmd = [sys.executable, "-c", script, "optimize", str(path), "-o", str(out), "--passes", name,
               "--calibration-data", str(feeds), "--verify", "--feeds", str(feeds)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        took = time.perf_counter() - t0
        assert proc.returncode == 0, proc.stderr[-2000:]
        peak = int(next(line for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS")).split()[1])
        print(f"\n{name}: {took:.0f}s, peak RSS {peak / 2**30:.2f} GiB = {peak / weights:.2f}x the weights")
        assert peak <= 2 * weights, name
        out.unlink()
        for data in tmp_path.glob(f"{name}.onnx*.data"):
            data.unlink()
