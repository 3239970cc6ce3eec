"""Handing a model too big for one protobuf to ONNX Runtime, the ONNX checker or shape inference.

Why: protobuf cannot serialize a message above 2 GB, and every runtime or checker that is given a model
as bytes needs it serialized.  An LLM from about 500M parameters in float32 is past that once a pass
holds its weights in memory (float16 copies, quantized weights, folded constants).  Serializing also
copies every in-memory weight twice (into the ``ModelProto``, then into the bytes), and ONNX Runtime
copies them a third time: the peak memory of a pass would be several times the weights.

So every place that gives a model to a runtime or a checker asks this module first:

* :func:`too_big`: whether the tensors the model holds *in memory* reach :func:`spill_bytes` (external
  tensors are references and cost nothing in a protobuf): protobuf's limit, or 32 MiB, where the copies
  that serialization makes (three of them: the ``ModelProto``, its bytes, ONNX Runtime's parse) start to
  cost more memory than writing a file costs time.  Below it, nothing
  changes: bytes, as before.
* :func:`spill`: the model written into an owned temporary folder (:mod:`mograph._tempfiles`: removed
  with the handle, on an exception, and by the next run after SIGKILL) as a small ``model.onnx`` whose
  tensors are all external.  In-memory tensors are written one at a time to ``inline.data``; tensors
  already in external files are **not read** into memory: their file is copied into the folder by the
  kernel (``shutil.copyfile``: ``sendfile``/``copy_file_range``), so spilling a model loaded from disk
  costs disk time but no memory.  (A hard link would cost nothing, but while it exists ``onnx_ir``
  refuses to read the original file, which has two links then, as a possible hard-link attack; a
  symbolic link leading out of the folder is refused by ONNX Runtime.)  Each runtime then makes its
  session from the path.  The spilled
  ``ModelProto`` (:attr:`Spilled.proto`) is small; a caller may edit it (add graph outputs, as
  calibration does) and write it back beside the data (:meth:`Spilled.variant`).
* :func:`shape_proto`: a ``ModelProto`` for shape inference, whose large tensors keep their type and
  shape but no data (external references to nothing), so no weight is copied or read.
* :func:`payload`: what ONNX Runtime is given for a model in any form: bytes with the folder their
  external data is read from, or the path of a spilled model.

The limit is ``2**31 - 64 MiB`` (room for the graph itself).  ``MOGRAPH_PROTO_LIMIT`` (bytes) lowers it,
so a test can drive a model of a few megabytes through the same paths a 4 GB one takes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mograph._tempfiles import OwnedTempDir, owned_tempdir
from mograph._traverse import iter_nodes, subgraphs
from mograph.irutil import serialize_model

__all__ = [
    "PROTO_LIMIT_ENV",
    "DEFAULT_PROTO_LIMIT",
    "proto_limit",
    "inline_bytes",
    "spill_bytes",
    "save_external_bytes",
    "too_big",
    "Census",
    "Spilled",
    "spill",
    "model_proto",
    "shared_copy",
    "shape_proto",
    "Payload",
    "payload",
    "drop_pages",
    "remember_data_files",
    "trim_heap",
    "release_pages",
    "free_dropped",
    "footprint",
    "pin_mmap_threshold",
    "MMAP_THRESHOLD_ENV",
    "PagedTensor",
    "page_out",
    "page_in",
]

logger = logging.getLogger(__name__)

PROTO_LIMIT_ENV = "MOGRAPH_PROTO_LIMIT"
#: protobuf's 2 GB, less room for the graph itself.
DEFAULT_PROTO_LIMIT = 2**31 - 64 * 2**20
#: From this many bytes of in-memory tensors a model is spilled even below the protobuf limit: handed
#: over as bytes, its weights would be copied into the ``ModelProto``, again into the bytes, and again by
#: ONNX Runtime (four times the weights at the peak); written to a file, they are copied once, by the
#: runtime, and the disk write of a few tens of megabytes takes a fraction of a second.  (Measured with
#: ``tools/bench_memory.py``: at 256 MiB, the float16 copy of a 411 MB model went as bytes to every
#: session, and ``fp16 --verify`` peaked at 3.6x the weights; at 32 MiB, 2.x.)
SPILL_BYTES = 32 * 2**20
#: From this many bytes of initializers :func:`mograph.ir_io.save_model` writes external data by default
#: (what a user gets: a single file below it, as before).
SAVE_EXTERNAL_BYTES = 256 * 2**20
#: In-memory tensors up to this size stay inside the spilled protobuf (shape constants and the like:
#: shape inference and ONNX Runtime's constant handling read them there).
INLINE_BYTES = 1024
_ALIGN = 4096


def _append_aligned(data: Any, t: ir.TensorProtocol) -> tuple[int, int]:
    """Write ``t``'s bytes at the next :data:`_ALIGN` boundary of the open file ``data``: ``(offset, length)``."""
    pad = -data.tell() % _ALIGN
    if pad:
        data.write(b"\0" * pad)
    start = data.tell()
    raw = t.tobytes()
    data.write(raw)
    return start, len(raw)


