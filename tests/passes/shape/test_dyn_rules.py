"""make-dynamic's per-op rules one at a time: a small graph, one input axis made symbolic, the forward walk
(``_Analysis``) run once, and what the rule concluded — the symbolic dims of an output, a planned rewrite, a
baked size to trace back (``_NeedTag``) or a refusal (``_Refuse``).  ``test_every_rule_has_a_case`` fails
when a rule (``_dyn_rules.RULES``) is added without a case here.

Dims are written as :class:`mograph.shapes.Dim` prints them (``"b"``, ``"b*16"``, ``"1"``); ``"?"`` is a
fresh symbol (a size derived in a way the walk does not model).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import pytest
from _shape_testing import f32, i64
from mograph.passes.shape._dyn_base import _NeedTag, _Refuse
from mograph.passes.shape._dyn_rules import RULES
from mograph.passes.shape._dyn_symbolic import _Analysis
from mograph.passes.shape._shapes import infer_shapes
from onnx import TensorProto, helper

from mograph.shapes import Dim
from mograph.testing import to_ir

N = helper.make_node


def _walk(nodes: list, inputs: list, out: str, out_type: int = TensorProto.FLOAT, inits: list | None = None,
          dynamic: dict[str, dict[int, str]] | None = None, opset: int = 17) -> tuple[_Analysis, ir.Model]:
    graph_proto = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(out, out_type, None)], inits)
    proto = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 9
    model = to_ir(proto)
    infer_shapes(model)
    graph = model.graph
    sizes: dict[str, int] = {}
    witness: dict[str, tuple[ir.Value, int]] = {}
    seeds: dict[ir.Value, list[Dim]] = {}
    for name, axes in (dynamic or {"x": {0: "b"}}).items():
        v = next(i for i in graph.inputs if i.name == name)
        dims = [Dim.lit(int(d)) for d in v.shape]
        for axis, sym in axes.items():
            dims[axis] = Dim.sym(sym)
            sizes[sym] = int(v.shape[axis])
            witness.setdefault(sym, (v, axis))
        seeds[v] = dims
    an = _Analysis(graph, seeds, sizes, witness, {}, [])
    an.run()
    return an, model


def _value(model: ir.Model, name: str) -> ir.Value:
    for node in model.graph:
        for out in node.outputs:
            if out.name == name:
                return out
    raise KeyError(name)


def _shown(dims: list[Dim]) -> list[str]:
    return ["?" if d.symbol is not None and d.symbol.startswith("_d") else str(d) for d in dims]


def _f(name: str, shape: list[int], value: float = 0.0) -> Any:
    return helper.make_tensor(name, TensorProto.FLOAT, shape, [value] * int(np.prod(shape)))


X4 = [f32("x", [4, 3, 8])]  # b = 4 in the export
NEED, REFUSE, ACTION, ELEMS = "need", "refuse", "action", "elems"
# rule (the r_* method, without r_) -> cases (nodes, inputs, initializers, output, expected[, dynamic axes]);
# expected: the output's dims | (REFUSE, text) | (NEED, the value whose static dim bakes the size in) |
# (ACTION, planned rewrite, the output's dims) | (ELEMS, the int tensor's symbolic contents)
CASES: dict[str, list[tuple]] = {
    "unary": [([N("Relu", ["x"], ["y"])], X4, [], "y", ["b", "3", "8"])],
    "broadcast": [
        ([N("Add", ["x", "c"], ["y"])], X4, [_f("c", [3, 1])], "y", ["b", "3", "8"]),
        ([N("Add", ["x", "c"], ["y"])], X4, [_f("c", [4, 1, 1])], "y", (NEED, "c")),  # 4 = b's export size
        ([N("Add", ["x", "c"], ["y"])], X4, [_f("c", [2, 1, 1])], "y", (REFUSE, "broadcasts against the static")),
    ],
    "matmul": [([N("MatMul", ["x", "w"], ["y"])], X4, [_f("w", [8, 5])], "y", ["b", "3", "5"])],
    "gemm": [([N("Flatten", ["x"], ["f"]), N("Gemm", ["f", "w"], ["y"])], X4, [_f("w", [24, 5])], "y", ["b", "5"])],
    "transpose": [([N("Transpose", ["x"], ["y"], perm=[2, 0, 1])], X4, [], "y", ["8", "b", "3"])],
    "unsqueeze": [([N("Unsqueeze", ["x", "a"], ["y"])], X4, [i64("a", [1])], "y", ["b", "1", "3", "8"])],
    "squeeze": [
        ([N("Squeeze", ["x", "a"], ["y"])], [f32("x", [4, 1, 8])], [i64("a", [1])], "y", ["b", "8"]),
        ([N("Squeeze", ["x", "a"], ["y"])], [f32("x", [1, 3, 8])], [i64("a", [0])], "y",
         (REFUSE, "squeezes the dynamic axis")),
    ],
    "flatten": [([N("Flatten", ["x"], ["y"], axis=1)], X4, [], "y", ["b", "24"])],
    "concat": [
        ([N("Concat", ["x", "x"], ["y"], axis=0)], X4, [], "y", ["2*b", "3", "8"]),
        ([N("Concat", ["x", "x"], ["y"], axis=2)], X4, [], "y", ["b", "3", "16"]),
    ],
    "split": [
        ([N("Split", ["x", "s"], ["y", "z"], axis=2)], X4, [i64("s", [3, 5])], "z", ["b", "3", "5"]),
        ([N("Split", ["x", "s"], ["y", "z"], axis=0)], X4, [i64("s", [1, 3])], "z", (REFUSE, "splits the dynamic axis")),
    ],
    "shape": [([N("Shape", ["x"], ["s"], start=1)], X4, [], ("s", TensorProto.INT64), (ELEMS, ["3", "8"]))],
    "size": [([N("Size", ["x"], ["n"])], X4, [], ("n", TensorProto.INT64), (ELEMS, [None]))],
    "gather": [
        ([N("Gather", ["x", "i"], ["y"], axis=1)], X4, [i64("i", [0, 2])], "y", ["b", "2", "8"]),
        ([N("Gather", ["x", "i"], ["y"], axis=0)], X4, [i64("i", 3)], "y", (REFUSE, "gathers index 3")),
        ([N("Gather", ["x", "i"], ["y"], axis=0)], X4, [i64("i", [[0, 1, 2, 3]])], "y",
         (ACTION, "Gather", ["1", "b", "3", "8"])),  # every index once, in order: a reshape of the axis
    ],
    "reshape": [
        ([N("Reshape", ["x", "t"], ["y"])], X4, [i64("t", [4, 24])], "y", (ACTION, "Reshape", ["b", "24"])),
        ([N("Reshape", ["x", "t"], ["y"])], X4, [i64("t", [0, -1])], "y", ["b", "24"]),  # already follows b
        ([N("Reshape", ["x", "t"], ["y"])], X4, [i64("t", [2, 48])], "y", (REFUSE, "cannot be matched")),
        ([N("Shape", ["x"], ["s"]), N("Reshape", ["x", "s"], ["y"])], X4, [], "y", ["b", "3", "8"]),
    ],
    "expand": [
        ([N("Expand", ["x", "t"], ["y"])], [f32("x", [4, 1, 8])], [i64("t", [4, 3, 8])], "y",
         (ACTION, "Expand", ["b", "3", "8"])),
        ([N("Expand", ["x", "t"], ["y"])], [f32("x", [4, 1, 8])], [i64("t", [1, 3, 1])], "y", ["b", "3", "8"]),
    ],
    "resize": [([N("Resize", ["x", "", "sc"], ["y"], mode="nearest")], [f32("x", [4, 3, 8, 8])],
                [helper.make_tensor("sc", TensorProto.FLOAT, [4], [1.0, 1.0, 2.0, 2.0])], "y",
                ["b", "3", "16", "16"])],
    "constantofshape": [([N("Shape", ["x"], ["s"]), N("ConstantOfShape", ["s"], ["y"])], X4, [], "y",
                         ["b", "3", "8"])],
    "tile": [([N("Tile", ["x", "r"], ["y"])], X4, [i64("r", [2, 1, 1])], "y", ["b*2", "3", "8"])],
    "range": [([N("Shape", ["x"], ["s"]), N("Gather", ["s", "z"], ["n"], axis=0), N("Range", ["z", "n", "one"], ["y"])],
               X4, [i64("z", 0), i64("one", 1)], ("y", TensorProto.INT64), ["b"])],
    "slice": [
        ([N("Slice", ["x", "st", "en", "ax"], ["y"])], X4, [i64("st", [0]), i64("en", [4]), i64("ax", [0])], "y",
         (ACTION, "Slice", ["b", "3", "8"])),  # the whole axis: the end becomes INT64_MAX
        ([N("Slice", ["x", "st", "en", "ax"], ["y"])], X4, [i64("st", [0]), i64("en", [2]), i64("ax", [0])], "y",
         (REFUSE, "cannot be told apart")),
    ],
    "reduce": [
        ([N("ReduceSum", ["x", "a"], ["y"], keepdims=0)], X4, [i64("a", [2])], "y", ["b", "3"]),
        ([N("ArgMax", ["x"], ["y"], axis=1, keepdims=1)], X4, [], ("y", TensorProto.INT64), ["b", "1", "8"]),
    ],
    "pool": [
        ([N("MaxPool", ["x"], ["y"], kernel_shape=[2])], X4, [], "y", ["b", "3", "7"]),
        ([N("MaxPool", ["x"], ["y"], kernel_shape=[2])], X4, [], "y", (REFUSE, "channel axis is dynamic"),
         {"x": {1: "c"}}),
    ],
    "global_pool": [([N("GlobalAveragePool", ["x"], ["y"])], X4, [], "y", ["b", "3", "1"])],
    "pad": [([N("Pad", ["x", "p"], ["y"])], X4, [i64("p", [0, 0, 1, 0, 0, 1])], "y", ["b", "3", "10"])],
    "topk": [([N("TopK", ["x", "k"], ["y", "i"], axis=-1)], X4, [i64("k", [2])], "y", ["b", "3", "2"])],
    "gathernd": [([N("GatherND", ["x", "i"], ["y"])], X4, [i64("i", [[0, 1]])], "y", (REFUSE, "fixed positions"))],
    "gatherelements": [([N("GatherElements", ["x", "i"], ["y"], axis=2)],
                        [f32("x", [4, 3, 8]), helper.make_tensor_value_info("i", TensorProto.INT64, [4, 3, 2])], [],
                        "y", ["b", "3", "2"], {"x": {0: "b"}, "i": {0: "b"}})],
    "scatterelements": [([N("ScatterElements", ["x", "i", "u"], ["y"], axis=2)], X4,
                         [i64("i", np.zeros((4, 3, 1), np.int64)), _f("u", [4, 3, 1])], "y", ["b", "3", "8"])],
    "scatternd": [([N("ScatterND", ["x", "i", "u"], ["y"])], X4, [i64("i", [[0]]), _f("u", [1, 3, 8])], "y",
                   ["b", "3", "8"])],
}


def _rules() -> list[str]:
    return sorted(RULES)


def test_every_rule_has_a_case() -> None:
    assert sorted(CASES) == _rules()


@pytest.mark.parametrize(("rule", "case"), [(r, c) for r, cs in CASES.items() for c in cs],
                         ids=[f"{r}#{i}" for r, cs in CASES.items() for i in range(len(cs))])
def test_rule(rule: str, case: tuple) -> None:
    nodes, inputs, inits, out, expected = case[:5]
    dynamic = case[5] if len(case) > 5 else None
    name, dtype = out if isinstance(out, tuple) else (out, TensorProto.FLOAT)
    if isinstance(expected, tuple) and expected[0] in (REFUSE, NEED):
        error = _Refuse if expected[0] == REFUSE else _NeedTag
        with pytest.raises(error, match=expected[1] if error is _Refuse else None) as info:
            _walk(nodes, inputs, name, dtype, inits, dynamic)
        if error is _NeedTag:
            assert info.value.value.name == expected[1]
        return
    an, model = _walk(nodes, inputs, name, dtype, inits, dynamic)
    value = _value(model, name)
    if isinstance(expected, tuple) and expected[0] == ELEMS:
        assert [None if e is None else str(e) for e in an.elems[value]] == expected[1]
        return
    if isinstance(expected, tuple):
        kind, expected = expected[1], expected[2]
        assert [a.kind for a in an.actions] == [kind]
    else:
        assert an.actions == []
    assert _shown(an.tags[value]) == expected


@pytest.mark.parametrize("rule", ["transpose", "shape", "gatherelements"])
def test_rules_that_repeat_the_core_ask_it(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Transpose``, ``Shape`` and ``GatherElements`` are the core's registered rules (:mod:`mograph.shapes`), asked
    from the walk's state: with an empty core table the walk refuses them instead of concluding on its own."""
    from mograph.passes.shape import _dyn_rules

    from mograph.shapes import ShapeRules

    nodes, inputs, inits, out, _ = CASES[rule][0][:5]
    dynamic = CASES[rule][0][5] if len(CASES[rule][0]) > 5 else None
    name, dtype = out if isinstance(out, tuple) else (out, TensorProto.FLOAT)
    _walk(nodes, inputs, name, dtype, inits, dynamic)  # the table as it is: concludes (test_rule checks what)
    monkeypatch.setattr(_dyn_rules, "_CORE", ShapeRules())
    with pytest.raises(_Refuse, match="cannot tell"):
        _walk(nodes, inputs, name, dtype, inits, dynamic)
