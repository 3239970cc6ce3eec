"""``fuse-embed-layernorm`` on real DistilBERT exports: word + position lookups and their LayerNorm, no token type
table.  They went to ``SkipLayerNorm`` (the Add and the norm: ``SkipLayerNormFusion.plain``) and kept their
Gathers; they now fuse into ``EmbedLayerNorm``, lowered for ``ort`` to ``EmbedLayerNormalization`` without segment
inputs.

``DistilBertModel`` (transformers' own code, a tiny config, seeded random weights: nothing is downloaded) exported
by TorchScript at opsets 14 (the norm written out) and 17, and by dynamo at 18, with its three position forms:
``buffer`` (the ``position_ids`` buffer sliced to ``inputs_embeds.size(1)``: TorchScript reads it as a ``Shape`` of the
word rows, dynamo from the mask's shape), ``range`` (no buffer: ``torch.arange(S).unsqueeze(0).expand_as(ids)``,
transformers' fallback) and ``input`` (``position_ids`` a graph input).  Each fused model (targets ``onnx`` and
``ort``) agrees with the export under ONNX Runtime with its optimizations off, and a second run does nothing.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mograph.pass_infra import graph_fingerprint  # noqa: E402
from mograph.plugins import get_registry  # noqa: E402
from mograph.testing import assert_close, op_counts, run_ort, to_ir, to_proto  # noqa: E402

VOCAB, MAXPOS, HIDDEN, LAYERS = 200, 128, 64, 1  # (the larger table is taken for the word one where nothing else tells)
RULES = ("LayerNormFusion", "EmbedLayerNormFusion", "SkipLayerNormFusion")


def _module(positions: str) -> torch.nn.Module:
    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=4,
                                           hidden_dim=2 * HIDDEN, max_position_embeddings=MAXPOS,
                                           attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.DistilBertModel(config).eval()
        with torch.no_grad():  # noise on every parameter: no bias 0, no norm weight 1
            for _, param in sorted(model.named_parameters()):
                param.add_(0.02 * torch.randn(param.shape))
    if positions == "range":
        del model.embeddings.position_ids  # transformers then builds them with torch.arange

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              return_dict=True).last_hidden_state

    return Wrapper().eval()


def _feeds(positions: str, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64),
             "attention_mask": np.ones((batch, seq), np.int64)}
    feeds["attention_mask"][0, seq // 2:] = 0  # padding in the first row
    if positions == "input":
        feeds["position_ids"] = rng.integers(0, MAXPOS, (batch, seq)).astype(np.int64)
    return feeds


def _export(export_dir: Path, positions: str, exporter: str, opset: int) -> Path:
    path = export_dir / f"distilbert_{positions}_{exporter}_{opset}.onnx"
    if path.exists():
        return path
    feeds = _feeds(positions, 2, 16, 0)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names = list(feeds)
    with torch.no_grad():
        if exporter == "torchscript":
            axes = {name: {0: "batch", 1: "seq"} for name in [*names, "y"]}
            torch.onnx.export(_module(positions), args, str(path), input_names=names, output_names=["y"],
                              opset_version=opset, dynamo=False, dynamic_axes=axes)
        else:
            dims = {0: torch.export.Dim("batch", max=1024), 1: torch.export.Dim("seq", max=MAXPOS)}
            torch.onnx.export(_module(positions), args, str(path), input_names=names, output_names=["y"],
                              opset_version=opset, dynamo=True, external_data=False, verbose=False,
                              dynamic_shapes={name: dict(dims) for name in names})
    return path


def _fuse(model, target: str) -> Counter:
    reg = get_registry()
    stats: Counter = Counter()
    for p in reg.instantiate(reg.plan("fuse", {"target": target}), {"target": target}):
        result = p.call(model)
        stats.update({k: v for k, v in result.stats.items() if k.split(".")[0] in RULES or k.startswith("embed_")})
    return stats


CASES = [pytest.param(pos, "torchscript", opset, id=f"{pos}-torchscript-{opset}")
         for pos in ("buffer", "range", "input") for opset in (14, 17)]
CASES += [pytest.param(pos, "dynamo", 18, id=f"{pos}-dynamo-18", marks=[pytest.mark.slow])  # 5-10 s an export
          for pos in ("buffer", "range", "input")]


@pytest.mark.parametrize("positions,exporter,opset", CASES)
def test_distilbert_embeddings_fuse(export_dir: Path, positions: str, exporter: str, opset: int) -> None:
    import onnx

    proto = onnx.load(str(_export(export_dir, positions, exporter, opset)))
    decomposed = exporter == "torchscript" and opset < 17
    implicit = positions != "input"  # 0 .. S-1: the kernel's own positions
    for target in ("onnx", "ort"):
        model = to_ir(proto)
        stats = _fuse(model, target)
        norm = "mograph" if decomposed else "standard"
        assert stats["EmbedLayerNormFusion"] == 1 and stats[f"EmbedLayerNormFusion.{norm}.no-segment"] == 1, stats
        assert stats["SkipLayerNormFusion"] == 2 * LAYERS and "SkipLayerNormFusion.plain" not in stats, stats
        assert stats["LayerNormFusion"] == (2 * LAYERS + 1 if decomposed else 0)
        for batch, seq, seed in ((2, 16, 1), (3, 5, 2), (1, 1, 3)):
            feeds = _feeds(positions, batch, seq, seed)
            assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), rel=1e-4)
        if target == "onnx":
            assert not any(k.startswith("mograph.") for k in op_counts(model))
            continue
        assert stats["embed_no_segment"] == 1 and stats.get("embed_implicit_positions", 0) == int(implicit), stats
        (node,) = [n for n in model.graph if n.op_type == "EmbedLayerNormalization"]
        assert node.inputs[1] is None and node.inputs[4] is None  # no segment ids, no segment table
        assert len(node.inputs) == (7 if implicit else 9)
        assert node.inputs[2].const_value.shape[0] == VOCAB and node.inputs[3].const_value.shape[0] == MAXPOS
        if implicit:  # the position ids' shape subgraph went with them: only the mask's computation reads shapes
            assert op_counts(model).get("Range", 0) == 0
        before = graph_fingerprint(model)
        assert not {k: v for k, v in _fuse(model, target).items() if k.split(".")[0] in RULES}  # second run
        assert graph_fingerprint(model) == before
