"""The graph readers of ``fuse-attention`` (:mod:`.attention`): typed producers, scalar factors and reshape targets.

A reshape target is read entry by entry (:func:`_entries`): a constant, ``("dim", i)`` where it is dim ``i``
of a runtime ``Shape`` (through ``Gather``/``Unsqueeze``/``Concat``), or None where only its place is known (a
target compared with another tensor's dims is read by the shape query, ``GraphShapes.values``).
:func:`_heads_and_dim` proves a ``[B, S, H*D] -> [B, S, H, D]`` split from them, and :func:`_keeps_leading` a kept
``B, S``; where the targets do not tell, they ask the shape query (:class:`~mograph.passes.fusion._common.GraphShapes`).
Read-only: nothing here changes the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from mograph.patterns import constant_array, scalar_value

if TYPE_CHECKING:
    from mograph.passes.fusion._common import GraphShapes


def _producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in op_types:
        return None
    return node


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return None if attr is None else [int(p) for p in attr.value]


def _scaled(value: ir.Value) -> tuple[ir.Value, float]:
    """``value`` as ``base * factor`` through ``Mul``/``Div`` by single-element constants."""
    factor = 1.0
    for _ in range(4):
        node = _producer(value, "Mul", "Div")
        if node is None or node.inputs[0] is None or node.inputs[1] is None:
            break
        a, b = node.inputs[0], node.inputs[1]
        cb, ca = scalar_value(b), scalar_value(a) if node.op_type == "Mul" else None
        if cb is not None and (node.op_type == "Mul" or cb != 0):
            factor *= cb if node.op_type == "Mul" else 1.0 / cb
            value = a
        elif ca is not None:
            factor *= ca
            value = b
        else:
            break
    return value, factor


def _what(value: ir.Value | None) -> str:
    node = value.producer() if value is not None else None
    return "a graph input" if node is None else f"{node.op_type} '{node.name}'"


# ---------------------------------------------------------------------------------------------
# reshape targets
# ---------------------------------------------------------------------------------------------

#: An entry of a reshape target: a constant, ("dim", i) for "dim i of a runtime shape", or None.
Entry = Any


def _runtime_dim(value: ir.Value | None) -> tuple[str, int] | None:
    """``("dim", i)`` if ``value`` is a 1-element tensor holding dim ``i`` of some tensor's runtime shape."""
    node = value.producer() if value is not None else None
    while node is not None and node.op_type in ("Unsqueeze", "Cast", "Reshape", "Squeeze") and node.domain == "":
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    if node is None:
        return None
    if node.op_type == "Shape":
        start = node.attributes.get("start")
        end = node.attributes.get("end")
        if start is None or end is None or int(end.value) != int(start.value) + 1 or int(start.value) < 0:
            return None
        return ("dim", int(start.value))
    if node.op_type == "Gather" and node.inputs[0] is not None:
        shape_node = node.inputs[0].producer()
        idx = constant_array(node.inputs[1])
        if shape_node is None or shape_node.op_type != "Shape" or idx is None or idx.size != 1:
            return None
        start = shape_node.attributes.get("start")
        if shape_node.attributes.get("end") is not None or int(idx.reshape(())) < 0:
            return None
        return ("dim", int(idx.reshape(())) + (int(start.value) if start is not None else 0))
    return None


def _entries(value: ir.Value | None) -> list[Entry] | None:
    """The entries of a reshape target, each resolved as far as it can be; None if even its length is unknown."""
    if value is None:
        return None
    arr = constant_array(value)
    if arr is not None:
        return [int(a) for a in arr.reshape(-1)]
    node = value.producer()
    if node is not None and node.op_type == "Where" and node.domain == "":
        eq = node.inputs[0].producer() if node.inputs[0] is not None else None
        if eq is not None and eq.op_type == "Equal" and node.inputs[2] in eq.inputs:
            inner = _entries(node.inputs[2])  # Where(r == -1, 1, r): the same entries where none is -1
            return inner if inner is not None and -1 not in inner and None not in inner else None
    if node is not None and node.op_type == "Reshape" and node.domain == "":
        flat = constant_array(node.inputs[1])
        if flat is not None and flat.reshape(-1).tolist() == [-1]:
            return _entries(node.inputs[0])
    if node is None or node.op_type != "Concat":
        return None
    out: list[Entry] = []
    for inp in node.inputs:
        part = constant_array(inp)
        if part is not None:
            out.extend(int(a) for a in part.reshape(-1))
            continue
        dim = _runtime_dim(inp)
        if dim is not None:
            out.append(dim)
        elif inp is not None and inp.shape is not None and list(inp.shape) == [1]:
            out.append(None)
        else:
            return None
    return out


def _keeps_leading(reshape: ir.Node, shapes: GraphShapes, rest_is_last: bool = False) -> bool:
    """Whether a Reshape keeps dims 0 and 1 of its input (the shape query says so, or its target starts with ``B, S``).

    ``rest_is_last``: the caller proved that the target's entries after the first two multiply to the
    input's last dim (a ``[B, S, N]`` -> ``[B, ?, H, D]`` split with ``H * D = N``), so a -1 in place of
    ``S`` can only be ``S``."""
    x, target = reshape.inputs[0], reshape.inputs[1]
    out = reshape.outputs[0]
    if x is None or x.shape is None or len(x.shape) < 2:
        return False
    if all(shapes.same_dim(out, i, x, i) for i in (0, 1)):
        return True
    entries = _entries(target)
    if entries is None or len(entries) < 2:
        return False
    allowzero = reshape.attributes.get("allowzero")
    zero_copies = allowzero is None or int(allowzero.value) == 0
    for i in (0, 1):
        e = entries[i]
        if e == ("dim", i) or (e == 0 and zero_copies):
            continue
        if i == 1 and e == -1 and rest_is_last and len(x.shape) == 3 and -1 not in entries[2:]:
            continue
        if isinstance(e, int) and isinstance(x.shape[i], int) and x.shape[i] == e:
            continue
        return False
    return True


def _heads_and_dim(reshape: ir.Node, hidden: int, shapes: GraphShapes) -> tuple[int, int] | str:
    """``(H, D)`` of a ``[B, S, H*D] -> [B, S, H, D]`` Reshape (from its target, else the shape query's dims of its
    output), or why they cannot be determined."""
    entries = _entries(reshape.inputs[1])
    out = reshape.outputs[0]
    h: Any = None
    d: Any = None
    if entries is not None and len(entries) == 4:
        h, d = entries[2], entries[3]
    elif entries is not None:
        return f"reshape '{reshape.name}' is not to 4 dims"
    dims = shapes.dims(out) if not (isinstance(h, int) and isinstance(d, int)) else None
    if dims is not None and len(dims) == 4:
        h, d = (m.value if m is not None else None for m in dims[2:])
    if not (isinstance(h, int) and isinstance(d, int)):
        return f"num_heads cannot be determined: reshape target of '{reshape.name}' is not constant"
    if h == -1 and d > 0 and hidden % d == 0:
        h = hidden // d
    elif d == -1 and h > 0 and hidden % h == 0:
        d = hidden // h
    if h <= 0 or d <= 0 or h * d != hidden:
        return f"reshape '{reshape.name}' splits {hidden} into {h} x {d}"
    if not _keeps_leading(reshape, shapes, rest_is_last=entries is not None and len(entries) == 4 and -1 not in entries[2:]):
        return f"reshape '{reshape.name}' does not keep the batch and sequence dims"
    return h, d
