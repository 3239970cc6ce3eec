"""Shape rules declared by custom-op and foreign-op records, filed through the registry.

Each declared rule of the built-in plugins has a case (a one-node graph in, the dims the query concludes
out; ``test_every_declared_rule_has_a_case`` fails when an op declares a rule without one).  Then the
table itself: a plugin's custom op and foreign op reach the query through :func:`mograph.shapes.rules_for`,
a foreign op's ``same_shape_outputs`` gives a rule, a declared rule replaces a built-in one of its key,
and without a registry only the built-in rules are there.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

from mograph.custom_ops import CustomOp
from mograph.foreign_ops import MS_DOMAIN, ForeignOp
from mograph.plugins import get_registry
from mograph.shapes import Dim, ShapeQuery, ShapeRuleError, builtin_rules, declared_rules, mul, rules_for


def _dim(spec: Any) -> Dim | None:
    if spec is None:
        return None
    if isinstance(spec, int):
        return Dim.lit(spec)
    return Dim([int(p) if p.isdigit() else f"={p}" for p in spec.split("*")]).normal()


def _graph(domain: str, op: str, ins: list[Any], attrs: dict[str, Any], outputs: int = 1
           ) -> tuple[ir.Graph, ir.Node]:
    values: list[ir.Value | None] = []
    inputs: list[ir.Value] = []
    inits: list[ir.Value] = []
    for i, spec in enumerate(ins):
        if spec is None:
            values.append(None)
            continue
        if isinstance(spec, np.ndarray):
            v = ir.Value(name=f"in{i}", const_value=ir.tensor(spec), shape=ir.Shape(list(spec.shape)),
                         type=ir.TensorType(ir.DataType.from_numpy(spec.dtype)))
            inits.append(v)
        else:
            v = ir.Value(name=f"in{i}", shape=ir.Shape(spec), type=ir.TensorType(ir.DataType.FLOAT))
            inputs.append(v)
        values.append(v)
    node = ir.node(op, values, attributes=attrs, domain=domain, num_outputs=outputs)
    graph = ir.Graph(inputs, list(node.outputs), nodes=[node], initializers=inits,
                     opset_imports={"": 18, domain: 1})
    return graph, node


W = np.zeros((4, 16), np.float32)  # a constant [4, 16] (a table, a packed weight)

#: op name in the ``mograph`` domain -> [(inputs, attributes, expected dims of each output)]
CASES: dict[str, list[tuple[list[Any], dict[str, Any], list[Any]]]] = {
    "LayerNorm": [([["b", "s", 8], [8], [8]], {}, [("b", "s", 8)])],
    "RMSNorm": [([["b", "s", 8], [8]], {}, [("b", "s", 8)])],
    "SkipLayerNorm": [
        ([["b", "s", 8], ["b", "s", 8], [8], [8], [8]], {}, [("b", "s", 8), ("b", "s", 8)]),
        ([["b", "s", 8], [1, "s", 8], [8], [8], [8]], {}, [("b", "s", 8), ("b", "s", 8)]),  # Skip broadcast up
    ],
    "SkipRMSNorm": [([[1, "s", 8], ["b", "s", 8], [8], [8]], {}, [("b", "s", 8), ("b", "s", 8)])],
    "EmbedLayerNorm": [
        ([["b", "s"], ["b", "s"], [1, "s"], W, W, W, [16], [16]], {}, [("b", "s", 16)]),
        ([["b", "s"], ["b", "s"], ["s"], W, W, W, [16], [16]], {}, [None]),  # ranks differ: no rule's answer
    ],
    "Gelu": [([["b", "s", 8]], {}, [("b", "s", 8)])],
    "FastGelu": [([["b", 8]], {}, [("b", 8)])],
    "QuickGelu": [([["n"]], {}, [("n",)])],
    "BiasGelu": [([["b", "s", 8], [8]], {}, [("b", "s", 8)])],
    "BiasFastGelu": [([["b", "s", 8], [8]], {}, [("b", "s", 8)])],
    "Attention": [
        ([["b", "s", 64], ["b", "t", 64], ["b", "t", 64], None], {"num_heads": 4}, [("b", "s", 64)]),
        ([["b", "s", 64], ["b", "t", 32], ["b", "t", "d"], None], {"num_heads": 4, "kv_num_heads": 2},
         [("b", "s", "2*d")]),  # GQA: V's width times num_heads / kv_num_heads
        ([["b", "s", 64], ["b", "t", 32], ["b", "t", 32], None], {"num_heads": 4, "kv_num_heads": 3}, [("b", "s", "?")]),
    ],
    "RotaryEmbedding": [([["b", "s", 64], ["s", 16], ["s", 16]], {"num_heads": 4}, [("b", "s", 64)])],
    "WeightOnlyMatMul": [
        ([["b", "s", 16], W, W, None], {"K": 16, "N": 24}, [("b", "s", 24)]),
        ([["b", "s", 16], W, W, None], {"K": 16}, [None]),  # N unknown: no answer
    ],
}


def _expected(spec: Any, got: tuple[Dim | None, ...] | None, declared: tuple[Dim | None, ...] | None) -> None:
    if spec is None:
        assert got == declared  # the query kept what the value declared (nothing, here)
        return
    assert got is not None and len(got) == len(spec)
    for g, w in zip(got, spec):
        if w == "?":
            assert g is not None and g.symbol is not None and g.symbol.startswith("?")
        else:
            assert g == _dim(w)


@pytest.mark.parametrize("op", sorted(CASES), ids=str)
def test_declared_rule(op: str) -> None:
    registry = get_registry()
    rules = rules_for(registry)
    decl = registry.custom_ops[("mograph", op)]
    for ins, attrs, outs in CASES[op]:
        graph, node = _graph("mograph", op, ins, attrs, len(outs))
        query = ShapeQuery(graph, rules)
        for value, spec in zip(node.outputs, outs):
            _expected(spec, query.dims(value), None)
        # the rule is the declaration's, filed at (domain, name, version)
        rule = rules.lookup("mograph", op, decl.version)
        assert rule is not None and rule.dims is decl.shape_dims and rule.since_version == decl.version
        # without the registry's table the query knows nothing of the op
        assert all(ShapeQuery(graph).dims(v) is None for v in node.outputs)


def test_every_declared_rule_has_a_case() -> None:
    declared = {op.name for op in get_registry().custom_ops.values() if op.shape_dims is not None}
    assert declared - set(CASES) == set(), "declared shape rules without a case here"


def _twice(node: ir.Node, q: ShapeQuery) -> list[Any]:
    d = q.dims(node.inputs[0])
    return [None if d is None else (*d[:-1], mul(d[-1], Dim.lit(2)))]


def test_a_plugins_custom_op_and_foreign_op_reach_the_query() -> None:
    """Records a plugin declared: a custom op with a rule, a foreign op with one, a foreign op with only
    ``same_shape_outputs``; a record without any gives no rule."""
    custom = CustomOp("Twice", domain="my.ops", version=3, shape_dims=_twice)
    foreign = ForeignOp("Widen", "vendor.ops", shape_dims=_twice, since_version=2)
    same = ForeignOp("Scale", "vendor.ops", same_shape_outputs=(0, 1))
    bare = ForeignOp("Opaque", "vendor.ops")
    registry = SimpleNamespace(custom_ops={custom.key: custom},
                               foreign_ops={r.key: r for r in (foreign, same, bare)})
    rules = rules_for(registry)  # type: ignore[arg-type]
    assert len(rules) == len(builtin_rules()) + 3
    assert rules.lookup("my.ops", "Twice", 2) is None  # before the op's version: no rule
    assert rules.lookup("vendor.ops", "Opaque") is None
    b = _dim("b")
    for domain, op, want in (("my.ops", "Twice", [(b, _dim(16))]), ("vendor.ops", "Widen", [(b, _dim(16))]),
                             ("vendor.ops", "Scale", [(b, _dim(8)), (b, _dim(8))])):
        graph, node = _graph(domain, op, [["b", 8]], {}, len(want))
        graph.opset_imports[domain] = 3
        query = ShapeQuery(graph, rules)
        assert [query.dims(v) for v in node.outputs] == want


def test_a_declared_rule_replaces_the_built_in_one() -> None:
    """A plugin's record for ``com.microsoft::Gelu`` with its own rule wins over the built-in same-shape rule;
    the built-in records themselves add nothing (their rules are built in)."""
    from mograph.foreign_ops import BUILTIN_FOREIGN_OPS

    assert declared_rules(foreign_ops=BUILTIN_FOREIGN_OPS) == []
    mine = ForeignOp("Gelu", MS_DOMAIN, "GELU", shape_dims=_twice)
    rules = rules_for(SimpleNamespace(custom_ops={}, foreign_ops={mine.key: mine}))  # type: ignore[arg-type]
    assert len(rules) == len(builtin_rules())
    graph, node = _graph(MS_DOMAIN, "Gelu", [["b", 8]], {})
    assert ShapeQuery(graph, rules).dims(node.outputs[0]) == (_dim("b"), _dim(16))
    assert ShapeQuery(graph).dims(node.outputs[0]) == (_dim("b"), _dim(8))


def test_two_declared_rules_of_one_key_clash() -> None:
    a = ForeignOp("Widen", "vendor.ops", shape_dims=_twice)
    b = CustomOp("Widen", domain="vendor.ops", version=1, shape_dims=_twice)
    with pytest.raises(ShapeRuleError):
        rules_for(SimpleNamespace(custom_ops={b.key: b}, foreign_ops={a.key: a}))  # type: ignore[arg-type]


def test_without_a_registry_the_built_in_rules() -> None:
    assert {r.key for r in rules_for(None)} == {r.key for r in builtin_rules()}
