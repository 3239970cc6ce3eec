"""GPT-NeoX (Pythia, ``GPTNeoXForCausalLM``) and Falcon (``FalconForCausalLM``, new decoder architecture) decoders,
each with one fused ``query_key_value`` projection, lowered to ``GroupQueryAttention`` (``--target ort``).

GPT-NeoX projects Q, K and V with one ``query_key_value`` whose columns are laid out per head, ``[q_h | k_h |
v_h]`` for each head ``h``: ``Reshape(x @ W + b, [B, S, H, 3D])``, ``Transpose [0, 2, 1, 3]``, ``chunk(3, -1)``
(three Slices whose bounds TorchScript computes from the shape).  No head-split Transpose of a ``[B, S, H*D]``
projection to trace: the attention stayed unfused.  ``fuse-attention``'s ``head-slice`` rewrite
(:mod:`mograph.passes.fusion.canonicalize._layout`) makes each part a projection of its own (``W``'s columns
``h*3D + j*D .. h*3D + (j+1)*D``, exact), which the lowering packs back into one ``[Q | K | V]`` MatMul; a quarter of
each head is rotated (``rotary_pct`` 0.25), rotate-half, as StableLM's.

``gpt_neox_ts_decode_transformers524.onnx``: ``models/decoder_export.py`` (``config("gpt_neox")``: 2 layers, hidden 64,
4 heads of 16, R 4, FFN 128, vocab 100, seeded random weights, sdpa), TorchScript decode graph with past and
``attention_mask``, positions from the past's length (torch 2.13.0, transformers 5.24.0, opset 17).
``gpt_neox_optimum_transformers457.onnx``: the same config and seeded weights saved by ``save_pretrained`` and
exported by ``optimum-cli export onnx --task text-generation-with-past`` (optimum-onnx 0.1.0, optimum 2.1.0,
transformers 4.57.6, torch 2.13.0, opset 18; ``position_ids`` an input).  The slow test exports a head of 64 with
torch (R 16: the rotary goes inside GroupQueryAttention, ``do_rotary``).

Falcon's new decoder architecture lays its ``query_key_value`` out per K/V group, ``[q_1 .. q_n | k | v]``:
``Reshape(x @ W, [B, S, G, n+2, D])``, the queries a Slice ``[0, n)`` of axis 3, the key and the value Gathers ``[n]``
/ ``[n+1]`` broadcast to the group's n query heads, each merged to ``[B, S, G*n, D]``, then ``.transpose(1, 2)
.reshape(B, H, S, D)`` (a no-op Reshape after the head Transpose); its cache holds the broadcast K/V (H heads).
``group-slice`` makes each part a projection (the key's and value's columns once per query head: copies) and
``heads-reshape`` drops the no-op Reshape; the rotary (whole head of 16) goes inside GroupQueryAttention.
``falcon_ts_decode_transformers524.onnx``: ``config("falcon")``, 2 layers, hidden 64, 4 query heads in 2 K/V groups of
16, no biases, parallel attention, TorchScript decode graph as above (530 KB).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

ort = pytest.importorskip("onnxruntime")

import mograph  # noqa: E402
from mograph.cuda_graph import cuda_graph_check  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data" / "decoders"
NEOX = DATA / "gpt_neox_ts_decode_transformers524.onnx"
NEOX_OPTIMUM = DATA / "gpt_neox_optimum_transformers457.onnx"
FALCON = DATA / "falcon_ts_decode_transformers524.onnx"
EXPORTS = pytest.mark.parametrize("path", [NEOX, NEOX_OPTIMUM], ids=["ts", "optimum"])
LAYERS = 2
PAST = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
FUSED = {"AttentionFusion": LAYERS, "AttentionFusion.mul-qk.mask.rotary.cache": LAYERS}


def _session(model: Any) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _feeds(ref: Any, ids: np.ndarray, past: list[np.ndarray] | None, left: bool = False) -> dict[str, np.ndarray]:
    inputs = {i.name: i for i in ref.get_inputs()}
    shape = inputs[PAST[0]].shape
    b, s = ids.shape
    p = past[0].shape[2] if past else 0
    feeds = {"input_ids": ids, "attention_mask": np.ones((b, p + s), np.int64)}
    if left:  # the padding check sends a left-padded row to the exact branch
        feeds["attention_mask"][0, :2] = 0
    if "position_ids" in inputs:
        feeds["position_ids"] = np.tile(np.arange(p, p + s, dtype=np.int64), (b, 1))
    for i, name in enumerate(PAST):
        feeds[name] = past[i] if past else np.zeros((b, int(shape[1]), 0, int(shape[3])), np.float32)
    return feeds


def _steps(ref: Any, left: bool = False) -> tuple[list[dict[str, np.ndarray]], list[list[np.ndarray]]]:
    """A 6-token prefill (past 0 long) and a one-token decode step over its presents, with the export's outputs."""
    rng = np.random.default_rng(0)
    prefill = _feeds(ref, rng.integers(0, 100, (2, 6)), None)
    out = ref.run(None, prefill)
    decode = _feeds(ref, rng.integers(0, 100, (2, 1)), out[1:])
    feeds, outs = [prefill, decode], [out, ref.run(None, decode)]
    if left:
        padded = _feeds(ref, rng.integers(0, 100, (2, 6)), None, left=True)
        feeds.append(padded)
        outs.append(ref.run(None, padded))
    return feeds, outs


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _optimize(model: onnx.ModelProto | Path, **options: Any) -> tuple[onnx.ModelProto, dict[str, dict[str, Any]]]:
    proto = onnx.load(model) if isinstance(model, Path) else model
    out, report = mograph.optimize(proto, passes=["cleanup", "fuse"], options={"target": "ort", **options})
    return out, {p["name"]: p for p in report.to_dict()["passes"]}


