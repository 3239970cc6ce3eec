"""``_spill.free_dropped`` collects the model copies a pass dropped only when they add up to enough memory.

A full collection walks every object of the process: in a test run or a notebook (hundreds of thousands
of objects) it cost more than the ONNX Runtime session it came before, once per session, whatever the
model's size (issue 28: most of the time of the float16 tests).  It is there for peak memory on large
models, so the sizes of the dropped copies add up and the collection runs once they reach
``_spill.spill_bytes()``.  The automatic collector is off in these tests, so a copy is freed only by
``free_dropped``.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir
import pytest

from mograph import _spill, ir_io


def _model(weight_bytes: int) -> ir.Model:
    """x -> MatMul(w) -> Relu -> y, ``w`` float32 of about ``weight_bytes``."""
    cols = max(1, weight_bytes // (4 * 16))
    w = ir.Value(name="w", const_value=ir.tensor(np.ones((16, cols), np.float32), name="w"))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 16]))
    mm = ir.node("MatMul", [x, w], name="mm")
    relu = ir.node("Relu", mm.outputs, name="relu")
    graph = ir.Graph([x], relu.outputs, nodes=[mm, relu], initializers=[w], opset_imports={"": 17})
    return ir.Model(graph, ir_version=8)


@pytest.fixture
def no_auto_gc() -> Iterator[None]:
    gc.collect()
    _spill.free_dropped()  # nothing counted from earlier tests
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _dropped_copy(model: ir.Model) -> weakref.ref:
    """A copy of ``model`` (a web of back references: freed by the cycle collector only), dropped; a weak
    reference to its graph."""
    copy = ir_io.copy_model(model)
    ref = weakref.ref(copy.graph)
    del copy
    return ref


def test_footprint_counts_tensors_and_nodes():
    model = _model(64 * 1024)
    assert _spill.footprint(model) == 64 * 1024 + 2 * _spill.NODE_BYTES


def test_a_large_models_copy_is_collected_at_once(no_auto_gc, monkeypatch):
    model = _model(64 * 1024)
    monkeypatch.setattr(_spill, "SPILL_BYTES", 32 * 1024)  # the model is twice the limit
    ref = _dropped_copy(model)
    assert ref() is not None  # the collector is off: only free_dropped frees it
    assert _spill.free_dropped(model)
    assert ref() is None


def test_small_models_copies_wait_until_they_add_up(no_auto_gc, monkeypatch):
    model = _model(4 * 1024)
    size = _spill.footprint(model)
    monkeypatch.setattr(_spill, "SPILL_BYTES", 5 * size)
    refs = []
    for _ in range(4):
        refs.append(_dropped_copy(model))
        assert not _spill.free_dropped(model)
    assert all(r() is not None for r in refs)  # not collected: four copies, below the limit
    refs.append(_dropped_copy(model))
    assert _spill.free_dropped(model)  # the fifth reaches it
    assert all(r() is None for r in refs)
    refs = [_dropped_copy(model)]
    assert not _spill.free_dropped(model)  # counted again from zero
    assert refs[0]() is not None


def test_bytes_count_like_a_model_and_no_argument_always_collects(no_auto_gc, monkeypatch):
    model = _model(1024)
    monkeypatch.setattr(_spill, "SPILL_BYTES", 1 << 20)
    assert not _spill.free_dropped((1 << 20) - 1)
    assert _spill.free_dropped(1)
    ref = _dropped_copy(model)
    assert _spill.free_dropped()
    assert ref() is None
