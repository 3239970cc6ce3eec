"""``fp16``: convert a float32 model to float16, keeping float32 where calibration shows it is needed.

Half precision halves memory traffic and runs on tensor cores, but it has two failure modes: values above
65504 overflow to infinity, and long reductions (sums and means over thousands of elements, normalization
statistics) lose the small addends.  Both are measured rather than guessed: every float tensor is observed
on the calibration data (largest magnitude, largest reduced extent), and a node stays in float32 when

- any of its float inputs or outputs reached ``--fp16-max`` (default 65504) in magnitude — **overflow**;
- it reduces (``Reduce*``, ``*Normalization``, ``GlobalAveragePool``, ``Softmax``, ``CumSum``) over at least
  ``--fp16-reduction-limit`` elements (default 4096) — **deep reduction**;
- it is in a custom domain, or the user said so (``--keep-fp32``, an edited ``--precision-plan``);
- its operator has no float16 form at the model's opset (``DynamicQuantizeLinear``, ``DequantizeLinear``
  before opset 19: the ONNX schema's type constraints say so) — **no float16 form**;
- it is control flow (``If``, ``Loop``, ``Scan``): its subgraphs are not converted, so its outputs keep the
  types its branches produce — **control flow**.

When an op has a float16 form only at a newer opset (``CumSum`` 14, ``DequantizeLinear`` 19), the model's
opset is raised to the smallest one that gives every such node its form, at most ``FP16_UPGRADE_LIMIT``
(``onnx.version_converter`` node by node, :func:`mograph.opset.upgrade_opset`; reported in
the stats and ``details["opset_upgrade"]``).  When the converter cannot convert the model, the opset is
left as it is, those nodes stay float32 and ``details["opset_upgrade"]`` says why: a valid model with a
few more float32 nodes beats refusing the conversion.

An input the schema allows only as float32 (``Resize`` scales, for example) stays float32 on a float16
node: the initializer or ``Constant`` feeding it is left in float32 (or a ``Cast`` to float32 feeds it).

Every other node computes in float16: its float initializers are stored in float16, ``Cast``s to float and
float ``Constant``/``ConstantOfShape`` values follow, and one ``Cast`` is inserted on each edge that crosses
between the two precisions (shared per tensor).  Graph inputs and outputs stay float32 (a ``Cast`` at each)
unless ``--fp16-io yes``.  Every node that computes in float is listed in the precision plan with its
reason.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import calibration as cal
from mograph.passes.quant._base import CALIBRATION_OPTIONS, PLAN_OPTIONS, calibration_meta, open_calibration
from mograph.passes.quant.plan import PrecisionPlan, load_plan, node_key

from mograph.errors import OptionError
from mograph.pass_infra import Option, Pass, PassResult
from mograph.specs import parse_bool

__all__ = ["Fp16Pass"]

logger = logging.getLogger(__name__)

_F32 = ir.DataType.FLOAT.value
_F16 = ir.DataType.FLOAT16.value
_REDUCTIONS_BY_SIZE = {"ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp",
                       "ReduceProd", "GlobalAveragePool", "CumSum"}
_REDUCTIONS_LAST_AXIS = {"LayerNormalization", "SimplifiedLayerNormalization", "GroupNormalization",
                         "InstanceNormalization", "RMSNormalization", "Softmax", "LogSoftmax"}
_FP16_MARK = "mograph.fp16"


_HALF = "tensor(float16)"
#: Newest opset ``fp16`` raises a model to, to give an op its float16 form.
FP16_UPGRADE_LIMIT = 21
_CONTROL_FLOW = {"If", "Loop", "Scan"}


def _formal(formals: list[Any], i: int) -> Any | None:
    """The schema's formal parameter for input or output ``i`` (the last one repeats when variadic)."""
    if i < len(formals):
        return formals[i]
    if formals and formals[-1].option == formals[-1].option.Variadic:
        return formals[-1]
    return None


def _allows_half(schema: Any, formal: Any | None) -> bool:
    if formal is None:
        return True
    constraints = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    allowed = constraints.get(formal.type_str, [formal.type_str])
    return any(_HALF in t for t in allowed)


def _half_support(node: ir.Node, opset: int, floats: set[str]) -> tuple[bool, frozenset[int]]:
    """Whether ``node`` can compute in float16, and which of its float inputs must stay float32.

    Read from the operator's ONNX schema at ``opset`` (a node without a schema is not constrained here).
    """
    import onnx

    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return True, frozenset()
    outs_ok = all(_allows_half(schema, _formal(list(schema.outputs), i))
                  for i, v in enumerate(node.outputs) if v.name in floats)
    pinned = frozenset(i for i, v in enumerate(node.inputs) if v is not None and v.name in floats
                       and not _allows_half(schema, _formal(list(schema.inputs), i)))
    return outs_ok, pinned


