"""The rule table (registration, versions, clashes) and what the query answers over a graph."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

from mograph.errors import MographError
from mograph.shapes import Dim, ShapeQuery, ShapeRule, ShapeRuleError, ShapeRules, builtin_rules, shape_rule


def _graph(opset: int = 18) -> tuple[ir.Graph, dict[str, ir.Value]]:
    """x[b, s, 8] -> Relu -> Reshape(., Concat(Shape(x)[0:1], [-1, 2])) -> Custom (domain my.ops)."""
    x = ir.Value(name="x", shape=ir.Shape(["b", "s", 8]), type=ir.TensorType(ir.DataType.FLOAT))
    other = ir.Value(name="other", shape=ir.Shape(["b", "unk__0"]), type=ir.TensorType(ir.DataType.FLOAT))
    tail = ir.Value(name="tail", const_value=ir.tensor(np.array([-1, 2], dtype=np.int64)))
    tail.shape, tail.type = ir.Shape([2]), ir.TensorType(ir.DataType.INT64)
    relu = ir.node("Relu", [x])
    shape = ir.node("Shape", [x], attributes={"end": 1})
    target = ir.node("Concat", [shape.outputs[0], tail], attributes={"axis": 0})
    reshape = ir.node("Reshape", [relu.outputs[0], target.outputs[0]])
    custom = ir.node("Twice", [reshape.outputs[0]], domain="my.ops")
    graph = ir.Graph([x, other], [custom.outputs[0]], nodes=[relu, shape, target, reshape, custom], initializers=[tail],
                     opset_imports={"": opset, "my.ops": 1})
    return graph, {"x": x, "other": other, "relu": relu.outputs[0], "target": target.outputs[0],
                   "reshape": reshape.outputs[0], "custom": custom.outputs[0]}


def test_query_dims_values_same_dim_and_witness() -> None:
    graph, v = _graph()
    q = ShapeQuery(graph)
    assert q.dims(v["relu"]) == (("=b",), ("=s",), (8,))
    assert q.values(v["target"]) == (False, (("=b",), (-1,), (2,)))
    assert q.dims(v["reshape"]) == (("=b",), (4, "=s"), (2,))  # -1 is the rest: 8*s / 2
    assert q.same_dim(v["x"], 0, v["reshape"], 0) and q.same_dim(v["x"], 0, v["other"], 0)
    assert not q.same_dim(v["x"], 1, v["reshape"], 1)
    assert q.dim(v["x"], -1) == Dim.lit(8) and q.dim(v["x"], 3) is None
    assert q.witness["=b"] == (v["x"], 0)  # the first value (graph inputs first) carrying b
    # An unk__ dim is a fresh atom of that value alone, never equal to another value's.
    assert not q.same_dim(v["other"], 1, v["other"], 0) and q.dim(v["other"], 1).symbol.startswith("?")
    assert q.dims(v["custom"]) is None  # no rule for my.ops::Twice, nothing inferred


def test_registered_rules_are_a_parameter() -> None:
    """A custom op's rule, registered into a table the caller hands over, is consulted like a built-in."""
    rules = builtin_rules()

    @shape_rule(rules, "my.ops", "Twice")
    def twice(node: ir.Node, q: ShapeQuery) -> list:
        d = q.dims(node.inputs[0])
        return [d[:-1] + (Dim.lit(2 * d[-1].coef),)]

    graph, v = _graph()
    assert ShapeQuery(graph, rules).dims(v["custom"]) == (("=b",), (4, "=s"), (4,))
    plain = ShapeRules([ShapeRule("my.ops", "Twice", 1, dims=lambda node, q: [(("=s", 2), 1, (0, "x"))])])
    assert ShapeQuery(graph, plain).dims(v["custom"]) == ((2, "=s"), (), (0,))  # plain tuples: read in normal form
    assert ShapeQuery(graph).dims(v["custom"]) is None  # the default table is fresh, not shared


