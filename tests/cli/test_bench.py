"""``mograph bench``: latency percentiles, throughput, memory; tiny runs only."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.cli import main
from mograph.plugins import BUILTIN_PLUGINS


@pytest.fixture(autouse=True)
def _only_core_plugins(monkeypatch):
    # bench looks its backend up in the registry; the pass plugins are not what is tested here.
    monkeypatch.setenv("MOGRAPH_BLOCK_PLUGINS", ",".join(m for m in BUILTIN_PLUGINS if m.startswith("mograph.passes")))
    monkeypatch.setenv("MOGRAPH_DISABLE_PLUGIN_AUTOLOAD", "1")


def _model(path, batch="batch") -> None:
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [batch, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _bench(capsys, *args: str) -> tuple[int, dict]:
    code = main(["bench", *map(str, args), "--json", "--warmup", "1", "--iterations", "5", "--threads", "1"])
    return code, json.loads(capsys.readouterr().out)


def test_bench_json(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    _model(path)
    code, data = _bench(capsys, path)
    assert code == 0
    lat = data["latency_ms"]
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert data["iterations"] == 5 and data["warmup"] == 1 and data["threads"] == 1
    assert data["ort_optimizations"] is True
    assert data["providers"] == ["CPUExecutionProvider"]
    assert data["batch"] == 1
    assert data["throughput"]["inferences_per_s"] > 0
    assert data["throughput"]["samples_per_s"] == pytest.approx(data["throughput"]["inferences_per_s"])
    assert data["memory"]["peak_increase_bytes"] >= 0 and "RSS" in data["memory"]["measures"]
    assert data["feeds"]["x"]["shape"] == [1, 8]


def test_bench_batch_and_no_optimizations(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    _model(path)
    code, data = _bench(capsys, path, "--batch", "4", "--no-ort-optimizations")
    assert code == 0
    assert data["batch"] == 4 and data["feeds"]["x"]["shape"] == [4, 8]
    assert data["ort_optimizations"] is False
    assert data["throughput"]["samples_per_s"] == pytest.approx(4 * data["throughput"]["inferences_per_s"])


def test_bench_static_batch_has_no_samples_rate(tmp_path, capsys):
    path = tmp_path / "static.onnx"
    _model(path, batch=2)
    code, data = _bench(capsys, path)
    assert code == 0 and data["batch"] is None and data["throughput"]["samples_per_s"] is None
    assert main(["bench", str(path), "--batch", "3"]) == 2


def test_bench_text_and_errors(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    _model(path)
    assert main(["bench", str(path), "--warmup", "0", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "p50" in out and "p99" in out and "inferences/s" in out and "memory" in out
    assert main(["bench", str(tmp_path / "missing.onnx"), "--iterations", "1"]) == 3
    assert main(["bench", str(path), "--backend", "nope"]) == 2
    assert main(["bench", str(path), "--iterations", "0"]) == 2


def test_bench_help():
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0


def test_bench_session_config_reaches_onnx_runtime(tmp_path, capsys):
    """--session-config KEY=VALUE goes into the session: recorded in the JSON, and a key with an effect has it
    (session.load_model_format=ORT makes ONNX Runtime read the .onnx file as an ORT-format file: refused)."""
    from mograph.backends.ort import make_session

    path = tmp_path / "m.onnx"
    _model(path)
    code, data = _bench(capsys, path, "--session-config", "session.intra_op.allow_spinning=0")
    assert code == 0 and data["session_config"] == {"session.intra_op.allow_spinning": "0"}
    code, data = _bench(capsys, path)
    assert code == 0 and data["session_config"] == {}
    sess = make_session(str(path), config={"session.intra_op.allow_spinning": "0"})
    assert sess.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    code = main(["bench", str(path), "--iterations", "1", "--session-config", "session.load_model_format=ORT"])
    assert code != 0 and "ORT" in capsys.readouterr().err
    for bad in ("novalue", "=1", "key="):
        assert main(["bench", str(path), "--iterations", "1", "--session-config", bad]) == 2
        assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["bench", str(path), "--iterations", "1", "--session-config", "a=1", "--session-config", "a=2"]) == 2
    assert main(["bench", str(path), "--iterations", "1", "--backend", "tensorrt", "--session-config", "a=1"]) == 2
    assert "--backend ort" in capsys.readouterr().err
