"""The example third-party plugin, installed the way a user installs it, works from the CLI and Python.

``plugins/mograph-example-plugin`` is built and installed with pip into a temporary ``--target`` folder
(offline: no dependencies, no build isolation, when setuptools is at hand).  The test environment itself
is left as it was: the folder goes on ``PYTHONPATH`` of the ``mograph`` console script run in a
subprocess, and on ``sys.path`` only for the duration of the in-process tests (the plugin's modules
and mograph's registry cache are dropped afterwards).  mograph must find the plugin through its entry
point, list its pass under the plugin's name, run it, offer its option as a flag, block it on request,
and the plugin's own test-suite must pass against this mograph.  Its custom op (``example.BetaSwish``) and
backend (``example-ref``) go through the same doors as the built-in ones: ``optimize`` fuses into the op,
``bench``, ``validate``, ``diff`` and ``build`` run on the backend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from models.builders import make_model

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "plugins" / "mograph-example-plugin"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """Install the plugin into a temporary folder; return that folder (for PYTHONPATH)."""
    work = tmp_path_factory.mktemp("example-plugin")
    source = work / "source"  # pip builds in the source tree: build a copy, never the checkout
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache"))
    target = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    if importlib.util.find_spec("setuptools") is not None:
        cmd += ["--no-build-isolation", "--no-index"]  # fully offline
    proc = subprocess.run([*cmd, str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert list(target.glob("mograph_example_plugin-*.dist-info/entry_points.txt"))
    return target


@pytest.fixture
def in_process(plugin_path, monkeypatch):
    """The installed plugin visible to this process, for one test."""
    from mograph import plugins

    monkeypatch.syspath_prepend(str(plugin_path))
    monkeypatch.delenv(plugins.BLOCK_ENV, raising=False)
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    importlib.invalidate_caches()
    plugins.reset()
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "mograph_example_plugin"]:
        del sys.modules[name]
    plugins.reset()


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from mograph.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _env(plugin_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MOGRAPH_BLOCK_PLUGINS", "MOGRAPH_DISABLE_PLUGIN_AUTOLOAD")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_path), env.get("PYTHONPATH", "")) if p)
    return env


def _mograph(plugin_path: Path, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mograph", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(plugin_path), timeout=300, **kwargs)


def _transposes_model(path: Path) -> onnx.ModelProto:
    """Relu -> (Transpose, Transpose: cancel) -> Sigmoid -> (Transpose, Transpose: merge) -> y."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Transpose", ["r"], ["a"], perm=[0, 2, 1]),
        helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1]),
        helper.make_node("Sigmoid", ["b"], ["s"]),
        helper.make_node("Transpose", ["s"], ["c"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["c"], ["y"], perm=[0, 2, 1]),
    ]
    proto = make_model(nodes, [("x", np.float32, [2, 3, 4])], [("y", np.float32, None)])
    onnx.save(proto, path)
    return proto


