"""The ``fuse`` preset then each target's ``lower`` on the corpus's norms without a residual at opsets 11-16.

Issue 27: below opset 17 ONNX has no ``LayerNormalization``, yet the ``ort`` lowering writes one (ONNX
Runtime registers its own kernel in the default domain at every opset); the output check's ONNX
checker refused it, so ``fuse --target ort`` failed on real models that had optimized before.  These
models (``torch_ts{11..16}_plain-*``, TorchScript exports: LayerNorm with exact and tanh GELU, RMSNorm
with QuickGELU, no residual ``Add`` anywhere) go through every target, each with the five checks and
the output check every pipeline ends with (and, built in code, the residual forms at each of 11-16):

1. ops left: the target's form of every fused op (ORT's kernels, plugin nodes, or the inlined
   function bodies where ONNX has no standard op at that opset) and no mograph op left for ``ort``;
2. exact stats: one core rule per norm and GELU instance, one ``lowered.*`` / ``inlined.*`` each;
3. numbers equal to the original's (ONNX Runtime, optimizations off; plugin nodes through
   ``onnx.reference`` running the ops' numpy references);
4. the near-miss export is left untouched for every target;
5. a second run changes nothing: the lowered forms (ORT's ops, the inlined bodies of ``onnx``,
   TensorRT's ``x * sigmoid(alpha x)``) are never fused again.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from mograph.passes.fusion import ops
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from test_tensorrt_target import LayerNorm, RMSNorm

from mograph.output_check import check_model_output
from mograph.pass_infra import graph_fingerprint
from mograph.plugins import get_registry
from mograph.testing import assert_close, feeds_for, op_counts, run_ort, to_ir, to_proto

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())["models"]
PLAIN = [e for e in MANIFEST if "_plain-" in e["file"]]
TARGETS = ("ort", "onnx", "tensorrt")


class BiasGelu(OpRun):
    op_domain = "mograph"

    def _run(self, x, bias, approximate=None, plugin_namespace=None, plugin_version=None):  # type: ignore[no-untyped-def]
        return (ops.bias_gelu(x, bias, approximate or "none"),)


class Gelu(OpRun):
    op_domain = "mograph"

    def _run(self, x, approximate=None, plugin_namespace=None, plugin_version=None):  # type: ignore[no-untyped-def]
        return (ops.gelu(x, approximate or "none"),)


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    if any(n.domain == "mograph" for n in proto.graph.node):
        return ReferenceEvaluator(proto, new_ops=[LayerNorm, RMSNorm, BiasGelu, Gelu]).run(None, feeds)
    return run_ort(proto, feeds)


def _fuse(model, target: str) -> tuple[Counter, bool]:  # type: ignore[no-untyped-def]
    reg = get_registry()
    options = {"target": target}
    stats: Counter = Counter()
    modified = False
    for p in reg.instantiate(reg.plan("fuse", options), options):
        result = p.call(model)
        modified = modified or result.modified
        stats.update({k: v for k, v in result.stats.items() if v and (k.startswith(("lowered.", "inlined.")) or "." not in k)})
    return stats, modified


def _expected_ops(entry: dict, target: str, opset: int) -> Counter:
    """The fused ops' forms left for ``target`` (opset < 17: no standard norm)."""
    rms = entry["instances"]["rmsnorm"] > 0
    tanh = "tanh" in entry["file"]
    n = entry["instances"]["layernorm"] + entry["instances"]["rmsnorm"]
    if target == "ort":
        act = "com.microsoft.QuickGelu" if rms else ("com.microsoft.FastGelu" if tanh else "com.microsoft.BiasGelu")
        return Counter({"SimplifiedLayerNormalization" if rms else "LayerNormalization": n, act: 1})
    if target == "tensorrt":
        # QuickGelu is native layers (x * sigmoid(alpha x)); the bias GELUs are the BiasGelu plugin
        return Counter({"mograph.RMSNorm" if rms else "mograph.LayerNorm": n, **({"Sigmoid": 1} if rms else {"mograph.BiasGelu": 1})})
    return Counter()  # onnx: every body inlined, checked by the primitives below


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("entry", PLAIN, ids=[e["file"][:-5] for e in PLAIN])
def test_plain_norms_below_opset_17_for_each_target(entry: dict, target: str) -> None:
    proto = onnx.load(str(CORPUS / entry["file"]))
    opset = entry["opset"]
    assert 11 <= opset <= 16 and entry["instances"]["skipnorm"] == 0
    want = entry["instances"]
    feeds = feeds_for(proto)
    reference = run_ort(proto, feeds)
    model = to_ir(proto)
    stats, modified = _fuse(model, target)
    ops_left = op_counts(model)
    # 1. ops left
    for op, count in _expected_ops(entry, target, opset).items():
        assert ops_left[op] == count, (op, ops_left)
    if target == "ort":
        assert not any(k.startswith("mograph.") for k in ops_left), ops_left
        assert not {"ReduceMean", "Sqrt", "Erf", "Tanh", "Sigmoid", "Pow"} & set(ops_left), ops_left
    if target == "onnx":
        assert not any(k.startswith("mograph.") for k in ops_left), ops_left
        assert "LayerNormalization" not in ops_left and "SimplifiedLayerNormalization" not in ops_left
    # 2. exact stats
    n_norm = want["layernorm"] + want["rmsnorm"]
    core = stats["LayerNormFusion"] + stats["RMSNormFusion"]
    assert core == n_norm, stats
    assert stats["GeluFusion"] + stats["GeluTanhFusion"] + stats["QuickGeluFusion"] == want["gelu"], stats
    done = sum(v for k, v in stats.items() if k.startswith(("lowered.", "inlined.")))
    assert done == n_norm + want["gelu"], stats
    if target == "onnx":
        assert not any(k.startswith("lowered.") for k in stats), stats  # nothing standard below 17 / 20
    assert modified
    # the output check every pipeline ends with: the checker passes, and ONNX Runtime loads what it can run
    result = check_model_output(model)
    assert result["onnx_checker"].startswith("passed"), result
    if target in ("ort", "onnx"):
        assert result["onnxruntime"].startswith("passed"), result
    # 3. numbers, ORT optimizations off (plugin nodes through their numpy references)
    assert_close(reference, _run(to_proto(model), feeds), rel=1e-4)
    # 5. a second run changes nothing
    before = graph_fingerprint(model)
    again, modified = _fuse(model, target)
    assert not modified and not again, again
    assert graph_fingerprint(model) == before


