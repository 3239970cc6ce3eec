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
    "add_tolerance_arguments",
    "add_model_arguments",
    "model_source",
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


def add_model_arguments(
    parser: Any, model_help: str = "input .onnx file (or use --example)", verb: str = "use", example_help: str | None = None
) -> None:
    """``MODEL`` (optional) and ``--example NAME``: a command's input model; :func:`model_source` reads them."""
    parser.add_argument("model", nargs="?", help=model_help)
    parser.add_argument(
        "--example",
        metavar="NAME",
        help=example_help or f"{verb} a model shipped with mograph: {', '.join(sorted(EXAMPLES))}",
    )


def model_source(args: Any) -> Path:
    """The input model of :func:`add_model_arguments`: ``MODEL`` or ``--example NAME``, exactly one."""
    if bool(args.model) == bool(args.example):
        raise UsageError("give exactly one of MODEL or --example NAME")
    return Path(args.model) if args.model else example_path(args.example)


def default_output(src: Path, suffix: str = ".opt.onnx", cwd_for: bool = False) -> Path:
    """``model.onnx`` -> ``model.opt.onnx`` beside it (or in the current folder when ``cwd_for``)."""
    stem = src.name[:-5] if src.name.endswith(".onnx") else src.name
    folder = Path.cwd() if cwd_for else src.parent
    return folder / f"{stem}{suffix}"


def add_tolerance_arguments(parser: Any, judged: str) -> None:
    """``--atol``, ``--rtol``, ``--min-cosine`` and ``--family``: how the outputs of ``judged`` are judged
    (:func:`mograph.validate.tolerance_for`)."""
    parser.add_argument("--atol", type=float, help="absolute tolerance for floating outputs, taken as given (default: the table's, or 0.1 x rtol x the output's largest magnitude where that is larger)")
    parser.add_argument("--rtol", type=float, help="relative tolerance for floating outputs (overrides the table)")
    parser.add_argument("--min-cosine", type=float, help="minimum cosine similarity for floating outputs")
    parser.add_argument(
        "--family",
        action="append",
        metavar="FAMILY",
        help=f"judge {judged} as the output of passes of this family (cleanup, shape, fusion: tight; quant, prune: "
        "cosine-based); repeatable, the loosest applies. Default: tight",
    )
