"""``mograph.profile.profile_model`` and ``mograph bench --profile``: where the time goes, on the CPU here,
and the decomposed LayerNorm / RMSNorm / GELU / attention subgraphs it reports, as the fusion passes' own
rules find them (``decomposed_candidates``, through the registry)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph.cli import main
from mograph.errors import UsageError
from mograph.plugins import BUILTIN_PLUGINS, get_registry
from mograph.profile import SCHEMA, _named_copy, decomposed_candidates, format_profile, profile_model

BERT = Path(__file__).resolve().parents[2] / "mograph" / "examples" / "bert-tiny.onnx"


@pytest.fixture(autouse=True)
def _only_core_plugins(monkeypatch):
    # the core, and the passes the profile asks what they would fuse (the cleanup preset, then the fusion rules)
    keep = ("mograph.passes.fusion", "mograph.passes.cleanup")
    monkeypatch.setenv("MOGRAPH_BLOCK_PLUGINS", ",".join(m for m in BUILTIN_PLUGINS
                                                         if m.startswith("mograph.passes") and m not in keep))
    monkeypatch.setenv("MOGRAPH_DISABLE_PLUGIN_AUTOLOAD", "1")


def find_decomposed(model: onnx.ModelProto) -> list[dict]:
    loaded = ir.serde.deserialize_model(model)
    _named_copy(loaded)  # as profile_model does: regions are listed by node name
    return decomposed_candidates(loaded, get_registry())


def _kinds(model: onnx.ModelProto) -> Counter:
    return Counter(c["kind"] for c in find_decomposed(model))


def _c(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=np.float32), name)


def _model(nodes, inits, out="y", shape=(2, 8)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_finder_on_bert_tiny_counts_each_layer():
    kinds = _kinds(onnx.load(str(BERT)))
    # 2 layers: 2 LayerNorms each plus the embeddings' one, one GELU and one attention each; the pooler's
    # Tanh is not a GELU (no cube of x before it)
    assert kinds == Counter({"LayerNorm": 5, "GELU": 2, "attention": 2})


def test_finder_tanh_gelu_rmsnorm_quickgelu_and_near_misses():
    tanh_gelu = [
        helper.make_node("Pow", ["x", "three"], ["x3"]),
        helper.make_node("Mul", ["x3", "k"], ["kx3"]),
        helper.make_node("Add", ["x", "kx3"], ["inner"]),
        helper.make_node("Mul", ["inner", "s"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["onep"]),
        helper.make_node("Mul", ["x", "onep"], ["xo"]),
        helper.make_node("Mul", ["xo", "half"], ["y"]),
    ]
    inits = [_c("three", 3.0), _c("k", 0.044715), _c("s", math.sqrt(2 / math.pi)), _c("one", 1.0), _c("half", 0.5)]
    assert _kinds(_model(tanh_gelu, inits)) == Counter({"GELU": 1})
    # near miss: x squared, not cubed, is not a GELU
    squared = [helper.make_node("Pow", ["x", "two"], ["x3"]), *tanh_gelu[1:]]
    assert _kinds(_model(squared, [*inits, _c("two", 2.0)])) == Counter()

    rms = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["n"]),
        helper.make_node("Mul", ["n", "w"], ["y"]),
    ]
    rms_inits = [_c("two", 2.0), _c("eps", 1e-6), numpy_helper.from_array(np.ones(8, np.float32), "w")]
    found = find_decomposed(_model(rms, rms_inits))
    assert [c["kind"] for c in found] == ["RMSNorm"] and len(found[0]["nodes"]) == 7
    # near miss: no Sqrt
    no_sqrt = [rms[0], rms[1], rms[2], helper.make_node("Reciprocal", ["mse"], ["inv"]), rms[5], rms[6]]
    assert _kinds(_model(no_sqrt, rms_inits)) == Counter()

    quick = [
        helper.make_node("Mul", ["x", "a"], ["ax"]),
        helper.make_node("Sigmoid", ["ax"], ["sg"]),
        helper.make_node("Mul", ["x", "sg"], ["y"]),
    ]
    assert _kinds(_model(quick, [_c("a", 1.702)])) == Counter({"GELU": 1})
    silu = [helper.make_node("Sigmoid", ["x"], ["sg"]), helper.make_node("Mul", ["x", "sg"], ["y"])]
    assert _kinds(_model(silu, [])) == Counter()  # SiLU is not a GELU


def _check_shape(prof: dict) -> None:
    assert prof["schema"] == SCHEMA
    for key in ("by_op_type", "top_nodes", "kernels", "candidates", "total_ms", "run_ms", "placement", "notes"):
        assert key in prof
    assert prof["total_ms"] > 0 and prof["run_ms"] >= prof["total_ms"] * 0.5
    assert math.isclose(sum(r["pct"] for r in prof["by_op_type"]), 100.0, rel_tol=1e-6)
    assert math.isclose(sum(r["ms"] for r in prof["by_op_type"]), prof["total_ms"], rel_tol=1e-9)
    assert [r["ms"] for r in prof["by_op_type"]] == sorted((r["ms"] for r in prof["by_op_type"]), reverse=True)
    for row in prof["by_op_type"]:
        assert set(row) == {"op_type", "ms", "pct", "count"}
    for node in prof["top_nodes"]:
        assert set(node) == {"name", "op_type", "ms", "pct", "provider"}
    for c in prof["candidates"]:
        assert {"kind", "instances", "ms", "pct"} <= set(c)
    json.dumps(prof)  # JSON-serialisable


def test_profile_as_written_times_every_candidate_node():
    prof = profile_model(str(BERT), runs=3, warmup=1, optimizations=False, top=4, threads=1)
    _check_shape(prof)
    assert prof["device"] == "cpu" and prof["kernels"] == [] and prof["kernels_source"] is None
    assert len(prof["top_nodes"]) == 4
    proto = onnx.load(str(BERT))
    runs = Counter(n.op_type for n in proto.graph.node if n.op_type != "Constant")
    assert {r["op_type"]: r["count"] for r in prof["by_op_type"]} == dict(runs)
    cands = {c["kind"]: c for c in prof["candidates"]}
    assert set(cands) == {"decomposed LayerNorm", "decomposed GELU", "decomposed attention"}
    assert cands["decomposed LayerNorm"]["instances"] == 5 and cands["decomposed LayerNorm"]["nodes"] == 45
    for c in cands.values():
        assert c["timed_nodes"] == c["nodes"] and c["ms"] > 0 and 0 < c["pct"] < 100
    assert prof["placement"]["fallback"] == [] and prof["placement"]["profiled"]


def test_profile_with_ort_optimizations_shows_ort_fusions_as_fused():
    prof = profile_model(str(BERT), runs=2, warmup=1, threads=1)
    _check_shape(prof)
    cands = {c["kind"]: c for c in prof["candidates"]}
    # ONNX Runtime fuses the LayerNorms itself on the CPU: the decomposed nodes did not run as written,
    # and five fused LayerNormalization nodes did
    assert cands["decomposed LayerNorm"]["timed_nodes"] == 0
    assert cands["fused LayerNorm"]["instances"] == 5 and cands["fused LayerNorm"]["fused"] is True
    assert "LayerNormalization" in cands["fused LayerNorm"]["op_types"]
    assert any("fused or removed" in n for n in prof["notes"])


def test_profile_names_unnamed_nodes_and_takes_feeds(tmp_path):
    w = np.ones((8, 8), np.float32)
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    prof = profile_model(path, feeds={"x": np.ones((2, 8), np.float32)}, runs=2, warmup=0, top=5)
    assert {n["name"] for n in prof["top_nodes"]} == {"MatMul_0", "Relu_1"}
    assert any("unnamed nodes" in n for n in prof["notes"])


def test_profile_in_a_child_process():
    """The CUDA path's child process (CUDA_LAUNCH_BLOCKING=1), run on the CPU."""
    prof = profile_model(str(BERT), runs=2, warmup=0, optimizations=False, launch_blocking=True, threads=1)
    _check_shape(prof)
    assert "CUDA_LAUNCH_BLOCKING=1" in prof["node_timing"]


