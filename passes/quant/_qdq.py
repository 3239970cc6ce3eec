"""Where Q/DQ goes, the default precision rules, and the writer that inserts QuantizeLinear/DequantizeLinear.

Placement follows what the backends fuse:

- **activations** are quantized per tensor, once per tensor: one ``QuantizeLinear → DequantizeLinear``
  pair right after the producer, whose output feeds every quantized consumer (Q, K and V projections of
  one hidden state share it).  ONNX Runtime duplicates a shared DQ for each node group it fuses, and
  TensorRT propagates a shared pair, so sharing costs neither backend a fusion.
- **weights** become an integer (or FP8) initializer followed by a ``DequantizeLinear``; INT8 weights are
  symmetric (zero point 0, range ``[-127, 127]``) with one scale per output channel (MatMul ``[K, N]``:
  axis 1; Gemm: axis 0 with ``transB=1``, else 1; Conv ``[M, C, kh, kw]``: axis 0).
- **bias** of Conv and Gemm becomes INT32 with scale ``input_scale * weight_scale[c]``, as ONNX Runtime's
  ``QLinearConv``/``QGemm`` fusions require, unless a bias value does not fit INT32 at that scale (an
  input calibrated constant, e.g. all zeros, has a scale near 0): clipped, it would be lost, so that
  bias stays float.
- **Conv and Gemm outputs** get their own pair as well: ONNX Runtime forms ``QLinearConv``/``QGemm`` only from
  ``DQ → Conv → Q`` (``DQ → Gemm → Q``); MatMul needs no output pair (``DQ → MatMul`` becomes
  ``MatMulIntegerToFloat``).

Nothing is put inside the nodes a backend fuses with a MatMul (bias Add, GELU, LayerNorm): only the
MatMul/Gemm/Conv inputs are touched.

Default rules (each recorded as a plan reason; ``qdq-int8`` measures instead by default and uses them with
``--accuracy-budget off``, ``qdq-fp8`` uses them unless given a budget): weight MatMul/Gemm/Conv are quantized; a MatMul of two
activations (attention scores and context) stays in float — its inputs are the softmax output and the
query/key/value tensors, whose quantization costs accuracy for little speed; the final projection (a
candidate with no other candidate downstream) stays in float; normalization and softmax are never
quantized and are listed in the plan as such.  Embedding tables are weights: ``qdq-int8`` stores them as
INT8 (:func:`quantize_embeddings`, ``--embeddings float`` to keep them) and the Gather's rows are
dequantized after the lookup; passes that do not (``qdq-fp8``) list the lookups as float.  Nodes whose inputs already come from a
``DequantizeLinear`` are skipped, so running a pass twice changes nothing.

Weights may be initializers or ``Constant`` nodes, and candidates may sit inside subgraphs (``If``
branches): what the writer adds goes into the graph that defines the value it follows, so a branch's
weights stay in the branch.  On float16 (bfloat16) models the scales have the model's float type, as
``QuantizeLinear``/``DequantizeLinear`` 19 require (the Q/DQ passes raise the opset to 19 for that), and
Conv/Gemm biases stay float (an INT32 bias scale ``act_scale * weight_scale`` underflows float16).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant.plan import node_key

from mograph import _spill
from mograph.foreign_ops import ForeignOp, normalization_ops
from mograph.irutil import fresh_name

logger = logging.getLogger(__name__)

__all__ = [
    "Candidate",
    "Scheme",
    "INT8_U8",
    "INT8_S8",
    "FP8_E4M3",
    "find_candidates",
    "sensitive_nodes",
    "default_precision",
    "QdqWriter",
    "tensors_to_observe",
    "activation_params",
    "fake_quant_activation",
    "fake_quant_weight",
    "quantize_weight_array",
    "scale_numpy_type",
    "const_tensor",
]

QUANT_OPS = ("MatMul", "Gemm", "Conv")
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, None)
#: Standard normalizations over a channel or group axis; those over the last axes (``LayerNormalization``,
#: ``RMSNormalization``, ONNX Runtime's) are the foreign-op records that say ``normalizes``.
_CHANNEL_NORMS = frozenset({"BatchNormalization", "InstanceNormalization", "GroupNormalization"})


@dataclass
class Candidate:
    """One node Q/DQ may be put in front of."""

    node: ir.Node
    key: str
    act_inputs: tuple[int, ...]
    weight_input: int | None
    weight_axis: int | None
    bias_input: int | None
    quantize_output: bool

    @property
    def has_weight(self) -> bool:
        return self.weight_input is not None


@dataclass(frozen=True)
class Scheme:
    """How values are quantized: element types, symmetric or not, per-channel weights or not."""

    name: str
    act_dtype: Any  # numpy dtype of quantized activations
    weight_dtype: Any
    act_symmetric: bool
    per_channel: bool
    qmax: float  # largest magnitude of the weight / symmetric activation range
    is_float: bool = False

    @property
    def precision(self) -> str:
        return "fp8" if self.is_float else "int8"


INT8_U8 = Scheme("int8 (uint8 activations)", np.uint8, np.int8, False, True, 127.0)
INT8_S8 = Scheme("int8 (int8 activations)", np.int8, np.int8, True, True, 127.0)


def _fp8() -> Any:
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


FP8_E4M3 = Scheme("fp8 e4m3fn", "float8_e4m3fn", "float8_e4m3fn", True, False, 448.0, is_float=True)


def const_tensor(v: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of an initializer or of a ``Constant`` node's ``value``, else ``None``."""
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value
    producer = v.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.as_tensor()
    return None


