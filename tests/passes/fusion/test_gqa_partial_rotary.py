"""Phi-2 and StableLM decoders as optimum exports them (``optimum-cli export onnx --task text-generation-with-past``,
optimum-onnx 0.1.0, optimum 2.1.0, transformers 4.57.6, torch 2.13.0 TorchScript, opset 18; seeded random weights
saved by ``save_pretrained`` first, no hub; see ``benchmarks/decoder-families.md``).  Both rotate part of each head
and have as many K/V heads as query heads.

``phi2_partial``: ``PhiForCausalLM``, 2 layers, hidden 80, 2 heads of 40, ``partial_rotary_factor`` 0.4 (16 of 40
rotated), biased projections, ``position_ids`` an input.  With the default mask format the exact branch of the
right-padding check lowered its cache to MultiHeadAttention, whose presents took the place of the outer graph's
outputs: a model the checker refuses (exit 4).  With ``--position-ids cache`` the rotary went into
GroupQueryAttention's ``do_rotary``, which ONNX Runtime refuses at run time for a head of 40 ("head_size shall be a
multiple of 16"): it stays outside now, in RotaryEmbedding kernels (``rotary_embedding_dim`` 16).

``stablelm_partial``: ``StableLmForCausalLM``, 2 layers, hidden 128, 2 heads of 64, ``partial_rotary_factor`` 0.25,
``use_qkv_bias``, FFN 64.  Its sdpa export scales Q and K^T by ``sqrt(1 / sqrt(D))`` computed from the query's shape:
the attention stayed unfused.  Its causal mask is transformers' legacy spelling (``triu(full(min), 1) * (arange(T) >
cache_position[:, None])``, the padding written over it by ``ScatterND``): proved causal now
(:func:`mograph.passes.fusion.lowerings.attention_proofs.legacy_causal`), it lowers to GroupQueryAttention (it
stayed MultiHeadAttention with the mask as a bias).  A Trilu that keeps a key after the query (``k`` 2) or the
lower triangle is a near miss: MultiHeadAttention, exact.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

ort = pytest.importorskip("onnxruntime")

import mograph  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data" / "decoders"
PHI2 = DATA / "phi2_partial_optimum_transformers457.onnx"
STABLELM = DATA / "stablelm_partial_optimum_transformers457.onnx"
LAYERS = 2
PAST = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


def _session(model: Any) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _feeds(ref: Any, ids: np.ndarray, past: list[np.ndarray] | None) -> dict[str, np.ndarray]:
    shape = next(i.shape for i in ref.get_inputs() if i.name == PAST[0])
    b, s = ids.shape
    p = past[0].shape[2] if past else 0
    feeds = {"input_ids": ids, "attention_mask": np.ones((b, p + s), np.int64),
             "position_ids": np.tile(np.arange(p, p + s, dtype=np.int64), (b, 1))}
    for i, name in enumerate(PAST):
        feeds[name] = past[i] if past else np.zeros((b, int(shape[1]), 0, int(shape[3])), np.float32)
    return feeds


def _steps(ref: Any) -> tuple[list[dict[str, np.ndarray]], list[list[np.ndarray]]]:
    """A 6-token prefill (past 0 long) and a one-token decode step over its presents, with the export's outputs."""
    rng = np.random.default_rng(0)
    prefill = _feeds(ref, rng.integers(0, 100, (2, 6)), None)
    out = ref.run(None, prefill)
    decode = _feeds(ref, rng.integers(0, 100, (2, 1)), out[1:])
    return [prefill, decode], [out, ref.run(None, decode)]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _optimize(path: Path, model: onnx.ModelProto | None = None, **options: Any
              ) -> tuple[onnx.ModelProto, dict[str, dict[str, Any]]]:
    out, report = mograph.optimize(model if model is not None else onnx.load(path), passes=["cleanup", "fuse"],
                                   options={"target": "ort", **options})
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


def _check_numbers(path: Path, model: onnx.ModelProto, left_padded: bool = False) -> None:
    ref, opt = _session(path), _session(model)
    feeds, outs = _steps(ref)
    cases = list(zip(feeds, outs))
    if left_padded:  # the check sends a left-padded row to the exact branch
        left = dict(feeds[0])
        left["attention_mask"] = left["attention_mask"].copy()
        left["attention_mask"][0, :2] = 0
        cases.append((left, ref.run(None, left)))
    for f, want in cases:
        assert _max_diff(opt.run(None, f), want) < 1e-5


