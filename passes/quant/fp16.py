"""``fp16``: convert a float32 model to float16, keeping float32 only where calibration measures it is needed.

Half precision halves memory traffic and runs on tensor cores, but it has two failure modes: values above
65504 overflow to infinity, and some computations lose too much when their inputs are rounded to 11
significant bits (cancellation, long reductions).  Neither is guessed from op types; both are measured on
the calibration data (:mod:`mograph.passes.quant._fp16_measure`):

1. **which nodes can compute in float16** is read from the op's schema at the model's opsets: ``onnx.defs``
   for the default domain, ONNX Runtime's registry for contrib ops (``com.microsoft`` ``Attention``,
   ``SkipLayerNormalization``, ``BiasGelu``, ``FastGelu``, ``MultiHeadAttention``, ``GroupQueryAttention``,
   ``RotaryEmbedding`` ...), and every ``mograph.*`` op is float-generic (its body computes in
   ``stash_type``).  Inputs the schema allows only in another type keep it (``mask_index`` int32,
   ``Resize`` scales float32: the constant or a ``Cast`` feeds them); outputs it allows only float32 stay
   float32 (``mean``/``inv_std_var`` of the norms).  A node whose op has no float16 form at its opset, an
   op of an unknown custom domain, and control flow (``If``/``Loop``/``Scan``: its subgraphs are not
   converted) stay float32 — **no float16 form** / **control flow**;
2. **each node's own float16 error**: every other node gets a float16 twin fed with the float32 model's
   inputs rounded to float16, run over the calibration data (in groups whose read-back tensors fit
   ``$MOGRAPH_FP16_MEASURE_BYTES``, default 512 MiB per sample).  A twin that ONNX Runtime refuses to
   run although the schema allows float16 (``ScatterElements`` with ``reduction='add'`` on CPU) keeps its
   node float32 — **no float16 form** (in ONNX Runtime) — and its group is measured again.  A twin that gives a
   non-finite value where float32 is finite keeps the node float32 — **overflow**; a reduction over at
   least ``--fp16-reduction-limit`` elements (default 4096) also stays — **deep reduction**;
3. **the end-to-end check**: the model converted with everything else in float16 runs on the first
   ``--fp16-samples`` calibration samples; if its outputs miss ``--fp16-budget`` (default
   ``cosine>=0.9999``, the smallest cosine against float32 of any output of any sample, each output
   judged on its own as ``--verify`` judges it, made scale-aware (a relative norm error ``e`` caps it at
   ``1 - e^2/2``), padded positions of an ``attention_mask`` left out;
   :func:`~mograph.passes.quant._fp16_measure.output_metric`), the nodes with the largest
   local error are kept float32, the fewest that meet the budget (a binary search) — **measured
   sensitivity**.  ``--fp16-budget none`` skips this step.

The user decides over all of it with ``--keep-fp32`` and an edited ``--precision-plan``.

When an op has a float16 form only at a newer opset (``CumSum`` 14, ``DequantizeLinear`` 19), the model's
opset is raised to the smallest one that gives every such node its form, at most ``FP16_UPGRADE_LIMIT``
(``onnx.version_converter`` node by node, :func:`mograph.opset.upgrade_opset`; reported in
the stats and ``details["opset_upgrade"]``).  When the converter cannot convert the model, the opset is
left as it is, those nodes stay float32 and ``details["opset_upgrade"]`` says why.  The same holds for the
fused ops whose declaration gives a ``float_generic_opset`` (``mograph.LayerNorm``, ``mograph.Attention``, the
weight-only MatMul: their function bodies reach float16 through ``CastLike``, opset 15): a model below it is
raised to it, as the int4 pass does for float16 activations, rather than leaving those nodes float32.

Conversion: float initializers are stored in float16 (saturated to +-65504: an attention mask's float32
minimum becomes -65504, never -inf), or as a float16 copy beside the float32 one when both precisions read
them (no ``Cast`` at run time); ``Cast``s to float and float ``Constant``/``ConstantOfShape`` values follow.
One ``Cast`` is inserted per value and direction on each edge that crosses precisions — with everything
in float16 that is only the graph boundary: graph inputs and outputs stay float32 unless ``--fp16-io yes``.
With ``--fp16-io yes`` an output that a kept float32 node writes (a real LM head whose logits miss the budget
in float16) is computed in float32 and rounded to float16 once at the boundary
(``stats["outputs_rounded_to_fp16"]``); only a model where no node runs in float16 is refused.
A float32 value measured beyond +-65504 is clipped before its ``Cast`` to float16.  Every node is listed in
the precision plan with its reason and measured error; ``details["kept_fp32"]`` lists the float32 ones.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import calibration as cal
from mograph.passes.quant._base import CALIBRATION_OPTIONS, PLAN_OPTIONS, calibration_meta, open_calibration
from mograph.passes.quant._fp16_measure import (
    CLIP_INPUTS_OPSET,
    FP16_LIMIT,
    LocalMeasure,
    Search,
    fewest_fp32,
    keep_fp16_rounding,
    measure_local,
    output_metric,
    to_half,
)
from mograph.passes.quant.plan import Budget, PrecisionPlan, load_plan, node_key, parse_budget

from mograph import _spill, ir_io
from mograph.custom_ops import DOMAIN as CUSTOM_DOMAIN
from mograph.custom_ops import CustomOp
from mograph.errors import OptionError
from mograph.foreign_ops import normalization_ops
from mograph.irutil import fresh_name
from mograph.pass_infra import Option, Pass, PassResult
from mograph.specs import parse_bool

__all__ = ["Fp16Pass"]

logger = logging.getLogger(__name__)

_F32 = ir.DataType.FLOAT.value
_F16 = ir.DataType.FLOAT16.value
_REDUCTIONS_BY_SIZE = {"ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp",
                       "ReduceProd", "GlobalAveragePool", "CumSum"}
#: Standard ops whose reduction depth is input 0's last axis; with them, the ops whose foreign-op record
#: says ``normalizes`` (``LayerNormalization``, ``RMSNormalization``, ONNX Runtime's norms).
_REDUCTIONS_LAST_AXIS = frozenset({"GroupNormalization", "InstanceNormalization", "Softmax", "LogSoftmax"})
_FP16_MARK = "mograph.fp16"
_CAST_MARK = "mograph.fp16.cast"


_HALF = "tensor(float16)"
#: Newest opset ``fp16`` raises a model to, to give an op its float16 form.
FP16_UPGRADE_LIMIT = 21
_CONTROL_FLOW = {"If", "Loop", "Scan"}
#: ops an angle passes through between an integer position turned float and the Cos/Sin of it (rotary and
#: sinusoidal position embeddings computed at run time)
_ANGLE_OPS = frozenset({"Mul", "Div", "Add", "Sub", "MatMul", "Einsum", "Unsqueeze", "Squeeze", "Reshape", "Flatten",
                        "Transpose", "Concat", "Expand", "Tile", "Gather", "Slice", "Identity", "Cast"})
_ANGLE_REASON = ("default rule: angle of an integer position (Cos/Sin of it): float16 holds positions only to "
                 "2048 exactly and an angle of position p to p/1024 rad")


def _position_angles(nodes: list[ir.Node], floats: set[str], dtypes: Mapping[str, int]) -> set[int]:
    """Indices of the nodes that compute Cos/Sin of positions: from a Cast of an integer tensor to float (or a
    float Range) through :data:`_ANGLE_OPS` to a Cos or Sin, those included.  In float16 a position above 2048
    rounds (to 4 above 4096) and the angle ``p * inv_freq`` loses ``p/1024`` rad, so a rotary embedding computed
    at run time from ``position_ids`` would rotate long-context tokens by visibly wrong angles."""
    where = {id(n): i for i, n in enumerate(nodes)}

    def is_float(v: ir.Value | None) -> bool:
        return v is not None and v.name in floats

    def is_integer(v: ir.Value) -> bool:
        code = dtypes.get(v.name or "")
        dtype = v.dtype if code is None else ir.DataType(code)
        return dtype is not None and dtype.is_integer()

    sources = [n for n in nodes if (n.op_type == "Cast" and n.inputs and n.inputs[0] is not None
                                     and is_integer(n.inputs[0]) and is_float(n.outputs[0]))
               or (n.op_type == "Range" and is_float(n.outputs[0]))]
    reach: set[int] = set()
    ends: list[ir.Node] = []
    stack = list(sources)
    while stack:
        n = stack.pop()
        if id(n) in reach or id(n) not in where:
            continue
        reach.add(id(n))
        if n.op_type in ("Cos", "Sin"):
            ends.append(n)
            continue
        for v in n.outputs:
            if not is_float(v):
                continue
            for use in v.uses():
                if use.node.op_type in _ANGLE_OPS or use.node.op_type in ("Cos", "Sin"):
                    stack.append(use.node)
    memo: dict[int, bool] = {}

    def constant_side(v: ir.Value) -> bool:
        """Whether ``v`` is computed from constants only through angle ops (``inv_freq`` expanded over the batch
        and cast, as transformers writes it): it stays float32 with the positions it multiplies."""
        prod = v.producer()
        if prod is None:
            return v.const_value is not None or v.is_initializer()
        if id(prod) not in memo:
            memo[id(prod)] = False  # (a cycle cannot happen in a DAG; this only stops re-entry)
            memo[id(prod)] = (prod.op_type in _ANGLE_OPS | {"Constant", "ConstantOfShape", "Where", "Shape", "Equal"}
                              and all(x is None or not is_float(x) or constant_side(x) for x in prod.inputs))
        return memo[id(prod)]

    keep: set[int] = set()
    stack = list(ends)
    while stack:
        n = stack.pop()
        if id(n) in keep:
            continue
        keep.add(id(n))
        for inp in n.inputs:
            prod = inp.producer() if inp is not None else None
            if prod is not None and inp is not None and (id(prod) in reach or (is_float(inp) and constant_side(inp))):
                stack.append(prod)
    return {where[i] for i in keep if i in where}


#: data-movement ops whose first input alone is data (the rest: shapes, bounds, axes)
_ATTENTION_GLUE = frozenset({"Reshape", "Transpose", "Concat", "Slice", "Split", "Squeeze", "Unsqueeze", "Identity",
                             "Expand", "Cast"})
_ATTENTION_REASON = ("default rule: a decoder's fused attention, its Q/K/V projections, rotary and KV cache take "
                     "one precision, "
                     "float16 (ONNX Runtime's GroupQueryAttention has float16 kernels only on CUDA, and a Cast inside "
                     "the unit leaves it MultiHeadAttention over repeated K/V heads and --kv-cache shared impossible)")


def _attention_units(nodes: list[ir.Node]) -> set[int]:
    """Positions of each decoder attention unit: a fused ``mograph`` ``Attention`` whose inputs are rotated
    (a ``mograph`` ``RotaryEmbedding``) or read a KV cache (a Concat with a graph input), with the glue
    and rotary nodes (fused, or spelled out as Mul/Slice/Neg/Concat/Add) between it and the Q/K/V projections, the
    projections (MatMul, bias Add) included.  The lowering turns such a unit into one GroupQueryAttention only when
    no precision boundary cuts it (a Cast between the projection and the head split leaves it unlowered)."""
    where = {id(n): i for i, n in enumerate(nodes)}
    units: set[int] = set()
    for p, n in enumerate(nodes):
        if n.domain != CUSTOM_DOMAIN or n.op_type != "Attention":
            continue
        unit, decoder = {p}, False
        stack = [v for v in n.inputs[:4] if v is not None]  # Q, K, V and the mask bias
        while stack:
            v = stack.pop()
            prod = v.producer()
            if prod is None or id(prod) not in where or where[id(prod)] in unit:
                continue
            rotary = prod.domain == CUSTOM_DOMAIN and prod.op_type == "RotaryEmbedding"
            standard = prod.domain in ("", "ai.onnx")
            if not (rotary or standard) or prod.op_type in _CONTROL_FLOW:
                continue
            unit.add(where[id(prod)])
            if prod.op_type in ("MatMul", "Gemm"):  # the Q/K/V projection: in float16 too, and the walk ends
                continue
            if rotary or (prod.op_type == "Concat" and any(x is not None and x.is_graph_input() for x in prod.inputs)):
                decoder = True
            # data inputs only (not a Reshape's shape, a Slice's bounds): the head split, the rotary (spelled
            # out or fused, its cos/sin angles stay float32 by their own rule) and the cache Concat
            data = prod.inputs[:1] if prod.op_type in _ATTENTION_GLUE and prod.op_type != "Concat" else prod.inputs
            stack.extend(x for x in data if x is not None)
        if decoder:
            units |= unit
    return units


def _formal(formals: list[Any], i: int) -> Any | None:
    """The schema's formal parameter for input or output ``i`` (the last one repeats when variadic)."""
    if i < len(formals):
        return formals[i]
    if formals and getattr(formals[-1].option, "name", str(formals[-1].option)).endswith("Variadic"):
        return formals[-1]
    return None


