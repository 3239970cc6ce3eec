"""``tools/ort_cpu.py``: the CPU session the tools/bench_* scripts share honours its optimization level."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tools.ort_cpu import LEVELS, cpu_session

pytest.importorskip("onnxruntime")


def _model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Identity", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_cpu_session_levels(level, tmp_path):
    import onnxruntime as ort

    sess = cpu_session(_model(), threads=1, level=level)
    assert sess.get_providers() == ["CPUExecutionProvider"]
    assert sess.get_session_options().graph_optimization_level == getattr(ort.GraphOptimizationLevel, LEVELS[level])
    out = sess.run(None, {"x": np.array([-1.0, 2.0], dtype=np.float32)})[0]
    np.testing.assert_array_equal(out, [0.0, 2.0])
    path = tmp_path / "m.onnx"
    onnx.save(_model(), str(path))
    assert cpu_session(str(path), threads=1, level=level).get_inputs()[0].name == "x"


def test_unknown_level_is_refused():
    with pytest.raises(KeyError):
        cpu_session(_model(), threads=1, level="max")
