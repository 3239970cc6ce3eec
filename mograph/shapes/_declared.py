"""The shape rules the plugins declared: custom ops' and foreign ops' records, filed into one table.

A :class:`~mograph.custom_ops.CustomOp` carries its rule as ``shape_dims`` / ``shape_values`` (in force
from the op's domain ``version``); a :class:`~mograph.foreign_ops.ForeignOp` carries the same fields (from
its ``since_version``), or only ``same_shape_outputs``, from which the rule follows.  :func:`rules_for`
merges them into the built-in table for one registry: what a pass or a lowering hands to
:class:`~mograph.shapes.ShapeQuery`.  The registry is a parameter here, never looked up: the composition
root hands it down (to a pass as ``Pass.registry``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from mograph.foreign_ops import BUILTIN_FOREIGN_OPS
from mograph.shapes._builtin import builtin_rules, same_shape_rule
from mograph.shapes._rules import ShapeRule, ShapeRules

if TYPE_CHECKING:
    from mograph.custom_ops import CustomOp, Declarations
    from mograph.foreign_ops import ForeignOp

__all__ = ["declared_rules", "rules_for"]


def declared_rules(custom_ops: Iterable[CustomOp] = (), foreign_ops: Iterable[ForeignOp] = ()) -> list[ShapeRule]:
    """One :class:`ShapeRule` per record that states one: a custom op's at ``(domain, name, version)``, a
    foreign op's at ``(domain, name, since_version)``.  The built-in foreign records are left out: their
    rules are in :func:`~mograph.shapes.builtin_rules` already."""
    out = [ShapeRule(op.domain, op.name, op.version, dims=op.shape_dims, values=op.shape_values)
           for op in custom_ops if op.shape_dims is not None or op.shape_values is not None]
    for rec in foreign_ops:
        if rec in BUILTIN_FOREIGN_OPS:
            continue
        dims = rec.shape_dims
        if dims is None and rec.same_shape_outputs:
            dims = same_shape_rule(rec.same_shape_outputs)
        if dims is not None or rec.shape_values is not None:
            out.append(ShapeRule(rec.domain, rec.name, rec.since_version, dims=dims, values=rec.shape_values))
    return out


def rules_for(declarations: Declarations | None) -> ShapeRules:
    """The table a :class:`~mograph.shapes.ShapeQuery` consults for a model of this registry: the built-in
    rules, and the declared ones (:func:`declared_rules`; a declared rule replaces a built-in one of the
    same key, as a plugin's foreign-op record replaces the built-in record).  ``None`` (a pass made by hand,
    without a registry): the built-in rules alone."""
    table = builtin_rules()
    if declarations is None:
        return table
    declared = declared_rules(declarations.custom_ops.values(), declarations.foreign_ops.values())
    return table.overridden(declared)
