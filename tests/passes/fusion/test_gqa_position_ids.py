"""Decoder exports that take ``position_ids`` as an input (as optimum's do): their rotary angles come from that input,
which nothing proves equal to ``past + s``, so the rotary cannot go inside ``GroupQueryAttention``.  Today they lower
for ``--target ort`` to the exact form (ONNX Runtime's ``RotaryEmbedding`` kernels over the export's own angles,
``MultiHeadAttention`` over repeated K/V heads), equal to the export on ONNX Runtime CPU, and ``--kv-cache shared``
refuses them by name.  (A ``GroupQueryAttention`` with ``do_rotary`` 0 after those kernels was tried, commit b538b8e:
exact on ONNX Runtime CPU, but ONNX Runtime 1.31.1's CUDA provider with its default optimizations failed it on the
H200 with "cos_cache dimension 0 shall not be less than total_sequence_length", so it is not written.)"""

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

import mograph  # noqa: E402
from models import decoder_export as de  # noqa: E402

pytestmark = pytest.mark.slow

CFG: dict[str, Any] = {"hidden": 128, "heads": 4, "kv_heads": 2}  # head size 32 (GQA's CPU kernel: multiple of 8)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("decoders_position_ids")
    made: dict[tuple[str, str], Path] = {}

    def get(step: str, exporter: str) -> Path:
        if (step, exporter) not in made:
            made[(step, exporter)] = de.export(de.config("llama", **CFG), step, exporter,
                                               base / f"{step}_{exporter}.onnx", position_ids=True)
        return made[(step, exporter)]

    return get


def _optimize(path: Path, **options: Any) -> tuple[onnx.ModelProto, dict[str, Any]]:
    model, report = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse"], options={"target": "ort", **options})
    lower = next(p for p in report.to_dict()["passes"] if p["name"] == "lower")
    return model, lower["stats"]


def _session(model: Any) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _run(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return _session(model).run(None, feeds)


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y.astype(np.float32)).max()) for x, y in zip(a, b))


def _gqa_attrs(nodes: Any) -> list[dict[str, Any]]:
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            for n in nodes if n.op_type == "GroupQueryAttention"]


#: (step, batch, new tokens, padding): the cases each form must match the export on
CASES = {"prefill": [(2, 6, "none"), (2, 6, "right"), (1, 5, "none")],
         "decode": [(2, 1, "none"), (1, 4, "none")]}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_position_ids_exports_lower_exactly(exports: Any, exporter: str, step: str) -> None:
    path = exports(step, exporter)
    for options in ({"mask_format": "lengths"}, {}):
        model, stats = _optimize(path, **options)
        ops = Counter(n.op_type for n in model.graph.node)
        assert ops["MultiHeadAttention"] == 2 and ops["GroupQueryAttention"] == 0 and ops["RotaryEmbedding"] == 4, ops
        assert ops["If"] == 0 and stats["rotary.kernel"] == 4 and "attention.gqa_rotary" not in stats
        cfg = de.config("llama", **CFG)
        for batch, seq, padding in CASES[step] + ([(2, 6, "left")] if step == "prefill" else [(2, 1, "left")]):
            feeds = de.feeds(cfg, step, batch=batch, seq=seq, past=7, padding=padding, position_ids=True)
            assert _max_diff(_run(path, feeds), _run(model, feeds)) < 1e-5, (options, batch, seq, padding)
        again, _ = mograph.optimize(model, passes=["cleanup", "fuse"], options={"target": "ort", **options})
        assert Counter(n.op_type for n in again.graph.node) == ops  # a second run changes nothing


def test_kv_cache_shared_refuses_them_by_name(exports: Any) -> None:
    with pytest.raises(mograph.MographError, match="cannot become GroupQueryAttention with rotary inside"):
        _optimize(exports("decode", "torchscript"), kv_cache="shared")