def _allows_half(schema: Any, formal: Any | None) -> bool:
    if formal is None:
        return True
    type_str = getattr(formal, "type_str", None) or getattr(formal, "typeStr", "")
    constraints = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    allowed = constraints.get(type_str, [type_str])
    return any(_HALF in t for t in allowed)


_ORT_SCHEMAS: dict[tuple[str, str], list[Any]] | None = None


def _ort_schema(domain: str, op_type: str, version: int) -> Any | None:
    """ONNX Runtime's schema of a contrib op (``com.microsoft`` ...), newest at or below ``version``.

    Read from the installed ``onnxruntime`` (its operator registry); ``None`` without it or for an unknown op.
    """
    global _ORT_SCHEMAS
    if _ORT_SCHEMAS is None:
        _ORT_SCHEMAS = {}
        try:
            from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

            for s in ort_c.get_all_operator_schema():
                _ORT_SCHEMAS.setdefault((s.domain, s.name), []).append(s)
        except (ImportError, AttributeError) as exc:  # pragma: no cover - onnxruntime is needed to calibrate
            logger.debug("onnxruntime operator schemas unavailable: %s", exc)
    found = [s for s in _ORT_SCHEMAS.get((domain, op_type), []) if s.since_version <= version]
    return max(found, key=lambda s: s.since_version) if found else None