def test_lookup_by_version_and_clashes() -> None:
    def one(node: ir.Node, q: ShapeQuery) -> None:
        return None

    table = ShapeRules([ShapeRule("", "Op", 1, dims=one), ShapeRule("ai.onnx", "Op", 13, dims=one)])
    assert table.lookup("", "Op", 12).since_version == 1
    assert table.lookup("ai.onnx", "Op", 13).since_version == 13
    assert table.lookup("", "Op", None).since_version == 13  # unknown version: the newest
    assert table.lookup("", "Other", 13) is None and len(table) == 2
    with pytest.raises(ShapeRuleError, match="already registered") as info:
        table.register(ShapeRule("", "Op", 13, dims=one))
    assert isinstance(info.value, MographError)
    with pytest.raises(ShapeRuleError):
        table.merged([ShapeRule("ai.onnx", "Op", 1, values=one)])
    shape_rule(table, "", "Op", 13, kind="values")(one)  # a values rule completes the dims rule of the key
    assert table.lookup("", "Op", 13).values is one and table.lookup("", "Op", 13).dims is one
    with pytest.raises(ShapeRuleError):
        shape_rule(table, "", "Op", 13, kind="values")(one)



def test_the_query_only_reads() -> None:
    """Sweeping a graph writes nothing into it: a ``Constant``'s tensor keeps its own name (ONNX IR's
    ``get_const_tensor`` would name it after the node's output), and the dims on the values stay."""
    x = ir.Value(name="x", shape=ir.Shape(["b", 8]), type=ir.TensorType(ir.DataType.FLOAT))
    tensor = ir.tensor(np.array([0, -1], dtype=np.int64))
    assert tensor.name is None
    const = ir.node("Constant", [], attributes={"value": tensor})
    const.outputs[0].name = "target"
    reshape = ir.node("Reshape", [x, const.outputs[0]])
    graph = ir.Graph([x], reshape.outputs, nodes=[const, reshape], opset_imports={"": 18})
    q = ShapeQuery(graph)
    assert q.values(const.outputs[0]) == (False, ((0,), (-1,)))  # read: [0, -1]
    assert q.dims(reshape.outputs[0]) == (("=b",), (8,))
    assert const.attributes["value"].value.name is None and reshape.outputs[0].shape is None


def test_refresh_visits_only_the_new_nodes() -> None:
    """A node written after the sweep is unknown until :meth:`ShapeQuery.refresh`, which visits it from the dims
    already known (an earlier value keeps its dims, even one whose producer changed)."""
    graph, v = _graph()
    q = ShapeQuery(graph)
    relu_dims = q.dims(v["relu"])
    tanh = ir.node("Tanh", [v["reshape"]])
    graph.insert_after(v["reshape"].producer(), tanh)
    assert not q.knows(tanh.outputs[0]) and q.dims(tanh.outputs[0]) is None
    q.refresh()
    assert q.knows(tanh.outputs[0]) and q.dims(tanh.outputs[0]) == q.dims(v["reshape"]) == (("=b",), (4, "=s"), (2,))
    assert q.dims(v["relu"]) is relu_dims


def _int32_graph() -> tuple[ir.Graph, dict[str, ir.Value]]:
    """jax2tf's dynamic-batch target: Reshape(m, Cast<to=int64>(Concat(Slice(Cast<to=int32>(Shape(x)), 0, 1), [3], [1])))."""
    x = ir.Value(name="x", shape=ir.Shape(["b", 3, 8]), type=ir.TensorType(ir.DataType.FLOAT))
    m = ir.Value(name="m", shape=ir.Shape(["b", 3]), type=ir.TensorType(ir.DataType.FLOAT))
    consts = {}
    for name, arr in (("z", [0]), ("o", [1]), ("three", [3])):
        consts[name] = ir.Value(name=name, const_value=ir.tensor(np.array(arr, dtype=np.int32)))
        consts[name].shape, consts[name].type = ir.Shape([1]), ir.TensorType(ir.DataType.INT32)
    shape = ir.node("Shape", [x])
    sh32 = ir.node("Cast", [shape.outputs[0]], attributes={"to": ir.DataType.INT32})
    batch = ir.node("Slice", [sh32.outputs[0], consts["z"], consts["o"], consts["z"]])
    k32 = ir.node("Concat", [batch.outputs[0], consts["three"], consts["o"]], attributes={"axis": 0})
    k64 = ir.node("Cast", [k32.outputs[0]], attributes={"to": ir.DataType.INT64})
    reshape = ir.node("Reshape", [m, k64.outputs[0]])
    graph = ir.Graph([x, m], reshape.outputs, nodes=[shape, sh32, batch, k32, k64, reshape],
                     initializers=list(consts.values()), opset_imports={"": 18})
    return graph, {"k32": k32.outputs[0], "k64": k64.outputs[0], "reshape": reshape.outputs[0], "three": consts["three"]}


