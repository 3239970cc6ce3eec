"""TensorRT optimization profiles, carried in the model's metadata.

A TensorRT engine built for dynamic inputs needs, per dynamic input, the smallest, the most common and
the largest shape it will see (``min``, ``opt``, ``max``).  Those belong to the model, not to a build
script: this pass validates them against the model (rank, static dims unchanged, ``min <= opt <= max``,
positive sizes) and stores them as one JSON document in the model's ``metadata_props`` under
:data:`METADATA_KEY`::

    {"input_ids": {"min": [1, 16], "opt": [8, 128], "max": [32, 512]}}

The TensorRT backend reads them back with :func:`read_profiles` when it builds an engine.  Running the
pass again with the same profiles changes nothing; a new profile for an input replaces the old one,
profiles of other inputs are kept.
"""

from __future__ import annotations

import onnx_ir as ir
from mograph.passes.shape._spec import input_dims

from mograph.errors import OptionError
from mograph.metadata import PROFILES_KEY as METADATA_KEY
from mograph.metadata import Profile, profile_to_json, read_profiles, write_profiles
from mograph.pass_infra import Option, Pass, PassResult
from mograph.specs import parse_profile

__all__ = ["METADATA_KEY", "SetTrtProfilePass", "read_profiles", "write_profiles"]

def validate_profile(graph: ir.Graph, name: str, profile: Profile, pass_name: str) -> None:
    """Raise ``OptionError`` unless ``profile`` fits input ``name`` of ``graph``."""
    dims = input_dims(graph, name, pass_name)
    labels = ("min", "opt", "max")
    for label, shape in zip(labels, profile):
        if dims is not None and len(shape) != len(dims):
            raise OptionError(
                f"{pass_name}: --profile {label} shape of input '{name}' has rank {len(shape)}, "
                f"the model's input has rank {len(dims)}"
            )
    rank = len(profile[0])
    if any(len(s) != rank for s in profile):
        raise OptionError(f"{pass_name}: --profile shapes of input '{name}' differ in rank")
    for axis in range(rank):
        lo, opt, hi = (s[axis] for s in profile)
        if not lo <= opt <= hi:
            raise OptionError(
                f"{pass_name}: --profile of input '{name}' dimension {axis}: need min <= opt <= max, got {lo}, {opt}, {hi}"
            )
        static = dims[axis] if dims is not None else None
        if isinstance(static, int) and (lo, opt, hi) != (static, static, static):
            raise OptionError(
                f"{pass_name}: --profile of input '{name}' dimension {axis} must be {static} "
                f"(static in the model), got {lo}, {opt}, {hi}"
            )


class SetTrtProfilePass(Pass):
    """Record TensorRT optimization profiles (min/opt/max shapes per input) in the model's metadata."""

    name = "set-trt-profile"
    family = "shape"
    options = (
        Option(
            "profile",
            str,
            None,
            "TensorRT profile of one input, NAME:MIN,OPT,MAX (e.g. input_ids:1x16,8x128,32x512); repeatable",
            multiple=True,
            metavar="NAME:MIN,OPT,MAX",
        ),
    )

    def call(self, model: ir.Model) -> PassResult:
        requested: dict[str, Profile] = {}
        for spec in self.config["profile"]:
            name, prof = parse_profile(spec, self.name, fixed_allowed=False)
            if name in requested and requested[name] != prof:
                raise OptionError(f"{self.name}: input '{name}' given two different profiles")
            validate_profile(model.graph, name, prof, self.name)
            requested[name] = prof
        current = read_profiles(model)
        merged = {**current, **requested}
        changed = sum(1 for k, v in requested.items() if current.get(k) != v)
        if changed:
            write_profiles(model, merged)
        return PassResult(
            modified=changed > 0,
            stats={"profiles_set": changed, "profiles_total": len(merged)},
            details={"profiles": {k: profile_to_json(v) for k, v in sorted(merged.items())}} if merged else {},
        )
