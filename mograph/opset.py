"""The model's opset, and raising its default-domain opset in place (``lower --upgrade-opset``, the precision passes).

Why: the standard forms of the fused ops appear late in ONNX (``LayerNormalization`` 17, ``Gelu`` 20,
``RMSNormalization`` 23).  A model exported at an older opset can only use them if its opset is raised,
which the ``lower`` step does only when asked (``--upgrade-opset N`` or ``auto``).

How, and what it promises:

* the conversion is ``onnx.version_converter`` (the adapters of the ONNX project, which keep each op's
  meaning), applied **node by node**: a node whose operator schema is the same at the old and the new
  opset is left as it is (same object, same name, same provenance); a node whose schema changed is put
  alone in a one-node model, converted, and replaced only if the converter rewrote it (``ReduceMean``
  with ``axes`` as an attribute becomes ``ReduceMean`` with an ``axes`` input at 18, for example);
* the graph and every subgraph are converted; control-flow ops (``If``, ``Loop``, ``Scan``) changed
  only the types they accept between the opsets mograph meets, so they keep their form and their
  bodies are converted node by node;
* the function bodies of registered custom ops (:mod:`mograph.custom_ops`) are rebuilt for the new
  opset from their declarations; a model with other model-local functions is refused (their bodies
  would need converting too), as is a node the converter cannot take.

Refusals raise :class:`OpsetUpgradeError` before anything is changed: the model is either fully
converted or untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from mograph.ir_version import fit_ir_version, make_model
from mograph.irutil import constant_array, fresh_name

if TYPE_CHECKING:
    import onnx

    from mograph.custom_ops import CustomOp

__all__ = ["OpsetUpgrade", "OpsetUpgradeError", "upgrade_opset", "max_opset", "model_opset"]

logger = logging.getLogger(__name__)

#: Ops whose versions in the range mograph upgrades over (13 ->) only widened the accepted types.
_TYPE_ONLY = frozenset({"If", "Loop", "Scan"})
#: Constant inputs up to this many elements are handed to the converter as values, not as inputs.
_SMALL = 64


class OpsetUpgradeError(Exception):
    """The model cannot be upgraded; the message says why.  Nothing was changed."""


@dataclass
class OpsetUpgrade:
    """What :func:`upgrade_opset` did: the opsets, and the nodes it rewrote (``op_type`` -> count)."""

    from_opset: int
    to_opset: int
    rewritten: dict[str, int] = field(default_factory=dict)


def model_opset(model: ir.Model) -> int:
    """The model's default-domain (``""`` or ``"ai.onnx"``) opset; 1 when it imports none."""
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))


def max_opset() -> int:
    """The highest default-domain opset the installed ``onnx`` knows."""
    import onnx

    return int(onnx.defs.onnx_opset_version())


def _schema_version(op_type: str, opset: int) -> int:
    import onnx

    try:
        return int(onnx.defs.get_schema(op_type, opset, "").since_version)
    except onnx.defs.SchemaError as exc:
        raise OpsetUpgradeError(f"'{op_type}' is not a standard op at opset {opset}") from exc


def _value_info(name: str, value: ir.Value) -> onnx.ValueInfoProto:
    from onnx import helper

    dtype = value.dtype
    if dtype is None:
        return helper.make_value_info(name, helper.TypeProto())
    shape = None
    if value.shape is not None:
        shape = [d if isinstance(d, int) else (str(d) if d.value is not None else None)  # type: ignore[union-attr]
                 for d in value.shape]
    return helper.make_tensor_value_info(name, int(dtype), shape)


def _one_node_model(node: ir.Node, opset: int) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """``node`` alone in a ModelProto at ``opset``; returns it with its input and output names."""
    import onnx
    from onnx import helper, numpy_helper


    in_names, inputs, inits = [], [], []
    for i, v in enumerate(node.inputs):
        if v is None:
            in_names.append("")
            continue
        name = f"in{i}"
        in_names.append(name)
        arr = constant_array(v)
        if arr is not None and arr.size <= _SMALL:
            inits.append(numpy_helper.from_array(np.asarray(arr), name))
        else:
            inputs.append(_value_info(name, v))
    out_names = [f"out{i}" if o.name or o.uses() or o.is_graph_output() else ""
                 for i, o in enumerate(node.outputs)]
    proto = ir.serde.serialize_node(node)
    del proto.input[:]
    proto.input.extend(in_names)
    del proto.output[:]
    proto.output.extend(out_names)
    outputs = [helper.make_value_info(n, onnx.TypeProto()) for n in out_names if n]
    graph = helper.make_graph([proto], "one_node", inputs, outputs, inits)
    model = make_model(graph, {"": opset})
    return model, in_names, out_names


