"""The one lowering step: canonical custom ops -> what a target runs natively.

Fusion passes write only canonical custom ops (``mograph.LayerNorm``, ``mograph.Attention``, a
plugin's own ops), each with an ONNX function body.  Lowering happens at the end of the
pipeline (the ``lower`` pass, which ``--target`` adds to a pipeline, followed by the ``after-lower``
preset of shape clean-ups) or as a backend's first act,
and asks the custom-op registry how: for every node of a registered op it calls the op's declared
lowering for the target (:attr:`mograph.custom_ops.CustomOp.lowerings`).

Targets are declared data (:class:`mograph.targets.Target`, registered through ``mograph_add_targets``);
the built-in ones, registered by this plugin:

``mograph``
    keep the custom ops; each carries its function body (runs on any ONNX runtime).
``onnx`` (default)
    standard ONNX only: the op's ``onnx`` lowering where the model's opset has a standard form
    (``LayerNormalization`` 17, ``Gelu`` 20, ``RMSNormalization`` 23, ``Attention`` 23), else its
    function body **inlined**, so the result has no custom domain.  ``--upgrade-opset N|auto`` first
    raises the opset when a standard form needs it (:mod:`mograph.opset`).
``ort``, ``tensorrt``, and any target a plugin declares or its lowerings name
    the op's lowering for that target; where it has none or it declines (a dynamic hidden size, a
    shape the kernel does not take), the op stays, with its function body.

Passes never import backends and backends never import passes: both reach the lowerings through
the registry, which the composition root hands down (``registry=``; the ``lower`` pass gets it from
:meth:`mograph.plugins.Registry.instantiate`); nothing here looks the registry up.  The helpers below (:func:`replace_node`, :func:`as_vector`, :func:`plugin_node`,
:func:`inline_node`) are for lowering authors, built-in or third-party.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx_ir as ir

from mograph._traverse import iter_nodes
from mograph.backend_protocol import backend_target
from mograph.custom_ops import CustomOp, TensorRTPlugin
from mograph.errors import OptionError, PassFailedError, PluginError
from mograph.foreign_ops import BUILTIN_FOREIGN_OPS, ForeignOp
from mograph.hookspecs import hookimpl
from mograph.irutil import add_initializer, infer_types, is_zero, restore_types, static_last_dim
from mograph.metadata import LOWERED_FOR
from mograph.opset import OpsetUpgradeError, model_opset, upgrade_opset
from mograph.pass_infra import Option, Pass, PassResult
from mograph.patterns import attr_constant, constant_array, remove_dead_producers
from mograph.shapes import DimKey, Dims, ShapeQuery, ShapeReads, ShapeRules, Vector, rules_for
from mograph.targets import BUILTIN_TARGETS, DEFAULT_TARGET, LOWER_PASS, Target

if TYPE_CHECKING:
    from mograph.custom_ops import Declarations

__all__ = [
    "BUILTIN_TARGETS",
    "DEFAULT_TARGET",
    "LOWER_PASS",
    "LoweringContext",
    "LowerPass",
    "as_vector",
    "ensure_functions",
    "drop_unused_functions",
    "inline_node",
    "is_plugin_node",
    "has_custom_ops",
    "known_targets",
    "lower_model",
    "lowered_for",
    "plugin_node",
    "plugin_nodes_as_ops",
    "plugin_vectors",
    "replace_node",
]

logger = logging.getLogger(__name__)



def _declared(registry: Declarations) -> dict[str, Target]:
    """The registry's targets, the built-in ones always among them (a registry made by hand may lack them)."""
    return {**{t.name: t for t in BUILTIN_TARGETS}, **registry.targets}


def known_targets(registry: Declarations) -> list[str]:
    """Every target name: the declared ones, those the registered ops' lowerings name, and backends' targets."""
    names = list(_declared(registry))
    for op in registry.custom_ops.values():
        names += [t for t in op.lowerings if t not in names]
    for backend in registry.backends.values():
        target = backend_target(backend)
        if isinstance(target, str) and target and target not in names:
            names.append(target)
    return names


