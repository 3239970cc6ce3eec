"""Built-in plugin ``mograph.passes.prune``: structured pruning and 2:4 sparsity.

- ``prune-structured`` removes whole FFN neurons, attention heads or convolution channels together
  with everything coupled to them (see :mod:`mograph.passes.prune.structured` and the dependency
  analysis in :mod:`mograph.passes.prune._deps`); the model stays dense and gets smaller and faster.
- ``sparsity-2to4`` zeroes 2 of every 4 consecutive weights along the reduction axis, the pattern
  sparse tensor cores accelerate (:mod:`mograph.passes.prune.sparsity_2to4`).

Preset ``prune`` is ``prune-structured`` followed by ``eliminate-dead`` (a private copy of a shared
shape constant can leave the original unread).
"""

from __future__ import annotations

from mograph.passes.prune.sparsity_2to4 import Sparsity2to4Pass
from mograph.passes.prune.structured import PruneStructuredPass

from mograph.hookspecs import hookimpl

__all__ = ["PruneStructuredPass", "Sparsity2to4Pass"]


@hookimpl
def mograph_add_passes() -> list[type]:
    return [PruneStructuredPass, Sparsity2to4Pass]


@hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {"prune": ["prune-structured", "eliminate-dead"]}
