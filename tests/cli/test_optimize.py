"""``mograph optimize``: where it writes (folders, failed verification), what ``-q`` prints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

import mograph
from models.builders import make_model
from mograph.cli import main
from mograph.plugins import get_registry

IO = ([("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])


def _good() -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    return make_model(nodes, *IO, {"w": np.ones((2, 3), np.float32)})


class _ScaleWeightsPass(mograph.Pass):
    """Multiply every float initializer by 3 (deliberately wrong, to fail verification)."""

    name = "test-scale-weights"

    def call(self, model: ir.Model) -> mograph.PassResult:
        for value in model.graph.initializers.values():
            value.const_value = ir.tensor(value.const_value.numpy() * np.float32(3.0))
        return mograph.PassResult(modified=True, stats={"scaled": len(model.graph.initializers)})


@pytest.fixture
def scale_pass(monkeypatch):
    reg = get_registry()
    monkeypatch.setitem(reg.passes, _ScaleWeightsPass.name, _ScaleWeightsPass)
    monkeypatch.setitem(reg.pass_source, _ScaleWeightsPass.name, "tests")


@pytest.fixture
def work(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    onnx.save(_good(), folder / "good.onnx")
    return folder


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_output_into_a_missing_folder_is_refused(capsys, work):
    before = _listing(work)
    code, out, err = _cli(capsys, "optimize", str(work / "good.onnx"), "-o", str(work / "nope" / "o.onnx"))
    assert code == 2
    assert err.splitlines() == [
        f"mograph: error: -o {work / 'nope' / 'o.onnx'}: folder {work / 'nope'} does not exist; create it first"
    ]
    assert not (work / "nope").exists() and _listing(work) == before and out == ""


def test_the_default_output_beside_the_input_needs_no_flag(capsys, work):
    code, _, err = _cli(capsys, "optimize", str(work / "good.onnx"), "-q")
    assert code == 0, err
    assert (work / "good.opt.onnx").exists()


def test_report_into_a_missing_folder_is_refused_before_any_work(capsys, work):
    before = _listing(work)
    report = work / "reports" / "r.json"
    code, _, err = _cli(capsys, "optimize", str(work / "good.onnx"), "-o", str(work / "o.onnx"), "--report", str(report))
    assert code == 2
    assert err.splitlines() == [f"mograph: error: --report {report}: folder {work / 'reports'} does not exist; create it first"]
    assert _listing(work) == before  # the model was not written either


def test_quiet_prints_nothing_on_success(capsys, work):
    code, out, err = _cli(capsys, "optimize", str(work / "good.onnx"), "-o", str(work / "o.onnx"), "-q")
    assert (code, out, err) == (0, "", "")
    assert (work / "o.onnx").exists()
    code, out, _ = _cli(capsys, "optimize", str(work / "good.onnx"), "-o", str(work / "o2.onnx"))
    assert code == 0 and "wrote" in out and "pass" in out.splitlines()[0]


def test_quiet_still_prints_errors(capsys, work):
    code, out, err = _cli(capsys, "optimize", str(work / "good.onnx"), "-o", str(work / "o.onnx"), "-q", "--passes", "nope")
    assert code == 2 and out == "" and "unknown pass or preset 'nope'" in err


@pytest.mark.parametrize("mode", ["end", "each"])
def test_a_model_that_fails_verification_is_kept_as_failed(capsys, work, scale_pass, mode):
    out, report = work / "o.onnx", work / "r.json"
    code, stdout, err = _cli(
        capsys, "optimize", str(work / "good.onnx"), "-o", str(out), "--passes", "test-scale-weights",
        "--verify", mode, "--report", str(report), "-q",
    )
    assert code == 5
    failed = work / "o.failed.onnx"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mograph: error: ")
    assert f"kept for inspection: model {failed}, report {report}" in lines[0]
    assert not out.exists() and failed.exists() and stdout == ""
    kept = onnx.load(failed)
    w = next(t for t in kept.graph.initializer if t.name == "w")
    assert np.allclose(onnx.numpy_helper.to_array(w), 3.0)  # the model as the pipeline left it
    data = json.loads(report.read_text())
    assert data["verification"]["passed"] is False
    assert data["verification"]["outputs"]["y"]["max_abs"] > 0
    assert data["output"] == str(failed)


def test_a_failed_verification_without_report_keeps_the_model(capsys, work, scale_pass):
    code, _, err = _cli(
        capsys, "optimize", str(work / "good.onnx"), "--passes", "test-scale-weights", "--verify", "-q"
    )
    assert code == 5
    assert (work / "good.opt.failed.onnx").exists() and not (work / "good.opt.onnx").exists()
    assert f"kept for inspection: model {work / 'good.opt.failed.onnx'})" in err


def test_help_shows_yes_no_defaults_as_a_user_writes_them():
    import argparse

    from mograph.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["optimize"].format_help().split())
    assert "--fp16-io yes|no" in text and "[fp16; default: no]" in text
    assert "default: True" not in text and "default: False" not in text


def test_an_option_no_pass_reads_warns_and_strict_refuses(tmp_path, capsys, caplog):
    src = tmp_path / "m.onnx"
    onnx.save(_good(), str(src))
    with caplog.at_level("WARNING", logger="mograph"):
        code = main(["optimize", str(src), "-o", str(tmp_path / "a.onnx"), "--passes", "cleanup", "--ratio", "0.5"])
    assert code == 0 and "'ratio' (read by prune-structured); ignored" in caplog.text
    code = main(["optimize", str(src), "-o", str(tmp_path / "b.onnx"), "--passes", "cleanup", "--ratio", "0.5",
                 "--strict"])
    err = capsys.readouterr().err
    assert code == 2 and "no pass of the pipeline" in err and "'ratio' (read by prune-structured)" in err
    assert not (tmp_path / "b.onnx").exists()
    caplog.clear()
    with caplog.at_level("WARNING", logger="mograph"):  # --shape also sizes verification feeds: never warned about
        code = main(["optimize", str(src), "-o", str(tmp_path / "c.onnx"), "--passes", "cleanup", "--shape", "x:2x3",
                     "--strict"])
    assert code == 0 and "reads" not in caplog.text


def test_validate_defaults_to_a_backend_that_runs_here(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("polygraphy")
    src = tmp_path / "m.onnx"
    onnx.save(_good(), str(src))
    code = main(["validate", str(src), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["backend"] == "ort"


def test_fp16_report_lists_each_float32_node_with_its_measured_reason(tmp_path, capsys):
    """Issue 31 item 1: the report names every node the fp16 pass kept in float32 and why (measured), and the
    written model runs exactly those in float32."""
    nodes = [helper.make_node("Sub", ["x", "c"], ["d"], name="sub"),  # x near 1000: float16 steps of 0.5
             helper.make_node("Mul", ["d", "k"], ["e"], name="mul"),
             helper.make_node("Relu", ["e"], ["y"], name="relu"),
             helper.make_node("Mul", ["x", "k"], ["z"], name="big")]  # |x * 100| ~ 1e5 > 65504
    proto = make_model(nodes, [("x", np.float32, ["n", 8])], [("y", np.float32, ["n", 8]), ("z", np.float32, ["n", 8])],
                       {"c": np.array(1000.0, np.float32), "k": np.array(100.0, np.float32)})
    onnx.save(proto, tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    x = (1000 + rng.standard_normal((4, 1, 8))).astype(np.float32)  # 4 samples of [1, 8]
    np.savez(tmp_path / "calib.npz", x=x)
    np.savez(tmp_path / "feeds.npz", x=x[0])
    code, _, err = _cli(capsys, "optimize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"), "--passes",
                        "fp16", "--calibration-data", str(tmp_path / "calib.npz"), "--feeds",
                        str(tmp_path / "feeds.npz"), "--report", str(tmp_path / "r.json"))
    assert code == 0, err
    fp16 = next(p for p in json.loads((tmp_path / "r.json").read_text())["passes"] if p["name"] == "fp16")
    kept = fp16["details"]["kept_fp32"]
    assert [(e["node"], e["op"]) for e in kept] == [("sub", "Sub"), ("big", "Mul")]
    assert kept[0]["reason"].startswith("measured sensitivity: local float16 error ")
    assert kept[1]["reason"].startswith("measured overflow: the float16 result is not finite where float32 reaches")
    assert fp16["stats"]["kept_fp32"] == len(kept) and fp16["stats"]["converted"] == 2
    plan = {e["node"]: e["precision"] for e in fp16["details"]["plan"]["nodes"]}
    assert plan == {"sub": "fp32", "mul": "fp16", "relu": "fp16", "big": "fp32"}
    out = onnx.shape_inference.infer_shapes(onnx.load(tmp_path / "out.onnx"))
    types = {v.name: v.type.tensor_type.elem_type for v in [*out.graph.value_info, *out.graph.output]}
    float32_outputs = {n.name for n in out.graph.node if types.get(n.output[0]) == onnx.TensorProto.FLOAT
                       and n.op_type != "Cast"}
    assert float32_outputs == {"sub", "big"}


def test_fix_shapes_dim_sizes_the_verification_feeds(tmp_path, capsys):
    """``fix-shapes --dim N=2 --verify`` (a paddle2onnx text model, batch named ``DynamicDimension.0``): the
    feeds were made at batch 1 from the dynamic original, the pinned model refused them and a right rewrite
    failed with exit 5.  The pinned sizes make the feeds, as ``--shape`` does."""
    nodes = [helper.make_node("Add", ["x", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])],
                              [onnx.numpy_helper.from_array(np.ones(3, np.float32), "w")])
    src = tmp_path / "dyn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    out = tmp_path / "pinned.onnx"
    code, text, err = _cli(capsys, "optimize", str(src), "-o", str(out), "--passes", "fix-shapes", "--dim", "N=2",
                           "--verify")
    assert code == 0, err
    assert "verify: passed" in text and "x 2x3" in text
    assert [d.dim_value for d in onnx.load(out).graph.input[0].type.tensor_type.shape.dim] == [2, 3]