def _target(registry: Declarations, name: str) -> Target:
    """The record of target ``name``; :class:`OptionError` listing the known ones for an unknown name."""
    declared = _declared(registry)
    if name in declared:
        return declared[name]
    targets = known_targets(registry)
    if name not in targets:
        raise OptionError(f"{LOWER_PASS}: unknown target {name!r} (known: {', '.join(targets)})")
    return Target(name)


def is_plugin_node(node: ir.Node) -> bool:
    """A node already in a TensorRT plugin's form (it carries ``plugin_namespace``)."""
    return "plugin_namespace" in node.attributes


@dataclass
class LoweringContext(ShapeReads):
    """What one lowering run gives each lowering function.

    Attributes:
        model: the model being lowered (rewritten in place).
        target: the target name.
        op: the declaration of the op whose node is being lowered.
        shared: values a lowering builds once per run for several nodes (key -> value); keys are
            tuples whose first item names the kind (``("mask_index", ...)``): each kind is counted in
            the stats.
        stats: extra counts a lowering wants reported.
        shape_rules: the shape-rule table of the run's registry (:func:`mograph.shapes.rules_for`), which
            :meth:`dims` asks; ``None``: the built-in rules.
    """

    model: ir.Model
    target: str
    op: CustomOp | None = None
    shared: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    shape_rules: ShapeRules | None = None
    _query: ShapeQuery | None = field(default=None, repr=False)

    @property
    def shapes(self) -> ShapeQuery:
        """The core's shape query over the main graph (:class:`mograph.shapes.ShapeQuery`), swept on first ask."""
        if self._query is None:
            self._query = ShapeQuery(self.model.graph, self.shape_rules)
        return self._query

    def dims(self, value: ir.Value | None) -> Dims | None:
        """The symbolic dims of ``value`` (:meth:`ShapeQuery.dims`); a value written since the sweep (by an earlier
        lowering of this run) has the new nodes visited (:meth:`ShapeQuery.refresh`).  ``None``: rank unknown (a value outside the main
        graph: the dims ONNX inference left on it, read the query's way)."""
        if value is None:
            return None
        if not self.shapes.knows(value) and value.graph is self.model.graph:
            self.shapes.refresh()
        return self.shapes.dims(value) if self.shapes.knows(value) else self.shapes.declared(value)

    def dim_key(self, value: ir.Value, axis: int, *, spelled: bool = False) -> DimKey:
        """A key of dim ``axis`` of ``value``, equal for dims known to be equal (:meth:`ShapeQuery.dim_key`),
        refreshed as :meth:`dims` is; a value outside the main graph keys by the shape written on it."""
        if not self.shapes.knows(value) and value.graph is self.model.graph:
            self.shapes.refresh()
        return self.shapes.dim_key(value, axis, spelled=spelled or not self.shapes.knows(value))

    def values(self, value: ir.Value | None) -> Vector | None:
        """The elements of a small int64 shape vector (:meth:`ShapeQuery.values`), refreshed as :meth:`dims` is."""
        if value is None:
            return None
        if not self.shapes.knows(value) and value.graph is self.model.graph:
            self.shapes.refresh()
        return self.shapes.values(value)


    @property
    def opset(self) -> int:
        """The model's default-domain opset."""
        return model_opset(self.model)

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def inline(self, node: ir.Node) -> bool:
        """Replace ``node`` by its op's function body (a lowering for targets that take the decomposition)."""
        if self.op is None or self.op.function is None:
            return False
        inline_node(node, self.op.function(self.opset), self.target)
        return True


# ---------------------------------------------------------------------------------------------
# helpers for lowering authors
# ---------------------------------------------------------------------------------------------


def replace_node(node: ir.Node, new_nodes: Sequence[ir.Node], new_outputs: Sequence[ir.Value | None],
                 target: str | None = None) -> None:
    """Put ``new_nodes`` where ``node`` is; its outputs become ``new_outputs`` (``None``: an output nothing reads).

    The new nodes inherit the old node's metadata (provenance) and name (``name`` or ``name/i``); opset
    imports are added for new domains; producers left dead are removed.
    """
    graph = node.graph
    assert graph is not None
    model_opsets = graph.opset_imports
    olds, news = [], []
    for old, new in zip(node.outputs, new_outputs):
        if new is not None:
            olds.append(old)
            news.append(new)
    base = node.name or node.op_type
    for i, n in enumerate(new_nodes):
        if n.domain not in ("", "ai.onnx") and n.domain not in model_opsets:
            model_opsets[n.domain] = 1
        n.metadata_props.update(node.metadata_props)
        if target is not None:
            n.metadata_props[LOWERED_FOR] = target
        n.name = base if len(new_nodes) == 1 else f"{base}/{i}"
    inputs = list(node.inputs)
    ir.convenience.replace_nodes_and_values(graph, node, [node], list(new_nodes), olds, news)
    remove_dead_producers(graph, inputs)