def _opset_with_half(node: ir.Node, opset: int, floats: set[str]) -> int | None:
    """The smallest opset above ``opset`` (up to the limit) at which ``node``'s op has a float16 form."""
    import onnx

    for version in range(opset + 1, min(FP16_UPGRADE_LIMIT, onnx.defs.onnx_opset_version()) + 1):
        if _half_support(node, version, floats)[0]:
            return version
    return None


class Fp16Pass(Pass):
    """Convert to FP16, keeping FP32 where calibration measures overflow or reductions are deep."""

    name = "fp16"
    family = "quant"
    options = (
        *CALIBRATION_OPTIONS,
        *PLAN_OPTIONS,
        Option("fp16-io", parse_bool, False, "make graph inputs and outputs float16 too (yes/no)", metavar="yes|no"),
        Option("fp16-max", float, 65504.0, "magnitude at which a tensor counts as overflowing float16", metavar="X"),
        Option("fp16-reduction-limit", int, 4096, "reductions over this many elements or more stay float32",
               metavar="N"),
    )
    progress = None

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if any(n.metadata_props.get(_FP16_MARK) for n in graph) or any(
            v.dtype == ir.DataType.FLOAT16 for v in graph.inputs
        ):
            return PassResult(False, {"converted": 0, "skipped_already_fp16": 1})
        dtypes = cal.infer_dtypes(model)
        floats = {name for name, t in dtypes.items() if t == _F32}
        compute = [n for n in graph if any(v is not None and v.name in floats for v in (*n.inputs, *n.outputs))]
        if not compute:
            return PassResult(False, {"converted": 0})
        source = open_calibration(self, model)
        stats: dict[str, int | float] = {}
        details: dict[str, Any] = {}
        upgraded = self._upgrade_opset(model, compute, floats, stats, details)
        if upgraded:
            dtypes = cal.infer_dtypes(model)
            floats = {name for name, t in dtypes.items() if t == _F32}
            compute = [n for n in graph if any(v is not None and v.name in floats for v in (*n.inputs, *n.outputs))]
        observed = [v.name for n in compute for v in n.outputs if v.name in floats]
        observed += [v.name for v in graph.inputs if v.name in floats]
        stats_by = cal.observe(model, observed, source, progress=self.progress, dtypes=dtypes)
        limit_abs = float(self.config["fp16_max"])
        limit_red = int(self.config["fp16_reduction_limit"])

        def amax(v: ir.Value | None) -> float:
            if v is None or v.name not in floats:
                return 0.0
            if v.const_value is not None:
                return float(np.abs(v.const_value.numpy()).max()) if v.const_value.size else 0.0
            s = stats_by.get(v.name or "")
            return s.amax if s is not None else 0.0

        def reduced(n: ir.Node) -> int:
            x = stats_by.get(n.inputs[0].name or "") if n.inputs and n.inputs[0] is not None else None
            y = stats_by.get(n.outputs[0].name or "")
            if x is None:
                return 0
            if n.op_type in _REDUCTIONS_LAST_AXIS:
                return x.max_reduced
            return x.max_size // max(y.max_size, 1) if y is not None else x.max_size

        opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))
        support = {id(n): _half_support(n, opset, floats) for n in compute if n.domain in ("", "ai.onnx")}
        pinned = {key: value[1] for key, value in support.items() if value[1]}
        decisions: dict[int, tuple[str, str]] = {}
        keep = set(self.config.get("keep_fp32") or [])
        user = load_plan(self.config["precision_plan"]) if self.config.get("precision_plan") else None
        for n in compute:
            key = node_key(n)
            if user is not None and user.precision_of(key) is not None:
                prec = "fp16" if user.precision_of(key) == "fp16" else "fp32"
                decisions[id(n)] = (prec, f"user override (plan {self.config['precision_plan']})")
            elif key in keep or n.op_type in keep:
                decisions[id(n)] = ("fp32", "user override (--keep-fp32)")
            elif n.domain not in ("", "ai.onnx"):
                decisions[id(n)] = ("fp32", f"default rule: custom domain {n.domain}")
            elif not support[id(n)][0]:
                decisions[id(n)] = ("fp32", f"default rule: {n.op_type} has no float16 form at opset {opset}")
            elif n.op_type in _CONTROL_FLOW:
                decisions[id(n)] = ("fp32", "default rule: control flow (its subgraphs stay float32, so do its outputs)")
            else:
                peak = max(amax(v) for v in (*n.inputs, *n.outputs))
                depth = reduced(n) if n.op_type in _REDUCTIONS_BY_SIZE | _REDUCTIONS_LAST_AXIS else 0
                if peak >= limit_abs:
                    decisions[id(n)] = ("fp32", f"measured sensitivity: |x| reached {peak:.4g} >= {limit_abs:g}")
                elif depth >= limit_red:
                    decisions[id(n)] = ("fp32", f"measured sensitivity: reduces {depth} elements >= {limit_red}")
                else:
                    decisions[id(n)] = ("fp16", "default rule: float16")
        pinned_uses = 0
        for n in compute:  # a constant that only feeds float32-only inputs stays float32 itself
            if n.inputs or decisions[id(n)][0] != "fp16":
                continue
            uses = [u for v in n.outputs for u in v.uses()]
            if uses and all(u.idx in pinned.get(id(u.node), ()) for u in uses) and not any(
                v.is_graph_output() for v in n.outputs
            ):
                decisions[id(n)] = ("fp32", "default rule: feeds only inputs that must stay float32")
        for n in compute:
            if decisions[id(n)][0] == "fp16":
                pinned_uses += len(pinned.get(id(n), ()))
        converted = self._convert(model, compute, decisions, floats, pinned)
        plan = PrecisionPlan(self.name)
        plan.meta["calibration"] = calibration_meta(source, max((s.samples for s in stats_by.values()), default=0),
                                                    None)
        for n in compute:
            plan.add(n, *decisions[id(n)])
        stats = {
            "converted": sum(1 for n in compute if decisions[id(n)][0] == "fp16"),
            "kept_fp32": sum(1 for n in compute if decisions[id(n)][0] == "fp32"),
            "kept_fp32.overflow": sum(1 for n in compute if "|x| reached" in decisions[id(n)][1]),
            "kept_fp32.reduction": sum(1 for n in compute if "reduces" in decisions[id(n)][1]),
            "kept_fp32.no_float16_form": sum(1 for n in compute if "no float16 form" in decisions[id(n)][1]),
            "kept_fp32.control_flow": sum(1 for n in compute if "control flow" in decisions[id(n)][1]),
            "kept_fp32.float32_only_input": pinned_uses,
            "initializers_fp16": converted["initializers"],
            "casts": converted["casts"],
            **stats,
        }
        if source.random:
            stats["calibrated_on_random_data"] = 1
        details = {"plan": plan.to_dict(), **details}
        if source.random:
            from mograph.passes.quant._base import RANDOM_WARNING

            details = {"WARNING": RANDOM_WARNING, **details}
        if self.config.get("precision_plan_out"):
            plan.write(self.config["precision_plan_out"])
        return PassResult(upgraded or stats["converted"] > 0, stats, details)

    def _upgrade_opset(self, model: ir.Model, compute: list[ir.Node], floats: set[str],
                       stats: dict[str, int | float], details: dict[str, Any]) -> bool:
        """Raise the opset where an op gets its float16 form by it (module docstring); True if raised."""
        from mograph.opset import OpsetUpgradeError, upgrade_opset

        opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))
        keep = set(self.config.get("keep_fp32") or [])
        needs: dict[str, int] = {}
        for n in compute:
            if n.domain not in ("", "ai.onnx") or n.op_type in keep or node_key(n) in keep:
                continue
            if _half_support(n, opset, floats)[0]:
                continue
            version = _opset_with_half(n, opset, floats)
            if version is not None:
                needs[n.op_type] = version
        if not needs:
            return False
        target = max(needs.values())
        reason = "float16 forms of " + ", ".join(f"{k} ({v})" for k, v in sorted(needs.items()))
        try:
            done = upgrade_opset(model, target)
        except OpsetUpgradeError as exc:
            logger.warning("%s: opset %d not raised to %d (%s): %s", self.name, opset, target, reason, exc)
            details["opset_upgrade"] = {"done": False, "reason": f"{reason}: cannot raise opset {opset} to "
                                        f"{target}: {exc}; those nodes stay float32"}
            return False
        stats["opset_upgrade.from"] = done.from_opset
        stats["opset_upgrade.to"] = done.to_opset
        stats["opset_upgrade.rewritten"] = sum(done.rewritten.values())
        details["opset_upgrade"] = {"done": True, "from": done.from_opset, "to": done.to_opset, "reason": reason,
                                    "rewritten": dict(done.rewritten)}
        return True

    def _convert(self, model: ir.Model, compute: list[ir.Node], decisions: dict[int, tuple[str, str]],
                 floats: set[str], pinned: dict[int, frozenset[int]]) -> dict[str, int]:
        graph = model.graph
        half = {id(n) for n in compute if decisions[id(n)][0] == "fp16"}
        if not half:
            return {"initializers": 0, "casts": 0}
        io16 = bool(self.config.get("fp16_io"))
        counts = {"initializers": 0, "casts": 0}

        def wants_half(use: Any) -> bool:  # an onnx_ir Usage (node, idx)
            return id(use.node) in half and use.idx not in pinned.get(id(use.node), ())

        # where each float value lives: its producer's precision, initializers where all consumers are fp16
        home: dict[int, str] = {}
        values: list[ir.Value] = []
        for v in graph.inputs:
            if v.name in floats:
                home[id(v)] = "fp16" if io16 else "fp32"
                values.append(v)
        for name, v in list(graph.initializers.items()):
            if name in floats and v.uses() and all(wants_half(u) for u in v.uses()):
                t = v.const_value
                assert t is not None
                v.const_value = ir.tensor(t.numpy().astype(np.float16), name=name)
                v.dtype = ir.DataType.FLOAT16
                home[id(v)] = "fp16"
                counts["initializers"] += 1
            elif name in floats:
                home[id(v)] = "fp32"
                values.append(v)
        for n in compute:
            prec = decisions[id(n)][0]
            for v in n.outputs:
                if v.name in floats:
                    home[id(v)] = prec
                    values.append(v)
                    if prec == "fp16":
                        v.dtype = ir.DataType.FLOAT16
            if prec == "fp16":
                n.metadata_props[_FP16_MARK] = "1"
                self._retype_attributes(n)
        if io16:
            for v in graph.inputs:
                if v.name in floats:
                    v.dtype = ir.DataType.FLOAT16
        # casts on edges that cross precisions (one per value and direction)
        casts: dict[tuple[int, str], ir.Value] = {}
        first = next(iter(graph))
        for v in values:
            for use in list(v.uses()):
                consumer = use.node
                if consumer.op_type == "Cast" and consumer.metadata_props.get("mograph.fp16.cast"):
                    continue
                want = "fp16" if wants_half(use) else "fp32"
                if want == home.get(id(v)) or consumer.op_type in ("Shape", "Size"):
                    continue
                key = (id(v), want)
                if key not in casts:
                    to = ir.DataType.FLOAT16 if want == "fp16" else ir.DataType.FLOAT
                    cast = ir.node("Cast", [v], {"to": to.value}, name=f"{v.name}_to_{want}")
                    cast.metadata_props["mograph.fp16.cast"] = "1"
                    cast.outputs[0].name = f"{v.name}_{want}"
                    cast.outputs[0].dtype = to
                    producer = v.producer()
                    if producer is not None:
                        graph.insert_after(producer, cast)
                    else:
                        graph.insert_before(first, cast)
                    casts[key] = cast.outputs[0]
                    counts["casts"] += 1
                consumer.replace_input_with(use.idx, casts[key])
        # graph outputs back to float32 unless asked
        for i, v in enumerate(list(graph.outputs)):
            if home.get(id(v)) == "fp16" and not io16:
                out_name = v.name
                v.name = f"{out_name}_fp16"
                cast = ir.node("Cast", [v], {"to": _F32}, name=f"{out_name}_to_fp32")
                cast.outputs[0].name = out_name
                cast.outputs[0].dtype = ir.DataType.FLOAT
                cast.outputs[0].shape = v.shape
                graph.append(cast)
                graph.outputs[i] = cast.outputs[0]
                counts["casts"] += 1
            elif home.get(id(v)) == "fp32" and io16 and v.name in floats:
                raise OptionError(f"{self.name}: output {v.name} stays float32 (kept node); --fp16-io not possible")
        return counts

    @staticmethod
    def _retype_attributes(n: ir.Node) -> None:
        if n.op_type == "Cast":
            to = n.attributes.get("to")
            if to is not None and to.as_int() == _F32:
                n.attributes["to"] = ir.AttrInt64("to", _F16)
        elif n.op_type in ("Constant", "ConstantOfShape"):
            for key in ("value",):
                a = n.attributes.get(key)
                if a is not None and isinstance(a.value, ir.TensorProtocol) and a.value.dtype == ir.DataType.FLOAT:
                    n.attributes[key] = ir.AttrTensor(key, ir.tensor(a.value.numpy().astype(np.float16)))
            for key in ("value_float", "value_floats"):
                a = n.attributes.get(key)
                if a is not None:
                    arr = np.array(a.value, dtype=np.float16)
                    del n.attributes[key]
                    n.attributes["value"] = ir.AttrTensor("value", ir.tensor(arr))
