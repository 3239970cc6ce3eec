"""Built-in plugin ``mograph.passes.shape``: passes that change which dimensions are static.

- ``fix-shapes`` pins dynamic input dims (``--shape input_ids:1x128``, ``--dim batch=1``), re-infers every
  shape and folds the shape arithmetic that became constant.
- ``make-dynamic`` turns static input axes into named dynamic ones (``--dynamic input_ids:0=batch``) and
  rewrites the constants that baked the old size in, refusing where it cannot tell what a constant means.
- ``set-trt-profile`` records TensorRT min/opt/max shapes per input in the model's metadata
  (``--profile input_ids:1x16,8x128,32x512``); :func:`read_profiles` reads them back.

Preset ``fix-shapes-clean`` runs ``fix-shapes`` followed by the ``cleanup`` passes.
"""

from __future__ import annotations

from mograph.passes.shape.fix_shapes import FixShapesPass
from mograph.passes.shape.make_dynamic import MakeDynamicPass
from mograph.passes.shape.profiles import METADATA_KEY, SetTrtProfilePass, read_profiles

from mograph.hookspecs import hookimpl

__all__ = ["FixShapesPass", "MakeDynamicPass", "SetTrtProfilePass", "METADATA_KEY", "read_profiles"]


@hookimpl
def mograph_add_passes() -> list[type]:
    return [FixShapesPass, MakeDynamicPass, SetTrtProfilePass]


@hookimpl
def mograph_add_presets() -> dict[str, list[str]]:
    return {"fix-shapes-clean": ["fix-shapes", "cleanup"]}
