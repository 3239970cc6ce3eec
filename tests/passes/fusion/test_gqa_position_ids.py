"""Decoder exports that take ``position_ids`` as an input (as optimum's do): their rotary angles come from that input,
which nothing proves equal to ``past + s``; the causal mask is still built from the cache position.  Three forms:

* the default mask format: its run-time check (right padding) also checks ``position_ids == past + s``; where it
  holds, ``GroupQueryAttention`` computes the rotary itself (``do_rotary`` 1), else the exact branch runs;
* ``--mask-format lengths`` / ``--kv-cache shared`` (they assume right padding): by default (``--position-ids auto``)
  the ids are read as cache positions, as ``--position-ids cache`` does (rotary inside, the ids unread);
* ``--position-ids as-given`` under those: ``do_rotary`` 0 over one packed projection, ``Split(h @ [W_q | W_k |
  W_v])``, one ONNX Runtime ``RotaryEmbedding`` kernel over the Q and K heads together, ``Concat`` with V into its one
  QKV input (no K/V head repeat, the cache as its past/present, the shared buffer possible).  The Concat keeps the
  graph outside ONNX Runtime's CUDA ``GroupQueryAttentionFusion`` (RotaryEmbedding kernels feeding the op directly),
  which would read these per-token rotary caches by absolute position; checked here structurally.

Each exact against the export on ONNX Runtime CPU where its assumption holds."""

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

import mograph  # noqa: E402
from models import decoder_export as de  # noqa: E402
from mograph.testing import if_decisions  # noqa: E402

pytestmark = pytest.mark.slow

CFG: dict[str, Any] = {"hidden": 128, "heads": 4, "kv_heads": 2}  # head size 32 (GQA's CPU kernel: multiple of 8)
MAX_LEN = 16


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("decoders_position_ids")
    made: dict[tuple[str, str], Path] = {}

    def get(step: str, exporter: str) -> Path:
        if (step, exporter) not in made:
            made[(step, exporter)] = de.export(de.config("llama", **CFG), step, exporter,
                                               base / f"{step}_{exporter}.onnx", position_ids=True)
        return made[(step, exporter)]

    return get


def _optimize(path: Path, **options: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    model, report = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse"], options={"target": "ort", **options})
    lower = next(p for p in report.to_dict()["passes"] if p["name"] == "lower")
    return model, lower["stats"]


def _session(model: Any) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _run(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return _session(model).run(None, feeds)


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y.astype(np.float32)).max()) for x, y in zip(a, b))


def _gqa_attrs(nodes: Any) -> list[dict[str, Any]]:
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            for n in nodes if n.op_type == "GroupQueryAttention"]


def _not_ort_cuda_gqa_fusion_pattern(graph: onnx.GraphProto, packed: bool = True) -> None:
    """Every GroupQueryAttention takes one packed input made by a Concat of the rotated Q and K heads (one
    RotaryEmbedding over a Split of the packed projection; two kernels where not ``packed``) and V: no
    RotaryEmbedding node feeds it directly (ONNX Runtime's CUDA GroupQueryAttentionFusion looks for exactly that)."""
    producer = {o: n for n in graph.node for o in n.output}
    for gqa in (n for n in graph.node if n.op_type == "GroupQueryAttention"):
        assert gqa.input[1] == "" and gqa.input[2] == "", list(gqa.input)
        assert all(producer[i].op_type != "RotaryEmbedding" for i in gqa.input if i in producer)
        concat = producer[gqa.input[0]]
        assert concat.op_type == "Concat"
        if packed:
            rot, split = producer[concat.input[0]], producer[concat.input[1]]
            assert (len(concat.input), rot.op_type, split.op_type) == (2, "RotaryEmbedding", "Split")
            assert producer[rot.input[0]] is split and producer[split.input[0]].op_type == "MatMul"
            heads = {a.name: a.i for a in rot.attribute}["num_heads"]
            assert heads == CFG["heads"] + CFG["kv_heads"]  # the Q and K heads together
        else:
            assert [producer[i].op_type for i in concat.input[:2]] == ["RotaryEmbedding", "RotaryEmbedding"]


