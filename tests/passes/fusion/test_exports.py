"""The ``fuse`` preset on real exports: BERT, GPT-2, ViT, LLaMA, both torch exporters, opsets 14/17/18.

Models come from :mod:`models.export_hf` (tiny configs, random weights: 2 layers, hidden 64), exported
once per session (set ``MOGRAPH_TEST_EXPORT_DIR`` to keep them between sessions).  For each model we
assert the exact count of every fusion, that no LayerNorm/RMSNorm/GELU is left unfused, and that the
fused model (targets ``onnx`` and ``ort``) agrees with the original under ONNX Runtime with its own
optimizations off: max abs error <= 1e-4 of the output scale.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from models import export_hf  # noqa: E402
from mograph.pass_infra import graph_fingerprint  # noqa: E402
from mograph.plugins import get_registry  # noqa: E402
from mograph.testing import assert_close, op_counts, run_ort, to_ir, to_proto  # noqa: E402

L = 2  # layers
# What each architecture holds with L layers: norms and GELUs.
NORMS = {"bert": 2 * L + 1, "gpt2": 2 * L + 1, "vit": 2 * L + 1, "llama": 2 * L + 1}

# Exact fusion counts per (kind, exporter, opset).  LayerNormFusion counts decomposed LayerNorms
# (TorchScript below opset 17; above it the exporters already emit LayerNormalization, which
# SkipLayerNormFusion then takes together with its residual Add).
EXPECTED: dict[tuple[str, str, int], dict[str, int]] = {}
for _ex, _ops in (("torchscript", (14, 17, 18)), ("dynamo", (17, 18))):
    for _op in _ops:
        ln = NORMS["bert"] if (_ex == "torchscript" and _op < 17) else 0
        # BERT's embeddings and their LayerNorm go to EmbedLayerNorm; the other 2L norms read residual sums
        EXPECTED[("bert", _ex, _op)] = {"LayerNormFusion": ln, "EmbedLayerNormFusion": 1, "SkipLayerNormFusion": 2 * L,
                                        "GeluFusion": L, "BiasGeluFusion": L}
        # GPT-2's Conv1D is Gemm + bias: the bias goes into four of the five Skip norms and into the GELU
        EXPECTED[("gpt2", _ex, _op)] = {"LayerNormFusion": ln, "SkipLayerNormFusion": 1,
                                        "SkipLayerNormGemmBiasFusion": 2 * L, "GeluTanhFusion": L,
                                        "GemmBiasGeluFusion": L}
        EXPECTED[("vit", _ex, _op)] = {"LayerNormFusion": ln, "SkipLayerNormFusion": 5, "GeluFusion": L,
                                       "BiasGeluFusion": L}
for _ex, _ops in (("torchscript", (14, 17, 18)), ("dynamo", (14, 17, 18))):
    for _op in _ops:
        # every RMSNorm but the first layer's input norm reads a residual sum
        EXPECTED[("llama", _ex, _op)] = {"RMSNormFusion": NORMS["llama"], "SkipRMSNormFusion": 2 * L}
CASES = sorted(k for k in EXPECTED if k[2] in export_hf.SUPPORTED.get((k[0], k[1]), ()))

RULES = ("LayerNormFusion", "RMSNormFusion", "EmbedLayerNormFusion", "SkipLayerNormFusion", "SkipLayerNormGemmBiasFusion", "SkipRMSNormFusion",
         "GeluFusion", "GeluTanhFusion", "QuickGeluFusion", "BiasGeluFusion", "GemmBiasGeluFusion")


def _export(export_dir: Path, kind: str, exporter: str, opset: int) -> Path:
    path = export_dir / f"{kind}_{exporter}_{opset}.onnx"
    if not path.exists():
        export_hf.export(kind, path, exporter=exporter, opset=opset, layers=L)
    return path


def _fuse(model, target: str) -> Counter:
    reg = get_registry()
    stats: Counter = Counter()
    for p in reg.instantiate(reg.plan("fuse", {"target": target}), {"target": target}):
        result = p.call(model)
        stats.update({k: v for k, v in result.stats.items() if k in RULES})
    return stats


#: dynamo exports take 5-10 s each: slow (the quick run keeps the TorchScript ones; CI runs all)
_CASE_PARAMS = [pytest.param(k, e, o, id=f"{k}-{e}-{o}", marks=[pytest.mark.slow] if e == "dynamo" else [])
                for k, e, o in CASES]


@pytest.mark.parametrize("kind,exporter,opset", _CASE_PARAMS)
def test_fuse_export(export_dir: Path, kind: str, exporter: str, opset: int) -> None:
    import onnx

    proto = onnx.load(str(_export(export_dir, kind, exporter, opset)))
    feeds = export_hf.sample_feeds(kind, 2, 16, seed=1)
    reference = run_ort(proto, feeds)
    expected = {k: v for k, v in EXPECTED[(kind, exporter, opset)].items() if v}
    for target in ("onnx", "ort"):
        model = to_ir(proto)
        stats = _fuse(model, target)
        assert dict(stats) == expected, (target, dict(stats))  # the fusions do not depend on the target
        left = op_counts(model)
        assert_close(reference, run_ort(to_proto(model), feeds), rel=1e-4)
        if target == "onnx":  # standard ONNX only: standard ops where the opset has them, else inlined bodies
            assert not any(k.startswith("mograph.") for k in left) and "mograph" not in model.opset_imports, left
            continue
        assert not {"Erf", "Pow", "ReduceMean", "Sqrt"} & set(left), left  # nothing left half-fused
        norms = sum(v for k, v in left.items() if "LayerNormalization" in k or "RMSNorm" in k or "SkipLayerNorm" in k)
        assert norms == NORMS[kind], left
        before = graph_fingerprint(model)
        assert not _fuse(model, target)  # second run: nothing to do
        assert graph_fingerprint(model) == before