@pytest.mark.parametrize(("int32", "k32", "k64", "reshaped"), [
    (False, None, None, None),  # the default: int32 vectors untracked, the Reshape's dims unknown
    (True, (False, (("=b",), (3,), ())), (False, (("=b",), (3,), ())), (("=b",), (3,), ())),
])
def test_int32_shape_vectors_only_when_asked(int32: bool, k32: object, k64: object, reshaped: object) -> None:
    """``int32=True``: int32 constants and ``Cast`` to int32 are tracked, so the int64 vector cast back has elements
    and the ``Reshape`` to it has dims (a dim of 1 is ``Dim()``); the default query tracks neither."""
    graph, v = _int32_graph()
    q = ShapeQuery(graph, int32=int32)
    assert q.int32 is int32
    assert q.values(v["k32"]) == k32 and q.values(v["k64"]) == k64
    assert q.values(v["three"]) == ((False, ((3,),)) if int32 else None)
    assert q.dims(v["reshape"]) == reshaped


@pytest.mark.parametrize(("dims", "shape"), [
    ((Dim.lit(4), Dim(), Dim.sym("=batch")), [4, 1, "batch"]),  # literals, 1, a named input dim
    ((Dim((2, "=s")), Dim.sym("?0:x:1")), [None, None]),  # a product, a fresh atom: unnamed
    ((), []),
])
def test_as_ir_shape_writes_the_query_dims_back(dims: tuple, shape: list) -> None:
    from mograph.shapes import as_ir_shape

    got = as_ir_shape(dims)
    assert [d if isinstance(d, int) else d.value for d in got] == shape


