"""kv-cache-fp8: FP8 Q/DQ on the KV cache of decode-step exports (GPT-2, LLaMA from the attention corpus).

The five checks on a GPT-2 cache export; the simulated numbers against a numpy emulation (the original model fed
the FP8-rounded past, its presents rounded with the recorded scales); stored mode's FP8 I/O types, metadata and a
two-step decode round trip on ONNX Runtime CPU; refusal of a model without a cache; a near miss left alone; and
the attention fusion still matching after the pass, before or after ``cleanup,fuse``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant.kv_cache_fp8 import KV_CACHE_KEY, KvCacheFp8Pass, read_kv_cache_metadata
from onnx import TensorProto, helper

from mograph.errors import PassFailedError
from mograph.plugins import get_registry
from mograph.testing import assert_untouched, check_pass, op_counts, run_ort, to_ir, to_proto

pytest.importorskip("torch")
pytest.importorskip("transformers")

from models import attention_corpus as corpus  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn
GPT2 = corpus.Case("gpt2", "torchscript", "eager", "cache")
LLAMA = corpus.Case("llama", "torchscript", "eager", "cache")
CACHE = ["past_key_0", "past_value_0", "past_key_1", "past_value_1"]


def _export(case: corpus.Case, folder: Path) -> onnx.ModelProto:
    path = folder / f"{case.name}.onnx"
    if not path.exists():
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            corpus.export(case, path)
        finally:
            torch.set_num_threads(threads)
    return onnx.load(str(path))


@pytest.fixture(scope="module")
def gpt2(export_dir: Path) -> onnx.ModelProto:
    return _export(GPT2, export_dir)


@pytest.fixture(scope="module")
def llama(export_dir: Path) -> onnx.ModelProto:
    return _export(LLAMA, export_dir)


def _calib(case: corpus.Case) -> list[dict[str, np.ndarray]]:
    return [corpus.feeds(case, seed=s) for s in range(4)]


def _fake(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What Q(saturate) -> DQ does with this scale (1-D: per head, axis 1)."""
    s = scale.reshape(1, -1, 1, 1) if scale.ndim == 1 else scale
    q = np.clip(x / s, -448.0, 448.0).astype(FP8)
    return q.astype(np.float32) * s


def _scales(model) -> dict[str, np.ndarray]:
    rec = read_kv_cache_metadata(model)
    return {name: np.asarray(t["scale"], np.float32).reshape(-1 if t["axis"] == 1 else ())
            for name, t in rec["tensors"].items()}


def test_five_checks_on_gpt2_cache_export(gpt2: onnx.ModelProto) -> None:
    expected = op_counts(to_ir(gpt2)) + Counter({"QuantizeLinear": 8, "DequantizeLinear": 8})
    feeds = corpus.feeds(GPT2, seed=1)  # inside the calibrated range (saturation: the emulation test below)
    stats = {"cache_tensors": 4, "cache_tensors.key": 2, "cache_tensors.value": 2, "skipped_already_quantized": 0,
             "opset_upgrade.from": 17, "opset_upgrade.to": 19, "opset_upgrade.rewritten": 0, "q_nodes": 8,
             "dq_nodes": 8, "calibration_samples": 4}
    # FP8 E4M3 keeps 3 mantissa bits: a cache value moves by up to 16/448 of its head's range
    model = check_pass(KvCacheFp8Pass(calibration_data=_calib(GPT2)), gpt2, stats=stats, ops_left=expected,
                       rel=0.05, feeds=feeds)
    assert [v.name for v in model.graph.inputs] == [i.name for i in gpt2.graph.input]
    assert [v.name for v in model.graph.outputs] == [o.name for o in gpt2.graph.output]
    assert all(v.dtype == ir.DataType.FLOAT for v in model.graph.inputs if v.name in CACHE)