def test_phi2_default_padding_check_keeps_the_outer_presents() -> None:
    model, passes = _optimize(PHI2)
    onnx.checker.check_model(model)  # was: "Graph output 'AttentionFusion_9_exact/6:1' is not an output of any node"
    stats = passes["lower"]["stats"]
    assert stats["attention.padding_check"] == LAYERS and stats["attention.gqa_external_rotary"] == LAYERS, stats
    ops = _ops(model)
    assert ops["If"] == LAYERS and ops["GroupQueryAttention"] == LAYERS and ops["MultiHeadAttention"] == LAYERS, ops
    assert ops["Softmax"] == 0, ops
    outputs = [o.name for o in model.graph.output]
    assert outputs == ["logits"] + [p.replace("past_key_values", "present") for p in PAST]
    producers = {o for n in model.graph.node for o in n.output}
    assert all(o in producers for o in outputs)  # each present is the If's, in the outer graph
    _check_numbers(PHI2, model, left_padded=True)


@pytest.mark.parametrize("options", [{"mask_format": "lengths"}, {"kv_cache": "shared"},
                                     {"mask_format": "lengths", "position_ids": "cache"}],
                         ids=["lengths", "shared", "lengths-cache"])
def test_phi2_partial_rotary_stays_outside_a_head_of_40(options: dict[str, str]) -> None:
    """16 of 40 values rotated: R/2 = 8 fits do_rotary's caches, but ONNX Runtime takes do_rotary only for heads of a
    multiple of 16; the rotary stays outside, one RotaryEmbedding over the packed Q and K heads per layer."""
    model, passes = _optimize(PHI2, **options)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["MultiHeadAttention"] == 0 and ops["If"] == 0, ops
    assert ops["RotaryEmbedding"] == LAYERS and ops["Softmax"] == 0, ops
    for rot in (n for n in model.graph.node if n.op_type == "RotaryEmbedding"):
        attrs = {a.name: helper.get_attribute_value(a) for a in rot.attribute}
        assert attrs["rotary_embedding_dim"] == 16, attrs
    for gqa in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
        assert attrs["do_rotary"] == 0 and attrs["num_heads"] == attrs["kv_num_heads"] == 2, attrs
    stats = passes["lower"]["stats"]
    assert stats["attention.gqa_external_rotary"] == LAYERS and stats.get("attention.gqa_rotary", 0) == 0, stats
    if options.get("kv_cache") != "shared":  # (a shared buffer's numbers: test_gqa_optimum's in-place step)
        _check_numbers(PHI2, model)


def test_phi2_shared_buffer_decode_step_in_place() -> None:
    """``--kv-cache shared``: a decode step writes its new key into the bound 16-row buffer; the logits and the written
    rows are the export's."""
    model, passes = _optimize(PHI2, kv_cache="shared")
    assert passes["lower"]["stats"]["attention.kv_cache_shared"] == LAYERS
    ref = _session(PHI2)
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


def test_stablelm_shape_computed_scale_and_legacy_mask_lower_to_gqa() -> None:
    """The scale read from the query's shape folds, the Trilu / ScatterND mask is proved causal: GroupQueryAttention
    behind the check (right padding and position_ids == past + s), the rotary (16 of 64) inside it there, and two
    kernels in the exact branch."""
    model, passes = _optimize(STABLELM)
    fuse = passes["fuse-attention"]["stats"]
    assert fuse == {"AttentionFusion": LAYERS, "AttentionFusion.mul-qk.mask.rotary.cache": LAYERS}, fuse
    stats = passes["lower"]["stats"]
    assert stats["attention.padding_check"] == LAYERS and stats["attention.gqa_rotary"] == LAYERS, stats
    assert stats["attention.position_ids_checked"] == LAYERS, stats
    ops = _ops(model)
    assert ops["Softmax"] == 0 and ops["GroupQueryAttention"] == ops["MultiHeadAttention"] == LAYERS, ops
    assert ops["If"] == LAYERS and ops["RotaryEmbedding"] == 2 * LAYERS, ops
    for rot in (n for n in model.graph.node if n.op_type == "RotaryEmbedding"):
        attrs = {a.name: helper.get_attribute_value(a) for a in rot.attribute}
        assert attrs["rotary_embedding_dim"] == 16, attrs  # 0.25 of 64
    _check_numbers(STABLELM, model, left_padded=True)


