"""Measurements behind ``fp16``'s decisions: each node's own float16 error, and the model's end-to-end error.

**Local error (one run per calibration sample).**  A copy of the model gets, beside every candidate node,
a float16 *twin*: the same op and attributes, fed with the float32 model's own inputs of that node
rounded to float16 (values beyond the float16 range saturate to +-65504, and constants are stored the way
the conversion stores them).  An ONNX Runtime session (optimizations off) computes the float32 graph
and the twins together, so each node's error is measured on the inputs it really sees and is not mixed
with the error of the nodes before it (the nodes are measured in groups, each with its own session, so
that the tensors read back per sample stay under a byte budget: :func:`measure_local`)::

    local_error(n) = sqrt(sum ||y16 - sat(y32)||^2 / sum ||sat(y32)||^2)     over samples and outputs

``sat`` clips to the float16 range: a value that only saturates (an attention-mask constant of -3.4e38
that becomes -65504) is not counted as an error here; whether saturation matters is left to the end-to-end
check.  A twin that gives a non-finite value where the float32 node gives a finite one **overflows** (the
node cannot compute in float16 on this data).  The float32 outputs' statistics (largest magnitude,
reduced extent) come from the same run.

**Running float16 on the CPU.**  ONNX Runtime's CPU provider has no float16 kernel for most ops; it
computes them in float32 between inserted ``Cast`` s and then drops each ``Cast`` pair that goes to float16
and straight back, so a float16 graph runs there as float32 and shows no float16 error at all (measured:
``Cast(1000.7 -> f16) - 1000`` gives 0.7, not 0.5).  Every measurement here therefore runs a copy in which
each float16 tensor passes an ``Identity`` (:func:`keep_fp16_rounding`): ORT keeps the rounding, and the
CPU emulates what a GPU computes — every tensor between nodes stored in float16, each node's arithmetic in
float32 (as the CUDA kernels accumulate).

**End-to-end error.**  A converted copy runs on the first samples and its outputs are compared with the
float32 model's (:class:`~mograph.passes.quant.plan.Budget`: the smallest cosine, or the largest absolute
difference, of each output of each sample judged on its own the way ``--verify`` judges it, so a small
output is not hidden by a large one; positions the ``attention_mask`` marks as padding are left out, as
no output value there is read: :func:`output_metric`); :func:`fewest_fp32` keeps the fewest nodes in float32, in order of local
error, that meet the budget (a binary search over how many).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import calibration as cal
from mograph.passes.quant.plan import Budget

from mograph import _spill, ir_io
from mograph.errors import OptionError
from mograph.irutil import fresh_name, run_shape_inference

if TYPE_CHECKING:
    from mograph.custom_ops import CustomOp

__all__ = ["FP16_LIMIT", "LocalMeasure", "Search", "keep_fp16_rounding", "measure_local", "output_metric", "output_value",
           "fewest_fp32", "to_half", "SIGNAL_FLOOR", "MEASURE_BYTES", "MEASURE_BYTES_ENV"]

logger = logging.getLogger(__name__)

#: Largest finite float16 value.
FP16_LIMIT = 65504.0


def to_half(array: np.ndarray) -> np.ndarray:
    """``array`` as float16, saturated to the float16 range (never infinite from a finite value)."""
    return np.clip(array, -FP16_LIMIT, FP16_LIMIT).astype(np.float16)


def keep_fp16_rounding(model: ir.Model) -> ir.Model:
    """Route every float16 node output of ``model`` through an ``Identity`` (in place; module docstring).

    Only for running on ONNX Runtime's CPU provider: the ``Identity`` has a float16 kernel, so the
    ``Cast`` pairs ORT inserts around float32-only kernels are no longer adjacent and are not dropped.
    """
    graph = model.graph
    taken = {v.name for n in graph for v in n.outputs if v.name} | {v.name for v in graph.inputs if v.name}
    outputs = {id(v): i for i, v in enumerate(graph.outputs)}
    for node in list(graph):
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
            continue
        for v in node.outputs:
            if v.dtype != ir.DataType.FLOAT16 or (not v.uses() and id(v) not in outputs):
                continue
            ident = ir.node("Identity", [v], name=fresh_name(taken, f"{v.name}_keep16"))
            out = ident.outputs[0]
            out.dtype, out.shape = v.dtype, v.shape
            for use in list(v.uses()):
                if use.node is not ident:
                    use.node.replace_input_with(use.idx, out)
            if id(v) in outputs:  # the graph output keeps its name
                name = v.name
                v.name = fresh_name(taken, f"{name}_raw16")
                out.name = name
                graph.outputs[outputs[id(v)]] = out
            else:
                out.name = fresh_name(taken, f"{v.name}_kept16")
            graph.insert_after(node, ident)
    return model


#: First default-domain opset whose ``Clip`` takes its bounds as inputs (attributes ``min``/``max`` before).
CLIP_INPUTS_OPSET = 11


@dataclass
class LocalMeasure:
    """What one calibration run measured, per node position (index in the graph's node order)."""

    error: dict[int, float] = field(default_factory=dict)  # local float16 error (module docstring)
    overflow: dict[int, float] = field(default_factory=dict)  # position -> largest |y32| where y16 was not finite
    stats: dict[str, cal.TensorStats] = field(default_factory=dict)  # float32 statistics by tensor name
    samples: int = 0
    # position -> ONNX Runtime's refusal of the node's float16 twin (no float16 kernel for its attributes)
    no_kernel: dict[int, str] = field(default_factory=dict)
    # the model's own outputs on the first samples (``measure_local(outputs=N)``), computed by the same float32
    # nodes from the same tensors as a session of the model gives them; None where not all were read back
    outputs: list[list[np.ndarray]] | None = None


def _twin_model(model: ir.Model, positions: Sequence[int], floats: set[str], pinned_in: dict[int, frozenset[int]],
                pinned_out: dict[int, frozenset[int]], retype: Callable[[ir.Node], None],
                watch_nodes: set[int] | None = None, watch_inputs: bool = True,
                twin_names: dict[str, int] | None = None,
                ) -> tuple[ir.Model, dict[int, list[tuple[str, str]]], list[str]]:
    """A copy of ``model`` with a float16 twin beside each node at ``positions``.

    Returns the copy, for each position the ``(float32 output, twin output)`` name pairs to compare, and
    the names of the float32 tensors whose statistics are wanted: the float outputs of the nodes at
    ``watch_nodes`` (every node when ``None``) and, with ``watch_inputs``, the float graph inputs
    (``twin_names``, if given, gets each twin node's name with its position).  The
    copy's graph outputs are exactly those tensors and the twins' outputs (the model's own outputs are
    dropped unless among them, so ONNX Runtime frees them like any other intermediate).
    """
    copy = ir_io.copy_model(model)
    graph = copy.graph
    nodes = list(graph)
    taken = {v.name for n in nodes for v in n.outputs if v.name} | {v.name for v in graph.inputs if v.name}
    taken |= set(graph.initializers)
    halves: dict[int, ir.Value] = {}
    clip_inputs = int(copy.opset_imports.get("", copy.opset_imports.get("ai.onnx", 1))) >= CLIP_INPUTS_OPSET
    lo = ir.Value(name=fresh_name(taken, "fp16_twin_lo"), const_value=ir.tensor(np.array(-FP16_LIMIT, np.float32)))
    hi = ir.Value(name=fresh_name(taken, "fp16_twin_hi"), const_value=ir.tensor(np.array(FP16_LIMIT, np.float32)))
    for v in (lo, hi) if clip_inputs else ():
        v.const_value.name = v.name  # type: ignore[union-attr]
        v.dtype, v.shape = ir.DataType.FLOAT, ir.Shape([])
        graph.register_initializer(v)
    added: list[ir.Node] = []

    def half_of(v: ir.Value) -> ir.Value:
        if id(v) in halves:
            return halves[id(v)]
        if v.const_value is not None and v.is_initializer():
            t = ir.tensor(to_half(v.const_value.numpy()), name=fresh_name(taken, f"{v.name}_twin16"))
            _spill.release_pages(v.const_value)
            out = ir.Value(name=t.name, const_value=t)
            out.dtype, out.shape = ir.DataType.FLOAT16, v.shape
            graph.register_initializer(out)
        else:
            if clip_inputs:
                clip = ir.node("Clip", [v, lo, hi], name=fresh_name(taken, f"{v.name}_twin_clip"))
            else:  # before opset 11 the bounds are attributes
                clip = ir.node("Clip", [v], {"min": -FP16_LIMIT, "max": FP16_LIMIT},
                               name=fresh_name(taken, f"{v.name}_twin_clip"))
            cast = ir.node("Cast", [clip.outputs[0]], {"to": ir.DataType.FLOAT16.value},
                           name=fresh_name(taken, f"{v.name}_twin_cast"))
            clip.outputs[0].name = fresh_name(taken, f"{v.name}_twin_clipped")
            out = cast.outputs[0]
            out.name = fresh_name(taken, f"{v.name}_twin16")
            out.dtype = ir.DataType.FLOAT16
            added.extend([clip, cast])
        halves[id(v)] = out
        return out

    pairs: dict[int, list[tuple[str, str]]] = {}
    for pos in positions:
        n = nodes[pos]
        ins = [None if v is None else half_of(v) if v.name in floats and i not in pinned_in.get(pos, ()) else v
               for i, v in enumerate(n.inputs)]
        twin = ir.Node(n.domain, n.op_type, ins, [a for a in n.attributes.values()], num_outputs=len(n.outputs),
                       overload=n.overload, name=fresh_name(taken, f"{n.name or n.op_type}_twin16"))
        retype(twin)
        if twin_names is not None and twin.name:
            twin_names[twin.name] = pos
        compare = []
        for j, (ref, out) in enumerate(zip(n.outputs, twin.outputs)):
            out.name = fresh_name(taken, f"{ref.name}_twin16")
            if ref.name in floats:
                out.dtype = ir.DataType.FLOAT if j in pinned_out.get(pos, ()) else ir.DataType.FLOAT16
                if j not in pinned_out.get(pos, ()):
                    compare.append((ref.name, out.name))
        added.append(twin)
        pairs[pos] = compare
    for node in added:
        graph.append(node)
    keep_fp16_rounding(copy)
    watched = [v.name for p, n in enumerate(nodes) if watch_nodes is None or p in watch_nodes
               for v in n.outputs if v.name and v.name in floats]
    if watch_inputs:
        watched += [v.name for v in graph.inputs if v.name and v.name in floats]
    # after keep_fp16_rounding a float16 graph output's name is on its Identity: look names up afterwards
    by_name = {v.name: v for n in graph for v in n.outputs if v.name}
    by_name.update({v.name: v for v in graph.inputs if v.name})
    wanted = [name for name in dict.fromkeys([*watched, *(t for p in pairs.values() for pair in p for t in pair)])
              if name in by_name]
    if wanted:
        graph.outputs.clear()
        for name in wanted:
            v = by_name[name]
            if v.dtype is None:
                v.dtype = ir.DataType.FLOAT
            graph.outputs.append(v)
    return copy, pairs, watched


#: Environment variable that sets how many bytes of requested tensors one measuring run may return.
MEASURE_BYTES_ENV = "MOGRAPH_FP16_MEASURE_BYTES"
#: Default of :data:`MEASURE_BYTES_ENV`: 512 MiB.
MEASURE_BYTES = 512 * 2**20

#: Bytes of float32-side tensors the measuring groups may hold for the later groups, over all samples (at
#: least :data:`MEASURE_BYTES`' setting): beyond it the later groups compute them again from the inputs.
CARRY_BYTES = 256 * 2**20


def _measure_bytes() -> int:
    raw = os.environ.get(MEASURE_BYTES_ENV, "").strip()
    if not raw:
        return MEASURE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise OptionError(f"{MEASURE_BYTES_ENV}={raw!r}: give a positive number of bytes")
    return value


def _bind_custom(model: ir.Model, ops: Mapping[tuple[str, str], CustomOp], bind: dict[str, int]) -> None:
    """Bind the symbolic dims ONNX inference leaves on custom ops' outputs to what the ops' own rules say.

    ONNX infers a custom op through its function body, whose attribute-driven ``Reshape`` leaves the output's
    last dim a fresh symbol (``unk__N``: a ``WeightOnlyMatMul``'s ``N``, a ``BlockQuantizedGather``'s ``K``);
    the nodes ONNX inferred after it carry the same symbol.  In graph order, each custom op's ``infer_shapes``
    rewrites its outputs' shapes on ``model`` (a copy), and every symbol the rule turns into a number is
    bound, so those downstream tensors are sized too."""
    for node in model.graph:
        op = ops.get((node.domain, node.op_type))
        if op is None or op.infer_shapes is None:
            continue
        before = [v.shape for v in node.outputs]
        try:
            op.infer_shapes(node)
        except Exception:  # noqa: BLE001 - best effort, as the inference above
            logger.debug("fp16: shape rule of %s failed", node.op_type, exc_info=True)
            continue
        for old, v in zip(before, node.outputs):
            if old is None or v.shape is None or len(old) != len(v.shape):
                continue
            for was, now in zip(old, v.shape):
                known = now if isinstance(now, int) else bind.get(str(now)) if now.value is not None else None
                if not isinstance(was, int) and was.value is not None and known is not None:
                    bind.setdefault(str(was), int(known))


def _tensor_sizes(model: ir.Model, feed: cal.Feed,
                  ops: Mapping[tuple[str, str], CustomOp] | None = None) -> dict[str, int | None]:
    """Number of elements of every tensor of ``model`` on ``feed`` (``None`` where not inferred).

    ONNX shape inference on a copy whose graph inputs have ``feed``'s shapes; a symbolic dim left is
    bound by its name to the feed's dim of the same name, or to what a custom op's rule among ``ops`` says
    (:func:`_bind_custom`); a size still unknown is estimated as the sum of its node's input sizes (exact
    for elementwise ops, reshapes and concatenations; an estimate otherwise, which counts a weight's
    elements as if they were the output's).
    """
    copy = ir_io.copy_model(model)
    bind: dict[str, int] = {}
    for v in copy.graph.inputs:
        if v.name in feed:
            arr = np.asarray(feed[v.name])
            if v.shape is not None and len(v.shape) == arr.ndim:
                bind.update((str(d), int(n)) for d, n in zip(v.shape, arr.shape) if isinstance(d, ir.SymbolicDim)
                            and d.value is not None)
            v.shape = ir.Shape(list(arr.shape))
    for node in copy.graph:
        for v in node.outputs:
            v.shape = None
    try:
        run_shape_inference(copy)
    except Exception:  # noqa: BLE001 - best effort: sizes are then estimated from inputs
        logger.debug("fp16: shape inference for the measuring chunks failed", exc_info=True)
    if ops:
        _bind_custom(copy, ops, bind)
    sizes: dict[str, int | None] = {}
    for v in [*copy.graph.inputs, *copy.graph.initializers.values(), *(o for n in copy.graph for o in n.outputs)]:
        if not v.name:
            continue
        count: int | None = None
        if v.shape is not None:
            count = 1
            for d in v.shape:
                n = d if isinstance(d, int) else bind.get(str(d)) if d.value is not None else None
                if n is None:
                    count = None
                    break
                count *= n
        sizes[v.name] = count
    # what inference left unknown (a Range from shape arithmetic and everything after it) is estimated from
    # the node's inputs, in graph order, so an estimate follows the tensors it is computed from
    for node in copy.graph:
        for v in node.outputs:
            if v.name and sizes.get(v.name) is None:
                sizes[v.name] = _estimate(node, v, sizes)
    return sizes


def _estimate(node: ir.Node, v: ir.Value, sizes: dict[str, int | None]) -> int | None:
    """Elements of ``v`` (an output of ``node`` that inference did not size) from its inputs' sizes.

    The largest computed (non-constant) input, or their sum for a ``Concat``: exact for elementwise ops,
    reshapes and concatenations.  Weights count only when no computed input is sized (a weight says nothing
    of the rows an activation has).  The dims that inference did give are a floor.  Never a sum over a
    node's inputs otherwise: along a residual chain (``x + f(x)`` in every layer) sums double per node, and
    one unsized dim at a BERT's embeddings made every later tensor exabytes, so the measurement was split
    into a group per node (153 sessions on BERT-base, minutes)."""
    inputs = [i for i in node.inputs if i is not None]
    computed = [sizes.get(i.name or "") for i in inputs if i.const_value is None]
    known = [c for c in computed if c is not None]
    if not known:
        known = [c for c in (sizes.get(i.name or "") for i in inputs) if c is not None]
    guess = (sum(known) if node.op_type == "Concat" else max(known)) if known else 0
    if v.shape is not None:
        floor = math.prod(d for d in v.shape if isinstance(d, int))
        guess = max(guess, floor)
    return guess or None


def _chunks(model: ir.Model, positions: Sequence[int], floats: set[str], pinned_out: dict[int, frozenset[int]],
            feed: cal.Feed, budget: int, ops: Mapping[tuple[str, str], CustomOp] | None = None,
            ) -> list[tuple[list[int], set[int], bool]]:
    """Groups of work for one measuring session each: ``(twin positions, watched node positions, watch the
    graph inputs)``, in graph order, each requesting at most ``budget`` bytes per sample where its parts
    allow (one node whose own outputs exceed the budget is a group of its own)."""
    sizes = _tensor_sizes(model, feed, ops)
    known = [c for c in sizes.values() if c is not None]
    fallback = max(known) if known else 1

    def nbytes(v: ir.Value, itemsize: int | None = None) -> int:
        count = sizes.get(v.name or "")
        size = itemsize or (v.dtype.itemsize if v.dtype is not None and v.dtype.is_floating_point() else 4)
        return int(size * (fallback if count is None else count))

    twins = set(positions)
    units: list[tuple[int | None, int]] = []  # (node position or None for the graph inputs, bytes)
    inputs = sum(nbytes(v) for v in model.graph.inputs if v.name in floats)
    if inputs:
        units.append((None, inputs))
    for p, n in enumerate(model.graph):
        cost = 0
        for j, v in enumerate(n.outputs):
            if v.name and v.name in floats:
                cost += nbytes(v)
                if p in twins:
                    cost += nbytes(v, 4 if j in pinned_out.get(p, ()) else 2)
        if cost or p in twins:
            units.append((p, cost))
    groups: list[tuple[list[int], set[int], bool]] = []
    used = budget + 1
    for unit, cost in units:
        if not groups or used + cost > budget:
            groups.append(([], set(), False))
            used = 0
        used += cost
        if unit is None:
            groups[-1] = (groups[-1][0], groups[-1][1], True)
        else:
            groups[-1][1].add(unit)
            if unit in twins:
                groups[-1][0].append(unit)
    return groups



@dataclass
class _Carry:
    """Float32-side tensors one measuring group hands to the next (:func:`_carry_plan`)."""

    bounds: list[tuple[int, int]]  # per group: the node positions [start, end) it computes
    last_use: dict[str, int]  # value name -> position of its last top-level consumer


def _carry_plan(model: ir.Model, groups: Sequence[tuple[list[int], set[int], bool]]) -> _Carry | None:
    """Where each group of :func:`measure_local` starts and ends in graph order, and the last consumer of
    each node output; ``None`` (every group computes the whole model, as before) when the graph has
    subgraphs (their implicit outer-scope reads are not node inputs) or the groups are not in graph order."""
    nodes = list(model.graph)
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for n in nodes for a in n.attributes.values()):
        return None
    starts = [min(w) if w else None for _, w, _ in groups]
    known = [s for s in starts if s is not None]
    if known != sorted(known) or len(set(known)) != len(known):
        return None
    bounds: list[tuple[int, int]] = []
    for k, s in enumerate(starts):
        if s is None:
            bounds.append((0, 0))
            continue
        later = [t for t in starts[k + 1:] if t is not None]
        bounds.append((0 if s == known[0] else s, later[0] if later else len(nodes)))
    where = {id(n): i for i, n in enumerate(nodes)}
    last_use: dict[str, int] = {}
    for n in nodes:
        for v in n.outputs:
            if not v.name:
                continue
            uses = [where.get(id(u.node)) for u in v.uses()]
            if any(u is None for u in uses):
                return None
            if uses:
                last_use[v.name] = max(u for u in uses if u is not None)
    return _Carry(bounds, last_use)


