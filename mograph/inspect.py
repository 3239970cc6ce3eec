"""What is in a model: opsets, inputs and outputs, operators, parameters and sizes.

:func:`summarize` answers from the model's structure and tensor metadata only: external data is
never read (a tensor's size comes from its shape and dtype, a data file's size from the file system),
so summarizing a 20 GB model costs what loading its graph costs.  External data is resolved against
the model's own folder, and a location outside it is refused as the loader refuses it (inspect never
reports the size of a file the model may not read).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import onnx_ir as ir

from mograph import ir_io
from mograph._traverse import subgraphs
from mograph.errors import ModelError

__all__ = ["summarize", "format_summary", "op_key"]

_DEFAULT_DOMAINS = ("", "ai.onnx")


def op_key(node: ir.Node) -> str:
    """``Conv`` for the default domain, ``domain::Op`` otherwise."""
    return node.op_type if node.domain in _DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"


_DTYPE_NAMES = {"FLOAT": "float32", "DOUBLE": "float64"}


def _dtype_name(dtype: ir.DataType | None) -> str | None:
    """``float32``, ``float16``, ``int64`` ... (numpy's spelling where ONNX's differs)."""
    if dtype is None:
        return None
    return _DTYPE_NAMES.get(dtype.name, dtype.name.lower())


def _dims(shape: ir.Shape | None) -> list[int | str] | None:
    if shape is None:
        return None
    return [d if isinstance(d, int) else (d.value or "?") for d in shape]


def _io(value: ir.Value) -> dict[str, Any]:
    return {
        "name": value.name,
        "dtype": _dtype_name(value.dtype),
        "shape": _dims(value.shape),
    }


def _attr_elements(attr: Any) -> tuple[int, str | None]:
    """Element count and dtype of a Constant node's value attribute."""
    name = attr.name
    if attr.is_ref():
        return 0, None
    if name in ("value", "sparse_value"):
        tensor = attr.value
        if tensor is None or attr.type != ir.AttributeType.TENSOR:
            return 0, None
        return math.prod(tensor.shape.numpy()), _dtype_name(tensor.dtype)
    if name in ("value_floats", "value_ints", "value_strings"):
        kind = {"value_floats": "float32", "value_ints": "int64", "value_strings": "string"}[name]
        return (len(attr.value), kind) if isinstance(attr.value, (list, tuple)) else (1, kind)
    if name in ("value_float", "value_int", "value_string"):
        kind = {"value_float": "float32", "value_int": "int64", "value_string": "string"}[name]
        return 1, kind
    return 0, None


def _graphs(model: ir.Model) -> list[ir.Graph]:
    return [model.graph, *subgraphs(model.graph)]


