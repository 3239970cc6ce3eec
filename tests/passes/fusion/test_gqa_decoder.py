"""Decoder exports (LlamaForCausalLM / Qwen2ForCausalLM, TorchScript and dynamo, prefill and decode) lowered for
``--target ort`` to ``GroupQueryAttention`` with the rotary inside, packed QKV, and the cache as its past/present."""

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

import onnx_ir as ir  # noqa: E402

import mograph  # noqa: E402
from models import decoder_export as de  # noqa: E402
from mograph.cuda_graph import cuda_graph_check  # noqa: E402
from mograph.testing import if_decisions  # noqa: E402

pytestmark = pytest.mark.slow

CFG: dict[str, Any] = {"hidden": 128, "heads": 4, "kv_heads": 2}  # head size 32 (GQA's CPU kernel: multiple of 8)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("decoders")
    made: dict[tuple[str, str, str], Path] = {}

    def get(family: str, step: str, exporter: str) -> Path:
        key = (family, step, exporter)
        if key not in made:
            made[key] = de.export(de.config(family, **CFG), step, exporter, base / f"{family}_{step}_{exporter}.onnx")
        return made[key]

    return get


def _optimize(path: Path, **options: Any) -> onnx.ModelProto:
    model, _ = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse"], options={"target": "ort", **options})
    return model


def _run(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y.astype(np.float32)).max()) for x, y in zip(a, b))


#: what a 2-layer decoder lowers to: per layer one packed QKV MatMul, o_proj, three MLP MatMuls; plus lm_head
GQA_OPS = {"GroupQueryAttention": 2, "MatMul": 11}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_prefill_lengths_becomes_gqa_with_rotary_inside(exports: Any, family: str, exporter: str) -> None:
    path = exports(family, "prefill", exporter)
    model = _optimize(path, mask_format="lengths")
    ops = Counter(n.op_type for n in model.graph.node)
    for op, n in GQA_OPS.items():
        assert ops[op] == n, ops
    for gone in ("MultiHeadAttention", "RotaryEmbedding", "Expand", "Concat", "Softmax", "Cos", "Sin", "Transpose"):
        assert ops[gone] == 0, (gone, ops)  # no K/V repeat, no exporter rotary/present left
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
    assert attrs["do_rotary"] == 1 and attrs["kv_num_heads"] == 2 and attrs["num_heads"] == 4
    assert gqa.input[1] == "" and gqa.input[2] == ""  # packed QKV
    cfg = de.config(family, **CFG)
    for padding in ("none", "right"):  # the lengths form is exact for right padding
        feeds = de.feeds(cfg, "prefill", batch=2, seq=6, padding=padding)
        assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_decode_lengths_becomes_gqa_over_the_cache(exports: Any, exporter: str) -> None:
    path = exports("llama", "decode", exporter)
    model = _optimize(path, mask_format="lengths")
    ops = Counter(n.op_type for n in model.graph.node)
    for op, n in GQA_OPS.items():
        assert ops[op] == n, ops
    assert ops["Concat"] == 0 and ops["Expand"] == 0 and ops["MultiHeadAttention"] == 0, ops
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert [n.input[3] for n in gqa] == ["past_key_values.0.key", "past_key_values.1.key"]
    assert [n.output[1] for n in gqa] == ["present.0.key", "present.1.key"]
    cfg = de.config("llama", **CFG)
    # one token for a batch of 2; several tokens for a batch of 1 (ONNX Runtime's GQA takes S > 1 over a past
    # only for batch 1)
    for batch, seq in ((2, 1), (1, 4)):
        feeds = de.feeds(cfg, "decode", batch=batch, seq=seq, past=7)
        assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5


def _branches(model: onnx.ModelProto) -> list[dict[str, Counter[str]]]:
    """Each top-level ``If``'s branches: name -> op counts."""
    return [{a.name: Counter(n.op_type for n in a.g.node) for a in node.attribute}
            for node in model.graph.node if node.op_type == "If"]