@pytest.mark.parametrize("granularity", ["head", "tensor"])
def test_simulated_numbers_equal_a_numpy_emulation(gpt2: onnx.ModelProto, granularity: str) -> None:
    model = to_ir(gpt2)
    KvCacheFp8Pass(calibration_data=_calib(GPT2), kv_cache_scale=granularity).call(model)
    scales = _scales(model)
    heads = gpt2.graph.input[2].type.tensor_type.shape.dim[1].dim_value
    assert all(s.shape == ((heads,) if granularity == "head" else ()) for s in scales.values()), scales
    feeds = corpus.feeds(GPT2, seed=11)
    for name in CACHE:  # a few values beyond the calibrated range: saturated, not NaN
        feeds[name][0, 0, 0, :2] *= 50.0
    got = run_ort(model, feeds)
    rounded = {k: _fake(v, scales[k]) if k in scales else v for k, v in feeds.items()}
    ref = run_ort(gpt2, rounded)  # the original decoder fed the FP8-rounded past
    assert np.all(np.isfinite(got[0]))
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-4)  # hidden state: reads the rounded past
    outs = [o.name for o in gpt2.graph.output]
    for name in CACHE:
        i = outs.index(name.replace("past", "present"))
        np.testing.assert_allclose(got[i], _fake(ref[i], scales[name]), rtol=1e-5, atol=1e-6)
        assert np.abs(got[i]).max() <= 448.0 * scales[name].max() * (1 + 1e-6)


def _fp8_value(x: np.ndarray):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(x).view(np.uint8),
                                                           TensorProto.FLOAT8E4M3FN)


def _session(model):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(to_proto(model, with_data=True).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_stored_fp8_io_and_a_two_step_round_trip(which: str, request: pytest.FixtureRequest) -> None:
    proto = request.getfixturevalue(which)
    case = GPT2 if which == "gpt2" else LLAMA
    sim, stored = to_ir(proto), to_ir(proto)
    KvCacheFp8Pass(calibration_data=_calib(case)).call(sim)
    res = KvCacheFp8Pass(calibration_data=_calib(case), kv_cache_io="fp8").call(stored)
    assert res.stats["cache_tensors"] == 4 and res.stats["q_nodes"] == res.stats["dq_nodes"] == 4
    fp8 = onnx.TensorProto.FLOAT8E4M3FN
    saved = to_proto(stored)
    onnx.checker.check_model(saved, full_check=True)
    ins = {i.name: i.type.tensor_type.elem_type for i in saved.graph.input}
    outs = {o.name: o.type.tensor_type.elem_type for o in saved.graph.output}
    assert {k for k, t in ins.items() if t == fp8} == set(CACHE)
    assert {k for k, t in outs.items() if t == fp8} == {n.replace("past", "present") for n in CACHE}
    assert outs[saved.graph.output[0].name] == TensorProto.FLOAT and ins["input_ids"] == TensorProto.INT64
    rec = read_kv_cache_metadata(saved)
    assert rec["io"] == "fp8" and set(rec["tensors"]) == set(CACHE)
    for k, v in _scales(sim).items():
        np.testing.assert_array_equal(_scales(stored)[k], v)
    assert res.details["plan"]["kv_cache"]["tensors"] == rec["tensors"]
    scales = _scales(stored)
    # step 1 from a float past rounded to FP8; step 2 feeds step 1's presents back (FP8 bytes as they came out)
    feeds = corpus.feeds(case, seed=3)
    s_sim, s_st = _session(sim), _session(stored)
    out_names = [o.name for o in saved.graph.output]
    past = {k: (feeds[k] / (scales[k].reshape(1, -1, 1, 1))).clip(-448, 448).astype(FP8) for k in CACHE}
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    sim_past = {k: v.astype(np.float32) * scales[k].reshape(1, -1, 1, 1) for k, v in past.items()}
    for step in range(2):
        got_sim = s_sim.run(None, {"input_ids": ids, "attention_mask": mask, **sim_past})
        got_st = s_st.run(None, {"input_ids": ids, "attention_mask": mask,
                                 **{k: _fp8_value(v) for k, v in past.items()}})
        np.testing.assert_allclose(got_st[0], got_sim[0], rtol=1e-5, atol=1e-5)
        for k in CACHE:
            i = out_names.index(k.replace("past", "present"))
            raw = got_st[i]
            assert raw.dtype == np.uint8 and raw.shape == got_sim[i].shape  # ORT hands FP8 back as its bytes
            decoded = raw.view(FP8).astype(np.float32) * scales[k].reshape(1, -1, 1, 1)
            np.testing.assert_allclose(decoded, got_sim[i], rtol=0, atol=1e-6)
            past[k] = raw.view(FP8)
            sim_past[k] = got_sim[i]
        ids = (ids + step + 1) % corpus.VOCAB
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), mask.dtype)], axis=1)
    assert past["past_key_0"].shape[2] == feeds["past_key_0"].shape[2] + 2