def _cut(twin: ir.Model, carried_in: Mapping[str, np.ndarray], carry_out: Sequence[str]) -> list[str]:
    """Make ``twin`` (a group's measuring copy) read ``carried_in`` (tensors an earlier group computed, by
    name) as graph inputs, also return ``carry_out``, and drop every node its outputs do not need.

    ONNX Runtime runs every node of a graph whatever outputs a run asks for, so without this each group
    computed the whole float32 model again (4 groups: 4 whole models per sample on a 135M decoder).  The
    float32 nodes a group keeps compute from the same float32 tensors as before, so every figure is the same.
    Returns the names of the graph outputs, in order."""
    graph = twin.graph
    by_name = {v.name: v for n in graph for v in n.outputs if v.name}
    taken = set(by_name) | {v.name for v in graph.inputs if v.name} | set(graph.initializers)
    for name, array in carried_in.items():
        v = by_name.get(name)
        if v is None or not v.uses():
            continue
        fed = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
        v.name = fresh_name(taken, f"{name}_recomputed")  # its producer stays only for another output
        for use in list(v.uses()):
            use.node.replace_input_with(use.idx, fed)
        graph.inputs.append(fed)
    outs = {v.name for v in graph.outputs}
    for name in carry_out:
        v = by_name.get(name)
        if v is not None and name not in outs and v.name == name:
            graph.outputs.append(v)
            outs.add(name)
    needed: set[int] = set()
    stack = [v.producer() for v in graph.outputs]
    while stack:
        n = stack.pop()
        if n is None or id(n) in needed:
            continue
        needed.add(id(n))
        stack.extend(x.producer() for x in n.inputs if x is not None)
    graph.remove([n for n in graph if id(n) not in needed], safe=True)
    for name, v in list(graph.initializers.items()):  # not serialized for the session
        if not v.uses() and not v.is_graph_output() and not v.is_graph_input():
            del graph.initializers[name]
    return [v.name or "" for v in graph.outputs]


