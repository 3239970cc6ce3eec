"""Helpers for the cleanup-pass tests: compare the numbers of the original and the optimized model.

Numbers are compared under ONNX Runtime with its graph optimizations off (its own fusions could hide a
broken rewrite), on seeded feeds, with a tolerance chosen by dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

from mograph.testing import run_ort

#: (rtol, atol) per output dtype; cleanup passes only reorder or precompute, so these are tight.
TOLERANCE = {np.dtype(np.float32): (1e-6, 1e-6), np.dtype(np.float16): (1e-3, 1e-3), np.dtype(np.float64): (1e-12, 1e-12)}


def assert_same_outputs(original: onnx.ModelProto, optimized: ir.Model, feeds: Mapping[str, np.ndarray]) -> None:
    """Same output names, and values equal within the dtype's tolerance."""
    assert [o.name for o in original.graph.output] == [v.name for v in optimized.graph.outputs]
    want, got = run_ort(original, feeds), run_ort(optimized, feeds)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        if w.dtype in TOLERANCE:
            rtol, atol = TOLERANCE[w.dtype]
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, w)
