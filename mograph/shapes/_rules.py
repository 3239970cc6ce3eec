"""The shape-rule table: one rule per ``(domain, op_type, since_version)``.

A :class:`ShapeRule` says, for one op from one opset version on, what a :class:`~mograph.shapes.ShapeQuery`
may conclude about the node's outputs:

- ``dims(node, query)``: the symbolic dims of each output (a list, one entry per output, each a tuple of
  :class:`~mograph.shapes.Dim` or ``None`` where a dim is unknown, or ``None`` for the whole output);
- ``values(node, query)``: for an op that computes a small int64 shape vector, its elements
  ``(is_scalar, (Dim | None, ...))``.

Either may return ``None`` ("this rule cannot tell"); the query then keeps what ONNX inference left on
the value.  Rules read their inputs only through the query (``query.dims``, ``query.values``,
``query.ints``), so the same rule serves every pass that asks.

A table is plain data: the built-in rules come from :func:`builtin_rules`; a custom op's or a plugin's
foreign op's rules are registered into a table (:meth:`ShapeRules.register`, :func:`shape_rule`) that the
caller who looked them up in the plugin registry hands to the query.  Nothing here reads a global
registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from mograph.errors import MographError

if TYPE_CHECKING:
    from mograph.shapes._query import ShapeQuery

__all__ = ["DimsFn", "ShapeRule", "ShapeRuleError", "ShapeRules", "ValuesFn", "node_version", "shape_rule"]

DimsFn = Callable[[ir.Node, "ShapeQuery"], Any]
ValuesFn = Callable[[ir.Node, "ShapeQuery"], Any]

_STD_ALIASES = ("", "ai.onnx")


class ShapeRuleError(MographError):
    """A shape rule was registered twice for the same ``(domain, op_type, since_version)``."""


def _domain(domain: str) -> str:
    return "" if domain in _STD_ALIASES else domain


@dataclass(frozen=True)
class ShapeRule:
    """What the query may conclude about one op's outputs, from ``since_version`` of its domain on."""

    domain: str
    op_type: str
    since_version: int
    dims: DimsFn | None = None
    values: ValuesFn | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return (_domain(self.domain), self.op_type, self.since_version)


def node_version(node: ir.Node, opset_imports: dict[str, int]) -> int | None:
    """The opset version ``node`` is read at: its own, else the graph's import of its domain."""
    if node.version is not None:
        return node.version
    domain = _domain(node.domain)
    if domain == "":
        return opset_imports.get("", opset_imports.get("ai.onnx"))
    return opset_imports.get(domain)


class ShapeRules:
    """A table of :class:`ShapeRule`, looked up by domain, op type and the node's opset version."""

    def __init__(self, rules: Iterable[ShapeRule] = ()) -> None:
        self._by_op: dict[tuple[str, str], list[ShapeRule]] = {}
        for rule in rules:
            self.register(rule)

    def register(self, rule: ShapeRule) -> None:
        """Add ``rule``; a second rule for the same ``(domain, op_type, since_version)`` is an error."""
        domain, op, since = rule.key
        versions = self._by_op.setdefault((domain, op), [])
        if any(r.since_version == since for r in versions):
            raise ShapeRuleError(f"a shape rule for {domain or 'ai.onnx'}::{op} since version {since} is already registered")
        versions.append(rule)
        versions.sort(key=lambda r: r.since_version)

    def lookup(self, domain: str, op_type: str, version: int | None = None) -> ShapeRule | None:
        """The rule in force at ``version`` (the newest with ``since_version <= version``; the newest of all if
        ``version`` is unknown), or ``None``."""
        versions = self._by_op.get((_domain(domain), op_type))
        if not versions:
            return None
        if version is None:
            return versions[-1]
        for rule in reversed(versions):  # the last one in force (no list: looked up for every node of a sweep)
            if rule.since_version <= version:
                return rule
        return None

    def merged(self, other: Iterable[ShapeRule]) -> ShapeRules:
        """A new table with this table's rules and ``other``'s (a key in both is an error)."""
        return ShapeRules([*self, *other])

    def overridden(self, other: Iterable[ShapeRule]) -> ShapeRules:
        """A new table with ``other``'s rules, and this table's where ``other`` has none of the same key
        (two of ``other`` with one key is an error)."""
        theirs = ShapeRules(other)
        keys = {r.key for r in theirs}
        return ShapeRules([*(r for r in self if r.key not in keys), *theirs])

    def __iter__(self) -> Iterator[ShapeRule]:
        for versions in self._by_op.values():
            yield from versions

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_op.values())


def shape_rule(table: ShapeRules, domain: str, op_types: str | Iterable[str], since_version: int = 1,
               *, kind: str = "dims") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register the function as the ``kind`` (``"dims"`` or ``"values"``) rule of each op in
    ``op_types`` (a name or names) from ``since_version`` on, in ``table``.

    A ``dims`` and a ``values`` function for the same key make one rule: the second registration completes
    the first instead of clashing with it.
    """
    if kind not in ("dims", "values"):
        raise ValueError(f"kind must be 'dims' or 'values', not {kind!r}")
    names = [op_types] if isinstance(op_types, str) else list(op_types)

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in names:
            existing = table.lookup(domain, op, since_version)
            if existing is not None and existing.since_version == since_version:
                if getattr(existing, kind) is not None:
                    raise ShapeRuleError(f"a {kind} shape rule for {domain or 'ai.onnx'}::{op} since version "
                                         f"{since_version} is already registered")
                versions = table._by_op[(_domain(domain), op)]
                versions[versions.index(existing)] = ShapeRule(
                    domain, op, since_version, dims=fn if kind == "dims" else existing.dims,
                    values=fn if kind == "values" else existing.values)
            else:
                table.register(ShapeRule(domain, op, since_version, **{kind: fn}))
        return fn

    return register