def _toy(with_cache: bool) -> onnx.ModelProto:
    """A past/present Concat on the sequence axis (the cache) or not, plus two near misses: a past Concat-ed on
    the head-dim axis, and a sequence-axis Concat into a graph output whose names are not past/present."""
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Concat", ["past_b", "new_b"], ["present_b"], axis=3),
             helper.make_node("Concat", ["x_in", "new_x"], ["y_out"], axis=2)]
    ins = [vi("past_b", f, ["B", 2, "P", 4]), vi("new_b", f, ["B", 2, "P", 1]),
           vi("x_in", f, ["B", 2, "P", 4]), vi("new_x", f, ["B", 2, 1, 4])]
    outs = [vi("present_b", f, ["B", 2, "P", 5]), vi("y_out", f, ["B", 2, "T", 4])]
    if with_cache:
        nodes.append(helper.make_node("Concat", ["past_key_0", "new_k"], ["present_key_0"], axis=-2))
        ins += [vi("past_key_0", f, ["B", 2, "P", 4]), vi("new_k", f, ["B", 2, 1, 4])]
        outs.append(vi("present_key_0", f, ["B", 2, "T", 4]))
    model = helper.make_model(helper.make_graph(nodes, "toy", ins, outs), opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model)
    return model


def _toy_feeds(rng: np.random.Generator, with_cache: bool = True) -> dict[str, np.ndarray]:
    shapes = {"past_b": (2, 2, 3, 4), "new_b": (2, 2, 3, 1), "x_in": (2, 2, 3, 4), "new_x": (2, 2, 1, 4)}
    if with_cache:
        shapes |= {"past_key_0": (2, 2, 3, 4), "new_k": (2, 2, 1, 4)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_near_misses_are_left_alone_and_said_why() -> None:
    rng = np.random.default_rng(0)
    model = to_ir(_toy(True))
    res = KvCacheFp8Pass(calibration_data=[_toy_feeds(rng) for _ in range(2)]).call(model)
    assert res.stats["cache_tensors"] == 1 and res.stats["q_nodes"] == 2
    assert "sequence axis" in res.details["not_cache"]["past_b"]
    assert [n.op_type for n in model.graph if n.op_type.endswith("Linear")].count("QuantizeLinear") == 2
    # what is left (the axis-3 Concat, the unnamed one, the done cache) is untouched by a second run
    assert_untouched(KvCacheFp8Pass(calibration_data=[_toy_feeds(rng) for _ in range(2)]), to_proto(model))
    assert model.metadata_props[KV_CACHE_KEY]


def test_refuses_a_model_without_a_cache(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(PassFailedError, match="no recognizable KV cache") as err:
        KvCacheFp8Pass(calibration_data=[_toy_feeds(rng, False)]).call(to_ir(_toy(False)))
    assert "\n" not in str(err.value) and "past_b" in str(err.value)
    assert err.value.exit_code == 4
    from mograph.cli import main

    path = tmp_path / "toy.onnx"
    onnx.save(_toy(False), str(path))
    code = main(["optimize", str(path), "-o", str(tmp_path / "out.onnx"), "--passes", "kv-cache-fp8",
                 "--calibration-random", "2", "-q"])
    assert code == 4 and not (tmp_path / "out.onnx").exists()


def _fuse(model, target: str, lower: bool = True) -> dict:
    reg = get_registry()
    cfg = {"target": target}
    stats: dict = {}
    for p in reg.instantiate(reg.plan("cleanup,fuse", cfg), cfg):
        if p.name == "lower" and not lower:
            continue
        for k, v in p.call(model).stats.items():
            stats[k] = stats.get(k, 0) + v
    return stats


@pytest.mark.parametrize("io", ["float", "fp8"])
def test_fusion_still_matches_after_the_pass(llama: onnx.ModelProto, io: str) -> None:
    """Q/DQ sits on the graph-I/O side of the cache: fuse-attention forms the same MultiHeadAttention after it,
    and the fused model computes what the unfused quantized one does."""
    model = to_ir(llama)
    KvCacheFp8Pass(calibration_data=_calib(LLAMA), kv_cache_io=io).call(model)
    quantized = to_proto(model)
    stats = _fuse(model, "ort")
    assert stats["AttentionFusion"] == 2 and stats["lowered.Attention"] == 2, stats
    left = op_counts(model)
    assert left["com.microsoft.MultiHeadAttention"] == 2 and "Softmax" not in left, left
    assert left["QuantizeLinear"] == left["DequantizeLinear"] == (8 if io == "float" else 4)
    if io == "float":
        feeds = corpus.feeds(LLAMA, seed=5)
        np.testing.assert_allclose(run_ort(model, feeds)[0], run_ort(quantized, feeds)[0], rtol=1e-4, atol=1e-4)


def test_after_cleanup_fuse_at_target_onnx(gpt2: onnx.ModelProto) -> None:
    model = to_ir(gpt2)
    _fuse(model, "onnx")
    fused = to_proto(model)
    res = KvCacheFp8Pass(calibration_data=_calib(GPT2)).call(model)
    assert res.stats["cache_tensors"] == 4
    feeds = corpus.feeds(GPT2, seed=2)
    scales = _scales(model)
    rounded = {k: _fake(v, scales[k]) if k in scales else v for k, v in feeds.items()}
    np.testing.assert_allclose(run_ort(model, feeds)[0], run_ort(fused, rounded)[0], rtol=1e-4, atol=1e-4)


def _mha_with_past() -> onnx.ModelProto:
    """ONNX Runtime's MultiHeadAttention fed the cache directly (past_key/past_value inputs 6/7, presents 1/2)."""
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    mha = helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "", "past_key_0", "past_value_0"],
                           ["out", "present_key_0", "present_value_0"], domain="com.microsoft", num_heads=2,
                           name="mha")
    graph = helper.make_graph(
        [mha], "mha",
        [vi("q", f, ["B", 1, 8]), vi("k", f, ["B", 1, 8]), vi("v", f, ["B", 1, 8]),
         vi("past_key_0", f, ["B", 2, "P", 4]), vi("past_value_0", f, ["B", 2, "P", 4])],
        [vi("out", f, ["B", 1, 8]), vi("present_key_0", f, ["B", 2, "T", 4]), vi("present_value_0", f, ["B", 2, "T", 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)])


def _mha_feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"q": (2, 1, 8), "k": (2, 1, 8), "v": (2, 1, 8), "past_key_0": (2, 2, 5, 4), "past_value_0": (2, 2, 5, 4)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_cache_read_by_a_fused_attention_op() -> None:
    proto = _mha_with_past()
    calib = [_mha_feeds(s) for s in range(3)]
    stats = {"cache_tensors": 2, "cache_tensors.key": 1, "cache_tensors.value": 1, "skipped_already_quantized": 0,
             "q_nodes": 4, "dq_nodes": 4, "calibration_samples": 3}
    ops = ["QuantizeLinear", "DequantizeLinear", "QuantizeLinear", "DequantizeLinear", "com.microsoft.MultiHeadAttention",
           "QuantizeLinear", "DequantizeLinear", "QuantizeLinear", "DequantizeLinear"]
    model = check_pass(KvCacheFp8Pass(calibration_data=calib), proto, stats=stats, ops_left=ops, rel=0.05,
                       feeds=calib[1])
    rec = read_kv_cache_metadata(model)
    assert {t["via"] for t in rec["tensors"].values()} == {"com.microsoft.MultiHeadAttention"}
    mha = next(n for n in model.graph if n.op_type == "MultiHeadAttention")
    readers = [mha.inputs[i] for i in (6, 7)]
    assert all(v is not None and getattr(v.producer(), "op_type", None) == "DequantizeLinear" for v in readers)
    feeds = _mha_feeds(9)
    scales = _scales(model)
    ref = run_ort(proto, {k: _fake(v, scales[k]) if k in scales else v for k, v in feeds.items()})
    got = run_ort(model, feeds)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], _fake(ref[1], scales["past_key_0"]), rtol=0, atol=1e-6)
    stored = to_ir(proto)
    KvCacheFp8Pass(calibration_data=calib, kv_cache_io="fp8").call(stored)
    assert [v.dtype for v in stored.graph.inputs][3:] == [ir.DataType.FLOAT8E4M3FN] * 2
    assert [v.dtype for v in stored.graph.outputs] == [ir.DataType.FLOAT] + [ir.DataType.FLOAT8E4M3FN] * 2


