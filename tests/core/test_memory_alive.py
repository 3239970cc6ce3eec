"""What is alive when a large model's next session is made (issue 25 item 3, the peaks over 2x the weights).

Each test checks what the code holds at the moment a session is made (or that it holds nothing twice),
never a memory figure: ``tools/bench_memory.py`` measures those.

* int8: the weights smoothing made are paged out to a file (:func:`mograph._spill.page_out`) before the
  calibration and sensitivity sessions, and read back when the pass is done; the model is the same, byte
  for byte, as without paging;
* sweep: a model whose weights reach :func:`mograph._spill.save_external_bytes` is measured one model at a
  time: no other model's runner is alive when a session is made;
* bench, validate and every ONNX Runtime runner (:func:`mograph.lowering.lowered_for`): the model each loads
  to read its inputs is collected before the session; validate
  keeps no copy of an original given as a file and does not read the file again to learn its inputs.
"""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import _spill
from mograph.testing import to_ir

ort = pytest.importorskip("onnxruntime")


def _chain(layers: int = 3, width: int = 32) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) / 4).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ------------------------------------------------------------------------------------------- page_out
def test_page_out_maps_the_same_bytes_and_page_in_restores_them(monkeypatch):
    model = to_ir(_chain())
    before = {n: v.const_value.numpy().copy() for n, v in model.graph.initializers.items()}
    assert _spill.page_out(model) == 0  # 12 KiB of weights: below spill_bytes(), nothing done
    assert not any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, "1024")  # the weights now count as large
    bytes_before = _spill.inline_bytes(model)
    assert _spill.page_out(model) == bytes_before
    tensors = [v.const_value for v in model.graph.initializers.values()]
    assert all(isinstance(t, _spill.PagedTensor) for t in tensors)
    folder = tensors[0].base_dir
    for name, value in model.graph.initializers.items():
        assert np.array_equal(value.const_value.numpy(), before[name])
    # not in the model's folder: a serialized copy takes them along (spilled), never refers to a temp folder
    assert _spill.inline_bytes(model) == bytes_before and _spill.too_big(model)
    assert _spill.page_in(model) == bytes_before
    assert not any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    for name, value in model.graph.initializers.items():
        assert np.array_equal(value.const_value.numpy(), before[name])
    del tensors, value
    gc.collect()
    assert not os.path.exists(folder)  # removed with the last paged tensor


def test_int8_smoothed_weights_are_not_in_memory_at_the_sessions_and_the_output_is_the_same(monkeypatch):
    from mograph.passes.quant import QdqInt8Pass
    from mograph.passes.quant import calibration as cal

    rng = np.random.default_rng(1)
    # channels of very different ranges: smoothing moves them into the weights
    samples = [{"x": (rng.standard_normal((4, 32)) * np.linspace(0.1, 20, 32)).astype(np.float32)} for _ in range(4)]

    def run(paging: bool) -> tuple[bytes, list[list[str]], dict]:
        if not paging:
            monkeypatch.setattr(_spill, "page_out", lambda model: 0)
        model = to_ir(_chain())
        in_memory_at_sessions: list[list[str]] = []
        real = cal._session

        def spy(model_bytes, folder=None):
            in_memory_at_sessions.append(sorted(
                n for n, v in model.graph.initializers.items()
                if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
                and v.const_value.nbytes > _spill.INLINE_BYTES))
            return real(model_bytes, folder)

        monkeypatch.setattr(cal, "_session", spy)
        result = QdqInt8Pass(calibration_data=samples, smoothing="0.5", accuracy_budget="cosine>=0.9999").call(model)
        monkeypatch.undo()
        assert not any(isinstance(v.const_value, _spill.PagedTensor) for v in model.graph.initializers.values())
        return ir.serde.serialize_model(model).SerializeToString(), in_memory_at_sessions, dict(result.stats)

    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, "2048")  # 4 KiB weights count as large: the paths of a 4 GB model
    plain, held_plain, stats_plain = run(paging=False)
    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, "2048")
    paged, held_paged, stats_paged = run(paging=True)
    assert stats_plain["smoothed"] > 0 and stats_plain["kept_float"] > 0 and stats_plain == stats_paged
    # the first session (calibration) comes before smoothing; the later ones (sensitivity) after it
    assert len(held_paged) >= 2 and held_paged[0] == held_plain[0] != []
    assert any(any("smoothed" in n for n in names) for names in held_plain[1:])  # what paging takes away
    assert not any(held_paged[1:])  # nothing in memory then
    assert paged == plain  # byte for byte