def _ops(model: onnx.ModelProto) -> Counter[str]:
    """Op types, the If branches' included."""
    got: Counter[str] = Counter()

    def walk(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            got[n.op_type] += 1
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
    walk(model.graph)
    return got


def _check_numbers(ref_model: Any, model: onnx.ModelProto, left: bool = False) -> float:
    ref, opt = _session(ref_model), _session(model)
    feeds, outs = _steps(ref, left)
    worst = 0.0
    for f, want in zip(feeds, outs):
        worst = max(worst, _max_diff(opt.run(None, f), want))
    assert worst < 1e-5
    return worst


def _packed(model: onnx.ModelProto, heads: int = 4, kv_heads: int = 4) -> None:
    """Every GroupQueryAttention reads one packed [Q | K | V] input."""
    for gqa in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
        assert attrs["num_heads"] == heads and attrs["kv_num_heads"] == kv_heads, attrs
        assert gqa.input[1] == gqa.input[2] == "", list(gqa.input)


@pytest.mark.parametrize("options", [{"mask_format": "lengths"}, {"kv_cache": "shared"},
                                     {"mask_format": "lengths", "position_ids": "cache"}],
                         ids=["lengths", "shared", "lengths-cache"])
@EXPORTS
def test_neox_group_query_attention_alone(path: Path, options: dict[str, str]) -> None:
    """The per-head qkv becomes three projections packed again; 4 of 16 rotated: too few for do_rotary's caches (a
    width of a multiple of 8), so one RotaryEmbedding over the packed Q and K heads per layer, outside."""
    model, passes = _optimize(path, **options)
    onnx.checker.check_model(model)
    fuse = passes["fuse-attention"]
    assert fuse["stats"] == FUSED, fuse["stats"]
    assert fuse["details"]["canonicalized"]["head-slice"] == 3 * LAYERS, fuse["details"]
    stats = passes["lower"]["stats"]
    assert stats["attention.packed_qkv"] == LAYERS and stats["attention.gqa_external_rotary"] == LAYERS, stats
    assert stats["attention.kv_cache"] == LAYERS and stats.get("attention.gqa_rotary", 0) == 0, stats
    shared = LAYERS if options.get("kv_cache") else 0
    assert stats.get("attention.kv_cache_shared", 0) == shared, stats
    # (shared, positions from the past's length: the rotary kernels read the buffer's from the mask, one table for
    # the layers; optimum's position_ids are given)
    assert stats.get("gqa_buffer_positions", 0) == (1 if shared and path == NEOX else 0), stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["RotaryEmbedding"] == LAYERS, ops
    assert ops["MultiHeadAttention"] == ops["If"] == ops["Softmax"] == 0, ops
    # the head, and per layer one packed qkv, the output, the MLP's two (optimum: the angle table's outer product)
    assert ops["MatMul"] == 1 + 4 * LAYERS + (path == NEOX_OPTIMUM), ops
    # (optimum: the angle table's rows are counted on the device over the input's own Shape(start, end), no Slice)
    assert ops["Slice"] == 0, ops
    for rot in (n for n in model.graph.node if n.op_type == "RotaryEmbedding"):
        attrs = {a.name: helper.get_attribute_value(a) for a in rot.attribute}
        assert attrs["rotary_embedding_dim"] == 4, attrs  # 0.25 of 16
    if options.get("kv_cache") == "shared":
        # every node on the CUDA provider: the rotary kernels' rows and the buffer positions are counted on the
        # device (CumSum over ConstantOfShape ones), no Range over shape values feeding a device input
        report = cuda_graph_check(ir.serde.deserialize_model(model))
        assert report.capturable, report.blockers
    _packed(model)
    if options.get("kv_cache") != "shared":  # (a shared buffer's numbers: the in-place step below)
        _check_numbers(path, model)


@EXPORTS
def test_neox_default_padding_check(path: Path) -> None:
    """Default mask format: GroupQueryAttention behind the right-padding ``If``, MultiHeadAttention in its exact
    branch; a left-padded prefill takes the exact branch, equal too."""
    model, passes = _optimize(path)
    onnx.checker.check_model(model)
    assert passes["fuse-attention"]["stats"] == FUSED
    stats = passes["lower"]["stats"]
    assert stats["attention.padding_check"] == LAYERS and stats["attention.packed_qkv"] == LAYERS, stats
    ops = _ops(model)
    assert ops["If"] == ops["GroupQueryAttention"] == ops["MultiHeadAttention"] == LAYERS, ops
    assert ops["Softmax"] == 0 and ops["RotaryEmbedding"] == 2 * LAYERS, ops
    outputs = [o.name for o in model.graph.output]
    assert outputs == ["logits"] + [p.replace("past_key_values", "present") for p in PAST]
    _check_numbers(path, model, left=True)


@EXPORTS
def test_neox_shared_buffer_decode_step_in_place(path: Path) -> None:
    """``--kv-cache shared``: a decode step writes its new key and value into the bound 16-row buffer; the logits and
    the written rows are the export's."""
    model, passes = _optimize(path, kv_cache="shared")
    assert passes["lower"]["stats"]["attention.kv_cache_shared"] == LAYERS
    ref = _session(path)
    feeds, outs = _steps(ref)
    opt, size, past = _session(model), 16, outs[0][1:]
    prev = past[0].shape[2]
    buffers = {}
    for name, p in zip(PAST, past):
        buf = np.zeros((2, p.shape[1], size, p.shape[3]), np.float32)
        buf[:, :, :prev] = p
        buffers[name] = ort.OrtValue.ortvalue_from_numpy(buf)
    mask = np.zeros((2, size), np.int64)
    mask[:, :prev + 1] = 1
    binding = opt.io_binding()
    for name in ("input_ids", "position_ids"):
        if name in feeds[1]:
            binding.bind_cpu_input(name, feeds[1][name])
    binding.bind_cpu_input("attention_mask", mask)
    binding.bind_output("logits")
    for name in PAST:
        binding.bind_ortvalue_input(name, buffers[name])
        binding.bind_ortvalue_output(name.replace("past_key_values", "present"), buffers[name])
    opt.run_with_iobinding(binding)
    assert float(np.abs(binding.copy_outputs_to_cpu()[0] - outs[1][0]).max()) < 1e-5
    for name, present in zip(PAST, outs[1][1:]):
        assert np.abs(buffers[name].numpy()[:, :, :prev + 1] - present).max() < 1e-5


@EXPORTS
def test_neox_heads_read_elsewhere_are_a_near_miss(path: Path) -> None:
    """The split qkv heads also a graph output: the three parts cannot become projections of their own (the qkv
    tensor must stay); nothing fuses and the model is the export's, exactly."""
    proto = onnx.load(path)
    heads = [n.output[0] for n in proto.graph.node
             if n.op_type == "Transpose" and n.name.endswith("attention/Transpose")]
    assert len(heads) == LAYERS
    proto.graph.output.extend(helper.make_tensor_value_info(h, onnx.TensorProto.FLOAT, None) for h in heads)
    model, passes = _optimize(proto, mask_format="lengths")
    fuse = passes["fuse-attention"]
    assert not fuse["modified"] and fuse["stats"] == {} and "canonicalized" not in fuse["details"], fuse
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Softmax"] == LAYERS and ops["GroupQueryAttention"] == 0 and ops["Slice"] >= 3 * LAYERS, ops
    _check_numbers(proto, model)


@EXPORTS
def test_neox_second_run_changes_nothing(path: Path) -> None:
    model, _ = _optimize(path, mask_format="lengths")
    again, passes = _optimize(model, mask_format="lengths")
    assert not passes["fuse-attention"]["modified"] and not passes["lower"]["stats"].get("lowered.Attention")
    assert "canonicalized" not in passes["fuse-attention"]["details"]
    assert Counter(n.op_type for n in again.graph.node) == Counter(n.op_type for n in model.graph.node)


@pytest.mark.slow
@pytest.mark.parametrize("position_ids", [False, True], ids=["cache-length", "position-ids"])
def test_neox_head_of_64_rotary_inside(tmp_path: Path, position_ids: bool) -> None:
    """Exported here with torch (TorchScript, transformers 5.x): 2 heads of 64, R 16 (``rotary_pct`` 0.25), so the
    rotary fits ``do_rotary`` (R/2 = 8 a multiple of 8, at most (64 / 16) * 8): GroupQueryAttention alone, the
    rotary inside, one packed [Q | K | V] MatMul per layer; given position_ids under ``--position-ids cache``."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from models import decoder_export as de

    cfg = de.config("gpt_neox", hidden=128, heads=2)
    path = de.export(cfg, "decode", "torchscript", tmp_path / "neox64.onnx", position_ids=position_ids)
    options = {"mask_format": "lengths", **({"position_ids": "cache"} if position_ids else {})}
    model, passes = _optimize(path, **options)
    assert passes["fuse-attention"]["stats"] == FUSED
    stats = passes["lower"]["stats"]
    assert stats["attention.gqa_rotary"] == stats["attention.packed_qkv"] == LAYERS, stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["RotaryEmbedding"] == ops["Softmax"] == 0, ops
    for gqa in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
        assert attrs["do_rotary"] == 1, attrs
    _packed(model, heads=2, kv_heads=2)
    _check_numbers(path, model)


@pytest.mark.parametrize("options", [{"mask_format": "lengths"}, {"kv_cache": "shared"}, {}],
                         ids=["lengths", "shared", "default"])
def test_falcon_grouped_qkv_to_group_query_attention(options: dict[str, str]) -> None:
    """The per-group qkv becomes three projections (K and V repeated per query head, as the export's cache holds
    them), packed again; the rotary inside (a head of 16, the whole head rotated); exact."""
    model, passes = _optimize(FALCON, **options)
    onnx.checker.check_model(model)
    fuse = passes["fuse-attention"]
    assert fuse["stats"] == FUSED, fuse["stats"]
    assert fuse["details"]["canonicalized"] == {"group-slice": 3 * LAYERS, "heads-reshape": 3 * LAYERS}, fuse["details"]
    stats = passes["lower"]["stats"]
    assert stats["attention.packed_qkv"] == stats["attention.gqa_rotary"] == stats["attention.kv_cache"] == LAYERS, stats
    assert stats.get("attention.kv_cache_shared", 0) == (LAYERS if options.get("kv_cache") else 0), stats
    assert stats.get("attention.padding_check", 0) == (0 if options else LAYERS), stats
    ops = _ops(model)
    assert ops["GroupQueryAttention"] == LAYERS and ops["Softmax"] == 0, ops
    assert ops["MultiHeadAttention"] == ops["If"] == (0 if options else LAYERS), ops
    if options:
        assert ops["RotaryEmbedding"] == ops["Transpose"] == ops["Expand"] == ops["Slice"] == 0, ops
        assert ops["MatMul"] == 1 + 4 * LAYERS, ops  # the head, and per layer one packed qkv, dense, the MLP's two
        _packed(model)
    if options.get("kv_cache") != "shared":
        _check_numbers(FALCON, model, left=not options)
    else:  # the in-place step: the new key and value written into a 16-row buffer bound as past and present
        ref = _session(FALCON)
        feeds, outs = _steps(ref)
        opt, size, past = _session(model), 16, outs[0][1:]
        prev = past[0].shape[2]
        buffers = {}
        for name, p in zip(PAST, past):
            buf = np.zeros((2, p.shape[1], size, p.shape[3]), np.float32)
            buf[:, :, :prev] = p
            buffers[name] = ort.OrtValue.ortvalue_from_numpy(buf)
        mask = np.zeros((2, size), np.int64)
        mask[:, :prev + 1] = 1
        binding = opt.io_binding()
        binding.bind_cpu_input("input_ids", feeds[1]["input_ids"])
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_output("logits")
        for name in PAST:
            binding.bind_ortvalue_input(name, buffers[name])
            binding.bind_ortvalue_output(name.replace("past_key_values", "present"), buffers[name])
        opt.run_with_iobinding(binding)
        assert float(np.abs(binding.copy_outputs_to_cpu()[0] - outs[1][0]).max()) < 1e-5
        for name, present in zip(PAST, outs[1][1:]):
            assert np.abs(buffers[name].numpy()[:, :, :prev + 1] - present).max() < 1e-5


def test_falcon_grouped_heads_read_elsewhere_are_a_near_miss() -> None:
    """The 5-D grouped qkv also a graph output: it must stay, so its parts do not become projections; nothing fuses,
    the numbers are the export's."""
    proto = onnx.load(FALCON)
    heads = [n.output[0] for n in proto.graph.node if n.op_type == "Reshape" and n.name.endswith("self_attention/Reshape")]
    assert len(heads) == LAYERS
    proto.graph.output.extend(helper.make_tensor_value_info(h, onnx.TensorProto.FLOAT, None) for h in heads)
    model, passes = _optimize(proto, mask_format="lengths")
    fuse = passes["fuse-attention"]
    assert not fuse["modified"] and fuse["stats"] == {} and "canonicalized" not in fuse["details"], fuse
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Softmax"] == LAYERS and ops["GroupQueryAttention"] == 0, ops
    _check_numbers(proto, model)


def test_falcon_second_run_changes_nothing() -> None:
    model, _ = _optimize(FALCON, mask_format="lengths")
    again, passes = _optimize(model, mask_format="lengths")
    assert not passes["fuse-attention"]["modified"] and "canonicalized" not in passes["fuse-attention"]["details"]
    assert Counter(n.op_type for n in again.graph.node) == Counter(n.op_type for n in model.graph.node)
