"""``mograph diff``: per-output numbers, exit 5 past tolerance, exit 3 for a missing model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.cli import main


def _model(w: np.ndarray) -> onnx.ModelProto:
    """y = x @ w, and the argmax of y."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("ArgMax", ["y"], ["top"], axis=-1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("top", TensorProto.INT64, ["batch", 1]),
        ],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def models(tmp_path):
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    paths = {}
    for name, weights in (("a", w), ("same", w.copy()), ("b", w + np.float32(0.01))):
        paths[name] = tmp_path / f"{name}.onnx"
        onnx.save(_model(weights), str(paths[name]))
    paths["w"] = w
    return paths


def _diff(capsys, *args: str) -> tuple[int, dict]:
    code = main(["diff", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_identical_models_exit_0(models, capsys):
    code, data = _diff(capsys, models["a"], models["same"], "--shape", "x:3x8", "--seed", "4")
    assert code == 0
    assert data["passed"] is True and data["seed"] == 4
    assert data["feeds"]["x"]["shape"] == [3, 8]
    assert set(data["outputs"]) == {"y", "top"}
    assert data["outputs"]["y"]["max_abs"] == 0.0


def test_different_models_exit_5_with_the_table(models, capsys):
    code = main(["diff", str(models["a"]), str(models["b"]), "--shape", "x:2x8"])
    captured = capsys.readouterr()
    assert code == 5
    assert "FAIL" in captured.out and "max abs" in captured.out and "y" in captured.out
    assert "mograph: error: outputs differ" in captured.err
    code, data = _diff(capsys, models["a"], models["b"], "--shape", "x:2x8")
    assert code == 5 and data["passed"] is False and data["exit_code"] == 5
    assert data["outputs"]["y"]["passed"] is False and "output 'y'" in data["error"]


def test_tolerance_overrides_and_family(models, capsys):
    code, data = _diff(capsys, models["a"], models["b"], "--atol", "0.1")
    assert code == 0, data["summary"]
    assert data["outputs"]["y"]["atol"] == 0.1
    code, data = _diff(capsys, models["a"], models["b"], "--family", "quant")
    assert code == 0 and data["family"] == ["quant"] and data["outputs"]["y"]["atol"] is None


def test_user_feeds(models, tmp_path, capsys):
    x = np.arange(16, dtype=np.float32).reshape(2, 8) / 16
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, x=x)
    code, data = _diff(capsys, models["a"], models["b"], "--feeds", feeds)
    assert code == 5
    assert data["feeds"]["x"]["source"] == "file"
    expected = float(np.max(np.abs(x @ (models["w"] + np.float32(0.01)) - x @ models["w"])))
    assert data["outputs"]["y"]["max_abs"] == pytest.approx(expected, rel=1e-4)


def test_missing_model_exit_3(models, tmp_path, capsys):
    assert main(["diff", str(models["a"]), str(tmp_path / "nope.onnx")]) == 3
    assert "no such file" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "nope.onnx"), str(models["a"])]) == 3


def test_bad_shape_is_a_usage_error(models, capsys):
    assert main(["diff", str(models["a"]), str(models["b"]), "--shape", "x:2x9"]) == 2
    assert "fixed at 8" in capsys.readouterr().err


def test_diff_help():
    with pytest.raises(SystemExit) as info:
        main(["diff", "--help"])
    assert info.value.code == 0