#: the default's cases: (step, batch, new tokens, padding, GroupQueryAttention taken); a decode step takes it
#: only with every key present (the export puts the new token at P + s) and one token or one row (ONNX Runtime)
DEFAULT_CASES = [("prefill", 2, 6, "none", True), ("prefill", 2, 6, "right", True), ("prefill", 2, 6, "left", False),
                 ("prefill", 1, 5, "none", True),
                 ("decode", 2, 1, "none", True), ("decode", 1, 4, "none", True), ("decode", 2, 1, "left", False),
                 ("decode", 2, 3, "none", False)]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_default_checks_right_padding_on_the_device(exports: Any, exporter: str, step: str) -> None:
    """The default mask format: GroupQueryAttention where the graph checks at run time that the mask is right
    padded (an ``If`` per layer on one shared check), the exact MultiHeadAttention form (bias, K/V repeated)
    otherwise; the export's numbers either way, the branch taken as the check says."""
    path = exports("llama", step, exporter)
    model, report = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse"], options={"target": "ort"})
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["If"] == 2 and ops["GroupQueryAttention"] == 0 and ops["MultiHeadAttention"] == 0, ops
    assert ops["RotaryEmbedding"] == 0 and ops["Transpose"] == 0, ops  # the exact form's work sits in its branch
    assert ops["MatMul"] == 9, ops  # o_proj + MLP per layer, lm_head: the projections moved into the branches
    for branches in _branches(model):
        assert branches["then_branch"] == Counter({"MatMul": 1, "GroupQueryAttention": 1}), branches
        assert branches["else_branch"]["MultiHeadAttention"] == 1 and branches["else_branch"]["RotaryEmbedding"] == 2
        assert branches["else_branch"]["GroupQueryAttention"] == 0
    lower = next(p for p in report.to_dict()["passes"] if p["name"] == "lower")
    stats = lower["stats"]
    assert (stats["attention.gqa_rotary"], stats["attention.padding_check"], stats["padding_checks"]) == (2, 2, 1)
    assert stats.get("attention.kv_cache", 0) == (2 if step == "decode" else 0)
    cfg = de.config("llama", **CFG)
    for kind, batch, seq, padding, fast in DEFAULT_CASES:
        if kind != step:
            continue
        feeds = de.feeds(cfg, step, batch=batch, seq=seq, past=7, padding=padding)
        assert if_decisions(model, feeds) == [fast, fast], (batch, seq, padding)
        assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5, (batch, seq, padding)


def test_default_check_refuses_a_mask_other_than_zeros_and_ones(exports: Any) -> None:
    """A mask value 2 (nonzero: a key the export attends to) would give a wrong key length: the exact branch."""
    path = exports("llama", "prefill", "torchscript")
    model = _optimize(path)
    feeds = de.feeds(de.config("llama", **CFG), "prefill", batch=2, seq=6)
    feeds["attention_mask"][0, 0] = 2
    assert if_decisions(model, feeds) == [False, False]
    assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5