def test_cli_stored_mode_verifies_through_the_recorded_scales(gpt2: onnx.ModelProto, tmp_path: Path) -> None:
    """``--verify`` on stored mode feeds the FP8 inputs quantized with the recorded scales and compares the FP8
    presents by the values they stand for: the same figures as the simulated model's."""
    import json

    from mograph.cli import main

    src = tmp_path / "gpt2.onnx"
    onnx.save(gpt2, str(src))
    shapes = ["--shape", "input_ids:2x1", "--shape", "attention_mask:2x9"]
    for n in CACHE:
        shapes += ["--shape", f"{n}:2x4x8x16"]
    figures = {}
    for io in ("float", "fp8"):
        out, report = tmp_path / f"{io}.onnx", tmp_path / f"{io}.json"
        code = main(["optimize", str(src), "-o", str(out), "--passes", "kv-cache-fp8", "--kv-cache-io", io,
                     "--calibration-random", "4", *shapes, "--verify", "--report", str(report), "-q"])
        assert code == 0
        ver = json.loads(report.read_text())["verification"]
        assert ver["passed"]
        figures[io] = {k: (o["max_abs"], o["cosine"]) for k, o in ver["outputs"].items()}
        if io == "fp8":
            assert sum("fed as float8e4m3fn" in n for n in ver["notes"]) == 4
            assert read_kv_cache_metadata(onnx.load(str(out)))["io"] == "fp8"
    assert figures["fp8"] == figures["float"]