def as_vector(graph: ir.Graph, value: ir.Value, x: ir.Value, base: str) -> ir.Value | None:
    """``value`` as a 1-D ``[hidden]`` tensor of x's dtype (hidden = x's last axis), built if it is a constant.

    A one-element constant is widened; a constant of ``hidden`` elements in another rank or dtype is
    reshaped/cast into a new initializer.  None when it cannot be done (a dynamic hidden size where a
    vector must be built, a non-constant of the wrong form).
    """
    hidden = static_last_dim(x)
    arr = constant_array(value)
    if arr is None:
        if value.shape is not None and len(value.shape) == 1 and value.dtype == x.dtype:
            return value
        return None
    if hidden is None:
        if arr.ndim == 1 and arr.size > 1 and value.const_value is not None:
            return value
        return None
    dtype = x.dtype.numpy() if x.dtype is not None else arr.dtype
    if arr.size == 1:
        arr = np.full((hidden,), arr.reshape(()), dtype=dtype)
    elif arr.size == hidden:
        if arr.ndim == 1 and arr.dtype == dtype and value.const_value is not None and value.is_initializer():
            return value
        arr = arr.reshape(hidden).astype(dtype)
    else:
        return None
    return add_initializer(graph, f"{base}_{hidden}", arr)


def plugin_node(spec: TensorRTPlugin, inputs: Sequence[ir.Value], *, domain: str, **fields: Any) -> ir.Node:
    """A node of TensorRT plugin ``spec``: its fields checked against the plugin's table, outputs counted from them.

    ``inputs`` must already be legal (vectors ``[hidden]``, optional ones only left off the end).
    """
    attrs = spec.node_attributes(**fields)
    return ir.node(spec.name, list(inputs), attributes=attrs, domain=domain, num_outputs=spec.num_outputs(attrs))


def plugin_vectors(node: ir.Node, x: ir.Value, values: Sequence[tuple[ir.Value | None, str, bool]]) -> list[ir.Value] | None:
    """Legal vector inputs of a plugin node: each ``(value, base name, optional)`` in order.

    A vector must be ``[hidden]`` (a one-element constant is widened); an optional one that is zero is
    left off when nothing after it is kept, else it becomes zeros ``[hidden]`` (TensorRT's parser
    refuses empty input names).  None if one cannot be built (unknown hidden size).
    """
    graph = node.graph
    assert graph is not None
    keep = [not (optional and is_zero(v)) for v, _, optional in values]
    while keep and not keep[-1]:
        keep.pop()
    out: list[ir.Value] = []
    hidden = static_last_dim(x)
    for (value, base, _), _keep in zip(values, keep):
        if value is None:
            if hidden is None:
                return None
            dtype = x.dtype.numpy() if x.dtype is not None else np.float32
            out.append(add_initializer(graph, f"{base}_{hidden}", np.zeros((hidden,), dtype=dtype)))
            continue
        vec = as_vector(graph, value, x, base)
        if vec is None or (hidden is None and (vec.shape is None or len(vec.shape) != 1)):
            return None
        out.append(vec)
    return out


#: Ops whose output has the dtype of their first input (for the dtype bookkeeping of inlined bodies).
_SAME_DTYPE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Neg", "Sqrt", "Reciprocal", "Erf", "Tanh", "Sigmoid",
                         "Relu", "Max", "Min", "ReduceMean", "ReduceSum", "Softmax", "MatMul", "Transpose",
                         "Reshape", "Identity"})
_FOLD = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}