#: (step, batch, new tokens, padding): the cases each form must match the export on
CASES = {"prefill": [(2, 6, "none"), (2, 6, "right"), (1, 5, "none")],
         "decode": [(2, 1, "none"), (1, 4, "none")]}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_lengths_becomes_gqa_with_the_rotary_outside(exports: Any, exporter: str, step: str) -> None:
    path = exports(step, exporter)
    model, stats = _optimize(path, mask_format="lengths", position_ids="as-given")
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["RotaryEmbedding"] == 2 and ops["Split"] == 2, ops
    assert ops["MatMul"] == 11, ops  # one packed Q/K/V projection per layer (2 x 5 + the LM head)
    for gone in ("MultiHeadAttention", "Expand", "Softmax", "If"):
        assert ops[gone] == 0, (gone, ops)  # no K/V head repeat, no check
    assert ops["Concat"] == 2, ops  # the packing Concat per layer, no exporter cache Concat
    for attrs in _gqa_attrs(model.graph.node):
        assert attrs["do_rotary"] == 0 and attrs["num_heads"] == 4 and attrs["kv_num_heads"] == 2
    _not_ort_cuda_gqa_fusion_pattern(model.graph)
    assert stats["attention.gqa_external_rotary"] == 2 and "attention.gqa_rotary" not in stats
    assert stats["rotary.kernel"] == 2 and stats["attention.packed_qkv"] == 2  # one kernel per layer, in front
    assert stats.get("attention.kv_cache", 0) == (2 if step == "decode" else 0)
    if step == "decode":
        gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert [n.input[3] for n in gqa] == ["past_key_values.0.key", "past_key_values.1.key"]
        assert [n.output[1] for n in gqa] == ["present.0.key", "present.1.key"]
    cfg = de.config("llama", **CFG)
    for batch, seq, padding in CASES[step]:
        feeds = de.feeds(cfg, step, batch=batch, seq=seq, past=7, padding=padding, position_ids=True)
        assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5, (batch, seq, padding)
    again, _ = mograph.optimize(model, passes=["cleanup", "fuse"],
                                options={"target": "ort", "mask_format": "lengths", "position_ids": "as-given"})
    assert Counter(n.op_type for n in again.graph.node) == ops  # a second run changes nothing


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_default_checks_right_padding_and_positions(exports: Any, step: str) -> None:
    """The default mask format: the check on the device (right padding, and position_ids each token's cache
    position ``P + s``) picks GroupQueryAttention with the rotary inside (do_rotary 1, position_ids unread) or the
    exact form per run; left padding and offset positions take the exact branch; the export's numbers either way."""
    path = exports(step, "torchscript")
    model, stats = _optimize(path)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["If"] == 2, ops
    branches = [{a.name: a.g for a in n.attribute} for n in model.graph.node if n.op_type == "If"]
    for b in branches:
        fast = Counter(n.op_type for n in b["then_branch"].node)
        assert fast["GroupQueryAttention"] == 1 and fast["RotaryEmbedding"] == 0 and fast["Concat"] == 0, fast
        assert [a["do_rotary"] for a in _gqa_attrs(b["then_branch"].node)] == [1]
        exact = Counter(n.op_type for n in b["else_branch"].node)
        assert exact["MultiHeadAttention"] == 1 and exact["RotaryEmbedding"] == 2, exact  # its own Q and K kernels
    assert (stats["attention.gqa_rotary"], stats["attention.padding_check"]) == (2, 2)
    assert stats["attention.position_ids_checked"] == 2 and "attention.gqa_external_rotary" not in stats
    assert "attention.position_ids_as_given" not in stats  # (no note: nothing stays outside)
    cfg = de.config("llama", **CFG)
    cases = [(2, 6, "none", True), (2, 6, "right", False), (2, 6, "left", False), (1, 5, "none", True)] \
        if step == "prefill" else [(2, 1, "none", True), (2, 1, "left", False), (1, 4, "none", True)]
    for batch, seq, padding, fast_taken in cases:
        feeds = de.feeds(cfg, step, batch=batch, seq=seq, past=7, padding=padding, position_ids=True)
        assert if_decisions(model, feeds) == [fast_taken, fast_taken], (batch, seq, padding)
        assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5, (batch, seq, padding)
        shifted = dict(feeds, position_ids=feeds["position_ids"] + 3)  # offsets: the exact branch, same numbers
        assert if_decisions(model, shifted) == [False, False], (batch, seq, padding)
        assert _max_diff(_run(path, shifted), _run(model, shifted)) < 1e-5, (batch, seq, padding)
    again, _ = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort"})
    assert Counter(n.op_type for n in again.graph.node) == ops  # a second run changes nothing


