"""The ``fuse`` preset on the exporter corpus (tests/data/corpus, made by tools/corpus/make_corpus.py).

Each model was written by a real exporter (torch TorchScript and dynamo, TF/Keras 3 through tf2onnx,
Flax through jax2onnx and through jax2tf + tf2onnx, PaddlePaddle through paddle2onnx, and fp16 conversions of some of them by
onnxconverter-common); the manifest says how many LayerNorm, RMSNorm, residual+norm and GELU
instances each holds by construction.  For every model, the five checks:

1. ops left: exactly that many norm ops (``mograph`` or standard), that many of them with the residual
   Add inside (``SkipLayerNorm``/``SkipRMSNorm``), that many GELU-family ops, and none of the primitive
   ops a norm or GELU is written with (ReduceMean, Sqrt, Erf, Tanh, Sigmoid ...);
2. exact stats: the core rules fired once for every instance the exporter did not already write as one
   standard op, the residual rules once per residual+norm;
3. numbers equal to the original's under ONNX Runtime with its optimizations off (1e-4 of the output
   scale for float32, 2e-3 for float16);
4. near misses (``nearmiss_*``: a norm over the wrong axis, epsilon outside the root, a GELU with a
   wrong constant, Keras' ``rms_scaling``) and models with a stated limitation are left untouched;
5. a second run changes nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import onnx
import pytest

from mograph.pass_infra import graph_fingerprint
from mograph.plugins import get_registry
from mograph.testing import assert_close, feeds_for, op_counts, run_ort, to_ir, to_proto

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())["models"]

NORM_OPS = {"mograph.LayerNorm", "mograph.RMSNorm", "mograph.SkipLayerNorm", "mograph.SkipRMSNorm",
            "LayerNormalization", "RMSNormalization"}
SKIP_OPS = {"mograph.SkipLayerNorm", "mograph.SkipRMSNorm"}
GELU_OPS = {"mograph.Gelu", "mograph.FastGelu", "mograph.QuickGelu", "mograph.BiasGelu", "mograph.BiasFastGelu",
            "Gelu"}
PRIMITIVES = {"ReduceMean", "GlobalAveragePool", "Sqrt", "Reciprocal", "Pow", "Erf", "Tanh", "Sigmoid"}
CORE_RULES = ("LayerNormFusion", "RMSNormFusion")
SKIP_RULES = ("SkipLayerNormFusion", "SkipRMSNormFusion", "SkipLayerNormGemmBiasFusion")  # the last: a Gemm bias taken in
GELU_RULES = ("GeluFusion", "GeluTanhFusion", "QuickGeluFusion")


def _fuse(model, explain: bool = False) -> tuple[Counter, dict, bool]:
    reg = get_registry()
    options = {"target": "mograph", "explain": explain}
    stats: Counter = Counter()
    details: dict = {}
    modified = False
    for p in reg.instantiate(reg.plan("fuse", options), options):
        result = p.call(model)
        modified = modified or result.modified
        stats.update({k: v for k, v in result.stats.items() if "." not in k and v})  # zero counts say nothing
        details[p.name] = result.details
    return stats, details, modified


def _count(ops: Counter, names: set[str]) -> int:
    return sum(v for k, v in ops.items() if k in names)


IDS = [e["file"][:-5] for e in MANIFEST]


@pytest.mark.parametrize("entry", MANIFEST, ids=IDS)
def test_corpus_model(entry: dict) -> None:
    proto = onnx.load(str(CORPUS / entry["file"]))
    want = entry["instances"]
    feeds = feeds_for(proto)
    if entry.get("limitation") or not any(want.values()):  # 4: left untouched
        model = to_ir(proto)
        before = graph_fingerprint(model)
        stats, details, modified = _fuse(model, explain=True)
        assert not modified and not stats, stats
        assert graph_fingerprint(model) == before
        if entry.get("limitation"):
            assert entry["limitation"] in json.dumps(details), details
        return
    original = op_counts(to_ir(proto))
    model = to_ir(proto)
    stats, _, modified = _fuse(model)
    ops = op_counts(model)
    # 1. ops left
    assert _count(ops, NORM_OPS) == want["layernorm"] + want["rmsnorm"], ops
    assert _count(ops, SKIP_OPS) == want["skipnorm"], ops
    assert _count(ops, GELU_OPS) == want["gelu"], ops
    assert not PRIMITIVES & set(ops), ops
    # 2. exact stats: one core fusion per instance not already one standard op; one residual fusion each
    std_norms = original["LayerNormalization"] + original["RMSNormalization"]
    assert sum(stats[r] for r in CORE_RULES) == want["layernorm"] + want["rmsnorm"] - std_norms, stats
    assert sum(stats[r] for r in SKIP_RULES) == want["skipnorm"], stats
    assert sum(stats[r] for r in GELU_RULES) == want["gelu"] - original["Gelu"], stats
    assert modified
    # 3. numbers, ORT optimizations off
    reference = run_ort(proto, feeds)
    assert_close(reference, run_ort(to_proto(model), feeds), rel=2e-3 if entry.get("fp16") else 1e-4)
    # 5. a second run changes nothing
    before = graph_fingerprint(model)
    again, _, modified = _fuse(model)
    assert not modified and not again, again
    assert graph_fingerprint(model) == before


def test_corpus_covers_the_exporters() -> None:
    exporters = {e["exporter"] for e in MANIFEST}
    for name in ("torch-torchscript", "torch-dynamo", "keras3-tf2onnx", "flax-jax2onnx", "jax2tf-tf2onnx",
                 "paddle2onnx"):
        assert name in exporters
        assert f"{name}+fp16" in exporters
    opsets = {(e["exporter"], e["opset"]) for e in MANIFEST}
    for opset in (11, 14, 17):
        assert ("torch-torchscript", opset) in opsets
    for opset in (18, 23):
        assert ("torch-dynamo", opset) in opsets
    assert sum((CORPUS / e["file"]).stat().st_size for e in MANIFEST) < 5_000_000


def test_explain_on_a_near_miss_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mograph optimize --explain`` on a real export of near misses names each region and where it failed."""
    from mograph.cli import main

    out = tmp_path / "out.onnx"
    assert main(["optimize", str(CORPUS / "nearmiss_torch_ts14.onnx"), "-o", str(out), "--passes", "fuse",
                 "--explain"]) == 0
    text = capsys.readouterr().out
    sections = {b.splitlines()[0].split()[0]: b for b in text.split("== ")[1:]}
    for name in ("fuse-layernorm", "fuse-rmsnorm", "fuse-gelu"):  # human-readable: one line per unfused region
        assert "    unfused " in sections[name], text
    assert "Fusion: 0 fused, 0 near miss" not in text  # only rules that matched or nearly matched are listed
    # the GELU whose sqrt(2/pi) is 0.9: the Tanh region, and the constant that is off
    assert "unfused Tanh '/Tanh'" in text and "is 0.9, expected 0.797" in text, text
    # the LayerNorm with epsilon outside the root: a region at its mean, with the node where matching stopped
    assert "unfused ReduceMean '/b/ReduceMean'" in text and "stopped at '" in text, text
    assert main(["optimize", str(CORPUS / "nearmiss_torch_ts14.onnx"), "-o", str(out), "--passes", "fuse",
                 "--explain", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # --json: every rule's figures, as data
    details = {p["name"]: p.get("details") or {} for p in data["passes"]}
    assert details["fuse-gelu"]["unfused_regions"][0]["anchor"] == "/Tanh"
    assert details["fuse-rmsnorm"]["rules"]["RMSNormScaleFusion"]["candidates"] == 0


def test_explain_lists_the_sum_based_norms_of_a_flax_export() -> None:
    """Issue 27: the jax2tf LayerNorms (ReduceSum * 1/N without kept dims) with 1/N made wrong (1/20 for
    a last axis of 16) fuse nowhere, and --explain lists every one of their last-axis sums, each with
    the node where the match stopped (before, sum-based reductions without kept dims were never listed)."""
    import numpy as np
    from onnx import numpy_helper

    proto = onnx.load(str(CORPUS / "jax2tf_tf2onnx13_dyn-ln.onnx"))
    changed = 0
    for init in proto.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.size == 1 and abs(float(arr.reshape(-1)[0]) - 1 / 16) < 1e-7:
            init.CopyFrom(numpy_helper.from_array(np.full(arr.shape, 0.05, arr.dtype), init.name))
            changed += 1
    assert changed == 1
    model = to_ir(proto)
    stats, details, modified = _fuse(model, explain=True)
    assert "LayerNormFusion" not in stats and "RMSNormFusion" not in stats, stats
    for pass_name in ("fuse-layernorm", "fuse-rmsnorm"):
        regions = details[pass_name]["unfused_regions"]
        assert [r["op"] for r in regions] == ["ReduceSum"] * 4, regions
        assert all(r.get("failed_at") for r in regions), regions
