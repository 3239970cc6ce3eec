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