def inline_node(node: ir.Node, function: ir.Function, target: str | None = None) -> list[ir.Node]:
    """Replace a call ``node`` by a copy of ``function``'s body; return the nodes put in its place.

    Attribute references of the body take the call's attributes, else the function's defaults.  What
    the concrete call makes trivial is simplified while copying, so the inlined form costs no more
    than a hand-written one: a ``Cast``/``CastLike`` to the dtype its input already has is dropped, a
    ``CastLike`` of a constant becomes a constant of the target dtype, and ``Add``/``Sub``/``Mul``/``Div``,
    ``Concat`` and ``Reshape`` of constants are folded.
    """
    mapping: dict[ir.Value, ir.Value | None] = {}
    for i, formal in enumerate(function.inputs):
        mapping[formal] = node.inputs[i] if i < len(node.inputs) else None
    defaults = function.attributes
    new_nodes: list[ir.Node] = []
    consts: dict[ir.Value, np.ndarray] = {}  # constant values among the copied nodes' outputs
    dtypes: dict[ir.Value, ir.DataType] = {}

    def dtype_of(value: ir.Value | None) -> ir.DataType | None:
        if value is None:
            return None
        return dtypes.get(value) or value.dtype

    def constant(arr: np.ndarray) -> ir.Value:
        c = ir.node("Constant", [], attributes={"value": ir.tensor(arr)})
        new_nodes.append(c)
        consts[c.outputs[0]] = arr
        dtypes[c.outputs[0]] = ir.DataType.from_numpy(arr.dtype)
        return c.outputs[0]

    for inner in function:
        attrs: list[ir.Attr] = []
        for attr in inner.attributes.values():
            if attr.is_ref():
                ref = attr.ref_attr_name
                assert ref is not None
                src = node.attributes.get(ref) or defaults.get(ref)
                if src is None:
                    continue
                attrs.append(ir.Attr(attr.name, src.type, src.value))
            else:
                attrs.append(ir.Attr(attr.name, attr.type, attr.value))
        inputs = [mapping.get(v) if v is not None else None for v in inner.inputs]
        op = inner.op_type if inner.domain in ("", "ai.onnx") else None
        if op in ("Cast", "CastLike") and inputs and inputs[0] is not None:
            want = (ir.DataType(next(int(a.value) for a in attrs if a.name == "to")) if op == "Cast"
                    else dtype_of(inputs[1]) if len(inputs) > 1 else None)
            if want is not None and dtype_of(inputs[0]) == want:
                mapping[inner.outputs[0]] = inputs[0]  # a cast to the dtype it has
                continue
            if want is not None and inputs[0] in consts:
                mapping[inner.outputs[0]] = constant(consts[inputs[0]].astype(want.numpy()))
                continue
        if op in _FOLD and len(inputs) == 2 and all(v in consts for v in inputs):
            a, b = consts[inputs[0]], consts[inputs[1]]  # type: ignore[index]
            mapping[inner.outputs[0]] = constant(np.asarray(_FOLD[op](a, b)).astype(a.dtype))
            continue
        if op == "Concat" and inputs and all(v in consts for v in inputs):
            axis = next((int(a.value) for a in attrs if a.name == "axis"), 0)
            parts = [consts[v] for v in inputs]  # type: ignore[index]
            mapping[inner.outputs[0]] = constant(np.concatenate(parts, axis=axis))
            continue
        if op == "Reshape" and len(inputs) == 2 and all(v in consts for v in inputs):
            data, shape = consts[inputs[0]], consts[inputs[1]]  # type: ignore[index]
            dims = [data.shape[i] if d == 0 and i < data.ndim else int(d) for i, d in enumerate(shape.tolist())]
            mapping[inner.outputs[0]] = constant(data.reshape(dims))
            continue
        new = ir.Node(inner.domain, inner.op_type, inputs, attributes=attrs, num_outputs=len(inner.outputs))
        for old_out, new_out in zip(inner.outputs, new.outputs):
            mapping[old_out] = new_out
        new_nodes.append(new)
        if op == "Constant":
            arr = attr_constant(new)
            if arr is not None:
                consts[new.outputs[0]] = arr
                dtypes[new.outputs[0]] = ir.DataType.from_numpy(arr.dtype)
        elif op == "Cast":
            dtypes[new.outputs[0]] = ir.DataType(next(int(a.value) for a in attrs if a.name == "to"))
        elif op == "CastLike" and dtype_of(inputs[1]) is not None:
            dtypes[new.outputs[0]] = dtype_of(inputs[1])  # type: ignore[assignment]
        elif op in _SAME_DTYPE and dtype_of(inputs[0]) is not None:
            dtypes[new.outputs[0]] = dtype_of(inputs[0])  # type: ignore[assignment]
    outputs: list[ir.Value | None] = []
    for formal, actual in zip(function.outputs, node.outputs):
        value = mapping.get(formal)
        if value is None or value.producer() not in new_nodes:  # an input passed straight through
            ident = ir.node("Identity", [value])
            new_nodes.append(ident)
            value = ident.outputs[0]
        outputs.append(value if (actual.uses() or actual.is_graph_output()) else None)
    used = {v for n in new_nodes for v in n.inputs if v is not None} | {v for v in outputs if v is not None}
    new_nodes = [n for n in new_nodes if n.op_type != "Constant" or n.outputs[0] in used]  # folded away
    replace_node(node, new_nodes, outputs, target)
    return new_nodes


