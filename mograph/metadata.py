"""The keys mograph writes into a model's ``metadata_props``, and their readers and writers.

One module, so every producer (passes) and consumer (backends, tools) agrees on them:

================================  ===============================================================
key                               what
================================  ===============================================================
``mograph.tensorrt_profiles``     TensorRT optimization profiles: one JSON object, input name ->
                                  ``{"min": [...], "opt": [...], "max": [...]}`` (``set-trt-profile``)
================================  ===============================================================

Node metadata (provenance of rewritten nodes) uses :data:`PROVENANCE_PASS`, :data:`PROVENANCE_RULE`
and :data:`LOWERED_FOR`.
"""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

from mograph.errors import ModelError

__all__ = ["PROFILES_KEY", "PROVENANCE_PASS", "PROVENANCE_RULE", "LOWERED_FOR", "Profile", "profile_to_json", "read_profiles",
           "write_profiles"]

#: The ``metadata_props`` key holding every input's TensorRT profile as one JSON object.
PROFILES_KEY = "mograph.tensorrt_profiles"
#: Node metadata: the pass that created the node, and its rule.
PROVENANCE_PASS = "mograph.pass"
PROVENANCE_RULE = "mograph.rule"
#: Node metadata: the target the ``lower`` step wrote the node for.
LOWERED_FOR = "mograph.lowered_for"

Profile = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def profile_to_json(p: Profile) -> dict[str, list[int]]:
    return {"min": list(p[0]), "opt": list(p[1]), "max": list(p[2])}


def read_profiles(model: Any) -> dict[str, Profile]:
    """The TensorRT profiles stored in ``model`` (input name -> ``(min, opt, max)`` shapes); empty if none.

    Accepts an ``onnx_ir.Model`` or an ``onnx.ModelProto``.  A malformed entry raises ``ModelError``.
    """
    raw = _metadata(model).get(PROFILES_KEY)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
        return {
            str(name): (tuple(map(int, p["min"])), tuple(map(int, p["opt"])), tuple(map(int, p["max"])))
            for name, p in data.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"malformed {PROFILES_KEY} metadata: {exc}") from exc


def write_profiles(model: ir.Model, profiles: dict[str, Profile]) -> None:
    """Store ``profiles`` (replacing what was stored) in ``model.metadata_props``; none removes the key."""
    if profiles:
        body = {k: profile_to_json(v) for k, v in sorted(profiles.items())}
        model.metadata_props[PROFILES_KEY] = json.dumps(body, sort_keys=True, separators=(",", ":"))
    else:
        model.metadata_props.pop(PROFILES_KEY, None)


def _metadata(model: Any) -> dict[str, str]:
    if isinstance(model, ir.Model):
        return dict(model.metadata_props)
    props = getattr(model, "metadata_props", None)  # onnx.ModelProto
    if props is None:
        return {}
    return {p.key: p.value for p in props}
