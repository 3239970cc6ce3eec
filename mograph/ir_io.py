"""Loading and saving models at the API edge.

mograph works on one in-memory IR, `onnx-ir <https://github.com/onnx/ir-py>`_.  This module is the
only place that converts between it and the forms users hand us: a file path, raw bytes, an
``onnx.ModelProto``, an ``onnx_ir.Model`` or an ``onnx_graphsurgeon.Graph``.  Everything inside the
pipeline sees ``onnx_ir.Model`` only.

Why this matters:

* **Load once, save once.**  Passes never serialise the model between them.
* **External data stays lazy.**  A model loaded from a path keeps its large initializers as
  memory-mapped external tensors; nothing reads them wholesale, so models above 2 GB work.
* **Safety.**  An external-data ``location`` that escapes the model's folder (``../../etc/passwd``,
  an absolute path, a symbolic link leading out) is refused, for every tensor in the model:
  initializers, Constant and other tensor attributes, in subgraphs and in model-local functions.
  Loading it would read arbitrary files.  Bytes and protos have no folder, so their external data is
  refused unless the caller names one (``base_dir``).
* **Atomic writes.**  :func:`save_model` writes into a temporary folder beside the destination and
  moves the files into place only when everything was written, the data under a fresh name and the
  model by one rename, so an interrupted run never leaves a half-written model, nor a model paired
  with another save's weights; it refuses to write over the model it was loaded from.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
import onnx_ir as ir

from mograph._model_checks import check_declarations, check_structure
from mograph._tempfiles import owned_tempdir, sweep_stale
from mograph._traverse import graphs_and_functions, subgraphs
from mograph.errors import InternalError, ModelError, UsageError
from mograph.ir_version import fit_ir_version
from mograph.irutil import serialize_model

__all__ = [
    "ModelSource",
    "load_model",
    "save_model",
    "sweep_save_leftovers",
    "to_format",
    "model_size_bytes",
    "copy_model",
    "external_tensors",
    "check_external_data",
    "check_model_file",
    "TWO_GB",
    "SOURCE_KEY",
]

TWO_GB = 2**31

#: Anything :func:`load_model` accepts.
ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto, ir.Model, Any]


def _all_tensors(model: ir.Model) -> Iterator[tuple[str, ir.TensorProtocol]]:
    """Every tensor in the model with a description of where it sits: initializers of every graph,
    and tensor-valued attributes (``value`` of Constant, TENSOR and TENSORS attributes of any node)
    in the main graph, its subgraphs and model-local functions."""
    for owner in graphs_and_functions(model):
        if isinstance(owner, ir.Graph):
            for value in owner.initializers.values():
                if value.const_value is not None:
                    yield f"initializer '{value.name}'", value.const_value
        for node in owner:  # each subgraph is visited as an owner of its own
            for attr in node.attributes.values():
                if attr.is_ref() or attr.value is None:
                    continue
                label = f"attribute '{attr.name}' of node '{node.name or node.op_type}'"
                if attr.type == ir.AttributeType.TENSOR:
                    yield label, attr.value
                elif attr.type == ir.AttributeType.TENSORS:
                    for tensor in attr.value:
                        yield label, tensor


def external_tensors(model: ir.Model) -> list[ir.ExternalTensor]:
    """Every tensor of ``model`` whose values live in an external file, wherever it sits."""
    return [t for _, t in _all_tensors(model) if isinstance(t, ir.ExternalTensor)]


def check_external_data(model: ir.Model, origin: str = "an onnx_ir.Model") -> None:
    """Refuse an ``onnx_ir.Model`` whose external data lies outside its tensors' folders, or has no folder.

    What :func:`load_model` checks for paths, bytes and protos, for a model that reaches a runtime
    without going through it (``ir.ExternalTensor`` s built by hand, a copy that lost its folder):
    a tensor without a folder would be read from the current directory.

    Raises:
        ModelError: a location that escapes its folder, or an external tensor with no folder.
    """
    _check_external_data(model, None, origin, exists=False)


#: Model files whose external data :func:`load_model` found inside their folder, by resolved path:
#: the file's (device, inode, size, mtime) then.  :func:`check_model_file` reads a file again only
#: when it is not here or has changed since.
_CHECKED_FILES: dict[str, tuple[int, int, int, int]] = {}


def _stamp(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_model_file(path: str | os.PathLike) -> None:
    """Refuse a model file whose external data lies outside its folder, before a runtime reads it
    itself (ONNX Runtime given the path; before 1.24 it followed any location).

    The checks are :func:`load_model`'s; a file it already loaded, unchanged since, is not read again
    (``mograph bench`` measures the memory of session creation).

    Raises:
        ModelError: the file is missing or unreadable, or its external data escapes its folder.
    """
    resolved = Path(path).resolve()
    try:
        if _CHECKED_FILES.get(str(resolved)) == _stamp(resolved):
            return
    except OSError:
        pass  # load_model says what is wrong with the file
    load_model(path, check=False)


def copy_model(model: ir.Model) -> ir.Model:
    """An independent copy of ``model`` through a serialized round trip, its external tensors still
    reading from the folder the original's read from.

    ``onnx_ir``'s serializer keeps an external tensor's location but not its folder (``base_dir``): a
    bare round trip gives a copy that would resolve every location against the current directory,
    reading whatever file of that name sits there.

    The copy shares the original's external tensors (read-only memory maps: mapped once, not twice), and
    a model whose in-memory tensors are too big for one protobuf (:func:`mograph._spill.too_big`) shares
    those too instead of copying them (:func:`mograph._spill.shared_copy`).
    """
    from mograph import _spill

    copy = _spill.shared_copy(model, in_memory=_spill.too_big(model))
    originals = [t for _, t in _all_tensors(model)]
    copies = [t for _, t in _all_tensors(copy)]
    if len(originals) != len(copies):  # the walk is the same on both: this would be an onnx_ir change
        raise ModelError(f"copying the model changed its tensors ({len(originals)} -> {len(copies)})")
    for original, copied in zip(originals, copies):
        if isinstance(copied, ir.ExternalTensor):
            copied.base_dir = original.base_dir if isinstance(original, ir.ExternalTensor) else ""
    return copy


def _check_external_data(model: ir.Model, base_dir: Path | None, origin: str, *, exists: bool) -> None:
    """Refuse external data outside the model's folder, and point every external tensor at it.

    A location may not be absolute, may not climb out with ``..``, and may not be a symbolic link
    that leads out: reading it would hand the bytes of an arbitrary file (``/etc/passwd``, a key) to
    constant folding and from there into the saved model.  A model without a folder of its own
    (bytes, a ``ModelProto``) has nothing to resolve locations against, so its external data is refused
    unless ``base_dir`` names one.  Tensors of an ``onnx_ir.Model`` keep the folder they were loaded
    with.  With ``exists``, the file must also be there.
    """
    for where, tensor in _all_tensors(model):
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        loc = str(tensor.location)
        folder = base_dir if base_dir is not None else (Path(tensor.base_dir) if tensor.base_dir else None)
        if folder is None:
            raise ModelError(
                f"{where} has external data at '{loc}', but a model given as {origin} has no folder to read "
                "it from: refused; load the model from its path (or give base_dir)"
            )
        base = folder.resolve()
        try:
            target = (base / loc).resolve()
        except (OSError, ValueError) as exc:  # NUL bytes, symlink loops ...
            raise ModelError(f"{where} has an unusable external data location {loc!r}: {exc}") from exc
        if not loc or os.path.isabs(loc) or base not in target.parents:
            raise ModelError(
                f"{where} has external data at '{loc}', outside the model's folder {base}: refused "
                "(it could read arbitrary files)"
            )
        if exists and not target.is_file():
            raise ModelError(f"{where} has external data at '{loc}', which does not exist beside the model in {base}")
        if target.is_file():
            offset, length = tensor.offset or 0, tensor.length
            available = target.stat().st_size
            if offset < 0 or (length is not None and length < tensor.nbytes) or offset + tensor.nbytes > available:
                raise ModelError(
                    f"{where} declares {tensor.nbytes} bytes of external data (shape {list(tensor.shape.numpy())}) "
                    f"at offset {offset} in '{loc}', which holds {available} bytes"
                    + (f" (its length field says {length})" if length is not None else "")
                )
        tensor.base_dir = str(base)


#: Where a tensor without ``raw_data`` keeps its values, by dtype (everything else: ``int32_data``).
_TYPED_FIELD = {
    ir.DataType.FLOAT: "float_data",
    ir.DataType.COMPLEX64: "float_data",
    ir.DataType.DOUBLE: "double_data",
    ir.DataType.COMPLEX128: "double_data",
    ir.DataType.INT64: "int64_data",
    ir.DataType.UINT32: "uint64_data",
    ir.DataType.UINT64: "uint64_data",
}


def _check_tensor_data(model: ir.Model) -> None:
    """Refuse tensors whose declared size is not the data they hold, before anything is allocated.

    A tensor declaring 2^40 elements with 16 bytes of data would otherwise be expanded by the first
    pass that looks at its values (tens of gigabytes), or written out as a terabyte of zeros.  Only
    metadata and field lengths are read here; external data is checked against its file's size in
    :func:`_check_external_data`.
    """
    for where, tensor in _all_tensors(model):
        try:
            dtype = tensor.dtype
        except ValueError as exc:  # a data_type number ONNX does not define
            raise ModelError(f"{where} has an unknown data type: {exc}") from exc
        if dtype == ir.DataType.UNDEFINED:
            raise ModelError(f"{where} has no data type (UNDEFINED)")
        dims = tuple(tensor.shape.numpy())
        if any(d < 0 for d in dims):
            raise ModelError(f"{where} has a negative dimension in its shape {list(dims)}")
        size = math.prod(dims)
        if isinstance(tensor, ir.StringTensor):
            held = len(tensor.raw)
            if held != size:
                raise ModelError(f"{where} declares {size} strings (shape {list(dims)}) but holds {held}")
        elif isinstance(tensor, ir.TensorProtoTensor):
            proto = tensor.raw
            if proto.raw_data:
                if len(proto.raw_data) != tensor.nbytes:
                    raise ModelError(
                        f"{where} declares {size} elements of {tensor.dtype.name} (shape {list(dims)}, "
                        f"{tensor.nbytes} bytes) but holds {len(proto.raw_data)} bytes of data"
                    )
                continue
            field = _TYPED_FIELD.get(tensor.dtype, "int32_data")
            held = len(getattr(proto, field))
            if tensor.dtype in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128):
                need = 2 * size
            elif tensor.dtype.bitwidth < 8:  # packed, one byte per int32 value
                need = tensor.nbytes
            else:
                need = size
            if held != need:
                raise ModelError(
                    f"{where} declares {size} elements of {tensor.dtype.name} (shape {list(dims)}) but holds "
                    f"{held} values"
                )


def _all_initializers(model: ir.Model) -> list[ir.Value]:
    out = list(model.graph.initializers.values())
    for sub in subgraphs(model.graph):
        out.extend(sub.initializers.values())
    return out


def _load_file(path: Path, *, stream: bool = True) -> ir.Model:
    """The model in the ``.onnx`` file at ``path``: a large file with its big weights read from the file
    straight into their arrays (:mod:`mograph._stream_load`: they are in memory once, not twice), any
    other (or with ``stream=False``) with ``onnx.load``."""
    from mograph import _stream_load

    try:
        streamed = _stream_load.load(path) if stream else None
        proto = streamed.proto if streamed is not None else onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises several unrelated types
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from exc
    try:
        if not proto.graph.node and not proto.graph.output:
            raise ModelError(f"{path}: not an ONNX model (no graph found: truncated or another format?)")
        model = _from_proto(proto)
    except BaseException:
        if streamed is not None:
            streamed.close()
        raise
    del proto
    if streamed is not None and not streamed.fill(model):
        return _load_file(path, stream=False)
    return model


def _from_proto(proto: onnx.ModelProto) -> ir.Model:
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as exc:  # noqa: BLE001 - any decoding failure means a bad model
        # onnx-ir wraps the cause once per enclosing graph or node: the innermost error says what is wrong.
        inner: BaseException = exc
        while inner.__cause__ is not None:
            inner = inner.__cause__
        maps = _map_typed(proto) if isinstance(inner, NotImplementedError) else []
        if maps:
            raise ModelError(
                f"cannot read the model: {maps[0]}{f' (and {len(maps) - 1} more)' if len(maps) > 1 else ''} "
                "has a map type, which mograph's IR (onnx-ir) cannot hold; a classifier's ZipMap output can be "
                "left out at conversion (skl2onnx/onnxmltools: zipmap=False)"
            ) from exc
        detail = str(exc) if inner is exc else f"{exc} ({type(inner).__name__}: {inner})"
        raise ModelError(f"cannot read the model: {detail}") from exc
    return model


def _map_typed(proto: onnx.ModelProto) -> list[str]:
    """The main graph's values whose type holds a map (``map``, or a ``sequence``/``optional`` of one), each
    said as ``role 'name' (TYPE, made by OP)``."""
    def has_map(t: onnx.TypeProto) -> bool:
        kind = t.WhichOneof("value")
        if kind == "map_type":
            return True
        if kind == "sequence_type":
            return has_map(t.sequence_type.elem_type)
        if kind == "optional_type":
            return has_map(t.optional_type.elem_type)
        return False

    def text(t: onnx.TypeProto) -> str:
        kind = t.WhichOneof("value")
        if kind == "tensor_type":
            return f"tensor({onnx.TensorProto.DataType.Name(t.tensor_type.elem_type).lower()})"
        if kind == "map_type":
            key = onnx.TensorProto.DataType.Name(t.map_type.key_type).lower()
            return f"map({key}, {text(t.map_type.value_type)})"
        if kind == "sequence_type":
            return f"seq({text(t.sequence_type.elem_type)})"
        if kind == "optional_type":
            return f"optional({text(t.optional_type.elem_type)})"
        return str(kind)

    graph = proto.graph
    made_by = {o: n.op_type for n in graph.node for o in n.output}
    found = []
    for role, values in (("input", graph.input), ("output", graph.output), ("value", graph.value_info)):
        for v in values:
            if has_map(v.type):
                op = made_by.get(v.name)
                found.append(f"{role} '{v.name}' ({text(v.type)}{f', made by {op}' if op else ''})")
    return found


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Turn the cyclic garbage collector off while the block runs (as it was, after).

    Why: decoding a model makes millions of objects that all stay alive (a 100k-node graph: its nodes,
    values, attributes and their protobuf fields), and each collection on the way walks what was made so
    far: loading that graph ran 10 full collections (1.1 of its 4.6 CPU-seconds) that together found 20
    unreachable objects, against 2 (0.07 s) at 10k nodes: the part of the load that grew faster than the
    graph.  Objects freed by reference counting are freed as usual; a reference cycle made in the block
    waits for the next collection after it.  Nothing changes when the collector is already off.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def load_model(source: ModelSource, *, check: bool = True, base_dir: str | os.PathLike | None = None) -> ir.Model:
    """Turn any accepted model form into an ``onnx_ir.Model``.

    Args:
        source: a path to an ``.onnx`` file (external data is resolved next to it and mapped
            lazily; in a file of 64 MiB or more, large in-protobuf weights are read from the file
            straight into their arrays: :mod:`mograph._stream_load`), the bytes of a serialised model, an ``onnx.ModelProto``, an ``onnx_ir.Model``
            (returned as is: passes then rewrite it in place) or an ``onnx_graphsurgeon.Graph``.
        check: refuse models with a missing initializer, a cycle, or a missing external-data file.
            External data outside the model's folder is refused whatever ``check`` says (except in an
            ``onnx_ir.Model``, which is the caller's own object and is checked only with ``check``).
        base_dir: the folder external data is read from, for a model given as bytes or a
            ``ModelProto`` (which have none of their own: without it their external data is refused).

    The garbage collector is off while it runs (:func:`collection_paused`).

    Raises:
        ModelError: the file is missing, not ONNX, truncated, or structurally invalid.
    """
    with collection_paused():
        return _load_model(source, check=check, base_dir=base_dir)


def _load_model(source: ModelSource, *, check: bool = True, base_dir: str | os.PathLike | None = None) -> ir.Model:
    """:func:`load_model`, with the collector as the caller left it."""
    folder = Path(base_dir) if base_dir is not None else None
    origin = "an onnx_ir.Model"
    if isinstance(source, ir.Model):
        model = source
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise ModelError(f"{path}: no such file")
        if path.is_dir():
            raise ModelError(f"{path}: is a folder, not an ONNX file")
        if not path.is_file():  # a device (/dev/zero) or a pipe would be read forever
            raise ModelError(f"{path}: not a regular file")
        folder = path.resolve().parent
        origin = "a path"
        model = _load_file(path)
        model.meta[SOURCE_KEY] = str(path.resolve())
        stamp = _stamp(path.resolve())
    elif isinstance(source, (bytes, bytearray)):
        origin = "bytes"
        try:
            proto = onnx.load_from_string(bytes(source))
        except Exception as exc:  # noqa: BLE001
            raise ModelError(f"bytes are not a readable ONNX model: {exc}") from exc
        if not proto.graph.node and not proto.graph.output:
            raise ModelError("bytes are not an ONNX model (no graph found)")
        model = _from_proto(proto)
    elif isinstance(source, onnx.ModelProto):
        origin = "an onnx.ModelProto"
        model = _from_proto(source)
    elif type(source).__module__.startswith("onnx_graphsurgeon"):
        import onnx_graphsurgeon as gs

        origin = "a graphsurgeon graph"
        model = _from_proto(gs.export_onnx(source))
    else:
        raise UsageError(
            f"cannot load a model from {type(source).__name__}: give a path, bytes, onnx.ModelProto, "
            "onnx_ir.Model or onnx_graphsurgeon.Graph"
        )
    if not isinstance(source, ir.Model):
        fit_ir_version(model)  # what mograph runs and writes from it is readable by the installed runtime
    if check or not isinstance(source, ir.Model):
        _check_tensor_data(model)
        _check_external_data(model, folder, origin, exists=check)
    if not isinstance(source, ir.Model):
        _decode_initializers(model)
    if origin == "a path":
        _CHECKED_FILES[str(model.meta[SOURCE_KEY])] = stamp  # taken before reading: a later change shows
    from mograph import _spill

    _spill.remember_data_files(model)  # their pages are dropped before each session (_spill.drop_pages)
    if check:
        check_structure(model)
        check_declarations(model)
    return model


#: Dtypes whose protobuf data numpy holds as is (others keep onnx-ir's own decoding on each read).
_NUMPY_NATIVE = frozenset({
    ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.INT8, ir.DataType.INT16,
    ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32,
    ir.DataType.UINT64, ir.DataType.BOOL,
})


def _decode_initializers(model: ir.Model) -> None:
    """Decode each in-protobuf initializer into a numpy-backed tensor, once.

    An initializer straight from ``deserialize_model`` decodes its protobuf field on every
    ``numpy()`` call (a full copy of the weight each time): rules that ask "is this input a
    constant?" of every weight they pass made a 30-layer LLaMA spend minutes copying weights.  Once
    every tensor is decoded nothing refers to the protobuf any more, so it is freed when loading ends:
    the weights sit in memory once, not twice.  External tensors stay lazy.
    """
    for graph in [model.graph, *subgraphs(model.graph)]:
        for value in graph.initializers.values():
            decoded = _decoded(value.const_value)
            if decoded is not None:
                value.const_value = decoded
    for owner in graphs_and_functions(model):
        for node in owner:
            for key, attr in list(node.attributes.items()):
                if attr.type == ir.AttributeType.TENSOR and not attr.is_ref():
                    decoded = _decoded(attr.value)
                    if decoded is not None:
                        node.attributes[key] = ir.AttrTensor(key, decoded, doc_string=attr.doc_string)


def _decoded(tensor: object) -> ir.Tensor | None:
    if not isinstance(tensor, ir.serde.TensorProtoTensor) or tensor.dtype not in _NUMPY_NATIVE:
        return None
    return ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=tensor.name, doc_string=tensor.doc_string,
                     metadata_props=dict(tensor.metadata_props) or None)


def model_size_bytes(model: ir.Model) -> int:
    """Bytes of initializer data (the bulk of a saved model), without reading external data."""
    total = 0
    for value in _all_initializers(model):
        tensor = value.const_value
        if tensor is not None:
            total += tensor.nbytes
    return total


def save_model(
    model: ir.Model,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
    forbid: str | os.PathLike | None = None,
    overwrite_source: bool = False,
) -> Path:
    """Write ``model`` to ``path`` atomically, its external data with it.

    Args:
        model: the model to write.
        path: destination ``.onnx`` file.
        external_data: write initializers to a data file beside the model (``<name>.data``, or
            ``<name>.<id>.data`` when a file of that name is already there). ``None`` chooses it when
            the initializers need 256 MiB or more (:func:`mograph._spill.save_external_bytes`: written inline,
            they would be copied twice in memory on the way) or the model already had external data; ``False``
            writes one self-contained file (external tensors are read in for it).
        forbid: a path that must not be written over (the input model).
        overwrite_source: allow writing over the file the model was loaded from (refused otherwise:
            the model may still read its weights beside it, and the original would be lost).

    A reader of ``path`` sees the old model with its old data or the new model with its new data,
    never a mix, even if the process is killed half-way: the new data goes under a name no existing
    file has (so nothing another model reads is replaced), one rename then switches the model file,
    and only after that is the data file the old model read removed (if it was one of ours and nothing
    loaded still reads it).  Temporary folders of saves that were killed are swept on the next save.

    Returns:
        The destination path.
    """
    dest = Path(path)
    if forbid is not None and _same_file(dest, Path(forbid)):
        raise UsageError(f"refusing to write over the input model {forbid}; choose another output path")
    source = model.meta.get(SOURCE_KEY)
    if not overwrite_source and isinstance(source, str) and _same_file(dest, Path(source)):
        raise UsageError(
            f"refusing to write over {source}, the file this model was loaded from (its weights may still be "
            "read from beside it); choose another path, or allow it explicitly (overwrite=True)"
        )
    if external_data is None:
        from mograph import _spill

        external_data = model_size_bytes(model) >= _spill.save_external_bytes() or any(
            isinstance(v.const_value, ir.ExternalTensor) for v in _all_initializers(model)
        )
    elif not external_data and model_size_bytes(model) >= TWO_GB:
        raise UsageError(
            f"the model's initializers need {model_size_bytes(model) / 2**30:.1f} GiB, past protobuf's 2 GB "
            "limit: save it with external data"
        )
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        sweep_save_leftovers(dest.parent)  # a killed save of any model in this folder, not just this one
        tmp = owned_tempdir(f".{dest.name}.", dir=dest.parent)
    except OSError as exc:  # an output folder that cannot be created or written is the user's to fix
        raise UsageError(f"cannot write {dest}: {exc.strerror or exc}") from exc
    fit_ir_version(model)  # never newer than the installed runtime reads (mograph.ir_version)
    old_data = _own_data_files(dest)
    placed: Path | None = None
    try:
        tmp_model = tmp.path / dest.name
        if external_data:
            data_name = _fresh_data_name(dest)
            with _attributes_inlined(model):
                ir.save(model, tmp_model, external_data=data_name)
            if data_name in _locations(tmp_model):  # tensors below the size threshold stay inline
                placed = dest.parent / data_name
                os.replace(tmp.path / data_name, placed)  # a new name: replaces nothing
        else:
            with _inlined(model), _attributes_inlined(model):
                _write_inline(model, tmp_model)
        os.replace(tmp_model, dest)  # the one switch from the old pair to the new
    except BaseException as exc:
        if placed is not None:  # the new data no model reads yet
            with contextlib.suppress(OSError):
                placed.unlink()
        if isinstance(exc, OSError):  # disk full, a folder in the way ...: nothing half-written is left
            raise UsageError(f"cannot write {dest}: {exc.strerror or exc}") from exc
        raise
    finally:
        tmp.cleanup()
    read_now = [Path(t.path) for t in external_tensors(model)]
    for stale in old_data:
        if stale != placed and not any(_same_file(stale, r) for r in read_now):
            with contextlib.suppress(OSError):
                stale.unlink()
    return dest


#: Initializers at least this big are written one at a time by :func:`_write_inline`.
_STREAMED_BYTES = 1 << 20


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _write_inline(model: ir.Model, path: Path) -> None:
    """Write ``model`` as one self-contained protobuf file, its large initializers one at a time.

    ``ir.save`` builds the whole ``ModelProto`` (a copy of every weight) and then its serialized bytes
    (another copy): a model with 1 GB of weights needs 3 GB to be written.  Here the model is
    serialized with a stand-in (an external reference, no data) for each large initializer of the main
    graph, the stand-ins are taken out of the graph's message, and each large initializer is then
    serialized on its own and appended to the graph's bytes (protobuf lets a message's repeated fields
    come in any order and in separate pieces), so at most one weight is copied at a time.  The file
    parses to the same model (the initializers' value infos and annotations included), large
    initializers listed after the others.

    Each streamed tensor is named after its *value*, as ``ir.serde`` names every initializer: a pass's
    new tensor (``ir.tensor(array)``) has no name of its own, and an unnamed initializer in the file is
    dropped by the next load, leaving its node reading nothing.
    """
    graph = model.graph
    big = [v for v in graph.initializers.values() if v.const_value is not None and v.const_value.nbytes >= _STREAMED_BYTES]
    stand_ins: dict[str, ir.Value] = {}
    real: list[ir.TensorProtocol] = []
    try:
        for v in big:
            t = v.const_value
            assert t is not None
            location = f"mograph-streamed-{len(stand_ins)}"
            stand_ins[location] = v
            real.append(t)
            v.const_value = ir.ExternalTensor(location, 0, t.nbytes, t.dtype, shape=ir.Shape(t.shape.numpy()),
                                              name=v.name, base_dir="")  # type: ignore[arg-type]
        proto = serialize_model(model)
    finally:
        for v, t in zip(stand_ins.values(), real):
            v.const_value = t
    inits = proto.graph.initializer
    taken = 0
    for i in reversed(range(len(inits))):
        where = {e.key: e.value for e in inits[i].external_data}
        if inits[i].data_location == onnx.TensorProto.EXTERNAL and where.get("location") in stand_ins:
            del inits[i]
            taken += 1
    if taken != len(big):
        raise InternalError("save", f"{len(big)} large initializers to stream, {taken} stand-ins found")
    graph_bytes = proto.graph.SerializeToString()
    proto.ClearField("graph")
    head = proto.SerializeToString()
    del proto

    def tensor_proto(v: ir.Value) -> onnx.TensorProto:
        if not v.name:
            raise InternalError("save", "an initializer of the graph has no name")
        out = ir.serde.serialize_tensor(v.const_value)  # type: ignore[arg-type]
        out.name = v.name  # the value's name, whatever the tensor's is
        return out

    sizes = [tensor_proto(v).ByteSize() for v in big]
    graph_len = len(graph_bytes) + sum(1 + len(_varint(n)) + n for n in sizes)
    with open(path, "wb") as f:
        f.write(head)
        f.write(b"\x3a" + _varint(graph_len))  # ModelProto.graph: field 7, length-delimited
        f.write(graph_bytes)
        for v, n in zip(big, sizes):
            data = tensor_proto(v).SerializeToString()
            if len(data) != n:
                raise InternalError("save", f"initializer '{v.name}' serialized to {len(data)} bytes, not {n}")
            f.write(b"\x2a" + _varint(n))  # GraphProto.initializer: field 5, length-delimited
            f.write(data)
            del data


def sweep_save_leftovers(folder: str | os.PathLike) -> list[Path]:
    """Remove what saves into ``folder`` left when their process was killed; return what was removed.

    A save writes into a hidden folder ``.<name>.<random>`` beside its destination that holds a lock
    file locked by the saving process (:mod:`mograph._tempfiles`); such a folder whose lock nobody
    holds is a dead save's (a SIGKILL mid-write leaves the partial model and data there).  Every run
    that writes into ``folder`` calls this first, whatever model it writes (and every other file mograph
    writes there: a report, a CSV export, a precision plan, a ledger, through
    :func:`mograph._paths.sweep_dead_saves`); folders without the lock file, and live saves (locked), are
    never touched.
    """
    return sweep_stale(folder, ".")


#: ``model.meta`` key holding the resolved path a model was loaded from.
SOURCE_KEY = "mograph.source_path"


def _fresh_data_name(dest: Path) -> str:
    """``<name>.data``, or ``<name>.<id>.data`` when that exists: a name no file beside ``dest`` has."""
    name = f"{dest.name}.data"
    while (dest.parent / name).exists() or (dest.parent / name).is_symlink():
        name = f"{dest.name}.{secrets.token_hex(4)}.data"
    return name


def _own_data_files(dest: Path) -> list[Path]:
    """The data files the model at ``dest`` reads that a save of ``dest`` wrote (``<name>[.<id>].data``
    beside it); files named otherwise may be shared with other models and are never removed."""
    ours = re.compile(re.escape(dest.name) + r"(\.[0-9a-f]{8})?\.data")
    try:
        present = any(ours.fullmatch(name) for name in os.listdir(dest.parent))
    except OSError:
        present = True  # cannot tell: read the model to find out
    if not present:  # nothing of ours to remove: do not read (a possibly large) old model at all
        return []
    return [dest.parent / loc for loc in _locations(dest) if ours.fullmatch(loc)]


def _locations(path: Path) -> set[str]:
    """The external-data locations the model file at ``path`` reads (none if it is not one)."""
    if not path.is_file():
        return set()
    from mograph import _stream_load

    try:
        proto = _stream_load.proto_without_weights(path)  # a large file's weights are not read
    except Exception:  # noqa: BLE001 - an unreadable old output reads nothing of ours
        return set()
    found: set[str] = set()
    for tensor in _proto_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            found.update(e.value for e in tensor.external_data if e.key == "location")
    return found


def _proto_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    graphs = [proto.graph]
    while graphs:
        graph = graphs.pop()
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)


@contextlib.contextmanager
def _inlined(model: ir.Model) -> Iterator[None]:
    """Hold external tensors in memory while the model is written without external data.

    Otherwise their references would be written as they are, relative to a folder the new file may
    not be in.
    """
    external = [v for v in _all_initializers(model) if isinstance(v.const_value, ir.ExternalTensor)]
    saved = [v.const_value for v in external]
    try:
        for value, tensor in zip(external, saved):
            assert tensor is not None
            value.const_value = ir.Tensor(np.array(tensor.numpy()), name=value.name)
        yield
    finally:
        for value, tensor in zip(external, saved):
            value.const_value = tensor


def _in_memory(tensor: ir.TensorProtocol) -> ir.Tensor:
    return ir.Tensor(np.array(tensor.numpy()), dtype=tensor.dtype, name=tensor.name)


@contextlib.contextmanager
def _attributes_inlined(model: ir.Model) -> Iterator[None]:
    """Hold external tensors of attributes (a Constant's ``value``) in memory while the model is written.

    Only initializers are moved into the new data file; an attribute's reference would otherwise be
    written as it is, relative to the input's folder, and the saved model would read a file that is not
    beside it (or none at all).
    """
    swapped: list[tuple[ir.Node, str, ir.Attr]] = []
    for owner in graphs_and_functions(model):
        for node in owner:
            for name, attr in list(node.attributes.items()):
                if attr.is_ref() or attr.value is None:
                    continue
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    value: Any = _in_memory(attr.value)
                elif attr.type == ir.AttributeType.TENSORS and any(
                    isinstance(t, ir.ExternalTensor) for t in attr.value
                ):
                    value = [_in_memory(t) if isinstance(t, ir.ExternalTensor) else t for t in attr.value]
                else:
                    continue
                node.attributes[name] = ir.Attr(name, attr.type, value, doc_string=attr.doc_string)
                swapped.append((node, name, attr))
    try:
        yield
    finally:
        for node, name, attr in swapped:
            node.attributes[name] = attr


def _same_file(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` name the same file (symbolic and hard links included)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def to_format(model: ir.Model, like: object) -> object:
    """Return ``model`` in the same form as ``like`` (the object the user passed in)."""
    if isinstance(like, onnx.ModelProto) or isinstance(like, (bytes, bytearray)):
        proto = ir.serde.serialize_model(model)
        return proto.SerializeToString() if isinstance(like, (bytes, bytearray)) else proto
    if type(like).__module__.startswith("onnx_graphsurgeon"):
        import onnx_graphsurgeon as gs

        return gs.import_onnx(ir.serde.serialize_model(model))
    return model