def _schema(node: ir.Node, opset: int, opsets: dict[str, int],
            ops: Mapping[tuple[str, str], CustomOp] | None = None) -> tuple[Any | None, bool]:
    """The node's schema at the model's opsets, and whether the node's op is known at all.

    Default-domain ops read ``onnx.defs``; contrib ops (``com.microsoft``) ONNX Runtime's registry; ops of
    the ``mograph`` domain are declared float-generic (their bodies compute in ``stash_type``), so they are
    known without a schema, except below their declaration's ``float_generic_opset`` (``ops``), where the
    body computes float32 only: such a node is not known in float16 (a float16 twin of a weight-only MatMul
    at opset 14 was a model ONNX Runtime refused, exit 1).
    """
    import onnx

    if node.domain in ("", "ai.onnx"):
        try:
            return onnx.defs.get_schema(node.op_type, opset, node.domain), True
        except onnx.defs.SchemaError:
            return None, True
    if node.domain == CUSTOM_DOMAIN:
        op = (ops or {}).get((node.domain, node.op_type))
        generic_from = op.float_generic_opset if op is not None else None
        return None, generic_from is None or opset >= generic_from
    schema = _ort_schema(node.domain, node.op_type, int(opsets.get(node.domain, 1)))
    return schema, schema is not None


def _type_str(formal: Any) -> str:
    """A formal parameter's type string (``onnx.defs`` says ``type_str``, ONNX Runtime's registry ``typeStr``)."""
    return str(getattr(formal, "type_str", None) or getattr(formal, "typeStr", ""))


def _type_code(type_str: str) -> int | None:
    """``onnx.TensorProto`` element type of a schema type string such as ``tensor(float16)``."""
    if not (type_str.startswith("tensor(") and type_str.endswith(")")):
        return None
    name = type_str[len("tensor("):-1].upper()
    try:
        return ir.DataType[name].value
    except KeyError:
        return None


def _complete_dtypes(model: ir.Model, dtypes: dict[str, int], opset: int, opsets: dict[str, int]) -> None:
    """Fill in the element types ONNX shape inference left unknown, from the ops' type constraints.

    ONNX's inference does not know contrib ops, so the outputs of ``com.microsoft`` ``MultiHeadAttention``,
    ``Attention`` ... (and whatever reads only them) get no type; the fp16 pass would then not see them as
    float and leave them float32 while their consumers turn float16 (an ill-typed model).  Walking the graph
    in order, an output whose schema formal is a type parameter bound by an input of known type (``T`` of
    ``query`` for ``output``), or a constraint with a single allowed type, gets that type.  ``dtypes`` is
    updated in place.
    """
    for node in model.graph:
        missing = [j for j, v in enumerate(node.outputs) if v.name and v.name not in dtypes]
        if not missing:
            continue
        schema, _ = _schema(node, opset, opsets)
        if schema is None:
            continue
        constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
        bound: dict[str, int] = {}
        for i, v in enumerate(node.inputs):
            formal = _formal(list(schema.inputs), i)
            if v is None or formal is None or not v.name or v.name not in dtypes or not _type_str(formal):
                continue
            bound.setdefault(_type_str(formal), dtypes[v.name])
        for j in missing:
            formal = _formal(list(schema.outputs), j)
            if formal is None:
                continue
            type_str = _type_str(formal)
            code = bound.get(type_str)
            if code is None:
                allowed = constraints.get(type_str, [type_str])
                code = _type_code(allowed[0]) if len(allowed) == 1 else None
            if code is not None:
                dtypes[node.outputs[j].name] = code  # type: ignore[index]


