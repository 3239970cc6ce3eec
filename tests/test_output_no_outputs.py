"""The output check refuses a model with no graph outputs (issue 30, R10).

A pass that deleted every graph output passed the ONNX checker and ONNX Runtime's load, and the model
was written with exit 0 (an input with no outputs is refused on load, exit 3).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import api
from mograph.errors import PassFailedError
from mograph.output_check import InvalidModel, check_model_output
from mograph.pass_infra import Pass, PassResult
from mograph.plugins import BUILTIN_PLUGINS

BLOCK = [m for m in BUILTIN_PLUGINS if m.startswith("mograph.passes")]


@pytest.fixture(autouse=True)
def _no_third_party_plugins(monkeypatch):
    monkeypatch.setenv("MOGRAPH_DISABLE_PLUGIN_AUTOLOAD", "1")


def _model() -> ir.Model:
    """y = Relu(x + w)."""
    w = np.arange(4, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["s"], name="add"), helper.make_node("Relu", ["s"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(w, "w")],
    )
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


class RenamePass(Pass):
    """Renames the Relu (a valid change)."""

    name = "rename"

    def call(self, model: ir.Model) -> PassResult:
        node = next(n for n in model.graph if n.op_type == "Relu")
        if node.name == "renamed":
            return PassResult(False, {})
        node.name = "renamed"
        return PassResult(True, {"renamed": 1})


class DropOutputsPass(Pass):
    """Deletes every graph output (issue 30, R10): the ONNX checker accepts the result; it computes nothing."""

    name = "drop-outputs"

    def call(self, model: ir.Model) -> PassResult:
        if not model.graph.outputs:
            return PassResult(False, {})
        model.graph.outputs.clear()
        return PassResult(True, {"dropped": 1})


def test_output_with_no_graph_outputs_is_refused():
    model = _model()
    with pytest.raises(InvalidModel, match="no outputs"):
        check_model_output(_no_outputs(_model()))
    with pytest.raises(PassFailedError) as err:
        api.run_passes(model, [RenamePass(), DropOutputsPass()], blocked=BLOCK)
    assert err.value.pass_name == "drop-outputs" and "no outputs" in str(err.value)


def _no_outputs(model: ir.Model) -> ir.Model:
    model.graph.outputs.clear()
    return model


def test_a_pass_that_drops_every_output_writes_nothing(tmp_path, monkeypatch, capsys):
    """Through the command line: exit 4 naming the pass, and no output file (it was written with exit 0)."""
    import sys
    import types

    from mograph.cli import main
    from mograph.hookspecs import hookimpl

    plugin = types.ModuleType("mograph_test_drop_outputs")

    @hookimpl
    def mograph_add_passes():  # type: ignore[no-untyped-def]
        return [DropOutputsPass]

    plugin.mograph_add_passes = mograph_add_passes  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    src = tmp_path / "m.onnx"
    onnx.save(ir.serde.serialize_model(_model()), src)
    from mograph import plugins

    monkeypatch.setattr(plugins, "BUILTIN_PLUGINS", (*plugins.BUILTIN_PLUGINS, plugin.__name__))
    plugins.reset()
    try:
        code = main(["optimize", str(src), "--passes", "drop-outputs", "-o", str(tmp_path / "out.onnx"), "-q"])
    finally:
        plugins.reset()
    err = capsys.readouterr().err
    assert code == 4, err
    assert "drop-outputs" in err and "no outputs" in err
    assert not (tmp_path / "out.onnx").exists()
