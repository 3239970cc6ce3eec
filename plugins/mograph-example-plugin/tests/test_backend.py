"""The ``example-ref`` backend follows mograph's backend protocol and computes the right numbers."""

from __future__ import annotations

import mograph_example_plugin
import numpy as np
import onnx
import pytest
from mograph_example_plugin import BACKEND, ReferenceBackend
from mograph_example_plugin.swish import swish
from onnx import TensorProto, helper, numpy_helper

import mograph
from mograph.backends import BackendProtocol, backend_problems, backend_target, is_available
from mograph.plugins import Registry, get_plugin_manager


def _registry() -> Registry:
    pm = get_plugin_manager(autoload=False)
    if pm.get_plugin("example") is None:
        pm.register(mograph_example_plugin, name="example")
    return Registry.build(pm)


def _swish_model(fused: bool) -> onnx.ModelProto:
    """x -> SiLU -> MatMul(w) (-> y); the SiLU fused or not."""
    w = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    if fused:
        import onnx_ir as ir
        from mograph_example_plugin.swish import swish_function

        act = [helper.make_node("BetaSwish", ["x"], ["a"], domain="example", beta=1.0)]
        fn = ir.to_proto(swish_function(17))
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("example", 1)]
    else:
        act = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["a"])]
        fn = None
        opsets = [helper.make_opsetid("", 17)]
    graph = helper.make_graph(
        [*act, helper.make_node("MatMul", ["a", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=opsets, ir_version=8, functions=[fn] if fn is not None else None)


def _expected(x: np.ndarray) -> np.ndarray:
    w = np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)
    return swish(x) @ w


def test_follows_the_protocol_and_is_registered_under_the_plugin():
    assert backend_problems(BACKEND) == [] and isinstance(BACKEND, BackendProtocol)
    assert is_available(BACKEND) and backend_target(BACKEND) == "onnx" and callable(BACKEND.build)
    reg = _registry()
    assert reg.backends["example-ref"] is BACKEND and reg.backend_source["example-ref"] == "example"
    assert reg.custom_ops[("example", "BetaSwish")] is mograph_example_plugin.SWISH


@pytest.mark.parametrize("fused", [False, True], ids=["standard-ops", "example-op"])
def test_runner_computes_the_model(fused):
    runner = ReferenceBackend(_registry()).make_runner(_swish_model(fused), optimizations=False, threads=1)
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    out = runner({"x": x})
    assert list(out) == ["y"]
    np.testing.assert_allclose(out["y"], _expected(x), rtol=1e-5, atol=1e-5)


def test_a_custom_op_left_after_lowering_runs_as_its_numpy_reference():
    runner = ReferenceBackend(_registry()).make_runner(_swish_model(True))
    if runner.lowering["lowered"]:  # the lower step turned BetaSwish into standard ops first
        assert "example" not in {n.domain for n in runner.model.graph.node}
    else:
        assert runner.kernels == ["BetaSwish"]
        assert not runner.model.functions  # the body is not what runs


def test_build_writes_the_model_it_would_run(tmp_path):
    out = tmp_path / "m.ref.onnx"
    report = ReferenceBackend(_registry()).build(_swish_model(False), out)
    assert report["artifact_bytes"] == out.stat().st_size and report["nodes"] == 3
    onnx.checker.check_model(onnx.load(str(out)))
    with pytest.raises(mograph.UsageError, match="takes no build options"):
        BACKEND.build(_swish_model(False), tmp_path / "x.onnx", fp16=True)
    assert not (tmp_path / "x.onnx").exists()


def test_external_data_is_read_from_the_model_folder_not_the_cwd(tmp_path, monkeypatch):
    """A Constant and an initializer whose values sit in ``w.bin`` beside the model; another ``w.bin`` in
    the current directory must not be what runs (onnx.reference alone would resolve it there)."""
    folder, cwd = tmp_path / "model", tmp_path / "cwd"
    folder.mkdir()
    cwd.mkdir()
    real = np.arange(1, 9, dtype=np.float32)
    (folder / "w.bin").write_bytes(real.tobytes())
    (cwd / "w.bin").write_bytes(np.full(8, 99, np.float32).tobytes())

    def external(name: str) -> onnx.TensorProto:
        tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[8])
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value="w.bin")
        return tensor

    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=external("c")), helper.make_node("Add", ["c", "w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
        initializer=[external("w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "m.onnx")
    monkeypatch.chdir(cwd)
    run = ReferenceBackend(_registry()).make_runner(str(folder / "m.onnx"))
    np.testing.assert_array_equal(run({})["y"], real + real)
