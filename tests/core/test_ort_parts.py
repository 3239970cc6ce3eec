"""The output check's ONNX Runtime load of a very large graph, made in consecutive parts (mograph._ort_parts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import _ort_parts, ir_io
from mograph.irutil import serialize_model
from mograph.output_check import InvalidModel, _ort_check_options, check_model_output

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).resolve().parents[1] / "data"


def _load(part: onnx.ModelProto):
    return ort.InferenceSession(part.SerializeToString(), _ort_check_options(), providers=["CPUExecutionProvider"])


def _chain(n: int, head: list[onnx.NodeProto] | None = None, tail: list[onnx.NodeProto] | None = None,
           x_type: int = TensorProto.FLOAT, x_shape: list = (2, 3), out: str = "y", out_type: int = TensorProto.FLOAT, out_shape: list = (2, 3),
           initializers: list[onnx.TensorProto] = (), opset: int = 17) -> onnx.ModelProto:
    """``head`` nodes (reading ``x``, writing ``h``), ``n`` Identity nodes h -> c{n}, then ``tail`` (writing ``out``)."""
    nodes = list(head or [helper.make_node("Identity", ["x"], ["h"], name="head")])
    prev = "h"
    for i in range(n):
        nodes.append(helper.make_node("Identity", [prev], [f"c{i}"], name=f"id{i}"))
        prev = f"c{i}"
    nodes.extend(tail or [helper.make_node("Relu", [prev], [out], name="tail")])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                              [helper.make_tensor_value_info(out, out_type, list(out_shape))], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)  # ORT 1.31.1 too


def _check(proto: onnx.ModelProto, monkeypatch, part_nodes: int) -> dict[str, str]:
    monkeypatch.setattr(_ort_parts, "PART_NODES", part_nodes)
    return check_model_output(ir.serde.deserialize_model(proto))


def test_a_long_graph_loads_in_parts_and_says_so(monkeypatch):
    proto = _chain(58)  # 60 nodes
    assert _check(proto, monkeypatch, 10)["onnxruntime"] == (
        "passed (loaded in 6 consecutive parts of the graph, graph optimizations off)")
    # up to twice the part size: loaded whole
    assert _check(proto, monkeypatch, 30)["onnxruntime"] == "passed (loaded, graph optimizations off)"


def test_a_short_last_run_joins_the_part_before_it():
    calls: list[int] = []

    def load(part):
        calls.append(len(part.graph.node))
        return _load(part)

    assert _ort_parts.load_in_parts(_chain(62), load, part_nodes=10) == 6  # 64 nodes: 10 x 5 + 14
    assert calls == [10, 10, 10, 10, 10, 14]


def test_a_type_made_in_the_first_part_and_refused_in_the_last_is_refused(monkeypatch):
    """Cast to int32 at the start, Sin (floating types only) at the end: the type crosses five cuts."""
    proto = _chain(58, head=[helper.make_node("Cast", ["x"], ["h"], to=TensorProto.INT32, name="cast")],
                   tail=[helper.make_node("Sin", ["c57"], ["y"], name="sin")], out_type=TensorProto.INT32)
    for part_nodes in (10, 1000):  # in parts, and whole
        with pytest.raises(InvalidModel) as err:
            _check(proto, monkeypatch, part_nodes)
        assert err.value.tool == "onnxruntime" and err.value.node == "sin", err.value.detail


def test_a_shape_known_only_by_inference_across_cuts_is_still_checked(monkeypatch):
    """x is [2, 3]; 58 Identities later a MatMul with a [4, 5] weight: ONNX Runtime's inference refuses the
    dimensions, which reach the last part only through the shapes each part's load reported."""
    w = numpy_helper.from_array(np.ones((4, 5), np.float32), "w")
    proto = _chain(58, tail=[helper.make_node("MatMul", ["c57", "w"], ["y"], name="mm")], initializers=[w],
                   out_shape=[2, 5])
    for part_nodes in (10, 1000):
        with pytest.raises(InvalidModel) as err:
            _check(proto, monkeypatch, part_nodes)
        assert err.value.node == "mm", err.value.detail
    ok = numpy_helper.from_array(np.ones((3, 5), np.float32), "w")
    proto = _chain(58, tail=[helper.make_node("MatMul", ["c57", "w"], ["y"], name="mm")], initializers=[ok],
                   out_shape=[2, 5])
    assert "3 consecutive parts" in _check(proto, monkeypatch, 20)["onnxruntime"]