def measure_local(model: ir.Model, positions: Sequence[int], floats: set[str], pinned_in: dict[int, frozenset[int]],
                  pinned_out: dict[int, frozenset[int]], retype: Callable[[ir.Node], None],
                  source: Iterable[cal.Feed], *, progress: Callable[[int, int | None], None] | None = None,
                  total: int | None = None, ops: Mapping[tuple[str, str], CustomOp] | None = None,
                  outputs: int = 0) -> LocalMeasure:
    """Run the float32 model and every twin on each sample of ``source`` (module docstring).

    **Memory.**  Every float tensor and every twin output is read back, which on an LLM is gigabytes per
    sample (issue 31: 5,568 nodes of a 270M decoder, 268 MB of logits alone).  So the nodes are split, in
    graph order, into groups whose requested tensors take at most :data:`MEASURE_BYTES` (512 MiB, or
    ``$MOGRAPH_FP16_MEASURE_BYTES``) per sample — sizes from ONNX shape inference with the first sample's
    input shapes, or estimated from the node's inputs where inference gives none (:func:`_tensor_sizes`)
    — and each group gets its own session
    with only its twins and only its tensors as outputs, run over every sample (``source`` is iterated
    once per group: a :class:`~mograph.passes.quant.calibration.CalibrationSource` or a list).  A node's
    figures come from one group, summed over the samples in the same order, so every number is the one
    a single session over all nodes gives.

    **Time.**  ONNX Runtime runs every node of a session's graph whatever a run fetches, so each group would
    compute the whole float32 model again.  Instead a group also reads back the tensors its nodes write that
    a later node reads (not a ``Constant``'s), held for every sample up to ``max(budget, CARRY_BYTES)``
    (beyond it the later groups compute them again), takes those of the earlier groups as graph inputs, and
    keeps only the nodes its outputs need (:func:`_cut`): the float32 model is computed about once per
    sample, from the same float32 tensors, so with the same numbers.  Not for a graph with subgraphs.
    ``outputs``: also keep the model's own outputs for the first ``outputs`` samples
    (:attr:`LocalMeasure.outputs`), for the accuracy budget's float32 reference (not beyond
    ``max(budget, CARRY_BYTES)``, nor for a model with float16 tensors of its own: ``None`` then).
    ``ops``: the declared custom ops (the registry's), whose shape rules size their outputs.
    """
    if iter(source) is source:  # a one-shot iterator: each group reads every sample
        source = list(source)
    first = next(iter(source), None)
    groups = _chunks(model, positions, floats, pinned_out, first, _measure_bytes(), ops) if first is not None else []
    if not groups:
        groups = [(list(positions), set(range(len(model.graph))), True)]
    _spill.free_dropped(model)  # the shape-inference copy, before the first session
    if len(groups) > 1:
        logger.info("fp16: measuring %d nodes in %d groups of at most %d bytes of tensors per sample",
                    len(positions), len(groups), _measure_bytes())
    result = LocalMeasure()
    num: dict[int, float] = {}
    den: dict[int, float] = {}
    runs = 0
    plan = _carry_plan(model, groups)
    model_nodes = list(model.graph)
    where = {id(n): i for i, n in enumerate(model_nodes)}
    out_names = [v.name or "" for v in model.graph.outputs]
    produced = {v.name or "": where.get(id(v.producer())) for v in model.graph.outputs}
    if any(p is None for p in produced.values()):
        outputs = 0  # an output no node writes (a graph input, a constant): the caller runs the model
    if any(v.dtype == ir.DataType.FLOAT16 for n in model_nodes for v in n.outputs):
        # float16 tensors of the model's own: the measuring copy keeps their rounding (keep_fp16_rounding),
        # which a session of the model drops (Cast pairs ORT's CPU provider removes): not the same outputs
        outputs = 0
    captured: list[dict[str, np.ndarray]] = [{} for _ in range(outputs)] if plan is not None else []
    captured_bytes = 0  # held at most max(budget, CARRY_BYTES), as the carried tensors
    # per sample, the float32-side tensors computed by the groups so far that a later node reads
    carried: list[dict[str, np.ndarray]] = []
    carrying = plan is not None
    todo = list(enumerate(groups))
    while todo:
        k, (chunk, watch_nodes, watch_inputs) = todo.pop(0)
        chunk = [p for p in chunk if p not in result.no_kernel]
        twin_names: dict[str, int] = {}
        twin, pairs, watched = _twin_model(model, chunk, floats, pinned_in, pinned_out, retype, watch_nodes,
                                           watch_inputs, twin_names)
        carry_out: list[str] = []
        own: list[str] = []  # the model's outputs this group writes, read back for the first samples
        if plan is not None:
            start, end = plan.bounds[k]
            if carrying and end < len(model_nodes):
                # not a Constant's: ONNX Runtime reads a Constant as an initializer (a MatMul prepacks it)
                carry_out = [v.name for n in model_nodes[start:end] if n.op_type != "Constant" for v in n.outputs
                             if v.name and plan.last_use.get(v.name, -1) >= end]
            own = [name for name, p in produced.items() if name and p is not None and start <= p < end]
            names = _cut(twin, carried[0] if carried else {}, [*carry_out, *(own if captured else [])])
        else:
            names = [v.name or "" for v in twin.graph.outputs]
        names_in = {v.name for v in twin.graph.inputs}
        # too big for one protobuf: spilled to a file, which the session reads; the twin (its float16 copies
        # of the weights) is freed before the session is made, not beside it (measured: 0.5x the weights)
        payload = _spill.payload(twin, cal.model_folder(model))
        del twin
        _spill.free_dropped(model)  # the twin: a copy of about the model's size
        try:
            sess = cal._session(payload)
        except Exception as exc:  # noqa: BLE001 - ORT's own types; only a refused twin is handled here
            if _refused_twin(exc, twin_names, result) is None:
                raise
            todo.insert(0, (k, (chunk, watch_nodes, watch_inputs)))  # again, without that twin
            continue
        del payload
        for name in watched:
            result.stats[name] = cal.TensorStats()
        num.update(dict.fromkeys(pairs, 0.0))
        den.update(dict.fromkeys(pairs, 0.0))
        samples = 0
        refused = False
        handed: list[dict[str, np.ndarray]] = []  # this group's carry_out, per sample
        handed_bytes = 0
        for index, feed in enumerate(source):
            # a feed the model rejects is the same one-line OptionError (exit 2) as in every precision pass;
            # a float16 twin that ONNX Runtime cannot run is not the feed's fault: that node stays float32
            if carried:
                feed = {**feed, **{k2: a for k2, a in carried[index].items() if k2 in names_in}}
            try:
                outs = dict(zip(names, cal._run_feed(sess, names, feed, source, index)))
            except OptionError as exc:
                if _refused_twin(exc.__cause__ or exc, twin_names, result) is None:
                    raise
                refused = True
                break
            for name in watched:
                result.stats[name].update(outs[name], False)
            for pos, compare in pairs.items():
                for ref_name, twin_name in compare:
                    _compare(result, num, den, pos, outs[ref_name], outs[twin_name])
            if carry_out:
                # tensors only (a sequence is computed again by the groups that read it)
                handed.append({name: outs[name] for name in carry_out if isinstance(outs.get(name), np.ndarray)})
                handed_bytes += sum(a.nbytes for a in handed[-1].values())
            if index < len(captured):
                captured[index].update((name, outs[name]) for name in own if name in outs)
                captured_bytes += sum(getattr(outs[name], "nbytes", 0) for name in own if name in outs)
                if captured_bytes > max(_measure_bytes(), CARRY_BYTES):
                    captured = []  # not held through the measurement: the caller runs the model for them
            del outs
            samples += 1
            runs += 1
            if progress is not None:
                progress(runs, total * len(groups) if total is not None else None)
        del sess
        _spill.trim_heap()  # the session's buffers back to the system, before the next group's or the caller's
        if refused:  # this group again from its first sample, without the refused twin
            for pos in pairs:
                num.pop(pos, None)
                den.pop(pos, None)
                result.overflow.pop(pos, None)
            todo.insert(0, (k, (chunk, watch_nodes, watch_inputs)))
            continue
        result.samples = samples
        if carrying and plan is not None:
            end = plan.bounds[k][1]
            if handed_bytes + sum(a.nbytes for c in carried for a in c.values()) > max(_measure_bytes(), CARRY_BYTES):
                carrying, carried = False, []  # too much to hold for every sample: later groups compute it again
            else:
                carried = [{name: a for name, a in (carried[i] if carried else {}).items()
                            if plan.last_use.get(name, -1) >= end} | (handed[i] if handed else {})
                           for i in range(samples)]
        del handed
    result.error = {pos: (num[pos] / den[pos]) ** 0.5 if den[pos] > 0 else (0.0 if num[pos] == 0 else float("inf"))
                    for pos in num}
    if captured and all(name in c for c in captured[:result.samples] for name in produced):
        result.outputs = [[c[name] for name in out_names] for c in captured[:result.samples]]
    return result