@pytest.mark.parametrize("positions", ["as-given", "auto"])
def test_kv_cache_shared_greedy_loop_matches_the_export(exports: Any, positions: str) -> None:
    """``--kv-cache shared`` with position_ids: past and present bound to one static buffer per layer, position_ids
    fed as a generation loop does; the greedy tokens and logits are the export's (its cache grown by Concat).
    ``as-given``: the rotary outside; ``auto`` (the default): the shared buffer's right padding implies cache
    positions, so GroupQueryAttention computes the rotary itself (position_ids unread)."""
    path = exports("decode", "torchscript")
    model, stats = _optimize(path, kv_cache="shared", position_ids=positions)
    assert stats["attention.kv_cache_shared"] == 2
    if positions == "as-given":
        assert stats["attention.gqa_external_rotary"] == 2
        _not_ort_cuda_gqa_fusion_pattern(model.graph)
    else:
        assert stats["attention.gqa_rotary"] == 2 and stats["attention.position_ids_assumed"] == 2
        assert "attention.gqa_external_rotary" not in stats
        assert [a["do_rotary"] for a in _gqa_attrs(model.graph.node)] == [1, 1]
        assert Counter(n.op_type for n in model.graph.node)["RotaryEmbedding"] == 0
    cfg = de.config("llama", **CFG)
    layers = cfg.num_hidden_layers
    names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    start = de.feeds(cfg, "decode", batch=1, seq=1, past=3, position_ids=True)
    ref, opt = _session(path), _session(model)
    feeds = dict(start)
    ref_logits, ref_tokens = [], []
    for _ in range(6):
        out = ref.run(None, feeds)
        ref_logits.append(out[0])
        ref_tokens.append(int(out[0][0, -1].argmax()))
        past_len = out[1].shape[2]
        feeds = {"input_ids": np.array([[ref_tokens[-1]]], dtype=np.int64),
                 "attention_mask": np.ones((1, past_len + 1), dtype=np.int64),
                 "position_ids": np.array([[past_len]], dtype=np.int64)}
        feeds.update(dict(zip(names, out[1:])))
    buffers = {}
    for n in names:
        buf = np.zeros((1, 2, MAX_LEN, 32), dtype=np.float32)
        buf[:, :, :3] = start[n]
        buffers[n] = ort.OrtValue.ortvalue_from_numpy(buf)
    mask = np.zeros((1, MAX_LEN), dtype=np.int64)
    token_ids, length = start["input_ids"], 4
    tokens, worst = [], 0.0
    for step in range(6):
        mask[0, :length] = 1
        binding = opt.io_binding()
        binding.bind_cpu_input("input_ids", token_ids)
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_cpu_input("position_ids", np.array([[length - 1]], dtype=np.int64))
        binding.bind_output("logits")
        for n in names:
            binding.bind_ortvalue_input(n, buffers[n])
            binding.bind_ortvalue_output(n.replace("past_key_values", "present"), buffers[n])
        opt.run_with_iobinding(binding)
        logits = binding.copy_outputs_to_cpu()[0]
        worst = max(worst, float(np.abs(logits - ref_logits[step]).max()))
        tokens.append(int(logits[0, -1].argmax()))
        token_ids = np.array([[tokens[-1]]], dtype=np.int64)
        length += 1
    assert tokens == ref_tokens and worst < 1e-5


