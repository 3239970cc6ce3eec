"""One shape facility for every pass: a symbolic-dim algebra, a table of per-op shape rules, a query.

- :class:`Dim` and its arithmetic (:func:`mul`, :func:`div`, :func:`add`, :func:`sub`, :func:`same_dim`):
  a size as an ordered product of integers and symbols (``_dim``);
- :class:`ShapeRule` / :class:`ShapeRules`: one rule per ``(domain, op_type, since_version)``, registered
  with :func:`shape_rule` or :meth:`ShapeRules.register`; :func:`builtin_rules` holds the standard and
  ``com.microsoft`` ones, and the op-class tables (:data:`SAME_SHAPE_OPS`, :data:`BROADCAST_OPS`,
  :data:`REDUCE_OPS`) say once which standard ops keep, broadcast or reduce their input's shape
  (``_rules``, ``_builtin``);
- :func:`rules_for`: the built-in table with the rules the registry's custom-op and foreign-op records
  declare (``shape_dims`` / ``shape_values``), for a caller that was handed the registry (``_declared``);
- :class:`ShapeQuery`: one sweep over a graph, then ``dims``, ``dim``, ``static_dim`` (a dim as a number),
  ``same_dim``, ``dim_key`` (a hashable key of a dim, equal for dims it proves equal), ``values`` (the elements of
  shape vectors), ``literals`` (those elements as numbers), ``is_shape_of`` (a vector that holds a value's dims),
  ``reshape_dims`` and the witness of each symbolic dim; :func:`static_dim`, :func:`vector_ints` and
  :func:`holds_dims` are the same answers from dims and vectors already asked (for a caller that wraps the
  query); :func:`as_ir_shape` writes its dims back as an IR shape (``_query``);
- :class:`Sizes`, :func:`shape_literals`, :func:`const_tensor`, :func:`int_vector`: the numeric side,
  the query's dims read as ints or names and the stored entries of a reshape target, for passes that
  edit weights and shape constants (``_sizes``).

This package is part of the IR toolbox: it imports neither passes, backends nor the plugin registry.  A
caller that was handed the registry asks :func:`rules_for` for its table and hands it to the query.
"""

from __future__ import annotations

from mograph.shapes._builtin import (
    BROADCAST_OPS,
    MS_DOMAIN,
    REDUCE_OPS,
    SAME_SHAPE_OPS,
    broadcast,
    builtin_rules,
    reshape_dims,
    reshape_entries,
    same_shape_rule,
    shape_range,
)
from mograph.shapes._declared import declared_rules, rules_for
from mograph.shapes._dim import Dim, Factor, add, div, mul, prod, same_dim, sub
from mograph.shapes._query import (
    DimKey,
    Dims,
    ShapeQuery,
    ShapeReads,
    Vector,
    as_ir_shape,
    holds_dims,
    static_dim,
    vector_ints,
)
from mograph.shapes._rules import ShapeRule, ShapeRuleError, ShapeRules, node_version, shape_rule
from mograph.shapes._sizes import DimSize, ShapeLiteral, Sizes, const_tensor, int_vector, owns_tensor, shape_literals

__all__ = [
    "BROADCAST_OPS", "MS_DOMAIN", "REDUCE_OPS", "SAME_SHAPE_OPS", "Dim", "DimKey", "DimSize", "Dims", "Factor",
    "ShapeLiteral", "ShapeQuery", "ShapeReads", "ShapeRule", "ShapeRuleError", "ShapeRules", "Sizes", "Vector", "add",
    "as_ir_shape", "broadcast", "builtin_rules", "const_tensor", "declared_rules", "div", "holds_dims", "int_vector",
    "mul", "node_version", "owns_tensor", "prod", "reshape_dims", "reshape_entries", "rules_for", "same_dim",
    "same_shape_rule", "shape_literals", "shape_range", "shape_rule", "static_dim", "sub", "vector_ints",
]