def _refused_twin(exc: BaseException, twin_names: Mapping[str, int], result: LocalMeasure) -> int | None:
    """The position of the float16 twin that ONNX Runtime's error ``exc`` names, recorded in
    ``result.no_kernel`` with the reason (``ScatterElements`` with ``reduction='add'`` has no float16 CPU
    kernel although its schema allows float16); ``None`` when no twin is named (not a float16 problem)."""
    text = " ".join(str(exc).split())
    for name, pos in twin_names.items():
        if f"'{name}'" in text and pos not in result.no_kernel:
            result.no_kernel[pos] = cal._ort_reason(exc)[:300]
            logger.info("fp16: ONNX Runtime cannot run node %s in float16 (%s): kept float32",
                        name, result.no_kernel[pos])
            return pos
    return None


def _compare(result: LocalMeasure, num: dict[int, float], den: dict[int, float], pos: int,
             ref32: np.ndarray, out16: np.ndarray) -> None:
    """Add one output of one sample to node ``pos``'s error sums (or its overflow).

    The sums are those of float64 copies of the finite positions, in C order; where every position is
    finite (nearly always), those copies are the whole arrays raveled, made without the boolean-mask
    copies and with the finiteness tested on the arrays as ONNX Runtime gave them: the same numbers."""
    ref_a, out_a = np.asarray(ref32), np.asarray(out16)
    finite = np.isfinite(ref_a)
    if finite.all() and ref_a.shape == out_a.shape:
        bad = ~np.isfinite(out_a)
        if bad.any():
            peak = float(np.abs(np.asarray(ref_a[bad], np.float64)).max())
            result.overflow[pos] = max(result.overflow.get(pos, 0.0), peak)
            return
        del bad, finite
        # clipped before the widening: +-65504 is exact in every float type, so the same float64 values
        sat = np.asarray(np.clip(ref_a, -FP16_LIMIT, FP16_LIMIT), np.float64).ravel()
        diff = np.array(out_a, np.float64).ravel()
        diff -= sat
        num[pos] += float((diff**2).sum())
        den[pos] += float((sat**2).sum())
        return
    ref = np.asarray(ref32, np.float64)
    y16 = np.asarray(out16, np.float64)
    finite = np.isfinite(ref)
    bad = finite & ~np.isfinite(y16)
    if bad.any():
        peak = float(np.abs(ref[bad]).max())
        result.overflow[pos] = max(result.overflow.get(pos, 0.0), peak)
        return
    sat = np.clip(ref[finite], -FP16_LIMIT, FP16_LIMIT)
    del ref, bad
    diff = y16[finite]
    del y16, finite
    diff -= sat
    num[pos] += float((diff**2).sum())
    den[pos] += float((sat**2).sum())