def ensure_functions(model: ir.Model, ops: Mapping[tuple[str, str], CustomOp]) -> bool:
    """Give every node of a declared op in the model its function body and domain import; True if one was added."""
    used: dict[tuple[str, str], CustomOp] = {}
    for node in iter_nodes(model.graph):
        op = ops.get((node.domain, node.op_type))
        if op is not None and not is_plugin_node(node):
            used[op.key] = op
    changed = False
    opset = model_opset(model)
    for (domain, name), op in sorted(used.items()):
        if domain not in model.opset_imports:
            model.opset_imports[domain] = op.version
            changed = True
        if op.function is not None and (domain, name, "") not in model.functions:
            model.functions[(domain, name, "")] = op.function(opset)
            changed = True
    return changed


def plugin_nodes_as_ops(model: ir.Model, ops: Mapping[tuple[str, str], CustomOp]) -> tuple[int, list[str]]:
    """Turn each mograph TensorRT plugin node of ``model`` (in place; give it a copy) back into its
    canonical op, with the op's function body, so ONNX Runtime can run it and check its numbers.

    The op is the one declaring the node's plugin (``tensorrt_plugin``) whose ``tensorrt_fields``
    match the node's fields (``Gelu``/``FastGelu`` share the ``Gelu`` plugin, told apart by
    ``approximate``); fields that are op attributes (``epsilon``) carry over.  Optional inputs the
    plugin node left off become zeros ``[hidden]`` (a zero scalar where the hidden size is unknown).
    Returns the number of nodes turned back and a description of each plugin node that was not.
    """
    by_plugin: dict[tuple[str, str], list[CustomOp]] = {}
    for op in ops.values():
        if op.tensorrt_plugin is not None:
            by_plugin.setdefault((op.domain, op.tensorrt_plugin.name), []).append(op)
    done, left = 0, []
    for node in list(iter_nodes(model.graph)):
        if not is_plugin_node(node):
            continue
        cands = by_plugin.get((node.domain, node.op_type), [])
        spec = cands[0].tensorrt_plugin if cands else None
        if spec is None:
            left.append(f"{node.name or node.op_type} ({node.domain}.{node.op_type}: no op declares this plugin)")
            continue
        try:
            fields = spec.check_fields({k: a.value for k, a in node.attributes.items()})
        except PluginError as exc:
            left.append(f"{node.name or node.op_type} ({exc})")
            continue
        match = [op for op in cands if all(fields.get(k) == v for k, v in op.tensorrt_fields.items())]
        if len(match) != 1:
            left.append(f"{node.name or node.op_type} ({len(match)} ops match its fields)")
            continue
        op = match[0]
        given = dict(zip((n.rstrip("?") for n in spec.inputs), node.inputs))
        x = node.inputs[0]
        graph = node.graph
        assert graph is not None and x is not None
        inputs: list[ir.Value | None] = []
        for formal in op.inputs:
            value = given.get(formal.rstrip("?"))
            if value is None and not formal.endswith("?"):
                hidden = static_last_dim(x)
                dtype = x.dtype.numpy() if x.dtype is not None else np.float32
                zeros = np.zeros((hidden,) if hidden is not None else (), dtype=dtype)
                value = add_initializer(graph, f"mograph_zeros_{hidden or 'scalar'}_{np.dtype(dtype).name}", zeros)
            inputs.append(value)
        while inputs and inputs[-1] is None:
            inputs.pop()
        attrs = {k: v for k, v in fields.items() if k in op.attributes}
        # the op's every output (its function body has them all); those the plugin node had take its place
        new = ir.node(op.name, inputs, attributes=attrs, domain=op.domain, num_outputs=max(len(op.outputs), len(node.outputs)))
        replace_node(node, [new], list(new.outputs[: len(node.outputs)]))
        new.metadata_props.pop(LOWERED_FOR, None)
        done += 1
    if done:
        ensure_functions(model, ops)
    return done, left


