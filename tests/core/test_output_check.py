"""The output check after the last pass: an invalid model is a pass error naming the first bad pass and the node."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import api, ir_io
from mograph.errors import PassFailedError
from mograph.output_check import InvalidModel, check_model_output
from mograph.pass_infra import Pass, PassResult
from mograph.plugins import BUILTIN_PLUGINS

BLOCK = [m for m in BUILTIN_PLUGINS if m.startswith("mograph.passes")]

pytest.importorskip("onnxruntime")


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


class HalfWeightPass(Pass):
    """Stores the Add's weight as float16 without touching the Add: ONNX Runtime refuses the types."""

    name = "half-weight"

    def call(self, model: ir.Model) -> PassResult:
        w = model.graph.initializers["w"]
        if w.dtype == ir.DataType.FLOAT16:
            return PassResult(False, {})
        w.const_value = ir.tensor(w.const_value.numpy().astype(np.float16), name="w")  # type: ignore[union-attr]
        w.dtype = ir.DataType.FLOAT16
        return PassResult(True, {"halved": 1})


class BadAttributePass(Pass):
    """Gives the Relu an attribute it does not have: the ONNX checker refuses it."""

    name = "bad-attribute"

    def call(self, model: ir.Model) -> PassResult:
        node = next(n for n in model.graph if n.op_type == "Relu")
        node.attributes["alpha"] = ir.AttrFloat32("alpha", 0.1)
        return PassResult(True, {"broken": 1})


def test_valid_output_reports_the_check():
    model = _model()
    report = api.run_passes(model, [RenamePass()], blocked=BLOCK)
    assert report.extra["output_check"]["onnx_checker"] == "passed"
    assert report.extra["output_check"]["onnxruntime"].startswith("passed")
    assert report.to_dict()["output_check"] == report.extra["output_check"]


def test_ort_refusal_names_the_first_bad_pass_and_the_node():
    model = _model()
    with pytest.raises(PassFailedError) as err:
        api.run_passes(model, [HalfWeightPass(), RenamePass()], blocked=BLOCK)
    assert err.value.pass_name == "half-weight"  # not 'rename', the last pass that changed the model
    assert "node 'add'" in str(err.value)
    assert "does not load" in str(err.value)


def test_checker_refusal_names_the_pass_and_the_node():
    model = _model()
    with pytest.raises(PassFailedError) as err:
        api.run_passes(model, [RenamePass(), BadAttributePass()], blocked=BLOCK)
    assert err.value.pass_name == "bad-attribute"
    assert "onnx checker" in str(err.value)
    assert "renamed" in str(err.value)  # the checker names the node by its name at that point


def test_check_output_false_skips_the_check():
    model = _model()
    report = api.run_passes(model, [HalfWeightPass()], blocked=BLOCK, check_output=False)
    assert "output_check" not in report.extra
    with pytest.raises(InvalidModel):
        check_model_output(model)


def test_input_already_invalid_is_not_blamed_on_a_pass():
    model = _model()
    HalfWeightPass().call(model)  # the input itself does not load
    report = api.run_passes(model, [RenamePass()], blocked=BLOCK)
    assert report.extra["output_check"]["result"].startswith("the input model already fails")


def test_custom_domain_without_function_skips_the_ort_load():
    model = _model()
    relu = next(n for n in model.graph if n.op_type == "Relu")
    relu.domain = "example.custom"
    model.opset_imports["example.custom"] = 1
    result = check_model_output(model)
    assert result["onnx_checker"] == "passed"
    assert result["onnxruntime"] == "skipped: ops in domain(s) ONNX Runtime does not know: example.custom"


