"""Load a large ``.onnx`` file with its big in-protobuf weights read straight into numpy arrays.

Why: ``onnx.load`` reads the whole file into one ``bytes`` and parses it, so the weights are in memory
twice (the file's bytes and the parsed message); decoding each initializer afterwards copies its
``raw_data`` out of the message again, so they are twice in memory a second time (the message and the
arrays).  On a 30-layer LLaMA of 622 MiB both steps peaked at 2.2x the file.  Here they are read once.

How: the file is mapped and scanned at the protobuf wire level, without decoding: the ``ModelProto``'s
fields are copied as they are, except its ``graph`` field, whose fields are copied as they are except
each large ``initializer``, which is copied without its ``raw_data`` field (its position in the file
is noted).  That skeleton, a few MiB, is parsed by protobuf (``onnx.load_model_from_string``, as
``onnx.load`` does for the whole file); after ``onnx_ir`` has deserialized it, each noted tensor's bytes
are read from the file into a new array, which becomes that initializer's value: the same
``onnx_ir.Tensor`` (dtype, shape, name, doc string, metadata, a read-only little-endian array) that
decoding the full message gives (:func:`mograph.ir_io._decode_initializers`).

Only what is plain is taken this way: a tensor whose only data is one ``raw_data`` field of a type numpy
holds as is, in the main graph (subgraphs and ``Constant`` attributes are decoded as before).  Anything
else (a wire form the scan does not expect, duplicate initializer names, a size that does not match
the shape) returns ``None``, and the caller loads the file with ``onnx.load``, whose errors and checks
then apply as before.  Files below :data:`MIN_FILE_BYTES` are not scanned: one protobuf parse is faster
(the scan is Python, a few microseconds per field of the graph) and their double copy is small.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["Loaded", "load", "proto_without_weights", "MIN_FILE_BYTES", "MIN_TENSOR_BYTES"]

#: Files smaller than this are loaded with ``onnx.load``.
MIN_FILE_BYTES = 64 << 20
#: Initializers whose serialized size is below this stay in the skeleton (decoded as before).
MIN_TENSOR_BYTES = 64 << 10

# ModelProto.graph, GraphProto.initializer, TensorProto fields (onnx.proto).
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_T_DATA_TYPE, _T_RAW_DATA, _T_DATA_LOCATION = 2, 9, 14
#: TensorProto fields whose presence means data held some other way (typed fields, external data, segment).
_T_OTHER_DATA = frozenset({3, 4, 5, 6, 7, 10, 11, 13})
#: ONNX data type numbers whose raw_data numpy reads as is (mograph.ir_io._NUMPY_NATIVE).
_PLAIN_DTYPES = frozenset(int(d) for d in (
    ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.INT8, ir.DataType.INT16,
    ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32,
    ir.DataType.UINT64, ir.DataType.BOOL,
))


#: ``madvise`` advice where the platform has it (``None`` elsewhere: then the scan just does not advise).
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if hasattr(mmap.mmap, "madvise") else None
_RANDOM = getattr(mmap, "MADV_RANDOM", None) if hasattr(mmap.mmap, "madvise") else None


class _NotPlain(Exception):
    """The file is not in the form this loader takes: load it the ordinary way."""


@dataclass
class _Stripped:
    index: int  #: position among the graph's initializers
    offset: int  #: of the raw_data bytes in the file
    length: int


@dataclass
class Loaded:
    """The skeleton's proto, and ``fill(model)``, which puts the weights left out of it into the model
    deserialized from that proto (``False`` if it could not: then load the file with ``onnx.load``).
    The file stays open until ``fill`` has run, or ``close`` is called (a caller that gives up before)."""

    proto: onnx.ModelProto
    fill: Callable[[ir.Model], bool]
    close: Callable[[], None]


def _varint(buf: Any, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _NotPlain("varint longer than 10 bytes")


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _skip(buf: Any, pos: int, wire: int, end: int) -> int:
    """The position after a field's value (``pos`` is where the value starts)."""
    if wire == 0:
        _, pos = _varint(buf, pos)
    elif wire == 1:
        pos += 8
    elif wire == 2:
        n, pos = _varint(buf, pos)
        pos += n
    elif wire == 5:
        pos += 4
    else:  # groups (3, 4) are not used by ONNX; 6, 7 are invalid
        raise _NotPlain(f"wire type {wire}")
    if pos > end:
        raise _NotPlain("a field runs past its message")
    return pos