#: Outputs whose largest magnitude (in both models) is at most this are not judged by cosine: the floor
#: the verifier uses for a cosine-only tolerance (:func:`mograph.validate.compare_outputs`).
SIGNAL_FLOOR = 1e-6


def _rows(a: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """``a`` at the real (not padded) positions ``keep`` [batch, seq] when its leading dims are those."""
    if keep is None or a.ndim < 2 or a.shape[:2] != keep.shape:
        return a
    return a[keep]


def output_value(budget: Budget, ref: np.ndarray, out: np.ndarray) -> float:
    """One output of one sample judged as the verifier judges it: float64, NaN (or the same infinity) where
    both have it is agreement, a non-finite value alone is a failure, all-zero against all-zero agrees,
    an output whose values all stay within :data:`SIGNAL_FLOOR` is not judged by cosine.  The cosine is
    made scale-aware: at most ``1 - e^2 / 2`` for a relative norm error ``e``.

    Two float arrays without NaN or infinity (nearly always) are checked as they come and turned float64
    once, for the sums: the same figure with less memory traffic (a 135M decoder's logits, 8 x 12.6M values)."""
    r_in, o_in = np.asarray(ref).ravel(), np.asarray(out).ravel()
    if (r_in.dtype.kind == "f" and o_in.dtype.kind == "f" and r_in.shape == o_in.shape
            and np.isfinite(r_in).all() and np.isfinite(o_in).all()):
        if budget.metric != "cosine" or not r_in.size:
            return output_value_exact(budget, r_in, o_in)
        if np.abs(r_in).max() <= SIGNAL_FLOOR and np.abs(o_in).max() <= SIGNAL_FLOOR:
            return 1.0
        return _cosine(np.asarray(r_in, np.float64), np.asarray(o_in, np.float64))
    return output_value_exact(budget, r_in, o_in)


def output_value_exact(budget: Budget, ref: np.ndarray, out: np.ndarray) -> float:
    """:func:`output_value` as it was written first, everything in float64 (NaN and infinity handled)."""
    r = np.asarray(ref, np.float64).ravel()
    o = np.asarray(out, np.float64).ravel()
    if r.shape != o.shape:
        return -1.0 if budget.metric == "cosine" else float("inf")
    both = (np.isnan(r) & np.isnan(o)) | (np.isinf(r) & (r == o))
    if both.any():
        r, o = np.where(both, 0.0, r), np.where(both, 0.0, o)
    if not (np.isfinite(r).all() and np.isfinite(o).all()):
        return -1.0 if budget.metric == "cosine" else float("inf")
    if budget.metric != "cosine":
        return float(np.abs(r - o).max()) if r.size else 0.0
    if not r.size or (np.abs(r).max() <= SIGNAL_FLOOR and np.abs(o).max() <= SIGNAL_FLOOR):
        return 1.0
    return _cosine(r, o)


def _cosine(r: np.ndarray, o: np.ndarray) -> float:
    """The scale-aware cosine of two finite float64 vectors, not both within the signal floor."""
    nr, no = float(np.linalg.norm(r)), float(np.linalg.norm(o))
    if nr == 0.0 or no == 0.0:
        return 0.0
    cos = max(-1.0, min(1.0, float(r @ o / (nr * no))))
    # a cosine is blind to scale: an output uniformly 2x off (a divisor saturated at 65504 in float16) kept
    # cosine 1.  Its norm's relative error e counts as the cosine of an angle error of the same size,
    # 1 - e^2 / 2, so a scale error is judged like a direction error and never loosens the cosine
    rel = abs(no - nr) / nr
    return min(cos, 1.0 - 0.5 * rel * rel)


def output_metric(budget: Budget, refs: list[list[np.ndarray]], outs: list[list[np.ndarray]],
                  keeps: Sequence[np.ndarray | None] | None = None) -> float:
    """The budget's metric: the smallest cosine, or the largest |diff|, over every float output of every sample.

    Each output is judged on its own, as ``--verify`` judges it (:func:`output_value`), never concatenated
    with the others: a small output (a probability map in float16's subnormal range) next to a large one
    keeps its own figure.  ``keeps`` (per sample, ``[batch, seq]`` of real positions, or ``None``) leaves
    out the positions the ``attention_mask`` marks as padding: no output value there is read (a padded
    row's attention is over nothing, and its float32 and float16 garbage differ), as in calibration.
    """
    values = []
    for s, (ref, out) in enumerate(zip(refs, outs)):
        keep = keeps[s] if keeps is not None and s < len(keeps) else None
        for r, o in zip(ref, out):
            if not (np.issubdtype(np.asarray(r).dtype, np.floating) or np.issubdtype(np.asarray(o).dtype, np.floating)):
                continue
            values.append(output_value(budget, _rows(np.asarray(r), keep), _rows(np.asarray(o), keep)))
    if not values:
        return 1.0 if budget.metric == "cosine" else 0.0
    return min(values) if budget.metric == "cosine" else max(values)


@dataclass
class Search:
    """The outcome of :func:`fewest_fp32`."""

    keep: list[int]  # positions kept in float32 to meet the budget, most sensitive first
    metric: float  # the budget's metric with them kept
    met: bool
    evaluations: int
    tried: dict[int, float]  # how many kept -> metric measured


def fewest_fp32(ranked: Sequence[int], evaluate: Callable[[set[int]], float], budget: Budget) -> Search:
    """The smallest prefix of ``ranked`` (most sensitive first) to keep in float32 so the budget is met.

    ``evaluate(kept)`` converts a copy with ``kept`` also in float32 and returns the budget's metric.
    With none kept first; then a binary search (the metric is taken to improve as more are kept).  Where even
    keeping every ranked node misses the budget, it keeps them all only if that measured better than keeping none.
    """
    tried: dict[int, float] = {}

    def with_k(k: int) -> float:
        if k not in tried:
            tried[k] = evaluate(set(ranked[:k]))
            logger.info("fp16: keeping %d measured node(s) in float32 gives %s=%.6g", k, budget.metric, tried[k])
        return tried[k]

    lo, hi = 0, len(ranked)
    if budget.met(with_k(0)):
        hi = 0
    elif not budget.met(with_k(hi)):
        # not met even with every ranked node kept: keep them all only where that measured better than none (a
        # real Qwen2.5-Coder-0.5B: all float16 0.999889, all 242 kept 0.99985: keeping them cost speed for nothing)
        better = with_k(hi) > with_k(0) if budget.metric == "cosine" else with_k(hi) < with_k(0)
        if not better:
            hi = 0
    else:
        while lo + 1 < hi:  # with_k(lo) fails, with_k(hi) meets
            mid = (lo + hi) // 2
            if budget.met(with_k(mid)):
                hi = mid
            else:
                lo = mid
    return Search(list(ranked[:hi]), with_k(hi), budget.met(with_k(hi)), len(tried), tried)