def summarize(source: Any) -> dict[str, Any]:
    """Summarize a model given as a path (or any form :func:`mograph.load` accepts).

    Returns:
        A JSON-serialisable dict: ``producer``, ``ir_version``, ``opsets``, ``inputs``,
        ``outputs``, ``nodes`` (main graph and with subgraphs), ``ops`` (histogram,
        domain-qualified outside the default domain), ``functions``, ``parameters`` (total and by
        dtype: initializer elements plus Constant-node tensors), ``sizes`` (file, external data,
        initializer bytes) and ``warnings`` (structural problems found, if any).
    """
    path = Path(source) if isinstance(source, (str, os.PathLike)) else None
    model = ir_io.load_model(source, check=False)
    warnings: list[str] = []
    try:
        ir_io.load_model(model, check=True)  # structure only: dangling references, cycles
    except ModelError as exc:
        warnings.append(str(exc))

    ops: Counter[str] = Counter()
    main_nodes = len(model.graph)
    total_nodes = 0
    params: Counter[str] = Counter()
    init_bytes = 0
    external: dict[str, dict[str, Any]] = {}
    for graph in _graphs(model):
        for node in graph:
            total_nodes += 1
            ops[op_key(node)] += 1
            if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS:
                for attr in node.attributes.values():
                    count, dtype = _attr_elements(attr)
                    if dtype is not None:
                        params[dtype] += count
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue
            params[str(_dtype_name(tensor.dtype))] += math.prod(tensor.shape.numpy())
            init_bytes += tensor.nbytes
            if isinstance(tensor, ir.ExternalTensor):
                entry = external.setdefault(str(tensor.location), {"tensors": 0, "bytes": 0})
                entry["tensors"] += 1
                entry["bytes"] += tensor.nbytes

    file_size = path.stat().st_size if path is not None and path.is_file() else None
    ext_files = []
    for location, entry in sorted(external.items()):
        on_disk = None
        if path is not None:
            target = path.resolve().parent / location
            on_disk = target.stat().st_size if target.is_file() else None
            if on_disk is None:
                warnings.append(f"external data file '{location}' is missing beside the model")
        ext_files.append({"location": location, "tensors": entry["tensors"], "bytes": entry["bytes"], "file_size": on_disk})
    ext_total = sum(f["file_size"] or 0 for f in ext_files)

    return {
        "model": str(path) if path is not None else None,
        "producer": {
            "name": model.producer_name or None,
            "version": model.producer_version or None,
            "domain": model.domain or None,
            "model_version": model.model_version,
        },
        "ir_version": model.ir_version,
        "opsets": {(d or "ai.onnx"): v for d, v in sorted(model.opset_imports.items())},
        "graph_name": model.graph.name,
        "inputs": [_io(v) for v in model.graph.inputs if not v.is_initializer()],
        "outputs": [_io(v) for v in model.graph.outputs],
        "nodes": {"main_graph": main_nodes, "total": total_nodes, "subgraphs": len(_graphs(model)) - 1},
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "functions": sorted(f"{d}::{n}" for (d, n, _o) in model.functions),
        "parameters": {"total": sum(params.values()), "by_dtype": dict(sorted(params.items()))},
        "sizes": {
            "file": file_size,
            "external_data": ext_total,
            "external_files": ext_files,
            "initializer_bytes": init_bytes,
            "total_on_disk": (file_size or 0) + ext_total if file_size is not None else None,
        },
        "metadata": dict(model.metadata_props),
        "warnings": warnings,
    }


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _count(n: int) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n:,} ({n / div:.2f}{suffix})"
    return f"{n:,}"


def _shape(dims: list[Any] | None) -> str:
    return "?" if dims is None else "[" + ", ".join(map(str, dims)) + "]"


def format_summary(s: dict[str, Any], *, top: int | None = None) -> str:
    """The summary as text for people; ``top`` limits the op histogram."""
    prod = s["producer"]
    lines = []
    if s.get("model"):
        lines.append(f"model:      {s['model']}")
    producer = " ".join(x for x in (prod["name"], prod["version"]) if x) or "-"
    lines.append(f"producer:   {producer}")
    opsets = ", ".join(f"{d} {v}" for d, v in s["opsets"].items())
    lines.append(f"ir version: {s['ir_version']}   opsets: {opsets}")
    for title in ("inputs", "outputs"):
        lines.append(f"{title}:")
        width = max((len(v["name"]) for v in s[title]), default=0)
        for v in s[title]:
            lines.append(f"  {v['name']:<{width}}  {v['dtype'] or '?':<8} {_shape(v['shape'])}")
    n = s["nodes"]
    sub = f" ({n['total']} with {n['subgraphs']} subgraph(s))" if n["subgraphs"] else ""
    lines.append(f"nodes:      {n['main_graph']}{sub}")
    p = s["parameters"]
    by = ", ".join(f"{k} {v:,}" for k, v in p["by_dtype"].items())
    lines.append(f"parameters: {_count(p['total'])}" + (f"  [{by}]" if by else ""))
    z = s["sizes"]
    size_line = f"sizes:      file {_human(z['file'])}, initializers {_human(z['initializer_bytes'])}"
    if z["external_files"]:
        size_line += f", external data {_human(z['external_data'])} in {len(z['external_files'])} file(s)"
    lines.append(size_line)
    if s["functions"]:
        lines.append(f"functions:  {', '.join(s['functions'])}")
    lines.append("ops:")
    items = list(s["ops"].items())
    shown = items if top is None else items[:top]
    width = max((len(k) for k, _ in shown), default=0)
    for op, count in shown:
        lines.append(f"  {op:<{width}}  {count}")
    if len(shown) < len(items):
        lines.append(f"  ... {len(items) - len(shown)} more op types")
    for w in s["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