@pytest.mark.parametrize("options", [{"mask_format": "lengths", "position_ids": "as-given"},
                                     {"mask_format": "lengths", "position_ids": "cache"}, {"mask_format": "lengths"}],
                         ids=["lengths", "lengths-cache", "lengths-auto"])
def test_stablelm_lengths_group_query_attention_alone(options: dict[str, str]) -> None:
    """With the lengths: GroupQueryAttention alone (no Trilu, ScatterND or K/V Expand left); with ``--position-ids
    cache`` (or the default auto, under the lengths) the 16-of-64 rotary goes inside (``do_rotary``, 8-wide caches),
    with ``as-given`` one kernel outside."""
    model, passes = _optimize(STABLELM, **options)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["MultiHeadAttention"] == ops["If"] == 0, ops
    assert ops["Trilu"] == ops["ScatterND"] == ops["Softmax"] == 0, ops
    inside = options.get("position_ids") != "as-given"  # (auto under the lengths: cache positions)
    assert ops["RotaryEmbedding"] == (0 if inside else LAYERS), ops
    for gqa in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: helper.get_attribute_value(a) for a in gqa.attribute}
        assert attrs["do_rotary"] == int(inside) and attrs["num_heads"] == attrs["kv_num_heads"] == 2, attrs
    if inside:
        cos = next(i for i in model.graph.initializer if i.name.startswith("mograph_gqa_cos_cache"))
        assert list(cos.dims)[1] == 8
    stats = passes["lower"]["stats"]
    assert stats["attention.kv_cache"] == LAYERS and stats["attention.packed_qkv"] == LAYERS, stats
    _check_numbers(STABLELM, model)


def _stablelm_trilu(k: int | None = None, upper: int | None = None) -> onnx.ModelProto:
    model = onnx.load(STABLELM)
    trilu = next(n for n in model.graph.node if n.op_type == "Trilu")
    if k is not None:
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(k, np.int64), "near_miss_k"))
        trilu.input[1] = "near_miss_k"
    if upper is not None:
        del trilu.attribute[:]
        trilu.attribute.append(helper.make_attribute("upper", upper))
    return model


@pytest.mark.parametrize("change", [{"k": 2}, {"upper": 0}], ids=["diagonal-2", "lower-triangle"])
def test_stablelm_near_miss_trilu_not_causal(change: dict[str, int]) -> None:
    """``triu(full(min), 2)`` lets each query of a prefill see the next key; ``tril`` masks the past: neither is
    causal, so the mask stays the kernel's bias (MultiHeadAttention), and the numbers stay the edited export's."""
    edited = _stablelm_trilu(**change)
    model, passes = _optimize(STABLELM, model=onnx.load_from_string(edited.SerializeToString()), mask_format="lengths")
    ops = _ops(model)
    assert ops["GroupQueryAttention"] == 0 and ops["MultiHeadAttention"] == LAYERS and ops["Softmax"] == 0, ops
    assert passes["lower"]["stats"].get("attention.kv_cache") == LAYERS
    ref, opt = _session(edited), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):
        assert _max_diff(opt.run(None, f), want) < 1e-5


@pytest.mark.parametrize("path", [PHI2, STABLELM], ids=["phi2", "stablelm"])
def test_second_run_changes_nothing(path: Path) -> None:
    """The optimized model through ``cleanup,fuse`` again: nothing left to fuse or lower (cleanup may still tidy the
    shape reads the first run's simplify-shapes left)."""
    model, _ = _optimize(path)
    again, passes = _optimize(path, model=model)
    assert not passes["fuse-attention"]["modified"] and not passes["lower"]["stats"].get("lowered.Attention")
    kernels = ("GroupQueryAttention", "MultiHeadAttention", "RotaryEmbedding", "If", "Softmax")
    assert {k: _ops(again)[k] for k in kernels} == {k: _ops(model)[k] for k in kernels}