def _ort(path_or_proto, x: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = path_or_proto.SerializeToString() if isinstance(path_or_proto, onnx.ModelProto) else str(path_or_proto)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_not_installed_in_this_environment():
    # The install goes to a private folder; only the source checkout may be importable here.
    spec = importlib.util.find_spec("mograph_example_plugin")
    assert spec is None or str(PLUGIN) in str(spec.origin)


def test_passes_lists_the_plugin_pass_and_preset(plugin_path):
    proc = _mograph(plugin_path, "passes", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    listed = {p["name"]: p for p in data["passes"]}
    assert listed["remove-double-transpose"]["plugin"] == "example"
    assert listed["remove-double-transpose"]["summary"].startswith("Remove back-to-back Transposes")
    assert [o["name"] for o in listed["remove-double-transpose"]["options"]] == ["transpose-merge"]
    assert data["presets"]["simplify-transposes"] == {
        "expands_to": ["remove-double-transpose", "eliminate-dead", "topo-sort"],
        "plugin": "example",
    }


def test_optimize_runs_the_plugin_pass(plugin_path, tmp_path):
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    _transposes_model(src)
    proc = _mograph(plugin_path, "optimize", str(src), "-o", str(out), "--passes", "remove-double-transpose", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["pipeline"] == ["remove-double-transpose"]
    assert report["passes"][0]["stats"] == {"cancelled_pairs": 1, "merged_pairs": 1}
    saved = onnx.load(str(out))
    assert [n.op_type for n in saved.graph.node] == ["Relu", "Sigmoid", "Transpose"]
    provenance = {p.key: p.value for p in saved.graph.node[2].metadata_props}
    assert provenance["mograph.pass"] == "remove-double-transpose"
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(_ort(out, x), _ort(src, x))


def test_plugin_option_is_a_command_line_flag(in_process, capsys, tmp_path):
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    _transposes_model(src)
    args = ["optimize", str(src), "-o", str(out), "--passes", "remove-double-transpose", "--json"]
    code, stdout, err = _cli(capsys, *args, "--transpose-merge", "no")
    assert code == 0, err
    assert json.loads(stdout)["passes"][0]["stats"] == {"cancelled_pairs": 1, "merged_pairs": 0}
    code, _, err = _cli(capsys, *args[:-1], "--transpose-merge", "maybe")
    assert code == 2
    assert err.splitlines() == [
        "mograph: error: remove-double-transpose: bad value for --transpose-merge: 'maybe' (expected yes or no)"
    ]


def test_blocked_plugin_pass_is_unknown(in_process, capsys, tmp_path):
    src = tmp_path / "m.onnx"
    _transposes_model(src)
    code, _, err = _cli(capsys, "optimize", str(src), "--passes", "remove-double-transpose", "--block-plugin", "example")
    assert code == 2
    assert "unknown pass or preset 'remove-double-transpose'" in err
    assert not (tmp_path / "m.opt.onnx").exists()


def test_python_api_runs_the_plugin_preset(in_process, plugin_path, tmp_path):
    import mograph

    src = tmp_path / "m.onnx"
    proto = _transposes_model(src)
    model, report = mograph.optimize(str(src), passes="simplify-transposes")
    assert [n.op_type for n in model.graph] == ["Relu", "Sigmoid", "Transpose"]
    assert [p.name for p in report.passes] == ["remove-double-transpose", "eliminate-dead", "topo-sort"]
    assert report.passes[0].stats == {"cancelled_pairs": 1, "merged_pairs": 1}
    assert sys.modules["mograph_example_plugin"].__file__.startswith(str(plugin_path))  # the installed copy
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    out = tmp_path / "api.onnx"
    mograph.save(model, str(out))
    np.testing.assert_array_equal(_ort(out, x), _ort(proto, x))


@pytest.mark.slow
def test_the_plugin_own_tests_pass(plugin_path, tmp_path):
    """Its test-suite, run against the installed copy and this mograph."""
    tests = tmp_path / "plugin-tests"
    shutil.copytree(PLUGIN / "tests", tests, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tests)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(plugin_path), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


# --- the plugin's custom op and backend go through the same doors as the built-ins -----------------


def _silu_model(path: Path, seed: int = 0) -> onnx.ModelProto:
    """x -> SiLU (Sigmoid, Mul) -> MatMul(w) -> y, with a dynamic batch."""
    w = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Mul", ["x", "s"], ["a"]),
        helper.make_node("MatMul", ["a", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(proto, path)
    return proto


@pytest.fixture
def fused_model(in_process, capsys, tmp_path) -> tuple[Path, Path]:
    """(original, fused by the plugin's fuse-swish through `mograph optimize --verify`, the fused op kept with
    ``--target mograph``: the model the plugin's backend runs as it is)."""
    src, out = tmp_path / "silu.onnx", tmp_path / "silu.opt.onnx"
    _silu_model(src)
    code, stdout, err = _cli(capsys, "optimize", str(src), "-o", str(out), "--passes", "fuse-swish", "--target",
                             "mograph", "--verify", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["passes"][0]["stats"] == {"SwishFusion": 1} and report["verification"]["passed"] is True
    assert [p["name"] for p in report["passes"]] == ["fuse-swish", "lower"]
    return src, out


def test_passes_lists_the_plugin_custom_op_and_backend(plugin_path):
    proc = _mograph(plugin_path, "passes", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {p["name"]: p["plugin"] for p in data["passes"]}["fuse-swish"] == "example"
    assert data["custom_ops"]["example.BetaSwish"]["lowers_to"] == ["onnx", "ort"]
    backend = data["backends"]["example-ref"]
    assert backend["plugin"] == "example" and backend["available"] is True and backend["builds"] is True
    assert backend["target"] == "onnx"


def test_optimize_fuses_into_the_plugin_op(fused_model):
    src, out = fused_model
    saved = onnx.load(str(out))
    assert [(n.domain, n.op_type) for n in saved.graph.node] == [("example", "BetaSwish"), ("", "MatMul")]
    assert [(f.domain, f.name) for f in saved.functions] == [("example", "BetaSwish")]
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(_ort(out, x), _ort(src, x), rtol=1e-6, atol=1e-6)


def test_bench_runs_on_the_plugin_backend(fused_model, capsys):
    _, out = fused_model
    code, stdout, err = _cli(capsys, "bench", str(out), "--backend", "example-ref", "--json", "--warmup", "0",
                             "--iterations", "3", "--batch", "2")
    assert code == 0, err
    data = json.loads(stdout)
    assert data["backend"] == "example-ref" and data["iterations"] == 3 and data["batch"] == 2
    assert data["latency_ms"]["p50"] > 0 and data["feeds"]["x"]["shape"] == [2, 8]


def test_validate_compares_the_plugin_backend_with_onnx_runtime(fused_model, capsys):
    src, out = fused_model
    code, stdout, err = _cli(capsys, "validate", str(out), "--backend", "example-ref", "--json")
    assert code == 0, err
    data = json.loads(stdout)
    assert data["passed"] is True and data["backend"] == "example-ref" and data["target"] == "onnx"
    assert data["feeds"] == {"x": [1, 8]}
    entry = data["outputs"]["y"]
    # the float32 row of the table (its floor, 0.1 x rtol x the output's peak, is 1.03e-4 here)
    assert entry["passed"] and entry["max_abs"] < 1e-4 and entry["atol"] == pytest.approx(1e-4, rel=0.1)
    # Against another model as the reference, the same verdict fails: exit 5, figures still shown.
    other = src.parent / "other.onnx"
    _silu_model(other, seed=1)
    code, stdout, err = _cli(capsys, "validate", str(out), "--backend", "example-ref", "--reference", str(other))
    assert code == 5
    assert "y: FAILED" in stdout and "differs from" in err


def test_diff_runs_both_models_on_the_plugin_backend(fused_model, capsys, tmp_path):
    src, out = fused_model
    code, stdout, err = _cli(capsys, "diff", str(src), str(out), "--backend", "example-ref", "--json", "--shape", "x:4x8")
    assert code == 0, err
    data = json.loads(stdout)
    assert data["passed"] is True and data["backend"].startswith("backend 'example-ref'")
    other = tmp_path / "other.onnx"
    _silu_model(other, seed=1)
    code, _, _ = _cli(capsys, "diff", str(src), str(other), "--backend", "example-ref")
    assert code == 5


def test_build_writes_the_plugin_backend_artifact(fused_model, capsys):
    _, out = fused_model
    code, stdout, err = _cli(capsys, "build", str(out), "--backend", "example-ref", "--json")
    assert code == 0, err
    data = json.loads(stdout)
    artifact = out.parent / "silu.opt.ref.onnx"  # the backend's artifact_suffix
    assert data["output"] == str(artifact) and artifact.stat().st_size == data["artifact_bytes"]
    code, _, err = _cli(capsys, "build", str(out), "--backend", "ort")
    assert code == 2 and "unknown --backend 'ort' for build: it builds no artifact; backends that build:" in err


def test_target_lowers_the_plugin_op_through_its_lowering(in_process, capsys, tmp_path):
    """Needs the core ``lower`` step (``--target`` appends it to the pipeline): ``example.BetaSwish`` becomes
    standard ops through the plugin's own ``lowerings["ort"]``, exactly as a ``mograph.*`` op would."""
    src, out = tmp_path / "silu.onnx", tmp_path / "silu.ort.onnx"
    _silu_model(src)
    code, _, err = _cli(capsys, "optimize", str(src), "-o", str(out), "--passes", "fuse-swish", "--target", "ort", "-q")
    assert code == 0, err
    assert [n.op_type for n in onnx.load(str(out)).graph.node] == ["Sigmoid", "Mul", "MatMul"]
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(_ort(out, x), _ort(src, x), rtol=1e-6, atol=1e-6)


def test_fuse_swish_follows_the_manual_lower_is_appended(in_process, capsys, tmp_path):
    """``emits_custom_ops``: ``--passes fuse-swish`` gets the ``lower`` step (default target onnx), so no
    ``example.BetaSwish`` is left in the saved file; the op's function body came through ``ensure_functions``."""
    src, out = tmp_path / "silu.onnx", tmp_path / "silu.opt.onnx"
    _silu_model(src)
    code, stdout, err = _cli(capsys, "optimize", str(src), "-o", str(out), "--passes", "fuse-swish", "--json")
    assert code == 0, err
    names = [p["name"] for p in json.loads(stdout)["passes"]]
    assert names[:2] == ["fuse-swish", "lower"]
    saved = onnx.load(str(out))
    assert [n.op_type for n in saved.graph.node] == ["Sigmoid", "Mul", "MatMul"] and not saved.functions


def test_a_target_without_a_lowering_for_the_plugin_op_says_so(in_process, capsys, tmp_path):
    src, out = tmp_path / "silu.onnx", tmp_path / "silu.trt.onnx"
    _silu_model(src)
    code, stdout, err = _cli(capsys, "optimize", str(src), "-o", str(out), "--passes", "fuse-swish", "--target",
                             "tensorrt")
    assert code == 0, err
    assert "WARNING (lower): no lowering for target 'tensorrt' of example.BetaSwish x1 (declared by example)" in stdout
    assert [(n.domain, n.op_type) for n in onnx.load(str(out)).graph.node][0] == ("example", "BetaSwish")


def test_a_crash_in_the_plugin_pass_names_the_plugin_and_its_distribution(in_process, capsys, tmp_path, monkeypatch):
    import mograph_example_plugin

    def boom(self, model):
        raise ZeroDivisionError("plugin bug")

    monkeypatch.setattr(mograph_example_plugin.FuseSwishPass, "call", boom)
    src = tmp_path / "silu.onnx"
    _silu_model(src)
    code, _, err = _cli(capsys, "optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--passes", "fuse-swish", "-q")
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("mograph: error: internal error in pass 'fuse-swish' of plugin 'example' "
                           "(distribution mograph-example-plugin "), line
    assert "ZeroDivisionError: plugin bug" in line