def test_fp16_keeps_long_positions_exact(exports: Any, tmp_path: Path) -> None:
    """fp16 after fusion: the rotary angles of run-time ``position_ids`` stay float32 (Cos/Sin of them cast
    after), so a token at position 4,000-7,000 gets float16-rounding errors only; float16 angles gave present keys
    off by 0.06-0.1 there (measured before the rule)."""
    path = exports("decode", "torchscript")
    cfg = de.config("llama", **CFG)
    feeds = de.feeds(cfg, "decode", batch=2, seq=1, past=7, position_ids=True)
    np.savez(tmp_path / "calib.npz", **feeds)
    model, report = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse", "fp16"],
                                     options={"target": "ort", "mask_format": "lengths", "fp16_io": "yes",
                                              "position_ids": "as-given",
                                              "calibration_data": str(tmp_path / "calib.npz")})
    fp16 = next(p for p in report.to_dict()["passes"] if p["name"] == "fp16")
    assert fp16["stats"]["kept_fp32.position_angle"] >= 4  # Cast, MatMul/Mul, Cos, Sin at least
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["RotaryEmbedding"] == 2, ops  # one over Q and K per layer
    inferred = onnx.shape_inference.infer_shapes(model)
    dtype = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    trig = [n for n in model.graph.node if n.op_type in ("Cos", "Sin")]
    assert trig and all(dtype[n.output[0]] == onnx.TensorProto.FLOAT for n in trig)
    for start in (0, 4000, 7000):
        f = dict(feeds)
        f["position_ids"] = feeds["position_ids"] + start
        half = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in f.items()}
        assert _max_diff(_run(path, f), _run(model, half)) < 5e-3, start


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_position_ids_cache_puts_the_rotary_inside(exports: Any, exporter: str) -> None:
    """``--position-ids cache`` (an assumption, documented): position_ids taken as each token's cache position, so
    GroupQueryAttention computes the rotary itself (do_rotary 1, packed QKV, no RotaryEmbedding kernel, position_ids
    unread): the export's numbers where the assumption holds, other numbers where it does not (offset positions)."""
    path = exports("decode", exporter)
    model, stats = _optimize(path, mask_format="lengths", position_ids="cache")
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["RotaryEmbedding"] == 0 and ops["Cos"] == 0, ops
    assert [a["do_rotary"] for a in _gqa_attrs(model.graph.node)] == [1, 1]
    assert stats["attention.position_ids_assumed"] == 2 and stats["attention.gqa_rotary"] == 2
    assert "attention.gqa_external_rotary" not in stats and stats["attention.packed_qkv"] == 2
    cfg = de.config("llama", **CFG)
    feeds = de.feeds(cfg, "decode", batch=2, seq=1, past=7, position_ids=True)  # no padding: positions P + s
    assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5
    shifted = dict(feeds, position_ids=feeds["position_ids"] + 5)  # outside the assumption
    assert _max_diff(_run(path, shifted), _run(model, shifted)) > 1e-2
    exact, _ = _optimize(path, mask_format="lengths", position_ids="as-given")  # follows the given positions
    assert _max_diff(_run(path, shifted), _run(exact, shifted)) < 1e-5
    again, _ = mograph.optimize(model, passes=["cleanup", "fuse"],
                                options={"target": "ort", "mask_format": "lengths", "position_ids": "cache"})
    assert Counter(n.op_type for n in again.graph.node) == ops


def test_lengths_implies_cache_positions_by_default(exports: Any) -> None:
    """``--mask-format lengths`` without ``--position-ids``: the default ``auto`` reads position_ids as cache positions
    (the graph already assumes right padding), the same graph as ``--position-ids cache``; the lower step says so."""
    path = exports("decode", "torchscript")
    model, stats = _optimize(path, mask_format="lengths")
    cache, cache_stats = _optimize(path, mask_format="lengths", position_ids="cache")
    assert stats == cache_stats and stats["attention.position_ids_assumed"] == 2
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in cache.graph.node]
    feeds = de.feeds(de.config("llama", **CFG), "decode", batch=2, seq=1, past=7, position_ids=True)
    assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5


def test_position_ids_cache_changes_nothing_without_the_input(tmp_path: Path) -> None:
    """The near miss: an export without a position_ids input (its positions proved from the cache length) lowers to
    the same graph with the option as without it, nothing assumed (no stat)."""
    path = de.export(de.config("llama", **CFG), "decode", "torchscript", tmp_path / "d.onnx")
    plain, plain_stats = _optimize(path, mask_format="lengths")
    model, stats = _optimize(path, mask_format="lengths", position_ids="cache")
    assert "attention.position_ids_assumed" not in stats and stats == plain_stats
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in plain.graph.node]
    feeds = de.feeds(de.config("llama", **CFG), "decode", batch=2, seq=1, past=7)
    assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5
