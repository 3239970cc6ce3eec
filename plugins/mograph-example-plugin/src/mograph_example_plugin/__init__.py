"""mograph plugin ``example``: one pass, one preset — a template for third-party plugins.

mograph finds this module through the ``mograph`` entry-point group declared in ``pyproject.toml``
and calls the hooks below (see :mod:`mograph.hookspecs`) when it builds its registry, exactly as it
does for its own built-in passes.

* pass ``remove-double-transpose`` (:class:`RemoveDoubleTransposePass`);
* preset ``simplify-transposes``: ``remove-double-transpose``, then ``eliminate-dead`` and
  ``topo-sort`` — a preset may name passes of other plugins (here the built-in ``cleanup`` plugin).
"""

from __future__ import annotations

import mograph
from mograph_example_plugin.remove_double_transpose import RemoveDoubleTransposePass

__all__ = ["RemoveDoubleTransposePass", "PRESETS", "mograph_add_passes", "mograph_add_presets"]

PRESETS = {"simplify-transposes": ["remove-double-transpose", "eliminate-dead", "topo-sort"]}


@mograph.hookimpl
def mograph_add_passes() -> list[type[mograph.Pass]]:
    return [RemoveDoubleTransposePass]


@mograph.hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {name: list(items) for name, items in PRESETS.items()}