def test_a_model_with_a_few_paged_tensors_left_still_reaches_onnx_runtime_as_a_file(monkeypatch):
    from mograph.passes.quant import calibration as cal

    model = to_ir(_chain())
    feed = {"x": np.ones((4, 32), np.float32)}
    want = next(cal.run_model(_spill.payload(model), [feed]))[0]
    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, "1024")
    _spill.page_out(model)
    monkeypatch.delenv(_spill.PROTO_LIMIT_ENV)  # the paged bytes are far below the limit again (most quantized)
    assert _spill.inline_bytes(model) < _spill.spill_bytes() and _spill.too_big(model)
    payload = _spill.payload(model)
    assert payload.path is not None  # spilled: never bytes that name a paged file relative to another folder
    assert np.array_equal(next(cal.run_model(payload, [feed]))[0], want)


# ------------------------------------------------------------------------------------------------ sweep
def _targets(tmp_path):
    from mograph.workflow import metrics as M

    paths = []
    for i in range(3):
        p = tmp_path / f"m{i}.onnx"
        onnx.save(_chain(layers=1 + i, width=8), str(p))
        paths.append(M.Target(f"m{i}", p))
    return paths


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_measure_one_at_a_time_holds_one_runner(tmp_path, monkeypatch, one_at_a_time):
    from mograph.workflow import metrics as M

    runners: list[weakref.ref] = []
    alive_at_make: list[int] = []
    backend_cls = type(_ort_backend())
    real = backend_cls.make_runner

    def spy(self, *args, **kwargs):
        gc.collect()
        alive_at_make.append(sum(r() is not None for r in runners))
        runner = real(self, *args, **kwargs)
        runners.append(weakref.ref(runner))
        return runner

    monkeypatch.setattr(backend_cls, "make_runner", spy)
    feed = {"x": np.ones((4, 8), np.float32)}
    out = M.measure(_targets(tmp_path), feed, [feed], warmup=1, iterations=2, one_at_a_time=one_at_a_time)
    assert all(m.error is None and m.metrics.get("latency_p50_ms") for m in out.values())
    assert all(len(m.latencies[0]) == 2 and len(m.outputs) == 1 for m in out.values())
    assert alive_at_make == ([0, 0, 0] if one_at_a_time else [0, 1, 2])


def _ort_backend():
    from mograph.plugins import get_registry

    return get_registry().backends["ort"]


