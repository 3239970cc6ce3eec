"""Per-layer sensitivity analysis: keep the fewest layers in higher precision that meets an accuracy budget.

Given a budget on the model outputs (``cosine>=0.995``: the smallest cosine similarity between the quantized
and the float outputs, per sample with its outputs joined and per output on its own, as ``--verify`` judges
it; ``max-abs<=X``: the largest absolute difference), measured on the first calibration samples:

1. **rank**: every candidate layer is run alone (a one-node model, ONNX Runtime) on the inputs it sees in
   the float model for those samples, once in float and once with its inputs and weights fake-quantized
   exactly as the inserted Q/DQ will do; its sensitivity is the relative error of its output
   ``||y_q - y|| / ||y||`` (one float pass over the samples, not one model build per layer), and its cost
   the multiply-adds it did on those samples (output elements x reduction length, from the real shapes);
2. **order** (latency-aware, :func:`keep_order`): first the layers that cost less than
   :data:`CHEAP_FRACTION` (1/8) of the median layer's multiply-adds, whose float costs little latency (on
   transformers the activation x activation MatMuls of attention, about 1/24 of a projection at sequence
   128, and on ONNX Runtime CPU quantized ones also lose the fused transpose and scale), then the others;
   within each, most sensitive first, and of layers whose errors are within a factor :data:`TIE_FACTOR` of
   each other (one bucket of a log scale), the cheapest first;
3. **choose**: a binary search over ``k`` builds the real Q/DQ model with all but the first ``k`` layers
   of that order quantized, runs it end to end and keeps the smallest ``k`` that meets the budget.  The
   budget check is always measured on the model outputs, never inferred from the per-layer figures;
   every ``k`` measured and its value are kept (``SensitivityResult.curve``) for the plan.

Each end-to-end evaluation builds a quantized copy from the untouched float model and runs it with ONNX
Runtime, optimizations off, so it measures exactly the graph the pass will write.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant._fp16_measure import SIGNAL_FLOOR, output_value
from mograph.passes.quant._qdq import (
    Candidate,
    QdqWriter,
    Scheme,
    const_tensor,
    fake_quant_activation,
    find_candidates,
    quantize_weight_array,
    tensors_to_observe,
)
from mograph.passes.quant.calibration import (
    Feed,
    _run_feed,
    _session,
    _with_outputs_mapped,
    model_folder,
    run_model,
    set_model_folder,
)
from mograph.passes.quant.plan import Budget

from mograph import _spill
from mograph.ir_version import make_model as make_model_proto

__all__ = ["SensitivityResult", "analyse"]

logger = logging.getLogger(__name__)

#: Layers costing less than this fraction of the median layer's multiply-adds are kept float first.
CHEAP_FRACTION = 0.125
#: Layers whose quantized-alone errors are within this factor of each other go cheapest first.
TIE_FACTOR = 1.25


@dataclass
class SensitivityResult:
    alone: dict[str, float] = field(default_factory=dict)  # relative output error of the layer quantized alone
    cost: dict[str, float] = field(default_factory=dict)  # multiply-adds per sample of the layer (mean)
    order: list[str] = field(default_factory=list)  # the order layers are kept float in (rank 1 first)
    curve: dict[int, float] = field(default_factory=dict)  # layers kept float -> measured budget metric
    keep: list[str] = field(default_factory=list)  # layers kept in higher precision
    final: float = float("nan")  # metric of the chosen mix
    met: bool = False
    evaluations: int = 0


def _metric(budget: Budget, refs: list[list[np.ndarray]], outs: list[list[np.ndarray]],
            per_output: bool = False) -> float:
    """The smallest cosine (largest |diff|) between each sample's float outputs joined into one vector; with
    ``per_output`` also over each output on its own (:func:`~mograph.passes.quant._fp16_measure.output_value`,
    as ``--verify`` judges it), the metric the budget is checked on: joined alone, a small output that
    quantization wrecked hid behind a large exact one (a GRU encoder's bridge state, cosine 0, beside its
    memory output: 0.998 joined)."""
    # each sample's float outputs, one float64 vector per side, written into two buffers made once: a new
    # pair of vectors per sample (a decoder's logits: 100 MB each) cost three times as much, in page faults
    size = max((sum(a.size for a in ref if np.issubdtype(a.dtype, np.floating)) for ref in refs), default=0)
    buf_r, buf_o = np.empty(size, np.float64), np.empty(size, np.float64)
    values = []
    for ref, out in zip(refs, outs):
        r = _flat_floats(ref, buf_r)
        o = _flat_floats(out, buf_o)
        if budget.metric == "cosine":
            # all outputs silent on both sides agree (as output_value judges one output): their cosine, 0 / 0,
            # read 0 and no mix met the budget, so every layer stayed float with a "not met" warning (an
            # untrained torchvision ViT, whose zero-initialised head writes zeros whatever the layers do)
            quiet = max(float(np.abs(r).max(initial=0.0)), float(np.abs(o).max(initial=0.0))) <= SIGNAL_FLOOR
            values.append(1.0 if quiet else float(r @ o / (np.linalg.norm(r) * np.linalg.norm(o) + 1e-30)))
        else:
            values.append(float(np.abs(r - o).max()))
        if per_output:
            values.extend(_each_output(budget, ref, out, r, o))
    return min(values) if budget.metric == "cosine" else max(values)


def _each_output(budget: Budget, ref: list[np.ndarray], out: list[np.ndarray], r: np.ndarray,
                 o: np.ndarray) -> list[float]:
    """Each float output pair judged on its own, read from the joined vectors ``r``/``o`` where both sides
    put it at the same place with the same shape (no copy), else from the arrays themselves."""
    values = []
    at_r = at_o = 0
    for a, b in zip(ref, out):
        fa, fb = np.issubdtype(a.dtype, np.floating), np.issubdtype(b.dtype, np.floating)
        if fa and fb and a.shape == b.shape and at_r == at_o:
            values.append(output_value(budget, r[at_r:at_r + a.size], o[at_o:at_o + b.size]))
        elif fa:
            values.append(output_value(budget, np.asarray(a), np.asarray(b)))
        at_r += a.size if fa else 0
        at_o += b.size if fb else 0
    return values


def _flat_floats(arrays: list[np.ndarray], buf: np.ndarray) -> np.ndarray:
    """The floating arrays of ``arrays``, raveled and joined as float64 (exact), in ``buf`` when it is big enough."""
    parts = [np.asarray(a).ravel() for a in arrays if np.issubdtype(a.dtype, np.floating)]
    n = sum(p.size for p in parts)
    if not parts or n > buf.size:
        return np.concatenate([np.asarray(p, np.float64) for p in parts]) if parts else np.empty(0, np.float64)
    return np.concatenate(parts, out=buf[:n])


def _computed_inputs(cands: list[Candidate]) -> list[str]:
    """Names of the candidates' other inputs that are computed, not constant: a Gemm bias read through an
    ``Identity`` (PyTorch's export of a parameter shared by an unrolled LSTM's steps) stays float and unquantized
    in the Q/DQ model, so a layer run alone reads it as the float model made it."""
    names = [v.name for c in cands for i, v in enumerate(c.node.inputs)
             if v is not None and v.name and i not in c.act_inputs and const_tensor(v) is None]
    return list(dict.fromkeys(names))


def _observation(model: ir.Model, cands: list[Candidate], samples: list[Feed], source: Any = None,
                 refs: list[list[np.ndarray]] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The candidates' inputs on each sample (the float model, ORT optimizations off), one dict per sample.

    With ``refs``, the copy run is the whole model with the inputs as extra outputs, and each sample's model
    outputs are appended to ``refs``: the end-to-end reference and the per-layer inputs come from one run of
    the model per sample (the same graph and kernels as a run of the model alone, so the same numbers).
    Without, the copy keeps only the nodes the inputs need (:func:`_with_outputs_mapped` ``only``)."""
    proto_bytes, mapping = _with_outputs_mapped(model, [*tensors_to_observe(cands), *_computed_inputs(cands)],
                                                only=refs is None)
    names = list(mapping)
    model_outputs = [v.name or "" for v in model.graph.outputs] if refs is not None else []
    fetch = list(dict.fromkeys([*model_outputs, *(mapping[n] for n in names)]))
    where = {name: i for i, name in enumerate(fetch)}
    sess: Any = _session(proto_bytes, model_folder(model))
    del proto_bytes
    source = source if source is not None else _Samples()
    # The session holds the model's weights (once more than the pass's own copy, which smoothing made): when
    # every sample's activations take less than them, all samples are run first and the session is freed
    # before the candidates' float and fake-quantized weights are made (the same runs in the same order: the
    # same numbers).  Otherwise each sample is run as it is consumed.
    ahead: list[dict[str, np.ndarray] | None] = []
    for index, feed in enumerate(samples):
        outs = _run_feed(sess, fetch, feed, source, index)
        if refs is not None:
            refs.append([outs[where[n]] for n in model_outputs])
        got = {n: outs[where[mapping[n]]] for n in names}
        ahead.append(got)
        del outs
        if index == 0 and sum(int(a.nbytes) for a in got.values()) * len(samples) > _spill.footprint(model):
            break
    if len(ahead) == len(samples):
        sess = None
        _spill.trim_heap()
    for index, feed in enumerate(samples):
        if index < len(ahead):
            kept, ahead[index] = ahead[index], None
            assert kept is not None
            yield kept
            continue
        outs = _run_feed(sess, fetch, feed, source, index)
        if refs is not None:
            refs.append([outs[where[n]] for n in model_outputs])
        yield {n: outs[where[mapping[n]]] for n in names}


