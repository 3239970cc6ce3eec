"""Loading a large file reads its big in-protobuf weights straight into arrays (:mod:`mograph._stream_load`).

The size limits are lowered so that small models take that path; every model is also loaded the
ordinary way (``onnx.load`` then decoding) and the two results must be the same model: the same
serialized bytes, and each initializer the same kind of tensor (type, dtype, shape, name, doc string,
metadata, a read-only array).  Forms the scan does not take fall back to ``onnx.load``, whose errors
then apply unchanged.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import _stream_load, ir_io
from mograph._paths import model_files
from mograph.errors import ModelError


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every file is scanned, every initializer of 64 bytes or more left out; returns the count of
    tensors read from the file (appended to as they are)."""
    monkeypatch.setattr(_stream_load, "MIN_FILE_BYTES", 0)
    monkeypatch.setattr(_stream_load, "MIN_TENSOR_BYTES", 64)
    reads: list[int] = []
    real = _stream_load._read_into

    def read_into(file, offset, length):
        reads.append(length)
        return real(file, offset, length)

    monkeypatch.setattr(_stream_load, "_read_into", read_into)
    return reads


def _tensor(array: np.ndarray, name: str, **fields) -> TensorProto:
    t = numpy_helper.from_array(array, name)
    for key, value in fields.items():
        setattr(t, key, value)
    return t


