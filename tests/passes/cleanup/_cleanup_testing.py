"""Helpers for the cleanup-pass tests: run one pass the way the pipeline does, list ops, compare numbers.

Numbers are compared under ONNX Runtime with its graph optimizations off (its own fusions could hide a
broken rewrite), on seeded feeds, with a tolerance chosen by dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _pass_testing import assert_second_run_changes_nothing, op_types, run_pass  # noqa: F401 - re-exported

from mograph.testing import run_ort, to_ir, to_proto  # noqa: F401 - to_ir re-exported for the tests

#: (rtol, atol) per output dtype; cleanup passes only reorder or precompute, so these are tight.
TOLERANCE = {np.dtype(np.float32): (1e-6, 1e-6), np.dtype(np.float16): (1e-3, 1e-3), np.dtype(np.float64): (1e-12, 1e-12)}


def to_proto_with_data(model: ir.Model) -> onnx.ModelProto:
    """Serialise ``model`` with external data inlined (the model itself is left as it was)."""
    return to_proto(model, with_data=True)


def ort_outputs(model: onnx.ModelProto | ir.Model, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    pytest.importorskip("onnxruntime")
    return run_ort(model, feeds)


def assert_same_outputs(original: onnx.ModelProto, optimized: ir.Model, feeds: Mapping[str, np.ndarray]) -> None:
    """Same output names, and values equal within the dtype's tolerance."""
    assert [o.name for o in original.graph.output] == [v.name for v in optimized.graph.outputs]
    want, got = ort_outputs(original, feeds), ort_outputs(optimized, feeds)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        if w.dtype in TOLERANCE:
            rtol, atol = TOLERANCE[w.dtype]
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, w)