@pytest.mark.parametrize("target", TARGETS)
def test_near_miss_export_untouched_for_each_target(target: str) -> None:
    """4. a near miss (norm over the wrong axis, epsilon outside the root, a GELU with a wrong constant)."""
    proto = onnx.load(str(CORPUS / "nearmiss_torch_ts14.onnx"))
    model = to_ir(proto)
    reg = get_registry()
    options = {"target": target}
    # the fusion passes and the lower step leave it alone; the clean-up a target's plan ends with (cse)
    # merges TorchScript's duplicate constants, which is no fusion
    plan = reg.instantiate(reg.plan("fuse", options), options)
    fusion = [p for p in plan if p.name.startswith("fuse-") or p.name == "lower"]
    assert len(fusion) >= 8, [p.name for p in plan]
    before = graph_fingerprint(model)
    for p in fusion:
        result = p.call(model)
        assert not result.modified and not any(result.stats.values()), (p.name, result.stats)
    assert graph_fingerprint(model) == before


def test_the_plain_corpus_spans_opsets_11_to_16() -> None:
    kinds = {(e["opset"], e["file"].split("_plain-")[1]) for e in PLAIN}
    assert kinds == {(o, k) for o in range(11, 17) for k in ("ln-erf.onnx", "ln-tanh.onnx", "rms-quick.onnx")}


