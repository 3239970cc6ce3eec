"""``mograph validate``: run a model on a backend and compare its outputs with ONNX Runtime's.

* ``--backend tensorrt``: build (or load, ``--engine``) a TensorRT engine of MODEL and compare it, through
  Polygraphy's comparator, with ONNX Runtime running MODEL (or ``--reference``, e.g. the unfused original
  when MODEL holds plugin nodes ONNX Runtime cannot run) with its own graph optimizations **off**. Needs an
  NVIDIA GPU and a TensorRT runtime; where either is missing it says which and exits 7, doing nothing.
* ``--backend ort``: compare ONNX Runtime with its graph optimizations on (what a deployment runs) against
  the same model with them off: a cheap check that ORT's fusions keep the numbers.

The same seeded feeds go to both sides (``--seed``; dynamic dims from ``--shape``, else the profiles' opt
shapes, else 1), or the user's ``--feeds FILE.npz``. Per output it reports max-abs, max-rel and cosine
figures; outputs past ``--rtol``/``--atol`` fail the command with exit code 5.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from mograph.cli import CommandResult
from mograph.cli._common import example_path, parse_shapes
from mograph.errors import BackendUnavailableError, UsageError, VerificationError

__all__ = ["add_parser", "run"]

logger = logging.getLogger(__name__)

BACKENDS = ("tensorrt", "ort")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "validate",
        parents=[common],
        help="compare a backend's outputs with ONNX Runtime's (TensorRT engine, or ORT optimized vs not)",
        description="Run MODEL on a backend and compare every output with ONNX Runtime (its graph optimizations "
        "off) on the same seeded feeds. --backend tensorrt needs an NVIDIA GPU and TensorRT (exit 7 saying "
        "which is missing otherwise); --backend ort compares ORT with its optimizations on against off.",
    )
    p.add_argument("model", nargs="?", help="input .onnx file (or use --example)")
    p.add_argument("--example", metavar="NAME", help="use a model shipped with mograph: bert-tiny, cnn-small")
    p.add_argument("--backend", default="tensorrt", choices=BACKENDS, help="backend to check (default: tensorrt)")
    p.add_argument("--engine", metavar="FILE", help="tensorrt: use this engine instead of building one from MODEL")
    p.add_argument(
        "--reference",
        metavar="REF.onnx",
        help="run this model in ONNX Runtime as the reference instead of MODEL (e.g. the unfused original)",
    )
    p.add_argument(
        "--profile",
        action="append",
        metavar="NAME:MIN,OPT,MAX",
        help="tensorrt: optimization profile of a dynamic input (repeatable); default: the model's stored profiles",
    )
    p.add_argument(
        "--shape", action="append", metavar="NAME:DIMS", help="shape of an input's feeds, e.g. input_ids:2x64"
    )
    p.add_argument("--feeds", metavar="FILE.npz", help="use these input arrays instead of random ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the random feeds (default 0)")
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    p.add_argument("--atol", type=float, default=1e-3, help="absolute tolerance (default 1e-3)")
    p.set_defaults(run=run)


# --------------------------------------------------------------------------------------------- feeds


def _feed_shapes(
    ir_model: Any, shapes: dict[str, tuple[int, ...]], profiles: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    out = {}
    for value in ir_model.graph.inputs:
        if value.name in shapes:
            out[value.name] = tuple(shapes[value.name])
        elif value.name in profiles:
            out[value.name] = tuple(profiles[value.name][1])
        else:
            dims = list(value.shape.dims) if value.shape is not None else []
            out[value.name] = tuple(d if isinstance(d, int) else 1 for d in dims)
    unknown = sorted(set(shapes) - set(out))
    if unknown:
        raise UsageError(f"--shape given for {', '.join(unknown)}, which the model has no input of")
    return out


def _make_feeds(ir_model: Any, shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    """Seeded feeds: floats in [-1, 1), ints in [0, 2) (valid indices and masks), bools random."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for value in ir_model.graph.inputs:
        dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
        shape = shapes[value.name]
        if dtype.kind == "f":
            feeds[value.name] = rng.uniform(-1.0, 1.0, size=shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[value.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            feeds[value.name] = rng.integers(0, 2, size=shape).astype(dtype)
    return feeds


def _load_feeds(path: str) -> dict[str, Any]:
    import numpy as np

    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read feeds from {path}: {exc}") from exc


# --------------------------------------------------------------------------------------------- compare


def _figures(ref: Any, out: Any) -> dict[str, float]:
    import numpy as np

    a = np.asarray(ref, dtype=np.float64).reshape(-1)
    b = np.asarray(out, dtype=np.float64).reshape(-1)
    if a.size == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "cosine": 1.0}
    diff = np.abs(a - b)
    rel = diff / np.maximum(np.abs(a), 1e-12)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    cos = float(np.dot(a, b) / (na * nb)) if na > 0 and nb > 0 else float(na == nb)
    return {"max_abs": float(diff.max()), "max_rel": float(rel.max()), "cosine": cos}


def _compare(reference: dict[str, Any], candidate: dict[str, Any], rtol: float, atol: float) -> dict[str, Any]:
    import numpy as np

    outputs: dict[str, Any] = {}
    passed = True
    for name, ref in reference.items():
        if name not in candidate:
            outputs[name] = {"passed": False, "why": "missing from the backend's outputs"}
            passed = False
            continue
        out = np.asarray(candidate[name])
        ref = np.asarray(ref)
        if out.shape != ref.shape:
            outputs[name] = {"passed": False, "why": f"shape {out.shape} vs reference {ref.shape}"}
            passed = False
            continue
        figs = _figures(ref, out)
        ok = bool(
            np.all(
                np.abs(out.astype(np.float64) - ref.astype(np.float64)) <= atol + rtol * np.abs(ref.astype(np.float64))
            )
        )
        outputs[name] = {"passed": ok, **figs}
        passed = passed and ok
    return {"passed": passed, "outputs": outputs}


def _run_polygraphy(runners: list[Any], feeds: dict[str, Any]) -> list[dict[str, Any]]:
    """Run each Polygraphy runner on ``feeds`` with its Comparator; outputs per runner, in order."""
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    results = Comparator.run(runners, data_loader=[feeds])
    return [dict(iterations[0]) for _name, iterations in results.items()]


def _ort_runner(model: Any, optimizations: bool, name: str) -> Any:
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from mograph.backends.ort import make_session

    return OnnxrtRunner(lambda: make_session(model, optimizations=optimizations), name=name)


def _import_polygraphy() -> None:
    try:
        import polygraphy  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError("polygraphy", "polygraphy") from exc


# ----------------------------------------------------------------------------------------------- run


def _validate_tensorrt(args: argparse.Namespace, src: Path, ir_model: Any, feeds: dict[str, Any]) -> tuple[dict, dict]:
    from mograph.backends import _trt_loader
    from mograph.backends.tensorrt import build_engine, ensure_can_run, load_engine

    trt = ensure_can_run()  # exit 7 with the reason where this machine cannot run an engine
    _import_polygraphy()
    if _trt_loader.is_rtx(trt):
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"
        import polygraphy.config

        polygraphy.config.USE_TENSORRT_RTX = True
    from polygraphy.backend.trt import TrtRunner

    with tempfile.TemporaryDirectory(prefix="mograph-validate-") as tmp:
        build: dict[str, Any] = {}
        engine_path = Path(args.engine) if args.engine else Path(tmp) / "model.engine"
        if not args.engine:
            build = build_engine(src, engine_path, profiles=args.profile or None)
        engine = load_engine(engine_path)
        reference = Path(args.reference) if args.reference else src
        ref_out, trt_out = _run_polygraphy(
            [_ort_runner(str(reference), False, "onnxruntime"), TrtRunner(engine, name="tensorrt")], feeds
        )
    info: dict[str, Any] = {
        "reference": f"onnxruntime (optimizations off) on {reference}",
        "candidate": f"{trt.__name__} engine",
    }
    if build:
        info["build"] = {k: build.get(k) for k in ("engine_bytes", "build_seconds", "plugin_layers", "notes")}
    return info, _compare(ref_out, trt_out, args.rtol, args.atol)


def _validate_ort(args: argparse.Namespace, src: Path, ir_model: Any, feeds: dict[str, Any]) -> tuple[dict, dict]:
    from mograph.backends.ort import import_ort

    import_ort()
    reference = Path(args.reference) if args.reference else src
    try:
        _import_polygraphy()
        ref_out, opt_out = _run_polygraphy(
            [_ort_runner(str(reference), False, "ort-unoptimized"), _ort_runner(str(src), True, "ort-optimized")], feeds
        )
    except BackendUnavailableError:  # polygraphy missing: the ORT check needs only ORT itself
        from mograph.backends.ort import BACKEND

        ref_out = BACKEND.make_runner(str(reference), optimizations=False)(feeds)
        opt_out = BACKEND.make_runner(str(src), optimizations=True)(feeds)
    info = {
        "reference": f"onnxruntime (optimizations off) on {reference}",
        "candidate": f"onnxruntime (optimizations on) on {src}",
    }
    return info, _compare(ref_out, opt_out, args.rtol, args.atol)


def run(args: argparse.Namespace) -> CommandResult:
    from mograph import ir_io

    if bool(args.model) == bool(args.example):
        raise UsageError("give exactly one of MODEL or --example NAME")
    if args.engine and args.backend != "tensorrt":
        raise UsageError("--engine applies to --backend tensorrt only")
    src = Path(args.model) if args.model else example_path(args.example)
    if args.backend == "tensorrt":
        # Say at once, before any work, when this machine cannot run an engine.
        from mograph.backends.tensorrt import ensure_can_run

        ensure_can_run()
    ir_model = ir_io.load_model(src)
    profiles: dict[str, Any] = {}
    if args.profile:
        from mograph.backends.tensorrt import parse_profile_specs

        profiles = parse_profile_specs(args.profile)
    if args.feeds:
        feeds = _load_feeds(args.feeds)
    else:
        feeds = _make_feeds(ir_model, _feed_shapes(ir_model, parse_shapes(args.shape), profiles), args.seed)
    if args.backend == "tensorrt":
        info, result = _validate_tensorrt(args, src, ir_model, feeds)
    else:
        info, result = _validate_ort(args, src, ir_model, feeds)
    data = {
        "model": str(src),
        "backend": args.backend,
        **info,
        "rtol": args.rtol,
        "atol": args.atol,
        "feeds": {k: list(v.shape) for k, v in feeds.items()},
        **result,
    }
    lines = [f"{info['candidate']} vs {info['reference']} (rtol {args.rtol:g}, atol {args.atol:g})"]
    for name, o in result["outputs"].items():
        if "why" in o:
            lines.append(f"  {name}: FAILED — {o['why']}")
        else:
            lines.append(
                f"  {name}: {'ok' if o['passed'] else 'FAILED'}  max-abs {o['max_abs']:.3g}  max-rel {o['max_rel']:.3g}  "
                f"cosine {o['cosine']:.6f}"
            )
    lines.append("passed" if result["passed"] else "FAILED")
    if not result["passed"]:
        bad = [n for n, o in result["outputs"].items() if not o["passed"]]
        err = VerificationError(
            f"{info['candidate']} differs from {info['reference']} past rtol {args.rtol:g} / atol {args.atol:g} "
            f"in output(s) {', '.join(bad)}",
            report=data,
        )
        sys.stderr.write(f"mograph: error: {err}\n")
        return CommandResult(data={**data, "error": str(err)}, text="\n".join(lines), exit_code=err.exit_code)
    return CommandResult(data=data, text="\n".join(lines))
