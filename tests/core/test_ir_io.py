"""Loading and saving at the API edge: every accepted form comes back in the same form, external data
round-trips with equal values and stays lazy, and writes are atomic and never clobber the input."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

import mograph
from models.builders import make_model
from mograph import ir_io
from mograph.errors import ModelError, UsageError

X = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)


def _model() -> onnx.ModelProto:
    """y = Relu(Identity(x) @ w + b), plus a dead Sigmoid: cleanup removes two nodes."""
    nodes = [
        helper.make_node("Identity", ["x"], ["xi"]),
        helper.make_node("MatMul", ["xi", "w"], ["t"]),
        helper.make_node("Add", ["t", "b"], ["u"]),
        helper.make_node("Relu", ["u"], ["y"]),
        helper.make_node("Sigmoid", ["x"], ["dead"]),
    ]
    rng = np.random.default_rng(1)  # the same weights on every call
    inits = {"w": rng.standard_normal((8, 64)).astype(np.float32), "b": rng.standard_normal(64).astype(np.float32)}
    return make_model(nodes, [("x", np.float32, [2, 8])], [("y", np.float32, [2, 64])], inits)


def _reference(proto: onnx.ModelProto) -> np.ndarray:
    w = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    return np.maximum(X @ w["w"] + w["b"], 0)


def _run(model: onnx.ModelProto) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": X})[0]


def _as_proto(result: object) -> onnx.ModelProto:
    if isinstance(result, ir.Model):
        return ir.serde.serialize_model(result)
    if isinstance(result, bytes):
        return onnx.load_from_string(result)
    if isinstance(result, onnx.ModelProto):
        return result
    import onnx_graphsurgeon as gs

    return gs.export_onnx(result)


def _forms(tmp_path: Path):
    proto = _model()
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    yield "path", str(path), ir.Model
    yield "pathlike", path, ir.Model
    yield "bytes", proto.SerializeToString(), bytes
    yield "proto", proto, onnx.ModelProto
    yield "ir", ir.serde.deserialize_model(proto), ir.Model


@pytest.mark.parametrize("form", ["path", "pathlike", "bytes", "proto", "ir"])
def test_optimize_returns_the_form_it_was_given(tmp_path, form):
    name, source, kind = next(f for f in _forms(tmp_path) if f[0] == form)
    before = source.SerializeToString() if isinstance(source, onnx.ModelProto) else None
    result, report = mograph.optimize(source, passes="cleanup")
    assert isinstance(result, kind)
    if name == "ir":
        assert result is source  # rewritten in place
    if before is not None:
        assert source.SerializeToString() == before  # the caller's proto is left alone
    out = _as_proto(result)
    assert [n.op_type for n in out.graph.node] == ["MatMul", "Add", "Relu"]
    assert report.modified
    np.testing.assert_allclose(_run(out), _reference(_model()), rtol=1e-5, atol=1e-6)


def test_optimize_accepts_and_returns_a_graphsurgeon_graph():
    gs = pytest.importorskip("onnx_graphsurgeon")
    graph = gs.import_onnx(_model())
    result, _ = mograph.optimize(graph, passes="cleanup")
    assert isinstance(result, gs.Graph)
    out = gs.export_onnx(result)
    assert [n.op_type for n in out.graph.node] == ["MatMul", "Add", "Relu"]
    np.testing.assert_allclose(_run(out), _reference(_model()), rtol=1e-5, atol=1e-6)


def test_unsupported_source_type_is_a_usage_error():
    with pytest.raises(UsageError, match="cannot load a model from int"):
        mograph.load(42)


def _save_external(proto: onnx.ModelProto, path: Path, location: str = "weights.bin") -> None:
    copy = onnx.ModelProto.FromString(proto.SerializeToString())  # onnx.save converts in place
    onnx.save(copy, path, save_as_external_data=True, location=location, size_threshold=0)


def _values(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))  # loads external data too
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_external_data_loads_lazily_and_saves_with_equal_values(tmp_path):
    proto = _model()
    src = tmp_path / "in" / "m.onnx"
    src.parent.mkdir()
    _save_external(proto, src)
    want = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}

    model = mograph.load(src)
    tensors = {name: v.const_value for name, v in model.graph.initializers.items()}
    assert all(isinstance(t, ir.ExternalTensor) for t in tensors.values())
    assert all(t.raw is None for t in tensors.values())  # nothing read yet

    # Kept external (the default for a model that had external data): a .data file beside the output.
    out = tmp_path / "out" / "m.opt.onnx"
    mograph.save(model, str(out))
    assert sorted(os.listdir(out.parent)) == ["m.opt.onnx", "m.opt.onnx.data"]
    saved = onnx.load(str(out), load_external_data=False).graph.initializer
    assert {e.value for t in saved for e in t.external_data if e.key == "location"} == {"m.opt.onnx.data"}
    got = _values(out)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])

    # Inlined on request.
    inline = tmp_path / "inline.onnx"
    mograph.save(model, str(inline), external_data=False)
    loaded = onnx.load(str(inline), load_external_data=False)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in loaded.graph.initializer)
    for name, value in _values(inline).items():
        np.testing.assert_array_equal(value, want[name])


def test_in_memory_model_can_be_saved_with_external_data(tmp_path):
    out = tmp_path / "m.onnx"
    mograph.save(mograph.load(_model()), str(out), external_data=True)
    assert (tmp_path / "m.onnx.data").stat().st_size > 0
    np.testing.assert_allclose(_run(onnx.load(str(out))), _reference(_model()), rtol=1e-5, atol=1e-6)


def test_cleanup_never_reads_external_data_it_cannot_fold(tmp_path):
    """Passes see external tensors by shape and dtype only; their bytes are copied at save time.

    (ONNX shape inference is handed tensors of up to 1 KB inline, so only the 2 KB weight is checked.)
    """
    proto = _model()
    src = tmp_path / "m.onnx"
    _save_external(proto, src)
    model, _ = mograph.optimize(str(src), passes="cleanup", options={"fold_limit": 4})
    assert [n.op_type for n in model.graph] == ["MatMul", "Add", "Relu"]
    weight = model.graph.initializers["w"].const_value
    assert isinstance(weight, ir.ExternalTensor)
    assert weight.nbytes > 1000
    assert weight.raw is None, "the weight was read"
    out = tmp_path / "out.onnx"
    mograph.save(model, str(out))
    np.testing.assert_allclose(_run(onnx.load(str(out))), _reference(proto), rtol=1e-5, atol=1e-6)


def with_external_location(proto: onnx.ModelProto, name: str, location: str) -> onnx.ModelProto:
    """A copy of ``proto`` whose initializer ``name`` points at ``location`` (onnx itself refuses '..')."""
    copy = onnx.ModelProto.FromString(proto.SerializeToString())
    tensor = next(t for t in copy.graph.initializer if t.name == name)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    return copy


def test_bytes_with_external_data_outside_the_given_folder_are_refused(tmp_path, monkeypatch):
    # Bytes have no folder of their own: their external data is refused outright, and with a base_dir
    # it may not escape that folder (the working directory is never used).
    (tmp_path / "w.bin").write_bytes(numpy_helper.to_array(_model().graph.initializer[0]).tobytes())
    data = with_external_location(_model(), "w", "../w.bin").SerializeToString()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(ModelError, match="no folder to read it from"):
        mograph.load(data)
    with pytest.raises(ModelError, match="outside the model's folder"):
        mograph.load(data, base_dir=str(work))


def test_streamed_initializers_keep_the_values_names(tmp_path, monkeypatch):
    # A pass gives a value a new tensor without a name (``ir.tensor(array)``); only the value is named.
    # Written without external data, each large initializer is serialized on its own: it must carry the
    # value's name, or the file's node reads an initializer that is not there (a dangling input, which
    # the loader refuses).  The limit is lowered so a few kilobytes count as large.
    monkeypatch.setattr(ir_io, "_STREAMED_BYTES", 1024)
    model = mograph.load(_model())
    expected = {}
    for v in model.graph.initializers.values():
        array = v.const_value.numpy() * 2
        v.const_value = ir.tensor(array)  # no name: what a pass that converts weights makes
        expected[v.name] = array
    assert model.graph.initializers["w"].const_value.nbytes >= 1024  # streamed
    assert model.graph.initializers["w"].const_value.name is None
    out = ir_io.save_model(model, tmp_path / "out.onnx", external_data=False)
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto)
    assert [t.name for t in proto.graph.initializer] == ["b", "w"]  # b inline, then the streamed w
    back = ir_io.load_model(out)  # no dangling input
    for name, array in expected.items():
        np.testing.assert_array_equal(back.graph.initializers[name].const_value.numpy(), array)


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous result")
    listing = sorted(os.listdir(tmp_path))
    real_save = ir_io._write_inline  # what writes a model without external data

    def broken_save(model, path, **kwargs):
        real_save(model, path, **kwargs)  # the temporary file is complete ...
        Path(path).write_bytes(Path(path).read_bytes()[:10])  # ... then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ir_io, "_write_inline", broken_save)
    with pytest.raises(UsageError, match="No space left on device"):
        ir_io.save_model(mograph.load(_model()), out)
    assert sorted(os.listdir(tmp_path)) == listing  # no temporary folder left behind
    assert out.read_bytes() == b"previous result"  # the old output is intact


def test_unwritable_destination_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match="cannot write"):
        ir_io.save_model(mograph.load(_model()), blocker / "out.onnx")


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink"])
def test_save_refuses_to_write_over_the_input(tmp_path, alias):
    src = tmp_path / "m.onnx"
    onnx.save(_model(), src)
    before = src.read_bytes()
    dest = {"same": src, "symlink": tmp_path / "link.onnx", "hardlink": tmp_path / "hard.onnx"}[alias]
    if alias == "symlink":
        dest.symlink_to(src)
    elif alias == "hardlink":
        os.link(src, dest)
    with pytest.raises(UsageError, match="refusing to write over the input model"):
        ir_io.save_model(mograph.load(src), dest, forbid=src)
    assert src.read_bytes() == before


def test_save_never_replaces_the_weights_the_input_reads(tmp_path):
    # The input's external data is named like the output's data file would be: the output's data goes
    # under another name, and the input keeps its weights.
    src = tmp_path / "m.onnx"
    _save_external(_model(), src, location="out.onnx.data")
    data_before = (tmp_path / "out.onnx.data").read_bytes()
    ir_io.save_model(mograph.load(src), tmp_path / "out.onnx", forbid=src)
    assert (tmp_path / "out.onnx.data").read_bytes() == data_before
    saved = onnx.load(str(tmp_path / "out.onnx"), load_external_data=False).graph.initializer
    locations = {e.value for t in saved for e in t.external_data if e.key == "location"}
    assert len(locations) == 1 and locations != {"out.onnx.data"}
    np.testing.assert_allclose(_run(onnx.load(str(tmp_path / "out.onnx"))), _reference(_model()), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_run(onnx.load(str(src))), _reference(_model()), rtol=1e-5, atol=1e-6)


def test_python_save_refuses_to_write_over_the_model_it_was_loaded_from(tmp_path):
    src = tmp_path / "m.onnx"
    _save_external(_model(), src, location="m.onnx.data")
    onnx_before, data_before = src.read_bytes(), (tmp_path / "m.onnx.data").read_bytes()
    model = mograph.load(src)
    for external_data in (None, True, False):
        with pytest.raises(UsageError, match="the file this model was loaded from"):
            mograph.save(model, str(src), external_data=external_data)
    assert src.read_bytes() == onnx_before
    assert (tmp_path / "m.onnx.data").read_bytes() == data_before
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    # a self-contained copy next to it is fine, and holds the same weights
    mograph.save(model, str(tmp_path / "copy.onnx"), external_data=False)
    assert _values(tmp_path / "copy.onnx").keys() == _values(src).keys()
    for name, want in _values(src).items():
        np.testing.assert_array_equal(_values(tmp_path / "copy.onnx")[name], want)


def test_python_save_over_the_source_when_allowed_keeps_the_weights_it_reads(tmp_path):
    src = tmp_path / "m.onnx"
    _save_external(_model(), src, location="m.onnx.data")
    data_before = (tmp_path / "m.onnx.data").read_bytes()
    model, _ = mograph.optimize(str(src), passes="cleanup")
    mograph.save(model, str(src), overwrite=True)
    # The loaded model still maps m.onnx.data, so it stays; the new model reads its own new file.
    assert (tmp_path / "m.onnx.data").read_bytes() == data_before
    assert [n.op_type for n in onnx.load(str(src)).graph.node] == ["MatMul", "Add", "Relu"]
    np.testing.assert_allclose(_run(onnx.load(str(src))), _reference(_model()), rtol=1e-5, atol=1e-6)


def test_model_size_does_not_read_external_data(tmp_path):
    src = tmp_path / "m.onnx"
    _save_external(_model(), src)
    model = mograph.load(src)
    assert ir_io.model_size_bytes(model) == (8 * 64 + 64) * 4
    assert all(v.const_value.raw is None for v in model.graph.initializers.values())


def _zipmap_classifier() -> onnx.ModelProto:
    """A scikit-learn classifier as skl2onnx writes it by default: labels plus a ZipMap of probabilities."""
    f32 = onnx.TensorProto.FLOAT
    classify = helper.make_node("LinearClassifier", ["x"], ["label", "prob"], domain="ai.onnx.ml",
                                coefficients=[1.0, -1.0, 0.5, 0.5], intercepts=[0.0, 0.1], classlabels_ints=[0, 1],
                                post_transform="LOGISTIC")
    zipmap = helper.make_node("ZipMap", ["prob"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])
    probabilities = helper.make_value_info("probabilities", helper.make_sequence_type_proto(
        helper.make_map_type_proto(onnx.TensorProto.INT64, helper.make_tensor_type_proto(f32, []))))
    graph = helper.make_graph([classify, zipmap], "g", [helper.make_tensor_value_info("x", f32, ["n", 2])],
                              [helper.make_tensor_value_info("label", onnx.TensorProto.INT64, ["n"]), probabilities])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)])


def test_a_map_typed_output_is_refused_naming_it(tmp_path):
    """A LightGBM classifier from onnxmltools (issue 27's held-out run) ends in ZipMap, whose output is a
    sequence of maps: onnx-ir has no map type, and the refusal was its internal message with a graph hash."""
    path = tmp_path / "classifier.onnx"
    onnx.save(_zipmap_classifier(), str(path))
    with pytest.raises(ModelError) as info:
        mograph.optimize(str(path), passes=["cleanup"])
    message = str(info.value)
    assert message.startswith("cannot read the model: output 'probabilities' (seq(map(int64, tensor(float))), "
                              "made by ZipMap) has a map type")
    assert "zipmap=False" in message and "_deserialize_graph" not in message
