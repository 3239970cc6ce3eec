"""``mograph inspect``: structure, parameters and sizes, without reading external data."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.cli import main


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.zeros((16, 8), np.float32), "w")
    b = numpy_helper.from_array(np.zeros((8,), np.float16), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones((2, 3), np.int64))),
        helper.make_node("Constant", [], ["k"], value_floats=[1.0, 2.0, 3.0, 4.0]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Relu", ["r"], ["r2"]),
        helper.make_node("FusedThing", ["r2", "b"], ["y"], domain="com.example"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [w, b],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
        producer_name="tests",
        producer_version="1.0",
    )


def _inspect(capsys, *args: str) -> tuple[int, dict]:
    code = main(["inspect", *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_inspect_json(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(_model(), str(path))
    code, data = _inspect(capsys, str(path))
    assert code == 0
    assert data["opsets"] == {"ai.onnx": 17, "com.example": 1}
    assert data["producer"]["name"] == "tests" and data["producer"]["version"] == "1.0"
    assert data["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}]
    assert data["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["batch", 8]}]
    assert data["ops"] == {"Constant": 2, "Relu": 2, "MatMul": 1, "com.example::FusedThing": 1}
    assert data["nodes"]["main_graph"] == 6
    # 16*8 float + 8 float16 initializer elements, 6 int64 + 4 float Constant elements.
    assert data["parameters"]["total"] == 16 * 8 + 8 + 6 + 4
    assert data["parameters"]["by_dtype"] == {"float32": 128 + 4, "float16": 8, "int64": 6}
    assert data["sizes"]["file"] == path.stat().st_size
    assert data["sizes"]["initializer_bytes"] == 16 * 8 * 4 + 8 * 2
    assert data["sizes"]["external_data"] == 0 and data["warnings"] == []


def test_inspect_external_data_without_reading_it(tmp_path, capsys, monkeypatch):
    path = tmp_path / "ext.onnx"
    onnx.save(_model(), str(path), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)

    def refuse(self):  # any read of external data fails the test
        raise AssertionError(f"external data of {self.name} was read")

    monkeypatch.setattr(ir.ExternalTensor, "_load", refuse)
    monkeypatch.setattr(ir.ExternalTensor, "numpy", refuse)
    monkeypatch.setattr(ir.ExternalTensor, "tobytes", refuse)
    code, data = _inspect(capsys, str(path))
    assert code == 0
    data_file = tmp_path / "ext.onnx.data"
    sizes = data["sizes"]
    assert sizes["external_data"] == data_file.stat().st_size
    assert sizes["external_files"][0]["location"] == "ext.onnx.data"
    assert sizes["external_files"][0]["tensors"] == 2
    assert sizes["initializer_bytes"] == 16 * 8 * 4 + 8 * 2
    assert data["parameters"]["total"] == 146


def test_inspect_text_and_errors(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(_model(), str(path))
    assert main(["inspect", str(path), "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "com.example 1" in text and "parameters: 146" in text and "more op types" in text
    assert main(["inspect", str(tmp_path / "missing.onnx")]) == 3
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "junk.onnx").write_bytes(b"not a model at all")
    assert main(["inspect", str(tmp_path / "junk.onnx")]) == 3
    assert main(["inspect"]) == 2


def test_inspect_help():
    with pytest.raises(SystemExit) as info:
        main(["inspect", "--help"])
    assert info.value.code == 0