def _half_support(node: ir.Node, opset: int, floats: set[str], opsets: dict[str, int] | None = None,
                  ops: Mapping[tuple[str, str], CustomOp] | None = None) -> tuple[bool, frozenset[int], frozenset[int]]:
    """Whether ``node`` can compute in float16, and which of its float inputs and outputs must stay float32.

    Read from the operator's schema at ``opset`` (:func:`_schema`): a node whose op has no known schema
    cannot (it stays float32); one that has a float output only float32 is allowed for (``Mean`` of
    ``LayerNormalization``, ``mean``/``inv_std_var`` of ``SkipLayerNormalization``) computes in float16 with
    that output left float32; one whose every float output is float32-only has no float16 form.
    """
    schema, known = _schema(node, opset, opsets or {}, ops)
    if not known:
        return False, frozenset(), frozenset()
    if schema is None:
        return True, frozenset(), frozenset()
    float_outs = [i for i, v in enumerate(node.outputs) if v.name in floats]
    pinned_out = frozenset(i for i in float_outs if not _allows_half(schema, _formal(list(schema.outputs), i)))
    ok = not float_outs or len(pinned_out) < len(float_outs)
    pinned = frozenset(i for i, v in enumerate(node.inputs) if v is not None and v.name in floats
                       and not _allows_half(schema, _formal(list(schema.inputs), i)))
    return ok, pinned, pinned_out


def _opset_with_half(node: ir.Node, opset: int, floats: set[str]) -> int | None:
    """The smallest opset above ``opset`` (up to the limit) at which ``node``'s op has a float16 form."""
    import onnx

    for version in range(opset + 1, min(FP16_UPGRADE_LIMIT, onnx.defs.onnx_opset_version()) + 1):
        if _half_support(node, version, floats)[0]:
            return version
    return None


