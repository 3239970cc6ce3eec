"""``--target tensorrt`` emits plugin nodes in the form the mograph TensorRT plugins take, so ``build_engine``
has nothing to legalize (its legalization stays as a safety net for other producers).

Plugin nodes have no ONNX Runtime kernel and no function body, so their numbers are checked with
``onnx.reference`` running the ops' numpy references (:mod:`mograph.passes.fusion.ops`); the engine
builds run with ``tensorrt_rtx`` on the CPU in a child process (as ``tests/backends/test_tensorrt.py`` does)
and skip where no TensorRT module is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from _fusion_util import lowered
from mograph.passes.fusion import ops
from mograph.passes.fusion.layernorm import FuseLayerNormPass
from mograph.passes.fusion.rmsnorm import FuseRMSNormPass
from mograph.passes.fusion.skip_layernorm import FuseSkipLayerNormPass
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from test_norms import H, layernorm_model, rmsnorm_model, skip_model

from mograph.backends import _trt_loader
from mograph.backends import tensorrt as trt_backend
from mograph.backends.tensorrt_plugins import PLUGINS
from mograph.pass_infra import graph_fingerprint
from mograph.plugins import get_registry
from mograph.testing import assert_close, feeds_for, op_types, parse, to_ir, to_proto

TRT_NAME = _trt_loader.find_trt_module()


# ------------------------------------------------------------------ plugin nodes in numpy -------


class _Plugin(OpRun):
    op_domain = "mograph"


class LayerNorm(_Plugin):
    def _run(self, x, scale, b=None, epsilon=None, plugin_namespace=None, plugin_version=None):  # type: ignore[no-untyped-def]
        return (ops.layer_norm(x, scale, b, epsilon),)


class RMSNorm(_Plugin):
    def _run(self, x, scale, epsilon=None, plugin_namespace=None, plugin_version=None):  # type: ignore[no-untyped-def]
        return (ops.rms_norm(x, scale, epsilon),)


class SkipLayerNorm(_Plugin):
    def _run(self, x, skip, scale, b=None, bias=None, epsilon=None, sum_output=None,  # type: ignore[no-untyped-def]
             plugin_namespace=None, plugin_version=None):
        y, s = ops.skip_layer_norm(x, skip, scale, b, bias, epsilon)
        return (y, s) if sum_output else (y,)


def run_plugins(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ReferenceEvaluator(proto, new_ops=[LayerNorm, RMSNorm, SkipLayerNorm]).run(None, feeds)


def check_plugin_form(model) -> None:  # type: ignore[no-untyped-def]
    """What ``build_engine`` would otherwise patch: output counts, vector inputs, optional inputs, names."""
    for node in model.graph:
        if node.domain != "mograph":
            continue
        spec = PLUGINS[node.op_type]
        attrs = {k: a.value for k, a in node.attributes.items()}
        assert attrs["plugin_namespace"] == "mograph" and attrs["plugin_version"] == "1"
        assert set(attrs) <= set(spec.attributes) | {"plugin_namespace", "plugin_version"}, attrs
        assert len(node.outputs) == spec.num_outputs(attrs), node
        assert spec.min_inputs <= len(node.inputs) <= spec.max_inputs
        assert all(v is not None and v.name for v in node.inputs), node
        hidden = node.inputs[0].shape[-1]
        for k, v in enumerate(node.inputs[1:], 1):
            if spec.inputs[k] != "Skip":
                assert list(v.shape) == [hidden], (node.name, k, v.shape)
    assert not trt_backend._needs_lowering(model, get_registry())
    assert trt_backend._plugin_node_problems(model) == []  # what the backend validates before a build


def fuse_and_check(pass_, proto, stats, ops_left):  # type: ignore[no-untyped-def]
    feeds = feeds_for(proto)
    ref = run_plugins(proto, feeds)
    model = to_ir(proto)
    result = pass_.call(model)
    assert result.stats == stats
    assert op_types(model) == ops_left
    check_plugin_form(model)
    assert_close(ref, run_plugins(to_proto(model), feeds), rel=1e-5)
    before = graph_fingerprint(model)
    assert not pass_.call(model).modified
    assert graph_fingerprint(model) == before
    return model


# ------------------------------------------------------------------ forms -----------------------


SKIP_STATS = {"SkipLayerNormFusion": 1, "lowered.SkipLayerNorm": 1}


@pytest.mark.parametrize("bias,sum_output", [(True, False), (False, True), (True, True), (False, False)])
def test_skip_layernorm_plugin(bias, sum_output):
    proto = parse(skip_model(bias=bias, sum_output=sum_output))
    variant = ("bias" if bias else "plain") + (".sum-output" if sum_output else "")
    model = fuse_and_check(lowered(FuseSkipLayerNormPass(), "tensorrt"), proto,
                           {**SKIP_STATS, f"SkipLayerNormFusion.{variant}": 1},
                           ["MatMul", "mograph.SkipLayerNorm"] + (["Mul"] if sum_output else []))
    node = next(n for n in model.graph if n.op_type == "SkipLayerNorm")
    assert node.attributes["sum_output"].value == int(sum_output)
    assert len(node.outputs) == (2 if sum_output else 1)
    assert len(node.inputs) == (5 if bias else 4)  # a zero Bias is left off the end


def test_skip_layernorm_zero_beta_before_a_bias_becomes_zeros():
    text = skip_model().replace("LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma, beta)",
                                "LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma)")
    model = fuse_and_check(lowered(FuseSkipLayerNormPass(), "tensorrt"), parse(text),
                           {**SKIP_STATS, "SkipLayerNormFusion.bias": 1}, ["MatMul", "mograph.SkipLayerNorm"])
    node = next(n for n in model.graph if n.op_type == "SkipLayerNorm")
    assert len(node.inputs) == 5
    np.testing.assert_array_equal(node.inputs[3].const_value.numpy(), np.zeros(H, np.float32))


def test_skip_layernorm_plain_without_beta_has_three_inputs():
    text = skip_model(bias=False).replace("LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma, beta)",
                                          "LayerNormalization<axis=-1, epsilon=1e-5>(s, gamma)")
    model = fuse_and_check(lowered(FuseSkipLayerNormPass(), "tensorrt"), parse(text),
                           {**SKIP_STATS, "SkipLayerNormFusion.plain": 1}, ["MatMul", "mograph.SkipLayerNorm"])
    node = next(n for n in model.graph if n.op_type == "SkipLayerNorm")
    assert len(node.inputs) == 3


@pytest.mark.parametrize("scale,bias,n_inputs", [(True, True, 3), (True, False, 2), (False, False, 2)])
def test_layernorm_plugin_below_opset_17(scale, bias, n_inputs):
    proto = parse(layernorm_model(opset=14, scale=scale, bias=bias))
    stats = {"LayerNormFusion": 1, "LayerNormFusion.div-sqrt.centered.reducemean": 1, "lowered.LayerNorm": 1}
    if scale:
        stats["LayerNormScaleFusion"] = 1
    if bias:
        stats["LayerNormBiasFusion"] = 1
    model = fuse_and_check(lowered(FuseLayerNormPass(), "tensorrt"), proto, stats, ["mograph.LayerNorm", "Identity"])
    node = next(iter(model.graph))
    assert len(node.inputs) == n_inputs  # a missing scale is a [hidden] vector of ones; a zero B is left off
    assert set(node.attributes) == {"epsilon", "plugin_namespace", "plugin_version"}
    assert not model.functions


def test_rmsnorm_plugin_scale_is_a_vector():
    text = rmsnorm_model().replace("  y = Mul(gamma, y0)", "  y = Identity(y0)")
    stats = {"RMSNormFusion": 1, "RMSNormFusion.mul-reciprocal.eps.reducemean": 1, "lowered.RMSNorm": 1}
    model = fuse_and_check(lowered(FuseRMSNormPass(), "tensorrt"), parse(text), stats, ["mograph.RMSNorm", "Identity"])
    node = next(iter(model.graph))
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), np.ones(H, np.float32))


# ------------------------------------------------------------------ bert_tiny, engine built -----


#: The passes whose output is tested here (the ``fuse`` preset may hold more, e.g. attention).
NORM_AND_GELU = ["fuse-layernorm", "fuse-rmsnorm", "fuse-skip-layernorm", "fuse-gelu", "fuse-bias-gelu"]


def _fused_bert(opset: int):  # type: ignore[no-untyped-def]
    from models.builders import bert_tiny
    from mograph.plugins import get_registry

    reg = get_registry()
    model = to_ir(bert_tiny(opset=opset))
    stats: dict[str, int] = {}
    for p in reg.instantiate(reg.plan(NORM_AND_GELU, {"target": "tensorrt"}), {"target": "tensorrt"}):
        for k, v in p.call(model).stats.items():
            if k.startswith("lowered."):
                stats[k] = stats.get(k, 0) + int(v)
    return model, stats


@pytest.mark.parametrize("opset,lowered_stats,plugins", [
    # the fusions consume the LayerNorms and Gelus into SkipLayerNorm / BiasGelu before the one lower step
    (17, {"lowered.SkipLayerNorm": 5, "lowered.BiasGelu": 2}, {"mograph.SkipLayerNorm": 5, "mograph.BiasGelu": 2}),
    (14, {"lowered.SkipLayerNorm": 5, "lowered.BiasGelu": 2}, {"mograph.SkipLayerNorm": 5, "mograph.BiasGelu": 2}),
])
def test_fused_bert_tiny_is_already_legal(opset, lowered_stats, plugins):
    model, stats = _fused_bert(opset)
    assert stats == lowered_stats
    left = op_types(model)
    assert {t: left.count(t) for t in set(left) if t.startswith("mograph.")} == plugins
    assert not {"Erf", "ReduceMean", "Sqrt", "LayerNormalization"} & set(left)
    check_plugin_form(model)


_CHILD = textwrap.dedent(
    """
    import json, sys
    from mograph.backends.tensorrt import build_engine
    prof = "1x4,2x16,4x64"
    out = {}
    for name in sys.argv[2:]:
        r = build_engine(f"{sys.argv[1]}/{name}.onnx", f"{sys.argv[1]}/{name}.engine",
                         profiles={"input_ids": prof, "attention_mask": prof})
        out[name] = {k: r.get(k) for k in ("lowered", "unsupported", "plugin_layers", "mograph_plugin_layers",
                                           "engine_bytes")}
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.skipif(TRT_NAME is None, reason="neither tensorrt nor tensorrt_rtx is installed")
def test_fused_bert_tiny_engine_needs_no_legalization(tmp_path: Path) -> None:
    names = []
    for opset in (17, 14):
        model, _ = _fused_bert(opset)
        onnx.save(to_proto(model), tmp_path / f"bert{opset}.onnx")
        names.append(f"bert{opset}")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), *names], capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    out = json.loads(lines[-1][len("RESULT "):])
    for name, want in (("bert17", {"SkipLayerNorm": 5, "BiasGelu": 2}), ("bert14", {"SkipLayerNorm": 5, "BiasGelu": 2})):
        report = out[name]
        assert report["lowered"] == {}, report["lowered"]  # already lowered: the backend only validated
        assert report["unsupported"] == []
        plugins = [p.get("plugin") for p in report["plugin_layers"]]
        assert {p: plugins.count(p) for p in set(plugins)} == want
        assert report["mograph_plugin_layers"] == sum(want.values())
        assert report["engine_bytes"] > 0