def _is_const(v: ir.Value | None) -> bool:
    return const_tensor(v) is not None


def _from_dq(v: ir.Value | None) -> bool:
    if v is None:
        return False
    producer = v.producer()
    return producer is not None and producer.op_type == "DequantizeLinear"


def _is_float(v: ir.Value | None) -> bool:
    return v is not None and v.dtype in _FLOATS


def _all_nodes(model: ir.Model) -> list[ir.Node]:
    return [node for graph in model.graphs() for node in graph]


def _inferred_dtypes(model: ir.Model) -> dict[str, int]:
    """Element type of every named value, by ONNX shape inference on a copy without the weights' data."""
    import onnx

    proto = _spill.shape_proto(model)  # types and shapes only: nothing of a large model is copied
    try:
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:  # noqa: BLE001 - best effort: an unknown type stays unknown (taken as float)
        logger.debug("shape inference failed: %s", exc)
    out: dict[str, int] = {}
    graphs = [proto.graph]
    while graphs:
        g = graphs.pop()
        for vi in [*g.input, *g.value_info, *g.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                out[vi.name] = vi.type.tensor_type.elem_type
        for n in g.node:
            for attr in n.attribute:
                graphs.extend([attr.g] if attr.HasField("g") else [])
                graphs.extend(attr.graphs)
    return out


def find_candidates(model: ir.Model, ops: tuple[str, ...] = QUANT_OPS) -> tuple[list[Candidate], list[ir.Node]]:
    """Nodes Q/DQ can go in front of, in the graph and its subgraphs, and those already quantized (skipped).

    A weight is an initializer or the output of a ``Constant`` node.
    """
    cands: list[Candidate] = []
    done: list[ir.Node] = []
    inferred: dict[str, int] = {}

    def operands_float(a: ir.Value | None, b: ir.Value | None) -> bool:
        """Whether the two operands (one element type ``T`` in MatMul, Gemm and Conv) are float32/16.

        A known type decides; when neither operand has one (a computed weight of a model without
        ``value_info``: skl2onnx's float64 Gaussian process), ONNX shape inference does, once: an untyped
        float64 operand taken for float32 was observed as a float32 graph output, which ONNX Runtime refused.
        """
        if a is None or b is None:
            return False
        known = [v.dtype for v in (a, b) if v.dtype is not None]
        if known:
            return all(t in _FLOATS for t in known)
        if not inferred:
            inferred.update(_inferred_dtypes(model))
            inferred.setdefault("", 0)  # inferred once, even when nothing was
        elem = inferred.get(a.name or "") or inferred.get(b.name or "")
        return not elem or ir.DataType(elem) in _FLOATS

    for node in _all_nodes(model):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ops:
            continue
        ins = list(node.inputs)
        if len(ins) < 2 or not operands_float(ins[0], ins[1]):
            continue
        if any(_from_dq(v) for v in ins[:2]):
            done.append(node)
            continue
        a, b = ins[0], ins[1]
        if _is_const(a):  # constant left operand: not a layout the integer kernels take
            continue
        weight = 1 if _is_const(b) else None
        axis = None
        bias = None
        if node.op_type == "MatMul":
            if weight is not None:
                rank = len(const_tensor(b).shape)  # type: ignore[union-attr]
                if rank < 2:
                    continue
                axis = rank - 1
            acts = (0,) if weight is not None else (0, 1)
        elif node.op_type == "Gemm":
            if weight is None:
                continue
            trans_b = node.attributes.get("transB")
            axis = 0 if trans_b is not None and trans_b.as_int() == 1 else 1
            acts = (0,)
            beta = node.attributes.get("beta")
            if len(ins) > 2 and _is_const(ins[2]) and (beta is None or beta.as_float() == 1.0):
                if len(const_tensor(ins[2]).shape) == 1:  # type: ignore[union-attr]
                    bias = 2
        else:  # Conv
            if weight is None:
                continue
            axis = 0
            acts = (0,)
            if len(ins) > 2 and _is_const(ins[2]):
                bias = 2
        cands.append(
            Candidate(
                node=node,
                key=node_key(node),
                act_inputs=acts,
                weight_input=weight,
                weight_axis=axis,
                bias_input=bias,
                quantize_output=node.op_type in ("Conv", "Gemm") and not node.outputs[0].is_graph_output(),
            )
        )
    return cands, done


def _final_projections(model: ir.Model, cands: list[Candidate]) -> set[str]:
    """Keys of candidates with no other candidate downstream of them (through subgraphs too).

    A node that holds subgraphs counts as having a candidate downstream when one is inside it; the
    outputs of its subgraphs lead to whatever its own outputs lead to.
    """
    cand_nodes = {id(c.node) for c in cands}
    downstream: dict[int, bool] = {}

    def leads_on(value: ir.Value, sub_outputs: dict[int, bool]) -> bool:
        for use in value.uses():
            if id(use.node) in cand_nodes or downstream.get(id(use.node), False):
                return True
        return sub_outputs.get(id(value), False)

    def walk(graph: ir.Graph, sub_outputs: dict[int, bool]) -> None:
        for node in reversed(list(graph)):
            found = any(leads_on(out, sub_outputs) for out in node.outputs)
            for attr in node.attributes.values():
                subs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                    list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
                for sub in subs:
                    walk(sub, {id(o): found for o in sub.outputs})
                    found = found or any(id(n) in cand_nodes or downstream.get(id(n), False) for n in sub)
            downstream[id(node)] = found

    walk(model.graph, {})
    return {c.key for c in cands if not downstream.get(id(c.node), False)}


#: Reason of a MatMul whose second input is computed from constants only, not stored as one.
COMPUTED_WEIGHT_REASON = ("default rule: its weight is computed at run time from constants (a Transpose or an "
                          "in-graph dequantization of a stored weight), so it is not quantized as a weight; run "
                          "'cleanup' (fold-constants) before this pass to quantize it")


def computed_from_constants(v: ir.Value | None, limit: int = 16) -> bool:
    """Whether ``v`` is made by nodes (at most ``limit`` of them) that read only constants: a weight stored
    otherwise than as the MatMul's input (PyTorch's ``Transpose`` of a Linear weight, an int8 weight times
    its scale), which ``fold-constants`` turns into one."""
    if v is None or const_tensor(v) is not None:
        return False
    seen: set[int] = set()
    todo = [v]
    while todo:
        value = todo.pop()
        if const_tensor(value) is not None:
            continue
        node = value.producer()
        if node is None or id(node) in seen or node.attributes and any(
                a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return False  # a graph input, a captured outer value, or control flow
        seen.add(id(node))
        if len(seen) > limit:
            return False
        todo.extend(x for x in node.inputs if x is not None)
    return True


def default_precision(model: ir.Model, cands: list[Candidate], precision: str) -> dict[str, tuple[str, str]]:
    """Default rule decision and reason for every candidate."""
    finals = _final_projections(model, cands)
    out: dict[str, tuple[str, str]] = {}
    for c in cands:
        if not c.has_weight and computed_from_constants(c.node.inputs[1]):
            out[c.key] = ("fp32", COMPUTED_WEIGHT_REASON)
        elif not c.has_weight:
            out[c.key] = ("fp32", "default rule: activation x activation matmul (attention); sensitive, little gain")
        elif c.key in finals:
            out[c.key] = ("fp32", "default rule: final projection")
        else:
            out[c.key] = (precision, f"default rule: {c.node.op_type} with weights")
    return out


def sensitive_nodes(model: ir.Model, foreign: Mapping[tuple[str, str], ForeignOp] | None = None
                    ) -> list[tuple[ir.Node, str]]:
    """Nodes that stay in float by rule (listed in the plan): embeddings, normalization, softmax.

    The normalizations are the standard channel norms and the ops whose foreign-op record says
    ``normalizes`` (``foreign``: the registry's records, default the built-in ones)."""
    norms = normalization_ops(foreign)
    out = []
    for node in model.graph:
        if node.op_type == "Gather" and node.inputs and _is_const(node.inputs[0]) and _is_float(node.inputs[0]):
            out.append((node, "default rule: embedding lookup"))
        elif node.op_type in _CHANNEL_NORMS or (
                "" if node.domain == "ai.onnx" else node.domain, node.op_type) in norms:
            out.append((node, "default rule: normalization"))
        elif node.op_type in ("Softmax", "LogSoftmax"):
            out.append((node, "default rule: softmax"))
    return out


def tensors_to_observe(cands: list[Candidate]) -> list[str]:
    """Names of the activations whose ranges the given candidates need."""
    names: list[str] = []
    for c in cands:
        for i in c.act_inputs:
            v = c.node.inputs[i]
            if v is not None and v.name:
                names.append(v.name)
        if c.quantize_output and c.node.outputs[0].name:
            names.append(c.node.outputs[0].name)
    return list(dict.fromkeys(names))



def scale_numpy_type(dtype: ir.DataType | None) -> Any:
    """The numpy type of the scales for a tensor of ``dtype``: QuantizeLinear-19 takes the scale in x's type."""
    if dtype == ir.DataType.FLOAT16:
        return np.float16
    if dtype == ir.DataType.BFLOAT16:
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float32


def _round_scale(scale: np.ndarray | float, scale_dtype: Any) -> np.ndarray:
    """``scale`` stored in ``scale_dtype``, never rounded to zero (the smallest positive value of the type)."""
    arr = np.asarray(scale, np.float32)
    if scale_dtype is np.float32:
        return arr
    tiny = 2.0**-24 if scale_dtype is np.float16 else 1.2e-38
    return np.maximum(arr, np.float32(tiny)).astype(scale_dtype)


def activation_params(lo: float, hi: float, s: Scheme, scale_dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Scale (in ``scale_dtype``) and zero point of a per-tensor activation range under scheme ``s``."""
    if s.is_float:
        amax = max(abs(lo), abs(hi), 1e-12)
        return _round_scale(amax / s.qmax, scale_dtype), np.zeros((), _fp8())
    if s.act_symmetric:
        amax = max(abs(lo), abs(hi), 1e-12)
        return _round_scale(amax / 127.0, scale_dtype), np.zeros((), np.int8)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = _round_scale(max((hi - lo) / 255.0, 1e-12), scale_dtype)
    zp = int(np.clip(round(-lo / float(scale)), 0, 255))
    return scale, np.array(zp, np.uint8)


def fake_quant_activation(x: np.ndarray, lo: float, hi: float, s: Scheme) -> np.ndarray:
    """``DequantizeLinear(QuantizeLinear(x))`` in numpy, as the inserted pair computes it."""
    scale, zp = activation_params(lo, hi, s)
    if s.is_float:
        return (np.clip(x / scale, -s.qmax, s.qmax).astype(_fp8()).astype(np.float32) * scale).astype(np.float32)
    info = np.iinfo(zp.dtype)
    q = np.clip(np.rint(x / scale) + int(zp), info.min, info.max)
    return ((q - int(zp)) * scale).astype(np.float32)


def quantize_weight_array(w: np.ndarray, axis: int | None, s: Scheme,
                          scale_dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric quantization of a weight: per channel along ``axis`` when the scheme says so.

    The scale is returned in ``scale_dtype``; the weight is quantized with that rounded scale.
    """
    if s.per_channel and axis is not None:
        reduce_axes = tuple(i for i in range(w.ndim) if i != axis)
        amax = np.abs(w).max(axis=reduce_axes) if reduce_axes else np.abs(w)
        scale = _round_scale(np.maximum(amax / s.qmax, 1e-12), scale_dtype)
        bshape = [1] * w.ndim
        bshape[axis] = -1
        q = w / scale.astype(np.float32).reshape(bshape)
    else:
        scale = _round_scale(max(float(np.abs(w).max()) / s.qmax, 1e-12), scale_dtype)
        q = w / scale.astype(np.float32)
    if s.is_float:  # q is a new array (the division): rounded and clipped in place
        return np.clip(q, -s.qmax, s.qmax, out=q).astype(_fp8()), scale
    np.rint(q, out=q)  # in place: one float temporary per weight, not three
    return np.clip(q, -127, 127, out=q).astype(np.int8), scale


def fake_quant_weight(w: np.ndarray, axis: int | None, s: Scheme) -> np.ndarray:
    q, scale = quantize_weight_array(w, axis, s)
    if scale.ndim == 1 and axis is not None:
        bshape = [1] * w.ndim
        bshape[axis] = -1
        scale = scale.reshape(bshape)
    return (q.astype(np.float32) * scale).astype(np.float32)


class QdqWriter:
    """Inserts Q/DQ into a model (its graph and subgraphs) for a :class:`Scheme`, sharing pairs per tensor and weight."""

    def __init__(self, model: ir.Model, scheme: Scheme, ranges: dict[str, tuple[float, float]],
                 float_types: dict[str, ir.DataType] | None = None) -> None:
        self.graph = model.graph
        self.scheme = scheme
        self.ranges = ranges
        #: element types of values whose ``dtype`` the IR does not hold (from shape inference)
        self.float_types = float_types or {}
        self._act: dict[int, tuple[ir.Value, np.ndarray]] = {}
        self._dq_outs: dict[int, tuple[ir.Value, np.ndarray]] = {}  # id(DQ output) -> the same pair
        self._weight: dict[tuple[int, int | None], tuple[ir.Value, np.ndarray]] = {}
        self._names: set[str] = set()
        for graph in model.graphs():
            self._names.update(graph.initializers)
            self._names.update(o.name for node in graph for o in node.outputs if o.name)
            self._names.update(node.name for node in graph if node.name)  # node names must stay unique too
            self._names.update(v.name for v in graph.inputs if v.name)
        self.q_nodes = 0
        self.dq_nodes = 0
        self._first: dict[int, ir.Node | None] = {}  # per graph: the node new ones go in front of

    # -- helpers
    def _name(self, base: str) -> str:
        name, i = base, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def _init(self, base: str, array: np.ndarray, graph: ir.Graph) -> ir.Value:
        value = ir.Value(name=self._name(base), const_value=ir.tensor(array))
        graph.register_initializer(value)
        return value

    def _home(self, value: ir.Value) -> ir.Graph:
        """The graph that defines ``value`` (where what replaces or follows it goes)."""
        return value.graph or self.graph

    def float_type(self, value: ir.Value) -> ir.DataType:
        """The float element type of ``value`` (float32 when unknown)."""
        if value.dtype is not None and value.dtype in _FLOATS:
            return value.dtype
        return self.float_types.get(value.name or "", ir.DataType.FLOAT)

    def _insert_at_start(self, nodes: list[ir.Node], graph: ir.Graph) -> None:
        first = self._first.get(id(graph))
        if first is None or first.graph is not graph:  # not cached yet, or removed since (a dropped Constant)
            first = self._first[id(graph)] = next(iter(graph), None)
        if first is None:
            graph.extend(nodes)
        else:
            graph.insert_before(first, nodes)

    # -- activations
    def activation(self, value: ir.Value) -> tuple[ir.Value, np.ndarray] | None:
        """Q/DQ after ``value`` (once); return the DQ output and the scale, or None without a range."""
        if id(value) in self._act:
            return self._act[id(value)]
        if id(value) in self._dq_outs:  # already the DQ of a pair (a Conv/Gemm output pair): share it
            return self._dq_outs[id(value)]
        rng = self.ranges.get(value.name or "")
        if rng is None:
            return None
        ftype = self.float_type(value)
        scale, zp = activation_params(*rng, self.scheme, scale_numpy_type(ftype))
        base = value.name or "act"
        home = self._home(value)
        s_val = self._init(f"{base}_scale", scale, home)
        z_val = self._init(f"{base}_zero_point", zp, home)
        q = ir.node("QuantizeLinear", [value, s_val, z_val], name=self._name(f"{base}_QuantizeLinear"))
        q.outputs[0].name = self._name(f"{base}_quantized")
        dq = ir.node("DequantizeLinear", [q.outputs[0], s_val, z_val], name=self._name(f"{base}_DequantizeLinear"))
        dq.outputs[0].name = self._name(f"{base}_dequantized")
        dq.outputs[0].dtype = ftype
        dq.outputs[0].shape = value.shape
        q.outputs[0].dtype = ir.DataType.from_numpy(zp.dtype)
        q.outputs[0].shape = value.shape
        producer = value.producer()
        if producer is not None:
            home.insert_after(producer, [q, dq])
        else:
            self._insert_at_start([q, dq], home)
        self.q_nodes += 1
        self.dq_nodes += 1
        self._act[id(value)] = (dq.outputs[0], scale)
        self._dq_outs[id(dq.outputs[0])] = self._act[id(value)]
        return self._act[id(value)]

    # -- weights
    def weight(self, value: ir.Value, axis: int | None) -> tuple[ir.Value, np.ndarray]:
        """Quantized initializer + DQ for ``value`` (once per weight and axis)."""
        key = (id(value), axis)
        if key in self._weight:
            return self._weight[key]
        tensor = const_tensor(value)
        assert tensor is not None
        ftype = tensor.dtype if tensor.dtype in _FLOATS else ir.DataType.FLOAT
        w = tensor.numpy().astype(np.float32, copy=False)  # read only: a float32 weight is not copied
        qarr, scale = quantize_weight_array(w, axis, self.scheme, scale_numpy_type(ftype))
        _spill.release_pages(tensor)  # the mapped float weights need not stay resident
        base = value.name or "weight"
        home = self._home(value)
        zp = np.zeros(scale.shape, qarr.dtype)
        q_val = self._init(f"{base}_quantized", qarr, home)
        s_val = self._init(f"{base}_scale", scale, home)
        z_val = self._init(f"{base}_zero_point", zp, home)
        attrs = {"axis": int(axis)} if scale.ndim == 1 and axis is not None else {}
        dq = ir.node("DequantizeLinear", [q_val, s_val, z_val], attrs, name=self._name(f"{base}_DequantizeLinear"))
        dq.outputs[0].name = self._name(f"{base}_dequantized")
        dq.outputs[0].dtype = ftype
        dq.outputs[0].shape = ir.Shape(list(w.shape))
        self._insert_at_start([dq], home)
        self.dq_nodes += 1
        self._weight[key] = (dq.outputs[0], scale)
        return self._weight[key]

    def bias(self, value: ir.Value, act_scale: np.ndarray, w_scale: np.ndarray) -> ir.Value | None:
        """The INT32 bias ``DequantizeLinear`` output for ``value``; ``None`` when a value would not fit INT32
        at scale ``act_scale * w_scale`` (the bias then stays float: clipped, it would be lost)."""
        b = const_tensor(value).numpy().astype(np.float64)  # type: ignore[union-attr]
        scale = (float(act_scale) * w_scale.astype(np.float64)).reshape(-1)
        if scale.size == 1:
            scale = np.full(b.shape, scale[0])
        scale = np.maximum(scale, 1e-30)
        codes = np.rint(b / scale)
        if codes.size and float(np.abs(codes).max()) > 2**31 - 1:
            logger.info("bias %s stays float: at scale %.3g (input scale %.3g) it does not fit INT32",
                        value.name, float(scale.min()), float(act_scale))
            return None
        home = self._home(value)
        q = codes.astype(np.int32)
        base = value.name or "bias"
        q_val = self._init(f"{base}_quantized", q, home)
        s_val = self._init(f"{base}_scale", scale.astype(np.float32), home)
        z_val = self._init(f"{base}_zero_point", np.zeros(b.shape, np.int32), home)
        dq = ir.node("DequantizeLinear", [q_val, s_val, z_val], {"axis": 0}, name=self._name(f"{base}_DequantizeLinear"))
        dq.outputs[0].name = self._name(f"{base}_dequantized")
        dq.outputs[0].dtype = ir.DataType.FLOAT
        dq.outputs[0].shape = ir.Shape(list(b.shape))
        self._insert_at_start([dq], home)
        self.dq_nodes += 1
        return dq.outputs[0]

    # -- nodes
    def quantize(self, c: Candidate) -> bool:
        """Put Q/DQ in front of candidate ``c``; False (and nothing changed) if a range is missing."""
        node = c.node
        names = [node.inputs[i].name or "" for i in c.act_inputs  # type: ignore[union-attr]
                 if id(node.inputs[i]) not in self._dq_outs]
        if c.quantize_output:
            names.append(node.outputs[0].name or "")
        if any(n not in self.ranges for n in names):
            return False
        act_scale = None
        for i in c.act_inputs:
            v = node.inputs[i]
            assert v is not None
            dq_out, act_scale = self.activation(v)  # type: ignore[misc]
            node.replace_input_with(i, dq_out)
        if c.weight_input is not None:
            w_in = node.inputs[c.weight_input]
            assert w_in is not None
            dq_w, w_scale = self.weight(w_in, c.weight_axis)
            node.replace_input_with(c.weight_input, dq_w)
            self._drop_if_unused(w_in)
            # an INT32 bias has scale act_scale * w_scale: kept in float where scales are not float32
            if (c.bias_input is not None and not self.scheme.is_float and act_scale is not None
                    and act_scale.dtype == np.float32):
                b_in = node.inputs[c.bias_input]
                assert b_in is not None
                b_dq = self.bias(b_in, act_scale, w_scale)
                if b_dq is not None:
                    node.replace_input_with(c.bias_input, b_dq)
                    self._drop_if_unused(b_in)
        if c.quantize_output:
            out = node.outputs[0]
            dq_out, _ = self.activation(out)  # type: ignore[misc]
            q_node = dq_out.producer().inputs[0].producer()  # type: ignore[union-attr]
            for use in list(out.uses()):
                if use.node is not q_node:
                    use.node.replace_input_with(use.idx, dq_out)
        return True

    def _drop_if_unused(self, value: ir.Value) -> None:
        """Remove a replaced weight (initializer or ``Constant`` node) nothing reads any more."""
        if value.uses() or value.is_graph_output():
            return
        if value.is_initializer() and value.name:
            self._home(value).initializers.pop(value.name, None)
            return
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and producer.graph is not None:
            producer.graph.remove(producer, safe=True)


#: Bytes of float32 rows ``quantize_embeddings`` handles at once.
_SLICE_BYTES = 16 * 2**20

#: Smallest embedding table (elements) that ``quantize_embeddings`` converts; smaller ones are not worth it.
EMBEDDING_MIN_ELEMENTS = 1 << 16


def quantize_embeddings(model: ir.Model, min_elements: int = EMBEDDING_MIN_ELEMENTS) -> list[tuple[ir.Node, str]]:
    """Store the float tables that ``Gather`` nodes read (word, position, token-type embeddings) as INT8.

    A table ``W [rows, hidden]`` (a float initializer read only by ``Gather`` on axis 0, at least
    ``min_elements`` elements) becomes symmetric INT8 with one scale per column (per hidden unit, so the
    few large-magnitude dimensions of transformer embeddings keep their own range), and each
    ``Gather(W, ids)`` becomes ``DequantizeLinear(Gather(W_int8, ids), scale, 0, axis=-1)``: the rows are
    gathered as INT8 and only they are dequantized.  Calibration is not needed (weights only).
    Returns ``(gather node, description)`` for every converted Gather, for the precision plan.
    """
    graph = model.graph
    names: set[str] = set(graph.initializers)
    for node in graph:
        names.update(o.name for o in node.outputs if o.name)

    fresh = functools.partial(fresh_name, names)
    done: list[tuple[ir.Node, str]] = []
    for table in list(graph.initializers.values()):
        arr = table.const_value.numpy() if table.const_value is not None else None
        if arr is None or arr.ndim != 2 or arr.size < min_elements or arr.dtype not in (np.float32, np.float16):
            continue
        uses = list(table.uses())
        if not uses or table.is_graph_output() or any(
            u.op_type != "Gather" or u.domain not in ("", "ai.onnx") or idx != 0
            or int(u.attributes["axis"].value if "axis" in u.attributes else 0) != 0
            for u, idx in uses
        ):
            continue
        # in slices of rows (the same figures as on the whole table: a maximum and elementwise rounding), so
        # no float copy of the table is made, and its pages are forgotten once read
        step = max(1, _SLICE_BYTES // (4 * arr.shape[1]))
        amax = np.abs(arr[:step].astype(np.float32)).max(axis=0)
        for i in range(step, arr.shape[0], step):
            np.maximum(amax, np.abs(arr[i:i + step].astype(np.float32)).max(axis=0), out=amax)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.empty(arr.shape, np.int8)
        for i in range(0, arr.shape[0], step):
            q[i:i + step] = np.clip(np.rint(arr[i:i + step].astype(np.float32) / scale), -127, 127)
        _spill.release_pages(table.const_value)
        q_value = ir.Value(name=fresh(f"{table.name}_int8"), const_value=ir.tensor(q))
        s_value = ir.Value(name=fresh(f"{table.name}_scale"), const_value=ir.tensor(scale.astype(arr.dtype)))
        z_value = ir.Value(name=fresh(f"{table.name}_zero_point"), const_value=ir.tensor(np.zeros_like(q[0])))
        for v in (q_value, s_value, z_value):
            graph.register_initializer(v)
        for gather, _ in uses:
            out = gather.outputs[0]
            gather.replace_input_with(0, q_value)
            dq_out = ir.Value(name=fresh(f"{out.name}_dq"))
            out.replace_all_uses_with(dq_out, replace_graph_outputs=True)
            # the Gather now writes the INT8 rows (its own output value, so the DequantizeLinear is linked to
            # its producer, not to a look-alike name); the DequantizeLinear after it carries the float value on
            dq = ir.node("DequantizeLinear", [out, s_value, z_value], attributes={"axis": -1},
                         outputs=[dq_out], name=fresh(f"{gather.name}_DequantizeLinear"))
            gather_out_name = out.name
            out.name = fresh(f"{out.name}_int8")
            dq.outputs[0].name = gather_out_name
            dq.outputs[0].type, dq.outputs[0].shape = out.type, out.shape
            out.type = ir.TensorType(ir.DataType.INT8)
            graph.insert_after(gather, dq)
            done.append((gather, f"embedding table '{table.name}' stored as INT8, one scale per column"))
        graph.initializers.pop(str(table.name))
    return done
