"""The mechanisms that keep the precision passes' peak memory down (issue 25 item 3), each checked directly.

No memory threshold here (``tests/core/test_peak_memory.py`` has those): each test checks that a buffer is
freed or an option is set where it must be, and that the numbers are the ones the plain code gives.

* GPTQ's factor: :func:`cholesky_of_inverse` is ``np.linalg.cholesky(np.linalg.inv(h))`` bit for bit (and
  raises where numpy raises), through the LAPACK numpy itself calls, without numpy's copies;
* the sessions that read numbers (calibration, fp16 measurement, ``--verify``) have ONNX Runtime's CPU
  memory arena off and its memory pattern on; ``make_session`` keeps ORT's defaults unless told;
* fp16's measurement frees its float16 twin before the session is made; int8's per-layer sensitivity frees
  the activation session before it fake-quantizes the weights; its end-to-end evaluations free the
  quantized model before its session;
* the int4 pass's tied-embedding check compares the tables a slice at a time and forgets their pages.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from mograph.passes.quant import QdqInt8Pass, WeightOnlyPass
from mograph.passes.quant import _blockwise as bw
from mograph.passes.quant import _fp16_measure as fm
from mograph.passes.quant import calibration as cal
from mograph.passes.quant import sensitivity as sens
from mograph.passes.quant import weight_only as wo
from onnx import helper, numpy_helper

from mograph import _spill
from mograph.testing import to_ir

ort = pytest.importorskip("onnxruntime")


def _spd(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3 * n, n))
    h = x.T @ x / (3 * n)
    h[np.diag_indices(n)] += 0.01 * float(np.mean(np.diag(h)))
    return h


@pytest.mark.parametrize("n", [1, 2, 7, 130, 513])
def test_cholesky_of_inverse_is_numpys_bit_for_bit(n):
    h = _spd(n, n)
    before = h.copy()
    got = bw.cholesky_of_inverse(h)
    want = np.linalg.cholesky(np.linalg.inv(h))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.flags.c_contiguous == want.flags.c_contiguous
    assert np.array_equal(got, want)  # exactly: the same LAPACK routines on the same numbers
    assert np.array_equal(h, before)  # the caller's matrix is left as it was


@pytest.mark.parametrize("h", [np.ones((4, 4)), -np.eye(3), np.zeros((5, 5))])
def test_cholesky_of_inverse_raises_where_numpy_raises(h):
    with pytest.raises(np.linalg.LinAlgError):
        np.linalg.cholesky(np.linalg.inv(h))
    with pytest.raises(np.linalg.LinAlgError):
        bw.cholesky_of_inverse(h)


def test_cholesky_of_inverse_does_not_go_through_numpys_copies(monkeypatch):
    if bw._numpy_lapack() is None:
        pytest.skip("numpy's LAPACK is not the bundled scipy-openblas64 here: numpy itself is used")
    h = _spd(64, 3)
    want = np.linalg.cholesky(np.linalg.inv(h))

    def refused(*args, **kwargs):
        raise AssertionError("numpy.linalg's inv/cholesky called: four [K, K] matrices at once")

    monkeypatch.setattr(np.linalg, "inv", refused)
    monkeypatch.setattr(np.linalg, "cholesky", refused)
    assert np.array_equal(bw.cholesky_of_inverse(h), want)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_factor_same_with_or_without_numpys_lapack(monkeypatch, act_order):
    h = _spd(200, 5)
    h[7, :] = h[:, 7] = 0.0  # a dead row
    fast = bw.gptq_factor(h.copy(), damp=0.01, act_order=act_order)
    monkeypatch.setattr(bw, "_numpy_lapack", lambda: None)
    plain = bw.gptq_factor(h.copy(), damp=0.01, act_order=act_order)
    for a, b in zip((fast.perm, fast.diag, fast.dead), (plain.perm, plain.diag, plain.dead)):
        assert np.array_equal(a, b)
    # the factor: dpotrf + dtrtri through numpy's LAPACK, or numpy's cholesky and inv: equal up to rounding
    assert np.max(np.abs(fast.hinv - plain.hinv)) <= 1e-13 * np.max(np.abs(plain.hinv))
    assert fast.hinv.flags.f_contiguous == plain.hinv.flags.f_contiguous  # the same layout for gptq's products


def _matmul_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_measuring_sessions_have_the_arena_off_and_make_session_keeps_orts_defaults():
    from mograph.backends import ort as ort_backend

    proto = _matmul_model()
    calibration = cal._session(proto.SerializeToString()).get_session_options()
    assert not calibration.enable_cpu_mem_arena and calibration.enable_mem_pattern  # the pattern: one block
    # no spinning between runs: GPTQ's numpy work runs there (the numbers are the same)
    assert calibration.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    measuring = ort_backend.make_session(proto, memory_arena=False).get_session_options()
    assert not measuring.enable_cpu_mem_arena and measuring.enable_mem_pattern
    default = ort_backend.make_session(proto).get_session_options()  # bench and sweep time what deployments run
    assert default.enable_cpu_mem_arena and default.enable_mem_pattern


def test_verify_sessions_have_the_arena_off(monkeypatch):
    from mograph import api
    from mograph.backends import ort as ort_backend

    seen: list[bool] = []
    real = ort_backend.make_session

    def spy(*args, **kwargs):
        seen.append(kwargs.get("memory_arena", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(ort_backend, "make_session", spy)
    api.optimize(_matmul_model(), passes=["eliminate-dead"], verify=True)
    assert seen and not any(seen)  # the original's session and the candidate's


def test_fp16_measure_frees_the_twin_before_its_session(monkeypatch):
    twins: list[weakref.ref] = []
    alive_at_session: list[bool] = []
    real_twin, real_session = fm._twin_model, cal._session

    def twin_spy(*args, **kwargs):
        out = real_twin(*args, **kwargs)
        twins.append(weakref.ref(out[0]))
        return out

    def session_spy(model_bytes, folder=None):
        gc.collect()
        alive_at_session.append(any(t() is not None for t in twins))
        return real_session(model_bytes, folder)

    monkeypatch.setattr(fm, "_twin_model", twin_spy)
    monkeypatch.setattr(cal, "_session", session_spy)
    model = to_ir(_matmul_model())
    floats = {"x", "y", "w"}
    feeds = [{"x": np.ones((2, 8), np.float32)}]
    result = fm.measure_local(model, [0], floats, {}, {}, lambda node: None, feeds)
    assert twins and alive_at_session == [False]
    assert result.samples == 1 and 0 in result.error


def _chain(layers: int = 3, width: int = 32) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) / 4).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, width])],
                              [helper.make_tensor_value_info(prev, onnx.TensorProto.FLOAT, [4, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class _Held:
    """A session wrapper a weak reference can follow."""

    def __init__(self, sess):
        self.sess = sess

    def run(self, *args, **kwargs):
        return self.sess.run(*args, **kwargs)


def test_int8_sensitivity_frees_sessions_and_models_before_the_next_buffers(monkeypatch):
    sessions: list[weakref.ref] = []
    acts_session_alive_at_fake_quant: list[bool] = []
    real_session, real_fq, real_payload = sens._session, sens._quantized_weight, sens._mix_payload

    def session_spy(model_bytes, folder=None):
        held = _Held(real_session(model_bytes, folder))
        if len(onnx.load_from_string(model_bytes).graph.node) > 1:  # the model run for the layers' inputs
            sessions.append(weakref.ref(held))
        return held

    def fq_spy(*args, **kwargs):
        acts_session_alive_at_fake_quant.append(sessions[0]() is not None)
        return real_fq(*args, **kwargs)

    built: list[weakref.ref] = []
    models_alive: list[bool] = []
    real_deserialize = sens.ir.serde.deserialize_model

    def deserialize_spy(proto):
        model = real_deserialize(proto)
        built.append(weakref.ref(model))
        return model

    def payload_spy(*args, **kwargs):
        out = real_payload(*args, **kwargs)
        gc.collect()
        models_alive.append(built[-1]() is not None)
        return out

    monkeypatch.setattr(sens.ir.serde, "deserialize_model", deserialize_spy)
    monkeypatch.setattr(sens, "_session", session_spy)
    monkeypatch.setattr(sens, "_quantized_weight", fq_spy)
    monkeypatch.setattr(sens, "_mix_payload", payload_spy)
    rng = np.random.default_rng(1)
    samples = [{"x": rng.standard_normal((4, 32)).astype(np.float32)} for _ in range(4)]
    result = QdqInt8Pass(calibration_data=samples, accuracy_budget="cosine>=0.99999").call(to_ir(_chain()))
    assert result.stats["sensitivity_evaluations"] >= 1
    # every sample's activations were read first (they are far smaller than the weights): no session then
    assert acts_session_alive_at_fake_quant and not any(acts_session_alive_at_fake_quant)
    assert models_alive and not any(models_alive)  # the Q/DQ model is gone once its payload is made


def test_tied_table_check_reads_slices_and_forgets_pages(monkeypatch):
    released: list[object] = []
    real = _spill.release_pages
    monkeypatch.setattr(_spill, "release_pages", lambda t: (released.append(t), real(t)))
    rng = np.random.default_rng(0)
    table = rng.standard_normal((512, 128)).astype(np.float32)
    model = to_ir(_matmul_model())
    value = model.graph.initializers["w"]
    tensor = onnx.numpy_helper.from_array(table, "t")
    t_ir = ir.serde.deserialize_tensor(tensor)
    head = wo._Layer(model.graph[0], "mm", np.ascontiguousarray(table.T), value)
    assert wo._same_table(head, t_ir) is True
    assert t_ir in released
    other = table.copy()
    other[-1, -1] += 1.0  # differs in the last slice only
    head2 = wo._Layer(model.graph[0], "mm", np.ascontiguousarray(other.T), value)
    assert wo._same_table(head2, t_ir) is False
    slices = []
    real_eq = np.array_equal
    monkeypatch.setattr(np, "array_equal", lambda a, b: (slices.append(a.shape), real_eq(a, b))[1])
    other[0, 0] += 1.0  # and in the first: the compare stops there
    head3 = wo._Layer(model.graph[0], "mm", np.ascontiguousarray(other.T), value)
    assert wo._same_table(head3, t_ir) is False
    assert len(slices) == 1


def test_int4_tied_head_is_still_found():
    """An LM head that is the embedding transposed (two initializers): the pass still treats them as tied."""
    rng = np.random.default_rng(0)
    vocab, hidden = 256, 128
    emb = rng.standard_normal((vocab, hidden)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["h"], name="gather"),
             helper.make_node("MatMul", ["h", "head"], ["logits"], name="head")]
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 4, vocab])],
        [numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(np.ascontiguousarray(emb.T), "head")])
    model = to_ir(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    layers, _ = WeightOnlyPass(algorithm="rtn")._layers(model)
    tables = WeightOnlyPass(algorithm="rtn")._tables(model, layers)
    assert len(tables) == 1 and tables[0].head is not None and not tables[0].same
    assert tables[0].head.key == layers[0].key


def _pin_in_subprocess(env: dict[str, str]) -> str:
    import os
    import subprocess
    import sys

    code = "from mograph import _spill; print(_spill.pin_mmap_threshold(), _spill._pinned)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's mallopt")
def test_mmap_threshold_pinned_unless_the_user_set_one():
    assert _pin_in_subprocess({}) == f"True [{_spill.MMAP_THRESHOLD}]"
    assert _pin_in_subprocess({_spill.MMAP_THRESHOLD_ENV: "1048576"}) == "True [1048576]"
    assert _pin_in_subprocess({_spill.MMAP_THRESHOLD_ENV: "0"}) == "False []"
    assert _pin_in_subprocess({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == "False []"


def test_payload_pins_the_threshold_for_large_models_only(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(_spill, "pin_mmap_threshold", lambda: calls.append(1) or True)
    model = to_ir(_matmul_model())  # 128 bytes of weights
    _spill.payload(model)
    assert calls == []
    monkeypatch.setenv(_spill.PROTO_LIMIT_ENV, "64")  # the weights now count as large
    _spill.payload(model)
    assert calls == [1]