def _model(tmp_path: Path, extra_initializers: list[TensorProto] = ()) -> Path:
    """z = MatMul(x, w) + b, then If(cond) with an initializer in its branch; several kinds of weights."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    branch = helper.make_graph(
        [helper.make_node("Add", ["z", "inner"], ["y_then"])], "then", [],
        [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, [2, 16])],
        [numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "inner")],
    )
    other = helper.make_graph([helper.make_node("Identity", ["z"], ["y_else"])], "else", [],
                              [helper.make_tensor_value_info("y_else", TensorProto.FLOAT, [2, 16])])
    meta = _tensor(rng.standard_normal(16).astype(np.float32), "b", doc_string="bias")
    meta.metadata_props.add(key="origin", value="test")
    bf16 = helper.make_tensor("bf", TensorProto.BFLOAT16, [32],
                              rng.standard_normal(32).astype(ml_dtypes.bfloat16).view(np.uint16).tobytes(), raw=True)
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [32], rng.standard_normal(32).tolist())  # float_data
    inits = [
        numpy_helper.from_array(w, "w"), meta, bf16, typed,
        numpy_helper.from_array(np.arange(40, dtype=np.int64).reshape(5, 8), "idx"),
        numpy_helper.from_array(rng.standard_normal(64).astype(np.float16), "half"),
        numpy_helper.from_array(rng.random(96) > 0.5, "mask"),
        numpy_helper.from_array(np.float32(3.0), "small"),  # below the limit: stays in the skeleton
        *extra_initializers,
    ]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["z"]),
         helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="test")
    path = tmp_path / "m.onnx"
    onnx.save(proto, str(path))
    return path


def _ordinary(path: Path, monkeypatch: pytest.MonkeyPatch) -> ir.Model:
    with monkeypatch.context() as m:
        m.setattr(_stream_load, "MIN_FILE_BYTES", 1 << 62)
        return ir_io.load_model(path, check=False)


def _assert_same(a: ir.Model, b: ir.Model) -> None:
    assert ir.serde.serialize_model(a).SerializeToString() == ir.serde.serialize_model(b).SerializeToString()
    for name, value in a.graph.initializers.items():
        x, y = value.const_value, b.graph.initializers[name].const_value
        assert type(x) is type(y), name
        assert (x.dtype, x.shape, x.name, x.doc_string, dict(x.metadata_props)) == (
            y.dtype, y.shape, y.name, y.doc_string, dict(y.metadata_props)), name
        ax, ay = x.numpy(), y.numpy()
        assert ax.dtype == ay.dtype and ax.shape == ay.shape and ax.flags.writeable == ay.flags.writeable, name
        assert ax.tobytes() == ay.tobytes(), name


def test_large_weights_are_read_from_the_file_and_give_the_same_model(tmp_path, streamed, monkeypatch):
    path = _model(tmp_path)
    model = ir_io.load_model(path)
    # w, b, idx, half, mask: plain raw_data of 64 bytes or more; not bf (bfloat16), typed (float_data), small
    assert sorted(streamed) == sorted([8 * 16 * 4, 16 * 4, 40 * 8, 64 * 2, 96])
    _assert_same(model, _ordinary(path, monkeypatch))
    w = model.graph.initializers["w"].const_value
    assert isinstance(w, ir.Tensor) and not w.numpy().flags.writeable
    # The branch's initializer is decoded as before (not scanned), and equal too.
    inner = next(n for n in model.graph if n.op_type == "If").attributes["then_branch"].value.initializers["inner"]
    assert inner.const_value.numpy().shape == (16,)


def test_the_skeleton_holds_no_large_raw_data_and_names_external_files(tmp_path, streamed):
    path = _model(tmp_path)
    proto = _stream_load.proto_without_weights(path)
    held = {t.name: t.HasField("raw_data") for t in proto.graph.initializer}
    assert held == {"w": False, "b": False, "bf": True, "typed": False, "idx": False, "half": False, "mask": False,
                    "small": True}
    assert proto.graph.initializer[0].dims == [8, 16] and proto.producer_name == "test"
    assert streamed == []  # nothing read for it
    # model_files (what optimize checks before it reads) still finds external data through it.
    ext = onnx.load(str(path))
    onnx.save(ext, str(tmp_path / "e.onnx"), save_as_external_data=True, location="e.data", size_threshold=0)
    assert [p.name for p in model_files(tmp_path / "e.onnx")] == ["e.onnx", "e.data"]


def test_a_small_file_is_loaded_the_ordinary_way(tmp_path, streamed, monkeypatch):
    monkeypatch.setattr(_stream_load, "MIN_FILE_BYTES", 1 << 20)
    path = _model(tmp_path)
    assert _stream_load.load(path) is None
    ir_io.load_model(path)
    assert streamed == []


def test_duplicate_initializer_names_fall_back_to_onnx_load(tmp_path, streamed, monkeypatch):
    dup = numpy_helper.from_array(np.ones((8, 16), np.float32), "w")
    path = _model(tmp_path, [dup])
    assert _stream_load.load(path) is None
    _assert_same(ir_io.load_model(path, check=False), _ordinary(path, monkeypatch))
    assert streamed == []


def test_a_second_raw_data_field_is_left_to_protobuf(tmp_path, streamed, monkeypatch):
    """Protobuf keeps the last of two ``raw_data`` fields; that tensor stays in the skeleton, the others are read."""
    path = _model(tmp_path)
    proto = onnx.load(str(path))
    later = np.full((8, 16), 7.0, np.float32).tobytes()
    w = proto.graph.initializer[0]
    doubled = w.SerializeToString() + TensorProto(raw_data=later).SerializeToString()
    w.ParseFromString(doubled)  # parsing merges: the second raw_data wins
    assert w.raw_data == later
    # Write the tensor with both fields: the file is put together by hand around it.
    rest = onnx.GraphProto()
    rest.CopyFrom(proto.graph)
    del rest.initializer[0]

    def field(number: int, payload: bytes) -> bytes:
        return _stream_load._encode_varint(number << 3 | 2) + _stream_load._encode_varint(len(payload)) + payload

    graph = field(5, doubled) + rest.SerializeToString()
    head = onnx.ModelProto()
    head.CopyFrom(proto)
    head.ClearField("graph")
    path.write_bytes(head.SerializeToString() + field(7, graph))
    model = ir_io.load_model(path, check=False)
    assert np.array_equal(model.graph.initializers["w"].const_value.numpy(), np.full((8, 16), 7.0, np.float32))
    assert 8 * 16 * 4 not in streamed and len(streamed) == 4
    _assert_same(model, _ordinary(path, monkeypatch))


def test_a_truncated_file_gives_the_ordinary_error(tmp_path, streamed, monkeypatch):
    path = _model(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    assert _stream_load.load(path) is None
    with pytest.raises(ModelError) as streamed_err:
        ir_io.load_model(path)
    monkeypatch.setattr(_stream_load, "MIN_FILE_BYTES", 1 << 62)
    with pytest.raises(ModelError) as ordinary_err:
        ir_io.load_model(path)
    assert str(streamed_err.value) == str(ordinary_err.value)


def test_data_shorter_than_the_shape_gives_the_ordinary_error(tmp_path, streamed, monkeypatch):
    bad = _tensor(np.ones(20, np.float32), "bad")
    del bad.dims[:]
    bad.dims.extend([5, 5])  # 25 elements declared, 20 held
    path = _model(tmp_path, [bad])
    assert _stream_load.load(path) is None
    with pytest.raises(ModelError, match="declares 25 elements") as streamed_err:
        ir_io.load_model(path)
    monkeypatch.setattr(_stream_load, "MIN_FILE_BYTES", 1 << 62)
    with pytest.raises(ModelError) as ordinary_err:
        ir_io.load_model(path)
    assert str(streamed_err.value) == str(ordinary_err.value)


def test_a_failed_read_loads_the_file_again_the_ordinary_way(tmp_path, streamed, monkeypatch):
    path = _model(tmp_path)

    def fail(file, offset, length):
        raise _stream_load._NotPlain("the file ended before a tensor's data")

    monkeypatch.setattr(_stream_load, "_read_into", fail)
    model = ir_io.load_model(path)
    _assert_same(model, _ordinary(path, monkeypatch))


def test_optimize_on_a_streamed_file_writes_what_it_wrote_before(tmp_path, streamed, monkeypatch):
    import mograph

    path = _model(tmp_path)
    model, report = mograph.optimize(path, passes="cleanup")
    assert streamed  # the weights came through the streaming load
    with monkeypatch.context() as m:
        m.setattr(_stream_load, "MIN_FILE_BYTES", 1 << 62)
        reference, ref_report = mograph.optimize(path, passes="cleanup")
    assert ir.serde.serialize_model(model).SerializeToString() == ir.serde.serialize_model(reference).SerializeToString()
    assert [(p.name, p.stats) for p in report.passes] == [(p.name, p.stats) for p in ref_report.passes]
