"""fuse-attention on real exports of the attention corpus (:mod:`models.attention_corpus`).

Each case is exported once per session (``MOGRAPH_TEST_EXPORT_DIR`` keeps them), then ``cleanup,fuse
--target ort`` must fuse every attention instance into ``com.microsoft.MultiHeadAttention``, leave no
``Softmax``, agree with the export on ONNX Runtime CPU (optimizations off, right-padded feeds), and
change nothing on a second run.  The cases cover both exporters, transformers' ``eager`` and ``sdpa``
attention, with and without a padding mask, encoder self-attention (BERT, ViT, Whisper's encoder), causal
decoder self-attention (GPT-2), rotary grouped-query attention (LLaMA: 8 query / 2 KV heads) and
cross-attention (Whisper's decoder), and decode steps with a KV cache (GPT-2, LLaMA).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import pytest

pytestmark = pytest.mark.torch

pytest.importorskip("torch")
pytest.importorskip("transformers")

from _fusion_util import lowered  # noqa: E402
from mograph.passes.fusion.attention import FuseAttentionPass  # noqa: E402

from models import attention_corpus as corpus  # noqa: E402
from mograph.pass_infra import graph_fingerprint  # noqa: E402
from mograph.plugins import get_registry  # noqa: E402
from mograph.testing import assert_close, op_counts, run_ort, to_ir, to_proto  # noqa: E402

C = corpus.Case
#: families whose every attention is self-attention over `x @ W (+ b)` projections: lowered with packed QKV
PACKED_FAMILIES = {"bert", "roberta", "vit", "whisper-enc"}
CASES = [
    C("bert", "torchscript", "sdpa", "pad"), C("bert", "dynamo", "sdpa", "pad"), C("bert", "dynamo", "eager", "none"),
    C("roberta", "torchscript", "sdpa", "none"), C("vit", "torchscript", "sdpa", "none"), C("vit", "dynamo", "sdpa", "none"),
    C("whisper-enc", "torchscript", "eager", "none"), C("whisper-enc", "dynamo", "sdpa", "none"),
    C("gpt2", "torchscript", "eager", "pad"), C("gpt2", "torchscript", "sdpa", "none"), C("gpt2", "dynamo", "sdpa", "pad"),
    C("whisper-dec", "torchscript", "sdpa", "pad"), C("whisper-dec", "dynamo", "eager", "none"),
    C("llama", "torchscript", "eager", "pad"), C("llama", "dynamo", "sdpa", "pad"),
    # one decode step with a KV cache (past_key_i/past_value_i in, present_key_i/present_value_i out)
    C("gpt2", "torchscript", "sdpa", "cache"), C("llama", "torchscript", "eager", "cache"),
    C("llama", "dynamo", "sdpa", "cache"),
    # no padding mask: the causal mask is the kernel's own (unidirectional MultiHeadAttention, GroupQueryAttention)
    C("gpt2", "dynamo", "eager", "none"), C("llama", "dynamo", "eager", "none"), C("llama", "torchscript", "eager", "none"),
]
#: cases whose causal mask is provably causal and unpadded: (kernel, how many of the instances)
CAUSAL = {"gpt2-dynamo-eager-none": "MultiHeadAttention", "llama-dynamo-eager-none": "GroupQueryAttention",
          "llama-torchscript-eager-none": "GroupQueryAttention"}


def _preset(model, config: dict) -> dict:
    reg = get_registry()
    stats: dict = {}
    for p in reg.instantiate(reg.plan("cleanup,fuse", config), config):
        for k, v in p.call(model).stats.items():
            if k.startswith(("AttentionFusion", "lowered.Attention", "kept.Attention")):
                stats[k] = stats.get(k, 0) + v
    return stats


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.exporter == "dynamo" else [])
                                  for c in CASES])  # dynamo exports: slow (5-7 s each); CI runs them all
def test_corpus_export_fuses_every_attention(export_dir: Path, case: corpus.Case) -> None:
    path = export_dir / f"{case.name}.onnx"
    if not path.exists():
        corpus.export(case, path)
    proto = onnx.load(str(path))
    feeds = corpus.feeds(case)
    model = to_ir(proto)
    stats = _preset(model, {"target": "ort"})
    n = case.attention_count
    assert stats["AttentionFusion"] == n and stats["lowered.Attention"] == n, stats
    left = op_counts(model)
    guarded = left["If"]  # the default's run-time right-padding check: GroupQueryAttention, else the exact form
    assert guarded == (n if case.family == "llama" and case.mask in ("pad", "cache") else 0), left
    if guarded:  # what follows reads the exact (else) branches
        every = Counter(f"{x.domain}.{x.op_type}" if x.domain else x.op_type for x in model.graph.all_nodes())
        assert every["com.microsoft.GroupQueryAttention"] == n and every["com.microsoft.MultiHeadAttention"] == n
        left = every - Counter({"com.microsoft.GroupQueryAttention": n})
    packed, separate = left["com.microsoft.Attention"], left["com.microsoft.MultiHeadAttention"]
    grouped = left["com.microsoft.GroupQueryAttention"]
    assert packed + separate + grouped == n and "Softmax" not in left, left
    kernels = [x for x in model.graph.all_nodes() if x.domain == "com.microsoft" and "Attention" in x.op_type
               and not (guarded and x.op_type == "GroupQueryAttention")]
    if case.name in CAUSAL:  # no bias: the kernel's causal mask (GQA is causal by itself)
        assert all(k.op_type == CAUSAL[case.name] and (k.op_type == "GroupQueryAttention" or len(k.inputs) <= 4)
                   for k in kernels), left  # MultiHeadAttention: Q, K, V (and the projection's bias), no mask
        assert all(k.op_type == "GroupQueryAttention" or k.attributes["unidirectional"].value == 1 for k in kernels)
    elif case.mask == "cache" and case.family == "gpt2":  # the past into the kernel, its present outputs out
        assert {o.producer().op_type for o in model.graph.outputs[1:]} == {"MultiHeadAttention"}, left
        assert all(k.inputs[6] is not None and k.inputs[6].is_graph_input() for k in kernels)
        # the step's new K/V go in as the exporter's own [B, 1, H] projections: no Transpose/Reshape back and forth
        assert "Transpose" not in left, left
    elif case.mask == "cache" and case.family == "llama":  # masked grouped decode: the cache repeated as it is
        for kern in kernels:  # [B, G, P+1, D] -> Unsqueeze -> Expand -> Reshape [B, N, P+1, D], never transposed
            chain, x = [], kern.inputs[1]
            while x is not None and x.producer() is not None and len(chain) < 4:
                chain.append(x.producer().op_type)
                x = x.producer().inputs[0]
            assert chain == ["Reshape", "Expand", "Unsqueeze", "Concat"], chain
        # the new keys' rotary fused too (the present Concat rebuilt after it): a kernel for Q and for K
        assert left["com.microsoft.RotaryEmbedding"] == 2 * n and "Neg" not in left, left
        assert [o.name for o in model.graph.outputs] == [o.name for o in proto.graph.output]
        assert separate == n, left
    elif case.family in PACKED_FAMILIES:  # self-attention, x @ W + b projections: one QKV GEMM in the op
        assert packed == n, left
    elif case.family == "whisper-dec":  # self-attention packed, cross-attention (K/V of the encoder) separate
        assert packed == separate == n // 2, left
    else:  # Conv1D's one fused projection then Split, grouped KV heads, KV cache: MultiHeadAttention
        assert separate == n, left
        # Conv1D's Gemm bias into the kernel (TorchScript sdpa: another reader of the Q/K/V split keeps it)
        if case.family == "gpt2" and case.exporter == "torchscript" and case.attn == "eager":
            assert all(k.inputs[3] is not None for k in kernels), left
            assert not [g for g in model.graph if g.op_type == "Gemm" and len(g.inputs) == 3
                        and "c_attn" in g.name], left
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)
    before = graph_fingerprint(model)
    assert not lowered(FuseAttentionPass(), "ort").call(model).modified
    assert graph_fingerprint(model) == before


@pytest.mark.parametrize("case", [C("bert", "torchscript", "eager", "pad"), C("bert", "dynamo", "eager", "pad")],
                         ids=lambda c: c.name)
def test_corpus_bert_lengths(export_dir: Path, case: corpus.Case) -> None:
    """--mask-format lengths on a real export: the padding mask becomes 1-D key lengths where it is traced
    (TorchScript's flat index lookup and dynamo's GatherND lookup, with a finite fill; sdpa's -inf fills keep the
    exact bias)."""
    path = export_dir / f"{case.name}.onnx"
    if not path.exists():
        corpus.export(case, path)
    proto = onnx.load(str(path))
    model = to_ir(proto)
    _preset(model, {"target": "ort", "mask_format": "lengths"})
    left = op_counts(model)
    assert left["com.microsoft.Attention"] == case.attention_count  # packed Q/K/V, 1-D mask_index or bias
    assert left.get("ReduceSum", 0) == 1, left
    assert_close(run_ort(proto, corpus.feeds(case)), run_ort(to_proto(model), corpus.feeds(case)), 1e-4)


def _export_whisper_decode_step(path: Path, attn: str) -> dict:
    """A 2-layer Whisper decoder (hidden 64, 4 heads), one decode step: self-attention over a KV cache of 5
    (``past_key_i``/``past_value_i`` in, ``present_key_i``/``present_value_i`` out), cross-attention over
    ``encoder_hidden_states`` [B, 16, 64]; TorchScript export.  Returns seeded feeds (row 1 left-padded)."""
    import numpy as np
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.WhisperConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=64, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, decoder_start_token_id=1, attn_implementation=attn)
    decoder = tf.WhisperModel(cfg).decoder.eval()

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = decoder

        def forward(self, ids, enc, mask, pk0, pv0, pk1, pv1):  # type: ignore[no-untyped-def]
            own = tf.DynamicCache(config=cfg)
            own.update(pk0, pv0, 0)
            own.update(pk1, pv1, 1)
            out = self.m(input_ids=ids, encoder_hidden_states=enc, attention_mask=mask, use_cache=True,
                         past_key_values=tf.EncoderDecoderCache(own, tf.DynamicCache(config=cfg)), return_dict=True)
            c = out.past_key_values.self_attention_cache
            return out.last_hidden_state, c.layers[0].keys, c.layers[0].values, c.layers[1].keys, c.layers[1].values

    b, past = 2, 5
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(3, 100, (b, 1)), "encoder_hidden_states": rng.standard_normal((b, 16, 64)),
             "attention_mask": np.ones((b, past + 1), dtype=np.int64)}
    feeds["attention_mask"][1, :2] = 0
    for i in range(2):
        for kv in ("key", "value"):
            feeds[f"past_{kv}_{i}"] = rng.standard_normal((b, 4, past, 16))
    feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
    names = list(feeds)
    outs = ["last_hidden_state", "present_key_0", "present_value_0", "present_key_1", "present_value_1"]
    axes = {"input_ids": {0: "batch"}, "encoder_hidden_states": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"}}
    axes.update({n: {0: "batch", 2: "past"} for n in names[3:]})
    axes.update({n: {0: "batch", 2: "total"} for n in outs[1:]})
    if not path.exists():
        with torch.no_grad():
            torch.onnx.export(Step().eval(), tuple(torch.from_numpy(v) for v in feeds.values()), str(path),
                              input_names=names, output_names=outs, dynamic_axes=axes, opset_version=17, dynamo=False)
    return feeds


def test_whisper_decoder_kv_cache_into_multihead_attention(export_dir: Path) -> None:
    """Whisper's decoder, one decode step: each self-attention gets past_key/past_value and gives the present
    outputs (the exporter's Concats gone), the cross-attention stays MultiHeadAttention over the encoder states;
    equal to the export on ORT CPU with a left-padded row."""
    path = export_dir / "whisper-dec-torchscript-eager-step.onnx"
    feeds = _export_whisper_decode_step(path, "eager")
    proto = onnx.load(str(path))
    model = to_ir(proto)
    stats = _preset(model, {"target": "ort"})
    assert stats["AttentionFusion"] == 4 and stats["lowered.Attention"] == 4, stats
    kernels = [n for n in model.graph if n.domain == "com.microsoft" and "Attention" in n.op_type]
    assert [k.op_type for k in kernels] == ["MultiHeadAttention"] * 4
    cached = [k for k in kernels if len(k.inputs) > 6 and k.inputs[6] is not None]
    assert [k.inputs[6].name for k in cached] == ["past_key_0", "past_key_1"]
    assert {o.producer().op_type for o in model.graph.outputs[1:]} == {"MultiHeadAttention"}
    assert "Concat" not in {n.op_type for n in model.graph if any(o.is_graph_output() for o in n.outputs)}
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)



#: ``cleanup,fuse --target ort`` on Whisper's decoder step (2 layers): every op left, pinned.  Each self-attention's
#: new K/V reach MultiHeadAttention as the exporter's own ``[B, 1, G*D]`` projections (the shape query proves the
#: ``Reshape`` to ``[B, S, G, D]`` only splits the last dim), so no Transpose + Reshape pair rebuilds them: 104
#: nodes, where reading the Reshape target by its spelled structure left 120 (8 Transpose and 8 Reshape more).
WHISPER_STEP_ORT_OPS = {
    "Add": 11, "And": 2, "Cast": 1, "Concat": 3, "Constant": 13, "ConstantOfShape": 2, "Equal": 1, "Expand": 2,
    "Flatten": 1, "Gather": 7, "LessOrEqual": 1, "MatMul": 20, "Mul": 2, "Range": 3, "Reshape": 1, "Shape": 6,
    "Tile": 1, "Unsqueeze": 12, "Where": 2, "com.microsoft.BiasGelu": 2, "com.microsoft.MultiHeadAttention": 4,
    "com.microsoft.SkipLayerNormalization": 7,
}


def test_whisper_decoder_step_ort_op_counts(export_dir: Path) -> None:
    """The lowered Whisper decode step keeps exactly :data:`WHISPER_STEP_ORT_OPS` (104 nodes, no Transpose, one
    Reshape) and equals the export on ORT CPU with a left-padded row."""
    path = export_dir / "whisper-dec-torchscript-eager-step.onnx"
    feeds = _export_whisper_decode_step(path, "eager")
    proto = onnx.load(str(path))
    model = to_ir(proto)
    _preset(model, {"target": "ort"})
    left = op_counts(model)
    assert dict(left) == WHISPER_STEP_ORT_OPS, dict(left)
    assert sum(left.values()) == len(list(model.graph)) == 104
    assert "Transpose" not in left and left["Reshape"] == 1, left
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)

def test_corpus_llama_lengths_group_query_attention(export_dir: Path) -> None:
    """--mask-format lengths on LLaMA's TorchScript export: the causal + key-padding mask becomes
    GroupQueryAttention's own causal mask with ``seqlens_k = ReduceSum(mask) - 1`` (K/V not repeated), equal to
    the export on right-padded feeds; the default ``bias`` keeps MultiHeadAttention over the dense bias."""
    case = C("llama", "torchscript", "eager", "pad")
    path = export_dir / f"{case.name}.onnx"
    if not path.exists():
        corpus.export(case, path)
    proto = onnx.load(str(path))
    model = to_ir(proto)
    _preset(model, {"target": "ort", "mask_format": "lengths"})
    left = op_counts(model)
    assert left["com.microsoft.GroupQueryAttention"] == case.attention_count and left["ReduceSum"] == 1, left
    assert "com.microsoft.MultiHeadAttention" not in left, left
    assert_close(run_ort(proto, corpus.feeds(case)), run_ort(to_proto(model), corpus.feeds(case)), 1e-4)
