"""Helpers shared by the sub-commands: example models, output paths (shape specs: :mod:`mograph.specs`)."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import Any

from mograph.errors import UsageError

__all__ = [
    "example_path",
    "EXAMPLES",
    "default_output",
    "add_device_argument",
    "DEVICE_HELP",
    "add_feed_limit_argument",
]

#: What ``--device`` means, in every command that has it.
DEVICE_HELP = (
    "where the backend runs: cpu (default) or cuda / cuda:N (ONNX Runtime's CUDA provider, then the CPU for "
    "nodes CUDA has no kernel for; needs onnxruntime-gpu, exit 7 without it)"
)


def add_device_argument(parser: Any, help_text: str = DEVICE_HELP) -> None:
    """``--device cpu|cuda|cuda:N`` (the backend must list the kind in its ``devices``)."""
    parser.add_argument("--device", metavar="DEVICE", help=help_text)


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more bytes, got {value}")
    return value


def add_feed_limit_argument(parser: Any, what: str = "random feeds") -> None:
    """``--feed-limit BYTES``: the bound on generated feeds (``limit_bytes`` of ``make_feeds``).

    The default (1 GiB) is :data:`mograph.validate.FEED_LIMIT_BYTES`, not imported here so that
    building the parser stays cheap; a test keeps the two in step.
    """
    parser.add_argument(
        "--feed-limit",
        type=_byte_count,
        metavar="BYTES",
        help=f"largest total size of the {what}, checked before they are made (default 1 GiB; past it: exit 2)",
    )

#: Models shipped inside the package (``--example NAME``).
EXAMPLES = {"bert-tiny": "bert-tiny.onnx", "cnn-small": "cnn-small.onnx"}

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