def _layer_errors(
    model: ir.Model,
    cands: list[Candidate],
    ranges: dict[str, tuple[float, float]],
    scheme: Scheme,
    samples: list[Feed],
    source: Any = None,
    acts: Iterable[dict[str, np.ndarray]] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Relative output error of each candidate run alone with quantized inputs and weights, and its cost
    (multiply-adds per sample: output elements times the reduction length, as run on the samples).

    ``acts`` gives the candidates' inputs on each sample (default: :func:`_observation`, a run of a copy of
    the model per sample); each sample's dict is emptied as its tensors' last readers are measured.  Each weight is quantized once, on its first use, and kept as INT8 with its scales
    (a quarter of the float weight) for the later samples; its fake-quantized float copy is made per sample
    from them, the same numbers as :func:`fake_quant_weight` gives."""
    import onnx

    opset = model.opset_imports.get("", 13)
    singles = {}
    by_signature: dict[bytes, Any] = {}  # one session per distinct node (op, attributes, inputs): 271 -> 1 on a LLaMA
    for c in cands:
        node = ir.serde.serialize_node(c.node)
        n_in = len([v for v in c.node.inputs])
        ins = [f"x{i}" for i in range(n_in)]
        del node.input[:]
        node.input.extend(ins)
        del node.output[:]
        node.output.extend(["y"])
        node.name = node.doc_string = ""
        del node.metadata_props[:]
        signature = node.SerializeToString(deterministic=True)
        if signature in by_signature:
            singles[c.key] = by_signature[signature]
            continue
        graph = onnx.helper.make_graph(
            [node], "layer", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ins],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        )
        proto = make_model_proto(graph, {"": opset})
        singles[c.key] = by_signature[signature] = _session(proto.SerializeToString())
    err_num = {c.key: 0.0 for c in cands}
    err_den = {c.key: 0.0 for c in cands}
    macs = {c.key: 0.0 for c in cands}
    # weight (value, axis) -> its INT8 values and scales, quantized once: fake-quantizing every weight again
    # on every sample was a fifth of this function's time on a 135M LLaMA
    quantized: dict[tuple[int, int | None], tuple[np.ndarray, np.ndarray]] = {}
    if acts is None:
        acts = _observation(model, cands, samples, source)
    last_reader = {(v.name or ""): j for j, c in enumerate(cands) for i, v in enumerate(c.node.inputs)
                   if v is not None and i in c.act_inputs}
    for index, sample in enumerate(acts):
        # input tensor -> (float32, fake-quantized), made once per sample (Q, K and V read one hidden state)
        # and dropped, with the sample's own copy, after the last layer reading it
        act_q: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for j, c in enumerate(cands):
            xs_f, xs_q = {}, {}
            read: list[Any] = []
            seen = True
            for i, v in enumerate(c.node.inputs):
                assert v is not None
                if i in c.act_inputs:
                    x = sample.get(v.name or "")
                    if x is None or x.size == 0 or (v.name or "") not in ranges:
                        seen = False  # inside a Loop/Scan body, or an If branch this sample did not take
                        break
                    name = v.name or ""
                    if name not in act_q:
                        x = np.asarray(x, np.float32)
                        lo, hi = ranges[name]
                        act_q[name] = (x, fake_quant_activation(x, lo, hi, scheme))
                    xs_f[f"x{i}"], xs_q[f"x{i}"] = act_q[name]
                elif const_tensor(v) is None:  # computed, left float by the writer (_computed_inputs)
                    x = sample.get(v.name or "")
                    if x is None:
                        seen = False
                        break
                    xs_f[f"x{i}"] = xs_q[f"x{i}"] = np.asarray(x, np.float32)
                else:
                    # read per candidate and sample, never all at once: holding the float and quantized
                    # copies of every weight through the samples was twice the weights
                    tensor = const_tensor(v)  # an initializer or a Constant node's value, in any graph
                    assert tensor is not None
                    w = np.ascontiguousarray(tensor.numpy(), dtype=np.float32)
                    read.append(tensor)
                    xs_f[f"x{i}"] = w
                    if i != c.weight_input:
                        xs_q[f"x{i}"] = w
                        continue
                    key = (id(v), c.weight_axis)
                    if key not in quantized:
                        quantized[key] = _quantized_weight(w, c.weight_axis, scheme)
                    q, scale = quantized[key]
                    xs_q[f"x{i}"] = np.multiply(q, scale, dtype=np.float32)  # fake_quant_weight's numbers
            for i, v in enumerate(c.node.inputs):
                if i in c.act_inputs and v is not None and last_reader.get(v.name or "") == j:
                    act_q.pop(v.name or "", None)
                    sample.pop(v.name or "", None)
            if not seen:
                _release(read)
                continue
            y = singles[c.key].run(None, xs_f)[0]
            yq = singles[c.key].run(None, xs_q)[0]
            num, den = _error_terms(y, yq)
            err_num[c.key] += num
            err_den[c.key] += den
            macs[c.key] += float(y.size) * _reduction(c, xs_f)
            del y, yq
            del xs_f, xs_q
            _release(read)
        del sample, act_q
        if progress is not None:
            progress(index + 1, len(samples))
    quantized.clear()
    errors = {k: (err_num[k] / err_den[k]) ** 0.5 if err_den[k] > 0 else 0.0 for k in err_num}
    return errors, {k: v / max(len(samples), 1) for k, v in macs.items()}


def _error_terms(y: np.ndarray, yq: np.ndarray) -> tuple[float, float]:
    """``sum((yq - y)**2)`` and ``sum(y**2)`` in float64, without float64 copies of ``y`` and ``yq`` (the same
    numbers: each is widened exactly before the subtraction or square; on Gemma 3's LM head output, 256 x 262,144
    per sample, the copies were a sixth of the analysis)."""
    d = np.subtract(yq, y, dtype=np.float64)
    np.square(d, out=d)
    num = float(d.sum())
    if d.shape != y.shape:
        return num, float(np.square(y, dtype=np.float64).sum())
    np.square(y, out=d, dtype=np.float64)
    return num, float(d.sum())


def _quantized_weight(w: np.ndarray, axis: int | None, scheme: Scheme) -> tuple[np.ndarray, np.ndarray]:
    """``w``'s quantized values and its scales shaped to broadcast against it: ``q * scale`` in float32
    (``np.multiply(q, scale, dtype=np.float32)``) is :func:`fake_quant_weight`'s result."""
    q, scale = quantize_weight_array(w, axis, scheme)
    if scale.ndim == 1 and axis is not None:
        bshape = [1] * w.ndim
        bshape[axis] = -1
        scale = scale.reshape(bshape)
    return q, scale