def test_outer_values_of_a_branch_and_unused_or_passed_through_names_load_in_parts():
    """An If in the last part whose branches read a value made in the first; an unused initializer; a graph
    output that is the graph input itself; a graph output made in the middle and read later too."""
    then = helper.make_graph([helper.make_node("Add", ["h", "c5"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["h"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    cond = numpy_helper.from_array(np.array(True), "cond")
    unused = numpy_helper.from_array(np.zeros((7,), np.float32), "unused")
    proto = _chain(38, tail=[helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="if")],
                   initializers=[cond, unused])
    proto.graph.output.extend([helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("c5", TensorProto.FLOAT, [2, 3])])
    sizes: list[tuple[int, list[str], list[str]]] = []

    def load(part):
        sizes.append((len(part.graph.node), [v.name for v in part.graph.input], [v.name for v in part.graph.output]))
        return _load(part)

    assert _ort_parts.load_in_parts(proto, load, part_nodes=10) == 4
    assert sizes[0] == (10, ["x"], ["x", "h", "c5", "c8"])  # h and c5: read by the If's branches in the last part
    assert sizes[-1] == (10, ["c28", "h", "c5"], ["y"])  # branches in attribute order: else, then
    assert _load(proto)  # and whole


def test_a_name_read_before_it_is_made_is_loaded_whole():
    proto = _chain(30)
    nodes = list(proto.graph.node)
    nodes[3], nodes[20] = nodes[20], nodes[3]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    assert _ort_parts.load_in_parts(proto, _load, part_nodes=5) == 0


@pytest.mark.parametrize("folder", ["corpus", "decoders"])
def test_every_corpus_model_loads_in_parts_as_it_loads_whole(folder):
    """Each model of the test corpus (every exporter's spelling, decoders with their caches), cut in three, in
    seven and into runs of two nodes: every part loads (the whole does), and the parts are made as asked."""
    files = sorted((DATA / folder).glob("*.onnx"))
    assert files
    for path in files:
        proto = serialize_model(ir_io.load_model(path, check=False))
        count = len(proto.graph.node)
        _load(proto)
        for part_nodes in (count // 3, count // 7, 2):
            if part_nodes < 1 or count <= 2 * part_nodes:
                continue
            parts = _ort_parts.load_in_parts(proto, _load, part_nodes=part_nodes)
            runs = -(-count // part_nodes)
            expected = runs - 1 if count % part_nodes and count % part_nodes < part_nodes // 2 else runs
            assert parts == expected, (path.name, part_nodes, parts)


def test_a_spilled_model_loads_in_parts_reading_its_data_from_the_spilled_folder(monkeypatch):
    """Past the protobuf limit (lowered here) the check's payload is a spilled file whose weights are external
    data: every part reads its weights from that folder; a refused node there is refused the same way."""
    from mograph import _spill

    monkeypatch.setenv("MOGRAPH_PROTO_LIMIT", "4096")
    spills: list[object] = []
    real_spill = _spill.spill
    monkeypatch.setattr(_spill, "spill", lambda model: spills.append(model) or real_spill(model))
    w = numpy_helper.from_array(np.ones((3, 512), np.float32), "w")  # 6 KiB each: external data once spilled
    head = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm")]
    tail = [helper.make_node("Add", ["c37", "b"], ["y"], name="add")]
    for rows, refused in ((3, True), (1, False)):
        b = numpy_helper.from_array(np.ones((rows, 512), np.float32), "b")
        proto = _chain(38, head=head, tail=tail, initializers=[w, b], out_shape=[2, 512])
        if refused:  # [2, 512] + [3, 512]
            with pytest.raises(InvalidModel) as err:
                _check(proto, monkeypatch, 10)
            assert err.value.tool == "onnxruntime" and err.value.node == "add", err.value.detail
        else:
            assert _check(proto, monkeypatch, 10)["onnxruntime"] == (
                "passed (loaded in 4 consecutive parts of the graph, graph optimizations off)")
    assert len(spills) == 2
