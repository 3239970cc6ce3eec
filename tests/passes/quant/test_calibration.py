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



def _entropy_threshold_by_chunks(s: TensorStats, levels: int = 128) -> float:
    """The entropy calibrator's threshold written chunk by chunk (``np.array_split``), as it was before its
    vectorization: the two must agree exactly."""
    import math

    half = s.hist.size // 2
    absh = (s.hist[half:] + s.hist[:half][::-1]).astype(np.float64)
    last = int(np.nonzero(absh)[0][-1]) + 1
    best_i, best_kl = last, math.inf
    for i in range(levels, last + 1, max(1, (last - levels) // 256)):
        ref = absh[:i].copy()
        ref[i - 1] += absh[i:].sum()
        q = np.concatenate([np.where(c > 0, c.sum() / max(int((c > 0).sum()), 1), 0.0)
                            for c in np.array_split(absh[:i], levels)])
        if q.sum() == 0:
            continue
        p, qq = ref / ref.sum(), q / q.sum()
        mask = p > 0
        kl = float(np.sum(p[mask] * np.log(p[mask] / np.maximum(qq[mask], 1e-12))))
        if kl < best_kl:
            best_kl, best_i = kl, i
    return (best_i + 0.5) * s.hist_range / half


@pytest.mark.parametrize("seed", range(4))
def test_entropy_threshold_equals_the_chunk_by_chunk_computation(seed):
    rng = np.random.default_rng(seed)
    heavy = rng.standard_t(2 + seed, 20000).astype(np.float32)  # long tails: the threshold is inside
    sparse = np.repeat(rng.standard_normal(40).astype(np.float32), 25)  # mostly empty bins
    s = _stream([heavy, sparse * (1 + seed), np.array([50.0 * (seed + 1)], np.float32)])
    lo, hi = compute_ranges({"t": s}, "entropy")["t"]
    t = _entropy_threshold_by_chunks(s)
    assert t < s.max  # the outlier is clipped: a threshold was chosen, not the range
    assert (lo, hi) == (max(s.min, -t), min(s.max, t))


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


def test_every_source_form_gives_the_same_feeds(tmp_path, monkeypatch):
    """Folder of .npz, stacked .npz, module:function, relative file.py:function, list, callable,
    re-iterable object and generator: the same three feeds, and each can be read more than once."""
    import sys

    from mograph.passes.quant.calibration import open_source

    model = _matmul_model()
    feeds = [{"x": np.full((1, 6), float(i), np.float32)} for i in range(3)]
    folder = tmp_path / "feeds"
    folder.mkdir()
    for i, f in enumerate(feeds):
        np.savez(folder / f"{i:03d}.npz", **f)
    np.savez(tmp_path / "stacked.npz", x=np.concatenate([f["x"] for f in feeds]))
    (tmp_path / "calibmod_forms.py").write_text(_CALIB_MODULE)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "gen_feeds.py").write_text(_CALIB_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "calibmod_forms", raising=False)

    class Loader:  # re-iterable, like a data loader
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(feeds)

    sources = {
        "folder": str(folder),
        "stacked": str(tmp_path / "stacked.npz"),
        "module": "calibmod_forms:feeds",
        "relative file": "sub/gen_feeds.py:feeds",
        "list": feeds,
        "callable": lambda: iter(feeds),
        "iterable": Loader(),
        "generator": (f for f in feeds),
    }
    for label, data in sources.items():
        source = open_source(data, model)
        for _ in range(2):  # a generator is replayed from memory on the second pass
            got = [float(f["x"][0, 0]) for f in source]
            assert got == [0.0, 1.0, 2.0], (label, got)


def test_generator_cut_short_by_a_limit_goes_on_later():
    from mograph.passes.quant.calibration import open_source

    made = []

    def gen():  # type: ignore[no-untyped-def]
        for i in range(5):
            made.append(i)
            yield {"x": np.full((1, 6), float(i), np.float32)}

    source = open_source(gen(), _matmul_model(), limit=3)
    assert [float(f["x"][0, 0]) for f in source] == [0.0, 1.0, 2.0]
    assert made == [0, 1, 2]  # streamed: nothing read beyond the limit
    assert [float(f["x"][0, 0]) for f in source] == [0.0, 1.0, 2.0]
    assert made == [0, 1, 2]  # replayed, not read again


def test_generator_calibrates_the_pass_and_a_bad_type_is_one_line():
    from mograph.passes.quant import QdqInt8Pass

    model = _matmul_model(reshape=True)
    feeds = ({"x": np.random.default_rng(i).standard_normal((2, 6)).astype(np.float32)} for i in range(4))
    result = QdqInt8Pass(calibration_data=feeds).call(model)
    assert result.stats["calibration_samples"] == 4
    assert result.details["plan"]["calibration"]["source"] == "generator of feeds"
    with pytest.raises(OptionError, match="expected a path, module:function, a callable or an iterable"):
        QdqInt8Pass(calibration_data=3.5).call(_matmul_model(reshape=True))


def test_random_calibration_needs_opt_in_and_warns(caplog):
    from mograph.passes.quant import QdqInt8Pass

    with pytest.raises(OptionError, match="needs calibration data"):
        QdqInt8Pass().call(_matmul_model(batch=2, reshape=True))
    with caplog.at_level("WARNING"):
        result = QdqInt8Pass(calibration_random=4).call(_matmul_model(batch=2, reshape=True))
    assert result.stats["calibrated_on_random_data"] == 1
    assert "RANDOM" in result.details["WARNING"]
    assert any("CALIBRATED ON RANDOM DATA" in r.getMessage() for r in caplog.records)


def test_padded_positions_are_left_out_of_the_statistics():
    """A [batch, seq, hidden] tensor is observed at the positions attention_mask marks real only."""
    import onnx
    from mograph.passes.quant.calibration import RandomSource, observe, padding_mask_input
    from onnx import helper

    from mograph import ir_io

    graph = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, [1, 4, 2]),
         helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 2])],
    )
    model = ir_io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert padding_mask_input(model) == "attention_mask"
    h = np.array([[[1, -2], [3, 0.5], [100, -100], [50, 7]]], np.float32)  # the last two rows are padding
    feed = {"h": h, "attention_mask": np.array([[1, 1, 0, 0]], np.int64)}
    from mograph.passes.quant.calibration import open_source

    masked = observe(model, ["y"], open_source([feed], model), padding_mask="attention_mask", channels=["y"])["y"]
    assert (masked.min, masked.max) == (-2.0, 3.0)
    assert masked.ch_min.tolist() == [1.0, -2.0] and masked.ch_max.tolist() == [3.0, 0.5]
    plain = observe(model, ["y"], open_source([feed], model))["y"]
    assert (plain.min, plain.max) == (-100.0, 100.0)
    del RandomSource


def test_random_ids_stay_inside_a_table_read_through_a_transpose():
    """torchaudio's RNN-T predictor transposes its ``targets`` ([batch, U] -> [U, batch]) before the embedding
    Gather: random ids, bounded only for a Gather reading the input directly, went up to 99 for a 50-row table
    and every random calibration of the model failed (exit 2)."""
    import onnx
    from mograph.passes.quant.calibration import RandomSource
    from onnx import helper, numpy_helper

    from mograph.testing import run_ort, to_ir

    table = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["targets"], ["t"], perm=[1, 0]),
             helper.make_node("Gather", ["table", "t"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("targets", onnx.TensorProto.INT64, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [64, 1, 4])],
                              [numpy_helper.from_array(table, "table")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = list(RandomSource(to_ir(proto), 4))
    assert all(int(f["targets"].max()) < 50 for f in feeds)
    assert max(int(f["targets"].max()) for f in feeds) >= 40  # the table's range, not a timid one
    for f in feeds:
        run_ort(proto, f)
