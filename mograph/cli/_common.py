"""Helpers shared by the sub-commands: shape specs, example models, output paths."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from mograph.errors import UsageError

__all__ = ["parse_shape", "parse_shapes", "example_path", "EXAMPLES", "default_output"]

#: Models shipped inside the package (``--example NAME``).
EXAMPLES = {"bert-tiny": "bert-tiny.onnx", "cnn-small": "cnn-small.onnx"}

_DIMS = re.compile(r"^\d+(x\d+)*$")


def parse_shape(spec: str) -> tuple[str, tuple[int, ...]]:
    """Parse ``name:1x128`` into ``("name", (1, 128))``.

    The name may itself contain ``:`` (torch names inputs like ``onnx::Flatten_0``): the dims are
    what follows the *last* colon.  A scalar input is ``name:`` (empty dims).
    """
    name, sep, dims = spec.rpartition(":")
    if not sep or not name:
        raise UsageError(f"bad shape {spec!r}: expected NAME:D1xD2x... (e.g. input_ids:1x128)")
    if dims == "":
        return name, ()
    if not _DIMS.match(dims):
        raise UsageError(f"bad shape {spec!r}: dims must be positive integers joined by 'x' (e.g. 1x128)")
    shape = tuple(int(d) for d in dims.split("x"))
    if any(d <= 0 for d in shape):
        raise UsageError(f"bad shape {spec!r}: sizes must be positive")
    return name, shape


def parse_shapes(specs: list[str] | None) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for spec in specs or []:
        name, shape = parse_shape(spec)
        if name in out and out[name] != shape:
            raise UsageError(f"input '{name}' given two shapes: {out[name]} and {shape}")
        out[name] = shape
    return out


def example_path(name: str) -> Path:
    if name not in EXAMPLES:
        raise UsageError(f"unknown example {name!r}; choose from {', '.join(sorted(EXAMPLES))}")
    path = Path(str(resources.files("mograph.examples") / EXAMPLES[name]))
    if not path.exists():
        raise UsageError(f"example {name!r} is not shipped in this installation ({path} missing)")
    return path


def default_output(src: Path, suffix: str = ".opt.onnx", cwd_for: bool = False) -> Path:
    """``model.onnx`` -> ``model.opt.onnx`` beside it (or in the current folder when ``cwd_for``)."""
    stem = src.name[:-5] if src.name.endswith(".onnx") else src.name
    folder = Path.cwd() if cwd_for else src.parent
    return folder / f"{stem}{suffix}"