def _same_node(a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


@dataclass
class _Plan:
    node: ir.Node
    graph: ir.Graph
    converted: ir.Model
    in_names: list[str]
    out_names: list[str]


def _signature(node: ir.Node) -> tuple[object, ...]:
    """What the converter's adapters look at: op, which inputs/outputs are present, attribute values.

    Tensor and graph attributes count by presence only (the ``Constant`` value never changes an adapter).
    """
    attrs = []
    for k, a in sorted(node.attributes.items()):
        simple = a.type not in (ir.AttributeType.TENSOR, ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS,
                                ir.AttributeType.TENSORS, ir.AttributeType.SPARSE_TENSOR)
        attrs.append((k, a.type, repr(a.value) if simple else None))
    return (node.op_type, tuple(v is not None for v in node.inputs), len(node.outputs), tuple(attrs))


def _plan_node(node: ir.Node, graph: ir.Graph, old: int, new: int, unchanged: set[tuple[object, ...]]) -> _Plan | None:
    import onnx

    if _schema_version(node.op_type, old) == _schema_version(node.op_type, new):
        return None
    if node.op_type in _TYPE_ONLY:
        return None
    key = _signature(node)
    if key in unchanged:
        return None
    if any(a.is_ref() for a in node.attributes.values()):
        raise OpsetUpgradeError(f"node '{node.name}' ({node.op_type}) has reference attributes")
    proto, in_names, out_names = _one_node_model(node, old)
    try:
        converted = onnx.version_converter.convert_version(proto, new)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError/ConvertError variants
        raise OpsetUpgradeError(f"node '{node.name}' ({node.op_type}): the ONNX version converter "
                                f"refused it: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if len(converted.graph.node) == 1 and _same_node(converted.graph.node[0], proto.graph.node[0]):
        unchanged.add(key)
        return None
    return _Plan(node, graph, ir.serde.deserialize_model(converted), in_names, out_names)


def _apply(plan: _Plan, new: int, taken: set[str]) -> None:
    node, graph = plan.node, plan.graph
    small = plan.converted.graph
    by_name: dict[str, ir.Value | None] = {}
    for name, v in zip(plan.in_names, node.inputs):
        if name:
            by_name[name] = v
    new_nodes = list(small)
    small.outputs.clear()  # the values move to the model's graph
    small.remove(new_nodes)
    for n in new_nodes:
        for i, v in enumerate(n.inputs):
            if v is None:
                continue
            if v.name in by_name:
                n.replace_input_with(i, by_name[v.name])
            elif v.is_initializer():  # a constant the converter added (e.g. an axes tensor)
                small.initializers.pop(v.name)  # type: ignore[arg-type]
                v.name = fresh_name(taken, f"{node.name or node.op_type}_{v.name}")
                graph.register_initializer(v)
        n.metadata_props.update(node.metadata_props)
        n.version = None
    base = node.name or node.op_type
    for i, n in enumerate(new_nodes):
        n.name = base if len(new_nodes) == 1 else f"{base}/opset{new}_{i}"
    produced = {o.name: o for n in new_nodes for o in n.outputs if o.name}
    olds, news = [], []
    for name, old_out in zip(plan.out_names, node.outputs):
        if name:
            olds.append(old_out)
            news.append(produced.pop(name))
    for value in produced.values():  # intermediate values: names unique in the whole model
        value.name = fresh_name(taken, f"{base}/opset{new}/{value.name}")
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, olds, news)


def upgrade_opset(model: ir.Model, target: int, *, ops: Mapping[tuple[str, str], CustomOp]) -> OpsetUpgrade:
    """Raise ``model``'s default-domain opset to ``target`` in place (see the module docstring).

    ``ops`` are the declared custom ops (the registry's, handed down by the caller): their function
    bodies are rebuilt for the new opset; any other model-local function is refused.

    Raises:
        OpsetUpgradeError: ``target`` is beyond the installed ``onnx``, the model has model-local
            functions other than registered custom ops, or a node cannot be converted.  The model is
            unchanged then.
    """
    old = model_opset(model)
    result = OpsetUpgrade(old, max(old, target))
    if target <= old:
        return result
    if target > max_opset():
        raise OpsetUpgradeError(f"opset {target} is beyond the installed onnx (newest {max_opset()})")
    rebuilt = {key: ops[key[:2]] for key in model.functions if key[:2] in ops and ops[key[:2]].function is not None}
    foreign = [f"{d}::{n}" for d, n, _ in model.functions if (d, n, _) not in rebuilt]
    if foreign:
        raise OpsetUpgradeError(f"the model has model-local functions ({', '.join(sorted(foreign))}) "
                                "whose bodies would need converting too")
    plans = []
    unchanged: set[tuple[object, ...]] = set()
    for graph in list(model.graphs()):
        for node in graph:
            if node.domain in ("", "ai.onnx"):
                plan = _plan_node(node, graph, old, target, unchanged)
                if plan is not None:
                    plans.append(plan)
    taken = {v.name for g in model.graphs() for v in _values(g) if v.name}
    for plan in plans:  # all planned first: a refusal above leaves the model untouched
        _apply(plan, target, taken)
        result.rewritten[plan.node.op_type] = result.rewritten.get(plan.node.op_type, 0) + 1
    if "ai.onnx" in model.opset_imports:
        del model.opset_imports["ai.onnx"]
    model.opset_imports[""] = target
    for key, op in rebuilt.items():  # bodies are per opset
        assert op.function is not None
        model.functions[key] = op.function(target)
    _raise_ir_version(model)
    logger.info("opset %d -> %d; rewrote %s", old, target, result.rewritten or "no node")
    return result


def _values(graph: ir.Graph) -> list[ir.Value]:
    out = list(graph.inputs) + list(graph.initializers.values())
    for node in graph:
        out.extend(node.outputs)
    return out


def _raise_ir_version(model: ir.Model) -> None:
    fit_ir_version(model)  # at least what the new opset needs, at most what the runtime reads
