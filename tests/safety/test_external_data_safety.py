"""External data may only be read from inside the model's own folder, wherever the tensor sits.

A tensor with external data names a file; a loader that follows any name reads any file. These tests
build hostile models in code (``_hostile_models``) whose tensor — an initializer, a Constant's
``value``, a TENSORS attribute, a Constant inside an ``If`` branch, a subgraph initializer, a Constant
inside a model-local function — points at a secret outside the model's folder, and check that
``optimize --passes cleanup``, the API (from a path, bytes or a ``ModelProto``) and ``inspect`` refuse
it, and that the secret's bytes never reach an output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from _hostile_models import SITES, external_tensor, hostile_model
from onnx import TensorProto, helper, numpy_helper

import mograph
from mograph.cli import main
from mograph.errors import ModelError

SECRET = b"TOP-SECRET-0123456789-do-not-leak"


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """``tmp_path/secret.bin`` (outside) and an empty model folder ``tmp_path/model``."""
    (tmp_path / "secret.bin").write_bytes(SECRET)
    (tmp_path / "model").mkdir()
    return tmp_path / "model"


def _location(kind: str, folder: Path) -> str:
    if kind == "absolute":
        return str(folder.parent / "secret.bin")
    if kind == "parent":
        return "../secret.bin"
    if kind == "deep-parent":
        return "sub/../../../../../../" + str(folder.parent / "secret.bin").lstrip("/")
    if kind == "symlink":
        (folder / "link.bin").symlink_to(folder.parent / "secret.bin")
        return "link.bin"
    raise AssertionError(kind)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _no_leak(root: Path, before: dict[str, bytes]) -> None:
    after = _files(root)
    assert after == before, f"files changed or appeared: {sorted(set(after) ^ set(before))}"
    assert not any(SECRET in data for name, data in after.items() if name != "secret.bin")


@pytest.mark.parametrize("kind", ["absolute", "parent", "deep-parent", "symlink"])
@pytest.mark.parametrize("site", sorted(SITES))
def test_cli_cleanup_refuses_external_data_outside_the_folder(capsys, layout, monkeypatch, site, kind):
    path = layout / "m.onnx"
    onnx.save(hostile_model(site, _location(kind, layout), len(SECRET)), path)
    monkeypatch.chdir(layout)  # a relative location would also resolve here: still refused
    before = _files(layout.parent)
    code = main(["optimize", str(path), "--passes", "cleanup", "-o", str(layout / "out.onnx")])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and err.startswith("mograph: error:")
    _no_leak(layout.parent, before)


def test_cli_refuses_etc_passwd_in_a_subprocess(tmp_path):
    import subprocess
    import sys

    passwd = Path("/etc/passwd")
    if not passwd.is_file():
        pytest.skip("no /etc/passwd here")
    path = tmp_path / "m.onnx"
    onnx.save(hostile_model("constant", str(passwd), passwd.stat().st_size), path)
    proc = subprocess.run(
        [sys.executable, "-m", "mograph", "optimize", str(path), "--passes", "cleanup", "-o", str(tmp_path / "o.onnx")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert "outside the model's folder" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


@pytest.mark.parametrize("form", ["path", "bytes", "proto"])
@pytest.mark.parametrize("site", ["constant", "if-branch-constant", "function-constant", "tensors-attribute"])
def test_api_refuses_external_data_outside_the_folder(layout, monkeypatch, site, form):
    proto = hostile_model(site, "../secret.bin", len(SECRET))
    path = layout / "m.onnx"
    onnx.save(proto, path)
    monkeypatch.chdir(layout)
    source = {"path": str(path), "bytes": proto.SerializeToString(), "proto": proto}[form]
    with pytest.raises(ModelError, match="outside the model's folder|no folder to read it from"):
        mograph.optimize(source, passes="cleanup")
    with pytest.raises(ModelError):
        mograph.load(source)


@pytest.mark.parametrize("form", ["bytes", "proto"])
def test_bytes_and_protos_have_no_folder_so_their_external_data_is_refused(layout, monkeypatch, form):
    # The data file sits right in the working directory, where a cwd-relative read would find it.
    (layout / "secret.bin").write_bytes(SECRET)
    proto = hostile_model("constant", "secret.bin", len(SECRET))
    monkeypatch.chdir(layout)
    source = proto.SerializeToString() if form == "bytes" else proto
    with pytest.raises(ModelError, match="no folder to read it from"):
        mograph.optimize(source, passes="cleanup")
    # ... unless the caller names the folder: then it is read from there, and only from there.
    model = mograph.load(source, base_dir=str(layout))
    tensor = model.graph.node(0).attributes["value"].value
    assert tensor.tobytes() == SECRET
    with pytest.raises(ModelError, match="outside the model's folder"):
        mograph.load(hostile_model("constant", "../secret.bin", 4).SerializeToString(), base_dir=str(layout))


def _legit_constant_model(folder: Path) -> tuple[Path, np.ndarray]:
    """``y = x + c``, the Constant ``c`` with its value in ``weights.bin`` beside the model."""
    values = np.arange(12, dtype=np.float32)
    (folder / "weights.bin").write_bytes(values.tobytes())
    tensor = external_tensor("weights.bin", 12)
    tensor.data_type = TensorProto.FLOAT
    const = helper.make_node("Constant", [], ["c"], value=tensor)
    node = helper.make_node("Add", ["x", "c"], ["y"])
    graph = helper.make_graph(
        [const, node],
        "legit",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [12])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "m.onnx"
    onnx.save(model, path)
    return path, values


def test_external_data_inside_the_folder_is_read_from_the_folder_from_any_cwd(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    path, values = _legit_constant_model(folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(np.full(12, 99, np.float32).tobytes())  # a decoy in the cwd
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(path), "--passes", "cleanup", "-o", str(out), "-q"]) == 0, capsys.readouterr().err
    # The output reads nothing from the input's folder: the Constant's value travels with it.
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    x = np.linspace(-1, 1, 12, dtype=np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + values)
    saved = onnx.load(str(out))
    assert [n.op_type for n in saved.graph.node] == ["Constant", "Add"]
    np.testing.assert_array_equal(numpy_helper.to_array(saved.graph.node[0].attribute[0].t), values)


def _inspect(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["inspect", "--json", *argv])
    out = capsys.readouterr().out
    return code, json.loads(out)


@pytest.mark.parametrize("kind", ["absolute", "parent", "symlink"])
def test_inspect_refuses_external_data_outside_the_folder(layout, capsys, kind):
    big = layout.parent / "secret.bin"
    big.write_bytes(SECRET * 1000)  # its size would be reported otherwise
    proto = onnx.ModelProto.FromString(hostile_model("initializer", _location(kind, layout), 4).SerializeToString())
    path = layout / "m.onnx"
    onnx.save(proto, path)
    code, data = _inspect(capsys, str(path))
    assert code == 3
    assert "outside the model's folder" in data["error"]
    assert str(len(SECRET) * 1000) not in json.dumps(data)


def test_inspect_resolves_external_data_against_the_model_folder(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"\0" * 48)
    onnx.save(hostile_model("initializer", "w.bin", 48), folder / "m.onnx")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "w.bin").write_bytes(b"\0" * 5000)
    monkeypatch.chdir(elsewhere)
    code, data = _inspect(capsys, str(folder / "m.onnx"))
    assert code == 0
    assert data["warnings"] == []
    assert data["sizes"]["external_files"] == [{"location": "w.bin", "tensors": 1, "bytes": 48, "file_size": 48}]


# --- sessions: what reaches ONNX Runtime is checked as load_model checks it ------------------------

#: Sites whose model ONNX Runtime can run with no inputs (``y`` is the external tensor's bytes).
RUNNABLE = ["initializer", "constant", "if-branch-constant", "subgraph-initializer", "function-constant"]


@pytest.fixture
def decoy(tmp_path: Path, monkeypatch) -> tuple[Path, bytes]:
    """``tmp_path/model/w.bin`` holds the real bytes; the current directory holds a ``w.bin`` decoy."""
    folder = tmp_path / "model"
    folder.mkdir()
    real = bytes(range(1, 9))
    (folder / "w.bin").write_bytes(real)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "w.bin").write_bytes(b"\xee" * 8)
    monkeypatch.chdir(cwd)
    return folder, real


def _session_output(source, **kwargs) -> bytes:
    from mograph.backends import ort

    session = ort.make_session(source, **kwargs)
    return ort.run(session, {})["y"].tobytes()


@pytest.mark.parametrize("form", ["bytes", "proto"])
def test_session_from_bytes_refuses_external_data_unless_a_folder_is_named(decoy, form):
    pytest.importorskip("onnxruntime")
    folder, real = decoy
    proto = hostile_model("constant", "w.bin", 8)
    source = proto.SerializeToString() if form == "bytes" else proto
    # Given to ONNX Runtime as bytes, 'w.bin' would be read from the current directory (the decoy).
    with pytest.raises(ModelError, match="no folder to read it from"):
        _session_output(source)
    assert _session_output(source, base_dir=folder) == real
    with pytest.raises(ModelError, match="outside the model's folder"):
        _session_output(hostile_model("constant", "../cwd/w.bin", 8).SerializeToString(), base_dir=folder)


def test_session_base_dir_applies_to_bytes_and_protos_only(decoy):
    pytest.importorskip("onnxruntime")
    from mograph.errors import UsageError

    folder, _ = decoy
    onnx.save(hostile_model("constant", "w.bin", 8), folder / "m.onnx")
    with pytest.raises(UsageError, match="base_dir applies to"):
        _session_output(str(folder / "m.onnx"), base_dir=folder)


@pytest.mark.parametrize("site", RUNNABLE)
def test_session_of_a_loaded_model_reads_its_folder_not_the_cwd(decoy, site):
    """An ``onnx_ir.Model`` loaded from a path, and copies of it, read the model's folder, wherever the
    tensor sits (ONNX Runtime given it as bytes would read a Constant's data from the cwd)."""
    pytest.importorskip("onnxruntime")
    from mograph import ir_io

    folder, real = decoy
    onnx.save(hostile_model(site, "w.bin", 8), folder / "m.onnx")
    model = ir_io.load_model(folder / "m.onnx")
    assert _session_output(model) == real
    copy = ir_io.copy_model(model)
    assert copy is not model and [t.base_dir for t in ir_io.external_tensors(copy)] == [str(folder.resolve())]
    assert _session_output(copy) == real
    assert _session_output(str(folder / "m.onnx")) == real


def test_session_refuses_an_onnx_ir_model_whose_external_tensor_has_no_folder(decoy):
    pytest.importorskip("onnxruntime")
    import onnx_ir as ir

    from mograph import ir_io

    # A bare serialized round trip drops the folder: such a tensor would be read from the cwd.
    model = ir.serde.deserialize_model(hostile_model("constant", "w.bin", 8))
    assert [t.base_dir for t in ir_io.external_tensors(model)] == [""]
    with pytest.raises(ModelError, match="no folder to read it from"):
        _session_output(model)


@pytest.mark.parametrize("kind", ["absolute", "parent", "symlink"])
def test_session_from_a_path_refuses_external_data_outside_the_folder(layout, kind):
    """Checked by mograph before ONNX Runtime sees the file (ONNX Runtime before 1.24 followed any location)."""
    pytest.importorskip("onnxruntime")
    path = layout / "m.onnx"
    onnx.save(hostile_model("constant", _location(kind, layout), len(SECRET)), path)
    with pytest.raises(ModelError, match="outside the model's folder"):
        _session_output(str(path))


def test_verifier_reference_reads_the_model_folder(decoy):
    """``optimize --verify`` and ``diff`` compare against the model's real data, not a file in the cwd."""
    pytest.importorskip("onnxruntime")
    from mograph.validate import Verifier

    folder, real = decoy
    onnx.save(hostile_model("function-constant", "w.bin", 8), folder / "m.onnx")
    verifier = Verifier(str(folder / "m.onnx"))
    assert verifier.reference["y"].tobytes() == real
    assert verifier.check(mograph.load(str(folder / "m.onnx")))["passed"]


@pytest.mark.parametrize("kind", ["absolute", "parent", "symlink"])
def test_ledger_hash_and_size_never_read_files_outside_the_folder(layout, kind):
    """``mograph sweep``/``gate`` hash a model with its data files and record its size: only files inside
    its folder count (the secret's size and bytes must not change either figure)."""
    from mograph.workflow import metrics

    path = layout / "m.onnx"
    onnx.save(hostile_model("initializer", _location(kind, layout), len(SECRET)), path)
    size, digest = metrics.file_size(path), metrics.hash_file(path)
    assert size == path.stat().st_size
    (layout.parent / "secret.bin").write_bytes(SECRET * 2)
    assert metrics.file_size(path) == size and metrics.hash_file(path) == digest


def test_ledger_hash_and_size_count_data_files_inside_the_folder(tmp_path):
    from mograph.workflow import metrics

    (tmp_path / "w.bin").write_bytes(b"\0" * 48)
    path = tmp_path / "m.onnx"
    onnx.save(hostile_model("initializer", "w.bin", 48), path)
    assert metrics.file_size(path) == path.stat().st_size + 48
    before = metrics.hash_file(path)
    (tmp_path / "w.bin").write_bytes(b"\1" * 48)
    assert metrics.hash_file(path) != before


def test_output_check_loads_constant_external_data_from_the_folder(tmp_path, monkeypatch, capsys):
    """The ONNX Runtime load check of ``optimize`` reads a Constant's external data from the model's
    folder: a short file of the same name in the current directory must not make it fail."""
    pytest.importorskip("onnxruntime")
    from mograph import ir_io
    from mograph.output_check import check_model_output

    folder = tmp_path / "model"
    folder.mkdir()
    path, _values = _legit_constant_model(folder)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(b"\0" * 4)  # too short for the Constant
    monkeypatch.chdir(elsewhere)
    assert check_model_output(ir_io.load_model(path))["onnxruntime"].startswith("passed (loaded")


def test_check_model_file_reads_a_file_again_only_when_it_changed(tmp_path, monkeypatch):
    """``make_session(path)`` checks the file first; one ``load_model`` already checked (``mograph bench``
    loads the model before it measures session memory) is not parsed again, unless it changed since."""
    from mograph import ir_io

    (tmp_path / "w.bin").write_bytes(b"\0" * 8)
    path = tmp_path / "m.onnx"
    onnx.save(hostile_model("initializer", "w.bin", 8), path)
    ir_io.load_model(path)
    calls = []
    real = ir_io.load_model
    monkeypatch.setattr(ir_io, "load_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    ir_io.check_model_file(path)
    assert calls == []
    onnx.save(hostile_model("initializer", "../secret.bin", 8), path)  # replaced by an escaping one
    with pytest.raises(ModelError, match="outside the model's folder"):
        ir_io.check_model_file(path)
    assert len(calls) == 1
