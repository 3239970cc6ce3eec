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
and the trace reads the spelling as the rotary of the whole head (it was left unfused); its Sliced ``qkv_proj`` is
GroupQueryAttention's packed input as it is.

Phi-4-mini style (``Phi3ForCausalLM`` with ``partial_rotary_factor`` 0.75, ``pad_token_id`` 0): the same spelling
with ``r`` = 12 of 16 (hidden 64, 4 / 2 heads), and 48 of 64 (hidden 128, 2 query / 1 KV head of 64, FFN 64), where
GroupQueryAttention's ``do_rotary`` takes the 24-wide caches (it refuses 6: not a multiple of 8).  Both were left
unfused (exact, slow)."""

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
PHI4 = DATA / "phi4mini_partial_optimum_transformers457.onnx"  # partial_rotary_factor 0.75: 12 of 16 rotated
PHI4_64 = DATA / "phi4mini_partial_head64_optimum_transformers457.onnx"  # 48 of 64 rotated, 2 query / 1 KV head
LAYERS, KV_HEADS, HEAD = 2, 2, 16
PAST = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


def _session(model: Any) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _cache_dims(model: Any) -> tuple[int, int]:
    """(K/V heads, head size) of a session's ``[batch, G, past, D]`` cache inputs."""
    shape = next(i.shape for i in model.get_inputs() if i.name == PAST[0])
    return int(shape[1]), int(shape[3])


def _feeds(ids: np.ndarray, past: list[np.ndarray] | None, position_ids: bool = True,
           cache: tuple[int, int] = (KV_HEADS, HEAD)) -> dict[str, np.ndarray]:
    b, s = ids.shape
    p = past[0].shape[2] if past else 0
    feeds = {"input_ids": ids, "attention_mask": np.ones((b, p + s), np.int64)}
    if position_ids:
        feeds["position_ids"] = np.tile(np.arange(p, p + s, dtype=np.int64), (b, 1))
    for name, i in zip(PAST, range(len(PAST))):
        feeds[name] = past[i] if past else np.zeros((b, cache[0], 0, cache[1]), np.float32)
    return feeds


