"""The keys mograph writes into a model's ``metadata_props``, and their readers and writers.

One module, so every producer (passes) and consumer (backends, tools) agrees on them:

================================  ===============================================================
key                               what
================================  ===============================================================
``mograph.tensorrt_profiles``     TensorRT optimization profiles: one JSON object, input name ->
                                  ``{"min": [...], "opt": [...], "max": [...]}`` (``set-trt-profile``)
``mograph.kv_cache``              FP8 KV cache (``kv-cache-fp8``): ``{"io": "float"|"fp8", "dtype",
                                  "granularity", "tensors": {past name: {"present", "scale": [...],
                                  "axis": 1 or null, ...}}}``; a value is ``q * scale`` (per head on
                                  axis 1 when ``axis`` is 1)
================================  ===============================================================

Node metadata (provenance of rewritten nodes) uses :data:`PROVENANCE_PASS`, :data:`PROVENANCE_RULE`
and :data:`LOWERED_FOR`.
"""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

from mograph.errors import ModelError

__all__ = ["KV_CACHE_KEY", "read_kv_cache", "kv_cache_scales", "PROFILES_KEY", "PROVENANCE_PASS", "PROVENANCE_RULE", "LOWERED_FOR", "Profile", "profile_to_json", "read_profiles",
           "write_profiles"]

#: The ``metadata_props`` key holding every input's TensorRT profile as one JSON object.
PROFILES_KEY = "mograph.tensorrt_profiles"
#: The ``metadata_props`` key holding the FP8 KV cache's scales (JSON), written by ``kv-cache-fp8``.
KV_CACHE_KEY = "mograph.kv_cache"
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


def read_kv_cache(model: Any) -> dict[str, Any]:
    """The ``mograph.kv_cache`` record of an ``onnx_ir.Model`` or ``onnx.ModelProto`` (``{}`` when absent)."""
    raw = _metadata(model).get(KV_CACHE_KEY)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("tensors", {}), dict):
            raise ValueError("expected an object with a 'tensors' object")
        return data
    except ValueError as exc:
        raise ModelError(f"malformed {KV_CACHE_KEY} metadata: {exc}") from exc


def kv_cache_scales(model: Any) -> dict[str, Any]:
    """Past and present tensor name -> its FP8 scale as a numpy array broadcastable to ``[B, H, S, D]``."""
    import numpy as np

    out: dict[str, Any] = {}
    for past, t in read_kv_cache(model).get("tensors", {}).items():
        try:
            scale = np.asarray(t["scale"], np.float32)
            scale = scale.reshape(1, -1, 1, 1) if t.get("axis") == 1 else scale.reshape(())
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"malformed {KV_CACHE_KEY} metadata for {past!r}: {exc}") from exc
        out[str(past)] = scale
        if t.get("present"):
            out[str(t["present"])] = scale
    return out
