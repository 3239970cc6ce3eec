"""Real Hugging Face Optimum exports (``optimum-cli export onnx --task text-generation-with-past``, optimum-onnx 0.1.0,
transformers 4.57, torch 2.13 TorchScript, opset 18): one graph for prefill and decode (the past may be 0 long),
``position_ids`` an input, the mask length named ``past_sequence_length + sequence_length``.

Their causal mask reads transformers 4.5x's cache position ``Range(P, P + S, 1)`` (not ``Range(0, S) + P``), its
key range ends at ``P + cache_position.shape[0]`` (through a Cast), and sdpa cuts the mask to the key length
(``Slice(mask, [0], [k_len], [3])``); without those three rules the attention stayed MultiHeadAttention with the
K/V heads repeated by Expand, and ``--kv-cache shared`` refused the model.

The files: ``LlamaForCausalLM`` and ``Gemma3ForCausalLM`` (2 layers, hidden 64, 4 query / 2 KV heads of 16, vocab
100; Gemma 3 with ``sliding_window`` 3 so a 6-token prefill is cut by it, no ``position_ids`` input), seeded random
weights, exported by ``optimum-cli`` from a ``save_pretrained`` folder (no hub).

Gemma 3's layers slide: the mask And-s ``kv_idx > q_idx - W`` in, which becomes GroupQueryAttention's
``local_window_size`` W (ONNX Runtime keeps the last W keys; measured on its CPU kernel).  Its ``k_norm`` on the new
keys of a cache step was dropped by the attention fusion (exit 0, logits 2.4 off the export).  Qwen 3 (same shape,
``position_ids`` an input) norms its heads before the transpose, ``Transpose(q_norm(Reshape(q)))``: the attention was
left unfused.  Phi 3 (fused ``qkv_proj``, ``position_ids`` an input) rotates ``Concat(rotary(q[..., :r]),
q[..., r:])`` with ``r = cos.shape[-1]``, the whole head: the shape query now takes a Slice bound it proves literal,
and the trace reads the spelling as the rotary of the whole head (it was left unfused)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

ort = pytest.importorskip("onnxruntime")

import onnx_ir as ir  # noqa: E402

import mograph  # noqa: E402
from mograph.cuda_graph import cuda_graph_check  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data" / "decoders"
LLAMA = DATA / "llama_optimum_transformers457.onnx"
GEMMA3 = DATA / "gemma3_sliding_optimum_transformers457.onnx"
QWEN3 = DATA / "qwen3_optimum_transformers457.onnx"
PHI3 = DATA / "phi3_optimum_transformers457.onnx"
LAYERS, KV_HEADS, HEAD = 2, 2, 16
PAST = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


def _session(model: Any) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _feeds(ids: np.ndarray, past: list[np.ndarray] | None, position_ids: bool = True) -> dict[str, np.ndarray]:
    b, s = ids.shape
    p = past[0].shape[2] if past else 0
    feeds = {"input_ids": ids, "attention_mask": np.ones((b, p + s), np.int64)}
    if position_ids:
        feeds["position_ids"] = np.tile(np.arange(p, p + s, dtype=np.int64), (b, 1))
    for name, i in zip(PAST, range(len(PAST))):
        feeds[name] = past[i] if past else np.zeros((b, KV_HEADS, 0, HEAD), np.float32)
    return feeds


def _steps(ref: Any) -> tuple[list[dict[str, np.ndarray]], list[list[np.ndarray]]]:
    """A prefill (past 0 long) and a decode step over the export's own presents, with the export's outputs."""
    rng = np.random.default_rng(0)
    pos = "position_ids" in {i.name for i in ref.get_inputs()}
    prefill = _feeds(rng.integers(0, 100, (2, 6)), None, pos)
    out = ref.run(None, prefill)
    decode = _feeds(rng.integers(0, 100, (2, 1)), out[1:], pos)
    return [prefill, decode], [out, ref.run(None, decode)]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _optimize(path: Path = LLAMA, **options: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    model, report = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse"], options={"target": "ort", **options})
    lower = next(p for p in report.to_dict()["passes"] if p["name"] == "lower")
    return model, lower["stats"]


def test_lengths_lowers_to_group_query_attention_without_a_kv_repeat() -> None:
    model, stats = _optimize(mask_format="lengths")
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["MultiHeadAttention"] == 0, ops
    assert ops["RotaryEmbedding"] == LAYERS, ops  # one kernel over the Q and K heads (position_ids as given)
    assert stats.get("kv_repeats", 0) == 0 and stats["attention.packed_qkv"] == LAYERS, stats
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
    assert attrs["num_heads"] == 4 and attrs["kv_num_heads"] == KV_HEADS and attrs["do_rotary"] == 0
    ref, opt = _session(LLAMA), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):  # prefill and a decode step over a real past
        assert _max_diff(opt.run(None, f), want) < 1e-5


def test_default_puts_group_query_attention_behind_the_padding_check() -> None:
    model, stats = _optimize()
    assert stats["attention.padding_check"] == LAYERS and stats.get("kv_repeats", 0) == 0, stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["If"] == LAYERS and ops["MultiHeadAttention"] == 0, ops
    ref, opt = _session(LLAMA), _session(model)
    feeds, outs = _steps(ref)
    left = dict(feeds[0])  # left padding: the check sends the row to the exact branch
    left["attention_mask"] = left["attention_mask"].copy()
    left["attention_mask"][0, :2] = 0
    for f, want in [*zip(feeds, outs), (left, ref.run(None, left))]:
        assert _max_diff(opt.run(None, f), want) < 1e-5


@pytest.mark.parametrize("path", [LLAMA, GEMMA3, QWEN3, PHI3], ids=["llama", "gemma3", "qwen3", "phi3"])
def test_kv_cache_shared_decode_step_writes_the_buffer_in_place(path: Path) -> None:
    model, stats = _optimize(path, kv_cache="shared")
    assert stats["attention.kv_cache_shared"] == LAYERS, stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["If"] == 0, ops
    assert cuda_graph_check(ir.serde.deserialize_model(model)).capturable
    ref = _session(path)
    feeds, outs = _steps(ref)
    opt, size, past = _session(model), 16, outs[0][1:]
    prev = past[0].shape[2]
    buffers = {}
    for name, p in zip(PAST, past):
        buf = np.zeros((2, KV_HEADS, size, HEAD), np.float32)
        buf[:, :, :prev] = p
        buffers[name] = ort.OrtValue.ortvalue_from_numpy(buf)
    mask = np.zeros((2, size), np.int64)
    mask[:, :prev + 1] = 1
    binding = opt.io_binding()
    binding.bind_cpu_input("input_ids", feeds[1]["input_ids"])
    binding.bind_cpu_input("attention_mask", mask)
    if "position_ids" in feeds[1]:
        binding.bind_cpu_input("position_ids", feeds[1]["position_ids"])
    binding.bind_output("logits")
    for name in PAST:
        binding.bind_ortvalue_input(name, buffers[name])
        binding.bind_ortvalue_output(name.replace("past_key_values", "present"), buffers[name])
    opt.run_with_iobinding(binding)
    assert float(np.abs(binding.copy_outputs_to_cpu()[0] - outs[1][0]).max()) < 1e-5
    for name, present in zip(PAST, outs[1][1:]):
        assert np.abs(buffers[name].numpy()[:, :, :prev + 1] - present).max() < 1e-5


def test_sliding_window_becomes_local_window_size() -> None:
    model, stats = _optimize(GEMMA3, mask_format="lengths")
    assert stats["attention.sliding_window"] == LAYERS and stats["attention.gqa_rotary"] == LAYERS, stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["MultiHeadAttention"] == 0, ops
    for gqa in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
        assert attrs["local_window_size"] == 3 and attrs["do_rotary"] == 1, attrs
    ref, opt = _session(GEMMA3), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):  # a 6-token prefill (the window cuts it) and a decode step over it
        assert _max_diff(opt.run(None, f), want) < 1e-5


def test_gemma3_default_keeps_k_norm_on_the_cached_keys() -> None:
    """The default form (GroupQueryAttention behind the padding check, the bias form in its exact branch): the new
    keys of a cache step keep their ``k_norm`` in both branches."""
    model, _ = _optimize(GEMMA3)
    ref, opt = _session(GEMMA3), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):
        assert _max_diff(opt.run(None, f), want) < 1e-5
    left = dict(feeds[0])
    left["attention_mask"] = left["attention_mask"].copy()
    left["attention_mask"][1, :3] = 0  # left padding: the exact branch
    assert _max_diff(opt.run(None, left), ref.run(None, left)) < 1e-5


@pytest.mark.parametrize("path", [QWEN3, PHI3], ids=["qwen3", "phi3"])
def test_qwen3_and_phi3_attention_fuses(path: Path) -> None:
    for options in ({"mask_format": "lengths"}, {}):
        model, stats = _optimize(path, **options)
        ops = Counter(n.op_type for n in model.graph.node)
        assert ops["MultiHeadAttention"] == 0 and ops["Softmax"] == 0, ops
        assert ops["GroupQueryAttention" if options else "If"] == LAYERS and stats.get("kv_repeats", 0) == 0, ops
        ref, opt = _session(path), _session(model)
        feeds, outs = _steps(ref)
        for f, want in zip(feeds, outs):
            assert _max_diff(opt.run(None, f), want) < 1e-5


def test_verify_runs_the_export_on_its_own_feeds(tmp_path: Path) -> None:
    """``--verify`` sizes the mask as past + new tokens (it was sized apart and the export itself failed)."""
    pytest.importorskip("polygraphy")  # (the verifier's ONNX Runtime runner)
    model, report = mograph.optimize(onnx.load(LLAMA), passes=["cleanup", "fuse"], options={"target": "ort"},
                                     verify=True)
    assert Counter(n.op_type for n in model.graph.node)["If"] == LAYERS  # (random masks: the exact branch runs)
    verify = report.to_dict()["verification"]
    assert verify["passed"], verify


def test_kv_cache_shared_refuses_a_cache_no_fused_attention_takes() -> None:
    """Near miss: one layer's Softmax made a LogSoftmax (that attention cannot fuse). ``--kv-cache shared`` used to
    end with exit 0 and that layer's cache still a growing Concat, so a loop binding one buffer as past and present
    failed at run time; now the pass refuses it, naming the count; the unchanged export still goes through."""
    proto = onnx.load(LLAMA)
    softmax = next(n for n in proto.graph.node if n.op_type == "Softmax")
    softmax.op_type = "LogSoftmax"
    with pytest.raises(mograph.PassFailedError, match=r"--kv-cache shared: 4 KV caches grow by Concat .* but 1 fused"):
        mograph.optimize(proto, passes=["cleanup", "fuse"], options={"target": "ort", "kv_cache": "shared"})
    model, stats = _optimize(kv_cache="shared")
    assert stats["attention.kv_cache_shared"] == LAYERS, stats


def _fp16_shared(**extra: Any) -> tuple[onnx.ModelProto, dict[str, Any], dict[str, Any]]:
    model, report = mograph.optimize(onnx.load(LLAMA), passes=["cleanup", "fuse", "fp16"],
                                     options={"target": "ort", "kv_cache": "shared", "fp16_io": "yes",
                                              "calibration_random": 2, **extra})
    by = {p["name"]: p["stats"] for p in report.to_dict()["passes"]}
    return model, by["fp16"], by["lower"]


def test_fp16_budget_never_cuts_a_decoder_attention_unit() -> None:
    """On a real Qwen2.5-Coder-0.5B export, ``cleanup,fuse,fp16 --fp16-io yes --kv-cache shared`` kept 374 nodes
    float32 to meet the budget, among them every fused Attention and 45 of its 48 RotaryEmbeddings: with a Cast
    between the cache and the attention, the lowering wrote MultiHeadAttention over K/V heads repeated by Expand,
    dropped ``--kv-cache shared`` without a word and exited 0 (a loop binding one buffer would fail).  A strict
    budget does the same to this 2-layer export.  Now the attention, its rotary and its cache glue take float16
    together, and the search keeps other nodes to meet the budget."""
    model, fp16, lower = _fp16_shared(fp16_budget="cosine>=0.9999999")
    assert fp16["fp16.attention_unit"] > 0 and fp16["accuracy.metric"] >= 0.9999999, fp16
    assert lower["attention.kv_cache_shared"] == LAYERS and "kv_repeats" not in lower, lower
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["MultiHeadAttention"] == 0, ops
    ref = _session(LLAMA)
    feeds, outs = _steps(ref)
    opt, size, past = _session(model), 16, outs[0][1:]
    prev = past[0].shape[2]
    binding = opt.io_binding()
    for name in ("input_ids", "position_ids"):
        binding.bind_cpu_input(name, feeds[1][name])
    mask = np.zeros((2, size), np.int64)
    mask[:, :prev + 1] = 1
    binding.bind_cpu_input("attention_mask", mask)
    binding.bind_output("logits")
    buffers = []
    for name, p in zip(PAST, past):
        buf = np.zeros((2, KV_HEADS, size, HEAD), np.float16)
        buf[:, :, :prev] = p
        buffers.append(ort.OrtValue.ortvalue_from_numpy(buf))
        binding.bind_ortvalue_input(name, buffers[-1])
        binding.bind_ortvalue_output(name.replace("past_key_values", "present"), buffers[-1])
    opt.run_with_iobinding(binding)
    got, want = binding.copy_outputs_to_cpu()[0].astype(np.float64).ravel(), outs[1][0].astype(np.float64).ravel()
    assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) > 0.9999
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    again, fp16_again, _ = _fp16_shared(fp16_budget="cosine>=0.9999999")  # the same decisions a second time
    assert fp16_again == fp16


def test_fp16_budget_out_of_reach_keeps_the_attention_unit_float16() -> None:
    """On the real Qwen2.5-Coder-0.5B no choice met ``cosine>=0.9999`` with the attention units in float16, so
    every other node stayed float32: the Q/K/V projections, the spelled-out rotary and the mask chain too, and a Cast
    between them and the attention left it unlowered (exit 4). The unit now takes all of them; a budget out of
    reach (cosine 1) shows the same here."""
    model, fp16, lower = _fp16_shared(fp16_budget="cosine>=1")
    assert fp16["kept_fp32.budget"] > 0 and fp16["fp16.attention_unit"] > 0, fp16
    assert lower["attention.kv_cache_shared"] == LAYERS and lower["attention.packed_qkv"] == LAYERS, lower
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["MultiHeadAttention"] == 0, ops


def test_kv_cache_shared_refuses_an_attention_the_user_keeps_float32() -> None:
    """``--keep-fp32 Attention`` puts a Cast between the float16 cache and the attention: the lowering's refusal
    did not see the cache through it, wrote MultiHeadAttention with the cache still a growing Concat and exited 0.
    Now it refuses, as for any cache attention that cannot become GroupQueryAttention."""
    with pytest.raises(mograph.PassFailedError, match=r"--kv-cache shared: attention .* over a KV cache cannot"):
        _fp16_shared(keep_fp32="Attention")
