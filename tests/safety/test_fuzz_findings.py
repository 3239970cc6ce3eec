"""What the fuzz test (``test_fuzz.py``) found, each pinned by the smallest model that shows it.

Before the fixes these were tracebacks (exit 1), pass failures for what is a bad model (exit 4), or an
``optimize`` that exited 0 writing a model mograph itself could not load.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.cli import main


def _model(nodes, outputs=("y",), inputs=("x",), inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=list(inits),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _if(then_nodes, then_out: str) -> onnx.ModelProto:
    then = helper.make_graph(then_nodes, "then", [], [helper.make_tensor_value_info(then_out, TensorProto.FLOAT, None)])
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)]
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
    cond = numpy_helper.from_array(np.array(True), "c")
    return _model([node], inits=[cond])


def _constant_with_value(attr_value) -> onnx.ModelProto:
    const = helper.make_node("Constant", [], ["k"])
    const.attribute.append(helper.make_attribute("value", attr_value))
    return _model([const, helper.make_node("Add", ["x", "k"], ["y"])])


def _no_default_opset() -> onnx.ModelProto:
    model = _model([helper.make_node("Relu", ["x"], ["y"])])
    del model.opset_import[:]
    model.opset_import.add(domain="com.other", version=1)
    return model


def _tensor_dtype(dtype: int) -> onnx.TensorProto:
    t = numpy_helper.from_array(np.ones((2, 3), np.float32), "v")
    t.data_type = dtype
    return t


def _bad_dtype(dtype: int) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    w.data_type = dtype
    return _model([helper.make_node("Add", ["x", "w"], ["y"])], inits=[w])


CASES = {
    # optimize exited 0, then refused to load what it wrote (an empty graph)
    "no-outputs": (_model([helper.make_node("Relu", ["x"], ["y"])], outputs=()), "no outputs"),
    # exit 4 from topo-sort
    "cycle-inside-a-branch": (
        _if([helper.make_node("Add", ["x", "t"], ["t"])], "t"),
        "cycle",
    ),
    "branch-reads-its-own-if": (_if([helper.make_node("Add", ["x", "y"], ["t"])], "t"), "cycle"),
    # exit 4 from fold-constants, exit 1 from inspect
    "constant-value-is-an-int": (_constant_with_value(1 << 40), "must be TENSOR, not INT"),
    "constant-value-is-floats": (_constant_with_value([1.0, 2.0]), "must be TENSOR, not FLOATS"),
    # exit 4 from fuse-layernorm
    "axes-is-a-float": (
        _model([helper.make_node("ReduceMean", ["x"], ["y"], axes=0.5)], opset=17),
        "must be INTS, not FLOAT",
    ),
    "keepdims-is-a-string": (
        _model([helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims="yes")]),
        "must be INT, not STRING",
    ),
    "unknown-attribute": (_model([helper.make_node("Relu", ["x"], ["y"], alpha=0.1)]), "does not define"),
    "missing-required-attribute": (_model([helper.make_node("Cast", ["x"], ["y"])]), "required attribute 'to'"),
    "missing-required-input": (
        _model([helper.make_node("Unsqueeze", ["", "ax"], ["y"])], inits=[numpy_helper.from_array(np.array([0]), "ax")]),
        "lacks its required input 0 ('data')",
    ),
    "too-many-inputs": (_model([helper.make_node("Relu", ["x", "x"], ["y"])]), "takes at most 1"),
    "cast-to-999": (_model([helper.make_node("Cast", ["x"], ["y"], to=999)]), "is not an ONNX data type"),
    "no-default-opset": (_no_default_opset(), "imports no opset for the default domain"),
    # exit 1 (ValueError / TypeError from onnx-ir)
    "dtype-999": (_bad_dtype(999), "999 is not a valid DataType"),
    "constant-dtype-999": (_constant_with_value(_tensor_dtype(999)), "unknown data type"),
    "dtype-undefined": (_bad_dtype(0), "no data type"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_models_found_by_fuzzing_exit_3_in_one_line(tmp_path, capsys, case):
    proto, message = CASES[case]
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    code = main(["optimize", str(path), "-o", str(tmp_path / "out.onnx"), "--passes", "cleanup,fuse"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.parametrize("case", ["constant-value-is-an-int", "constant-value-is-floats", "no-outputs", "cycle-inside-a-branch"])
def test_inspect_reports_structural_problems_as_warnings(tmp_path, capsys, case):
    proto, message = CASES[case]
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    code = main(["inspect", "--json", str(path)])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert any(message in w for w in data["warnings"]), data["warnings"]


@pytest.mark.parametrize("command", ["inspect", "optimize"])
def test_devices_and_pipes_are_not_read(tmp_path, capsys, command):
    import os

    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)  # reading it would block forever
    for path in ("/dev/zero", str(fifo)):  # /dev/zero would be read until memory runs out
        code = main([command, path, *(["-o", str(tmp_path / "o.onnx")] if command == "optimize" else [])])
        assert code == 3
        assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [TensorProto.BOOL, TensorProto.INT64, TensorProto.FLOAT])
def test_verify_feeds_scalar_inputs(tmp_path, capsys, dtype):
    # Found by fuzzing with --verify: numpy gives a scalar, not a 0-d array, for a random feed of shape
    # (), and ONNX Runtime refused it ("Unable to handle object of type <class 'numpy.bool'>").
    pytest.importorskip("onnxruntime")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("s", dtype, [])],
        [helper.make_tensor_value_info("y", dtype, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    code = main(["optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "--verify"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "verify: passed" in captured.out
