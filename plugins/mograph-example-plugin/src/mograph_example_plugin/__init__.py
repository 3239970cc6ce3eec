"""mograph plugin ``example``: passes, a preset, a custom op and a backend — a template for third-party plugins.

mograph finds this module through the ``mograph`` entry-point group declared in ``pyproject.toml``
and calls the hooks below (see :mod:`mograph.hookspecs`) when it builds its registry, exactly as it
does for its own built-in passes, ops and backends.

* pass ``remove-double-transpose`` (:class:`RemoveDoubleTransposePass`);
* preset ``simplify-transposes``: ``remove-double-transpose``, then ``eliminate-dead`` and
  ``topo-sort`` — a preset may name passes of other plugins (here the built-in ``cleanup`` plugin);
* custom op ``example.BetaSwish`` (:data:`SWISH`: numpy reference, function body, shape function,
  lowerings for ``onnx`` and ``ort``) and pass ``fuse-swish`` (:class:`FuseSwishPass`) that fuses into it;
* backend ``example-ref`` (:data:`BACKEND`): ``onnx.reference`` as a runtime, in ``bench``,
  ``validate``, ``diff`` and ``build``.
"""

from __future__ import annotations

import mograph
from mograph_example_plugin.backend import BACKEND, ReferenceBackend
from mograph_example_plugin.remove_double_transpose import RemoveDoubleTransposePass
from mograph_example_plugin.swish import SWISH, FuseSwishPass

__all__ = [
    "RemoveDoubleTransposePass",
    "FuseSwishPass",
    "SWISH",
    "ReferenceBackend",
    "BACKEND",
    "PRESETS",
    "mograph_add_passes",
    "mograph_add_presets",
    "mograph_add_custom_ops",
    "mograph_add_backends",
]

PRESETS = {"simplify-transposes": ["remove-double-transpose", "eliminate-dead", "topo-sort"]}


@mograph.hookimpl
def mograph_add_passes() -> list[type[mograph.Pass]]:
    return [RemoveDoubleTransposePass, FuseSwishPass]


@mograph.hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {name: list(items) for name, items in PRESETS.items()}


@mograph.hookimpl
def mograph_add_custom_ops() -> list[mograph.CustomOp]:
    return [SWISH]


@mograph.hookimpl
def mograph_add_backends() -> list[ReferenceBackend]:
    return [BACKEND]
