"""MOGRAPH_ORT_THREADS caps the ONNX Runtime sessions mograph builds for itself (several runs on one machine)."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

ort = pytest.importorskip("onnxruntime")

from mograph import _spill  # noqa: E402


def _model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("env, asked, expected", [("3", 0, 3), ("", 0, 0), ("x", 0, 0), ("3", 2, 2)])
def test_env_sets_intra_op_threads_unless_asked(monkeypatch: pytest.MonkeyPatch, env: str, asked: int,
                                               expected: int) -> None:
    monkeypatch.setenv("MOGRAPH_ORT_THREADS", env)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = asked
    sess = _spill.payload(_model().SerializeToString()).session(opts, ["CPUExecutionProvider"])
    assert opts.intra_op_num_threads == expected
    assert sess.get_outputs()[0].name == "y"