def _strip_tensor(buf: Any, pos: int, end: int) -> tuple[bytes, int, int] | None:
    """The TensorProto in ``buf[pos:end]`` without its raw_data field, with that field's offset and length;
    ``None`` when it is not one plain raw_data tensor of a type numpy holds as is."""
    parts: list[Any] = []
    run = pos
    raw: tuple[int, int] | None = None
    dtype = 0
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == _T_RAW_DATA:
            if wire != 2 or raw is not None:  # a second raw_data replaces the first: leave that to protobuf
                return None
            n, body = _varint(buf, pos)
            pos = body + n
            if pos > end:
                raise _NotPlain("a field runs past its message")
            raw = (body, n)
            parts.append(buf[run:start])
            run = pos
            continue
        if field in _T_OTHER_DATA:
            return None
        if field in (_T_DATA_TYPE, _T_DATA_LOCATION) and wire == 0:
            value, pos = _varint(buf, pos)
            if field == _T_DATA_TYPE:
                dtype = value
            elif value != 0:  # EXTERNAL
                return None
            continue
        pos = _skip(buf, pos, wire, end)
    if pos != end:
        raise _NotPlain("a field runs past its message")
    if raw is None or dtype not in _PLAIN_DTYPES:
        return None
    parts.append(buf[run:end])
    return b"".join(parts), raw[0], raw[1]


def _scan_graph(buf: Any, pos: int, end: int, stripped: list[_Stripped], count: list[int]) -> bytes:
    """The GraphProto in ``buf[pos:end]`` with its large plain initializers' raw_data left out."""
    parts: list[Any] = []
    run = pos
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field != _GRAPH_INITIALIZER or wire != 2:
            pos = _skip(buf, pos, wire, end)
            continue
        n, body = _varint(buf, pos)
        pos = body + n
        if pos > end:
            raise _NotPlain("a field runs past its message")
        index = count[0]
        count[0] += 1
        tensor = _strip_tensor(buf, body, pos) if n >= MIN_TENSOR_BYTES else None
        if tensor is None:
            continue
        data, offset, length = tensor
        parts += [buf[run:start], _encode_varint(key), _encode_varint(len(data)), data]
        run = pos
        stripped.append(_Stripped(index, offset, length))
        if _DONTNEED is not None and isinstance(buf, mmap.mmap) and offset >= mmap.PAGESIZE:
            # Unmap what the scan touched so far: the kernel maps file pages in large blocks around the
            # ones read (a block per tensor header: +190 MiB on a 622 MiB file), and they count as ours.
            buf.madvise(_DONTNEED, 0, offset - offset % mmap.PAGESIZE)
    if pos != end:
        raise _NotPlain("a field runs past its message")
    parts.append(buf[run:end])
    return b"".join(parts)


def _scan_model(buf: Any, size: int) -> tuple[bytes, list[_Stripped], int]:
    """The skeleton's bytes, the tensors left out of it, and the graph's initializer count."""
    parts: list[Any] = []
    stripped: list[_Stripped] = []
    count = [0]
    pos = run = 0
    while pos < size:
        start = pos
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field != _MODEL_GRAPH or wire != 2:
            pos = _skip(buf, pos, wire, size)
            continue
        n, body = _varint(buf, pos)
        pos = body + n
        if pos > size:
            raise _NotPlain("a field runs past the file")
        graph = _scan_graph(buf, body, pos, stripped, count)
        parts += [buf[run:start], _encode_varint(key), _encode_varint(len(graph)), graph]
        run = pos
    if pos != size:
        raise _NotPlain("a field runs past the file")
    parts.append(buf[run:size])
    return b"".join(parts), stripped, count[0]