@pytest.mark.parametrize("fmt", ["lengths", "bias"])
def test_one_token_dynamo_decode_becomes_gqa_with_rotary(tmp_path: Path, fmt: str) -> None:
    """A dynamo decode step traced with exactly one new token (its token dim static 1: ``arange(1)`` folded to the
    constant ``[0]``, the key count ``P + 1``) is proven like the others: GroupQueryAttention with the rotary inside."""
    cfg = de.config("llama", **CFG)
    path = de.export(cfg, "decode", "dynamo", tmp_path / "decode1.onnx", tokens=1)
    model = _optimize(path, mask_format=fmt)
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    gqa += [n for b in model.graph.node if b.op_type == "If" for a in b.attribute if a.name == "then_branch"
            for n in a.g.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(onnx.helper.get_attribute_value(a) == 1 for n in gqa for a in n.attribute
                                 if a.name == "do_rotary")
    assert Counter(n.op_type for n in model.graph.node)["MultiHeadAttention"] == 0
    for padding in ("none", "left") if fmt == "bias" else ("none",):
        feeds = de.feeds(cfg, "decode", batch=2, seq=1, past=7, padding=padding)
        assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5


def test_lengths_is_not_exact_for_left_padding(exports: Any) -> None:
    """The documented limit of the opt-in: a left-padded row differs (so the test of exactness above can fail)."""
    path = exports("llama", "prefill", "torchscript")
    model = _optimize(path, mask_format="lengths")
    feeds = de.feeds(de.config("llama", **CFG), "prefill", batch=2, seq=6, padding="left")
    assert _max_diff(_run(path, feeds), _run(model, feeds)) > 1e-2


@pytest.mark.parametrize("fmt", ["lengths", "bias"])
def test_second_lowering_changes_nothing(exports: Any, fmt: str) -> None:
    model = _optimize(exports("llama", "decode", "dynamo"), mask_format=fmt)
    again, report = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort", "mask_format": fmt})
    assert Counter(n.op_type for n in again.graph.node) == Counter(n.op_type for n in model.graph.node)
    lowered = [p for p in report.to_dict()["passes"] if p["name"] == "lower"]
    assert all(not p["modified"] for p in lowered), lowered


def test_fp16_decode_keeps_gqa(exports: Any, tmp_path: Path) -> None:
    path = exports("llama", "decode", "dynamo")
    cfg = de.config("llama", **CFG)
    feeds = de.feeds(cfg, "decode", batch=2, seq=1, past=7)
    np.savez(tmp_path / "calib.npz", **feeds)
    model, _ = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse", "fp16"],
                                options={"target": "ort", "mask_format": "lengths", "fp16_io": "yes",
                                         "calibration_data": str(tmp_path / "calib.npz")})
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["MatMul"] == 11, ops
    half = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in feeds.items()}
    assert _max_diff(_run(path, feeds), _run(model, half)) < 5e-3
    report = cuda_graph_check(ir.serde.deserialize_model(model))
    assert report.capturable, report.blockers  # only Shape -> Cast -> Squeeze (total_sequence_length) on the host


def test_default_decode_step_is_not_capturable(exports: Any) -> None:
    """The default form (an If per layer on the padding check, computed from shapes) is named as blocking: the
    capturable form is the opt-in ``--kv-cache shared``."""
    model = _optimize(exports("llama", "decode", "dynamo"))
    report = cuda_graph_check(ir.serde.deserialize_model(model), limit=1000)
    assert not report.capturable and report.blockers and all(b["reason"] for b in report.blockers)
    assert [b["op"] for b in report.blockers].count("If") == 2, report.blockers


@pytest.mark.parametrize(("options", "gqa"), [({"mask_format": "lengths"}, 2), ({"mask_format": "raw"}, 0),
                                               ({"kv_cache": "shared"}, 2)])
def test_opt_ins_write_no_check(exports: Any, options: dict[str, str], gqa: int) -> None:
    """Near misses of the check: ``lengths`` and ``--kv-cache shared`` assume right padding (plain
    GroupQueryAttention, no If: capturable), ``raw`` takes no GroupQueryAttention at all."""
    model = _optimize(exports("llama", "decode", "dynamo"), **options)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["If"] == 0 and ops["GroupQueryAttention"] == gqa, ops