def test_cache_read_by_group_query_attention() -> None:
    """ONNX Runtime's GroupQueryAttention (past inputs 3/4, presents 1/2; 4 query heads over 2 KV heads of 8)."""
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    vi = helper.make_tensor_value_info
    gqa = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key_0", "past_value_0", "seqlens_k", "total"],
                           ["out", "present_key_0", "present_value_0"], domain="com.microsoft", num_heads=4,
                           kv_num_heads=2, name="gqa")
    graph = helper.make_graph(
        [gqa], "gqa",
        [vi("q", f, ["B", 1, 32]), vi("k", f, ["B", 1, 16]), vi("v", f, ["B", 1, 16]),
         vi("past_key_0", f, ["B", 2, "P", 8]), vi("past_value_0", f, ["B", 2, "P", 8]), vi("seqlens_k", i32, ["B"]),
         vi("total", i32, [])],
        [vi("out", f, ["B", 1, 32]), vi("present_key_0", f, ["B", 2, "T", 8]), vi("present_value_0", f, ["B", 2, "T", 8])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("com.microsoft", 1)])

    def feeds(seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        shapes = {"q": (2, 1, 32), "k": (2, 1, 16), "v": (2, 1, 16), "past_key_0": (2, 2, 5, 8),
                  "past_value_0": (2, 2, 5, 8)}
        out = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        return out | {"seqlens_k": np.array([5, 5], np.int32), "total": np.array(6, np.int32)}

    model = to_ir(proto)
    res = KvCacheFp8Pass(calibration_data=[feeds(s) for s in range(3)]).call(model)
    assert res.stats["cache_tensors"] == 2 and res.stats["q_nodes"] == 4
    assert {t["via"] for t in read_kv_cache_metadata(model)["tensors"].values()} == {"com.microsoft.GroupQueryAttention"}
    scales = _scales(model)
    x = feeds(7)
    ref = run_ort(proto, {k: _fake(v, scales[k]) if k in scales else v for k, v in x.items()})
    got = run_ort(model, x)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for i, name in ((1, "past_key_0"), (2, "past_value_0")):
        np.testing.assert_allclose(got[i], _fake(ref[i], scales[name]), rtol=0, atol=1e-6)


def test_no_calibration_data_is_refused_before_anything_changes(gpt2: onnx.ModelProto) -> None:
    from mograph.errors import OptionError
    from mograph.pass_infra import graph_fingerprint

    model = to_ir(gpt2)
    before = graph_fingerprint(model)
    with pytest.raises(OptionError, match="needs calibration data") as err:
        KvCacheFp8Pass().call(model)
    assert err.value.exit_code == 2 and graph_fingerprint(model) == before


def test_default_output_check_in_both_modes(gpt2: onnx.ModelProto) -> None:
    """kv-cache-fp8 ran no output check (int4 and qdq-fp8 do): now the same one-run figure, on calibration feeds
    that hold a past; stored mode is fed and read back through the recorded scales, so both modes read the same."""
    figures = {}
    for io in ("float", "fp8"):
        res = KvCacheFp8Pass(calibration_data=_calib(GPT2), kv_cache_io=io).call(to_ir(gpt2))
        check = res.details["output_check"]
        assert check["samples"] == 4 and check["data"] == "calibration" and check["passed"] is True
        assert "output_check.below_floor" not in res.stats and "note" not in check
        assert ("recorded scales" in check["ran"]) == (io == "fp8")
        figures[io] = check["measured"]
    assert 0.99 < figures["float"] < 1.0 and figures["fp8"] == figures["float"]


def _offset_cache(past: int = 3) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """A cache whose values sit at 100 +- 0.01 and an output that reads them minus 100: FP8's step there (a 32nd
    of the range) is all the output sees after the pass (cancellation)."""
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Concat", ["past_key_0", "new_k"], ["present_key_0"], axis=2),
             helper.make_node("Sub", ["past_key_0", "hundred"], ["y"])]
    graph = helper.make_graph(nodes, "offset", [vi("past_key_0", f, ["B", 2, "P", 4]), vi("new_k", f, ["B", 2, 1, 4])],
                              [vi("present_key_0", f, ["B", 2, "T", 4]), vi("y", f, ["B", 2, "P", 4])],
                              [onnx.numpy_helper.from_array(np.array(100.0, np.float32), "hundred")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    rng = np.random.default_rng(0)
    feeds = [{"past_key_0": (100 + 0.01 * rng.standard_normal((2, 2, past, 4))).astype(np.float32),
              "new_k": (100 + 0.01 * rng.standard_normal((2, 2, 1, 4))).astype(np.float32)} for _ in range(4)]
    return proto, feeds


def test_a_wrecked_output_warns_and_off_skips(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    import logging

    from mograph.passes.quant import _output_check as oc

    proto, feeds = _offset_cache()
    with caplog.at_level(logging.WARNING):
        res = KvCacheFp8Pass(calibration_data=feeds).call(to_ir(proto))
    check = res.details["output_check"]
    assert check["output"] == "y" and check["measured"] < oc.CHECK_FLOOR and check["passed"] is False
    assert res.stats["output_check.below_floor"] == 1 and res.stats["cache_tensors"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "wrecked" in r.getMessage()]
    assert line.startswith("kv-cache-fp8: output 'y' of the quantized model has cosine ")

    def refuse(*_a, **_k):
        raise AssertionError("the check ran")

    monkeypatch.setattr(oc.OutputCheck, "start", refuse)
    res = KvCacheFp8Pass(calibration_data=feeds, accuracy_budget="off").call(to_ir(proto))
    assert res.stats["cache_tensors"] == 1 and "output_check" not in res.details
    assert not any(k.startswith("output_check") for k in res.stats)


def test_feeds_with_an_empty_past_say_so() -> None:
    proto, feeds = _offset_cache(past=0)
    res = KvCacheFp8Pass(calibration_data=feeds).call(to_ir(proto))
    assert res.details["output_check"]["note"].startswith("every checked feed has an empty past")


def test_cli_reports_the_check_and_accuracy_budget_off_is_accepted(tmp_path: Path) -> None:
    import json

    from mograph.cli import main

    proto, _ = _offset_cache()
    src = tmp_path / "cache.onnx"
    onnx.save(proto, str(src))
    for i, (extra, present) in enumerate((([], True), (["--accuracy-budget", "off"], False))):
        report = tmp_path / f"r{i}.json"
        code = main(["optimize", str(src), "-o", str(tmp_path / f"o{i}.onnx"), "--passes", "kv-cache-fp8",
                     "--calibration-random", "2", "--report", str(report), "-q", *extra])
        assert code == 0
        details = json.loads(report.read_text())["passes"][0]["details"]
        assert ("output_check" in details) is present
        if present:  # random feeds size the dynamic past 1: a past is read
            assert details["output_check"]["samples"] == 2 and "note" not in details["output_check"]