def _read_into(file: Any, offset: int, length: int) -> np.ndarray:
    out = np.empty(length, dtype=np.uint8)
    view = out.data
    done = 0
    while done < length:
        got = os.preadv(file.fileno(), [view[done:]], offset + done)
        if got <= 0:
            raise _NotPlain("the file ended before a tensor's data")
        done += got
    return out


def _skeleton(path: Path) -> tuple[Any, onnx.ModelProto, list[_Stripped]] | None:
    """The open file, the skeleton's proto and the tensors left out of it; ``None`` (file closed) when
    the file is small, in a text format or in a form this loader does not take."""
    fmt = onnx.serialization.registry.get_format_from_file_extension(path.suffix)
    if fmt not in (None, "protobuf") or not hasattr(os, "preadv"):
        return None
    file = open(path, "rb", buffering=0)  # noqa: SIM115 - the caller closes it
    try:
        size = os.fstat(file.fileno()).st_size
        if size < MIN_FILE_BYTES:
            file.close()
            return None
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if _RANDOM is not None:  # read the pages the scan touches, not the weights around them
                buf.madvise(_RANDOM)
            try:
                skeleton, stripped, count = _scan_model(buf, size)
            except (_NotPlain, IndexError):
                file.close()
                return None
        if not stripped:
            file.close()
            return None
        proto = onnx.load_model_from_string(skeleton)
        del skeleton
        initializers = proto.graph.initializer
        names = [t.name for t in initializers]
        if len(initializers) != count or len(set(names)) != len(names):
            file.close()
            return None
        for s in stripped:
            t = initializers[s.index]
            itemsize = int(ir.DataType(t.data_type).itemsize)
            if t.HasField("raw_data") or any(d < 0 for d in t.dims) or math.prod(t.dims) * itemsize != s.length:
                file.close()  # _check_tensor_data words the error from the full message
                return None
    except BaseException:
        file.close()
        raise
    return file, proto, stripped


def proto_without_weights(path: Path) -> onnx.ModelProto:
    """The model file's ``ModelProto``, without the ``raw_data`` of its large initializers when the file
    is one :func:`load` takes (for what names external data, the graph, the opsets: not for weights).

    Raises:
        Whatever ``onnx.load`` raises for the file.
    """
    scanned = _skeleton(path)
    if scanned is None:
        return onnx.load(str(path), load_external_data=False)
    scanned[0].close()
    return scanned[1]


def load(path: Path) -> Loaded | None:
    """The skeleton of the model file at ``path`` and how to fill it in, or ``None`` (load it with
    ``onnx.load``): a small file, a text format, or a form this loader does not take (module docstring).

    Raises:
        Whatever ``onnx.load_model_from_string`` raises for a skeleton protobuf refuses.
    """
    scanned = _skeleton(path)
    if scanned is None:
        return None
    file, proto, stripped = scanned
    initializers = proto.graph.initializer

    def fill(model: ir.Model) -> bool:
        try:
            for s in stripped:
                t = initializers[s.index]
                value = model.graph.initializers.get(t.name)
                held = None if value is None else value.const_value
                if value is None or not isinstance(held, ir.serde.TensorProtoTensor):
                    return False
                dtype = held.dtype
                array = _read_into(file, s.offset, s.length).view(dtype.numpy().newbyteorder("<"))
                array = array.reshape(tuple(t.dims))
                array.flags.writeable = False  # as np.frombuffer over the message's bytes gives it
                value.const_value = ir.Tensor(array, dtype=dtype, name=held.name, doc_string=held.doc_string,
                                              metadata_props=dict(held.metadata_props) or None)
        except _NotPlain:
            return False
        finally:
            file.close()
        return True

    return Loaded(proto, fill, file.close)
