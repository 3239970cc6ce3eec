"""One parser each for what users type: shapes (``NAME:1x128``), profiles (``NAME:MIN,OPT,MAX``), booleans.

Every command and pass that takes one of these goes through here, so they read the same everywhere
and fail with the same message.  Input names may contain ``:`` (torch names inputs like
``onnx::Flatten_0``), so a spec that starts with an input name splits at the *last* colon.  Errors
are :class:`~mograph.errors.OptionError` s (exit code 2) that start with ``context`` (the pass or
command) when one is given, and name the input and the dimension at fault.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from mograph.errors import OptionError

__all__ = ["Profile", "Shape", "check_profile", "parse_bool", "parse_dims", "parse_profile", "parse_profiles",
           "parse_shape", "parse_shapes"]

Shape = tuple[int, ...]
Profile = tuple[Shape, Shape, Shape]

_INT = re.compile(r"^-?\d+$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _fail(context: str | None, message: str) -> OptionError:
    return OptionError(f"{context}: {message}" if context else message)


def parse_bool(raw: object) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case), or a Python bool; ``ValueError`` otherwise."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected yes or no")


def parse_dims(text: str, name: str, context: str | None = None, what: str = "--shape") -> Shape:
    """``"1x128"`` -> ``(1, 128)``; ``""`` -> ``()`` (a scalar).  Every size must be a positive integer."""
    if text == "":
        return ()
    out = []
    for axis, part in enumerate(text.lower().split("x")):
        if not _INT.match(part.strip()):
            raise _fail(context, f"{what} of input '{name}' dimension {axis}: {part!r} is not an integer")
        size = int(part)
        if size <= 0:
            raise _fail(context, f"{what} of input '{name}' dimension {axis}: size must be positive, not {size}")
        out.append(size)
    return tuple(out)


def parse_shape(spec: str, context: str | None = None) -> tuple[str, Shape]:
    """``NAME:1x128`` -> ``("NAME", (1, 128))``; ``NAME:`` is a scalar."""
    name, sep, dims = str(spec).rpartition(":")
    if not sep or not name:
        raise _fail(context, f"bad --shape {spec!r}: expected NAME:D1xD2... (e.g. input_ids:1x128)")
    return name, parse_dims(dims, name, context)


def parse_shapes(specs: Iterable[str] | None, context: str | None = None) -> dict[str, Shape]:
    """Several ``--shape`` values; an input given two different shapes is an error."""
    out: dict[str, Shape] = {}
    for spec in specs or []:
        name, shape = parse_shape(spec, context)
        if name in out and out[name] != shape:
            raise _fail(context, f"input '{name}' given two shapes: {out[name]} and {shape}")
        out[name] = shape
    return out


def check_profile(name: str, profile: Profile, context: str | None = None) -> None:
    """``min <= opt <= max`` in every dim, all of one rank."""
    mn, opt, mx = profile
    if not len(mn) == len(opt) == len(mx):
        raise _fail(context, f"--profile shapes of input '{name}' differ in rank: {mn}, {opt}, {mx}")
    for axis, (lo, mid, hi) in enumerate(zip(mn, opt, mx)):
        if not lo <= mid <= hi:
            raise _fail(context, f"--profile of input '{name}' dimension {axis}: need min <= opt <= max, "
                                 f"got {lo}, {mid}, {hi}")


def parse_profile(spec: str, context: str | None = None, *, fixed_allowed: bool = True) -> tuple[str, Profile]:
    """``NAME:MIN,OPT,MAX`` (``input_ids:1x16,8x128,32x512``); with ``fixed_allowed``, ``NAME:SHAPE`` means
    min = opt = max."""
    name, sep, body = str(spec).rpartition(":")
    if not sep or not name or not body:
        raise _fail(context, f"bad --profile {spec!r}: expected NAME:MIN,OPT,MAX (e.g. input_ids:1x16,8x128,32x512)")
    parts = body.split(",")
    if len(parts) == 1 and fixed_allowed:
        parts = parts * 3
    if len(parts) != 3:
        raise _fail(context, f"bad --profile {spec!r}: " + ("give three shapes MIN,OPT,MAX (or one fixed shape)"
                                                             if fixed_allowed else "give exactly three shapes MIN,OPT,MAX"))
    mn, opt, mx = (parse_dims(p, name, context, what="--profile") for p in parts)
    check_profile(name, (mn, opt, mx), context)
    return name, (mn, opt, mx)


def parse_profiles(specs: Iterable[str] | None, context: str | None = None) -> dict[str, Profile]:
    """Several ``--profile`` values; an input given two profiles is an error."""
    out: dict[str, Profile] = {}
    for spec in specs or []:
        name, prof = parse_profile(spec, context)
        if name in out:
            raise _fail(context, f"input '{name}' given two profiles")
        out[name] = prof
    return out
