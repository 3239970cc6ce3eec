"""The static CUDA-graph capture check (``mograph inspect --device cuda``): host shape subgraphs that need no copy
pass; a shape value feeding a device input, control flow, or an op without a CUDA kernel is named."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from mograph.cuda_graph import cuda_graph_check


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto] | None = None) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ir.serde.deserialize_model(proto)


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)


def test_shape_subgraph_into_a_host_input_is_capturable() -> None:
    """Shape -> Gather -> Concat -> Reshape's shape input: host values into a host slot, no Memcpy."""
    model = _model([helper.make_node("Shape", ["x"], ["sh"]),
                    helper.make_node("Gather", ["sh", "zero"], ["b"], axis=0),
                    helper.make_node("Unsqueeze", ["b", "zero1"], ["b1"]),
                    helper.make_node("Concat", ["b1", "minus1"], ["target"], axis=0),
                    helper.make_node("Reshape", ["x", "target"], ["y"])],
                   [X], [Y], [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                              helper.make_tensor("zero1", TensorProto.INT64, [1], [0]),
                              helper.make_tensor("minus1", TensorProto.INT64, [1], [-1])])
    report = cuda_graph_check(model)
    assert report.capturable and report.blockers == [] and report.cpu_nodes == 3


def test_untyped_constant_in_a_shape_subgraph_is_a_shape_value() -> None:
    """A rewrite's ``Constant`` node whose output carries no type (as the lowerings build them) concatenated with a
    shape value: the Concat is a host shape op (its dtype read from the Constant's tensor), Expand reads it on the
    host -- capturable.  It was taken for a device node reading a host value (a false "NO")."""
    ones = helper.make_node("Constant", [], ["ones"], value=helper.make_tensor("v", TensorProto.INT64, [2], [1, 1]))
    model = _model([ones, helper.make_node("Shape", ["x"], ["sh"]),
                    helper.make_node("Gather", ["sh", "one"], ["s"], axis=0),
                    helper.make_node("Unsqueeze", ["s", "zero1"], ["s1"]),
                    helper.make_node("Concat", ["ones", "s1", "one1"], ["target"], axis=0),
                    helper.make_node("Unsqueeze", ["x", "zero1"], ["x4"]),
                    helper.make_node("Expand", ["x4", "target"], ["y"])],
                   [X], [Y], [helper.make_tensor("one", TensorProto.INT64, [], [1]),
                              helper.make_tensor("zero1", TensorProto.INT64, [1], [0]),
                              helper.make_tensor("one1", TensorProto.INT64, [1], [1])])
    model.graph.node(0).outputs[0].type = None  # as a rewrite leaves it: no recorded type
    report = cuda_graph_check(model)
    assert report.capturable, report.blockers
    assert report.cpu_nodes == 3  # Gather, Unsqueeze, Concat


def test_constant_of_shape_fill_type_decides_where_it_runs() -> None:
    """Row indices counted on the device: ConstantOfShape(shape, float64 1) -> CumSum -> Cast int64 -> an int
    input of a device op.  The ConstantOfShape writes float64 (its ``value``'s type, not its int64 shape input's),
    so it is a device node and the chain needs no copy: capturable.  (It was read as the shape input's int64, which
    made the chain a host shape subgraph feeding the Gather's device index: a NO.)"""
    def chain(fill: onnx.TensorProto) -> ir.Model:
        return _model([helper.make_node("Shape", ["x"], ["sh"], start=1, end=2),
                       helper.make_node("ConstantOfShape", ["sh"], ["ones"], value=fill),
                       helper.make_node("CumSum", ["ones", "axis"], ["rows"], exclusive=1),
                       helper.make_node("Cast", ["rows"], ["idx"], to=TensorProto.INT64),
                       helper.make_node("Gather", ["x", "idx"], ["y"], axis=1, name="gather_rows")],
                      [X], [Y], [helper.make_tensor("axis", TensorProto.INT64, [], [0])])

    device = cuda_graph_check(chain(helper.make_tensor("v", TensorProto.DOUBLE, [1], [1.0])))
    assert device.capturable and device.cpu_nodes == 0, device.blockers


def test_shape_value_into_a_device_input_blocks() -> None:
    """Positions from the shape (Range on the host) cast to float and added to a device tensor: a Memcpy."""
    model = _model([helper.make_node("Shape", ["x"], ["sh"]),
                    helper.make_node("Gather", ["sh", "one"], ["s"], axis=0),
                    helper.make_node("Range", ["zero", "s", "one"], ["pos"]),
                    helper.make_node("Cast", ["pos"], ["posf"], to=TensorProto.FLOAT),
                    helper.make_node("Unsqueeze", ["posf", "axes"], ["posu"]),
                    helper.make_node("Add", ["x", "posu"], ["y"], name="add_positions")],
                   [X], [Y], [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
                              helper.make_tensor("one", TensorProto.INT64, [], [1]),
                              helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    report = cuda_graph_check(model)
    assert not report.capturable
    # the float Cast is not a shape op: it runs on the device and reads the host Range -> it is named first
    assert report.blockers[0]["op"] == "Cast" and "host" in report.blockers[0]["reason"]
    json.dumps(report.to_dict())


def test_control_flow_blocks() -> None:
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    model = _model([helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)],
                   [X, cond], [Y])
    report = cuda_graph_check(model)
    assert not report.capturable and report.blockers[0]["node"] == "branch"


def test_device_only_graph_is_capturable() -> None:
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.ones(64, dtype=np.float32).tolist())
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [X], [Y], [w])
    assert cuda_graph_check(model).capturable


def test_inspect_device_cuda_cli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    model = _model([helper.make_node("Shape", ["x"], ["sh"]),
                    helper.make_node("Cast", ["sh"], ["shf"], to=TensorProto.FLOAT),
                    helper.make_node("Add", ["x", "shf"], ["y"], name="adds_shape")], [X], [Y])
    path = tmp_path / "m.onnx"
    onnx.save(ir.serde.serialize_model(model), path)
    out = subprocess.run([sys.executable, "-m", "mograph", "inspect", str(path), "--device", "cuda", "--json"],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    found = data.get("cuda_graph") or data.get("data", {}).get("cuda_graph")
    assert found is not None and found["capturable"] is False
    assert found["blockers"][0]["op"] == "Cast"