def drop_unused_functions(model: ir.Model, ops: Mapping[tuple[str, str], CustomOp]) -> bool:
    """Remove function bodies of declared ops no node calls, and domain imports nothing uses; True if any."""
    nodes = list(iter_nodes(model.graph))
    used = {(n.domain, n.op_type) for n in nodes if not is_plugin_node(n)}  # a plugin node calls no function
    used_domains = {n.domain for n in nodes}
    changed = False
    for key in list(model.functions):
        if key[:2] in ops and key[:2] not in used:
            del model.functions[key]
            changed = True
    declared_domains = {d for d, _ in ops}
    for domain in list(model.opset_imports):
        if domain in declared_domains and domain not in used_domains and domain not in ("", "ai.onnx"):
            del model.opset_imports[domain]
            changed = True
    return changed


# ---------------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------------


def _upgrade_for(model: ir.Model, nodes: list[tuple[ir.Node, CustomOp]], upgrade: int | str,
                 stats: dict[str, int | float], details: dict[str, Any],
                 declared: Mapping[tuple[str, str], CustomOp]) -> None:
    """Raise the opset when an op to lower needs it for its standard form; record what happened."""
    current = model_opset(model)
    needs = {op.name: op.onnx_opset for _, op in nodes if op.onnx_opset is not None and op.onnx_opset > current}
    if not needs:
        details["opset_upgrade"] = {"done": False, "reason": f"not needed at opset {current}"}
        return
    want = max(v for v in needs.values() if v is not None)
    to = want if upgrade == "auto" else int(upgrade)
    ops = ", ".join(f"{k} ({v})" for k, v in sorted(needs.items()))
    if to < want:
        details["opset_upgrade"] = {"done": False,
                                    "reason": f"--upgrade-opset {to} is below the opset the standard form of {ops} needs"}
        return
    try:
        done = upgrade_opset(model, to, ops=declared)
    except OpsetUpgradeError as exc:
        logger.warning("opset not raised to %d: %s", to, exc)
        details["opset_upgrade"] = {"done": False, "reason": f"cannot raise opset {current} to {to}: {exc}"}
        return
    stats["opset_upgrade.from"] = done.from_opset
    stats["opset_upgrade.to"] = done.to_opset
    stats["opset_upgrade.rewritten"] = sum(done.rewritten.values())
    details["opset_upgrade"] = {"done": True, "from": done.from_opset, "to": done.to_opset, "for": ops,
                                "rewritten": dict(done.rewritten)}