def test_external_data_is_loaded_from_its_folder(tmp_path):
    """A model whose weights stay in an external file: the checker does not read them, ORT reads them in place."""
    proto = ir.serde.serialize_model(_model())
    w = np.arange(4096, dtype=np.float32)  # above the placeholder size
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4096
    proto.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 4096
    onnx.save(proto, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    model = ir_io.load_model(tmp_path / "m.onnx")
    assert isinstance(model.graph.initializers["w"].const_value, ir.ExternalTensor)
    assert check_model_output(model)["onnxruntime"].startswith("passed")
    (tmp_path / "m.data").write_bytes(b"\0" * 16)  # truncated weights: ORT, reading them in place, refuses
    with pytest.raises(InvalidModel) as err:
        check_model_output(model)
    assert err.value.tool == "onnxruntime"


def test_cli_exit_4_one_line_and_no_output_file(tmp_path, capsys, monkeypatch):
    from mograph.cli import main
    from mograph.plugins import get_registry

    reg = get_registry()
    monkeypatch.setitem(reg.passes, "half-weight", HalfWeightPass)
    monkeypatch.setitem(reg.pass_source, "half-weight", "tests")
    src = tmp_path / "m.onnx"
    onnx.save(ir.serde.serialize_model(_model()), src)
    code = main(["optimize", str(src), "-o", str(tmp_path / "out.onnx"), "--passes", "half-weight", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == PassFailedError.exit_code == 4
    assert len(err.splitlines()) == 1
    assert "pass 'half-weight' failed: wrote a model that does not load" in err and "node 'add'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_ort_load_skipped_above_the_weight_limit(monkeypatch):
    import mograph.output_check as oc

    monkeypatch.setattr(oc, "ORT_MAX_BYTES", 4)  # the model holds 8 bytes of weights
    model = _model()
    HalfWeightPass().call(model)  # would fail the load: the checker alone runs, and passes
    result = check_model_output(model)
    assert result == {"onnx_checker": "passed", "onnxruntime": "skipped: 8 bytes of weights (load limit 4 bytes)"}


def test_input_the_cloner_cannot_copy_is_still_checked_and_not_blamed():
    """A branch that outputs an outer value: onnx_ir's Model.clone fails on it, and the ONNX checker refuses it."""
    then_g = helper.make_graph([], "then", [], [helper.make_tensor_value_info("s", TensorProto.FLOAT, [4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["s"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["s"], name="add"),
         helper.make_node("If", ["c"], ["b"], name="if", then_branch=then_g, else_branch=else_g),
         helper.make_node("Relu", ["b"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")],
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(Exception):  # noqa: B017 - whatever onnx_ir raises; the point is that it does
        model.clone()
    report = api.run_passes(model, [RenamePass()], blocked=BLOCK)
    assert report.extra["output_check"]["result"].startswith("the input model already fails: onnx checker")


def _simplified_ln_model(op_type: str):
    import numpy as np
    from onnx import TensorProto, helper

    node = helper.make_node(op_type, ["x", "g"], ["y"], axis=-1, epsilon=1e-6)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor("g", TensorProto.FLOAT, [8], np.ones(8, np.float32))],
    )
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_ort_default_domain_op_is_left_to_onnxruntime():
    """SimplifiedLayerNormalization (ONNX Runtime's, default domain) passes; a misspelt op does not."""
    pytest.importorskip("onnxruntime")
    from mograph.output_check import InvalidModel, check_model_output

    assert check_model_output(_simplified_ln_model("SimplifiedLayerNormalization"))["onnxruntime"].startswith("passed")
    with pytest.raises(InvalidModel, match="SimplifiedLayerNormalizationX"):
        check_model_output(_simplified_ln_model("SimplifiedLayerNormalizationX"))


def _listing_or_skip():
    """ONNX Runtime's kernel listing; a skip where this onnxruntime is a GPU build whose listing cannot run here
    (its provider libraries missing: the child process crashes and the fallback list is used, as tested below)."""
    import onnxruntime as ort

    import mograph.output_check as oc

    kernels = oc._ort_cpu_default_domain_kernels()
    if kernels is None and not set(ort.get_available_providers()) <= oc._LISTING_SAFE_PROVIDERS:
        pytest.skip("a GPU build of onnxruntime whose kernel listing crashes here (provider libraries missing)")
    assert kernels
    return kernels


def test_ort_default_domain_ops_come_from_onnxruntime_itself():
    """Issue 27: which default-domain ops ONNX Runtime runs beyond the ONNX schemas is asked of its kernels."""
    pytest.importorskip("onnxruntime")
    from mograph.output_check import ort_default_domain_ops

    _listing_or_skip()
    below, source = ort_default_domain_ops(12)
    assert source == "onnxruntime"
    assert {"LayerNormalization", "SimplifiedLayerNormalization"} <= below
    at17, _ = ort_default_domain_ops(17)
    assert "LayerNormalization" not in at17 and "SimplifiedLayerNormalization" in at17  # ONNX has it from 17
    assert "Relu" not in below  # an op with an ONNX schema is the checker's


def test_a_gpu_build_lists_its_kernels_in_a_child_process(monkeypatch):
    """onnxruntime-gpu 1.31.1's ``get_all_opkernel_def`` loads every provider's library and crashed the whole
    process (a segmentation fault inside the output check of every pass) where TensorRT or CUDA libraries were
    missing (an H200 without TensorRT; any machine without CUDA): a build with providers beyond the CPU lists its
    kernels in a child process, and a child that crashes gives the fallback list, not a dead process."""
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state as ort_c

    import mograph.output_check as oc

    oc._ort_cpu_default_domain_kernels.cache_clear()
    want = _listing_or_skip()
    calls: list[int] = []
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                                                  "CPUExecutionProvider"])
    monkeypatch.setattr(ort_c, "get_all_opkernel_def", lambda: calls.append(1) or [])
    try:
        oc._ort_cpu_default_domain_kernels.cache_clear()
        assert oc._ort_cpu_default_domain_kernels() == want and calls == []  # the child's listing, same kernels
        monkeypatch.setattr(oc, "_LISTING_SCRIPT", "import os; os.abort()")  # the crash, in the child
        oc._ort_cpu_default_domain_kernels.cache_clear()
        assert oc._ort_cpu_default_domain_kernels() is None and calls == []
        assert oc.ort_default_domain_ops(12)[1] == "fallback"
    finally:
        oc._ort_cpu_default_domain_kernels.cache_clear()


def _ort_layernorm_model(opset: int):
    from onnx import TensorProto, helper

    node = helper.make_node("LayerNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor("g", TensorProto.FLOAT, [4], [1.0] * 4)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_layernorm_below_17_passes_the_check_and_loads_in_ort():
    """What ``--target ort`` writes for a LayerNorm at opset 12: the checker used to refuse it."""
    pytest.importorskip("onnxruntime")
    import onnx_ir as ir

    result = check_model_output(ir.serde.deserialize_model(_ort_layernorm_model(12)))
    assert result["onnx_checker"].startswith("passed") and "LayerNormalization" in result["onnx_checker"]
    assert result["onnxruntime"].startswith("passed")


def test_without_onnxruntime_the_fallback_names_what_went_unchecked(monkeypatch):
    import onnx_ir as ir

    import mograph.output_check as oc

    monkeypatch.setattr(oc, "_ort_cpu_default_domain_kernels", lambda: None)
    monkeypatch.setattr(oc, "_ort_skip_reason", lambda model, census=None: "onnxruntime is not installed")
    result = check_model_output(ir.serde.deserialize_model(_ort_layernorm_model(12)))
    assert "onnxruntime absent: not checked" in result["onnx_checker"], result
    assert result["onnxruntime"] == "skipped: onnxruntime is not installed"
    bad = _ort_layernorm_model(12)
    bad.graph.node[0].op_type = "NoSuchOp"  # an op neither ONNX nor the fallback knows: still refused
    with pytest.raises(InvalidModel, match="NoSuchOp"):
        check_model_output(ir.serde.deserialize_model(bad))


# -- a model with no graph outputs (issue 30, R10): the ONNX checker and ORT accept it; it computes nothing


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


def _with_plugin_passes(monkeypatch, *passes: type[Pass]) -> None:
    import sys
    import types

    from mograph import plugins
    from mograph.hookspecs import hookimpl

    plugin = types.ModuleType("mograph_test_output_check_passes")

    @hookimpl
    def mograph_add_passes():  # type: ignore[no-untyped-def]
        return list(passes)

    plugin.mograph_add_passes = mograph_add_passes  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, plugin.__name__, plugin)
    monkeypatch.setattr(plugins, "BUILTIN_PLUGINS", (*plugins.BUILTIN_PLUGINS, plugin.__name__))
    plugins.reset()


def test_a_model_read_from_a_file_is_read_again_to_bisect_not_copied_up_front(tmp_path, monkeypatch):
    """optimize(path): no copy of the input is made before the passes (on a 100k-node graph it cost 4
    CPU-seconds and a second graph's memory); a failed check reads the file again and still names the
    first bad pass, not the last one that changed the model."""
    from mograph import plugins

    src = tmp_path / "m.onnx"
    onnx.save(ir.serde.serialize_model(_model()), src)
    copies: list[object] = []
    real = api._snapshot
    monkeypatch.setattr(api, "_snapshot", lambda m: copies.append(m) or real(m))
    reads: list[object] = []
    real_load = ir_io.load_model
    monkeypatch.setattr(ir_io, "load_model", lambda source, **kw: reads.append(source) or real_load(source, **kw))
    _with_plugin_passes(monkeypatch, HalfWeightPass, RenamePass)
    try:
        model, report = api.optimize(str(src), ["rename"])
        assert report.extra["output_check"]["onnxruntime"].startswith("passed")
        assert copies == [] and reads == [str(src)]  # read once, never copied
        with pytest.raises(PassFailedError) as err:
            api.optimize(str(src), ["half-weight", "rename"])
        assert err.value.pass_name == "half-weight"
        assert copies == [] and reads == [str(src)] * 3  # the failed run read the file a second time
        with pytest.raises(PassFailedError) as err:  # an onnx_ir.Model is rewritten in place: copied up front
            api.optimize(_model(), ["half-weight", "rename"])
        assert err.value.pass_name == "half-weight" and len(copies) == 1
    finally:
        plugins.reset()


def test_a_spilled_model_is_serialized_once_for_the_checker_and_onnxruntime(monkeypatch):
    """Above the spill size the checker gets a copy of the spilled file's proto (its external tensors
    emptied) instead of a second serialization of the graph; a model below it still gets the skeleton."""
    from mograph import _spill, output_check

    calls: list[str] = []
    real_serialize = ir.serde.serialize_model
    monkeypatch.setattr(ir.serde, "serialize_model", lambda m, *a, **k: calls.append("serialize") or real_serialize(m, *a, **k))
    real_skeleton = output_check._skeleton
    monkeypatch.setattr(output_check, "_skeleton", lambda m, census=None: calls.append("skeleton") or real_skeleton(m, census))
    out = check_model_output(_model())
    assert out["onnxruntime"].startswith("passed") and calls.count("skeleton") == 1
    calls.clear()
    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, "0")  # every model is spilled
    model = _model()
    out = check_model_output(model)
    assert out["onnx_checker"] == "passed" and out["onnxruntime"].startswith("passed")
    assert calls == ["serialize"]  # the spill's; no skeleton
    calls.clear()
    with pytest.raises(PassFailedError) as err:  # the checker still refuses what it refused on the skeleton
        api.run_passes(model, [RenamePass(), BadAttributePass()], blocked=BLOCK)
    assert err.value.pass_name == "bad-attribute" and "onnx checker" in str(err.value)
    assert "skeleton" not in calls


def test_the_onnxruntime_load_runs_without_optimizations_or_weight_prepacking(monkeypatch):
    """The check's session: graph optimizations off and ``session.disable_prepacking`` set (a prepacked
    copy of every MatMul weight doubled the check's peak memory), the memory pattern off (its planner is
    quadratic in the initializers); a model ONNX Runtime refuses is still refused with these options."""
    import onnxruntime as ort

    from mograph import _spill

    seen: list[ort.SessionOptions] = []
    real_session = _spill.Payload.session

    def session(self, sess_options, providers):
        seen.append(sess_options)
        return real_session(self, sess_options, providers)

    monkeypatch.setattr(_spill.Payload, "session", session)
    assert check_model_output(_model())["onnxruntime"].startswith("passed")
    assert len(seen) == 1
    assert seen[0].graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert seen[0].get_session_config_entry("session.disable_prepacking") == "1"
    assert seen[0].enable_mem_pattern is False
    bad = _model()
    HalfWeightPass().call(bad)
    with pytest.raises(InvalidModel) as err:
        check_model_output(bad)
    assert err.value.tool == "onnxruntime" and len(seen) == 2


def test_fallback_list_is_read_off_the_foreign_op_records():
    """Without onnxruntime, the default-domain ops ONNX Runtime runs beyond ONNX's schemas are the records that
    say so (issue 28: one record per foreign op, no hand list); they agree with what ORT itself reports at opset
    12 where it is installed."""
    import mograph.foreign_ops as fo
    import mograph.output_check as oc

    assert oc.ORT_DEFAULT_DOMAIN_OPS_FALLBACK == {"LayerNormalization", "SimplifiedLayerNormalization"}
    assert all(op.domain == "" for op in fo.BUILTIN_FOREIGN_OPS if op.ort_default_domain)
    ort_ops, source = oc.ort_default_domain_ops(12)
    if source == "onnxruntime":
        assert oc.ORT_DEFAULT_DOMAIN_OPS_FALLBACK <= ort_ops