def _steps(ref: Any) -> tuple[list[dict[str, np.ndarray]], list[list[np.ndarray]]]:
    """A prefill (past 0 long) and a decode step over the export's own presents, with the export's outputs."""
    rng = np.random.default_rng(0)
    pos = "position_ids" in {i.name for i in ref.get_inputs()}
    prefill = _feeds(rng.integers(0, 100, (2, 6)), None, pos, _cache_dims(ref))
    out = ref.run(None, prefill)
    decode = _feeds(rng.integers(0, 100, (2, 1)), out[1:], pos, _cache_dims(ref))
    return [prefill, decode], [out, ref.run(None, decode)]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _optimize(path: Path = LLAMA, **options: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    model, report = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse"], options={"target": "ort", **options})
    lower = next(p for p in report.to_dict()["passes"] if p["name"] == "lower")
    return model, lower["stats"]


def test_lengths_lowers_to_group_query_attention_without_a_kv_repeat() -> None:
    model, stats = _optimize(mask_format="lengths", position_ids="as-given")
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


@pytest.mark.parametrize("path", [LLAMA, GEMMA3, QWEN3, PHI3, PHI4, PHI4_64],
                         ids=["llama", "gemma3", "qwen3", "phi3", "phi4-partial", "phi4-partial-64"])
def test_kv_cache_shared_decode_step_writes_the_buffer_in_place(path: Path) -> None:
    model, stats = _optimize(path, kv_cache="shared")
    assert stats["attention.kv_cache_shared"] == LAYERS, stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["If"] == 0, ops
    report = cuda_graph_check(ir.serde.deserialize_model(model))
    # PHI4's partial rotary stays outside as RotaryEmbedding kernels: their rows b*S + s are counted on the device
    # (a CumSum of ones), not by a Range over shape values on the host (a Memcpy that blocked capture)
    assert report.capturable, report.blockers
    ref = _session(path)
    feeds, outs = _steps(ref)
    opt, size, past = _session(model), 16, outs[0][1:]
    prev = past[0].shape[2]
    buffers, (g, d) = {}, _cache_dims(ref)
    for name, p in zip(PAST, past):
        buf = np.zeros((2, g, size, d), np.float32)
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


@pytest.mark.parametrize("options", [{"kv_cache": "shared"}, {"mask_format": "lengths"},
                                     {"mask_format": "lengths", "position_ids": "cache"}],
                         ids=["shared", "lengths", "lengths-cache"])
def test_verify_keeps_what_the_options_assume(options: dict[str, str]) -> None:
    """``--verify`` with ``--kv-cache shared`` or ``--mask-format lengths`` failed an exact rewrite (exit 5, logits
    0.2 off): its random mask had holes, which those graphs read as right padding, as documented.  The random
    masks are all ones and ``position_ids`` each token's cache position there, and the report says so."""
    pytest.importorskip("polygraphy")
    model, report = mograph.optimize(onnx.load(LLAMA), passes=["cleanup", "fuse"],
                                     options={"target": "ort", **options}, verify=True)
    assert Counter(n.op_type for n in model.graph.node)["GroupQueryAttention"] == LAYERS
    verify = report.to_dict()["verification"]
    assert verify["passed"], verify
    assert verify["assumptions"] and "masks all ones" in verify["summary"], verify["summary"]
    assert verify["feeds"]["attention_mask"]["range"] == [1, 1]
    past = verify["feeds"]["past_key_values.0.key"]["shape"][2]
    assert verify["feeds"]["position_ids"]["range"] == [past, past + verify["feeds"]["position_ids"]["shape"][1] - 1]


def test_verify_without_an_assumption_keeps_random_masks() -> None:
    """The default form checks the padding at run time: its feeds keep the random holes (the exact branch runs)."""
    from mograph.validate._feeds import keep_decoder_assumptions

    pytest.importorskip("polygraphy")
    _, report = mograph.optimize(onnx.load(LLAMA), passes=["cleanup", "fuse"], options={"target": "ort"}, verify=True)
    verify = report.to_dict()["verification"]
    assert verify["passed"] and not verify["assumptions"] and verify["feeds"]["attention_mask"]["range"] == [0, 1]
    given = {"attention_mask": np.array([[1, 1, 0]]), "position_ids": np.array([[5, 6]])}
    info = {"inputs": {"attention_mask": {"source": "file"}, "position_ids": {"source": "file"}}}
    keep_decoder_assumptions(given, info, ["--kv-cache shared"])  # the user's feeds stay as given
    assert given["attention_mask"].tolist() == [[1, 1, 0]] and given["position_ids"].tolist() == [[5, 6]]


def test_rotary_outside_says_what_position_ids_cache_would_change(caplog: pytest.LogCaptureFixture) -> None:
    """An export with a ``position_ids`` input keeps the rotary outside GroupQueryAttention (exact, 1.10-1.25x the
    GenAI builder's graphs on the H200): the lowering says so once and names the opt-in; with it, nothing is said."""
    with caplog.at_level("WARNING", logger="mograph.lowering"):
        model, stats = _optimize(kv_cache="shared", position_ids="as-given")
    assert stats["attention.position_ids_as_given"] == LAYERS and stats["attention.gqa_external_rotary"] == LAYERS
    notes = [r.getMessage() for r in caplog.records if "--position-ids cache" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith(f"lower: {LAYERS} GroupQueryAttention"), notes
    caplog.clear()
    with caplog.at_level("WARNING", logger="mograph.lowering"):
        _, stats = _optimize(kv_cache="shared", position_ids="cache")
    assert "attention.position_ids_as_given" not in stats and stats["attention.position_ids_assumed"] == LAYERS
    assert not [r for r in caplog.records if "--position-ids cache" in r.getMessage()]


@pytest.mark.parametrize("options", [{"mask_format": "lengths", "position_ids": "as-given"},
                                     {"mask_format": "lengths", "position_ids": "cache"},
                                     {"kv_cache": "shared", "position_ids": "cache"}],
                         ids=["rotary-outside", "rotary-inside", "shared-inside"])
def test_phi3_fused_qkv_proj_feeds_group_query_attention_packed(options: dict[str, str]) -> None:
    """Phi 3's ``qkv_proj`` output is Sliced into ``[q | k | v]`` side by side, the layout GroupQueryAttention's packed
    input reads: it goes in as it is (the op got the three Slices, and with the rotary outside two RotaryEmbedding
    kernels and a Concat); with the rotary outside one kernel rotates the Q and K heads of a Split of it."""
    model, stats = _optimize(PHI3, **options)
    ops = Counter(n.op_type for n in model.graph.node)
    inside = options.get("position_ids") == "cache"
    assert stats["attention.packed_qkv"] == LAYERS and stats.get("kv_repeats", 0) == 0, stats
    assert stats["attention.gqa_rotary" if inside else "attention.gqa_external_rotary"] == LAYERS, stats
    assert ops["GroupQueryAttention"] == LAYERS and ops["RotaryEmbedding"] == (0 if inside else LAYERS), ops
    # the MLP's gate/up halves (the kernels' rows b*S + s are counted over the input's own Shape(start, end))
    assert ops["Slice"] == 2 * LAYERS, ops
    assert ops["Range"] == 0 and ops["CumSum"] == (0 if inside else 1), ops
    assert ops["Split"] == (0 if inside else LAYERS) and ops["Concat"] == (0 if inside else LAYERS + 1), ops
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    assert gqa.input[1] == gqa.input[2] == "", list(gqa.input)  # one packed input
    ref = _session(PHI3)
    feeds, outs = _steps(ref)
    if "kv_cache" not in options:
        opt = _session(model)
        for f, want in zip(feeds, outs):
            assert _max_diff(opt.run(None, f), want) < 1e-5
    again, _ = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort", **options})
    assert Counter(n.op_type for n in again.graph.node) == ops  # a second run changes nothing


def test_phi3_qkv_slices_that_leave_columns_out_stay_three_inputs() -> None:
    """Near miss: ``qkv_proj`` given 8 more columns that no Slice reads (V's Slice ends at 128, not at the end):
    the whole output is not ``[q | k | v]``, so the three Slices stay GroupQueryAttention's inputs, still exact."""
    proto = onnx.load(PHI3)
    inits = {i.name: i for i in proto.graph.initializer}
    for node in [n for n in proto.graph.node if n.op_type == "MatMul" and "qkv_proj" in n.output[0]]:
        w = onnx.numpy_helper.to_array(inits[node.input[1]])
        wide = np.concatenate([w, np.ones((w.shape[0], 8), w.dtype)], axis=1)
        inits[node.input[1]].CopyFrom(onnx.numpy_helper.from_array(wide, node.input[1]))
    ends = {n.input[2] for n in proto.graph.node if n.op_type == "Slice" and "self_attn/Slice_2" in n.output[0]}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output[0] in ends:
            node.attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(np.array([128], np.int64)))
    for vi in list(proto.graph.value_info):
        if "qkv_proj" in vi.name:
            proto.graph.value_info.remove(vi)
    model, report = mograph.optimize(proto, passes=["cleanup", "fuse"],
                                     options={"target": "ort", "mask_format": "lengths", "position_ids": "cache"})
    stats = next(p for p in report.to_dict()["passes"] if p["name"] == "lower")["stats"]
    assert stats["attention.gqa_rotary"] == LAYERS and stats.get("attention.packed_qkv", 0) == 0, stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == LAYERS and ops["Slice"] == 5 * LAYERS, ops
    ref, opt = _session(proto), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):
        assert _max_diff(opt.run(None, f), want) < 1e-5


