"""fp16's per-node measurement keeps each ONNX Runtime run's requested tensors under a byte budget (issue 31).

A chain of many nodes, measured once with a budget that holds everything (one session, every tensor read
back per sample: what the pass did before) and once with a small budget: every run requests at most the
budget, and every measured figure — local error, overflow, float32 statistics — and the pass's decisions
are identical.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from mograph.passes.quant import Fp16Pass
from mograph.passes.quant import _fp16_measure as fm
from mograph.passes.quant import calibration as cal
from onnx import helper, numpy_helper

from mograph.errors import OptionError
from mograph.testing import op_counts, to_ir, to_proto

ROWS, WIDTH, LAYERS = 8, 64, 12  # one float32 activation: 2 KiB
ENV = "MOGRAPH_FP16_MEASURE_BYTES"  # spelled out: the test also runs (and fails) on the unbounded code


def _chain() -> onnx.ModelProto:
    """x -> LAYERS x (MatMul, Add, Tanh, Mul by a big scale in the middle layer: overflows in float16) -> y."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(LAYERS):
        w = (rng.standard_normal((WIDTH, WIDTH)) / 8).astype(np.float32)
        b = rng.standard_normal(WIDTH).astype(np.float32)
        s = np.array(3e4 if i == LAYERS // 2 else 1.5, np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}"),
                  numpy_helper.from_array(s, f"s{i}")]
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Tanh", [f"a{i}"], [f"t{i}"], name=f"tanh{i}"),
                  helper.make_node("Mul", [f"t{i}", f"s{i}"], [f"h{i}"], name=f"mul{i}")]
        prev = f"h{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", WIDTH])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((ROWS, WIDTH)).astype(np.float32)} for _ in range(n)]


def _measure(monkeypatch, budget: int) -> tuple[fm.LocalMeasure, list[int]]:
    """measure_local on the chain under ``budget`` bytes; also the bytes each session run returned."""
    monkeypatch.setenv(ENV, str(budget))
    sent: list[int] = []
    real = cal._run_feed

    def spy(sess, outputs, feed, source, index):
        outs = real(sess, outputs, feed, source, index)
        sent.append(sum(np.asarray(o).nbytes for o in outs))
        return outs

    monkeypatch.setattr(cal, "_run_feed", spy)
    model = to_ir(_chain())
    floats = {v.name for v in model.graph.inputs} | {v.name for n in model.graph for v in n.outputs}
    floats |= set(model.graph.initializers)
    positions = list(range(len(model.graph)))
    result = fm.measure_local(model, positions, floats, {}, {}, lambda node: None, _feeds())
    return result, sent


def _same(a: fm.LocalMeasure, b: fm.LocalMeasure) -> None:
    assert a.samples == b.samples == 3
    assert a.error == b.error  # exactly: the same sums in the same order
    assert a.overflow == b.overflow
    assert sorted(a.stats) == sorted(b.stats)
    for name in a.stats:
        assert dataclasses.asdict(a.stats[name]) == dataclasses.asdict(b.stats[name]), name


