"""Calibration: where the feeds come from, how intermediate tensors are observed, and the calibrators.

Quantization needs the range of every tensor it quantizes, measured on data that looks like what the
model will see.  This module provides three things:

**Sources** (:func:`open_source`).  ``--calibration-data`` is one of

- a folder of ``.npz`` files, each one feed (``{input name: array}``), read one at a time in name order;
- one ``.npz`` file of stacked feeds: every array has one more leading axis than the model input (sample
  ``i`` is ``array[i]``), or the same rank (sample ``i`` is ``array[i:i+1]``, a batch of one);
- ``module:function`` (the current folder is on the import path for it) or ``file.py:function``
  (loaded by path, relative to the current folder): the function is called (again for every pass over
  the data) and returns an iterable of feeds, so data can be generated or read lazily.

Through the Python API it may also be a list of feeds, a callable returning an iterable of feeds, a
re-iterable object (iterated again for every pass), or a generator / one-shot iterator, which is kept in
memory as it streams and replayed for later passes.

Random data is never used silently: :class:`RandomSource` exists only for an explicit
``--calibration-random N``, and the passes report it prominently.

**Observation** (:func:`observe`).  A copy of the model is given the tensors to watch as extra graph
outputs and run by ONNX Runtime with its graph optimizations off (so the tensors observed are the
tensors of the graph, not of a fused one).  Feeds are processed one at a time and folded into
per-tensor statistics (:class:`TensorStats`: min, max, largest magnitude, largest reduced extent and a
signed histogram), so memory does not grow with the number of samples; samples may have different shapes
(sentences of different lengths).  Progress is logged at INFO and given to an optional callback.

**Calibrators** turn statistics into a ``(low, high)`` range per tensor:

- ``minmax``: the observed extremes;
- ``percentile``: the ``p``-th percentile at each end of the histogram (clips rare outliers);
- ``entropy``: the symmetric threshold minimising the KL divergence between the histogram and its
  128-level quantized version (the TensorRT INT8 calibration method).

The histogram covers ``[-R, R]`` with a fixed number of bins; when a sample exceeds ``R`` the range doubles
and neighbouring bins merge, so no sample needs to be kept to rebin later.

Code layout: the statistics and the calibrators live in ``_calibrators`` (they need no model and no runtime);
this module re-exports them beside the sources and the observation.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant._calibrators import CALIBRATORS, TensorStats, compute_ranges, needs_histogram, scaled_stats

from mograph import _spill
from mograph.errors import BackendUnavailableError, OptionError
from mograph.irutil import fresh_name

__all__ = [
    "Feed",
    "CalibrationSource",
    "RandomSource",
    "open_source",
    "TensorStats",
    "observe",
    "CALIBRATORS",
    "compute_ranges",
    "needs_histogram",
    "run_model",
    "feed_rejected",
    "infer_dtypes",
    "padding_mask_input",
    "collect",
    "scaled_stats",
]

logger = logging.getLogger(__name__)

Feed = dict[str, np.ndarray]
ProgressCallback = Callable[[int, "int | None"], None]

# ------------------------------------------------------------------------------------------- sources


@dataclass
class _InputSpec:
    name: str
    dtype: np.dtype
    rank: int | None
    shape: tuple[int | str | None, ...] | None


def _input_specs(model: ir.Model) -> list[_InputSpec]:
    specs = []
    for v in model.graph.inputs:
        if v.is_initializer():
            continue
        dtype = v.dtype.numpy() if v.dtype is not None else np.dtype(np.float32)
        shape = None
        if v.shape is not None:
            shape = tuple(d if isinstance(d, int) else (str(d) if d is not None else None) for d in v.shape)
        specs.append(_InputSpec(v.name or "", np.dtype(dtype), len(shape) if shape is not None else None, shape))
    return specs


class CalibrationSource:
    """A re-iterable stream of feeds. ``description`` says where they come from (for the report)."""

    random = False

    def __init__(self, factory: Callable[[], Iterable[Mapping[str, Any]]], description: str,
                 model: ir.Model, limit: int | None = None, count: int | None = None) -> None:
        self._factory = factory
        self.description = description
        self._specs = _input_specs(model)
        self.limit = limit if limit else None
        self._count = count

    @property
    def count(self) -> int | None:
        """Number of samples one pass yields, when known in advance."""
        if self._count is None:
            return self.limit
        return min(self._count, self.limit) if self.limit else self._count

    def __iter__(self) -> Iterator[Feed]:
        feeds = self._factory()
        if self.limit is not None:  # islice: a stream is not read one feed beyond the limit
            feeds = itertools.islice(feeds, self.limit)
        for i, raw in enumerate(feeds):
            yield self._check(raw, i)

    def _check(self, raw: Mapping[str, Any], index: int) -> Feed:
        if not isinstance(raw, Mapping):
            raise OptionError(f"calibration sample {index} from {self.description} is not a dict of arrays")
        names = [s.name for s in self._specs]
        missing = [n for n in names if n not in raw]
        if missing:
            raise OptionError(
                f"calibration sample {index} from {self.description} lacks model input(s) {missing} "
                f"(it has {sorted(raw)})"
            )
        feed: Feed = {}
        for spec in self._specs:
            arr = np.asarray(raw[spec.name])
            if spec.rank is not None and arr.ndim != spec.rank:
                raise OptionError(
                    f"calibration sample {index} from {self.description}: input {spec.name!r} has rank "
                    f"{arr.ndim}, the model expects {spec.rank}"
                )
            feed[spec.name] = arr.astype(spec.dtype, copy=False)
        return feed


class RandomSource(CalibrationSource):
    """Seeded random feeds. Only ever used when the user asks for it explicitly."""

    random = True

    def __init__(self, model: ir.Model, samples: int, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 seed: int = 0) -> None:
        specs = _input_specs(model)
        shapes = dict(shapes or {})
        vocab = _vocab_sizes(model)
        #: Inputs whose dynamic dims were set to 1 (no ``--shape`` for them): the likely culprits when
        #: the model rejects a random feed.
        self.defaulted = [
            s.name for s in specs
            if s.name not in shapes and any(not isinstance(d, int) for d in (s.shape or ()))
        ]

        sized = {s.name: tuple(shapes[s.name]) if s.name in shapes
                 else tuple(d if isinstance(d, int) else 1 for d in (s.shape or ())) for s in specs}
        sized.update(_decode_mask_sizes(specs, sized, set(shapes)))

        def make() -> Iterator[Feed]:
            rng = np.random.default_rng(seed)
            for _ in range(samples):
                feed = {}
                for s in specs:
                    shape = sized[s.name]
                    if np.issubdtype(s.dtype, np.floating):
                        feed[s.name] = rng.standard_normal(shape).astype(s.dtype)
                    elif s.dtype == np.bool_:
                        feed[s.name] = rng.integers(0, 2, shape).astype(np.bool_)
                    elif "mask" in s.name.lower():
                        feed[s.name] = np.ones(shape, dtype=s.dtype)
                    else:
                        feed[s.name] = rng.integers(0, vocab.get(s.name, 100), shape).astype(s.dtype)
                yield feed

        super().__init__(make, f"RANDOM data ({samples} seeded samples)", model, count=samples)


def _decode_mask_sizes(specs: list[_InputSpec], sized: Mapping[str, tuple[int, ...]], given: set[str]
                       ) -> dict[str, tuple[int, ...]]:
    """The shapes of a decode step's attention masks: ``[batch, past + new]``.

    A decoder's decode step takes its KV cache (float inputs of rank 4 named ``past...``, ``[batch, heads,
    past, head_dim]``) and an attention mask over every position, past and new; the mask's last dim is a
    symbol of its own (``total``) that the model computes as ``past + new``.  Sized 1 like the other dynamic
    dims, the mask disagrees with the cache and the model rejects the feed.  For each rank-2 integer input
    named ``...mask`` whose last dim is such an unshared symbol (and not sized by ``--shape``), the last dim
    becomes the cache's past length plus the token ids' last dim (a rank-2 integer input that is not a
    mask).  Nothing changes for a model without such a cache.
    """
    cache = [s for s in specs if s.rank == 4 and np.issubdtype(s.dtype, np.floating) and "past" in s.name.lower()
             and s.shape is not None and not isinstance(s.shape[2], int)]
    ids = [s for s in specs if s.rank == 2 and np.issubdtype(s.dtype, np.integer) and "mask" not in s.name.lower()]
    if not cache or not ids:
        return {}
    symbols = [d for s in specs for d in (s.shape or ()) if isinstance(d, str)]
    past = sized[cache[0].name][2]
    new = sized[ids[0].name][1]
    out: dict[str, tuple[int, ...]] = {}
    for s in specs:
        if (s.name in given or s.rank != 2 or "mask" not in s.name.lower() or s.shape is None
                or not np.issubdtype(s.dtype, np.integer)):
            continue
        last = s.shape[1]
        if isinstance(last, str) and symbols.count(last) == 1:
            out[s.name] = (sized[s.name][0], past + new)
    return out


def _vocab_sizes(model: ir.Model) -> dict[str, int]:
    """For integer graph inputs used as Gather indices into an initializer: that table's row count (the
    smallest, if several), also through ops that keep the values (:data:`_VALUE_PRESERVING`: torchaudio's
    RNN-T predictor transposes its targets before the embedding; read directly only, its random ids went
    past the table's 50 rows and every random calibration failed, exit 2).

    A table stored block-quantized (``mograph.BlockQuantizedGather``, or ONNX Runtime's
    ``com.microsoft.GatherBlockQuantized``) counts too: its rows are the data's first axis (its gather axis),
    whatever the packing of the others.
    """
    out: dict[str, int] = {}
    for v in model.graph.inputs:
        frontier, seen = [(v, 0)], set()
        while frontier:
            val, depth = frontier.pop()
            if id(val) in seen:
                continue
            seen.add(id(val))
            for use in val.uses():
                node = use.node
                if node.domain in ("", "ai.onnx") and node.op_type in _VALUE_PRESERVING and use.idx == 0 and depth < 4:
                    frontier.extend((o, depth + 1) for o in node.outputs)
                    continue
                gathers = node.op_type == "Gather" or (node.domain, node.op_type) in _BLOCK_QUANTIZED_GATHERS
                if gathers and use.idx == 1 and node.inputs[0] is not None:
                    table = node.inputs[0].const_value
                    attr = node.attributes.get("gather_axis" if node.domain == "com.microsoft" else "axis")
                    axis = attr.as_int() if attr is not None else 0
                    if table is not None and -len(table.shape) <= axis < len(table.shape):
                        rows = int(table.shape.numpy()[axis])
                        name = v.name or ""
                        out[name] = min(out.get(name, rows), rows)
    return out


#: Ops whose output holds the input's values (moved, repeated, retyped): indices read through them.
_VALUE_PRESERVING = frozenset({"Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Transpose",
                               "Tile"})


#: Gathers whose data input is a block-quantized table: their indices pick rows of it.
_BLOCK_QUANTIZED_GATHERS = frozenset({("mograph", "BlockQuantizedGather"), ("com.microsoft", "GatherBlockQuantized")})


class _Replay:
    """A one-shot iterator of feeds made re-iterable: the first pass streams it and keeps what it yields,
    later passes replay that and go on where the first one stopped (a pass may be cut short by a limit).
    The feeds are held in memory; a callable that returns a fresh iterator avoids that."""

    def __init__(self, it: Iterator[Mapping[str, Any]]) -> None:
        self._it = it
        self._seen: list[Mapping[str, Any]] = []
        self._done = False

    def __call__(self) -> Iterator[Mapping[str, Any]]:
        i = 0
        while True:
            if i < len(self._seen):
                yield self._seen[i]
            elif self._done:
                return
            else:
                try:
                    item = next(self._it)
                except StopIteration:
                    self._done = True
                    return
                self._seen.append(item)
                yield item
            i += 1


def _npz_folder(folder: Path) -> Callable[[], Iterator[dict[str, np.ndarray]]]:
    files = sorted(folder.glob("*.npz"))
    if not files:
        raise OptionError(f"--calibration-data: folder {folder} holds no .npz files")

    def gen() -> Iterator[dict[str, np.ndarray]]:
        for f in files:
            with np.load(f, allow_pickle=False) as z:
                yield {k: z[k] for k in z.files}

    gen.count = len(files)  # type: ignore[attr-defined]
    return gen


def _npz_stacked(path: Path, specs: list[_InputSpec]) -> Callable[[], Iterator[dict[str, np.ndarray]]]:
    ranks = {s.name: s.rank for s in specs}
    with np.load(path, allow_pickle=False) as z:
        lengths = {k: z[k].shape[0] if z[k].ndim else 0 for k in z.files}
    if len(set(lengths.values())) != 1:
        raise OptionError(f"--calibration-data: arrays in {path} differ in their leading (sample) axis: {lengths}")

    def gen() -> Iterator[dict[str, np.ndarray]]:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        n = next(iter(lengths.values()))
        for i in range(n):
            feed = {}
            for k, a in arrays.items():
                rank = ranks.get(k)
                feed[k] = a[i : i + 1] if rank is not None and a.ndim == rank else a[i]
            yield feed

    gen.count = next(iter(lengths.values()))  # type: ignore[attr-defined]
    return gen


def _module_function(spec: str) -> Callable[[], Iterable[Mapping[str, Any]]]:
    """Resolve ``module:function`` (the current folder is importable, as for ``python -m``) or
    ``file.py:function`` (loaded by path); the import path is left as it was."""
    from mograph._user_code import load_function

    return load_function(spec, "--calibration-data", OptionError)


def open_source(data: Any, model: ir.Model, *, limit: int | None = None) -> CalibrationSource:
    """Open ``--calibration-data``: a path (folder or ``.npz``), ``module:function``, ``file.py:function``,
    a callable, a list, or any iterable of feeds (a generator too).

    Raises :class:`OptionError` for anything that is none of these.
    """
    if isinstance(data, CalibrationSource):
        return data
    if callable(data):
        return CalibrationSource(data, f"{getattr(data, '__name__', 'callable')}()", model, limit)
    if isinstance(data, (list, tuple)):
        items = list(data)
        return CalibrationSource(lambda: iter(items), f"{len(items)} in-memory feeds", model, limit, len(items))
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes, Path, Mapping)):
        if iter(data) is data:  # a generator or other one-shot iterator: kept as it streams, replayed after
            return CalibrationSource(_Replay(data), f"{type(data).__name__} of feeds", model, limit)
        return CalibrationSource(lambda: iter(data), f"{type(data).__name__} of feeds", model, limit)
    if not isinstance(data, (str, Path)):
        raise OptionError(
            f"--calibration-data: expected a path, module:function, a callable or an iterable of feeds, "
            f"not {type(data).__name__}"
        )
    path = Path(data)
    if path.is_dir():
        gen = _npz_folder(path)
        return CalibrationSource(gen, f"folder {path}", model, limit, gen.count)  # type: ignore[attr-defined]
    if path.suffix == ".npz":
        if not path.exists():
            raise OptionError(f"--calibration-data: file {path} does not exist")
        gen = _npz_stacked(path, _input_specs(model))
        return CalibrationSource(gen, f"stacked feeds {path}", model, limit, gen.count)  # type: ignore[attr-defined]
    text = str(data)
    if ":" in text and not path.exists():
        return CalibrationSource(_module_function(text), text, model, limit)
    raise OptionError(
        f"--calibration-data {text!r}: not a folder of .npz feeds, a .npz of stacked feeds, or module:function"
    )


# ------------------------------------------------------------------------------------------- observing


def _require_ort() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise BackendUnavailableError("onnxruntime (needed to calibrate)", "ort") from exc
    return ort


def _external_tensors(model: ir.Model) -> Iterator[ir.ExternalTensor]:
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                yield value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if not attr.is_ref() and isinstance(attr.value, ir.ExternalTensor):
                    yield attr.value


def model_folder(model: ir.Model) -> str | None:
    """The folder ``model``'s external data is read from (``None`` when it has none).

    A serialised copy keeps only the data's file names; ONNX Runtime, given bytes, would look for them
    in the working directory, so :func:`_session` is told this folder instead.
    """
    return next((str(t.base_dir) for t in _external_tensors(model) if t.base_dir), None)


def set_model_folder(model: ir.Model, folder: str | None) -> None:
    """Read the external data of ``model`` (a copy deserialised from bytes) from ``folder`` again."""
    if folder:
        for tensor in _external_tensors(model):
            tensor.base_dir = folder


def _session(model_bytes: Any, folder: str | None = None) -> Any:
    """An ONNX Runtime session (optimizations off) on ``model_bytes``, its external data in ``folder``.

    ``model_bytes`` may also be an ``onnx_ir.Model``, a ``ModelProto`` or a :class:`mograph._spill.Payload`
    (what :func:`_with_outputs_mapped` returns): one too big for a protobuf reaches ONNX Runtime as a
    file in a temporary folder (:mod:`mograph._spill`), never serialized whole.

    The CPU memory arena is off: these sessions read numbers, not time, and with the arena every buffer a
    run frees stays the process's (the float32 copies that the CPU provider's inserted Casts make of float16
    weights on each run among them).  The memory pattern stays on (one planned block per run; without it
    the heap fragments: see :func:`mograph.backends.ort.make_session`).  The intra-op threads do not spin
    between runs: the work between these runs is numpy's (GPTQ's factors, statistics), which spinning
    threads slow down (four runs of a 135M LLaMA on 256 tokens, the 2-core machine at load 7: 2.9 CPU-s
    without spinning, 4.4 with).  The numbers are the same.
    """
    ort = _require_ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = False
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return _spill.payload(model_bytes, folder).session(so, ["CPUExecutionProvider"])


def infer_dtypes(model: ir.Model) -> dict[str, int]:
    """Element type (``onnx.TensorProto`` code) of every named tensor, from ONNX shape inference on a copy."""
    import onnx

    proto = _spill.shape_proto(model) if _spill.too_big(model) else ir.serde.serialize_model(model)
    try:
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:  # noqa: BLE001 - inference is best effort; known dtypes still count
        logger.debug("shape inference failed: %s", exc)
    out: dict[str, int] = {}
    for graph in _proto_graphs(proto.graph):
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                out[vi.name] = vi.type.tensor_type.elem_type
        for init in graph.initializer:
            out[init.name] = init.data_type
    for name, v in _values_by_name(model).items():
        if v.dtype is not None:
            out[name] = v.dtype.value
    return out


def _proto_graphs(graph: Any) -> list[Any]:
    """``graph`` and every subgraph in it (``GraphProto`` s)."""
    out = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                out.extend(_proto_graphs(attr.g))
            for g in attr.graphs:
                out.extend(_proto_graphs(g))
    return out


def _defines(graph: Any, name: str) -> bool:
    return any(name in node.output for node in graph.node) or any(i.name == name for i in graph.initializer)


def _expose(graph: Any, name: str, elem: int, taken: set[str]) -> str | None:
    """Make tensor ``name`` of an ``If`` branch inside ``graph`` an output of ``graph``'s level; return its name there.

    The branch that defines it outputs it; the other branch outputs an empty tensor of the same type
    (samples that take it add nothing to the statistics); the ``If`` node gets one more output.
    Tensors inside ``Loop`` and ``Scan`` bodies are not exposed (``None``).
    """
    import onnx
    from onnx import helper

    for node in graph.node:
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            continue
        branches = {a.name: a.g for a in node.attribute if a.name in ("then_branch", "else_branch")}
        if len(branches) != 2:
            continue
        for key, branch in branches.items():
            inner = name if _defines(branch, name) else _expose(branch, name, elem, taken)
            if inner is None:
                continue
            other = branches["else_branch" if key == "then_branch" else "then_branch"]
            empty = fresh_name(taken, f"{name}__mograph_empty")
            other.node.append(helper.make_node("Constant", [], [empty],
                                               value=helper.make_tensor(empty, elem, [0], [])))
            branch.output.append(helper.make_tensor_value_info(inner, elem, None))
            other.output.append(helper.make_tensor_value_info(empty, elem, None))
            outer = fresh_name(taken, f"{name}__mograph_observed")
            node.output.append(outer)
            return outer
    del onnx
    return None


def _with_outputs_mapped(model: ir.Model, names: Iterable[str], dtypes: dict[str, int] | None = None, *,
                         only: bool = False) -> tuple[Any, dict[str, str]]:
    """Serialize a copy of ``model`` whose graph also outputs the named tensors; return it and the output names.

    A tensor inside an ``If`` branch is brought out through the ``If`` (:func:`_expose`), under another
    name; one that cannot be brought out (inside a ``Loop`` or ``Scan``) is left out of the mapping.
    The copy is bytes, or, for a model too big for one protobuf, a :class:`mograph._spill.Payload` (the
    model spilled to a temporary folder, the outputs added to its small proto): :func:`_session` takes both.

    With ``only``, the copy outputs the named tensors alone and keeps only the nodes and initializers they
    depend on (:func:`_prune_to_outputs`): ONNX Runtime runs every node of a session whatever is fetched,
    so without it the later searches (smoothing strength, per-layer sensitivity) would also run the layers
    after the last tensor they read (a decoder's LM head, when it stays float) on every sample.  Only for
    feeds :func:`observe` already ran through the whole model: a pruned copy does not check that the model
    accepts a feed.
    """
    import onnx

    proto, spilled = _spill.model_proto(model)
    have = {o.name for o in proto.graph.output}
    values = _values_by_name(model)
    taken = {o for g in _proto_graphs(proto.graph) for n in g.node for o in n.output}
    mapping: dict[str, str] = {}
    for name in names:
        if name in have:
            mapping[name] = name
            continue
        v = values.get(name)
        if dtypes is not None and name in dtypes:
            elem = dtypes[name]
        elif v is not None and v.dtype is not None:
            elem = v.dtype.value
        else:  # untyped (no shape inference ran before the pass): ONNX's inference, float32 only where it too fails
            if dtypes is None:
                dtypes = infer_dtypes(model)
            elem = dtypes.get(name, onnx.TensorProto.FLOAT)
        top = v is None or v.graph is None or v.graph is model.graph
        out = name if top else _expose(proto.graph, name, elem, taken)
        if out is None:
            logger.info("calibration: %s is inside a Loop or Scan body and cannot be observed", name)
            continue
        proto.graph.output.append(onnx.helper.make_tensor_value_info(out, elem, None))
        have.add(out)
        mapping[name] = out
    if only and mapping:
        _prune_to_outputs(proto.graph, set(mapping.values()))
    if spilled is not None:
        _spill.drop_pages(model)  # weights the pass read (paged out, smoothed): not resident beside the session
        return _spill.payload(proto, spilled=spilled), mapping
    return proto.SerializeToString(), mapping


def _subgraph_reads(node: Any) -> set[str]:
    """Names read by the nodes of ``node``'s subgraphs, at any depth (outer-scope values among them)."""
    out: set[str] = set()
    for attr in node.attribute:
        graphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
        for g in graphs:
            for inner in g.node:
                out.update(i for i in inner.input if i)
                out |= _subgraph_reads(inner)
    return out


def _prune_to_outputs(graph: Any, outputs: set[str]) -> None:
    """Make ``graph`` (a topologically sorted ``GraphProto``) output only ``outputs``; drop the nodes and
    initializers none of them depends on.  Graph inputs all stay (the feeds name them)."""
    for i in range(len(graph.output) - 1, -1, -1):
        if graph.output[i].name not in outputs:
            del graph.output[i]
    needed = set(outputs)
    drop_nodes = []
    for i in range(len(graph.node) - 1, -1, -1):
        node = graph.node[i]
        if any(o in needed for o in node.output):
            needed.update(x for x in node.input if x)
            needed |= _subgraph_reads(node)
        else:
            drop_nodes.append(i)
    for i in drop_nodes:  # descending: the indices still to delete do not move
        del graph.node[i]
    inputs = {v.name for v in graph.input}
    for i in range(len(graph.initializer) - 1, -1, -1):
        name = graph.initializer[i].name
        if name not in needed and name not in inputs:
            del graph.initializer[i]


def _with_outputs(model: ir.Model, names: Iterable[str], dtypes: dict[str, int] | None = None) -> Any:
    """Serialize a copy of ``model`` whose graph also outputs the named tensors."""
    return _with_outputs_mapped(model, names, dtypes)[0]


def _values_by_name(model: ir.Model) -> dict[str, ir.Value]:
    out: dict[str, ir.Value] = {}
    for graph in model.graphs():
        out.update({v.name: v for v in graph.inputs if v.name})
        for node in graph:
            for v in node.outputs:
                if v.name:
                    out[v.name] = v
    return out


def run_model(
    model_bytes: Any, feeds: Iterable[Feed], output_names: list[str] | None = None, folder: str | None = None
) -> Iterator[list[np.ndarray]]:
    """Run ``model_bytes`` (anything :func:`_session` takes; ORT, optimizations off, external data in
    ``folder``) on each feed; yield the outputs."""
    sess = _session(model_bytes, folder)
    for feed in feeds:
        yield sess.run(output_names, feed)
    # ONNX Runtime's buffers (its copy of the weights among them) go back to the system with the session:
    # glibc keeps freed blocks below its map threshold in the heap, beside whatever the caller makes next
    del sess
    _spill.trim_heap()


def _run_feed(sess: Any, outputs: list[str] | None, feed: Feed, source: CalibrationSource, index: int) -> list[np.ndarray]:
    """``sess.run`` on one calibration feed; a feed the model rejects is one :class:`OptionError` line
    that names the feed's inputs and how to give data the model accepts."""
    quiet = _require_ort().RunOptions()
    quiet.log_severity_level = 4  # the failure is reported below, once; not also by ORT's own logger
    try:
        return sess.run(outputs, feed, quiet)
    except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types for bad feeds
        raise feed_rejected(exc, feed, source, index) from exc


def feed_rejected(exc: Exception, feed: Feed, source: CalibrationSource, index: int) -> OptionError:
    """The one-line :class:`OptionError` for ONNX Runtime's refusal ``exc`` of calibration ``feed`` (the
    model's inputs of sample ``index`` from ``source``): names the inputs and how to give data it accepts."""
    reason = _ort_reason(exc)
    if len(reason) > 300:
        reason = reason[:300] + "..."
    shapes = ", ".join(f"{k} {'x'.join(map(str, v.shape)) or 'scalar'} {v.dtype}" for k, v in feed.items())
    if getattr(source, "random", False):
        defaulted = list(getattr(source, "defaulted", []))
        named = [k for k in feed if f"input: {k}" in reason or f"'{k}'" in reason]
        culprits = named or defaulted
        which = (
            f"input(s) {culprits} (dynamic dims set to 1)" if culprits and not named
            else f"input(s) {culprits}" if culprits else "the feed"
        )
        return OptionError(
            f"the model rejects its random calibration feed ({shapes}): {which} do not fit ({reason}); "
            "give real samples with --calibration-data (a folder of .npz, a stacked .npz or "
            "module:function), or the sizes of dynamic dims with --shape NAME:DIMS"
        )
    return OptionError(
        f"the model rejects calibration sample {index} from {source.description} ({shapes}): {reason}; "
        "each --calibration-data sample must fit the model's inputs (names, shapes, dtypes)"
    )


def _ort_reason(exc: Exception) -> str:
    """The useful part of an ONNX Runtime error: the node and its status message, without the source
    location of the check that failed."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    node = re.search(r"running (\w+) node\. Name:'([^']*)'", text)
    status = text.split("Status Message:", 1)[1].strip() if "Status Message:" in text else text
    status = re.sub(r"^\S+\.(?:h|cc|cpp):\d+ .*? was false\. ", "", status)
    if node:
        return f"{node.group(1)} node {node.group(2)!r}: {status}"
    return status


def observe(
    model: ir.Model,
    tensors: Iterable[str],
    source: CalibrationSource,
    *,
    histogram: bool = False,
    progress: ProgressCallback | None = None,
    dtypes: dict[str, int] | None = None,
    channels: Iterable[str] = (),
    padding_mask: str | None = None,
    capture: Iterable[str] = (),
    capture_samples: int = 0,
    captured: dict[str, list[np.ndarray]] | None = None,
) -> dict[str, TensorStats]:
    """Run every calibration feed once and return streaming statistics of each named tensor.

    ``channels`` names the tensors whose per-channel (last axis) extremes are kept as well
    (:attr:`TensorStats.ch_min` / ``ch_max``).  ``padding_mask`` names an integer ``[batch, seq]`` model
    input (see :func:`padding_mask_input`): positions where it is 0 are left out of the statistics of
    every ``[batch, seq, hidden]`` tensor, since no output depends on them.

    ``capture`` names tensors (among ``tensors``) whose values on the first ``capture_samples`` feeds are
    appended to ``captured[name]`` as float32 arrays, padded positions dropped: what :func:`collect` gives for
    those feeds, taken from this run instead of another run of the model (the smoothing strength search).
    """
    names = list(dict.fromkeys(tensors))
    per_channel = set(channels)
    stats = {n: TensorStats() for n in names}
    if not names:
        return stats
    data, mapping = _with_outputs_mapped(model, names, dtypes)  # the whole model: every feed is checked by it
    sess = _session(data, model_folder(model))
    observed = [n for n in names if n in mapping]
    total = source.count
    every = max(1, (total or 100) // 10)
    seen = 0
    keep_values = set(capture) if captured is not None and capture_samples > 0 else set()
    for name in keep_values:
        captured.setdefault(name, [])  # type: ignore[union-attr]
    for feed in source:
        outs = _run_feed(sess, [mapping[n] for n in observed], feed, source, seen)
        keep = _kept_positions(feed, padding_mask)
        for name, arr in zip(observed, outs):
            if np.issubdtype(arr.dtype, np.floating):
                if keep is not None and arr.ndim == 3 and arr.shape[:2] == keep.shape:
                    arr = arr[keep][None]
                stats[name].update(arr, histogram, name in per_channel)
                if seen < capture_samples and name in keep_values:
                    captured[name].append(np.asarray(arr, np.float32))  # type: ignore[index]
        seen += 1
        if progress is not None:
            progress(seen, total)
        if seen % every == 0 or seen == total:
            logger.info("calibration: %d/%s samples from %s", seen, total if total is not None else "?",
                        source.description)
    if seen == 0:
        raise OptionError(f"--calibration-data: {source.description} yielded no samples")
    return stats


def collect(model: ir.Model, names: Iterable[str], samples: Iterable[Feed],
            padding_mask: str | None = None) -> dict[str, list[np.ndarray]]:
    """The named tensors on each of ``samples`` (float model, ORT optimizations off), padded positions
    dropped as :func:`observe` does; for the few-sample searches (smoothing strength)."""
    wanted = list(dict.fromkeys(names))
    data, mapping = _with_outputs_mapped(model, wanted, only=True)
    sess = _session(data, model_folder(model))
    got = [n for n in wanted if n in mapping]
    out: dict[str, list[np.ndarray]] = {n: [] for n in wanted}
    for feed in samples:
        keep = _kept_positions(feed, padding_mask)
        for name, arr in zip(got, sess.run([mapping[n] for n in got], feed)):
            if keep is not None and arr.ndim == 3 and arr.shape[:2] == keep.shape:
                arr = arr[keep][None]
            out[name].append(np.asarray(arr, np.float32))
    return out


def padding_mask_input(model: ir.Model) -> str | None:
    """The model input that marks padding (``attention_mask``, integer or bool, rank 2), or ``None``.

    Padded positions of a batch are computed but ignored by every output; their activations are not
    what real tokens produce (a whole padded row is one repeated [PAD] embedding), and a calibrator that
    counts them takes its percentiles from them.  :func:`observe` leaves them out when told this name.
    """
    for v in model.graph.inputs:
        name = (v.name or "").lower()
        if name.endswith("attention_mask") and v.dtype is not None and v.dtype in (
                ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL) and (v.shape is None or len(v.shape) == 2):
            return v.name
    return None


def _kept_positions(feed: Feed, mask_name: str | None) -> np.ndarray | None:
    """Boolean ``[batch, seq]`` of the real (not padded) positions of ``feed``, or ``None``."""
    if mask_name is None or mask_name not in feed:
        return None
    mask = np.asarray(feed[mask_name])
    if mask.ndim != 2 or not mask.any():
        return None
    keep = mask != 0
    return None if keep.all() else keep