def _lower_stats(model: onnx.ModelProto, **options: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    out, report = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort", **options})
    return out, next(p for p in report.to_dict()["passes"] if p["name"] == "lower")["stats"]


@pytest.mark.parametrize("path, inside", [(PHI4, False), (PHI4_64, True)], ids=["r12-of-16", "r48-of-64"])
def test_partial_rotary_lowers_to_group_query_attention(path: Path, inside: bool) -> None:
    """Phi-4-mini's ``partial_rotary_factor`` 0.75 (``Concat(rotary(x[..., :R]), x[..., R:])``, the halves R/2
    apart): the attention was left unfused (exact, but MatMul/Softmax per layer).  Now the trace takes R, the rotary
    is ``mograph.RotaryEmbedding(rotary_dim=R)``, ONNX Runtime's kernel ``rotary_embedding_dim`` R, and with
    ``--position-ids cache`` GroupQueryAttention's ``do_rotary`` where its kernel takes the R/2-wide caches (a
    multiple of 8: R = 48 of 64; R = 12 of 16 it refuses at run time, so that one keeps one kernel outside)."""
    ref = _session(path)
    feeds, outs = _steps(ref)
    for options in ({"mask_format": "lengths", "position_ids": "as-given"},
                    {"mask_format": "lengths", "position_ids": "cache"}, {}):
        model, stats = _lower_stats(onnx.load(path), **options)
        ops = Counter(n.op_type for n in model.graph.node)
        assert ops["Softmax"] == 0 and ops["MultiHeadAttention"] == 0 and stats.get("kv_repeats", 0) == 0, ops
        opt = _session(model)
        for f, want in zip(feeds, outs):
            assert _max_diff(opt.run(None, f), want) < 1e-5
        if not options:  # the default: behind the padding check; left padding takes the exact branch
            assert ops["If"] == LAYERS and stats["attention.padding_check"] == LAYERS, stats
            left = dict(feeds[0])
            left["attention_mask"] = left["attention_mask"].copy()
            left["attention_mask"][0, :2] = 0
            assert _max_diff(opt.run(None, left), ref.run(None, left)) < 1e-5
            continue
        rotary_in = inside and options.get("position_ids") == "cache"
        assert stats["attention.gqa_rotary" if rotary_in else "attention.gqa_external_rotary"] == LAYERS, stats
        assert stats["attention.packed_qkv"] == LAYERS, stats  # (Phi's qkv_proj as it is)
        assert ops["GroupQueryAttention"] == LAYERS and ops["RotaryEmbedding"] == (0 if rotary_in else LAYERS), ops
        width = 48 if inside else 12
        for n in model.graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            if n.op_type == "RotaryEmbedding":
                assert attrs["rotary_embedding_dim"] == width and attrs["num_heads"] == (3 if inside else 6), attrs
            if n.op_type == "GroupQueryAttention":
                assert attrs["do_rotary"] == int(rotary_in), attrs
                if rotary_in:
                    cos = next(i for i in model.graph.initializer if i.name == n.input[7])
                    assert list(cos.dims) == [4096, width // 2]
        again, _ = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort", **options})
        assert Counter(n.op_type for n in again.graph.node) == ops  # a second run changes nothing


def test_partial_rotary_inlined_for_the_onnx_target() -> None:
    """``--target onnx``: ``mograph.RotaryEmbedding(rotary_dim=12)``'s function body, inlined, rotates the first 12
    values of each head and passes the other 4 (the standard Attention takes the rest)."""
    model, report = mograph.optimize(onnx.load(PHI4), passes=["cleanup", "fuse"], options={"target": "onnx"})
    fuse = next(p for p in report.to_dict()["passes"] if p["name"] == "fuse-attention")
    assert fuse["stats"].get("AttentionFusion", 0) == LAYERS, fuse["stats"]
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    ref, opt = _session(PHI4), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):
        assert _max_diff(opt.run(None, f), want) < 1e-5


def test_partial_rotary_with_its_halves_swapped_is_left_unfused() -> None:
    """Near miss: layer 0's query spelled ``Concat(x[..., R:], rotary(x[..., :R]))`` (the pass-through first: not a
    rotary of the head's first R values): that layer stays unfused, the other lowers, the numbers stay the export's."""
    proto = onnx.load(PHI4)
    prod = {o: n for n in proto.graph.node for o in n.output}
    q_cat = next(n for n in proto.graph.node if n.op_type == "Concat" and n.name.startswith("/model/layers.0/self_attn/")
                 and n.output[0] in {m.input[0] for m in proto.graph.node if m.op_type == "Mul"}
                 and prod[n.input[1]].op_type == "Slice" and prod[n.input[0]].op_type == "Add")
    q_cat.input[0], q_cat.input[1] = q_cat.input[1], q_cat.input[0]
    model, stats = _lower_stats(proto, mask_format="lengths")
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == 1 and ops["Softmax"] == 1 and stats["attention.gqa_external_rotary"] == 1, ops
    ref, opt = _session(proto), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):
        assert _max_diff(opt.run(None, f), want) < 1e-5


