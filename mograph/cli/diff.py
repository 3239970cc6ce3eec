"""``mograph diff``: do two models compute the same numbers on the same inputs?"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mograph.cli import CommandResult
from mograph.cli._common import add_device_argument, add_feed_limit_argument, add_tolerance_arguments
from mograph.errors import VerificationError
from mograph.specs import parse_shapes

__all__ = ["add_parser", "run", "format_table"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "diff",
        parents=[common],
        help="compare two models' outputs numerically on the same feeds",
        description="Run A (the reference) and B on the same inputs with ONNX Runtime (or --backend NAME), its graph optimizations "
        "off, and compare every output: max abs and max rel error and cosine similarity, against tolerances "
        "chosen by dtype (float32 tighter than float16/bfloat16, integers exact) and by pass family "
        "(--family; tight by default). Feeds are seeded random values that respect dtypes and index ranges, "
        "or your own (--feeds). Exits 5 when an output is past tolerance, 0 otherwise.",
    )
    p.add_argument("model_a", metavar="A", help="reference model (.onnx)")
    p.add_argument("model_b", metavar="B", help="model to check against A (.onnx)")
    p.add_argument(
        "--shape",
        action="append",
        metavar="NAME:DIMS",
        help="size of an input's dynamic dims, e.g. input_ids:1x128 (repeatable); others get defaults",
    )
    p.add_argument("--feeds", metavar="FILE.npz", help="input feeds (keys are input names) instead of random ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the random feeds (default 0)")
    add_feed_limit_argument(p)
    add_tolerance_arguments(p, "B")
    p.add_argument("--threads", type=int, metavar="N", help="ONNX Runtime intra-op threads")
    add_device_argument(
        p,
        "where both models run: cpu (default) or cuda / cuda:N (ONNX Runtime's CUDA provider, TF32 off, the CPU for "
        "nodes CUDA has no kernel for; needs onnxruntime-gpu, exit 7 without it)",
    )
    p.add_argument(
        "--backend",
        default="ort",
        metavar="NAME",
        help="registered backend to run both models on, its own graph optimizations off (default: ort)",
    )
    p.set_defaults(run=run)


def _f(x: float | None, spec: str = ".3g") -> str:
    return "nan" if x is None else format(x, spec)


def format_table(check: dict[str, Any]) -> str:
    """The per-output table of a check, for people."""
    outputs = check.get("outputs", {})
    width = max([len(n) for n in outputs] + [6])
    lines = [f"{'output':<{width}}  {'dtype':<8} {'max abs':>10} {'max rel':>10} {'cosine':>10}  {'result':<6} tolerance"]
    for name, e in outputs.items():
        tol = []
        if e.get("atol") is not None:
            tol.append(f"atol {e['atol']:g} rtol {e['rtol']:g}")
        if e.get("min_cosine") is not None:
            tol.append(f"cos>={e['min_cosine']:g}")
        if e.get("max_mismatch") is not None:
            tol.append(f"differ<={e['max_mismatch']:.0%}")
        lines.append(
            f"{name:<{width}}  {e['dtype']:<8} {_f(e['max_abs']):>10} {_f(e['max_rel']):>10} "
            f"{_f(e['cosine'], '.6f'):>10}  {('ok' if e['passed'] else 'FAIL'):<6} {', '.join(tol) or '-'}"
        )
        for reason in e.get("failures", []):
            lines.append(f"{'':<{width}}    - {reason}")
    return "\n".join(lines)


def _feeds_text(check: dict[str, Any]) -> str:
    parts = []
    for name, info in check.get("feeds", {}).items():
        shape = "x".join(map(str, info["shape"])) or "scalar"
        src = "file" if info.get("source") == "file" else f"random {info.get('range', '')}"
        parts.append(f"{name} {info['dtype']} {shape} ({src})")
    text = f"feeds (seed {check.get('seed')}): " + "; ".join(parts)
    if check.get("defaulted_dims"):
        dims = ", ".join(f"{k}={v}" for k, v in check["defaulted_dims"].items())
        text += f"\ndynamic dims not given, defaulted: {dims} (set them with --shape NAME:DIMS)"
    return text


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.backends import check_device, get_backend
    from mograph.plugins import get_registry
    from mograph.validate import diff_models

    registry = get_registry(args.block_plugin)
    backend = get_backend(registry.backends, args.backend, job="diff")
    check_device(backend, args.device)  # a backend without devices takes no --device

    a, b = Path(args.model_a), Path(args.model_b)
    check = diff_models(
        a,
        b,
        shapes=parse_shapes(args.shape),
        feeds=args.feeds,
        seed=args.seed,
        feed_limit=args.feed_limit,
        atol=args.atol,
        rtol=args.rtol,
        min_cosine=args.min_cosine,
        family=args.family,
        threads=args.threads,
        backend=backend,
        device=args.device,
        registry=registry,
    )
    data = {"model_a": str(a), "model_b": str(b), **check}
    lines = [f"A: {a}", f"B: {b}", _feeds_text(check)]
    if backend.name != "ort" or args.device:
        lines.insert(2, f"run on: {check['backend']}")
    for note in check.get("notes", []):
        lines.append(f"note: {note}")
    if check.get("reason"):
        lines.append(f"cannot compare: {check['reason']}")
    else:
        lines.append(format_table(check))
    lines.append(check["summary"])
    exit_code = 0
    if not check["passed"]:
        # The table above is the useful part of a failed diff, so it is printed (or put in the JSON)
        # rather than replaced by the one-line error main() prints for a raised VerificationError.
        exit_code = VerificationError.exit_code
        data["error"] = check.get("failure", check["summary"])
        data["exit_code"] = exit_code
        sys.stderr.write(f"mograph: error: outputs differ: {data['error']}\n")
    return CommandResult(data=data, text="\n".join(lines), exit_code=exit_code)