@pytest.mark.parametrize("opset", [12, 16])
def test_cli_fuse_target_ort_writes_a_plain_layernorm_below_17(tmp_path: Path, opset: int) -> None:
    """The reported failure: exit 4 'onnx checker refuses ... LayerNormalization with domain_version of 12'."""
    from mograph.cli import main

    out = tmp_path / "out.onnx"
    src = CORPUS / f"torch_ts{opset}_plain-ln-erf.onnx"
    assert main(["optimize", str(src), "-o", str(out), "--passes", "fuse", "--target", "ort", "--verify"]) == 0
    written = onnx.load(str(out))
    assert sum(n.op_type == "LayerNormalization" and n.domain == "" for n in written.graph.node) == 2
    assert max(o.version for o in written.opset_import if o.domain in ("", "ai.onnx")) == opset


# ------------------------------------------------------------------ residual norms, built in code ----
# The Skip* ops at opsets 11-16 (the corpus's residual models are at 11, 14, 17 and up): each target's
# form passes the output check and runs.


class SkipRMSNorm(OpRun):
    op_domain = "mograph"

    def _run(self, x, skip, scale, bias=None, epsilon=None, sum_output=None,  # type: ignore[no-untyped-def]
             plugin_namespace=None, plugin_version=None):
        y, s = ops.skip_rms_norm(x, skip, scale, bias, epsilon)
        return (y, s) if sum_output else (y,)


def _residual(norm: str, opset: int) -> onnx.ModelProto:
    from test_norms import layernorm_model, rmsnorm_model

    from mograph.testing import parse

    if norm == "ln":
        text = layernorm_model(opset=opset)
        text = text.replace("g (float[2,5,16] x)", "g (float[2,5,16] a, float[2,5,16] b)").replace(
            "  m = ReduceMean", "  x = Add(a, b)\n  m = ReduceMean", 1)
    else:
        text = rmsnorm_model(opset=opset)
        text = text.replace("g (float[2,5,16] x)", "g (float[2,5,16] a, float[2,5,16] b)").replace(
            "  xx = Pow", "  x = Add(a, b)\n  xx = Pow", 1)
    return parse(text)


SKIP_FORMS = {
    ("ln", "ort"): "com.microsoft.SkipLayerNormalization", ("ln", "tensorrt"): "mograph.SkipLayerNorm",
    ("rms", "ort"): "com.microsoft.SkipSimplifiedLayerNormalization", ("rms", "tensorrt"): "mograph.SkipRMSNorm",
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("norm", ["ln", "rms"])
@pytest.mark.parametrize("opset", range(11, 17))
def test_residual_norms_below_opset_17_for_each_target(opset: int, norm: str, target: str) -> None:
    from test_tensorrt_target import SkipLayerNorm

    proto = _residual(norm, opset)
    feeds = feeds_for(proto)
    reference = run_ort(proto, feeds)
    model = to_ir(proto)
    stats, modified = _fuse(model, target)
    ops_left = op_counts(model)
    # 1. ops left: the residual Add went into the target's Skip* form (onnx: its body inlined)
    if target == "onnx":
        assert not any(k.startswith(("mograph.", "com.microsoft.")) for k in ops_left), ops_left
    else:
        assert ops_left[SKIP_FORMS[norm, target]] == 1, ops_left
        assert "Add" not in ops_left and "ReduceMean" not in ops_left, ops_left
    # 2. exact stats
    skip = "SkipLayerNorm" if norm == "ln" else "SkipRMSNorm"
    assert stats[f"{skip}Fusion"] == 1 and stats["LayerNormFusion" if norm == "ln" else "RMSNormFusion"] == 1, stats
    assert stats[f"{'inlined' if target == 'onnx' else 'lowered'}.{skip}"] == 1, stats
    assert modified
    result = check_model_output(model)
    assert result["onnx_checker"].startswith("passed"), result
    if target != "tensorrt":
        assert result["onnxruntime"].startswith("passed"), result
    # 3. numbers
    got = to_proto(model)
    if target == "tensorrt":
        got_out = ReferenceEvaluator(got, new_ops=[SkipLayerNorm, SkipRMSNorm]).run(None, feeds)
    else:
        got_out = run_ort(got, feeds)
    assert_close(reference, got_out, rel=1e-4)
    # 5. a second run changes nothing
    before = graph_fingerprint(model)
    again, modified = _fuse(model, target)
    assert not modified and not again, again
    assert graph_fingerprint(model) == before