@pytest.mark.parametrize("options", [{"mask_format": "lengths", "position_ids": "as-given"},
                                     {"mask_format": "lengths", "position_ids": "cache"},
                                     {}], ids=["rotary-outside", "rotary-inside", "padding-check"])
def test_qwen3_projections_packed_through_the_head_norms(options: dict[str, str]) -> None:
    """Qwen 3's ``q_norm`` / ``k_norm`` sit between the projections and the rotary, so Q and K stay apart at
    GroupQueryAttention; the three projections of one ``h`` become one ``Split(h @ [Wq | Wk | Wv])`` read where each
    was (the norms and the rotary unchanged): one MatMul per layer instead of three, in both branches of the check."""
    model, stats = _optimize(QWEN3, **options)
    ops = Counter(n.op_type for n in model.graph.node)
    assert stats["attention.packed_projections"] == LAYERS and stats.get("attention.packed_qkv", 0) == 0, stats
    # per layer QKV, o_proj, gate, up, down; the lm_head; the angle table's (rotary outside, or the exact branch's)
    assert ops["Split"] == LAYERS and ops["MatMul"] == LAYERS * 5 + 1 + (
        0 if options.get("position_ids") == "cache" else 1), ops
    assert ops["SimplifiedLayerNormalization"] == 2 * LAYERS + 1, ops  # (the heads' and the final norm)
    ref, opt = _session(QWEN3), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):
        assert _max_diff(opt.run(None, f), want) < 1e-5
    again, _ = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort", **options})
    assert Counter(n.op_type for n in again.graph.node) == ops  # a second run changes nothing


