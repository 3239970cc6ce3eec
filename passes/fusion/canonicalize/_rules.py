"""The canonical rewrites, in the order they are tried at each node (the first that applies wins)."""

from __future__ import annotations

from mograph.passes.fusion.canonicalize._algebra import (
    CONST_CHAIN,
    CUBE,
    FACTOR_NORM,
    GLOBAL_AVERAGE_POOL,
    NEUTRAL,
    SCALE_OUT,
    SUB,
)
from mograph.passes.fusion.canonicalize._base import CanonRule
from mograph.passes.fusion.canonicalize._casts import CAST_CSE, CAST_ISLAND, CAST_NOOP, IDENTITY
from mograph.passes.fusion.canonicalize._shapes import EXPAND_NOOP, FOLD_BROADCAST, KEEPDIMS

__all__ = ["RULES"]

#: The rewrites, tried in this order at each node.
RULES: tuple[CanonRule, ...] = (
    IDENTITY,
    CAST_NOOP,
    CAST_CSE,
    CAST_ISLAND,
    NEUTRAL,
    EXPAND_NOOP,
    KEEPDIMS,
    FOLD_BROADCAST,
    GLOBAL_AVERAGE_POOL,
    SUB,
    CONST_CHAIN,
    FACTOR_NORM,
    SCALE_OUT,
    CUBE,
)