_DATA = "inline.data"


def proto_limit() -> int:
    """Bytes of in-memory tensors from which a model is spilled to a file (``MOGRAPH_PROTO_LIMIT`` lowers it)."""
    text = os.environ.get(PROTO_LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_PROTO_LIMIT
    try:
        value = int(text)
    except ValueError:
        logger.warning("%s=%r is not a number of bytes; using %d", PROTO_LIMIT_ENV, text, DEFAULT_PROTO_LIMIT)
        return DEFAULT_PROTO_LIMIT
    return max(0, min(value, DEFAULT_PROTO_LIMIT))


def _initializer_values(model: ir.Model) -> Iterator[ir.Value]:
    for graph in (model.graph, *subgraphs(model.graph)):  # mograph._traverse: ~10x faster than onnx_ir's walk
        yield from graph.initializers.values()


def _attribute_tensors(model: ir.Model) -> Iterator[ir.TensorProtocol]:
    for node in iter_nodes(model.graph):
        for attr in node.attributes.values():
            if attr.is_ref() or attr.value is None:
                continue
            if attr.type == ir.AttributeType.TENSOR:
                yield attr.value
            elif attr.type == ir.AttributeType.TENSORS:
                yield from attr.value
    for function in model.functions.values():
        for node in iter_nodes(function):
            for attr in node.attributes.values():
                if not attr.is_ref() and attr.type == ir.AttributeType.TENSOR and attr.value is not None:
                    yield attr.value


@dataclass
class Census:
    """Where a model's tensors sit, from one walk of it: what :func:`inline_bytes`, :func:`too_big`,
    :func:`footprint`, :func:`remember_data_files`, :func:`drop_pages` and :func:`payload` (and the output
    check, :mod:`mograph.output_check`) would each find by walking the model again.

    Why: a check of one model asked those questions in turn, about ten walks of the whole model (about a
    second of CPU time on a 100k-node graph).  A census holds the model's own objects (no copy), and is valid
    while the model's graphs, nodes, attributes and initializers are not edited: make it, ask it, drop it.
    """

    #: The main graph and its subgraphs (:func:`mograph._traverse.subgraphs` order).
    graphs: list[ir.Graph]
    #: The initializer values of :attr:`graphs`, in order (:func:`_initializer_values`).
    initializers: list[ir.Value]
    #: ``(node, attribute)`` of each TENSOR or TENSORS attribute with a value (not a reference) of the nodes of
    #: :attr:`graphs`.
    attrs: list[tuple[ir.Node, ir.Attr]]
    #: Tensors of the model-local functions' TENSOR attributes (subgraphs included), what
    #: :func:`_attribute_tensors` adds for them.
    function_tensors: list[ir.TensorProtocol]
    #: Tensors of the functions' TENSORS attributes and the initializers of their subgraphs (only
    #: :meth:`all_external` counts them, as :func:`mograph.ir_io.external_tensors` does).
    function_others: list[ir.TensorProtocol]
    #: ``(domain, op_type)`` of every node of :attr:`graphs`.
    ops: set[tuple[str, str]]
    #: How many nodes :attr:`graphs` have.
    nodes: int

    @classmethod
    def of(cls, model: ir.Model) -> Census:
        graphs = [model.graph, *subgraphs(model.graph)]
        initializers = [v for g in graphs for v in g.initializers.values()]
        attrs: list[tuple[ir.Node, ir.Attr]] = []
        ops: set[tuple[str, str]] = set()
        nodes = 0
        tensor, tensors = ir.AttributeType.TENSOR, ir.AttributeType.TENSORS
        for node in iter_nodes(model.graph):
            nodes += 1
            ops.add((node.domain, node.op_type))
            for attr in node.attributes.data.values():
                if (attr.type == tensor or attr.type == tensors) and not attr.is_ref() and attr.value is not None:
                    attrs.append((node, attr))
        function_tensors: list[ir.TensorProtocol] = []
        function_others: list[ir.TensorProtocol] = []
        for function in model.functions.values():
            for sub in subgraphs(function):
                function_others.extend(v.const_value for v in sub.initializers.values() if v.const_value is not None)
            for node in iter_nodes(function):
                for attr in node.attributes.values():
                    if attr.is_ref() or attr.value is None:
                        continue
                    if attr.type == tensor:
                        function_tensors.append(attr.value)
                    elif attr.type == tensors:
                        function_others.extend(attr.value)
        return cls(graphs, initializers, attrs, function_tensors, function_others, ops, nodes)

    def attribute_tensors(self) -> list[ir.TensorProtocol]:
        """What :func:`_attribute_tensors` yields, in its order."""
        out: list[ir.TensorProtocol] = []
        for _, attr in self.attrs:
            if attr.type == ir.AttributeType.TENSOR:
                out.append(attr.value)
            else:
                out.extend(attr.value)
        out.extend(self.function_tensors)
        return out

    def external(self) -> list[ir.ExternalTensor]:
        """What :func:`_external` yields, in its order."""
        out = [v.const_value for v in self.initializers if isinstance(v.const_value, ir.ExternalTensor)]
        out.extend(t for t in self.attribute_tensors() if isinstance(t, ir.ExternalTensor))
        return out

    def all_external(self) -> list[ir.ExternalTensor]:
        """The tensors :func:`mograph.ir_io.external_tensors` lists (in another order)."""
        return [*self.external(), *(t for t in self.function_others if isinstance(t, ir.ExternalTensor))]

    def inline_bytes(self) -> int:
        """:func:`inline_bytes`."""
        total = 0
        for value in self.initializers:
            t = value.const_value
            if t is not None and (not isinstance(t, ir.ExternalTensor) or isinstance(t, PagedTensor)):
                total += t.nbytes
        for t in self.attribute_tensors():
            if not isinstance(t, ir.ExternalTensor):
                total += t.nbytes
        return total

    def footprint(self) -> int:
        """:func:`footprint`."""
        total = sum(v.const_value.nbytes for v in self.initializers if v.const_value is not None)
        for _, attr in self.attrs:
            if attr.type == ir.AttributeType.TENSOR:
                total += attr.value.nbytes
            else:
                total += sum(t.nbytes for t in attr.value)
        return total + self.nodes * NODE_BYTES

    def too_big(self) -> bool:
        """:func:`too_big`."""
        return self.inline_bytes() >= spill_bytes() or any(isinstance(t, PagedTensor) for t in self.external())


def inline_bytes(model: ir.Model) -> int:
    """Bytes of the tensors ``model`` holds in memory (initializers and tensor attributes), that is, what a
    serialized copy of it would hold; external tensors are references and count nothing."""
    total = 0
    for value in _initializer_values(model):
        t = value.const_value
        if t is not None and (not isinstance(t, ir.ExternalTensor) or isinstance(t, PagedTensor)):
            total += t.nbytes  # a paged tensor is not in the model's folder: it goes into a serialized copy
    for t in _attribute_tensors(model):
        if not isinstance(t, ir.ExternalTensor):
            total += t.nbytes
    return total


#: Resolved paths of the external-data files this process has read weights from (:func:`remember_data_files`).
_DATA_FILES: set[str] = set()


def remember_data_files(model: ir.Model, census: Census | None = None) -> None:
    """Note the external-data files ``model`` reads, so :func:`drop_pages` can forget their pages later even
    when no model that is passed to it refers to them any more (the input's float weights after a pass
    gave every value a converted tensor, still mapped by the untouched copy a check keeps).  ``census``:
    ``model``'s (:class:`Census`), to walk it no more."""
    for t in (census.external() if census is not None else _external(model)):
        with contextlib.suppress(OSError, ValueError):
            _DATA_FILES.add(os.path.realpath(t.path))


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _drop_file_maps() -> int:
    """``MADV_DONTNEED`` on every read-only map of a :data:`_DATA_FILES` file in this process (``onnx_ir``'s
    maps of tensors this process no longer holds a model of, ONNX Runtime's own); how many were advised.
    Linux only (``/proc/self/maps``); elsewhere 0."""
    import mmap

    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or not _DATA_FILES or not os.path.exists("/proc/self/maps"):
        return 0
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
        libc = _libc()
    except OSError:  # pragma: no cover - no procfs or libc
        return 0
    if libc is None:  # pragma: no cover
        return 0
    count = 0
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or "w" in parts[1] or "x" in parts[1]:
            continue  # a writable map could hold changes that are not in the file: never advised
        if parts[5] not in _DATA_FILES:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if libc.madvise(start, end - start, advice) == 0:
            count += 1
    return count


def drop_pages(model: ir.Model, census: Census | None = None) -> int:
    """Drop the pages of memory-mapped external tensors from this process's resident memory; return how
    many maps were advised.

    A weight read once (to convert or quantize it) stays mapped, and its pages count in the process's
    memory until the map is closed, on top of what ONNX Runtime then loads.  ``MADV_DONTNEED`` on a
    read-only file map only forgets the pages (the page cache keeps them; a later read maps them again),
    so it is safe while numpy views of the map are alive, unlike closing it.  ``model``'s own maps are
    advised, and on Linux every read-only map of a data file any model of this process was loaded from
    (:func:`remember_data_files`): after a pass the untouched input a check keeps still maps the float
    weights the pass read.  Called before a session is made (:func:`payload`); it also frees the model
    copies a pass dropped (:func:`free_dropped`, counting copies of ``model``'s size) and hands the freed
    heap back to the system.  Does nothing where ``madvise`` is not available.  ``census``: ``model``'s
    (:class:`Census`), to walk it no more.
    """
    import mmap

    advice = getattr(mmap, "MADV_DONTNEED", None)
    count = 0
    if advice is None:  # pragma: no cover - not Linux/macOS
        return count
    external = census.external() if census is not None else list(_external(model))
    remember_data_files(model, census)
    for t in external:
        raw = getattr(t, "raw", None)
        if isinstance(raw, mmap.mmap) and not raw.closed:
            with contextlib.suppress(OSError, ValueError):
                raw.madvise(advice)
                count += 1
    count += _drop_file_maps()
    free_dropped(census.footprint() if census is not None else model)
    return count


#: What one node of an IR graph costs in memory, roughly (the node, its values and their uses,
#: attributes): the graph's share of :func:`footprint`.
NODE_BYTES = 1024
#: Estimated bytes of the model copies dropped since the last collection of :func:`free_dropped`.
_pending_bytes = 0


def footprint(model: ir.Model) -> int:
    """Estimated bytes of a copy of ``model`` that a pass makes: its tensors, in memory or external (a
    pass's converted copy of an external weight is in memory), and :data:`NODE_BYTES` per node."""
    total = 0
    for value in _initializer_values(model):
        if value.const_value is not None:
            total += value.const_value.nbytes
    nodes = 0
    for node in iter_nodes(model.graph):
        nodes += 1
        for attr in node.attributes.values():
            if attr.is_ref() or attr.value is None:
                continue
            if attr.type == ir.AttributeType.TENSOR:
                total += attr.value.nbytes
            elif attr.type == ir.AttributeType.TENSORS:
                total += sum(t.nbytes for t in attr.value)
    return total + nodes * NODE_BYTES


def free_dropped(dropped: ir.Model | int | None = None) -> bool:
    """Free the model copies nothing refers to any more and give the freed heap back to the system
    (:func:`trim_heap`); return whether it collected.

    An IR graph is a web of back references (values know their producers and users), so a copy a pass
    dropped is freed by the cycle collector, not when its last name goes: its tensors could otherwise
    sit beside ONNX Runtime's copy of the next session.

    A full collection walks every object the process holds, whatever the model's size: a tenth of a
    second in a process of a few hundred thousand objects (a test run, a notebook), which on a small
    model cost more than the session it came before (issue 28: most of the time of the float16 tests).
    So ``dropped`` says what was dropped: a model whose copies were (their size is its
    :func:`footprint`), or a number of bytes.  The estimates add up, and the collection runs once they
    reach :func:`spill_bytes` (32 MiB, where memory starts to matter more than time; less with
    ``MOGRAPH_PROTO_LIMIT``): at every call for a model of that size or more, as before, and seldom for
    small ones, whose counted copies wait for at most that much.  Without ``dropped``: always.
    """
    import gc

    global _pending_bytes
    if dropped is not None:
        _pending_bytes += dropped if isinstance(dropped, int) else footprint(dropped)
        if _pending_bytes < spill_bytes():
            return False
    _pending_bytes = 0
    gc.collect()
    trim_heap()
    return True


def release_pages(tensor: ir.TensorProtocol | None) -> None:
    """Forget the resident pages of ``tensor``'s memory map when it is an external tensor that was read.

    For a pass that reads each weight once to make a converted copy (float16, quantized): called right
    after the copy is made, the float weights are never all resident at once (the page cache keeps them;
    a later read maps them again).  Anything else: nothing happens.
    """
    import mmap

    advice = getattr(mmap, "MADV_DONTNEED", None)
    raw = getattr(tensor, "raw", None) if isinstance(tensor, ir.ExternalTensor) else None
    if advice is not None and isinstance(raw, mmap.mmap) and not raw.closed:
        with contextlib.suppress(OSError, ValueError):
            raw.madvise(advice)


#: Environment variable: glibc's mmap threshold (bytes) pinned once a large model reaches a session; 0 leaves
#: glibc's own (dynamic) threshold.
MMAP_THRESHOLD_ENV = "MOGRAPH_MMAP_THRESHOLD"
#: Default of :data:`MMAP_THRESHOLD_ENV`: 4 MiB.
MMAP_THRESHOLD = 4 * 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_pinned: list[int] = []


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at :data:`MMAP_THRESHOLD` (``$MOGRAPH_MMAP_THRESHOLD``); return whether it is.

    Why: glibc serves an allocation from its heap below the threshold, and raises the threshold to the size
    of every mapped block freed (up to 32 MiB).  Once a pass has freed a few weight-sized arrays, the buffers
    ONNX Runtime's worker threads allocate and free during a run (weights dequantized or widened per node)
    are heap blocks, which stay the process's until trimmed: measured on a 411 MB decoder, one ``--verify``
    run of its int4 form grew the process by 570 MiB, all given back by :func:`trim_heap` afterwards.  A
    pinned threshold maps every block from 4 MiB and unmaps it when freed.  Called for models whose weights
    reach :func:`spill_bytes` (the time to map large blocks is small beside the work on them); not where the
    user set glibc's threshold (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``), nor outside glibc.
    """
    if _pinned:
        return True
    text = os.environ.get(MMAP_THRESHOLD_ENV, "").strip()
    value = int(text) if text.isdigit() else MMAP_THRESHOLD
    if value <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = _libc()
        mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    except OSError:  # pragma: no cover
        return False
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, value):
        return False
    _pinned.append(value)
    return True


def trim_heap() -> None:
    """Give the heap memory this process freed back to the system (glibc's ``malloc_trim``).

    Weights are freed one by one as a pass replaces them; glibc keeps freed blocks below its (adaptive,
    up to 32 MiB) map threshold in its heap, counted in the process's memory, and ONNX Runtime's copy of
    the model then comes on top of them.  Nothing outside glibc: a no-op.
    """
    try:
        libc = _libc()
        trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    except OSError:  # pragma: no cover
        return
    if trim is not None:
        trim(0)


def save_external_bytes() -> int:
    """Bytes of initializers from which a saved model gets external data by default: :func:`proto_limit`, and
    at most :data:`SAVE_EXTERNAL_BYTES`."""
    return min(proto_limit(), SAVE_EXTERNAL_BYTES)


def spill_bytes() -> int:
    """Bytes of in-memory tensors from which a model is spilled: :func:`proto_limit`, and at most
    :data:`SPILL_BYTES` (memory, not protobuf, decides there)."""
    return min(proto_limit(), SPILL_BYTES)


def too_big(model: ir.Model | onnx.ModelProto) -> bool:
    """Whether ``model`` reaches a runtime or checker as a file: its in-memory tensors reach
    :func:`spill_bytes`."""
    if isinstance(model, onnx.ModelProto):
        return model.ByteSize() >= spill_bytes()
    # a paged tensor's file is in no folder a serialized copy could name beside the model's own data
    return inline_bytes(model) >= spill_bytes() or any(isinstance(t, PagedTensor) for t in _external(model))


@contextlib.contextmanager
def _swapped(model: ir.Model, replace: Any) -> Iterator[None]:
    """Put ``replace(tensor)`` (or the tensor itself when it returns ``None``) in place of every initializer's
    tensor while the block runs, and the model's own tensors back after it."""
    swapped: list[tuple[ir.Value, ir.TensorProtocol]] = []
    try:
        for value in _initializer_values(model):
            t = value.const_value
            if t is None:
                continue
            new = replace(t)
            if new is not None:
                swapped.append((value, t))
                value.const_value = new
        yield
    finally:
        for value, t in swapped:
            value.const_value = t


def _reference(t: ir.TensorProtocol, location: str, offset: int | None, length: int | None,
               folder: Path | None = None) -> ir.ExternalTensor:
    """An external tensor of ``t``'s name, type and shape at ``location`` (in ``folder``)."""
    return ir.ExternalTensor(location, offset, length, t.dtype, shape=ir.Shape(t.shape.numpy()),
                             name=t.name,  # type: ignore[arg-type]  # onnx_ir accepts None
                             base_dir=str(folder) if folder is not None else "")


@dataclass
class Spilled:
    """A model written with external data into an owned temporary folder (see the module docstring).

    Attributes:
        path: the model file (``model.onnx``), for ``InferenceSession(path)``.
        proto: its ``ModelProto`` without data (small: every large tensor is an external reference).
        folder: the temporary folder.
    """

    path: str
    proto: onnx.ModelProto
    folder: Path
    tmp: OwnedTempDir
    _variants: int = 0

    def variant(self, proto: onnx.ModelProto) -> str:
        """Write ``proto`` (this model's :attr:`proto`, edited: more outputs, other nodes; its tensors still
        referring to this folder's data) beside the data; return its path."""
        self._variants += 1
        path = self.folder / f"variant{self._variants}.onnx"
        onnx.save(proto, str(path))
        return str(path)

    def cleanup(self) -> None:
        self.tmp.cleanup()

    def __enter__(self) -> Spilled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _copied(source: str, folder: Path, copies: dict[str, str]) -> str:
    """The name under ``folder`` of a copy of the external-data file ``source`` (made once per file)."""
    key = os.path.realpath(source)
    if key not in copies:
        name = f"copied{len(copies)}.data"
        shutil.copyfile(key, folder / name)  # in the kernel: no buffer in this process
        copies[key] = name
    return copies[key]


def spill(model: ir.Model) -> Spilled:
    """Write ``model`` into a new owned temporary folder with external data (module docstring).

    The model is not changed: its tensors are swapped for external references while the protobuf is
    written, and put back.  In-memory tensors are written one at a time; external files are copied.
    """
    tmp = owned_tempdir("mograph-spill-")
    folder = tmp.path
    copies: dict[str, str] = {}
    try:
        with open(folder / _DATA, "wb") as data:

            def replace(t: ir.TensorProtocol) -> ir.TensorProtocol | None:
                if isinstance(t, ir.ExternalTensor):
                    name = _copied(t.path, folder, copies)
                    return _reference(t, name, t.offset, t.length, folder)
                if t.nbytes <= INLINE_BYTES:
                    return None
                start, length = _append_aligned(data, t)
                return _reference(t, _DATA, start, length, folder)

            from mograph.ir_io import _attributes_inlined

            with _swapped(model, replace), _attributes_inlined(model):  # attributes' external data: inline
                proto = serialize_model(model)
        path = folder / "model.onnx"
        onnx.save(proto, str(path))
    except BaseException:
        tmp.cleanup()
        raise
    logger.debug("spilled the model to %s (%d external file(s) copied)", folder, len(copies))
    return Spilled(str(path), proto, folder, tmp)


class PagedTensor(ir.ExternalTensor):  # pylint: disable=too-many-ancestors
    """An external tensor in a file :func:`page_out` wrote; it keeps that file's owned temporary folder alive
    (the folder is removed once no paged tensor refers to it)."""

    __slots__ = ("_keep",)

    def __init__(self, *args: Any, keep: OwnedTempDir, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keep = keep


def page_out(model: ir.Model) -> int:
    """Move the in-memory initializers of ``model`` (above :data:`INLINE_BYTES`) to a file and read them back
    through a memory map (:class:`PagedTensor`); return the bytes moved (0: nothing done).

    For tensors a pass made and keeps until it is done (smoothed weights): in memory they sit beside every
    ONNX Runtime session the pass makes afterwards; mapped from a file, their pages are the page cache's,
    counted in the process only while they are read, and dropped again (:func:`drop_pages`) before the next
    session.  The bytes are the same, so every number read from them is.  Only when they reach
    :func:`spill_bytes` (below it, nothing changes); the file lives in an owned temporary folder
    (:mod:`mograph._tempfiles`), removed once the last paged tensor is freed, or by the next run after SIGKILL.
    """
    values: list[ir.Value] = []
    total = 0
    for v in _initializer_values(model):
        t = v.const_value
        if (t is not None and not isinstance(t, ir.ExternalTensor) and t.nbytes > INLINE_BYTES
                and t.dtype != ir.DataType.STRING):  # strings have no external form
            values.append(v)
            total += t.nbytes
    if not values or total < spill_bytes():
        return 0
    tmp = owned_tempdir("mograph-paged-")
    try:
        with open(tmp.path / _DATA, "wb") as data:
            places = []
            for v in values:
                t = v.const_value
                assert t is not None
                places.append(_append_aligned(data, t))
    except BaseException:
        tmp.cleanup()
        raise
    for v, (start, length) in zip(values, places):
        t = v.const_value
        assert t is not None
        v.const_value = PagedTensor(_DATA, start, length, t.dtype, shape=ir.Shape(t.shape.numpy()),
                                    name=t.name,  # type: ignore[arg-type]  # onnx_ir accepts None
                                    base_dir=str(tmp.path), keep=tmp)
    del values, t
    remember_data_files(model)
    free_dropped()  # the in-memory copies, now unreferenced
    logger.debug("paged out %d bytes of in-memory initializers to %s", total, tmp.path)
    return total


def page_in(model: ir.Model) -> int:
    """Read every :class:`PagedTensor` of ``model`` back into memory (the pass that paged them out is done);
    return the bytes read.  The model is then as it would have been without :func:`page_out`: a saved model
    holds its tensors where it would have, byte for byte."""
    total = 0
    for value in _initializer_values(model):
        t = value.const_value
        if isinstance(t, PagedTensor):
            value.const_value = ir.Tensor(np.array(t.numpy()), dtype=t.dtype, name=t.name)
            release_pages(t)
            total += t.nbytes
    return total


def spill_proto(proto: onnx.ModelProto, base_dir: str | os.PathLike | None = None) -> Spilled:
    """:func:`spill` for a ``ModelProto`` (its external data read from ``base_dir``); the proto's tensors are
    wrapped, not copied."""
    model = ir.serde.deserialize_model(proto)
    if base_dir is not None:
        for value in _initializer_values(model):
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value.base_dir = str(base_dir)
    return spill(model)


def model_proto(model: ir.Model) -> tuple[onnx.ModelProto, Spilled | None]:
    """``model`` as a ``ModelProto`` to edit and hand to ONNX Runtime through :func:`payload`: the plain
    serialization below :func:`proto_limit`, else the small proto of :func:`spill` with its folder."""
    if too_big(model):
        spilled = spill(model)
        return spilled.proto, spilled
    return serialize_model(model), None


def shared_copy(model: ir.Model, *, in_memory: bool = True) -> ir.Model:
    """A copy of ``model`` (graph, nodes, values: all new) whose external initializers, and with
    ``in_memory`` its in-memory ones above a kilobyte, are the original's tensor objects, not copies.

    An external tensor is a read-only memory map: sharing it means the copy reads its file through the
    original's map instead of mapping (and counting) its pages a second time.  In-memory tensors are not
    changed in place by passes (a pass gives a value a new tensor), so sharing them is safe too, and
    a copy of a model too big for one protobuf then costs no memory.  The serialized round trip that
    makes the copy sees references in their place.  :func:`mograph.ir_io.copy_model` uses this.
    """
    shared: dict[str, ir.TensorProtocol] = {}

    def replace(t: ir.TensorProtocol) -> ir.TensorProtocol | None:
        if not isinstance(t, ir.ExternalTensor) and (not in_memory or t.nbytes <= INLINE_BYTES):
            return None
        key = f"mograph-shared-{len(shared)}"
        shared[key] = t
        return _reference(t, key, 0, t.nbytes)

    with _swapped(model, replace):
        copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    for value in _initializer_values(copy):
        t = value.const_value
        if isinstance(t, ir.ExternalTensor) and str(t.location) in shared:
            value.const_value = shared[str(t.location)]
    return copy


def shape_proto(model: ir.Model) -> onnx.ModelProto:
    """A ``ModelProto`` of ``model`` for shape inference or the checker: tensors above a few hundred bytes
    keep their type and shape but become references to data that does not exist, so nothing is copied
    or read (small ones, such as shape constants, stay for data propagation)."""

    def replace(t: ir.TensorProtocol) -> ir.TensorProtocol | None:
        if isinstance(t, ir.ExternalTensor) or t.nbytes > INLINE_BYTES:
            return _reference(t, "mograph-no-data", 0, t.nbytes)
        return None

    with _swapped(model, replace):
        return serialize_model(model)


@dataclass
class Payload:
    """What ONNX Runtime is given: ``data`` (bytes, their external data in ``folder``) or ``path`` (a model
    file in ``spilled``'s folder, which must live as long as the session)."""

    data: bytes | None = None
    path: str | None = None
    folder: str | None = None
    spilled: Spilled | None = None

    def session(self, sess_options: Any, providers: list[Any]) -> Any:
        """An ``InferenceSession``; it keeps the spilled folder alive (removed when the session is freed)."""
        import onnxruntime as ort

        threads = os.environ.get("MOGRAPH_ORT_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and not sess_options.intra_op_num_threads:
            sess_options.intra_op_num_threads = int(threads)  # several mograph processes side by side
        if self.path is not None:
            sess = ort.InferenceSession(self.path, sess_options, providers=providers)
            if self.spilled is not None:
                sess._mograph_spilled = self.spilled
            return sess
        if self.folder:
            sess_options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                                  str(self.folder))
        return ort.InferenceSession(self.data, sess_options, providers=providers)


def payload(model: ir.Model | onnx.ModelProto | bytes | Payload, folder: str | os.PathLike | None = None,
            spilled: Spilled | None = None, census: Census | None = None) -> Payload:
    """:class:`Payload` of ``model``: bytes below :func:`proto_limit`, else a spilled file.

    ``folder`` is where the external data of bytes or a ``ModelProto`` is read from; ``spilled`` says
    that a ``ModelProto`` is an edited :attr:`Spilled.proto` (written beside that data, never re-spilled);
    ``census``, an ``onnx_ir.Model``'s :class:`Census`, which then answers for it (one walk, not five).
    """
    if isinstance(model, Payload):
        return model
    if isinstance(model, (bytes, bytearray)):
        return Payload(data=bytes(model), folder=str(folder) if folder else None)
    if isinstance(model, onnx.ModelProto):
        if spilled is not None:
            return Payload(path=spilled.variant(model), spilled=spilled)
        if not too_big(model):
            return Payload(data=model.SerializeToString(), folder=str(folder) if folder else None)
        sp = spill_proto(model, folder)
        return Payload(path=sp.path, spilled=sp)
    drop_pages(model, census)  # weights read by the pass: not resident twice once ONNX Runtime loads its copy
    if (census.footprint() if census is not None else footprint(model)) >= spill_bytes():
        pin_mmap_threshold()  # ONNX Runtime's buffers of a large model's run go back when freed
    if census.too_big() if census is not None else too_big(model):
        sp = spill(model)
        return Payload(path=sp.path, spilled=sp)
    folders = {str(t.base_dir) for t in (census.external() if census is not None else _external(model)) if t.base_dir}
    return Payload(data=serialize_model(model).SerializeToString(),
                   folder=next(iter(folders)) if len(folders) == 1 else (str(folder) if folder else None))


def _external(model: ir.Model) -> Iterator[ir.ExternalTensor]:
    for value in _initializer_values(model):
        if isinstance(value.const_value, ir.ExternalTensor):
            yield value.const_value
    for t in _attribute_tensors(model):
        if isinstance(t, ir.ExternalTensor):
            yield t
