"""The example models shipped in ``mograph/examples/`` are exactly what ``tools/make_examples.py`` writes,
and they run on their shipped feeds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "mograph" / "examples"


def _make_examples():
    spec = importlib.util.spec_from_file_location("make_examples", ROOT / "tools" / "make_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_examples_are_up_to_date() -> None:
    assert _make_examples().main(["--check"], echo=lambda _: None) == 0


def test_regeneration_is_byte_stable(tmp_path: Path) -> None:
    tool = _make_examples()
    assert tool.main(["--out", str(tmp_path)], echo=lambda _: None) == 0
    assert tool.build_all() == {p.name: p.read_bytes() for p in sorted(tmp_path.iterdir())}


@pytest.mark.parametrize("name", ["bert-tiny", "cnn-small"])
def test_examples_run_on_their_feeds(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    path = EXAMPLES / f"{name}.onnx"
    assert path.stat().st_size < 1_000_000
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    with np.load(EXAMPLES / f"{name}.npz") as data:
        feeds = dict(data)
    assert sorted(feeds) == sorted(i.name for i in sess.get_inputs())
    for out in sess.run(None, feeds):
        assert np.isfinite(out).all()