def lower_model(model: ir.Model, target: str = DEFAULT_TARGET, *, registry: Declarations,
                upgrade: int | str | None = None) -> PassResult:
    """Lower every node of a registered custom op in ``model`` (in place) for ``target``.

    ``registry`` holds the custom ops and targets (the composition root's :class:`mograph.plugins.Registry`).
    What happens to each node follows the target's record (:class:`mograph.targets.Target`).

    Stats: ``lowered.<op>`` (the target's form), ``inlined.<op>`` (function body inlined), ``kept.<op>``
    (left as the custom op with its body), plus what lowerings count; details say the target.

    Raises:
        OptionError: an unknown target.
        PassFailedError: a target that inlines leftovers (``--target onnx``) and an op with neither a
            standard form nor a function body.
    """
    spec = _target(registry, target)
    ops = registry.custom_ops
    nodes = [(n, ops[(n.domain, n.op_type)]) for n in iter_nodes(model.graph)
             if (n.domain, n.op_type) in ops and not is_plugin_node(n)]
    stats: dict[str, int | float] = {}
    details: dict[str, Any] = {"target": target}
    if not nodes:
        return PassResult(modified=False, stats=stats, details=details)
    snapshot = infer_types(model)
    if spec.standard_opset and upgrade is not None:
        _upgrade_for(model, nodes, upgrade, stats, details, ops)
    ctx = LoweringContext(model, target, shape_rules=rules_for(registry))
    unlowered: dict[str, int] = {}
    for node, op in nodes:  # graph order: what is shared is built before its first user
        if node.graph is None:
            continue
        ctx.op = op
        lower = op.lowerings.get(target) if spec.lowers else None
        if lower is not None and lower(node, ctx):
            key = f"lowered.{op.name}"
        elif spec.leftovers == "inline":
            if op.function is None:
                raise PassFailedError(
                    LOWER_PASS,
                    f"node '{node.name}' ({op.domain}.{op.name}) has no standard ONNX form at opset {ctx.opset} "
                    "and no function body to inline; lower it for another --target or keep it with --target mograph",
                )
            inline_node(node, op.function(ctx.opset), target)
            key = f"inlined.{op.name}"
        else:
            key = f"kept.{op.name}"
            logger.debug("%s: %s stays a custom op for target %s", node.name, op.name, target)
            if spec.lowers and target not in op.lowerings:
                unlowered[f"{op.domain}.{op.name}"] = unlowered.get(f"{op.domain}.{op.name}", 0) + 1
        stats[key] = int(stats.get(key, 0)) + 1
    if unlowered:  # never silent: the target may not run these nodes (TensorRT has no kernel for a plugin's op)
        what = ", ".join(f"{k} x{n}" for k, n in sorted(unlowered.items()))
        sources = registry.custom_op_source
        owners = sorted({sources.get(tuple(k.rsplit(".", 1)), "?") for k in unlowered})  # type: ignore[arg-type]
        message = (f"no lowering for target '{target}' of {what} (declared by {', '.join(owners)}): kept as the "
                   "custom op with its function body; the target may not run it")
        logger.warning("%s: %s", LOWER_PASS, message)
        details["no_lowering"] = dict(sorted(unlowered.items()))
        details["WARNING"] = message
    for shared_key in ctx.shared:
        if shared_key and isinstance(shared_key[0], str):
            stats[shared_key[0]] = int(stats.get(shared_key[0], 0)) + 1
    for key, n in ctx.stats.items():
        stats[key] = int(stats.get(key, 0)) + n
    as_given = int(stats.get("attention.position_ids_as_given", 0))
    if as_given:  # exact, but slower than ONNX Runtime GenAI's graphs: say what the opt-in would change
        note = (f"{as_given} GroupQueryAttention node(s) keep the rotary outside the op (position_ids is a model "
                "input, read as given (--position-ids as-given): exact; 1.10-1.25x ONNX Runtime GenAI's graphs on "
                "an H200). If your loop always feeds each token's cache position (past + s, as ONNX Runtime GenAI "
                "does), --position-ids cache (or auto) puts the rotary inside (1.00x there)")
        logger.warning("%s: %s", LOWER_PASS, note)
        details["position_ids_note"] = note
    assumed = int(stats.get("attention.position_ids_assumed", 0))
    if assumed:  # an assumption the user may have made only through --kv-cache shared / --mask-format lengths
        note = (f"{assumed} GroupQueryAttention node(s) read the position_ids input as each token's cache position "
                "(past + s; --position-ids cache, or auto under --kv-cache shared / --mask-format lengths, which "
                "already assume right padding): other positions (offsets, packed sequences) give other numbers; "
                "--position-ids as-given keeps the export's")
        logger.info("%s: %s", LOWER_PASS, note)
        details["position_ids_note"] = note
    changed = ensure_functions(model, ops)
    changed = drop_unused_functions(model, ops) or changed
    modified = changed or any(k.split(".")[0] in ("lowered", "inlined", "opset_upgrade") for k in stats)
    if not modified:
        restore_types(snapshot)
    return PassResult(modified=modified, stats=dict(sorted(stats.items())), details=details)


def has_custom_ops(model: ir.Model, registry: Declarations) -> bool:
    """Whether ``model`` holds nodes of registered custom ops not yet lowered (plugin nodes count as lowered)."""
    ops = registry.custom_ops
    return any((n.domain, n.op_type) in ops and not is_plugin_node(n)
               for n in iter_nodes(model.graph))