def test_profile_refuses_other_backends_and_bad_counts():
    with pytest.raises(UsageError, match="needs --backend ort"):
        profile_model(str(BERT), backend="tensorrt")
    with pytest.raises(UsageError):
        profile_model(str(BERT), runs=0)


def test_bench_profile_json_and_table(capsys):
    argv = ["bench", str(BERT), "--profile", "--top", "3", "--profile-runs", "2", "--warmup", "1", "--iterations", "2"]
    assert main([*argv, "--json", "--no-ort-optimizations"]) == 0
    data = json.loads(capsys.readouterr().out)
    _check_shape(data["profile"])
    assert len(data["profile"]["top_nodes"]) == 3 and data["profile"]["runs"] == 2
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "op type" in text and "top 3 nodes" in text and "fusion candidates" in text
    assert "fused LayerNorm" in text  # ORT's optimizations are on by default
    assert format_profile(data["profile"]).count("\n") > 10


def test_profile_child_errors_come_back_as_mograph_errors():
    from mograph.errors import ModelError

    bad = {"input_ids": np.zeros((1, 16), np.int64), "attention_mask": np.zeros((1, 16, 2), np.int64)}
    with pytest.raises(ModelError, match="ONNX Runtime") as info:
        profile_model(str(BERT), feeds=bad, runs=1, warmup=0, launch_blocking=True)
    assert info.value.exit_code == 3


def _cuda_session_works() -> bool:
    from mograph.backends import ort as ort_backend

    try:
        ort_backend.make_session(str(BERT), device="cuda")
    except Exception:  # noqa: BLE001 - no onnxruntime-gpu, no GPU, no CUDA libraries
        return False
    return True


@pytest.mark.skipif(not _cuda_session_works(), reason="needs onnxruntime-gpu with a working CUDA provider and a GPU")
def test_profile_on_cuda_has_kernels_and_synchronous_node_times():
    prof = profile_model(str(BERT), device="cuda", runs=3, warmup=1)
    _check_shape(prof)
    assert prof["providers"][0] == "CUDAExecutionProvider"
    assert "CUDA_LAUNCH_BLOCKING=1" in prof["node_timing"]
    assert prof["kernels"] or any("kernel" in n for n in prof["notes"])
