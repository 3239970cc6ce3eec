"""The precision recipe per device: the table decides, the CLI and the API take the same --device, slow precisions warn."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from mograph.passes.quant import recipe as rc
from onnx import helper, numpy_helper

import mograph
from mograph.cli import main
from mograph.errors import OptionError
from mograph.testing import op_counts, run_ort, to_proto

K, N = 256, 128


def residual_mlp(seed: int = 0) -> onnx.ModelProto:
    """x -> LayerNorm -> MatMul -> Relu -> MatMul -> + x -> MatMul (the output projection)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    w3 = (rng.standard_normal((K, 64)) * 0.05).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "g", "b"], ["xn"], axis=-1, name="ln"),
         helper.make_node("MatMul", ["xn", "W1"], ["h"], name="fc1"),
         helper.make_node("Relu", ["h"], ["hr"], name="relu"),
         helper.make_node("MatMul", ["hr", "W2"], ["o"], name="fc2"),
         helper.make_node("Add", ["o", "x"], ["r"], name="residual"),
         helper.make_node("MatMul", ["r", "W3"], ["y"], name="head")],
        "mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", "S", K])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", "S", 64])],
        [numpy_helper.from_array(np.ones(K, np.float32), "g"), numpy_helper.from_array(np.zeros(K, np.float32), "b"),
         numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(w3, "W3")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_table_picks_per_device():
    r = rc.resolve(["cleanup", "int4"], {}, "cuda")
    assert r.passes == ["cleanup", "weight-only", "fp16"]
    assert r.options == {"bits": 4, "target": "ort", "output_projection": "float",
                         "embedding_precision": "bits",  # the table quantized: size measured, GPU speed not
                         "block_size": 32, "symmetric": True}  # measured on whole decoders (rc.LAYOUT)
    assert r.decisions[0]["lowering"] == "nbits4"
    assert r.decisions[0]["ratios_to_float"] == rc.lowering_ratios("cuda", "nbits4") == (0.781, 1.26, 1.078)
    r8 = rc.resolve(["int8"], {}, "cuda:1")
    assert r8.passes == ["weight-only", "fp16"] and r8.options["bits"] == 8
    assert "INT8 activations not used" in r8.decisions[0]["reason"] and "MatMulInteger" in r8.decisions[0]["reason"]
    assert not r8.warnings
    # CPU: today's recipe, since the table measures it faster there
    assert rc.resolve(["int4"], {}, "cpu").passes == ["int4"]
    assert rc.resolve(["int8"], {}, "cpu").passes == ["qdq-int8"]
    # TensorRT keeps explicit Q/DQ; nothing is redirected to MatMulNBits
    trt = rc.resolve(["int8"], {"target": "tensorrt"}, "cuda")
    assert trt.passes == ["int8"] and trt.options == {"target": "tensorrt"}
    # no quantization preset: nothing changes, no option is added
    assert rc.resolve(["cleanup", "fuse"], {}, "cuda").options == {}


def test_cuda_recipe_line_says_where_whole_models_are_smaller_not_faster(monkeypatch):
    """The measured whole-model ratios (rc.WHOLE_MODELS) are in the decision's line and record; a device without
    such rows gets none."""
    r8 = rc.resolve(["int8"], {}, "cuda")
    assert r8.decisions[0]["whole_models"] == rc.WHOLE_MODELS["cuda"]["int8"]
    assert "whole models measured: BERT-base" in r8.decisions[0]["reason"]
    assert "smaller, not faster" in r8.decisions[0]["reason"]
    monkeypatch.setattr(rc, "WHOLE_MODELS", {})
    r8 = rc.resolve(["int8"], {}, "cuda")
    assert r8.decisions[0]["whole_models"] == [] and "whole models" not in r8.decisions[0]["reason"]


def test_runtime_options_are_reported_not_set(monkeypatch):
    """A measured ONNX Runtime session setting (fpA_intB) is named in the cuda decisions and the report with its
    figures; it is never written into the options, and a device without such rows gets no line."""
    opt = rc.RUNTIME_OPTIONS["cuda"]["fpa_intb"]
    table = opt["kernel_ms"]
    assert all(len(v) == len(table["m"]) for v in table.values())
    # the data says where it pays: fewer ms at M=8, more at M=512, for both bit widths
    for lw in ("nbits4_b32", "nbits8_b32"):
        at = dict(zip(table["m"], zip(table[lw], table[lw + "+fpa"])))
        assert at[8][1] < at[8][0] and at[512][1] > at[512][0]
    for precision in ("int4", "int8"):
        r = rc.resolve([precision], {}, "cuda")
        reason = r.decisions[0]["reason"]
        assert "ep.cuda.fpa_intb_gemm=1" in reason and "not set by mograph" in reason
        assert "ep.cuda.fpa_intb_gemm" not in json.dumps(r.options)
        assert r.to_dict()["runtime_options"]["fpa_intb"]["session_config"] == {"ep.cuda.fpa_intb_gemm": "1"}
    assert "runtime option" not in rc.resolve(["int8"], {}, "cpu").decisions[0]["reason"]
    assert "runtime_options" not in rc.resolve(["int8"], {}, "cpu").to_dict()
    monkeypatch.setattr(rc, "RUNTIME_OPTIONS", {})
    assert "runtime option" not in rc.resolve(["int4"], {}, "cuda").decisions[0]["reason"]


def test_the_data_decides(monkeypatch):
    """Change the measured figures and the choice follows: 8-bit MatMulNBits measured fastest on the CPU wins int8."""
    table = json.loads(json.dumps(rc.KERNELS))
    table["cpu"]["ms"]["nbits8"] = [0.01, 1.0]
    monkeypatch.setattr(rc, "KERNELS", table)
    r = rc.resolve(["int8"], {}, "cpu")
    assert r.passes == ["weight-only"] and r.options == {"bits": 8}
    # and the CUDA int8 choice falls to INT8 activations if those were measured faster
    table["cuda"]["ms"]["matmulinteger"] = [0.001, 0.001, 0.001]
    assert rc.best_lowering("cuda", "int8")[0] == "matmulinteger"


def test_slow_precisions_warn_with_figures_and_alternatives():
    r = rc.resolve(["qdq-fp8"], {}, "cuda")
    assert r.passes == ["qdq-fp8"] and len(r.warnings) == 1
    line = r.warnings[0]
    assert "\n" not in line and "GemmFloat8" in line and "0.204 vs 0.032 ms" in line and "--target tensorrt" in line
    r = rc.resolve(["qdq-int8"], {}, "cuda")
    assert len(r.warnings) == 1 and "MatMulInteger" in r.warnings[0] and "Q/DQ A8W8" in r.warnings[0]
    assert not rc.resolve(["qdq-int8"], {}, "cpu").warnings  # faster than float32 on the CPU
    assert not rc.resolve(["qdq-fp8"], {"target": "tensorrt"}, "cuda").warnings


def test_refusals():
    with pytest.raises(ValueError, match="one --bits"):
        rc.resolve(["int4", "int8"], {}, "cuda")
    with pytest.raises(ValueError, match="contradicts"):
        rc.resolve(["int4"], {"bits": 8}, "cuda")
    with pytest.raises(OptionError, match="--device tpu"):
        mograph.optimize(residual_mlp(), "int4", device="tpu")


def test_api_int4_for_cuda_writes_matmulnbits_with_fp16_activations():
    proto = residual_mlp()
    model, report = mograph.optimize(proto, "int4", device="cuda", options={"calibration_random": 4})
    out = model if isinstance(model, onnx.ModelProto) else to_proto(model)
    counts = op_counts(mograph.load(out))
    assert counts["com.microsoft.MatMulNBits"] == 2 if "com.microsoft.MatMulNBits" in counts else counts["MatMulNBits"] == 2
    assert [p.name for p in report.passes][:3] == ["weight-only", "fp16", "lower"]
    nbits = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    inits = {i.name: i for i in out.graph.initializer}
    assert all(inits[n.input[2]].data_type == onnx.TensorProto.FLOAT16 for n in nbits)  # fp16 scales: fp16 A
    assert all(inits[n.input[1]].data_type == onnx.TensorProto.UINT8 for n in nbits)
    head = [n for n in out.graph.node if n.op_type == "MatMul"]
    assert len(head) == 1 and inits[head[0].input[1]].data_type == onnx.TensorProto.FLOAT16  # LM head float16
    rec = report.to_dict()["recipe"]
    assert rec["device"] == "cuda" and rec["passes"] == ["weight-only", "fp16"] and rec["decisions"][0]["lowering"] == "nbits4"
    # the numbers: ORT CPU runs the fp16 MatMulNBits graph; 4-bit weights and fp16 stay close to float32
    x = {"x": np.random.default_rng(3).standard_normal((2, 5, K)).astype(np.float32)}
    ref, got = run_ort(proto, x)[0], run_ort(out, x)[0]
    cos = float((ref * got).sum() / np.linalg.norm(ref) / np.linalg.norm(got))
    assert cos > 0.99, cos


def test_api_without_device_is_unchanged():
    _, report = mograph.optimize(residual_mlp(), "int4")
    assert [p.name for p in report.passes][0] == "weight-only" and "fp16" not in [p.name for p in report.passes]
    assert "recipe" not in report.to_dict()


def test_cli_device_without_gpu_and_warning(tmp_path, capsys, caplog):
    src = tmp_path / "m.onnx"
    onnx.save(residual_mlp(), src)
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    code = main(["optimize", str(src), "--passes", "int4", "--device", "cuda", "--calibration-random", "2",
                 "-o", str(out), "--report", str(rep)])
    text = capsys.readouterr().out
    assert code == 0 and "recipe (cuda): int4 -> weight-only,fp16" in text
    assert "recipe (cuda): not set, your session's choice: ep.cuda.fpa_intb_gemm=1" in text  # measured, not written
    data = json.loads(rep.read_text())
    assert data["recipe"]["runtime_options"]["fpa_intb"]["session_config"] == {"ep.cuda.fpa_intb_gemm": "1"}
    assert data["pipeline"][:3] == ["weight-only", "fp16", "lower"] and data["recipe"]["device"] == "cuda"
    assert sum(n.op_type == "MatMulNBits" for n in onnx.load(out).graph.node) == 2
    out2, rep2 = tmp_path / "o2.onnx", tmp_path / "r2.json"
    with caplog.at_level(logging.WARNING):
        code = main(["optimize", str(src), "--passes", "qdq-fp8", "--device", "cuda", "--calibration-random", "2",
                     "-o", str(out2), "--report", str(rep2)])
    assert code == 0 and "your session's choice" not in capsys.readouterr().out  # qdq-fp8 writes no MatMulNBits
    warned = [r.getMessage() for r in caplog.records if "qdq-fp8 on ONNX Runtime CUDA is measured slower" in r.getMessage()]
    assert len(warned) == 1
    assert json.loads(rep2.read_text())["recipe"]["warnings"] == warned


def test_cuda_int4_layout_is_the_measured_one_unless_the_user_says():
    """Blocks of 32 without zero points for the cuda recipe's 4-bit weights (the kernels ONNX Runtime runs fastest
    on whole decoders, rc.LAYOUT); the user's --block-size / --symmetric win; int8 and the CPU keep the defaults."""
    r = rc.resolve(["int4"], {}, "cuda")
    assert (r.options["block_size"], r.options["symmetric"]) == (32, True)
    assert r.to_dict()["layout"]["block_size"] == 32 and "zero points" in r.to_dict()["layout"]["reason"]
    mine = rc.resolve(["int4"], {"block_size": 128, "symmetric": False}, "cuda")
    assert (mine.options["block_size"], mine.options["symmetric"]) == (128, False)
    assert "block_size" not in rc.resolve(["int8"], {}, "cuda").options  # 8-bit: not measured, the pass's default
    assert "block_size" not in rc.resolve(["int4"], {}, "cpu").options
    assert "block_size" not in rc.resolve(["int4"], {"target": "tensorrt"}, "cuda").options


def test_api_cuda_int4_writes_blocks_of_32_without_zero_points():
    proto = residual_mlp()
    model, report = mograph.optimize(proto, "int4", device="cuda", options={"calibration_random": 4})
    out = model if isinstance(model, onnx.ModelProto) else to_proto(model)
    nbits = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 and all({a.name: a.i for a in n.attribute}["block_size"] == 32 for n in nbits)
    assert all(len([i for i in n.input if i]) == 3 for n in nbits)  # A, B, scales: no zero points
    assert report.to_dict()["recipe"]["layout"]["symmetric"] is True
    x = {"x": np.random.default_rng(3).standard_normal((2, 5, K)).astype(np.float32)}
    ref, got = run_ort(proto, x)[0], run_ort(out, x)[0]
    cos = float((ref * got).sum() / np.linalg.norm(ref) / np.linalg.norm(got))
    assert cos > 0.99, cos
    # near miss: the user's layout is kept (blocks of 128 with zero points)
    model2, _ = mograph.optimize(proto, "int4", device="cuda",
                                 options={"calibration_random": 4, "block_size": 128, "symmetric": False})
    out2 = model2 if isinstance(model2, onnx.ModelProto) else to_proto(model2)
    nbits2 = [n for n in out2.graph.node if n.op_type == "MatMulNBits"]
    assert all({a.name: a.i for a in n.attribute}["block_size"] == 128 and len(n.input) == 4 for n in nbits2)