def _drop_weights(model: ir.Model) -> None:
    """Let go of every initializer's tensor of ``model`` (in a function: no loop variable keeps a graph)."""
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            value.const_value = None


def lowered_for(model: Any, target: str, *, registry: Declarations) -> tuple[Any, dict[str, int | float]]:
    """A backend's first act: ``model`` lowered for ``target`` if it holds custom ops, else ``model`` itself.

    ``model`` may be anything :func:`mograph.ir_io.load_model` takes; the caller's object is never
    changed (a lowered copy is returned).  Returns the model to run and the lowering's stats (empty when
    nothing was lowered).
    """
    from mograph import ir_io

    ir_model = model if isinstance(model, ir.Model) else ir_io.load_model(model)
    if not has_custom_ops(ir_model, registry):
        if ir_model is not model:
            # loaded here only to look: its weights (decoded, for a model whose weights are inside its file)
            # go now, not when the cycle collector reaches the graph, so they never sit beside the session;
            # the graph itself, and the heap its loading used, with them when the model is large
            from mograph import _spill

            dropped = _spill.footprint(ir_model)
            _drop_weights(ir_model)
            del ir_model
            _spill.free_dropped(dropped)
        return model, {}
    if ir_model is model:
        ir_model = ir_io.copy_model(model)
    result = lower_model(ir_model, target, registry=registry)
    return ir_model, dict(result.stats)


def _target_name(raw: str) -> str:
    """A target name (checked against the registry's targets when the ``lower`` pass is made)."""
    text = str(raw).strip()
    if not text:
        raise ValueError("a target is a non-empty name")
    return text


def opset_level(raw: object) -> int | str:
    """Parse ``--upgrade-opset``: a positive opset number or ``auto``."""
    if isinstance(raw, str):
        text = raw.strip().lower()
        if text == "auto":
            return "auto"
        value = int(text)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    else:
        raise ValueError("expected an opset number or 'auto'")
    if value < 1:
        raise ValueError("an opset is a positive number")
    return value


TARGET_OPTION = Option(
    "target",
    _target_name,
    DEFAULT_TARGET,
    "what the fused ops lower to (the lower pass, added at the end of a pipeline that fuses): onnx "
    "(standard ops where the opset has them, else the fused op's function body inlined), ort (ONNX "
    "Runtime contrib ops), tensorrt (native layers or mograph TensorRT plugins), mograph (keep the "
    "mograph ops with function bodies), or a target a plugin adds",
    metavar="TARGET",
)

UPGRADE_OPTION = Option(
    "upgrade-opset",
    opset_level,
    None,
    "with --target onnx: raise the model's opset (to N, or 'auto': the lowest that has the standard op) "
    "when a fused op's standard form needs it (LayerNormalization 17, Gelu 20, RMSNormalization 23, "
    "Attention 23); by default the opset never changes",
    metavar="N|auto",
)


class LowerPass(Pass):
    """Lower the fused custom ops for --target (standard ONNX, ONNX Runtime, TensorRT, ...), at the end of the pipeline."""

    name = LOWER_PASS
    family = "fusion"
    options: ClassVar[tuple[Option, ...]] = (TARGET_OPTION, UPGRADE_OPTION)

    def __init__(self, *, registry: Declarations | None = None, **values: Any) -> None:
        super().__init__(registry=registry, **values)
        target = self.config["target"]
        names = known_targets(registry) if registry is not None else [t.name for t in BUILTIN_TARGETS]
        if target not in names:  # without a registry only the built-in targets are known
            raise OptionError(f"{self.name}: bad value for --target: {target!r} (unknown target; known: {', '.join(names)})")

    def call(self, model: ir.Model) -> PassResult:
        return lower_model(model, self.config["target"], registry=self.declarations,
                           upgrade=self.config.get("upgrade_opset"))


@hookimpl
def mograph_add_passes() -> list[type[Pass]]:
    return [LowerPass]


@hookimpl
def mograph_add_targets() -> list[Target]:
    return list(BUILTIN_TARGETS)


@hookimpl
def mograph_add_foreign_ops() -> list[ForeignOp]:
    return list(BUILTIN_FOREIGN_OPS)
