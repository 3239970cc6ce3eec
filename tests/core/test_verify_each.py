"""``verify="each"``: the numeric check after every pass names the first pass whose outputs drift."""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import api, ir_io
from mograph.errors import VerificationError
from mograph.hookspecs import hookimpl
from mograph.pass_infra import Pass, PassResult
from mograph.plugins import BUILTIN_PLUGINS, Registry, get_plugin_manager

# The built-in pass families are not what these tests are about; not loading them keeps the tests
# independent of them (only the core and the backends plugin are registered).
BLOCK = [m for m in BUILTIN_PLUGINS if m.startswith("mograph.passes")]


@pytest.fixture(autouse=True)
def _no_third_party_plugins(monkeypatch):
    monkeypatch.setenv("MOGRAPH_DISABLE_PLUGIN_AUTOLOAD", "1")


def identity_model() -> onnx.ModelProto:
    """y = Identity(x) @ w."""
    w = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["xi"]), helper.make_node("MatMul", ["xi", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class DropIdentityPass(Pass):
    """Test pass: remove Identity nodes (correct)."""

    name = "test-drop-identity"
    family = "cleanup"

    def call(self, model: ir.Model) -> PassResult:
        count = 0
        for node in list(model.graph):
            if node.op_type == "Identity" and not node.outputs[0].is_graph_output():
                node.outputs[0].replace_all_uses_with(node.inputs[0])
                model.graph.remove(node, safe=True)
                count += 1
        return PassResult(modified=count > 0, stats={"removed": count})


class ScaleWeightsPass(Pass):
    """Test pass: multiply every float initializer by 1.5 (deliberately wrong)."""

    name = "test-scale-weights"
    family = "fusion"

    def call(self, model: ir.Model) -> PassResult:
        for value in model.graph.initializers.values():
            value.const_value = ir.tensor(value.const_value.numpy() * np.float32(1.5))
        return PassResult(modified=True, stats={"scaled": len(model.graph.initializers)})


class NoOpPass(Pass):
    """Test pass: changes nothing (and says so)."""

    name = "test-no-op"
    family = "fusion"

    def call(self, model: ir.Model) -> PassResult:
        return PassResult(modified=False)


class _TestPlugin:
    @hookimpl
    def mograph_add_passes(self):
        return [DropIdentityPass, ScaleWeightsPass, NoOpPass]


def _model() -> ir.Model:
    return ir_io.load_model(identity_model())


def test_each_names_the_first_drifting_pass():
    with pytest.raises(VerificationError) as info:
        api.run_passes(
            _model(),
            [DropIdentityPass(), NoOpPass(), ScaleWeightsPass(), DropIdentityPass()],
            verify="each",
            verify_options={"shapes": {"x": (4, 6)}, "seed": 1},
            blocked=BLOCK,
        )
    message = str(info.value)
    assert "'test-scale-weights'" in message
    assert "test-drop-identity" not in message and "test-no-op" not in message
    assert "output 'y'" in message and "seed 1" in message
    assert info.value.exit_code == 5
    report = info.value.report
    assert report["passed"] is False and report["family"] == ["fusion"]
    assert report["outputs"]["y"]["max_abs"] > 0


def test_each_passes_a_correct_pipeline_and_records_checks():
    model = _model()
    report = api.run_passes(model, [DropIdentityPass(), NoOpPass()], verify="each", blocked=BLOCK)
    assert [op.op_type for op in model.graph] == ["MatMul"]
    assert report.verification["passed"] is True
    assert report.passes[0].stats == {"removed": 1}


def test_wrong_pass_registered_by_a_plugin_is_named():
    """The same, with the passes coming through a plugin's ``mograph_add_passes``."""
    pm = get_plugin_manager(blocked=BLOCK, autoload=False)
    pm.register(_TestPlugin(), name="test-plugin")
    reg = Registry.build(pm)
    assert reg.pass_source["test-scale-weights"] == "test-plugin"
    passes = reg.instantiate(["test-drop-identity", "test-scale-weights"])
    with pytest.raises(VerificationError, match="after pass 'test-scale-weights'") as info:
        api.run_passes(_model(), passes, verify="each", blocked=BLOCK)
    assert "test-drop-identity" not in str(info.value)


def test_end_mode_fails_without_naming_a_pass():
    with pytest.raises(VerificationError, match="differ from the original") as info:
        api.run_passes(_model(), [DropIdentityPass(), ScaleWeightsPass()], verify="end", blocked=BLOCK)
    assert info.value.report["family"] == ["cleanup", "fusion"]


def test_each_reports_the_check_time_apart_from_the_pass_time(monkeypatch):
    """The per-pass check's time is ``check_seconds``; the pass's ``seconds`` do not include it."""
    from mograph.validate import Verifier

    real_check = Verifier.check

    def slow_check(self, *args, **kwargs):
        time.sleep(0.5)
        return real_check(self, *args, **kwargs)

    monkeypatch.setattr(Verifier, "check", slow_check)
    report = api.run_passes(
        _model(), [DropIdentityPass(), NoOpPass()], verify="each", blocked=BLOCK, check_output=False
    )
    changed, unchanged = report.passes
    assert changed.check_seconds is not None and changed.check_seconds >= 0.5
    assert changed.seconds < 0.5
    assert unchanged.check_seconds is None  # nothing changed, nothing checked
    data = report.to_dict()["passes"]
    assert data[0]["check_seconds"] >= 0.5 and data[0]["seconds"] < 0.5
    assert "check_seconds" not in data[1]
