"""int4 decoders: the quantized Q/K/V of each attention lowered to ONE ``MatMulNBits`` (``GroupQueryAttention``'s packed
query), as the float path packs them; the numbers are those of the three separate nodes (a ``--kv-cache shared`` greedy
loop on ONNX Runtime CPU, optimizations off), and a plan that gives the three different precisions keeps them apart."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

import mograph.passes.fusion.lowerings._attention_gqa as attention_lowering  # noqa: E402  (where _lower_gqa calls it)

import mograph  # noqa: E402
from models import decoder_export as de  # noqa: E402
from mograph.lowering import lower_model  # noqa: E402
from mograph.plugins import get_registry  # noqa: E402
from mograph.testing import to_ir  # noqa: E402

pytestmark = pytest.mark.slow

CFG: dict[str, Any] = {"hidden": 128, "heads": 4, "kv_heads": 2}  # head size 32 (GQA's CPU kernel: multiple of 8)
MAX_LEN = 32
LAYER0_K = "/inner/model/layers.0/self_attn/k_proj/MatMul"


def _decode_export(tmp_path_factory: pytest.TempPathFactory, family: str) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp(f"packed_qkv_{family}")
    cfg = de.config(family, **CFG)
    path = de.export(cfg, "decode", "torchscript", base / "decode.onnx")
    calibration = base / "calibration.npz"
    np.savez(calibration, **de.feeds(cfg, "decode", batch=1, seq=1, past=7))
    return path, calibration


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _decode_export(tmp_path_factory, "llama")


def build(export: tuple[Path, Path], device: str | None, pack: bool, monkeypatch: pytest.MonkeyPatch,
          **options: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """``cleanup,fuse,int4 --target ort --kv-cache shared --output-projection bits`` (RTN); ``pack=False``: the same
    with the packing of quantized projections switched off (the reference: three MatMulNBits per attention)."""
    path, calibration = export
    opts: dict[str, Any] = {"target": "ort", "kv_cache": "shared", "output_projection": "bits", "algorithm": "rtn",
                            "calibration_data": str(calibration), **options}
    if device == "cuda":
        opts["fp16_io"] = True
    with monkeypatch.context() as mp:
        if not pack:
            mp.setattr(attention_lowering, "pack_nbits_projections", lambda *args, **kwargs: None)
        model, report = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse", "int4"], options=opts,
                                         device=device)
    lower = next(p for p in report.passes if p.name == "lower")
    return model, dict(lower.stats)


def greedy(model: onnx.ModelProto, steps: int = 6) -> tuple[list[int], list[np.ndarray]]:
    """Tokens and logits of a greedy loop, each layer's past and present bound to one ``[1, G, MAX, D]`` buffer."""
    cfg = de.config("llama", **CFG)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    start = de.feeds(cfg, "decode", batch=1, seq=1, past=3)
    names = [f"past_key_values.{i}.{kv}" for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]
    dtype = np.float16 if sess.get_inputs()[2].type == "tensor(float16)" else np.float32
    buffers = {}
    for n in names:
        buf = np.zeros((1, cfg.num_key_value_heads, MAX_LEN, cfg.hidden_size // cfg.num_attention_heads), dtype)
        buf[:, :, :3] = start[n]
        buffers[n] = ort.OrtValue.ortvalue_from_numpy(buf)
    mask = np.zeros((1, MAX_LEN), dtype=np.int64)
    token_ids, length = start["input_ids"], 4
    tokens, logits = [], []
    for _ in range(steps):
        mask[0, :length] = 1
        binding = sess.io_binding()
        binding.bind_cpu_input("input_ids", token_ids)
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_output("logits")
        for n in names:
            binding.bind_ortvalue_input(n, buffers[n])
            binding.bind_ortvalue_output(n.replace("past_key_values", "present"), buffers[n])
        sess.run_with_iobinding(binding)
        out = binding.copy_outputs_to_cpu()[0]
        logits.append(out)
        tokens.append(int(out[0, -1].argmax()))
        token_ids = np.array([[tokens[-1]]], dtype=np.int64)
        length += 1
    return tokens, logits


def ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize(("device", "rel"), [(None, 1e-6), ("cuda", 1e-3)])
def test_int4_decoder_packs_qkv_with_the_numbers_of_three(export: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                                          device: str | None, rel: float) -> None:
    """``device=cuda``: the GPU recipe (weight-only then fp16, float16 IO), still run on the CPU provider here."""
    block = {} if device == "cuda" else {"block_size": 32}  # 128: one block along K = hidden; 32: four
    packed, stats = build(export, device, True, monkeypatch, **block)
    separate, stats_separate = build(export, device, False, monkeypatch, **block)
    # 2 layers: per layer one packed QKV, o_proj, gate, up, down (was 7 with Q, K, V apart); plus the LM head
    assert ops(packed)["MatMulNBits"] == 2 * 5 + 1 and ops(separate)["MatMulNBits"] == 2 * 7 + 1
    assert ops(packed) - Counter({"MatMulNBits": 11}) == ops(separate) - Counter({"MatMulNBits": 15})
    assert ops(packed)["GroupQueryAttention"] == 2 and ops(packed)["MatMul"] == 0
    assert {k: v for k, v in stats.items() if "qkv" in k} == {"attention.packed_qkv": 2, "attention.packed_qkv.nbits": 2}
    assert not any("qkv" in k for k in stats_separate)
    for gqa in (n for n in packed.graph.node if n.op_type == "GroupQueryAttention"):
        assert gqa.input[1] == "" and gqa.input[2] == ""  # the query input carries Q, K and V
    tokens, logits = greedy(packed)
    ref_tokens, ref_logits = greedy(separate)
    assert tokens == ref_tokens
    scale = max(float(np.abs(x).max()) for x in ref_logits)
    diff = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(logits, ref_logits))
    assert diff <= rel * max(scale, 1.0), (diff, scale)
    # lowering the lowered model again finds nothing to do
    again = to_ir(packed)
    assert lower_model(again, "ort", registry=get_registry()).modified is False


def test_plan_with_different_precisions_keeps_that_layer_apart(export: tuple[Path, Path],
                                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The plan names q_proj, k_proj, v_proj one by one: layer 0's k_proj at int8 leaves layer 0 with three nodes
    (counted), layer 1 packed; the plan written out still lists every projection."""
    plan_path = tmp_path / "plan.yaml"
    plan = {"nodes": [{"node": LAYER0_K, "precision": "int8"}]}
    model, stats = build(export, None, True, monkeypatch, precision_plan=plan, precision_plan_out=str(plan_path))
    assert ops(model)["MatMulNBits"] == 7 + 5 + 1
    assert {k: v for k, v in stats.items() if "qkv" in k} == {
        "attention.packed_qkv": 1, "attention.packed_qkv.nbits": 1, "attention.unpacked_qkv.mixed_precision": 1}
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node
            if n.op_type == "MatMulNBits"}
    assert bits[LAYER0_K] == 8 and bits[LAYER0_K.replace("k_proj", "q_proj")] == 4
    written = plan_path.read_text()
    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert f"/inner/model/layers.{layer}/self_attn/{proj}/MatMul" in written
    tokens, _ = greedy(model, steps=2)
    assert len(tokens) == 2


@pytest.fixture(scope="module")
def qwen_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _decode_export(tmp_path_factory, "qwen2")


@pytest.mark.parametrize(("device", "rel"), [(None, 1e-6), ("cuda", 1e-3)])
def test_qwen2_biased_qkv_pack_with_their_biases(qwen_export: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                                  device: str | None, rel: float) -> None:
    """Qwen2's Q/K/V add biases after their ``MatMulNBits``: one packed node then one ``Add`` of ``[b_q | b_k | b_v]``
    (on the H200 the unpacked form launched 169 MatMulNBits a decode step of the Qwen2.5-0.5B shape against the
    builder's 121, 1.21x its time); the numbers are the three nodes'."""
    block = {} if device == "cuda" else {"block_size": 32}
    packed, stats = build(qwen_export, device, True, monkeypatch, **block)
    with monkeypatch.context() as mp:
        mp.setattr(attention_lowering, "pack_nbits_biased", lambda *args, **kwargs: (True, None))
        separate, _ = build(qwen_export, device, False, monkeypatch, **block)
    assert ops(packed)["MatMulNBits"] == 2 * 5 + 1 and ops(separate)["MatMulNBits"] == 2 * 7 + 1
    # per layer the three bias Adds become one
    assert ops(separate) - ops(packed) == Counter({"MatMulNBits": 4, "Add": 4})
    assert {k: v for k, v in stats.items() if "qkv" in k} == {
        "attention.packed_qkv": 2, "attention.packed_qkv.nbits": 2, "attention.packed_qkv.bias": 2}
    inits = {i.name: i for i in packed.graph.initializer}
    biases = [n for n in packed.graph.node if n.op_type == "Add" and any(i.startswith("mograph_qkv_bias") for i in n.input)]
    assert len(biases) == 2
    for add in biases:
        b = next(i for i in add.input if i in inits)
        assert list(inits[b].dims) == [128 + 2 * 64]
    tokens, logits = greedy(packed)
    ref_tokens, ref_logits = greedy(separate)
    assert tokens == ref_tokens
    scale = max(float(np.abs(x).max()) for x in ref_logits)
    diff = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(logits, ref_logits))
    assert diff <= rel * max(scale, 1.0), (diff, scale)
    assert lower_model(to_ir(packed), "ort", registry=get_registry()).modified is False
