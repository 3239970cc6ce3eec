"""Every built-in shape rule, one table of cases each: a one-node graph in, the dims (or shape-vector
elements) the query concludes out.  ``test_every_rule_has_a_case`` fails when a rule is registered
without a case here.

Notation of the cases: an input is a list (a float graph input of that shape; a string is a named dim),
an array (an initializer), ``("shape", dims)`` (``Shape`` of such an input: a symbolic vector), ``("dim",
dims, axis)`` (one element of it, a scalar), ``("eq", a, b)`` (``Equal`` of two such) or ``None`` (an absent optional input).  An expected dim is
an int, a name (``"b"``), a product (``"2*b"``), ``"?"`` (unknown: a fresh atom of that value alone).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

from mograph.shapes import BROADCAST_OPS, MS_DOMAIN, REDUCE_OPS, SAME_SHAPE_OPS, Dim, ShapeQuery, builtin_rules

OPSET = 18


def _value(spec: Any, name: str, nodes: list[ir.Node], inputs: list[ir.Value], inits: list[ir.Value]) -> ir.Value | None:
    if spec is None:
        return None
    if isinstance(spec, np.ndarray):
        v = ir.Value(name=name, const_value=ir.tensor(spec))
        v.shape = ir.Shape(list(spec.shape))
        v.type = ir.TensorType(ir.DataType.from_numpy(spec.dtype))
        inits.append(v)
        return v
    if isinstance(spec, list):
        v = ir.Value(name=name, shape=ir.Shape(spec), type=ir.TensorType(ir.DataType.FLOAT))
        inputs.append(v)
        return v
    if spec[0] == "eq":
        eq = ir.node("Equal", [_value(spec[1], name + "_a", nodes, inputs, inits),
                               _value(spec[2], name + "_b", nodes, inputs, inits)])
        nodes.append(eq)
        return eq.outputs[0]
    x = _value(spec[1], name + "_x", nodes, inputs, inits)
    shape = ir.node("Shape", [x])
    nodes.append(shape)
    if spec[0] == "shape":
        return shape.outputs[0]
    idx = _value(np.array(spec[2], dtype=np.int64), name + "_i", nodes, inputs, inits)
    gather = ir.node("Gather", [shape.outputs[0], idx], attributes={"axis": 0})
    nodes.append(gather)
    return gather.outputs[0]


def _query(domain: str, op: str, ins: list[Any], attrs: dict[str, Any], opset: int, outputs: int) -> tuple[ShapeQuery, ir.Node]:
    nodes: list[ir.Node] = []
    inputs: list[ir.Value] = []
    inits: list[ir.Value] = []
    values = [_value(s, f"in{i}", nodes, inputs, inits) for i, s in enumerate(ins)]
    node = ir.node(op, values, attributes=attrs, domain=domain, num_outputs=outputs)
    nodes.append(node)
    graph = ir.Graph(inputs, list(node.outputs), nodes=nodes, initializers=inits,
                     opset_imports={"": opset, MS_DOMAIN: 1})
    return ShapeQuery(graph), node


def _dim(spec: Any) -> Dim | None:
    if isinstance(spec, int):
        return Dim.lit(spec)
    out: list[int | str] = []
    for part in str(spec).split("*"):
        out.append(int(part) if part.lstrip("-").isdigit() else f"={part}")
    return Dim(out).normal()


def _matches(got: Dim | None, spec: Any) -> bool:
    if spec == "?":
        return got is not None and got.symbol is not None and got.symbol.startswith("?")
    return got == _dim(spec)


# (domain, op, since_version): [(inputs, attributes, expected dims of each checked output, opset)]
_S = ["b", "s", 8]
DIMS: dict[tuple[str, str, int], list[tuple[list[Any], dict[str, Any], list[Any], int]]] = {
    ("", "Reshape", 5): [
        ([_S, np.array([0, 0, 2, 4])], {}, [["b", "s", 2, 4]], OPSET),
        ([_S, np.array([-1, 8])], {}, [["b*s", 8]], OPSET),
        ([_S, ("shape", ["n", 4])], {}, [["n", 4]], OPSET),
        ([_S, np.array([0, -1])], {"allowzero": 1}, [[0, "?"]], OPSET),  # 0 is a literal size with allowzero
        ([_S, np.array([-1, -1])], {}, [None], OPSET),  # two -1: no rule
    ],
    ("", "Expand", 8): [
        ([["b", 1, 8], ("shape", ["b", "s", 1])], {}, [["b", "s", 8]], OPSET),
        ([[1, 8], np.array([3, 1, 8])], {}, [[3, 1, 8]], OPSET),
    ],
    ("", "Transpose", 1): [
        ([_S], {"perm": [2, 0, 1]}, [[8, "b", "s"]], OPSET),
        ([_S], {}, [[8, "s", "b"]], OPSET),
    ],
    ("", "Unsqueeze", 13): [
        ([["b", 8], np.array([0, -1])], {}, [[1, "b", 8, 1]], OPSET),
        ([["b", 8], np.array([1])], {}, [["b", 1, 8]], OPSET),
    ],
    ("", "Squeeze", 13): [
        ([["b", 1, 8], np.array([1])], {}, [["b", 8]], OPSET),
        ([["b", 1, 8], None], {}, [None], OPSET),  # no axes: cannot tell which 1s go
    ],
    # below opset 13 the axes are an attribute (exporters at opset 11 and 12 write this form)
    ("", "Unsqueeze", 1): [
        ([["b", 8]], {"axes": [0, -1]}, [[1, "b", 8, 1]], 11),
        ([["b", 8]], {"axes": [1]}, [["b", 1, 8]], 1),
        ([["b", 8]], {}, [None], 11),  # no axes: an invalid node, no rule
    ],
    ("", "Squeeze", 1): [
        ([["b", 1, 8]], {"axes": [-2]}, [["b", 8]], 11),
        ([["b", 1, 8]], {}, [None], 11),  # no axes: cannot tell which 1s go
    ],
    ("", "Gather", 1): [
        ([_S, np.array([[0, 1]])], {"axis": 1}, [["b", 1, 2, 8]], OPSET),
        ([_S, np.array(0)], {"axis": -1}, [["b", "s"]], OPSET),
    ],
    ("", "MatMul", 1): [
        ([["b", 1, "s", 8], [4, 8, 16]], {}, [["b", 4, "s", 16]], OPSET),
        ([[8], [8, 16]], {}, [None], OPSET),  # 1-D operand: no rule
    ],
    ("", "Gemm", 1): [
        ([["b", 8], [8, 16]], {}, [["b", 16]], OPSET),
        ([[8, "b"], [16, 8]], {"transA": 1, "transB": 1}, [["b", 16]], OPSET),
    ],
    ("", "Split", 13): [
        ([_S, np.array([3, 5])], {"axis": -1}, [["b", "s", 3], ["b", "s", 5]], OPSET),
        ([_S, None], {"axis": -1}, [None, None], OPSET),  # equal split without sizes: no rule
    ],
    ("", "Split", 2): [  # the sizes an attribute from 2 to 12
        ([_S], {"axis": -1, "split": [3, 5]}, [["b", "s", 3], ["b", "s", 5]], 11),
        ([_S], {"axis": -1}, [None, None], 11),  # equal split without sizes: no rule
    ],
    ("", "Range", 11): [
        ([np.array(0), ("dim", ["b", "s"], 1), np.array(1)], {}, [["s"]], OPSET),
        ([np.array(2), np.array(11), np.array(3)], {}, [[3]], OPSET),
        ([np.array(1), ("dim", ["b", "s"], 1), np.array(1)], {}, [None], OPSET),  # s - 1: not a monomial
    ],
    ("", "Slice", 10): [
        ([_S, np.array([0, 2]), np.array([1 << 62, 6]), np.array([1, 2])], {}, [["b", "s", 4]], OPSET),
        ([_S, np.array([1]), np.array([1 << 62]), np.array([1])], {}, [["b", "?", 8]], OPSET),
        ([[10], np.array([-3]), np.array([1 << 62]), None, np.array([2])], {}, [[2]], OPSET),
        ([_S, [1], [1], np.array([1])], {}, [["b", "?", 8]], OPSET),  # bounds at run time: the rank is kept
        ([_S, [1], [1]], {}, [["?", "?", "?"]], OPSET),  # ... and without axes every dim may be cut
    ],
    ("", "ConstantOfShape", 9): [
        ([("shape", ["b", "s"])], {}, [["b", "s"]], OPSET),
        ([np.array([3, 4])], {}, [[3, 4]], OPSET),
    ],
    ("", "GatherElements", 11): [([_S, ["b", "t", 8]], {"axis": 1}, [["b", "t", 8]], OPSET)],
    ("", "Flatten", 1): [
        ([["b", "s", 2, 4]], {}, [["b", "8*s"]], OPSET),
        ([["b", "s", 8]], {"axis": -1}, [["b*s", 8]], OPSET),
        ([["b", 8]], {"axis": 0}, [[1, "8*b"]], OPSET),
    ],
    ("", "Conv", 1): [
        ([["b", 3, 32, 32], np.zeros((16, 3, 3, 3), np.float32)], {"pads": [1, 1, 1, 1], "strides": [2, 2]},
         [["b", 16, 16, 16]], OPSET),
        ([["b", 3, "h", 32], np.zeros((16, 3, 3, 3), np.float32)], {}, [["b", 16, "?", 30]], OPSET),
        ([["b", 3, 32, 32], np.zeros((16, 3, 3, 3), np.float32)], {"auto_pad": "SAME_UPPER"},
         [["b", 16, "?", "?"]], OPSET),  # implicit pads: left to inference
    ],
    ("", "AveragePool", 1): [([["b", 8, 32, 32]], {"kernel_shape": [2, 2], "strides": [2, 2]}, [["b", 8, 16, 16]],
                              OPSET),
                             ([["b", 8, 32, 32]], {"kernel_shape": [2, 2], "ceil_mode": 1}, [None], OPSET)],
    ("", "LpPool", 1): [([["b", 8, 9]], {"kernel_shape": [3], "pads": [1, 1]}, [["b", 8, 9]], OPSET)],
    ("", "MaxPool", 1): [([["b", 8, 32, 32]], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                          [["b", 8, 16, 16]], OPSET)],
    ("", "GlobalAveragePool", 1): [([["b", 8, 7, 7]], {}, [["b", 8, 1, 1]], OPSET)],
    ("", "GlobalLpPool", 1): [([["b", 8, 7]], {}, [["b", 8, 1]], OPSET)],
    ("", "GlobalMaxPool", 1): [([["b", 8, "h", "w"]], {}, [["b", 8, 1, 1]], OPSET)],
    ("", "ReduceSum", 13): [
        ([_S, np.array([-1])], {}, [["b", "s", 1]], OPSET),
        ([_S, np.array([0, 2])], {"keepdims": 0}, [["s"]], OPSET),
        ([_S, None], {"noop_with_empty_axes": 1}, [["b", "s", 8]], OPSET),
        ([_S, [1]], {}, [None], OPSET),  # axes at run time
    ],
    ("", "Concat", 1): [
        ([["b", 3], ["b", 5]], {"axis": 1}, [["b", 8]], OPSET),
        ([["b", 3], ["s", 3]], {"axis": 0}, [None], OPSET),  # b + s: no monomial
    ],
    ("", "Shape", 1): [
        ([_S], {}, [[3]], OPSET),
        ([_S], {"start": 1, "end": -1}, [[1]], OPSET),
    ],
    (MS_DOMAIN, "EmbedLayerNormalization", 1): [
        ([["b", "s"], ["b", "s"], [100, 64]], {}, [["b", "s", 64], ["b"], ["b", "s", 64]], OPSET),
    ],
    (MS_DOMAIN, "Attention", 1): [
        ([["b", "s", 64], [64, 192]], {}, [["b", "s", 64]], OPSET),
        ([["b", "s", 64], [64, 160]], {"qkv_hidden_sizes": [64, 64, 32]}, [["b", "s", 32]], OPSET),
    ],
    (MS_DOMAIN, "MultiHeadAttention", 1): [
        ([["b", "s", 64], ["b", "t", 64], ["b", "t", 32]], {}, [["b", "s", 32]], OPSET),
    ],
    (MS_DOMAIN, "GroupQueryAttention", 1): [
        ([["b", "s", 128]], {"num_heads": 4, "kv_num_heads": 2}, [["b", "s", 64]], OPSET),  # packed: 4+2*2 heads
        ([["b", "s", 64], ["b", "s", 32]], {"num_heads": 4, "kv_num_heads": 2}, [["b", "s", 64]], OPSET),
    ],
    (MS_DOMAIN, "PackedAttention", 1): [
        ([["t", 64], [64, 192]], {}, [None], OPSET),  # packed tokens (rank 2): no rule
    ],
}
for _op in sorted(REDUCE_OPS):
    DIMS[("", _op, 1)] = [([_S], {"axes": [1]}, [["b", 1, 8]], 11), ([_S], {"keepdims": 0}, [[]], 11)]
    if _op != "ReduceSum":
        DIMS[("", _op, 18)] = [([_S, np.array([-1])], {"keepdims": 0}, [["b", "s"]], OPSET),
                               ([_S, None], {}, [[1, 1, 1]], OPSET)]
for _op in sorted(SAME_SHAPE_OPS):
    DIMS[("", _op, 1)] = [([["b", "s", 8]], {}, [["b", "s", 8]], OPSET)]
for _op in sorted(BROADCAST_OPS):
    _n = 3 if _op == "Where" else 2
    DIMS[("", _op, 1)] = [([["b", 1, 8], ["s", 1]] + [[8]] * (_n - 2), {}, [["b", "s", 8]], OPSET),
                         ([["b", 8], ["c", 8]] + [[8]] * (_n - 2), {}, [["?", 8]], OPSET)]  # b vs c: unknown
_MS_SAME = {"SkipLayerNormalization": 4, "SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 1,
            "LayerNormalization": 1, "FastGelu": 1, "BiasGelu": 1, "Gelu": 1, "QuickGelu": 1, "BiasAdd": 1,
            "RotaryEmbedding": 1}
for _op, _outs in _MS_SAME.items():
    _expect: list[Any] = [["b", "s", 8]] + [None] * (_outs - 1)
    if _outs == 4:
        _expect[3] = ["b", "s", 8]  # the residual sum
    DIMS[(MS_DOMAIN, _op, 1)] = [([["b", "s", 8], ["b", "s", 8]], {}, _expect, OPSET)]
# ONNX Runtime registers SimplifiedLayerNormalization in the default domain (its record says so)
DIMS[("", "SimplifiedLayerNormalization", 1)] = [([["b", "s", 8], [8]], {}, [["b", "s", 8]], OPSET)]


# (op, since_version): [(inputs, attributes, (is_scalar, expected elements) or None, opset)]
VALUES: dict[tuple[str, int], list[tuple[list[Any], dict[str, Any], Any, int]]] = {
    ("Shape", 1): [([_S], {}, (False, ["b", "s", 8]), OPSET), ([_S], {"start": -2}, (False, ["s", 8]), OPSET)],
    ("Identity", 1): [([("shape", _S)], {}, (False, ["b", "s", 8]), OPSET)],
    ("Cast", 1): [([("shape", _S)], {"to": ir.DataType.INT64}, (False, ["b", "s", 8]), OPSET),
                  ([("shape", _S)], {"to": ir.DataType.FLOAT}, None, OPSET)],
    ("ConstantOfShape", 9): [([np.array([3])], {"value": ir.tensor(np.array([7]))}, (False, [7, 7, 7]), OPSET),
                             ([np.array([3])], {}, None, OPSET)],  # float zeros: not a shape vector
    ("Gather", 1): [([("shape", _S), np.array(1)], {"axis": 0}, (True, ["s"]), OPSET),
                    ([("shape", _S), np.array([2, 0])], {"axis": 0}, (False, [8, "b"]), OPSET),
                    ([("shape", _S), np.array([3])], {"axis": 0}, None, OPSET)],  # out of range
    ("Slice", 10): [([("shape", _S), np.array([1]), np.array([1 << 62])], {}, (False, ["s", 8]), OPSET),
                    ([("shape", _S), np.array([0]), np.array([3]), np.array([0]), np.array([2])], {},
                     (False, ["b", 8]), OPSET)],
    ("Unsqueeze", 13): [([("dim", _S, 0), np.array([0])], {}, (False, ["b"]), OPSET)],
    ("Unsqueeze", 1): [([("dim", _S, 0)], {"axes": [0]}, (False, ["b"]), 11),
                       ([("dim", _S, 0)], {"axes": [1]}, None, 11)],  # not a vector [b]
    ("Squeeze", 13): [([("shape", ["b"]), np.array([0])], {}, (True, ["b"]), OPSET)],
    ("Squeeze", 1): [([("shape", ["b"])], {"axes": [0]}, (True, ["b"]), 11)],
    ("Reshape", 5): [([("shape", _S), np.array([-1])], {}, (False, ["b", "s", 8]), OPSET),
                     ([("shape", ["b"]), np.array([], dtype=np.int64)], {}, (True, ["b"]), OPSET)],
    ("Concat", 1): [([("shape", ["b"]), np.array([-1, 4])], {"axis": 0}, (False, ["b", -1, 4]), OPSET)],
    ("Add", 1): [([("shape", _S), np.array([0, 0, 2])], {}, (False, ["b", "s", 10]), OPSET),
                 ([("dim", _S, 0), ("dim", _S, 0)], {}, (True, ["2*b"]), OPSET),
                 ([("dim", _S, 0), ("dim", _S, 1)], {}, (True, [None]), OPSET)],  # b + s: no monomial
    ("Sub", 1): [([("dim", _S, 0), np.array(0)], {}, (True, ["b"]), OPSET),
                 ([np.array(5), np.array(7)], {}, (True, [-2]), OPSET)],
    ("Mul", 1): [([("shape", _S), np.array([2])], {}, (False, ["2*b", "2*s", 16]), OPSET)],
    ("Div", 1): [([("shape", _S), np.array([2])], {}, (False, [None, None, 4]), OPSET),  # b / 2: not exact
                 ([np.array(-7), np.array(2)], {}, (True, [-3]), OPSET)],  # truncates like int64 division
    ("Equal", 1): [([("shape", _S), np.array([-1, 3, 8])], {}, (False, [0, None, 1]), OPSET)],
    ("Where", 1): [([("eq", np.array([1, 2]), np.array([1, 3])), ("shape", ["b", "s"]), np.array([0, 5])], {},
                    (False, ["b", 5]), OPSET)],
    # tf2onnx's batched MatMul: Max of the two operands' batch dims, ReduceProd of the merged ones
    ("Max", 1): [([("shape", _S), ("shape", _S)], {}, (False, ["b", "s", 8]), OPSET),
                 ([("shape", ["b", 8]), np.array([1, 8])], {}, (False, [None, 8]), OPSET)],  # b vs 1: either
    ("Min", 1): [([np.array([3, 5]), np.array([4, 2])], {}, (False, [3, 2]), OPSET)],
    ("ReduceProd", 18): [([("shape", _S)], {}, (False, ["8*b*s"]), OPSET),
                         ([("shape", _S), np.array([0])], {"keepdims": 0}, (True, ["8*b*s"]), OPSET)],
    ("ReduceProd", 1): [([("shape", _S)], {"axes": [0]}, (False, ["8*b*s"]), 13),
                        ([("shape", _S)], {"axes": [1]}, None, 13)],  # no axis 1 in a vector
}


def _ids(table: dict) -> list[str]:
    return [f"{k[0] or 'ai.onnx'}::{k[1]}@{k[2]}#{i}" if len(k) == 3 else f"{k[0]}@{k[1]}#{i}"
            for k, cases in table.items() for i in range(len(cases))]


@pytest.mark.parametrize(("key", "case"), [(k, c) for k, cs in DIMS.items() for c in cs], ids=_ids(DIMS))
def test_dims_rule(key: tuple[str, str, int], case: tuple) -> None:
    domain, op, since = key
    ins, attrs, expected, opset = case
    query, node = _query(domain, op, ins, attrs, opset, len(expected))
    rule = query.rules.lookup(domain, op, opset)
    assert rule is not None and rule.since_version == since and rule.dims is not None
    for out, want in zip(node.outputs, expected):
        got = query.dims(out)
        if want is None:  # the rule cannot tell: nothing was inferred either, so the rank is unknown
            assert got is None, f"{out.name}: {got}"
            continue
        assert got is not None and len(got) == len(want), f"{out.name}: {got} vs {want}"
        assert all(_matches(g, w) for g, w in zip(got, want)), f"{out.name}: {[str(g) for g in got]} vs {want}"


@pytest.mark.parametrize(("key", "case"), [(k, c) for k, cs in VALUES.items() for c in cs], ids=_ids(VALUES))
def test_values_rule(key: tuple[str, int], case: tuple) -> None:
    op, since = key
    ins, attrs, expected, opset = case
    query, node = _query("", op, ins, attrs, opset, 1)
    rule = query.rules.lookup("", op, opset)
    assert rule is not None and rule.since_version == since and rule.values is not None
    got = query.values(node.outputs[0])
    if expected is None:
        assert got is None
        return
    assert got is not None and got[0] == expected[0]
    assert [None if g is None else g for g in got[1]] == [None if w is None else _dim(w) for w in expected[1]]


def test_every_rule_has_a_case() -> None:
    missing = []
    for rule in builtin_rules():
        if rule.dims is not None and (rule.domain, rule.op_type, rule.since_version) not in DIMS:
            missing.append(f"dims {rule.domain}::{rule.op_type}@{rule.since_version}")
        if rule.values is not None and (rule.op_type, rule.since_version) not in VALUES:
            missing.append(f"values {rule.op_type}@{rule.since_version}")
    assert not missing, missing


def test_a_rule_starts_at_its_version() -> None:
    """Below ``Slice``-10 (starts and ends attributes) there is no rule: the query keeps inference's dims."""
    query, node = _query("", "Slice", [["b", 8]], {"starts": [0], "ends": [1], "axes": [0]}, 9, 1)
    assert query.rules.lookup("", "Slice", 9) is None
    assert query.dims(node.outputs[0]) is None


def test_the_attribute_forms_below_opset_13() -> None:
    """``Unsqueeze``/``Squeeze``/``Split`` take at opset 11 and 12 an attribute, from 13 an input: the rule in force
    at 12 starts below 13 and is the same function as at 13, which reads whichever form the node has."""
    table = builtin_rules()
    for op, since in (("Unsqueeze", 1), ("Squeeze", 1), ("Split", 2)):
        rule = table.lookup("", op, 12)
        assert rule is not None and rule.since_version == since
        assert rule.dims is table.lookup("", op, 13).dims  # type: ignore[union-attr]