def _release(tensors: list[Any]) -> None:
    for t in tensors:
        _spill.release_pages(t)
    tensors.clear()


class _Samples:
    """What a rejected-feed message says about samples given as a plain list (not a calibration source)."""

    random = False
    description = "the sensitivity samples"


def _reduction(c: Candidate, xs: dict[str, np.ndarray]) -> float:
    """Multiply-adds per output element of candidate ``c`` on inputs ``xs`` (``x0``, ``x1``...)."""
    a, b = xs["x0"], xs["x1"]
    if c.node.op_type == "Conv":
        return float(b.size // max(b.shape[0], 1))  # C/group * kernel elements
    if c.node.op_type == "Gemm":
        attr = c.node.attributes.get("transA")
        return float(a.shape[0] if attr is not None and attr.as_int() == 1 else a.shape[-1])
    return float(a.shape[-1]) if a.ndim else 1.0


def keep_order(alone: dict[str, float], cost: dict[str, float], *, cheap: float = CHEAP_FRACTION,
               tie: float = TIE_FACTOR) -> list[str]:
    """Layers in the order they are kept float (see the module docstring, step 2): first the cheap ones
    (cost under ``cheap`` x the median layer's), then the others; within each, most sensitive first, and
    layers whose errors are within a factor ``tie`` of each other (one bucket of a log scale) cheapest first;
    then by name, so the order is reproducible."""
    positive = sorted(v for v in cost.values() if v > 0)
    median = positive[len(positive) // 2] if positive else 0.0

    def key(k: str) -> tuple[int, int, float, float, str]:
        e, c = alone[k], cost.get(k, 0.0)
        bucket = -math.floor(math.log(e) / math.log(tie)) if e > 0 else 1 << 30
        return (0 if c < cheap * median else 1, bucket, c, -e, k)

    return sorted(alone, key=key)


def _mix_payload(base: Any, folder: str | None, scheme: Scheme, ranges: dict[str, tuple[float, float]],
                 quantized: set[str]) -> tuple[Any, int]:
    """The Q/DQ model with ``quantized`` layers built from the float proto ``base``, as ONNX Runtime is given it
    (a file when too big for one protobuf), and its :func:`~mograph._spill.footprint`.  The model itself
    (its quantized weights, every candidate's node) is dropped on return."""
    m = ir.serde.deserialize_model(base)
    set_model_folder(m, folder)
    all_cands, _ = find_candidates(m)
    writer = QdqWriter(m, scheme, ranges)
    for c in all_cands:
        if c.key in quantized:
            writer.quantize(c)
    return _spill.payload(m, folder), _spill.footprint(m)


def _evaluate_mix(
    base: Any, folder: str | None, scheme: Scheme, ranges: dict[str, tuple[float, float]], samples: list[Feed],
    budget: Budget, refs: list[list[np.ndarray]], quantized: set[str],
) -> float:
    """Build the Q/DQ model with ``quantized`` layers from the float proto ``base``, run it, measure the budget
    metric.  A plain function of plain data, so an executor can run it in another process or machine."""
    payload, dropped = _mix_payload(base, folder, scheme, ranges, quantized)
    # the model is freed before its session is made: its weights are not beside the session's, nor beside
    # the next evaluation's
    _spill.free_dropped(dropped)
    outs = list(run_model(payload, samples))
    del payload
    return _metric(budget, refs, outs, per_output=True)


def _spread(lo: int, hi: int, m: int) -> list[int]:
    """Up to ``m`` distinct points strictly between ``lo`` and ``hi``, evenly spaced (the midpoint for m=1)."""
    return sorted({lo + (hi - lo) * (i + 1) // (m + 1) for i in range(m)} - {lo, hi})


def analyse(
    model: ir.Model,
    cands: list[Candidate],
    ranges: dict[str, tuple[float, float]],
    scheme: Scheme,
    samples: list[Feed],
    budget: Budget,
    *,
    fixed: Iterable[str] = (),
    progress: Callable[[int, int | None], None] | None = None,
    map_fn: Callable[..., list[float]] | None = None,
    source: Any = None,
) -> SensitivityResult:
    """Choose which of ``cands`` to keep in float so the budget holds; ``fixed`` are quantized regardless.

    ``map_fn(fn, items) -> list`` runs the end-to-end evaluations (default: the active executor's,
    :func:`mograph.workflow.executors.current_map`, which is serial unless ``--executor ray`` is on).  Its
    ``width`` (calls at once) turns the binary search into a (width+1)-ary one: each round evaluates
    ``width`` values of ``k`` together.  With width 1 the evaluations are exactly the binary search's.
    ``source`` (the calibration source the samples come from) words the error when the model rejects one.
    """
    from mograph.workflow.executors import current_map

    fixed = set(fixed)
    map_fn = map_fn or current_map()
    width = max(1, int(getattr(map_fn, "width", 1)))
    # A model too big for one protobuf is spilled to a temporary folder: ``base`` is then its small proto,
    # its weights read from that folder (kept alive by ``spilled`` until the search ends).
    base, spilled = _spill.model_proto(model)
    folder = str(spilled.folder) if spilled is not None else model_folder(model)
    # one run of the model per sample gives both the reference outputs and every candidate's inputs
    refs: list[list[np.ndarray]] = []
    result = SensitivityResult()
    result.alone, result.cost = _layer_errors(model, cands, ranges, scheme, samples, source,
                                              acts=_observation(model, cands, samples, source, refs),
                                              progress=progress)
    evaluate = functools.partial(_evaluate_mix, base, folder, scheme, ranges, samples, budget, refs)

    worst_first = result.order = keep_order(result.alone, result.cost)
    cache: dict[int, float] = {}

    def measure(ks: list[int]) -> None:
        todo = [k for k in ks if k not in cache]
        values = map_fn(evaluate, [set(worst_first[k:]) | fixed for k in todo]) if todo else []
        for k, v in zip(todo, values):
            cache[k] = v
            result.evaluations += 1
            logger.info("sensitivity: keeping %d layer(s) in float gives %s=%.6f", k, budget.metric, v)
            if progress is not None:
                progress(result.evaluations, None)

    # Invariant: with_k(lo) fails (lo = -1: nothing measured yet); with_k(hi) meets, or hi = n (nothing
    # measured quantized).  The first round always measures k = 0 (everything quantized).
    lo, hi = -1, len(worst_first)
    while lo + 1 < hi:
        ks = [0, *_spread(0, hi, width - 1)] if lo < 0 else _spread(lo, hi, width)
        measure(ks)
        for k in ks:
            if budget.met(cache[k]):
                hi = k
                break
            lo = k
    measure([hi])
    result.keep = worst_first[:hi]
    result.final = cache[hi]
    result.curve = dict(sorted(cache.items()))
    result.met = budget.met(result.final)
    if spilled is not None:
        spilled.cleanup()
    return result