def test_runs_stay_under_the_budget_with_identical_figures(monkeypatch):
    whole, sent_whole = _measure(monkeypatch, 2**40)
    assert len(sent_whole) == 3  # one session, one run per sample: every tensor of the model at once
    everything = max(sent_whole)
    # x, 49 float32 outputs and 49 float16 twins of 8x64: 2 KiB + 49 * (2 KiB + 1 KiB)
    assert everything == ROWS * WIDTH * (4 + (4 * LAYERS + 1) * 6)
    budget = 16 * 1024
    chunked, sent = _measure(monkeypatch, budget)
    assert max(sent) <= budget < everything
    assert len(sent) == 3 * len(sent) // 3 and len(sent) // 3 >= everything // budget  # groups x samples
    _same(whole, chunked)
    assert chunked.overflow and max(chunked.error.values()) > 0  # figures worth comparing
    assert set(chunked.overflow) == {4 * (LAYERS // 2 + 1)}  # the MatMul after the Mul by 3e4


def test_one_node_over_the_budget_is_a_group_of_its_own(monkeypatch):
    whole, _ = _measure(monkeypatch, 2**40)
    tiny, sent = _measure(monkeypatch, 1)
    assert len(sent) == 3 * (1 + 4 * LAYERS + 1)  # the graph input, then every node alone
    assert max(sent) == ROWS * WIDTH * 6  # one float32 output and its float16 twin
    _same(whole, tiny)


def test_pass_decisions_unchanged_under_a_small_budget(monkeypatch):
    results = []
    for budget in (2**40, 8 * 1024):
        monkeypatch.setenv(ENV, str(budget))
        model = to_ir(_chain())
        result = Fp16Pass(calibration_data=_feeds()).call(model)
        results.append((dict(result.stats), result.details["plan"], op_counts(model)))
    assert results[0] == results[1]
    assert results[0][0]["kept_fp32.overflow"] >= 1


@pytest.mark.parametrize("raw", ["0", "-5", "lots"])
def test_bad_budget_is_one_option_error(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(OptionError, match=ENV):
        fm.measure_local(to_ir(_chain()), [0], {"x", "w0", "m0"}, {}, {}, lambda node: None, _feeds(1))


# ----------------------------------------------------------------------------- custom ops' own shape rules
# Issue 26 item 4: after ``--embedding-precision bits`` the fp16 step of the cuda recipe on Gemma 3 270M split its
# measurement into 387 groups instead of 14 (3,096 model runs).  ONNX infers a custom op through its function
# body and leaves the output's last dim a fresh symbol, so the op's size was estimated as the sum of its inputs:
# a BlockQuantizedGather counted the whole packed table, and everything after it inherited that size.


def _quantized_lm() -> tuple[onnx.ModelProto, int, int]:
    """Gather -> MatMul -> tied LM head, all three through weight-only 4 bits (the table shares the head's data)."""
    from mograph.passes.quant import WeightOnlyPass
    from test_weight_only_embeddings import H as hidden
    from test_weight_only_embeddings import V as vocab
    from test_weight_only_embeddings import _weights, lm

    table, w1, head = _weights(np.random.default_rng(0))
    model = to_ir(lm(table, w1, head, tied="copy"))
    stats = WeightOnlyPass(algorithm="rtn", embedding_precision="bits", output_projection="bits").call(model).stats
    assert stats["quantized.embeddings"] == 1 and stats["embeddings.shared_with_head"] == 1
    return to_proto(model), vocab, hidden


def _lm_feeds(vocab: int, n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    return [{"input_ids": rng.integers(0, vocab, (2, 5)).astype(np.int64)} for _ in range(n)]


def test_custom_ops_are_sized_by_their_own_rules():
    from mograph.plugins import get_registry

    proto, vocab, hidden = _quantized_lm()
    model = to_ir(proto)
    feed = _lm_feeds(vocab, 1)[0]
    ops = get_registry().custom_ops
    sizes = fm._tensor_sizes(model, feed, ops)
    got = {n.op_type + ":" + str(n.outputs[0].name): sizes[str(n.outputs[0].name)] for n in model.graph}
    assert list(got.values()) == [10 * hidden, 10 * hidden, 10 * vocab]  # exact: what ORT returns
    # without the rules (the old code) the weight-only MatMul's output counts its packed weight and the table's
    # output before it; the Gather's own body now lets ONNX infer its output (it reshapes to ids' shape + [K])
    hid = str(model.graph.node(1).outputs[0].name)
    guessed = fm._tensor_sizes(model, feed)
    # without the rules the estimate follows the computed input (the hidden state), not the packed weight
    # (the code before the residual-chain fix summed every input: more than the weight's hidden*hidden/2)
    assert guessed[hid] == 10 * hidden
    # near miss: an op the mapping does not declare keeps the estimate
    partial = {k: v for k, v in ops.items() if k[1] != "WeightOnlyMatMul"}
    assert fm._tensor_sizes(model, feed, partial)[hid] == guessed[hid]


def test_quantized_table_does_not_split_the_measurement(monkeypatch):
    from mograph.plugins import get_registry

    proto, vocab, _ = _quantized_lm()
    sent: list[int] = []
    real = cal._run_feed

    def spy(sess, outputs, feed, source, index):
        outs = real(sess, outputs, feed, source, index)
        sent.append(sum(np.asarray(o).nbytes for o in outs))
        return outs

    monkeypatch.setattr(cal, "_run_feed", spy)

    def measure(budget: int, ops) -> fm.LocalMeasure:
        monkeypatch.setenv(ENV, str(budget))
        sent.clear()
        model = to_ir(proto)
        floats = {v.name for n in model.graph for v in n.outputs}
        # no twins (those need the pass's retyping): the float tensors alone are what the groups are cut by
        return fm.measure_local(model, [], floats, {}, {}, lambda node: None, _lm_feeds(vocab), ops=ops)

    whole = measure(2**40, None)
    everything = max(sent)
    assert len(sent) == 3
    exact = measure(everything, get_registry().custom_ops)
    assert len(sent) == 3 and max(sent) == everything  # one group: the real bytes fit the budget
    guessed = measure(everything, None)
    # the estimate alone no longer splits it either (the code before the rules split it, every node alone,
    # and so did the sum-of-inputs estimate after them: see test_unsized_residual_chain_is_one_group)
    assert len(sent) == 3
    assert whole.samples == exact.samples == guessed.samples == 3 and len(whole.stats) == 3
    for name in whole.stats:  # the same float32 statistics, however grouped
        assert dataclasses.asdict(whole.stats[name]) == dataclasses.asdict(exact.stats[name]) \
            == dataclasses.asdict(guessed.stats[name])


def test_fp16_pass_on_a_quantized_table_five_checks(monkeypatch):
    from mograph.passes.quant import Fp16Pass

    from mograph.plugins import get_registry
    from mograph.testing import assert_close, graph_fingerprint, op_types, run_ort, run_pass

    proto, vocab, _ = _quantized_lm()
    feeds = _lm_feeds(vocab)
    monkeypatch.setenv(ENV, str(2**20))  # 1 MiB: every tensor of the model fits in one group
    model, result = run_pass(Fp16Pass(registry=get_registry(), calibration_data=feeds), proto)
    assert op_types(model) == ["mograph.BlockQuantizedGather", "mograph.WeightOnlyMatMul",
                               "mograph.WeightOnlyMatMul", "Cast"]
    counts = {k: v for k, v in result.stats.items() if isinstance(v, int) and v}
    assert counts == {"converted": 3, "initializers_fp16": 2, "casts": 1, "accuracy.evaluations": 1}
    assert result.stats["accuracy.metric"] > 0.9999
    ref = run_ort(proto, feeds[0])
    assert_close(ref, run_ort(to_proto(model), feeds[0]), 1e-2)  # float16 activations
    before = graph_fingerprint(model)
    assert Fp16Pass(registry=get_registry(), calibration_data=feeds).call(model).modified is False
    assert graph_fingerprint(model) == before
    # near miss: nothing float to convert (an integer-only graph) is left untouched
    g = helper.make_graph([helper.make_node("Add", ["i", "i"], ["o"])], "ints",
                          [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("o", onnx.TensorProto.INT64, [2])])
    ints = to_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert Fp16Pass(registry=get_registry(), calibration_data=feeds).call(ints).modified is False


# ----------------------------------------------------------------------------- unsized tensors along a residual chain
# A BERT-base export (TorchScript, fused for ORT): one dim of the embeddings' output left unsized made the
# sum-of-inputs estimate double at every residual Add; the last tensors were "exabytes" and the fp16 pass
# measured every node in its own session (153 sessions, 6.5 minutes on 4 cores of the H200's host).


def _unsized_residual_chain(layers: int = 40) -> onnx.ModelProto:
    nodes = [helper.make_node("Opaque", ["x"], ["h0"], domain="test.unsized")]  # no schema: its output is unsized
    inits = [numpy_helper.from_array(np.full((1, 8), 0.5, np.float32), "c")]
    for i in range(layers):
        nodes += [helper.make_node("Mul", [f"h{i}", "c"], [f"m{i}"]),
                  helper.make_node("Add", [f"h{i}", f"m{i}"], [f"h{i + 1}"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 8])],
                              [helper.make_tensor_value_info(f"h{layers}", onnx.TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("test.unsized", 1)])


def test_unsized_residual_chain_is_one_group():
    model = to_ir(_unsized_residual_chain())
    feed = {"x": np.ones((4, 8), np.float32)}
    sizes = fm._tensor_sizes(model, feed)
    chain = [sizes[f"h{i}"] for i in range(41)]
    assert chain[1:] == [32] * 40  # the input's 4 x 8 elements, all along (the old estimate: 2**40 x 32 at the end)
    assert sizes["x"] == 32 and sizes["m39"] == 32
    floats = {v.name for n in model.graph for v in n.outputs}
    groups = fm._chunks(model, [], floats, {}, feed, 1 << 20)
    assert len(groups) == 1  # 81 tensors of 128 bytes fit one MiB (the old estimate: a group per node)
    # near miss: a Concat of two unsized tensors is their sum (exact), not the larger one
    model2 = _unsized_residual_chain(1)
    model2.graph.node.append(helper.make_node("Concat", ["h1", "m0"], ["cat"], axis=0))
    model2.graph.output.append(helper.make_tensor_value_info("cat", onnx.TensorProto.FLOAT, None))
    assert fm._tensor_sizes(to_ir(model2), feed)["cat"] == 64
