"""The shape passes on real PyTorch exports (tiny random-weight Hugging Face models).

- Exported with a static batch of 1 (and sequence 16), made dynamic: at batch 1, 3 and 8 every row equals
  the static model run on that row alone; with the sequence made dynamic too, at sequence 5 and 40 every
  row equals a static export at that length.
- Exported with dynamic axes, fixed: the outputs agree with the original at the fixed size and the node
  count drops.

ONNX Runtime runs everything with its graph optimizations off.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from mograph.passes.shape import FixShapesPass, MakeDynamicPass

from mograph.testing import run_ort, to_ir

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
export_hf = pytest.importorskip("models.export_hf")

pytestmark = pytest.mark.slow


def _export(tmp_path_factory, kind, exporter, **kw):
    opset = 18 if exporter == "dynamo" else 17
    tag = "_".join(f"{k}{v}" for k, v in sorted(kw.items()))
    path = tmp_path_factory.mktemp("exports") / f"{kind}_{exporter}_{tag}.onnx"
    res = export_hf.export(kind, path, exporter=exporter, opset=opset, **kw)
    return onnx.load(res.path), list(res.inputs)


def _rows_match(model, static, feeds):
    out = run_ort(model, feeds)
    batch = next(iter(feeds.values())).shape[0]
    assert out[0].shape[0] == batch
    for i in range(batch):
        ref = run_ort(static, {k: v[i : i + 1] for k, v in feeds.items()})
        for got, want in zip(out, ref):
            np.testing.assert_allclose(got[i : i + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kind", "exporter"),
    [("bert", "torchscript"), ("gpt2", "torchscript"), ("vit", "torchscript"), ("llama", "torchscript"),
     ("bert", "dynamo")],
)
def test_static_batch_made_dynamic(tmp_path_factory, kind, exporter):
    static, names = _export(tmp_path_factory, kind, exporter, dynamic=False, batch=1, seq=16)
    model = to_ir(static)
    result = MakeDynamicPass(dynamic=[f"{n}:0=batch" for n in names]).call(model)
    assert result.modified and result.stats["dims_made_dynamic"] == len(names)
    assert result.stats.get("rewritten.Reshape", 0) > 0
    for v in model.graph.inputs:
        assert v.shape.dims[0].value == "batch"
    for batch in (1, 3, 8):
        _rows_match(model, static, export_hf.sample_feeds(kind, batch=batch, seq=16, seed=batch))
    assert not MakeDynamicPass(dynamic=[f"{n}:0=batch" for n in names]).call(model).modified


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_static_sequence_made_dynamic(tmp_path_factory, kind):
    static, names = _export(tmp_path_factory, kind, "torchscript", dynamic=False, batch=1, seq=16)
    model = to_ir(static)
    specs = [f"{n}:0=batch" for n in names] + [f"{n}:1=seq" for n in names]
    result = MakeDynamicPass(dynamic=specs).call(model)
    assert result.modified and result.stats["dims_made_dynamic"] == 2 * len(names)
    _rows_match(model, static, export_hf.sample_feeds(kind, batch=3, seq=16, seed=3))
    for seq in (5, 40):
        other, _ = _export(tmp_path_factory, kind, "torchscript", dynamic=False, batch=1, seq=seq)
        _rows_match(model, other, export_hf.sample_feeds(kind, batch=2, seq=seq, seed=seq))


@pytest.mark.parametrize(
    ("kind", "exporter"), [("bert", "torchscript"), ("gpt2", "torchscript"), ("llama", "torchscript"), ("bert", "dynamo")]
)
def test_dynamic_export_fixed(tmp_path_factory, kind, exporter):
    dynamic, names = _export(tmp_path_factory, kind, exporter, dynamic=True)
    for batch, seq in ((1, 16), (2, 7)):
        model = to_ir(dynamic)
        nodes_before = len(list(model.graph))
        result = FixShapesPass(shape=[f"{names[0]}:{batch}x{seq}"]).call(model)
        assert result.modified and result.stats["inputs_fixed"] == len(names)
        assert len(list(model.graph)) < nodes_before
        assert result.stats["nodes_removed"] == nodes_before - len(list(model.graph))
        assert not {"Shape"} & {n.op_type for n in model.graph}
        feeds = export_hf.sample_feeds(kind, batch=batch, seq=seq, seed=seq)
        for got, want in zip(run_ort(model, feeds), run_ort(dynamic, feeds)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
