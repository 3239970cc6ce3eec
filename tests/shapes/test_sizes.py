"""The numeric side of the shape facility: the query's sizes as numbers, constants through Identity, and a
reshape target entry by entry with the constant that stores each entry."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mograph.shapes import ShapeQuery, Sizes, const_tensor, int_vector, owns_tensor, shape_literals


def _model() -> tuple[ir.Model, dict[str, ir.Value]]:
    """x[b, 6] -> MatMul(w[6, 4]) -> Reshape(., Concat(Unsqueeze(Shape(x)[0]), [2, 2])); w also via Identity."""
    x = ir.Value(name="x", shape=ir.Shape(["b", 6]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", const_value=ir.tensor(np.ones((6, 4), np.float32)))
    w.shape, w.type = ir.Shape([6, 4]), ir.TensorType(ir.DataType.FLOAT)
    tail = ir.Value(name="tail", const_value=ir.tensor(np.array([2, 2], np.int64)))
    tail.shape, tail.type = ir.Shape([2]), ir.TensorType(ir.DataType.INT64)
    zero = ir.Value(name="zero", const_value=ir.tensor(np.array([0], np.int64)))
    zero.shape, zero.type = ir.Shape([1]), ir.TensorType(ir.DataType.INT64)
    ident = ir.node("Identity", [w])
    mm = ir.node("MatMul", [x, ident.outputs[0]])
    shape = ir.node("Shape", [x])
    batch = ir.node("Gather", [shape.outputs[0], zero], attributes={"axis": 0})
    target = ir.node("Concat", [batch.outputs[0], tail], attributes={"axis": 0})
    reshape = ir.node("Reshape", [mm.outputs[0], target.outputs[0]])
    reshape.outputs[0].name = "y"
    for i, n in enumerate([ident, mm, shape, batch, target]):
        n.outputs[0].name = f"t{i}"
    graph = ir.Graph([x], [reshape.outputs[0]], nodes=[ident, mm, shape, batch, target, reshape],
                     initializers=[w, tail, zero], opset_imports={"": 18})
    return ir.Model(graph, ir_version=10), {"w": w, "wid": ident.outputs[0], "mm": mm.outputs[0],
                                            "target": target.outputs[0], "tail": tail, "y": reshape.outputs[0]}


def test_sizes_constants_and_reshape_entries() -> None:
    model, v = _model()
    shapes = Sizes(ShapeQuery(model.graph))
    assert shapes.dims(v["mm"]) == ["b", 4] and shapes.rank(v["mm"]) == 2 and shapes.size(v["mm"], 1) == 4
    assert shapes.dims(v["y"]) is not None and shapes.dims(v["y"])[1:] == [2, 2]
    assert shapes.dims(v["wid"]) == [6, 4]  # a constant behind an Identity: its tensor's shape
    assert const_tensor(v["wid"]) is v["w"].const_value and owns_tensor(v["w"]) and not owns_tensor(v["wid"])
    assert int_vector(v["tail"]) == [2, 2] and int_vector(v["mm"]) is None
    entries = shape_literals(v["target"], shapes)
    assert entries is not None and [e[0] for e in entries] == [None, 2, 2]  # the batch is computed at run time
    assert entries[1][1] is v["tail"] and (entries[1][2], entries[2][2]) == (0, 1)  # where each literal is stored
    shapes.set_size(v["mm"], 1, 3)
    assert shapes.dims(v["mm"]) == ["b", 3]
