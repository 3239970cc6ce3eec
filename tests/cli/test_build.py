"""``mograph build`` and ``mograph validate`` from the command line.

Engine builds need a TensorRT module (``tensorrt_rtx`` builds on this CPU-only machine) and skip without
one. The model with plugin nodes is built through a fresh ``python -m mograph`` process with a clean
environment: the plugin-library workaround must need nothing from the user's shell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import onnx
import pytest

from mograph.backends import _trt_loader
from mograph.backends import tensorrt as trt_backend
from mograph.cli import main

HAVE_TRT = _trt_loader.find_trt_module() is not None
needs_trt = pytest.mark.skipif(not HAVE_TRT, reason="neither tensorrt nor tensorrt_rtx is installed")
PROFILES = ["--profile", "input_ids:1x4,2x16,4x64", "--profile", "attention_mask:1x4,2x16,4x64"]


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    from models.builders import bert_tiny

    path = tmp_path_factory.mktemp("models") / "bert.onnx"
    onnx.save(bert_tiny(), path)
    return path


@needs_trt
def test_build_writes_engine_and_json_report(bert_path, tmp_path, capsys):
    out = tmp_path / "bert.engine"
    code = main(["build", str(bert_path), "--backend", "tensorrt", "-o", str(out), "--json", *PROFILES])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(captured.out)
    assert data["output"] == str(out) and out.stat().st_size == data["engine_bytes"] > 100_000
    assert data["profiles"]["input_ids"] == [[1, 4], [2, 16], [4, 64]]
    assert data["unsupported"] == [] and data["plugin_layers"] == []


@needs_trt
def test_build_text_summary_and_fp16_note(bert_path, tmp_path, capsys):
    out = tmp_path / "b.engine"
    assert main(["build", str(bert_path), "-o", str(out), "--fp16", *PROFILES]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"built {out} (") and "plugin layers: none" in text
    assert "profile input_ids: min 1x4, opt 2x16, max 4x64" in text
    if _trt_loader.is_rtx(_trt_loader.import_trt()):
        assert "note: --fp16 not applied: tensorrt_rtx builds strongly typed networks" in text


@needs_trt
def test_build_default_output_beside_input(bert_path, capsys):
    expected = bert_path.parent / "bert.engine"
    try:
        assert main(["build", str(bert_path), *PROFILES]) == 0
        assert expected.exists()
    finally:
        expected.unlink(missing_ok=True)
    capsys.readouterr()


@needs_trt
def test_dynamic_input_without_profile_is_built_for_a_default_shape(bert_path, tmp_path, capsys):
    code = main(["build", str(bert_path), "-o", str(tmp_path / "x.engine"), "--shape", "input_ids:1x8", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(captured.out)
    # attention_mask shares batch and seq with input_ids: it follows its --shape
    assert data["profiles"] == {"input_ids": [[1, 8]] * 3, "attention_mask": [[1, 8]] * 3}
    note = next(n for n in data["notes"] if n.startswith("dynamic input 'attention_mask'"))
    assert "fixed shape 1x8" in note and data["defaulted_profiles"] == ["attention_mask", "input_ids"]
    assert (tmp_path / "x.engine").exists()


def _dynamic_model():  # type: ignore[no-untyped-def]
    from mograph import ir_io

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "m"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3]),
         onnx.helper.make_tensor_value_info("m", onnx.TensorProto.FLOAT, ["batch", "seq"]),
         onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, [2, 3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])],
    )
    return ir_io.load_model(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]))


def test_dynamic_inputs_without_profiles_default_like_trtexec(caplog):
    from mograph.errors import UsageError

    model = _dynamic_model()
    with caplog.at_level("WARNING", logger="mograph.backends.tensorrt"):
        profiles, warnings = trt_backend.default_profiles(model, {}, None)
    assert profiles == {"x": ((1, 3),) * 3, "m": ((1, 1),) * 3}  # the static input needs none
    assert len(warnings) == 2 and [r.message for r in caplog.records] == warnings
    assert warnings[1] == ("dynamic input 'm' ['batch', 'seq'] has no --profile: building for the fixed shape 1x1 "
                           "(dynamic dims set to 1); give --profile m:MIN,OPT,MAX for a range of shapes")
    given = {"x": ((1, 3), (4, 3), (8, 3))}
    profiles, warnings = trt_backend.default_profiles(model, given, ["m:4x16"])
    assert profiles == {"x": given["x"], "m": ((4, 16),) * 3}
    assert len(warnings) == 1 and "fixed shape 4x16 (its --shape)" in warnings[0]
    # a dim shared with an input that has a profile or a --shape takes its sizes (inputs must agree)
    profiles, warnings = trt_backend.default_profiles(model, given, None)
    assert profiles["m"] == ((1, 1), (4, 1), (8, 1))
    assert "building for the profile 1x1,4x1,8x1 (dims shared with other inputs" in warnings[0]
    profiles, _ = trt_backend.default_profiles(model, {}, ["x:2x3"])
    assert profiles == {"x": ((2, 3),) * 3, "m": ((2, 1),) * 3}
    with pytest.raises(UsageError, match=r"--shape of 'x': 4x5 does not fit the input's shape \['batch', 3\]"):
        trt_backend.default_profiles(model, {}, ["x:4x5"])
    with pytest.raises(UsageError, match="--shape of 'm': 4 does not fit"):
        trt_backend.default_profiles(model, {}, ["m:4"])
    with pytest.raises(UsageError, match="--shape given for nope, which the model has no input of"):
        trt_backend.default_profiles(model, {}, ["nope:1"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "ort"], "unknown --backend 'ort'"),
        (["--profile", "input_ids:1x4,2x16"], "give three shapes"),
        (["--workspace", "0"], "--workspace must be a positive"),
        (["--shape", "input_ids:1xq"], "dimension 1: 'q' is not an integer"),
    ],
)
def test_usage_errors(bert_path, tmp_path, capsys, args, message):
    code = main(["build", str(bert_path), "-o", str(tmp_path / "x.engine"), *args])
    assert code == 2 and message in capsys.readouterr().err


def test_build_refuses_to_overwrite_input(bert_path, capsys):
    assert main(["build", str(bert_path), "-o", str(bert_path)]) == 2
    assert "refusing to write over the input" in capsys.readouterr().err


def test_build_without_tensorrt_names_the_extra(bert_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    monkeypatch.setattr(_trt_loader, "_cached", None)
    code = main(["build", str(bert_path), "-o", str(tmp_path / "x.engine"), *PROFILES])
    assert code == 7
    assert "pip install 'mograph[tensorrt]'" in capsys.readouterr().err


@needs_trt
def test_build_plugin_model_from_a_clean_shell(tmp_path):
    """``python -m mograph build`` on a model with mograph plugin nodes, environment without LD_LIBRARY_PATH."""
    from tests.backends.test_tensorrt import plugin_chain_model

    model = tmp_path / "chain.onnx"
    onnx.save(plugin_chain_model(), model)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "MOGRAPH_TRT_LIB_FIX")}
    cmd = [sys.executable, "-m", "mograph", "build", str(model), "-o", str(tmp_path / "chain.engine"), "--json"]
    proc = subprocess.run(
        [*cmd, "--profile", "x:1x64,8x64,64x64"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert [p["plugin"] for p in data["plugin_layers"]] == ["LayerNorm", "Gelu"]
    assert (tmp_path / "chain.engine").stat().st_size == data["engine_bytes"]


@needs_trt
def test_build_lists_ops_tensorrt_cannot_take(tmp_path, capsys):
    from tests.backends.test_tensorrt import unknown_op_model

    model = tmp_path / "unknown.onnx"
    onnx.save(unknown_op_model(), model)
    code = main(["build", str(model), "-o", str(tmp_path / "u.engine"), "--json"])
    captured = capsys.readouterr()
    assert code == 3
    data = json.loads(captured.out)
    assert {u["op"] for u in data["unsupported"]} >= {"MographNoSuchOp", "NotAnOnnxOp"}
    assert "TensorRT could not take" in captured.err
    assert not (tmp_path / "u.engine").exists()


# ------------------------------------------------------------------------------------------- validate


@pytest.mark.skipif(trt_backend.gpu_status()[0], reason="this machine has a GPU")
def test_validate_tensorrt_says_plainly_it_cannot(bert_path, capsys):
    code = main(["validate", str(bert_path), "--backend", "tensorrt", *PROFILES])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 7
    assert len(err) == 1 and err[0].startswith("mograph: error: cannot run TensorRT engines on this machine: ")
    if HAVE_TRT and _trt_loader.is_rtx(_trt_loader.import_trt()):
        assert "can build engines ahead of time here, but running one needs an NVIDIA GPU" in err[0]


def test_validate_ort_optimized_against_unoptimized(bert_path, capsys):
    pytest.importorskip("onnxruntime")
    code = main(
        [
            "validate",
            str(bert_path),
            "--backend",
            "ort",
            "--shape",
            "input_ids:2x16",
            "--shape",
            "attention_mask:2x16",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(captured.out)
    assert data["passed"] is True and data["feeds"] == {"input_ids": [2, 16], "attention_mask": [2, 16]}
    out = data["outputs"]["last_hidden_state"]
    assert out["passed"] and out["max_abs"] < 1e-3 and out["cosine"] > 0.9999


def test_validate_ort_reports_drift(bert_path, tmp_path, capsys):
    """--reference against a different model: outputs differ, exit 5, the per-output figures still printed."""
    pytest.importorskip("onnxruntime")
    from models.builders import bert_tiny

    other = tmp_path / "other.onnx"
    onnx.save(bert_tiny(seed=1), other)
    code = main(["validate", str(bert_path), "--backend", "ort", "--reference", str(other)])
    captured = capsys.readouterr()
    assert code == 5
    assert "last_hidden_state: FAILED" in captured.out and "differs from" in captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "nope"], "unknown backend 'nope'; available: "),
        (["--backend", "ort", "--profile", "input_ids:1x4,2x16,4x64"], "--profile applies to --backend tensorrt only"),
        (["--backend", "ort", "--engine", "x.engine"], "--engine applies to backends that build artifacts"),
    ],
)
def test_validate_usage_errors(bert_path, capsys, args, message):
    code = main(["validate", str(bert_path), *args])
    assert code == 2 and message in capsys.readouterr().err