MAX_LEN = 32


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_kv_cache_shared_greedy_loop_matches_the_export(exports: Any, exporter: str) -> None:
    """``--kv-cache shared``: each layer's past and present bound to ONE ``[B, G, MAX, D]`` buffer (ONNX Runtime IO
    binding, the same OrtValue as input and output), the ``[B, MAX]`` mask ones then zeros: every step has the same
    shapes, and a greedy loop gives the export's logits and tokens (the export run with its growing Concat cache)."""
    path = exports("llama", "decode", exporter)
    model = _optimize(path, kv_cache="shared")
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["Concat"] == 0, ops
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["past_key_values.0.key"][2] == "max_sequence_length" == dims["present.0.key"][2]
    cfg = de.config("llama", **CFG)
    start = de.feeds(cfg, "decode", batch=1, seq=1, past=3)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    opt = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    layers = cfg.num_hidden_layers
    names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    # reference: the export, cache grown by its Concat
    feeds = dict(start)
    ref_logits, ref_tokens = [], []
    for _ in range(6):
        out = ref.run(None, feeds)
        ref_logits.append(out[0])
        token = int(out[0][0, -1].argmax())
        ref_tokens.append(token)
        past_len = out[1].shape[2]
        feeds = {"input_ids": np.array([[token]], dtype=np.int64),
                 "attention_mask": np.ones((1, past_len + 1), dtype=np.int64)}
        feeds.update({n: o for n, o in zip(names, out[1:])})
    # shared: one static buffer per past/present pair
    buffers = {}
    for n in names:
        buf = np.zeros((1, 2, MAX_LEN, 32), dtype=np.float32)
        buf[:, :, :3] = start[n]
        buffers[n] = ort.OrtValue.ortvalue_from_numpy(buf)
    mask = np.zeros((1, MAX_LEN), dtype=np.int64)
    token_ids = start["input_ids"]
    length = 4  # 3 past + the new token
    tokens, max_diff = [], 0.0
    for step in range(6):
        mask[0, :length] = 1
        binding = opt.io_binding()
        binding.bind_cpu_input("input_ids", token_ids)
        binding.bind_cpu_input("attention_mask", mask)
        binding.bind_output("logits")
        for n in names:
            binding.bind_ortvalue_input(n, buffers[n])
            binding.bind_ortvalue_output(n.replace("past_key_values", "present"), buffers[n])
        opt.run_with_iobinding(binding)
        logits = binding.copy_outputs_to_cpu()[0]
        max_diff = max(max_diff, float(np.abs(logits - ref_logits[step]).max()))
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        token_ids = np.array([[token]], dtype=np.int64)
        length += 1
    assert tokens == ref_tokens
    assert max_diff < 1e-5
    for n, present in zip(names, out[1:]):  # the kernel wrote each step's K/V into the shared buffer in place
        total = present.shape[2]
        assert np.abs(buffers[n].numpy()[:, :, :total] - present).max() < 1e-5
        assert not buffers[n].numpy()[:, :, total:].any()


@pytest.mark.parametrize("tokens", [1, 3])
def test_target_mograph_keeps_the_presents_typed(tmp_path: Path, tokens: int) -> None:
    """``--target mograph`` (no lowering) on a dynamo decode step: the fused rotary's cache Concat, which becomes the
    present output, keeps the output's declared type and shape (untyped, the output check refused the model)."""
    cfg = de.config("llama", **CFG)
    path = de.export(cfg, "decode", "dynamo", tmp_path / f"decode{tokens}.onnx", tokens=tokens)
    model, _ = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse"], options={"target": "mograph"})
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Attention"] == 2 and ops["RotaryEmbedding"] == 4
    original = {o.name: o.type for o in onnx.load(path).graph.output}
    assert {o.name: o.type for o in model.graph.output} == original
    feeds = de.feeds(cfg, "decode", batch=2, seq=tokens, past=7)
    assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_int4_with_random_calibration_on_a_decode_step(exports: Any, exporter: str) -> None:
    """``--passes int4 --calibration-random`` on a decode step: the random mask is ``past + new`` long (sized 1 like
    the other dynamic dims, the export rejected the feed and weight-only failed with an internal error)."""
    path = exports("llama", "decode", exporter)
    model, _ = mograph.optimize(onnx.load(path), passes=["int4"], options={"calibration_random": 2})
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["WeightOnlyMatMul"] == 14 and ops["MatMul"] - Counter(
        n.op_type for n in onnx.load(path).graph.node)["MatMul"] == -14
    feeds = de.feeds(de.config("llama", **CFG), "decode", batch=2, seq=3, past=7)
    ref, got = _run(path, feeds), _run(model, feeds)
    cos = float(np.dot(ref[0].ravel(), got[0].ravel()) / (np.linalg.norm(ref[0]) * np.linalg.norm(got[0])))
    assert cos > 0.99