def _key_graph() -> tuple[ShapeQuery, dict[str, ir.Value]]:
    """x[b, s, 8], u[b, unk__0], w[b, unk__0], a constant c[8]; relu = Relu(x) with no shape written on it, r =
    Reshape(relu, [0, -1, 2]) (dims [b, 4*s, 2]), t = Twice(r) (my.ops: no rule, rank unknown)."""
    x = ir.Value(name="x", shape=ir.Shape(["b", "s", 8]), type=ir.TensorType(ir.DataType.FLOAT))
    u = ir.Value(name="u", shape=ir.Shape(["b", "unk__0"]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", shape=ir.Shape(["b", "unk__0"]), type=ir.TensorType(ir.DataType.FLOAT))
    c = ir.Value(name="c", const_value=ir.tensor(np.zeros(8, dtype=np.float32)))
    c.shape, c.type = ir.Shape([8]), ir.TensorType(ir.DataType.FLOAT)
    target = ir.Value(name="target", const_value=ir.tensor(np.array([0, -1, 2], dtype=np.int64)))
    target.shape, target.type = ir.Shape([3]), ir.TensorType(ir.DataType.INT64)
    relu = ir.node("Relu", [x])
    reshape = ir.node("Reshape", [relu.outputs[0], target])
    twice = ir.node("Twice", [reshape.outputs[0]], domain="my.ops")
    graph = ir.Graph([x, u, w], twice.outputs, nodes=[relu, reshape, twice], initializers=[c, target],
                     opset_imports={"": 18, "my.ops": 1})
    return ShapeQuery(graph), {"x": x, "u": u, "w": w, "c": c, "relu": relu.outputs[0], "r": reshape.outputs[0],
                               "t": twice.outputs[0]}


@pytest.mark.parametrize(("a", "axis_a", "b", "axis_b", "spelled", "equal"), [
    ("x", 0, "u", 0, False, True),  # one input dim name, two values
    ("x", 0, "u", 0, True, True),
    ("x", 2, "c", 0, False, True),  # literal 8
    ("x", 2, "c", 0, True, True),
    ("x", -1, "x", 2, False, True),  # a negative axis counts from the end
    ("x", -1, "x", 2, True, True),
    ("x", 1, "relu", 1, False, True),  # the rules derive relu's dims; nothing is written on relu
    ("x", 1, "relu", 1, True, False),
    ("relu", 1, "relu", 1, True, True),  # an unwritten dim still keys as itself
    ("x", 1, "r", 1, False, False),  # s and 4*s
    ("u", 1, "w", 1, False, False),  # an unk__ name: a fresh atom per value for the rules ...
    ("u", 1, "w", 1, True, True),  # ... but the same name as spelled
    ("u", 1, "u", 0, True, False),
    ("t", 0, "t", 1, False, False),  # rank unknown: a key of each axis alone
    ("t", 0, "t", 0, False, True),
    ("t", 0, "r", 0, False, False),
])
def test_dim_key_equal_exactly_for_dims_known_equal(a: str, axis_a: int, b: str, axis_b: int, spelled: bool,
                                                    equal: bool) -> None:
    q, v = _key_graph()
    ka, kb = q.dim_key(v[a], axis_a, spelled=spelled), q.dim_key(v[b], axis_b, spelled=spelled)
    assert (ka == kb) is equal and hash(ka) == hash(q.dim_key(v[a], axis_a, spelled=spelled))
    if equal and not spelled and ka[0] == "dim":
        assert q.same_dim(v[a], axis_a, v[b], axis_b)  # the key says what same_dim says


def test_dim_key_forms() -> None:
    q, v = _key_graph()
    assert q.dim_key(v["r"], 1) == ("dim", Dim((4, "=s")))
    assert q.dim_key(v["x"], 0, spelled=True) == q.dim_key(v["x"], 0) == ("dim", Dim.sym("=b"))
    assert q.dim_key(v["u"], 1, spelled=True) == ("unk", "unk__0")
    assert q.dim_key(v["t"], 5) == ("at", v["t"], 5) and q.dim_key(v["x"], 3, spelled=True) == ("at", v["x"], 3)
    assert q.dim_key(v["relu"], -2, spelled=True) == ("at", v["relu"], -2)  # no shape written: axis as asked


def _vectors() -> tuple[ShapeQuery, dict[str, ir.Value]]:
    """x[b, s, 8], y[2, 3] and shape vectors of them, spelled the ways exporters write them."""
    x = ir.Value(name="x", shape=ir.Shape(["b", "s", 8]), type=ir.TensorType(ir.DataType.FLOAT))
    y = ir.Value(name="y", shape=ir.Shape([2, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    nodes: list[ir.Node] = []

    def op(op_type: str, inputs: list, **attrs: Any) -> ir.Value:
        nodes.append(ir.node(op_type, inputs, attributes=attrs))
        return nodes[-1].outputs[0]

    def const(vals: list[int] | int) -> ir.Value:
        return op("Constant", [], value=ir.tensor(np.array(vals, dtype=np.int64)))

    shape = op("Shape", [x])
    dim0, dim1 = op("Gather", [shape, const(0)]), op("Gather", [shape, const(1)])
    axes = const([0])
    v = {"x": x, "y": y, "shape": shape, "dim0": dim0,
         "head": op("Shape", [x], end=1), "tail": op("Shape", [x], start=1),
         "spelled": op("Concat", [op("Unsqueeze", [dim0, axes]), op("Unsqueeze", [dim1, axes]), const([8])], axis=0),
         "swapped": op("Concat", [op("Unsqueeze", [dim1, axes]), op("Unsqueeze", [dim0, axes]), const([8])], axis=0),
         "split": op("Concat", [op("Shape", [x], end=1), const([-1, 2])], axis=0), "static": const([2, 3])}
    graph = ir.Graph([x, y], [], nodes=nodes, opset_imports={"": 18})
    return ShapeQuery(graph), v


@pytest.mark.parametrize(("vector", "value", "holds"), [
    ("shape", "x", True),  # Shape(x)
    ("spelled", "x", True),  # Concat(Unsqueeze(Gather(Shape(x), i)) for each i, 8): x's static last dim
    ("swapped", "x", False),  # the entries in another order
    ("split", "x", False),  # [b, -1, 2]: a reshape target, not x's shape
    ("head", "x", False), ("tail", "x", False),  # a part of the shape
    ("dim0", "x", False),  # a scalar
    ("static", "y", True), ("static", "x", False),  # a constant where the dims are static
    ("x", "x", False),  # not a shape vector
])
def test_is_shape_of(vector: str, value: str, holds: bool) -> None:
    q, v = _vectors()
    assert q.is_shape_of(v[vector], v[value]) is holds


@pytest.mark.parametrize(("vector", "ints"), [
    ("shape", [None, None, 8]), ("split", [None, -1, 2]), ("static", [2, 3]), ("dim0", [None]), ("x", None),
])
def test_literals_of_a_shape_vector(vector: str, ints: list | None) -> None:
    q, v = _vectors()
    assert q.literals(v[vector]) == ints


@pytest.mark.parametrize(("value", "axis", "size"), [
    ("x", 2, 8), ("x", -1, 8), ("x", 0, None), ("x", 3, None), ("y", -2, 2), ("shape", 0, 3), ("dim0", 0, None),
])
def test_static_dim(value: str, axis: int, size: int | None) -> None:
    q, v = _vectors()
    assert q.static_dim(v[value], axis) == size
