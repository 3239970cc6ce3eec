"""Calibration runs models whose weights live in external data, from any working directory.

The observed copy of the model reaches ONNX Runtime as bytes; ONNX Runtime resolves the external data
of a model given as bytes against the working directory, so without being told the model's folder it
failed ("External data path for model loaded from bytes escapes working directory") everywhere but
in that folder.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from models.builders import make_model
from mograph.cli import main


def _mlp() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    weights = {
        "w1": rng.standard_normal((16, 32)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal(32).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((32, 8)).astype(np.float32) * 0.3,
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, [4, 16])], [("y", np.float32, [4, 8])], weights), weights


@pytest.mark.parametrize("passes", ["int8", "fp16", "int8-sensitivity"])
def test_calibration_of_an_external_data_model_from_another_cwd(tmp_path, monkeypatch, capsys, passes):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    proto, weights = _mlp()
    onnx.save(proto, model_dir / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "out" / "m.q.onnx"
    out.parent.mkdir()  # -o into a missing folder is refused (issue 19, item 8)
    extra = ["--accuracy-budget", "cosine>=0.999", "--sensitivity-samples", "2"] if passes == "int8-sensitivity" else []
    pipeline = passes.split("-")[0]
    argv = ["optimize", str(model_dir / "m.onnx"), "--passes", pipeline, "--calibration-random", "8", "-o", str(out)]
    code = main([*argv, "-q", *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    saved = onnx.load(str(out))
    ops = [n.op_type for n in saved.graph.node]
    if pipeline == "int8":
        assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    else:
        inits = {t.name: numpy_helper.to_array(t) for t in saved.graph.initializer}
        assert any(a.dtype == np.float16 for a in inits.values())
    # The result runs, and stays close to the float model.
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = np.random.default_rng(1).uniform(-1, 1, (4, 16)).astype(np.float32)
    got = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = np.maximum(x @ weights["w1"] + weights["b1"], 0) @ weights["w2"]
    cosine = float(np.dot(got.ravel(), want.ravel()) / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.99
