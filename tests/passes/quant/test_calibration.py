"""Calibration statistics and calibrators, streaming over samples of different shapes."""

from __future__ import annotations

import numpy as np
import pytest
from mograph.passes.quant.calibration import TensorStats, compute_ranges
from mograph.passes.quant.plan import Budget, parse_budget

from mograph.errors import OptionError


def _stream(chunks: list[np.ndarray]) -> TensorStats:
    s = TensorStats()
    for c in chunks:
        s.update(c, histogram=True)
    return s


def test_streaming_histogram_matches_numpy_percentiles():
    rng = np.random.default_rng(0)
    # growing ranges force the histogram to double several times; shapes differ per sample
    chunks = [rng.standard_normal((1, 50 + 5 * i, 40)).astype(np.float32) * (1 + i) for i in range(12)]
    s = _stream(chunks)
    flat = np.concatenate([c.ravel() for c in chunks])
    assert s.min == pytest.approx(flat.min()) and s.max == pytest.approx(flat.max())
    assert s.hist.sum() == flat.size and s.samples == 12
    lo, hi = compute_ranges({"t": s}, "percentile", percentile=99.0)["t"]
    width = 2 * s.hist_range / s.hist.size
    assert lo == pytest.approx(np.percentile(flat, 1.0), abs=2 * width)
    assert hi == pytest.approx(np.percentile(flat, 99.0), abs=2 * width)


def test_calibrators_order():
    rng = np.random.default_rng(1)
    chunks = [rng.standard_normal(4000).astype(np.float32) for _ in range(5)]
    chunks.append(np.array([60.0], np.float32))  # one outlier
    s = _stream(chunks)
    r = compute_ranges({"t": s}, "minmax")["t"]
    p = compute_ranges({"t": s}, "percentile", percentile=99.99)["t"]
    e = compute_ranges({"t": s}, "entropy")["t"]
    assert r[1] == pytest.approx(60.0)
    assert p[1] < 10.0 and e[1] < 20.0  # both clip the lone outlier
    assert r[0] <= p[0] and r[0] <= e[0]


def test_nonfinite_values_are_counted_not_used():
    s = TensorStats()
    s.update(np.array([1.0, np.inf, -2.0, np.nan], np.float32), histogram=True)
    assert (s.min, s.max, s.nonfinite) == (-2.0, 1.0, 2)


def test_budget_parsing():
    assert parse_budget("cosine>=0.995") == Budget("cosine", 0.995)
    assert parse_budget(" max-abs <= 0.05 ") == Budget("max-abs", 0.05)
    assert Budget("cosine", 0.99).met(0.995) and not Budget("max-abs", 0.1).met(0.2)
    for bad in ("cos>0.9", "cosine<=0.9", "max-abs>=1", ""):
        with pytest.raises(OptionError):
            parse_budget(bad)


def _matmul_model(batch: int | str = "batch", reshape: bool = False):  # type: ignore[no-untyped-def]
    """y = x @ w (x: [batch, 6]); with ``reshape``, x is reshaped to [4, -1] (batch must be even) and
    multiplied twice by w."""
    import onnx
    from onnx import helper, numpy_helper

    from mograph import ir_io

    rng = np.random.default_rng(0)
    if reshape:
        nodes = [helper.make_node("Reshape", ["x", "shape"], ["t"]), helper.make_node("MatMul", ["t", "w"], ["u"]),
                 helper.make_node("MatMul", ["u", "w"], ["y"])]  # the last MatMul stays float (final projection)
        inits = [numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float32), "w"),
                 numpy_helper.from_array(np.array([4, -1], np.int64), "shape")]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
        inits = [numpy_helper.from_array(rng.standard_normal((6, 3)).astype(np.float32), "w")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [batch, 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits,
    )
    return ir_io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


_CALIB_MODULE = """
import numpy as np

def feeds():
    for i in range(3):
        yield {"x": np.full((1, 6), float(i), np.float32)}
"""


def test_module_function_resolves_from_the_current_folder_without_pythonpath(tmp_path, monkeypatch):
    import sys

    from mograph.passes.quant.calibration import open_source

    (tmp_path / "calibmod_cwd.py").write_text(_CALIB_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "calibmod_cwd", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    source = open_source("calibmod_cwd:feeds", _matmul_model())
    assert [float(f["x"][0, 0]) for f in source] == [0.0, 1.0, 2.0]
    assert sys.path == before  # the current folder is not left on the import path


def test_file_py_function_is_loaded_by_path(tmp_path, monkeypatch):
    import sys

    from mograph.passes.quant.calibration import open_source

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "make_feeds.py").write_text(_CALIB_MODULE)
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    source = open_source(f"{folder / 'make_feeds.py'}:feeds", _matmul_model())
    assert len(list(source)) == 3
    assert sys.path == before
    with pytest.raises(OptionError, match="does not exist"):
        open_source(f"{folder / 'nope.py'}:feeds", _matmul_model())
    with pytest.raises(OptionError, match="no callable 'missing'"):
        open_source(f"{folder / 'make_feeds.py'}:missing", _matmul_model())


def test_random_feeds_the_model_rejects_are_one_line_naming_the_input():
    from mograph.passes.quant import QdqInt8Pass

    # batch defaults to 1 in random feeds; the Reshape to [2, -1] needs an even batch
    with pytest.raises(OptionError) as info:
        QdqInt8Pass(calibration_random=2).call(_matmul_model(reshape=True))
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "random calibration feed (x 1x6 float32)" in message
    assert "input(s) ['x'] (dynamic dims set to 1)" in message
    assert "Reshape node" in message and "requested shape:{4,-1}" in message and "reshape_helper" not in message
    assert "--calibration-data" in message and "--shape NAME:DIMS" in message
    assert info.value.exit_code == 2  # a usage problem, not a failed pass
    # the sizes it needs, given with --shape, are accepted
    result = QdqInt8Pass(calibration_random=2, shape=["x:2x6"]).call(_matmul_model(reshape=True))
    assert result.modified


def test_real_samples_the_model_rejects_name_the_sample():
    from mograph.passes.quant import QdqInt8Pass

    feeds = [{"x": np.ones((2, 6), np.float32)}, {"x": np.ones((3, 6), np.float32)}]
    with pytest.raises(OptionError, match=r"rejects calibration sample 1 from 2 in-memory feeds \(x 3x6 float32\)"):
        QdqInt8Pass(calibration_data=feeds).call(_matmul_model(reshape=True))
