"""``tools/bench_llm.py``'s ``from:VARIANT:nbitsB`` variants and ``tools/bench_precision.py``'s bookkeeping:
parsing, ONNX Runtime's MatMulNBitsQuantizer on a small float16 graph, sizes and the Markdown table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llm():
    return _load("bench_llm")


@pytest.fixture(scope="module")
def prec(llm):
    return _load("bench_precision")


def test_nbits_specs(llm):
    assert llm.parse_nbits("nbits4") == {"bits": 4, "block": 128, "symmetric": False, "accuracy_level": None}
    assert llm.parse_nbits("nbits8:block=32,sym,acc=4") == {"bits": 8, "block": 32, "symmetric": True,
                                                            "accuracy_level": 4}
    for bad in ("nbits3", "int4", "nbits4:block=x", "nbits4:foo"):
        with pytest.raises(ValueError):
            llm.parse_nbits(bad)
    assert llm.parse_variant("q=from:base:nbits4:block=32,sym") == ("q", "from", "base", "nbits4:block=32,sym")
    with pytest.raises(SystemExit):
        llm.parse_variant("q=from:base:nbits5")
    args = argparse.Namespace(variant=["base=ts:cleanup", "q=from:base:nbits4"])
    assert llm._variant_base(args, "q-decode") == "base-decode"
    assert llm._variant_base(args, "base-decode") == "" and llm._variant_export(args, "q-decode") == ""


def test_prepare_refuses_a_from_variant_without_its_base(llm, tmp_path):
    with pytest.raises(SystemExit, match="not a ts/dynamo"):
        llm.main(["prepare", "--models", "tiny", "--cache", str(tmp_path), "--no-builder",
                  "--variant", "q=from:missing:nbits4"])
    assert not (tmp_path / "tiny").exists()


def test_ort_nbits_on_a_float16_graph(llm, prec, tmp_path):
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 64)).astype(np.float16)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 64])
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y],
                                                [numpy_helper.from_array(w, "w")]),
                              opset_imports=[helper.make_opsetid("", 17)])
    src = tmp_path / "a" / "model.onnx"
    src.parent.mkdir()
    onnx.save(model, str(src))
    out = tmp_path / "b" / "model.onnx"
    llm.ort_nbits(src, out, **llm.parse_nbits("nbits8:block=32"))
    facts = prec.graph_facts(out)
    assert facts["matmulnbits_bits"] == {"8": 1} and facts["matmul"] == 0
    # the external data file is counted: about a byte per weight, against two in the source
    assert facts["bytes"] == sum(p.stat().st_size for p in out.parent.iterdir())
    assert facts["bytes"] < prec.graph_facts(src)["bytes"] * 0.7
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    xv = rng.standard_normal((2, 256)).astype(np.float16)
    got = sess.run(None, {"x": xv})[0].astype(np.float32)
    want = xv.astype(np.float32) @ w.astype(np.float32)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_markdown_ratios_and_goal(prec, tmp_path, capsys):
    rows = [{"model": "bert-base", "device": "cuda", "variant": v, "cell": "size", "bytes": b, "matmulnbits_bits": {},
             "matmul": 0, "int8_ops": {}} for v, b in (("fp16", 200), ("int8-wo", 110))]
    rows += [{"model": "bert-base", "device": "cuda", "variant": v, "cell": "8x128", "mode": "plain",
              "median_ms": t, "cosine": 0.9999} for v, t in (("fp16", 2.0), ("int8-wo", 2.2))]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prec.main(["markdown", "--out", str(path)]) == 0
    text = capsys.readouterr().out
    assert "| 8x128 | plain | 2.000 | 2.200 | **1.10** | 0.99990 |" in text
    assert "| int8-wo | 0.0 | 0.550 |" in text
    assert "worst time 1.10x, size 0.550x: **not met**" in text
