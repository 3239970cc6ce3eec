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