@pytest.mark.parametrize("large", [True, False])
def test_sweep_measures_large_models_one_at_a_time(tmp_path, monkeypatch, large):
    from mograph.workflow import metrics as M
    from mograph.workflow.ledger import open_ledger
    from mograph.workflow.sweep import parse_config, run_sweep

    src = tmp_path / "m.onnx"
    onnx.save(_chain(layers=2, width=8), str(src))
    seen: list[bool] = []
    real = M.measure

    def spy(*args, **kwargs):
        seen.append(kwargs.get("one_at_a_time", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(M, "measure", spy)
    if large:  # 512 bytes of weights count as large
        monkeypatch.setattr(_spill, "save_external_bytes", lambda: 256)
    config = parse_config({"configurations": [{"name": "clean", "passes": ["eliminate-dead"]}],
                           "eval_samples": 1, "warmup": 1, "iterations": 2})
    with open_ledger(tmp_path / "runs.db") as ledger:
        rows = run_sweep(src, config, ledger)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert seen == [large]


# --------------------------------------------------------------------------------------- bench, validate
def _inline_model(path) -> None:
    onnx.save(_chain(layers=2, width=8), str(path))


def test_bench_collects_its_loaded_model_before_the_session(tmp_path, monkeypatch, capsys):
    from mograph import ir_io
    from mograph.cli import main

    path = tmp_path / "m.onnx"
    _inline_model(path)
    loaded: list[weakref.ref] = []
    alive_at_make: list[bool] = []
    real_load = ir_io.load_model
    backend_cls = type(_ort_backend())
    real_make = backend_cls.make_runner

    def load_spy(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loaded.append(weakref.ref(model.graph))  # the graph: a web of cycles that holds the weights
        return model

    def make_spy(self, *args, **kwargs):
        alive_at_make.append(any(r() is not None for r in loaded))  # no collection here: bench's own
        return real_make(self, *args, **kwargs)

    monkeypatch.setattr(ir_io, "load_model", load_spy)
    monkeypatch.setattr(backend_cls, "make_runner", make_spy)
    gc.disable()  # only the collection bench asks for may free the model
    try:
        code = main(["bench", str(path), "--warmup", "1", "--iterations", "2", "--threads", "1", "--json"])
    finally:
        gc.enable()
    capsys.readouterr()
    assert code == 0 and loaded and alive_at_make == [False]


def test_validate_keeps_no_copy_of_a_file_and_reads_it_once(tmp_path, monkeypatch, capsys):
    from mograph import ir_io
    from mograph.cli import main
    from mograph.validate import _verify

    path = tmp_path / "m.onnx"
    _inline_model(path)
    loads: list[weakref.ref] = []
    real_load = ir_io.load_model
    sessions_made_with_loaded_alive: list[bool] = []
    from mograph.backends import ort as ort_backend

    real_session = ort_backend.make_session

    def load_spy(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loads.append(weakref.ref(model.graph))  # the graph: a web of cycles that holds the weights
        return model

    def session_spy(*args, **kwargs):
        sessions_made_with_loaded_alive.append(any(r() is not None for r in loads))
        return real_session(*args, **kwargs)

    monkeypatch.setattr(ir_io, "load_model", load_spy)
    monkeypatch.setattr(_verify.ir_io, "load_model", load_spy)
    monkeypatch.setattr(ort_backend, "make_session", session_spy)
    verifier_copies: list[object] = []
    real_init = _verify.Verifier.__init__

    def init_spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        verifier_copies.append(self._original_copy)

    monkeypatch.setattr(_verify.Verifier, "__init__", init_spy)
    gc.disable()
    try:
        code = main(["validate", str(path), "--backend", "ort"])
    finally:
        gc.enable()
    capsys.readouterr()
    assert code == 0
    assert verifier_copies == [str(path)]  # the file itself, not a copy of its weights
    # the reference session: the model read for the inputs is gone; the candidate's input names come from
    # its session, so the file is read by the Verifier only (and by the runner's lowering check)
    assert sessions_made_with_loaded_alive and not sessions_made_with_loaded_alive[0]
    assert len(loads) <= 2


def test_lowered_for_collects_a_large_model_it_loaded_only_to_look(tmp_path, monkeypatch):
    from mograph import ir_io
    from mograph.lowering import lowered_for
    from mograph.plugins import get_registry

    path = tmp_path / "m.onnx"
    _inline_model(path)
    registry = get_registry()
    graphs: list[weakref.ref] = []
    real_load = ir_io.load_model

    def load_spy(*args, **kwargs):
        model = real_load(*args, **kwargs)
        graphs.append(weakref.ref(model.graph))
        return model

    monkeypatch.setattr(ir_io, "load_model", load_spy)
    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, "256")  # 512 bytes of weights count as large
    gc.disable()  # only the collection lowered_for asks for may free the graph
    try:
        out, stats = lowered_for(str(path), "ort", registry=registry)
    finally:
        gc.enable()
    assert out == str(path) and stats == {}  # nothing to lower: the file itself is run
    assert graphs and graphs[0]() is None
