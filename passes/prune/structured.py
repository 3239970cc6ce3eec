"""Structured pruning: remove whole FFN neurons, attention heads and convolution channels.

The model stays dense — weights get smaller, not sparser — so it really runs faster on any runtime.

**Groups.**  Every candidate is the closure of one seed dimension over the graph (see
:mod:`mograph.passes.prune._deps`): all the weights, biases, normalisation vectors, activations,
residual partners, Concat/Split offsets and Reshape constants that carry the same channels.  A group
is pruned as a whole or not at all.  Seeds, by ``--scope``:

- ``ffn``: the output neurons of each ``MatMul``/``Gemm`` with a constant weight.  In a transformer
  only the FFN intermediate dimension survives the analysis: Q/K/V neurons are split into heads by a
  Reshape (one neuron is not a whole head), and the hidden size is the residual stream, which reaches
  a LayerNorm (it normalises over the channels) and the graph output.
- ``heads``: the head axis of each ``Reshape`` that splits one axis into ``heads x head_dim``.  The
  group follows Q, K and V through their Transposes and the attention MatMuls back to the Q/K/V
  projection columns (in blocks of ``head_dim``) and forward to the output projection rows; the
  Reshape targets (constants, or constant parts of a ``Concat`` of run-time sizes) are updated.
- ``conv``: the output channels of each ``Conv`` (group 1) with a constant weight, with BatchNorm,
  bias, the next convolution's input channels, and both sides of residual Adds.
- ``all``: the three.

**Selection.**  Per group, units are ranked by the ``--criterion`` norm (``l1``: sum of absolute
values, ``l2``: Euclidean norm) of all their parameters taken together (weights, biases, BatchNorm
scale and shift; running statistics excluded); the smallest go first, lowest index first on ties.  A
group keeps ``units - floor(ratio * units)`` units rounded *up* so that its channel count (``units x
head_dim`` for heads) is a multiple of ``--round-to``, and always at least one rounding step.

**Idempotence.**  ``--ratio`` is a fraction of the group's *original* size: the seed node records it in
its metadata (``mograph.prune.units``), so running the pass again with the same options finds every
group already at its target and changes nothing.  A zero ratio changes nothing either.

**Report.**  ``stats`` counts groups found, pruned, blocked and excluded and units removed per scope,
and parameters and multiply-accumulates (MatMul/Gemm/Conv; symbolic dims count as 1) before and after,
for the whole model and per scope (the layers of that scope's prunable groups).  ``details`` lists
every group with its decision, and every blocked group with the reasons, and ``details["output_check"]``
the pruned model's smallest output cosine against the original (:data:`FIGURE_OPTION`; reported only).
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.prune._cost import count_params, param_count, total_macs
from mograph.passes.prune._deps import (
    Dim,
    Group,
    ShapeInfo,
    analyze,
    const_tensor,
    op_rules,
    owns_tensor,
    reshape_plan,
    shape_info,
)
from mograph.passes.quant._base import BUDGET_OPTION

from mograph.errors import OptionError
from mograph.opset import model_opset
from mograph.pass_infra import Option, Pass, PassResult
from mograph.shapes import rules_for

__all__ = ["PruneStructuredPass", "SCOPES", "EXCLUDE_OPTION", "FIGURE_OPTION", "start_figure"]

logger = logging.getLogger(__name__)

SCOPES = ("ffn", "heads", "conv")
META_UNITS = "mograph.prune.units"

#: The switch of the output figure both pruning passes report (``details["output_check"]``: the smallest
#: per-output cosine of the pruned model against the original on seeded random feeds, as
#: :mod:`mograph.passes.quant._output_check` measures it, but never judged: pruning is lossy by design and
#: fine-tuning is expected).  Same name as the precision passes' switch, so ``--accuracy-budget off``
#: skips every such run of a pipeline.
#: (the precision passes' declaration, so ``--help`` shows one text: any value but ``off`` takes the figure).
FIGURE_OPTION = BUDGET_OPTION


def start_figure(pass_: Pass, model: ir.Model) -> Any:
    """The float side of the output figure (``None`` when ``--accuracy-budget off``), taken before pruning."""
    from mograph.passes.quant._output_check import CHECK_SAMPLES, OutputCheck

    if str(pass_.config.get("accuracy_budget") or "auto").strip().lower() in ("off", "rules", "none"):
        return None
    return OutputCheck.start(pass_.name, model, None, samples=CHECK_SAMPLES, judged=False)


EXCLUDE_OPTION = Option(
    "exclude",
    str,
    None,
    "leave alone whatever touches a node or value whose name matches this glob (repeatable)",
    multiple=True,
    metavar="PATTERN",
)


def _ratio(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value < 1.0:
        raise ValueError("must be in [0, 1)")
    return value


class PruneStructuredPass(Pass):
    """Remove the least important FFN neurons, attention heads or conv channels, with their dependencies (the
    output's cosine against the original is reported)."""

    name = "prune-structured"
    family = "prune"
    options = (
        Option("ratio", _ratio, 0.3, "fraction of each group's original units to remove", metavar="R"),
        Option("criterion", str, "l1", "importance of a unit: norm of its parameters", choices=("l1", "l2")),
        Option("round-to", int, 8, "keep channel counts multiples of N (1: no rounding)", metavar="N"),
        Option("scope", str, "ffn", "what to prune", choices=("ffn", "heads", "conv", "all")),
        EXCLUDE_OPTION,
        FIGURE_OPTION,
    )

    def call(self, model: ir.Model) -> PassResult:
        ratio: float = self.config["ratio"]
        round_to: int = self.config["round_to"]
        if round_to < 1:
            raise OptionError(f"{self.name}: --round-to must be at least 1, not {round_to}")
        scope = self.config["scope"]
        scopes = SCOPES if scope == "all" else (scope,)
        patterns: list[str] = self.config["exclude"] or []
        graph = model.graph
        opset = model_opset(model)
        shapes = shape_info(model, rules_for(self.registry))
        rules = op_rules(self.registry.foreign_ops if self.registry is not None else None)

        groups = _find_groups(graph, shapes, opset, scopes, rules)
        stats: dict[str, int | float] = {}
        listing: list[dict[str, Any]] = []
        blocked: list[dict[str, Any]] = []
        plans: list[tuple[Group, list[int], int]] = []
        for s in scopes:
            for key in ("groups", "pruned_groups", "blocked_groups", "excluded_groups", "removed_units"):
                stats[f"{s}.{key}"] = 0
        for g in groups:
            stats[f"{g.scope}.groups"] += 1
            entry: dict[str, Any] = {"group": g.name, "scope": g.scope, "units": g.units}
            listing.append(entry)
            if g.blocked:
                stats[f"{g.scope}.blocked_groups"] += 1
                entry.update(status="blocked", reason=g.reasons[0])
                blocked.append({"group": g.name, "scope": g.scope, "reasons": _dedupe(g.reasons)[:5]})
                continue
            hit = _excluded(g, patterns)
            if hit is not None:
                stats[f"{g.scope}.excluded_groups"] += 1
                entry.update(status="excluded", reason=f"matches --exclude {hit!r}")
                continue
            original = int(g.seed.metadata_props.get(META_UNITS, g.units))
            step = _step(g, round_to)
            keep = _keep(original, ratio, step)
            entry.update(original_units=original, target_units=keep)
            if g.units <= keep:
                entry.update(status="kept", kept=g.units)
                continue
            scores = _importance(g, self.config["criterion"])
            order = np.argsort(scores, kind="stable")
            removed = sorted(int(u) for u in order[: g.units - keep])
            plans.append((g, removed, original))
            stats[f"{g.scope}.pruned_groups"] += 1
            stats[f"{g.scope}.removed_units"] += len(removed)
            entry.update(status="pruned", kept=keep, removed=len(removed))

        live = [g for g in groups if not g.blocked and _excluded(g, patterns) is None]
        scope_nodes = {s: _scope_nodes(live, s) for s in scopes}
        params_before = count_params(model)
        macs_before = total_macs(graph, shapes)
        per_scope_before = {
            s: (_scope_params(live, s), total_macs(scope_nodes[s], shapes)) for s in scopes
        }

        figure = start_figure(self, model) if plans else None
        for g, removed, original in plans:
            _apply(graph, g, removed, shapes)
            g.seed.metadata_props[META_UNITS] = str(original)
        _delete_slices(graph, plans)

        stats["params_before"] = params_before
        stats["params_after"] = count_params(model) if plans else params_before
        stats["macs_before"] = macs_before
        stats["macs_after"] = total_macs(graph, shapes) if plans else macs_before
        for s in scopes:
            p_before, m_before = per_scope_before[s]
            stats[f"{s}.params_before"] = p_before
            stats[f"{s}.params_after"] = _scope_params(live, s) if plans else p_before
            stats[f"{s}.macs_before"] = m_before
            stats[f"{s}.macs_after"] = total_macs(scope_nodes[s], shapes) if plans else m_before
        details: dict[str, Any] = {"groups": listing, "macs_note": "MatMul/Gemm/Conv; symbolic dims count as 1"}
        if blocked:
            details["blocked"] = blocked
        if figure is not None:
            figure.finish(model, stats, details)
        logger.info("prune-structured: %d groups pruned, %d blocked", len(plans), len(blocked))
        return PassResult(modified=bool(plans), stats=stats, details=details)


# ------------------------------------------------------------------------------------------- seeds


def _find_groups(graph: ir.Graph, shapes: ShapeInfo, opset: int, scopes: tuple[str, ...],
                 rules: Mapping[tuple[str, str], Any] | None = None) -> list[Group]:
    """Analyse every seed of the chosen scopes (heads first: their groups contain the Q/K/V neurons) with
    ``rules`` (:func:`~mograph.passes.prune._deps.op_rules`; default: with the built-in foreign-op records)."""
    seeds: list[tuple[str, ir.Node, Dim, int, str]] = []
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        op = node.op_type
        if "heads" in scopes and op == "Reshape":
            seed = _head_seed(node, shapes)
            if seed is not None:
                seeds.append(("heads", node, seed[0], seed[1], f"{node.name}:heads"))
        if "ffn" in scopes and op in ("MatMul", "Gemm") and len(node.inputs) > 1 and node.inputs[1] is not None:
            w = const_tensor(node.inputs[1])
            rank = shapes.rank(node.outputs[0])
            if w is not None and len(w.shape) == 2 and rank is not None and rank >= 1:
                trans_b = node.attributes.get("transB")
                n = int(w.shape[0] if op == "Gemm" and trans_b is not None and trans_b.value else w.shape[1])
                seeds.append(("ffn", node, Dim(node.outputs[0], rank - 1), n, f"{node.name}:out"))
        if "conv" in scopes and op == "Conv" and node.inputs[1] is not None:
            w = const_tensor(node.inputs[1])
            group = node.attributes.get("group")
            if w is not None and (group is None or group.value == 1):
                seeds.append(("conv", node, Dim(node.outputs[0], 1), int(w.shape[0]), f"{node.name}:out"))
    order = {"heads": 0, "ffn": 1, "conv": 2}
    seeds.sort(key=lambda s: order[s[0]])
    groups: list[Group] = []
    covered: set[tuple[int, int]] = set()
    for scope, node, dim, units, name in seeds:
        if (id(dim.value), dim.axis) in covered:  # already inside an earlier group, at any offset
            continue
        g = analyze(node, dim, units, scope, name, shapes, opset, rules)
        covered |= {key[:2] for key in g.dims}
        groups.append(g)
    return groups


def _head_seed(node: ir.Node, shapes: ShapeInfo) -> tuple[Dim, int] | None:
    """The head axis of a Reshape that splits one static axis into ``heads x head_dim`` (both > 1)."""
    plan = reshape_plan(node, shapes)
    if isinstance(plan, str):
        return None
    in_dims, out_dims, _literals, pairs = plan
    for ins, outs in pairs:
        real_in = [a for a in ins if in_dims[a] != 1]
        real_out = [a for a in outs if out_dims[a] != 1]
        if len(real_in) == 1 and len(real_out) == 2:
            heads = out_dims[real_out[0]]
            if isinstance(heads, int) and heads > 1:
                return Dim(node.outputs[0], real_out[0]), heads
    return None


# ------------------------------------------------------------------------------------------- decide


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _excluded(group: Group, patterns: list[str]) -> str | None:
    for name in group.names():
        for pattern in patterns:
            if fnmatch.fnmatchcase(name, pattern):
                return pattern
    return None


def _step(group: Group, round_to: int) -> int:
    """Units per rounding step: channel counts (``units x inner``) stay multiples of ``round_to``."""
    inner = max(d.inner for d in group.dims.values())
    return round_to // math.gcd(round_to, inner)


def _keep(units: int, ratio: float, step: int) -> int:
    keep = units - math.floor(ratio * units + 1e-9)
    keep = math.ceil(keep / step) * step
    return min(units, max(keep, step))


def _importance(group: Group, criterion: str) -> np.ndarray:
    """Per unit, the L1 or L2 norm of all the group's parameters belonging to it."""
    total = np.zeros(group.units, dtype=np.float64)
    for c in group.consts.values():
        if c.role not in ("weight", "bias", "norm"):
            continue
        tensor = const_tensor(c.value)
        if tensor is None or tensor.dtype.is_integer():
            continue
        arr = np.moveaxis(np.asarray(tensor.numpy(), dtype=np.float64), c.axis, 0)
        arr = arr[c.offset : c.offset + group.units * c.inner].reshape(group.units, -1)
        total += np.abs(arr).sum(axis=1) if criterion == "l1" else np.square(arr).sum(axis=1)
    return total if criterion == "l1" else np.sqrt(total)


def _scope_params(groups: list[Group], scope: str) -> int:
    """Parameters of the constants the scope's groups read (after pruning: the cut or private copies)."""
    seen: dict[int, ir.Value] = {}
    for g in groups:
        if g.scope != scope:
            continue
        for ports in g.const_ports.values():
            for node_id, idx in ports:
                value = g.nodes[node_id].inputs[idx]
                if value is not None:
                    seen[id(value)] = value
    return sum(param_count(v) for v in seen.values())


def _scope_nodes(groups: list[Group], scope: str) -> list[ir.Node]:
    seen: dict[int, ir.Node] = {}
    for g in groups:
        if g.scope == scope:
            seen.update(g.nodes)
    return list(seen.values())


# ------------------------------------------------------------------------------------------- apply


def _apply(graph: ir.Graph, group: Group, removed: list[int], shapes: ShapeInfo) -> None:
    """Shrink the activations' declared shapes and the shape literals; weights are cut by ``_delete_slices``."""
    n = len(removed)
    for d in group.dims.values():
        if const_tensor(d.value) is not None:
            continue
        size = shapes.size(d.value, d.axis)
        if isinstance(size, int):
            shapes.set_size(d.value, d.axis, size - n * d.inner)
        if d.value.shape is not None and isinstance(d.value.shape[d.axis], int):
            dims = list(d.value.shape)
            dims[d.axis] = dims[d.axis] - n * d.inner
            d.value.shape = ir.Shape(dims)
    by_holder: dict[int, tuple[ir.Value, dict[int, int], dict[tuple[int, int], tuple[ir.Node, int]]]] = {}
    for edit in group.shape_edits.values():
        _holder, changes, readers = by_holder.setdefault(id(edit.const), (edit.const, {}, {}))
        changes[edit.index] = -n * edit.inner
        readers.update({(id(node), idx): (node, idx) for node, idx in edit.readers})
    for holder, changes, readers in by_holder.values():
        _edit_literal(graph, holder, changes, list(readers.values()))
    for split in group.split_edits.values():
        attr = split.node.attributes["split"]
        sizes = list(attr.value)
        sizes[split.index] -= n * split.inner
        split.node.attributes["split"] = ir.AttrInt64s("split", sizes)


def _delete_slices(graph: ir.Graph, plans: list[tuple[Group, list[int], int]]) -> None:
    """Cut every pruned unit out of every constant (indices are the original ones).

    A constant read only by its groups is cut in place, all groups at once.  One also read elsewhere
    (or reached through an ``Identity``) is copied: the group's readers get a private, cut copy.
    """
    cuts: dict[int, tuple[ir.Value, dict[int, set[int]]]] = {}
    private: dict[tuple[int, int], tuple[Group, ir.Value, dict[int, set[int]], set[tuple[int, int]]]] = {}
    for group, removed, _ in plans:
        for key, c in group.consts.items():
            idx: set[int] = set()
            for u in removed:
                start = c.offset + u * c.inner
                idx.update(range(start, start + c.inner))
            ports = group.const_ports.get(key, set())
            if owns_tensor(c.value) and all((id(use.node), use.idx) in ports for use in c.value.uses()):
                _value, per_axis = cuts.setdefault(id(c.value), (c.value, {}))
            else:
                _g, _value, per_axis, all_ports = private.setdefault((id(group), id(c.value)), (group, c.value, {}, set()))
                all_ports |= ports
            per_axis.setdefault(c.axis, set()).update(idx)
    for value, per_axis in cuts.values():
        _set_const(value, _cut(value, per_axis))
    for group, value, per_axis, ports in private.values():
        copy = _new_initializer(graph, value.name or "weight", _cut(value, per_axis))
        for node_id, input_index in ports:
            node = group.nodes[node_id]
            if node.inputs[input_index] is value:
                node.replace_input_with(input_index, copy)
        _drop_if_unread(graph, value)


def _drop_if_unread(graph: ir.Graph, value: ir.Value) -> None:
    """Remove an Identity or initializer left without readers by the private copies (and what it read)."""
    if value.uses() or value.is_graph_output() or value.is_graph_input():
        return
    producer = value.producer()
    if producer is not None and producer.op_type == "Identity":
        source = producer.inputs[0]
        graph.remove(producer, safe=True)
        if source is not None:
            _drop_if_unread(graph, source)
    elif value.is_initializer() and value.name is not None and value.name in graph.initializers:
        graph.initializers.pop(value.name)


def _cut(value: ir.Value, per_axis: dict[int, set[int]]) -> np.ndarray:
    tensor = const_tensor(value)
    assert tensor is not None
    arr = tensor.numpy()
    for axis, idx in per_axis.items():
        arr = np.delete(arr, sorted(idx), axis=axis)
    return np.ascontiguousarray(arr)


def _new_initializer(graph: ir.Graph, base: str, arr: np.ndarray) -> ir.Value:
    name, k = f"{base}_pruned", 1
    while name in graph.initializers:
        k += 1
        name = f"{base}_pruned{k}"
    value = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)))
    value.const_value = ir.Tensor(arr, name=name)
    graph.register_initializer(value)
    return value


def _set_const(value: ir.Value, arr: np.ndarray) -> None:
    tensor = ir.Tensor(arr, name=value.name)
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant":
        producer.attributes["value"] = ir.AttrTensor("value", tensor)
        if value.type is None:
            value.type = ir.TensorType(tensor.dtype)
    else:
        value.const_value = tensor
    value.shape = ir.Shape(arr.shape)


def _edit_literal(
    graph: ir.Graph, holder: ir.Value, changes: dict[int, int], readers: list[tuple[ir.Node, int]]
) -> None:
    """Add ``changes[i]`` to element ``i`` of an integer constant, on a private copy if others read it too."""
    tensor = const_tensor(holder)
    assert tensor is not None
    arr = np.array(tensor.numpy(), copy=True)
    flat = arr.reshape(-1)
    for index, delta in changes.items():
        flat[index] += delta
    ours = {(id(node), idx) for node, idx in readers}
    if all((id(use.node), use.idx) in ours for use in holder.uses()):
        _set_const(holder, arr)
        return
    clone = _new_initializer(graph, holder.name or "shape", arr)
    for node, idx in readers:
        node.replace_input_with(idx, clone)
