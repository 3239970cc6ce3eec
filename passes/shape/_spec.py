"""Parsing and checking of the shape passes' option values (``NAME:1x128``, ``batch=1``, ``NAME:0=batch``).

Input names may contain ``:`` (torch names inputs like ``onnx::Flatten_0``), so every syntax that starts
with an input name splits at the *last* colon.  Errors are ``OptionError`` s that name the input and the
dimension at fault.
"""

from __future__ import annotations

import re

import onnx_ir as ir
from mograph.passes.shape._shapes import value_dims

from mograph.errors import OptionError

__all__ = ["parse_dim_assignment", "parse_dynamic", "input_dims", "find_input"]

_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_INT = re.compile(r"^-?\d+$")


def parse_dim_assignment(spec: str, pass_name: str) -> tuple[str, int]:
    """``batch=1`` -> ``("batch", 1)``."""
    sym, sep, size = spec.partition("=")
    sym = sym.strip()
    if not sep or not sym or not _INT.match(size.strip()):
        raise OptionError(f"{pass_name}: bad --dim {spec!r}: expected SYMBOL=SIZE (e.g. batch=1)")
    value = int(size)
    if value <= 0:
        raise OptionError(f"{pass_name}: --dim {sym}: size must be positive, not {value}")
    return sym, value


def parse_dynamic(spec: str, pass_name: str) -> tuple[str, int, str]:
    """``NAME:AXIS=SYMBOL`` -> ``(NAME, AXIS, SYMBOL)``; NAME may contain ``:``."""
    name, sep, rest = spec.rpartition(":")
    axis, eq, sym = rest.partition("=")
    if not sep or not name or not eq or not _INT.match(axis.strip()) or not _SYMBOL.match(sym.strip()):
        raise OptionError(
            f"{pass_name}: bad --dynamic {spec!r}: expected NAME:AXIS=SYMBOL (e.g. input_ids:0=batch); "
            "SYMBOL is a name like batch or seq_len"
        )
    return name, int(axis), sym.strip()


def find_input(graph: ir.Graph, name: str, pass_name: str) -> ir.Value:
    """The graph input called ``name`` (initializers excluded); ``OptionError`` listing the inputs otherwise."""
    inits = set(graph.initializers)
    for v in graph.inputs:
        if v.name == name and v.name not in inits:
            return v
    known = ", ".join(repr(v.name) for v in graph.inputs if v.name not in inits) or "none"
    raise OptionError(f"{pass_name}: the model has no input '{name}' (inputs: {known})")


def input_dims(graph: ir.Graph, name: str, pass_name: str) -> list[int | str | None] | None:
    """Dims of input ``name``: ints for static, the symbol for named, ``None`` for unnamed; ``None`` if unranked."""
    return value_dims(find_input(graph, name, pass_name))
