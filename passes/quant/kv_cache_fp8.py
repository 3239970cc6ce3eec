"""``kv-cache-fp8``: FP8 (E4M3) Q/DQ on the KV-cache inputs and outputs of a decoder exported with past/present.

A decoder exported for decoding takes the cache of earlier steps as graph inputs (``past_key_i``,
``past_value_i``, ``[batch, kv_heads, past, head_dim]``) and returns it grown by the new step as graph
outputs (``present_key_i`` = ``Concat(past_key_i, new_keys, axis=2)``).  Between two steps the cache lives
in memory, and for long contexts it is most of the memory a decoder uses; holding it in FP8 E4M3
(``float8e4m3fn``, largest finite 448, 3 mantissa bits) halves it against FP16 and quarters it against FP32.

**What counts as a cache.**  A pair ``(past, present)`` is recognized by name *and* by structure:

- names: the input's name contains ``past`` and the output's ``present`` (case-insensitive);
- structure, one of
  - the exported form: the past (through ``Identity`` or one-input ``Concat`` only) is input 0 of a
    two-input ``Concat`` on the sequence axis (2 or -2 of 4) whose result (again through those) is the
    present graph output;
  - the fused form: the past is the ``past_key``/``past_value`` input of ONNX Runtime's
    ``com.microsoft.MultiHeadAttention`` (inputs 6/7, outputs 1/2) or ``GroupQueryAttention`` (inputs 3/4,
    outputs 1/2) or of a ``mograph`` attention op whose schema names ``past_key``/``past_value`` inputs
    and ``present_key``/``present_value`` outputs, and the matching output is the present.

A model with neither is refused in one line (:class:`~mograph.errors.PassFailedError`, exit 4) that
says what was looked for and, for each ``past*`` input, why it was not taken.

**Scales.**  One scale per (layer, K/V), that is per pair: per KV head (``--kv-cache-scale head``, the
default; a 1-D scale on axis 1) or per tensor (``tensor``), ``amax / 448`` with ``amax`` the largest
magnitude of the present over all calibration decode steps (the present holds the past too).  A head that
was never non-zero gets scale 1.  ``QuantizeLinear`` saturates (``saturate=1``): values beyond the
calibrated range become +-448 times the scale, never NaN.

**Two modes** (``--kv-cache-io``):

- ``float`` (simulated, the default): the graph's inputs and outputs keep their float type;
  ``QuantizeLinear -> DequantizeLinear`` follows each past input and precedes each present output.  Any
  runtime with FP8 Q/DQ (ONNX Runtime CPU does, opset 19) runs it; ``--verify`` works; it measures the
  accuracy an FP8 cache costs.  A past fed back from the previous step's present is already on the FP8 grid
  of the same scale, so its second quantization is exact.
- ``fp8`` (stored): past inputs become ``float8e4m3fn`` graph inputs followed by a ``DequantizeLinear``;
  present outputs are the ``QuantizeLinear`` of the grown cache, ``float8e4m3fn``.  The caller keeps the
  cache in FP8 between steps (from Python, ``onnxruntime.OrtValue.ortvalue_from_numpy_with_onnx_type``
  feeds FP8 bytes).  The scales are written into the model metadata (``mograph.kv_cache``, JSON) and the
  precision plan.

Placement is on the graph I/O side of the cache only: the ``DequantizeLinear`` output replaces the past
wherever it was read (the ``Concat``, a ``Shape``, the attention op) with the same dtype and shape, and the
present's Q/DQ follows the ``Concat`` (or the attention op's present output), so the attention fusions
match the same structure before and after this pass, and it can run before ``fuse`` or after it.

**Output check.**  As ``int4`` and ``qdq-fp8`` do by default (:mod:`mograph.passes.quant._output_check`), the
written model is run once against the float one on the first 4 calibration feeds (each holds a past: the cache
inputs are graph inputs; ``--calibration-random`` sizes it 1 unless ``--shape`` says otherwise), stored mode
fed and read back through the recorded scales; the smallest per-output cosine goes into
``details["output_check"]``, a warning and ``output_check.below_floor`` below 0.8; ``--accuracy-budget off``
skips it, and a model over 1 GiB of weights is not run.

Needs opset 19 (FP8 ``QuantizeLinear``); an older model's opset is raised with ``onnx.version_converter``
first (recorded in the stats).  A pass run twice changes nothing: pasts already read through a
``QuantizeLinear``/``DequantizeLinear`` are counted as done.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import calibration as cal
from mograph.passes.quant._base import (
    BUDGET_OPTION,
    CALIBRATION_OPTIONS,
    NO_BUDGET,
    PLAN_OPTIONS,
    RANDOM_WARNING,
    open_calibration,
    parse_shapes,
)
from mograph.passes.quant._output_check import CHECK_SAMPLES, OutputCheck
from mograph.passes.quant.plan import PrecisionPlan

from mograph.custom_ops import CustomOp
from mograph.errors import ModelError, PassFailedError
from mograph.foreign_ops import ForeignOp, foreign_ops
from mograph.metadata import KV_CACHE_KEY, read_kv_cache
from mograph.pass_infra import Option, Pass, PassResult, stamp

__all__ = ["KvCacheFp8Pass", "KV_CACHE_KEY", "CachePair", "find_cache_pairs", "read_kv_cache_metadata"]

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_PASS_THROUGH = ("Identity",)

KV_OPTIONS = (
    Option(
        "kv-cache-io",
        str,
        "float",
        "'float' keeps the cache inputs/outputs float with Q/DQ inside (simulated, any runtime); "
        "'fp8' makes past inputs and present outputs float8e4m3fn (stored: cache memory halved vs fp16)",
        choices=("float", "fp8"),
    ),
    Option(
        "kv-cache-scale",
        str,
        "head",
        "one FP8 scale per KV head ('head') or per cache tensor ('tensor'), from calibration amax",
        choices=("head", "tensor"),
    ),
    BUDGET_OPTION,  # no layer to keep float: any value but off runs the output check
)


@dataclass
class CachePair:
    """One cache tensor: the past graph input, the present graph output, and what joins them."""

    past: ir.Value
    present: ir.Value
    #: the value the present is computed as (``Concat`` output or attention present output)
    grown: ir.Value
    via: str  # "concat" or the fused op's "domain.op"
    node: ir.Node  # the Concat or attention node
    kind: str  # "key", "value" or "kv"
    layer: int | None
    scale: np.ndarray | None = field(default=None)


def _names_match(past: str, present: str) -> bool:
    return "past" in past.lower() and "present" in present.lower()


def _kind(name: str) -> str:
    low = name.lower()
    if "key" in low or re.search(r"(^|[._])k($|[._])", low):
        return "key"
    if "value" in low or re.search(r"(^|[._])v($|[._])", low):
        return "value"
    return "kv"


def _layer(name: str) -> int | None:
    digits = re.findall(r"\d+", name)
    return int(digits[-1]) if digits else None


def _through(value: ir.Value) -> ir.Value:
    """``value`` followed forward through single-reader ``Identity`` / one-input ``Concat`` nodes."""
    for _ in range(8):
        uses = list(value.uses())
        if len(uses) != 1:
            return value
        node = uses[0].node
        one_concat = node.op_type == "Concat" and len(node.inputs) == 1
        if node.domain not in ("", "ai.onnx") or not (node.op_type in _PASS_THROUGH or one_concat):
            return value
        value = node.outputs[0]
    return value


def _back(value: ir.Value) -> ir.Value:
    """``value`` followed backward through ``Identity`` / one-input ``Concat`` producers."""
    for _ in range(8):
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
            return value
        if not (node.op_type in _PASS_THROUGH or (node.op_type == "Concat" and len(node.inputs) == 1)):
            return value
        value = node.inputs[0]
    return value


def _fused_index(node: ir.Node, ops: Mapping[tuple[str, str], CustomOp],
                 foreign: Mapping[tuple[str, str], ForeignOp]) -> dict[int, int] | None:
    """{past input index: present output index} of an op that carries a KV cache (its declaration says)."""
    record = foreign.get((node.domain, node.op_type))
    if record is not None and record.cache:
        return dict(record.cache)
    if node.domain != "mograph":
        return None
    op = ops.get((node.domain, node.op_type))  # a mograph op naming its cache I/O (none known without a registry)
    if op is None:
        return None
    ins, outs = [str(n) for n in op.inputs], [str(n) for n in op.outputs]
    pairs = {}
    for role in ("key", "value"):
        if f"past_{role}" in ins and f"present_{role}" in outs:
            pairs[ins.index(f"past_{role}")] = outs.index(f"present_{role}")
    return pairs or None


def _already_done(past: ir.Value) -> bool:
    uses = list(past.uses())
    if past.dtype == ir.DataType.FLOAT8E4M3FN:
        return bool(uses) and all(u.node.op_type == "DequantizeLinear" for u in uses)
    return len(uses) == 1 and uses[0].node.op_type == "QuantizeLinear"


def _pair_for(past: ir.Value, outputs: set[int], ops: Mapping[tuple[str, str], CustomOp],
              foreign: Mapping[tuple[str, str], ForeignOp]) -> CachePair | str:
    """The cache pair that starts at graph input ``past``, or why there is none."""
    start = _through(past)
    reasons = []
    for use in start.uses():
        node, idx = use.node, use.idx
        fused = _fused_index(node, ops, foreign)
        if fused is not None:
            if idx not in fused:
                reasons.append(f"read by {node.op_type} '{node.name}' input {idx}, not its past input")
                continue
            if fused[idx] >= len(node.outputs):
                reasons.append(f"{node.op_type} '{node.name}' has no present output")
                continue
            grown = node.outputs[fused[idx]]
            present = _through(grown)
            if id(present) not in outputs:
                reasons.append(f"{node.op_type} '{node.name}' present output is not a graph output")
                continue
            via = f"{node.domain}.{node.op_type}"
        elif node.op_type == "Concat" and node.domain in ("", "ai.onnx"):
            axis = node.attributes.get("axis")
            ax = axis.as_int() if axis is not None else None
            rank = len(past.shape) if past.shape is not None else None
            if rank != 4 or ax not in (2, -2) or len(node.inputs) != 2 or idx != 0:
                reasons.append(f"Concat '{node.name}' is not (past, new) on the sequence axis of a 4-D cache")
                continue
            grown = node.outputs[0]
            present = _through(grown)
            if id(present) not in outputs:
                reasons.append(f"the Concat '{node.name}' result is not a graph output")
                continue
            via = "concat"
        else:
            continue
        if not _names_match(past.name or "", present.name or ""):
            reasons.append(f"structure fits but '{past.name}' -> '{present.name}' are not named past*/present*")
            continue
        return CachePair(past, present, grown, via, node, _kind(past.name or ""), _layer(past.name or ""))
    return "; ".join(reasons) or "not Concat-ed with new K/V into a graph output nor read as an attention op's past"


def find_cache_pairs(model: ir.Model, ops: Mapping[tuple[str, str], CustomOp],
                     foreign: Mapping[tuple[str, str], ForeignOp] | None = None,
                     ) -> tuple[list[CachePair], list[ir.Value], dict[str, str]]:
    """The KV-cache pairs of ``model``'s main graph, the pasts already quantized, and why others were not taken.

    ``ops``: the declared custom ops (the registry's), whose ``past_*``/``present_*`` inputs and outputs
    say where a fused attention op reads and writes its cache; a ``mograph`` op not among them is not
    recognized as a cache reader.  ``foreign``: the records of ops mograph does not own (the registry's;
    default: the built-in ones), whose ``cache`` says the same for ONNX Runtime's attention ops."""
    foreign = foreign_ops(foreign)
    outputs = {id(v) for v in model.graph.outputs}
    pairs: list[CachePair] = []
    done: list[ir.Value] = []
    missed: dict[str, str] = {}
    for v in model.graph.inputs:
        if "past" in (v.name or "").lower() and _already_done(v):
            done.append(v)
            continue
        if v.dtype not in _FLOATS:
            continue
        found = _pair_for(v, outputs, ops, foreign)
        if isinstance(found, CachePair):
            pairs.append(found)
        elif "past" in (v.name or "").lower():
            missed[v.name or "?"] = found
    return pairs, done, missed


#: the record this pass writes (:func:`mograph.metadata.read_kv_cache`)
read_kv_cache_metadata = read_kv_cache


def _amax(model: ir.Model, pairs: list[CachePair], source: cal.CalibrationSource, per_head: bool,
          progress: Any) -> tuple[list[np.ndarray], int]:
    """Largest magnitude of each pair's grown cache (per KV head, axis 1, or per tensor) over all samples."""
    names = [p.grown.name or "" for p in pairs]
    data, mapping = cal._with_outputs_mapped(model, names)  # noqa: SLF001 - same package
    sess = cal._session(data, cal.model_folder(model))  # noqa: SLF001
    amax: list[np.ndarray | None] = [None] * len(pairs)
    seen = 0
    total = source.count
    for feed in source:
        outs = cal._run_feed(sess, [mapping[n] for n in names], feed, source, seen)  # noqa: SLF001
        for i, arr in enumerate(outs):
            a = np.abs(np.nan_to_num(np.asarray(arr, np.float32), nan=0.0, posinf=0.0, neginf=0.0))
            if a.size == 0:
                continue
            m = a.max(axis=(0, 2, 3)) if per_head and a.ndim == 4 else np.array(a.max() if a.size else 0.0)
            prev = amax[i]
            amax[i] = m if prev is None else np.maximum(prev, m)
        seen += 1
        if progress is not None:
            progress(seen, total)
    if seen == 0:
        raise PassFailedError("kv-cache-fp8", f"calibration data {source.description} yielded no samples")
    return [np.asarray(0.0 if a is None else a, np.float32) for a in amax], seen


def _past_length(feed: cal.Feed, pairs: list[CachePair]) -> int:
    """The longest past (sequence axis 2) among the cache inputs of ``feed``."""
    lengths = [np.shape(feed[p.past.name])[2] for p in pairs
               if p.past.name in feed and np.ndim(feed[p.past.name]) == 4]
    return int(max(lengths, default=0))


def _run_stored(model: ir.Model, feeds: list[cal.Feed]) -> list[list[np.ndarray]]:
    """Run the stored-mode ``model`` on float ``feeds``: FP8 past inputs quantized with the scales its metadata
    records (saturated, as ``QuantizeLinear`` does), FP8 presents read back as the values they stand for."""
    import ctypes

    import ml_dtypes
    import onnx

    from mograph.metadata import kv_cache_scales

    ort = cal._require_ort()  # noqa: SLF001 - same package
    fp8_type = "tensor(float8e4m3fn)"
    scales = kv_cache_scales(model)
    session = cal._session(model, cal.model_folder(model))  # noqa: SLF001
    in_types = {i.name: i.type for i in session.get_inputs()}
    outputs = [(o.name, o.type) for o in session.get_outputs()]
    results = []
    for feed in feeds:
        values = {}
        for name, arr in feed.items():
            if in_types.get(name) == fp8_type and name in scales:
                q = np.clip(np.asarray(arr, np.float32) / scales[name], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
                values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(q).view(np.uint8), onnx.TensorProto.FLOAT8E4M3FN)
            else:
                values[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr))
        row = []
        for (name, kind), value in zip(outputs, session.run_with_ort_values([n for n, _ in outputs], values)):
            if kind == fp8_type and name in scales:
                raw = ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes())
                fp8 = np.frombuffer(raw, np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(value.shape())
                row.append(fp8.astype(np.float32) * scales[name])
            else:
                row.append(value.numpy())
        results.append(row)
    del session
    return results


class KvCacheFp8Pass(Pass):
    """FP8 E4M3 Q/DQ on a decoder's KV-cache inputs/outputs (past_*/present_*), simulated or stored in FP8."""

    name = "kv-cache-fp8"
    family = "quant"
    options = (*CALIBRATION_OPTIONS, *KV_OPTIONS, PLAN_OPTIONS[1])

    def call(self, model: ir.Model) -> PassResult:
        ops = self.registry.custom_ops if self.registry is not None else {}
        foreign = self.registry.foreign_ops if self.registry is not None else None
        pairs, done, missed = find_cache_pairs(model, ops, foreign)
        stats: dict[str, int | float] = {"cache_tensors": 0, "skipped_already_quantized": len(done)}
        if not pairs:
            if done:
                return PassResult(False, stats, {"already_quantized": [v.name for v in done]})
            why = "; ".join(f"{k}: {v}" for k, v in list(missed.items())[:3])
            raise PassFailedError(self.name, "no recognizable KV cache (graph inputs past* Concat-ed with the new "
                                  "K/V on the sequence axis into present* graph outputs, or read as an attention "
                                  "op's past)" + (f"; {why}" if why else ""))
        details: dict[str, Any] = {}
        source = open_calibration(self, model)  # refuses before anything changes
        check = None
        if str(self.config.get("accuracy_budget") or "auto").strip().lower() not in NO_BUDGET:
            check = OutputCheck.start(self.name, model, source, samples=CHECK_SAMPLES,
                                      shapes=parse_shapes(self.config.get("shape")))
        upgraded = self._ensure_opset(model, stats, details)
        if upgraded:
            pairs, done, _ = find_cache_pairs(model, ops, foreign)
        per_head = self.config.get("kv_cache_scale", "head") == "head"
        stored = self.config.get("kv_cache_io", "float") == "fp8"
        amaxes, samples = _amax(model, pairs, source, per_head, getattr(self, "progress", None))
        plan = PrecisionPlan(self.name, meta={"scheme": "fp8 e4m3fn (saturating)", "kv_cache_io": "fp8" if stored
                                              else "float (simulated)", "kv_cache_scale": "per head" if per_head
                                              else "per tensor"})
        record: dict[str, Any] = {"dtype": "float8e4m3fn", "io": "fp8" if stored else "float",
                                  "granularity": "head" if per_head else "tensor", "calibration_samples": samples,
                                  "tensors": {}}
        for pair, amax in zip(pairs, amaxes):
            scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
            pair.scale = scale
            present_name = pair.present.name
            self._rewrite(model, pair, scale, stored)
            stats["cache_tensors"] += 1
            stats[f"cache_tensors.{pair.kind}"] = stats.get(f"cache_tensors.{pair.kind}", 0) + 1
            entry = {"present": present_name, "layer": pair.layer, "kind": pair.kind, "via": pair.via,
                     "axis": 1 if scale.ndim == 1 else None, "scale": [float(s) for s in np.ravel(scale)],
                     "amax": [float(a) for a in np.ravel(amax)]}
            record["tensors"][pair.past.name] = entry
            plan.add(pair.node, "fp8", f"KV cache {pair.kind} of layer {pair.layer} ({pair.past.name} -> "
                     f"{present_name}): scale{' per head' if per_head else ''} amax/448 over {samples} "
                     "calibration step(s)")
        stats["q_nodes"] = stats["dq_nodes"] = 2 * stats["cache_tensors"] if not stored else stats["cache_tensors"]
        stats["calibration_samples"] = samples
        if source.random:
            stats["calibrated_on_random_data"] = 1
            details["WARNING"] = RANDOM_WARNING
        plan.meta["calibration"] = {"source": source.description, "samples": samples}
        plan.meta["kv_cache"] = record
        model.metadata_props[KV_CACHE_KEY] = json.dumps(record, sort_keys=True)
        details["plan"] = plan.to_dict()
        if missed:
            details["not_cache"] = missed
        if check is not None:
            if stored:  # FP8 graph I/O: fed and read back through the recorded scales, as --verify does
                check.run_quantized(lambda feeds: _run_stored(model, feeds), "the written model (FP8 cache I/O "
                                    "quantized and read back with the recorded scales)")
            check.finish(model, stats, details)
            if check.samples and not any(_past_length(f, pairs) for f in check.samples):
                details["output_check"]["note"] = ("every checked feed has an empty past: the figure covers the "
                                                   "presents only, not reading a quantized past")
        out = self.config.get("precision_plan_out")
        if out:
            plan.write(out)
        return PassResult(True, stats, details)

    def _ensure_opset(self, model: ir.Model, stats: dict[str, int | float], details: dict[str, Any]) -> bool:
        from mograph.opset import OpsetUpgradeError, model_opset, upgrade_opset

        old = model_opset(model)
        if old >= 19:
            return False
        try:
            done = upgrade_opset(model, 19, ops=self.registry.custom_ops if self.registry is not None else {})
        except OpsetUpgradeError as exc:
            raise ModelError(f"{self.name}: needs opset >= 19 for FP8 QuantizeLinear; the model's opset cannot "
                             f"be upgraded from {old}: {exc}") from exc
        stats["opset_upgrade.from"] = done.from_opset
        stats["opset_upgrade.to"] = done.to_opset
        stats["opset_upgrade.rewritten"] = sum(done.rewritten.values())
        details["opset_upgrade"] = {"from": done.from_opset, "to": done.to_opset, "rewritten": dict(done.rewritten)}
        return True

    def _rewrite(self, model: ir.Model, pair: CachePair, scale: np.ndarray, stored: bool) -> None:
        graph = model.graph
        past, present = pair.past, pair.present
        float_type = past.dtype
        assert float_type is not None
        np_float = float_type.numpy()
        base = (past.name or "past").replace("/", "_")
        sc = ir.Value(name=f"{base}.fp8_scale", const_value=ir.Tensor(scale.astype(np_float), name=f"{base}.fp8_scale"))
        import ml_dtypes

        zp_arr = np.zeros(scale.shape, ml_dtypes.float8_e4m3fn)
        zp = ir.Value(name=f"{base}.fp8_zero", const_value=ir.Tensor(zp_arr, dtype=ir.DataType.FLOAT8E4M3FN,
                                                                      name=f"{base}.fp8_zero"))
        graph.register_initializer(sc)
        graph.register_initializer(zp)
        axis = {"axis": 1} if scale.ndim == 1 else {}
        readers = list(past.uses())
        fp8 = ir.DataType.FLOAT8E4M3FN
        if stored:
            past.dtype = fp8
            src = past
        else:
            q_in = ir.node("QuantizeLinear", [past, sc, zp], attributes={"saturate": 1, **axis}, name=f"{base}.kv_q")
            q_in.outputs[0].name, q_in.outputs[0].dtype, q_in.outputs[0].shape = f"{base}.fp8", fp8, past.shape
            self._add(graph, q_in, None, "past")
            src = q_in.outputs[0]
        dq_in = ir.node("DequantizeLinear", [src, sc, zp], attributes=axis, name=f"{base}.kv_dq")
        dq_in.outputs[0].name, dq_in.outputs[0].dtype, dq_in.outputs[0].shape = f"{base}.dq", float_type, past.shape
        self._add(graph, dq_in, q_in if not stored else None, "past")
        for use in readers:
            use.node.replace_input_with(use.idx, dq_in.outputs[0])
        # the present: Q (and DQ when simulated) after the value the present is computed as
        out_index = next(i for i, v in enumerate(graph.outputs) if v is present)
        out_name = present.name
        present.name = f"{out_name}.float"
        q_out = ir.node("QuantizeLinear", [present, sc, zp], attributes={"saturate": 1, **axis},
                        name=f"{base}.kv_present_q")
        q_out.outputs[0].dtype, q_out.outputs[0].shape = fp8, present.shape
        self._add(graph, q_out, present.producer(), "present")
        final = q_out.outputs[0]
        if not stored:
            q_out.outputs[0].name = f"{out_name}.fp8"
            dq_out = ir.node("DequantizeLinear", [final, sc, zp], attributes=axis, name=f"{base}.kv_present_dq")
            dq_out.outputs[0].dtype, dq_out.outputs[0].shape = float_type, present.shape
            self._add(graph, dq_out, q_out, "present")
            final = dq_out.outputs[0]
        final.name = out_name
        graph.outputs[out_index] = final

    def _add(self, graph: ir.Graph, node: ir.Node, after: ir.Node | None, rule: str) -> None:
        """Put ``node`` right after ``after`` (at the start of the graph when ``None``), stamped."""
        stamp(node, self.name, rule)
        first = next(iter(graph), None)
        if after is not None:
            graph.insert_after(after, node)
        elif first is not None:
            graph.insert_before(first, node)
        else:
            graph.append(node)
