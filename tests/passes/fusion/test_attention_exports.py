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

import os
from pathlib import Path

import onnx
import pytest

pytestmark = pytest.mark.torch

pytest.importorskip("torch")
pytest.importorskip("transformers")

from _fusion_util import assert_close, lowered, op_counts, run_ort, to_ir, to_proto  # noqa: E402
from mograph.passes.fusion.attention import FuseAttentionPass  # noqa: E402

from models import attention_corpus as corpus  # noqa: E402
from mograph.pass_infra import graph_fingerprint  # noqa: E402
from mograph.plugins import get_registry  # noqa: E402

C = corpus.Case
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
]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("MOGRAPH_TEST_EXPORT_DIR")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    return tmp_path_factory.mktemp("corpus")


def _preset(model, config: dict) -> dict:
    reg = get_registry()
    stats: dict = {}
    for p in reg.instantiate(reg.plan("cleanup,fuse", config), config):
        for k, v in p.call(model).stats.items():
            if k.startswith(("AttentionFusion", "lowered.Attention", "kept.Attention")):
                stats[k] = stats.get(k, 0) + v
    return stats


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_corpus_export_fuses_every_attention(corpus_dir: Path, case: corpus.Case) -> None:
    path = corpus_dir / f"{case.name}.onnx"
    if not path.exists():
        corpus.export(case, path)
    proto = onnx.load(str(path))
    feeds = corpus.feeds(case)
    model = to_ir(proto)
    stats = _preset(model, {"target": "ort"})
    n = case.attention_count
    assert stats["AttentionFusion"] == n and stats["lowered.Attention"] == n, stats
    left = op_counts(model)
    assert left["com.microsoft.MultiHeadAttention"] == n and "Softmax" not in left, left
    assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-4)
    before = graph_fingerprint(model)
    assert not lowered(FuseAttentionPass(), "ort").call(model).modified
    assert graph_fingerprint(model) == before


@pytest.mark.parametrize("case", [C("bert", "torchscript", "eager", "pad"), C("bert", "dynamo", "eager", "pad")],
                         ids=lambda c: c.name)
def test_corpus_bert_lengths(corpus_dir: Path, case: corpus.Case) -> None:
    """--mask-format lengths on a real export: the padding mask becomes 1-D key lengths where it is traced
    (TorchScript's index lookup with a finite fill); dynamo's GatherND lookup is not traced and keeps the exact
    bias (so do sdpa's -inf fills)."""
    path = corpus_dir / f"{case.name}.onnx"
    if not path.exists():
        corpus.export(case, path)
    proto = onnx.load(str(path))
    model = to_ir(proto)
    _preset(model, {"target": "ort", "mask_format": "lengths"})
    left = op_counts(model)
    assert left["com.microsoft.MultiHeadAttention"] == case.attention_count
    assert left.get("ReduceSum", 0) == (1 if case.exporter == "torchscript" else 0), left
    assert_close(run_ort(proto, corpus.feeds(case)), run_ort(to_proto(model), corpus.feeds(case)), 1e-4)