def test_qwen3_value_of_another_tensor_keeps_its_projections() -> None:
    """Near miss: layer 0's ``v_proj`` reads the embeddings, not the normed ``h`` the Q and K projections read: its
    three MatMuls stay (layer 1 packs), and the numbers are the (changed) export's."""
    proto = onnx.load(QWEN3)
    v_proj = next(n for n in proto.graph.node if n.op_type == "MatMul" and "layers.0/self_attn/v_proj" in n.name)
    v_proj.input[0] = next(n.output[0] for n in proto.graph.node if n.op_type == "Gather" and "embed_tokens" in n.name)
    model, stats = _lower_stats(proto, mask_format="lengths", position_ids="cache")
    assert stats["attention.packed_projections"] == 1 and stats["attention.gqa_rotary"] == LAYERS, stats
    ref, opt = _session(proto), _session(model)
    feeds, outs = _steps(ref)
    for f, want in zip(feeds, outs):
        assert _max_diff(opt.run(None, f), want) < 1e-5


def test_default_check_branches_read_their_own_projections() -> None:
    """The default form behind the check (right padding and ``position_ids == past + s``): the fast branch is one
    packed ``h @ [Wq | Wk | Wv]`` into GroupQueryAttention with the rotary inside; the exact branch keeps the three
    projections and its rotary kernels; the main graph holds neither (a run computes one set of projections)."""
    model, stats = _optimize()
    assert stats["attention.packed_qkv"] == LAYERS and stats["attention.padding_check"] == LAYERS, stats
    assert stats["attention.position_ids_checked"] == LAYERS and "attention.packed_projections" not in stats, stats
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["MatMul"] == LAYERS * 4 + 2 and ops["Split"] == 0, ops  # (+ the lm_head and the angle table)
    for node in (n for n in model.graph.node if n.op_type == "If"):
        branch = {a.name: Counter(x.op_type for x in a.g.node) for a in node.attribute}
        assert branch["then_branch"] == Counter({"MatMul": 1, "GroupQueryAttention": 1}), branch["then_branch"]
        assert branch["else_branch"]["MatMul"] == 3 and branch["else_branch"]["MultiHeadAttention"] == 1
    ref, opt = _session(LLAMA), _session(model)
    feeds, outs = _steps(ref)
    left = dict(feeds[0])
    left["attention_mask"] = left["attention_mask"].copy()
    left["attention_mask"][1, :3] = 0
    for f, want in [*zip(feeds, outs), (left, ref.run(None, left))]:
        assert _max_diff(opt.run(None, f), want) < 1e-5
    again, _ = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort"})
    assert Counter(n.op_type for n in again.graph.node) == ops


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