class Fp16Pass(Pass):
    """Convert to FP16, keeping FP32 only where measured on calibration data (overflow, error budget)."""

    name = "fp16"
    family = "quant"
    options = (
        *CALIBRATION_OPTIONS,
        *PLAN_OPTIONS,
        Option("fp16-io", parse_bool, False, "make graph inputs and outputs float16 too (yes/no)", metavar="yes|no"),
        Option("fp16-max", float, 65504.0, "below 65504: also keep float32 where values reach this magnitude "
               "(overflow itself is measured)", metavar="X"),
        Option("fp16-reduction-limit", int, 4096, "reductions over this many elements or more stay float32",
               metavar="N"),
        Option("fp16-budget", str, "cosine>=0.9999",
               "accuracy the float16 model must keep on the calibration samples (none: skip the check)",
               metavar="cosine>=X|max-abs<=X|none"),
        Option("fp16-samples", int, 16, "calibration samples the end-to-end accuracy check runs", metavar="N"),
    )
    progress = None

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if any(n.metadata_props.get(_FP16_MARK) for n in graph) or any(
            v.dtype == ir.DataType.FLOAT16 for v in graph.inputs
        ):
            return PassResult(False, {"converted": 0, "skipped_already_fp16": 1})
        budget_text = str(self.config.get("fp16_budget") or "none").strip()
        try:
            budget = None if budget_text.lower() in ("none", "off", "") else parse_budget(budget_text)
        except OptionError:
            raise OptionError(f"--fp16-budget {budget_text!r}: expected cosine>=X, max-abs<=X or none") from None
        opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))
        opsets = {k: int(v) for k, v in model.opset_imports.items()}
        dtypes = cal.infer_dtypes(model)
        _complete_dtypes(model, dtypes, opset, opsets)
        floats = {name for name, t in dtypes.items() if t == _F32}
        compute = [n for n in graph if any(v is not None and v.name in floats for v in (*n.inputs, *n.outputs))]
        if not compute:
            return PassResult(False, {"converted": 0})
        source = open_calibration(self, model)
        stats: dict[str, int | float] = {}
        details: dict[str, Any] = {}
        upgraded = self._upgrade_opset(model, compute, floats, stats, details)
        if upgraded:
            opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))
            opsets = {k: int(v) for k, v in model.opset_imports.items()}
            dtypes = cal.infer_dtypes(model)
            _complete_dtypes(model, dtypes, opset, opsets)
            floats = {name for name, t in dtypes.items() if t == _F32}
            compute = [n for n in graph if any(v is not None and v.name in floats for v in (*n.inputs, *n.outputs))]
        nodes = list(graph)
        where = {id(n): i for i, n in enumerate(nodes)}
        positions = [where[id(n)] for n in compute]
        ops = self.registry.custom_ops if self.registry is not None else None
        support = {p: _half_support(nodes[p], opset, floats, opsets, ops) for p in positions}
        pinned_in = {p: value[1] for p, value in support.items() if value[1]}
        pinned_out = {p: value[2] for p, value in support.items() if value[2]}
        decisions: dict[int, tuple[str, str]] = {}
        keep = set(self.config.get("keep_fp32") or [])
        user = load_plan(self.config["precision_plan"]) if self.config.get("precision_plan") else None
        angles = _position_angles(nodes, floats, dtypes)
        for p in positions:
            n = nodes[p]
            key = node_key(n)
            if user is not None and user.precision_of(key) is not None:
                prec = "fp16" if user.precision_of(key) == "fp16" else "fp32"
                if prec == "fp16" and not support[p][0]:
                    prec = "fp32"
                decisions[p] = (prec, f"user override (plan {self.config['precision_plan']})")
            elif key in keep or n.op_type in keep:
                decisions[p] = ("fp32", "user override (--keep-fp32)")
            elif not support[p][0] and n.domain not in ("", "ai.onnx"):
                decisions[p] = ("fp32", f"default rule: custom domain {n.domain}: no known float16 schema for "
                                        f"{n.op_type}")
            elif not support[p][0]:
                decisions[p] = ("fp32", f"default rule: {n.op_type} has no float16 form at opset {opset}")
            elif n.op_type in _CONTROL_FLOW:
                decisions[p] = ("fp32", "default rule: control flow (its subgraphs stay float32, so do its outputs)")
            elif p in angles:
                decisions[p] = ("fp32", _ANGLE_REASON)
        undecided = [p for p in positions if p not in decisions]
        measured = measure_local(model, [p for p in undecided if nodes[p].inputs], floats, pinned_in, pinned_out,
                                 self._retype_attributes, source, progress=self.progress, total=source.count,
                                 ops=self.registry.custom_ops if self.registry is not None else None,
                                 outputs=max(1, int(self.config.get("fp16_samples") or 16))
                                 if budget is not None else 0)
        stats_by = measured.stats
        limit_abs = float(self.config["fp16_max"])
        limit_red = int(self.config["fp16_reduction_limit"])

        def amax(v: ir.Value | None) -> float:
            if v is None or v.name not in floats:
                return 0.0
            if v.const_value is not None:
                if not v.const_value.size:
                    return 0.0
                peak = float(np.abs(v.const_value.numpy()).max())
                _spill.release_pages(v.const_value)
                return peak
            s = stats_by.get(v.name or "")
            return s.amax if s is not None else 0.0

        norms = normalization_ops(self.registry.foreign_ops if self.registry is not None else None)

        def along_last_axis(n: ir.Node) -> bool:
            return n.op_type in _REDUCTIONS_LAST_AXIS or ("" if n.domain == "ai.onnx" else n.domain, n.op_type) in norms

        def reduced(n: ir.Node) -> int:
            x = stats_by.get(n.inputs[0].name or "") if n.inputs and n.inputs[0] is not None else None
            y = stats_by.get(n.outputs[0].name or "")
            if x is None:
                return 0
            if along_last_axis(n):
                return x.max_reduced
            return x.max_size // max(y.max_size, 1) if y is not None else x.max_size

        candidates: list[int] = []
        for p in undecided:
            n = nodes[p]
            depth = reduced(n) if n.op_type in _REDUCTIONS_BY_SIZE or along_last_axis(n) else 0
            peak = max((amax(v) for v in (*n.inputs, *n.outputs)), default=0.0)
            if p in measured.no_kernel:
                decisions[p] = ("fp32", f"no float16 form in ONNX Runtime (its float16 twin failed: "
                                        f"{measured.no_kernel[p]})")
            elif p in measured.overflow:
                decisions[p] = ("fp32", f"measured overflow: the float16 result is not finite where float32 "
                                        f"reaches |y| = {measured.overflow[p]:.4g}")
            elif peak >= limit_abs and limit_abs < FP16_LIMIT:
                decisions[p] = ("fp32", f"measured sensitivity: |x| reached {peak:.4g} >= {limit_abs:g}")
            elif depth >= limit_red:
                decisions[p] = ("fp32", f"measured sensitivity: reduces {depth} elements >= {limit_red}")
            else:
                candidates.append(p)
        for p in candidates:  # a constant that only feeds float32 inputs stays float32 itself
            n = nodes[p]
            if n.inputs:
                continue
            uses = [u for v in n.outputs for u in v.uses()]
            if uses and all(u.idx in pinned_in.get(where[id(u.node)], ()) or decisions.get(
                    where[id(u.node)], ("fp16",))[0] == "fp32" for u in uses) and not any(
                    v.is_graph_output() for v in n.outputs):
                decisions[p] = ("fp32", "default rule: feeds only inputs that must stay float32")
        attention = _attention_units(nodes) & set(candidates) - set(decisions)
        for p in attention:
            decisions[p] = ("fp16", _ATTENTION_REASON)
        candidates = [p for p in candidates if p not in decisions]
        search = None
        if budget is not None and candidates:
            search = self._budget_search(model, candidates, decisions, floats, pinned_in, pinned_out, stats_by,
                                         measured, source, budget)
            for rank, p in enumerate(search.keep, 1):
                decisions[p] = ("fp32", f"measured sensitivity: local float16 error {measured.error.get(p, 0):.3g} "
                                        f"(rank {rank}); {budget} needs it float32 (all float16: "
                                        f"{budget.metric} {search.tried[0]:.6g})")
        measured.outputs = None  # the float32 outputs kept for the search, not beside the conversion
        for p in candidates:
            if p not in decisions:
                err = measured.error.get(p)
                decisions[p] = ("fp16", "float16" + (f" (local float16 error {err:.3g})" if err is not None else ""))
        amax_by_name = {name: s.amax for name, s in stats_by.items()}
        if self.config.get("fp16_io") and not any(d[0] == "fp16" for d in decisions.values()):
            # nothing runs in float16 (a tree ensemble: no float16 form): the float outputs stay float32, as
            # for a kept node that writes one; --fp16-io was ignored, float32 inputs and outputs written, exit 0
            for v in model.graph.outputs:
                if v.name in floats:
                    raise OptionError(f"{self.name}: output {v.name} stays float32 (no node runs in float16); "
                                      "--fp16-io not possible")
        converted = self._convert(model, {p: d[0] for p, d in decisions.items()}, floats, pinned_in, pinned_out,
                                  amax_by_name)
        plan = PrecisionPlan(self.name)
        plan.meta["calibration"] = calibration_meta(source, measured.samples, None)
        if search is not None and budget is not None:
            plan.meta["accuracy_budget"] = {"budget": str(budget), "measured": search.metric, "met": search.met,
                                            "evaluations": search.evaluations,
                                            "samples": min(int(self.config.get("fp16_samples") or 16),
                                                           measured.samples)}
        for p in positions:
            plan.add(nodes[p], *decisions[p])
        kept = [p for p in positions if decisions[p][0] == "fp32"]
        stats = {
            "converted": sum(1 for p in positions if decisions[p][0] == "fp16"),
            "kept_fp32": len(kept),
            "kept_fp32.overflow": sum(1 for p in kept if "overflow" in decisions[p][1] or "|x| reached"
                                      in decisions[p][1]),
            "kept_fp32.reduction": sum(1 for p in kept if "reduces" in decisions[p][1]),
            "kept_fp32.budget": sum(1 for p in kept if "local float16 error" in decisions[p][1]),
            "kept_fp32.no_float16_form": sum(1 for p in kept if "no float16 form" in decisions[p][1]
                                             or "no known float16 schema" in decisions[p][1]),
            "kept_fp32.control_flow": sum(1 for p in kept if "control flow" in decisions[p][1]),
            "kept_fp32.user": sum(1 for p in kept if decisions[p][1].startswith("user override")),
            "kept_fp32.float32_only_input": sum(len(pinned_in.get(p, ())) for p in positions
                                                if decisions[p][0] == "fp16"),
            "initializers_fp16": converted["initializers"],
            "casts": converted["casts"],
            **stats,
        }
        if attention:  # only where there are any
            stats["fp16.attention_unit"] = len(attention)
        angle_kept = sum(1 for p in kept if decisions[p][1] == _ANGLE_REASON)
        if angle_kept:  # only where there are any (models without run-time position angles report as before)
            stats["kept_fp32.position_angle"] = angle_kept
        if converted.get("outputs_rounded"):  # --fp16-io over an output a float32 node writes
            stats["outputs_rounded_to_fp16"] = converted["outputs_rounded"]
        if search is not None:
            stats["accuracy.metric"] = round(search.metric, 8)
            stats["accuracy.evaluations"] = search.evaluations
        if source.random:
            stats["calibrated_on_random_data"] = 1
        details = {"plan": plan.to_dict(), **details}
        details["kept_fp32"] = [{"node": node_key(nodes[p]), "op": nodes[p].op_type, "reason": decisions[p][1]}
                                for p in kept]
        if search is not None and not search.met and budget is not None:
            # never quiet: nodes kept float32 for a budget they cannot reach cost speed on a GPU
            all_half = search.tried.get(0)
            way_out = (f"a looser budget (--fp16-budget {budget.metric}{'>=' if budget.metric == 'cosine' else '<='}"
                       "...) or --fp16-budget none")
            if search.keep:
                details["note"] = (f"accuracy budget {budget} not met even with every measured node in float32 "
                                   f"({search.metric:.6g})")
                message = (f"accuracy budget {budget} not met even with all {len(search.keep)} measured node(s) "
                           f"kept float32 ({budget.metric}={search.metric:.6g}"
                           f"{f'; all float16: {all_half:.6g}' if all_half is not None else ''}); they stay float32 "
                           f"(slower on a GPU); {way_out} converts them")
            elif max(search.tried) == 0:  # nothing measured to keep
                details["note"] = f"accuracy budget {budget} not met ({search.metric:.6g}); no measured node to keep"
                message = details["note"] + "; check the outputs (--verify)"
            else:
                most = max(search.tried)
                details["note"] = (f"accuracy budget {budget} not met: all float16 gives {search.metric:.6g}, keeping "
                                   f"all {most} measured nodes float32 {search.tried[most]:.6g} (no better): none kept")
                message = (f"accuracy budget {budget} not met: all float16 gives {budget.metric}={search.metric:.6g} "
                           f"and keeping all {most} measured node(s) float32 no better ({search.tried[most]:.6g}), so "
                           "every one is converted; check the outputs (--verify); --keep-fp32 NODE keeps chosen nodes float32")
            logger.warning("%s: %s", self.name, message)
        if source.random:
            from mograph.passes.quant._base import RANDOM_WARNING

            details = {"WARNING": RANDOM_WARNING, **details}
        if self.config.get("precision_plan_out"):
            plan.write(self.config["precision_plan_out"])
        return PassResult(upgraded or stats["converted"] > 0, stats, details)

    def _budget_search(self, model: ir.Model, candidates: list[int], decisions: dict[int, tuple[str, str]],
                       floats: set[str], pinned_in: dict[int, frozenset[int]], pinned_out: dict[int, frozenset[int]],
                       stats_by: dict[str, cal.TensorStats], measured: LocalMeasure, source: cal.CalibrationSource,
                       budget: Budget) -> Search:
        """Keep the fewest candidates float32 (most sensitive first) so the converted model meets ``budget``."""
        samples = list(itertools.islice(iter(source), max(1, int(self.config.get("fp16_samples") or 16))))
        folder = cal.model_folder(model)
        mask = cal.padding_mask_input(model)
        keeps = [cal._kept_positions(f, mask) for f in samples]  # padded positions are not judged
        if measured.outputs is not None and len(measured.outputs) >= len(samples):
            # the float32 model's outputs as the measuring runs computed them (the same nodes on the same
            # tensors: the same numbers as a session of the model), not a second run of the whole model
            refs = measured.outputs[:len(samples)]
        else:
            ref_sess = cal._session(model, folder)  # too big for one protobuf: spilled to a file
            refs = [cal._run_feed(ref_sess, None, f, source, i) for i, f in enumerate(samples)]
            del ref_sess
            _spill.trim_heap()  # its buffers back to the system before the evaluations' copies and sessions
        measured.outputs = None  # held by refs alone, freed with them
        fixed = {p: d[0] for p, d in decisions.items()}
        amax_by_name = {name: s.amax for name, s in stats_by.items()}

        evaluations = 0

        def evaluate(extra: set[int]) -> float:
            nonlocal evaluations
            copy = ir_io.copy_model(model)  # made per evaluation, not held through the search
            chosen = {**fixed, **{p: ("fp32" if p in extra else "fp16") for p in candidates}}
            self._convert(copy, chosen, floats, pinned_in, pinned_out, amax_by_name)
            keep_fp16_rounding(copy)  # ORT's CPU provider would otherwise compute it all in float32
            halves = {v.name for v in copy.graph.inputs if v.dtype == ir.DataType.FLOAT16}
            feeds = [{k: (a.astype(np.float16) if k in halves else a) for k, a in f.items()} for f in samples]
            # written for ONNX Runtime (a file when too big for one protobuf) and freed before its session is
            # made: the copy's float16 weights are not beside the session's
            payload = _spill.payload(copy, folder)
            del copy
            _spill.free_dropped(model)  # not beside the session, nor the next evaluation's copy
            outs = list(cal.run_model(payload, feeds))
            del payload
            evaluations += 1
            if self.progress is not None:  # each one a whole-model run: minutes on a real LLM (issue 31)
                self.progress(evaluations, None)
            return output_metric(budget, refs, outs, keeps)

        ranked = sorted(candidates, key=lambda p: measured.error.get(p, 0.0), reverse=True)
        return fewest_fp32(ranked, evaluate, budget)

    def _upgrade_opset(self, model: ir.Model, compute: list[ir.Node], floats: set[str],
                       stats: dict[str, int | float], details: dict[str, Any]) -> bool:
        """Raise the opset where an op gets its float16 form by it (module docstring); True if raised."""
        from mograph.opset import OpsetUpgradeError, upgrade_opset

        opset = int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1)))
        keep = set(self.config.get("keep_fp32") or [])
        ops = self.registry.custom_ops if self.registry is not None else {}
        needs: dict[str, int] = {}
        generic: dict[str, int] = {}  # declared ops whose function bodies compute float32 below an opset
        for n in compute:
            if n.op_type in keep or node_key(n) in keep:
                continue
            if n.domain not in ("", "ai.onnx"):
                op = ops.get((n.domain, n.op_type)) if n.domain == CUSTOM_DOMAIN else None
                if op is not None and op.float_generic_opset is not None and opset < op.float_generic_opset:
                    generic[f"{n.domain}.{n.op_type}"] = op.float_generic_opset
                continue
            if _half_support(n, opset, floats)[0]:
                continue
            version = _opset_with_half(n, opset, floats)
            if version is not None:
                needs[n.op_type] = version
        if not needs and not generic:
            return False
        target = max((*needs.values(), *generic.values()))
        reasons = []
        if needs:
            reasons.append("float16 forms of " + ", ".join(f"{k} ({v})" for k, v in sorted(needs.items())))
        for version in sorted(set(generic.values())):
            names = ", ".join(sorted(k for k, v in generic.items() if v == version))
            reasons.append(f"float16 function bodies of {names} (CastLike, opset {version}; below it they "
                           "compute float32 and would stay float32)")
        reason = "; ".join(reasons)
        try:
            done = upgrade_opset(model, target, ops=self.registry.custom_ops if self.registry is not None else {})
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

    def _convert(self, model: ir.Model, decisions: dict[int, str], floats: set[str],
                 pinned_in: dict[int, frozenset[int]], pinned_out: dict[int, frozenset[int]],
                 amax: dict[str, float]) -> dict[str, int]:
        """Rewrite ``model`` by ``decisions`` (node position in graph order -> ``fp16``/``fp32``)."""
        graph = model.graph
        nodes = list(graph)
        where = {id(n): i for i, n in enumerate(nodes)}
        half = {p for p, prec in decisions.items() if prec == "fp16"}
        if not half:
            return {"initializers": 0, "casts": 0}
        io16 = bool(self.config.get("fp16_io"))
        counts = {"initializers": 0, "casts": 0}
        taken = {v.name for n in nodes for v in n.outputs if v.name} | set(graph.initializers)
        taken |= {v.name for v in graph.inputs if v.name}

        def wants_half(use: Any) -> bool:  # an onnx_ir Usage (node, idx)
            p = where.get(id(use.node))
            return p in half and use.idx not in pinned_in.get(p, ())

        # where each float value lives: its producer's precision; initializers are stored in the precision
        # their consumers read (a float16 copy beside the float32 one when both read it: no Cast at run time)
        home: dict[int, str] = {}
        values: list[ir.Value] = []
        for v in graph.inputs:
            if v.name in floats:
                home[id(v)] = "fp16" if io16 else "fp32"
                values.append(v)
        for name, v in list(graph.initializers.items()):
            if name not in floats or v.const_value is None:
                if name in floats:
                    home[id(v)] = "fp32"
                    values.append(v)
                continue
            uses = list(v.uses())
            readers16 = [u for u in uses if wants_half(u)]
            if uses and len(readers16) == len(uses) and not v.is_graph_output():
                float_weight = v.const_value
                v.const_value = ir.tensor(to_half(float_weight.numpy()), name=name)
                _spill.release_pages(float_weight)  # the float weights are never all resident at once
                v.dtype = ir.DataType.FLOAT16
                home[id(v)] = "fp16"
                counts["initializers"] += 1
            elif readers16:
                copy_name = fresh_name(taken, f"{name}_fp16")
                copy = ir.Value(name=copy_name, shape=v.shape, type=ir.TensorType(ir.DataType.FLOAT16),
                                const_value=ir.tensor(to_half(v.const_value.numpy()), name=copy_name))
                _spill.release_pages(v.const_value)
                graph.register_initializer(copy)
                for u in readers16:
                    u.node.replace_input_with(u.idx, copy)
                home[id(v)] = "fp32"
                values.append(v)
                counts["initializers"] += 1
            else:
                home[id(v)] = "fp32"
                values.append(v)
        for p, n in enumerate(nodes):
            if p not in decisions:
                continue
            prec = decisions[p]
            for j, v in enumerate(n.outputs):
                if v.name in floats:
                    out_prec = "fp32" if prec == "fp16" and j in pinned_out.get(p, ()) else prec
                    home[id(v)] = out_prec
                    values.append(v)
                    if out_prec == "fp16":
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
                if consumer.metadata_props.get(_CAST_MARK):
                    continue
                want = "fp16" if wants_half(use) else "fp32"
                if want == home.get(id(v)) or consumer.op_type in ("Shape", "Size"):
                    continue
                key = (id(v), want)
                if key not in casts:
                    casts[key] = self._cast(graph, v, want, amax.get(v.name or "", 0.0) >= FP16_LIMIT, first, taken)
                    counts["casts"] += 1
                consumer.replace_input_with(use.idx, casts[key])
        # graph outputs back to float32 unless asked
        for i, v in enumerate(list(graph.outputs)):
            if home.get(id(v)) == "fp16" and not io16:
                out_name = v.name
                v.name = fresh_name(taken, f"{out_name}_fp16")
                cast = ir.node("Cast", [v], {"to": _F32}, name=fresh_name(taken, f"{out_name}_to_fp32"))
                cast.metadata_props[_CAST_MARK] = "1"
                cast.outputs[0].name = out_name
                cast.outputs[0].dtype = ir.DataType.FLOAT
                cast.outputs[0].shape = v.shape
                graph.append(cast)
                graph.outputs[i] = cast.outputs[0]
                counts["casts"] += 1
            elif home.get(id(v)) == "fp32" and io16 and v.name in floats:
                # a kept node writes this output (an LM head whose logits miss the budget in float16): it still
                # computes in float32, and the boundary rounds its result to float16 as --fp16-io asks (one
                # rounding, saturated to +-65504 where the calibration saw more); graph inputs already are
                out_name = v.name
                v.name = fresh_name(taken, f"{out_name}_fp32")
                half_out = self._cast(graph, v, "fp16", amax.get(out_name, 0.0) >= FP16_LIMIT, first, taken)
                half_out.name = out_name
                graph.outputs[i] = half_out
                counts["casts"] += 1
                counts["outputs_rounded"] = counts.get("outputs_rounded", 0) + 1
        return counts

    @staticmethod
    def _cast(graph: ir.Graph, v: ir.Value, want: str, saturate: bool, first: ir.Node, taken: set[str]) -> ir.Value:
        """Insert ``Cast(v)`` to ``want`` after ``v``'s producer; saturate to the float16 range when asked."""
        to = ir.DataType.FLOAT16 if want == "fp16" else ir.DataType.FLOAT
        src = v
        made: list[ir.Node] = []
        opset = int(graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 1)))
        if want == "fp16" and saturate and opset < CLIP_INPUTS_OPSET:  # the bounds are attributes
            clip = ir.node("Clip", [v], {"min": -FP16_LIMIT, "max": FP16_LIMIT}, name=fresh_name(taken, f"{v.name}_saturate"))
            clip.outputs[0].name = fresh_name(taken, clip.name or "c")
            clip.outputs[0].dtype = ir.DataType.FLOAT
            clip.metadata_props[_CAST_MARK] = "1"
            made.append(clip)
            src = clip.outputs[0]
        elif want == "fp16" and saturate:  # float32 values beyond +-65504 would become infinite
            lo = ir.node("Constant", [], {"value": ir.tensor(np.array(-FP16_LIMIT, np.float32))},
                         name=fresh_name(taken, f"{v.name}_fp16_lo"))
            hi = ir.node("Constant", [], {"value": ir.tensor(np.array(FP16_LIMIT, np.float32))},
                         name=fresh_name(taken, f"{v.name}_fp16_hi"))
            clip = ir.node("Clip", [v, lo.outputs[0], hi.outputs[0]], name=fresh_name(taken, f"{v.name}_saturate"))
            for node in (lo, hi, clip):
                node.outputs[0].name = fresh_name(taken, node.name or "c")
                node.outputs[0].dtype = ir.DataType.FLOAT
                node.metadata_props[_CAST_MARK] = "1"
            made += [lo, hi, clip]
            src = clip.outputs[0]
        cast = ir.node("Cast", [src], {"to": to.value}, name=fresh_name(taken, f"{v.name}_to_{want}"))
        cast.metadata_props[_CAST_MARK] = "1"
        cast.outputs[0].name = fresh_name(taken, f"{v.name}_{want}")
        cast.outputs[0].dtype = to
        cast.outputs[0].shape = v.shape
        made.append(cast)
        producer = v.producer()
        if producer is not None:
            graph.insert_after(producer, made)
        else:
            graph.insert_before(first, made)
        return cast.outputs[0]

    @staticmethod
    def _retype_attributes(n: ir.Node) -> None:
        dtype = n.attributes.get("dtype")  # EyeLike, RandomNormal(Like), RandomUniform(Like), Bernoulli
        if dtype is not None and dtype.type == ir.AttributeType.INT and dtype.as_int() == _F32:
            n.attributes["dtype"] = ir.AttrInt64("dtype", _F16)
        if n.op_type == "Cast":
            to = n.attributes.get("to")
            if to is not None and to.as_int() == _F32:
                n.attributes["to"] = ir.AttrInt64("to", _F16)
        elif n.op_type in ("Constant", "ConstantOfShape"):
            if n.op_type == "ConstantOfShape" and "value" not in n.attributes:
                # no value: float32 zeros by default, so the float16 node writes them explicitly (its output,
                # typed float16, was float32 at run time: ONNX Runtime refused the measuring twin, an internal
                # error on torchvision's Swin V2 via the dynamo exporter)
                n.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.zeros(1, np.float16)))
            for key in ("value",):
                a = n.attributes.get(key)
                if a is not None and isinstance(a.value, ir.TensorProtocol) and a.value.dtype == ir.DataType.FLOAT:
                    n.attributes[key] = ir.AttrTensor(key, ir.tensor(to_half(a.value.numpy())))
            for key in ("value_float", "value_floats"):
                a = n.attributes.get(key)
                if a is not None:
                    arr = to_half(np.array(a.value, dtype=np.float32))
                    del n.attributes[key]
                    n.attributes["value"] = ir.AttrTensor("value", ir.tensor(arr))
