"""``mograph validate``: run a model on a backend and compare its outputs with ONNX Runtime's.

The backend is any registered one (``--backend NAME``: ``ort``, the default, which runs anywhere;
``tensorrt``; or a plugin's), and the comparison is exactly the one ``mograph optimize --verify`` makes (:class:`mograph.validate.Verifier`):

* **reference** — ONNX Runtime on CPU with its own graph optimizations **off**, running MODEL (or
  ``--reference``, e.g. the unfused original when MODEL holds nodes ONNX Runtime cannot run);
* **candidate** — the backend's runner on MODEL (``--engine FILE``: a prebuilt artifact instead), with
  the runtime's own optimizations on, as deployed.  For ``--backend ort`` that is ONNX Runtime with its
  optimizations on against off: a cheap check that ORT's fusions keep the numbers;
* **feeds** — the same seeded feeds as ``--verify`` (``--seed``; dynamic dims from ``--shape``, else the
  ``--profile`` opt shapes, else the defaults of :func:`mograph.validate.make_feeds`), or ``--feeds FILE.npz``;
* **verdict** — per output max-abs, max-rel and cosine figures judged by the tolerance table (by dtype;
  ``--family`` for a lossy pass family), ``--atol``/``--rtol``/``--min-cosine`` overriding it.  Outputs
  past tolerance fail the command with exit code 5.

A backend that cannot run here (TensorRT without a GPU, a runtime not installed) says which and exits 7
before any work.

``--device cuda`` (``--backend ort``) makes the candidate ONNX Runtime's CUDA provider (its
optimizations on, TF32 off unless ``--tf32``: with TensorFloat-32 float32 MatMuls, a float32 BERT is
off by ~1e-3 and fails float32 tolerances), checked against the CPU reference; the nodes that
fell back to the CPU and the ``Memcpy`` nodes are reported.  ``--cuda-graph`` checks the outputs of a
replayed CUDA graph.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from mograph.cli import CommandResult
from mograph.cli._common import (
    add_device_argument,
    add_feed_limit_argument,
    add_model_arguments,
    add_tolerance_arguments,
    model_source,
)
from mograph.errors import UsageError, VerificationError
from mograph.specs import parse_shapes

__all__ = ["add_parser", "run"]

logger = logging.getLogger(__name__)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "validate",
        parents=[common],
        help="compare a backend's outputs with ONNX Runtime's (TensorRT engine, ORT optimized vs not, a plugin's)",
        description="Run MODEL on a backend and compare every output with ONNX Runtime (its graph optimizations "
        "off) on the same seeded feeds, tolerances and verdict as `mograph optimize --verify`. --backend tensorrt "
        "needs an NVIDIA GPU and TensorRT (exit 7 saying which is missing otherwise); --backend ort compares ORT "
        "with its optimizations on against off; any registered backend (`mograph passes --json` lists them) works.",
    )
    add_model_arguments(p)
    p.add_argument("--backend", default="ort", metavar="NAME",
                   help="backend to check (default: ort, ONNX Runtime on the CPU, which runs anywhere; tensorrt needs a GPU)")
    add_device_argument(
        p,
        "where the candidate runs: cpu (default) or cuda / cuda:N (--backend ort: ONNX Runtime's CUDA provider; "
        "needs onnxruntime-gpu, exit 7 without it); the reference stays ONNX Runtime on the CPU",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="--device cuda: run the candidate as a replayed CUDA graph (dims pinned to the feeds' shapes)",
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="--device cuda: let float32 MatMuls use TensorFloat-32, as ONNX Runtime does by default when "
        "deployed (off by default here: TF32 alone moves a float32 BERT's outputs by ~1e-3, past float32 "
        "tolerances)",
    )
    p.add_argument("--engine", metavar="FILE", help="run this prebuilt artifact (a TensorRT engine) instead of MODEL")
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
        "--shape", action="append", metavar="NAME:DIMS",
        help="shape of an input's feeds, e.g. input_ids:2x64 (repeatable); other inputs: their --profile opt shape, else defaults",
    )
    p.add_argument("--feeds", metavar="FILE.npz", help="use these input arrays instead of random ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the random feeds (default 0)")
    add_feed_limit_argument(p)
    add_tolerance_arguments(p, "MODEL")
    p.set_defaults(run=run)


def _feed_shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """``--shape`` sizes, then the opt shapes of ``--profile`` for inputs ``--shape`` leaves out."""
    shapes = parse_shapes(args.shape)
    if args.profile:
        from mograph.specs import parse_profiles

        for name, (_mn, opt, _mx) in parse_profiles(args.profile).items():
            shapes.setdefault(name, tuple(opt))
    return shapes


def _line(name: str, entry: dict[str, Any]) -> str:
    def f(x: float | None, spec: str = ".3g") -> str:
        return "nan" if x is None else format(x, spec)

    text = (
        f"  {name}: {'ok' if entry['passed'] else 'FAILED'}  max-abs {f(entry['max_abs'])}  "
        f"max-rel {f(entry['max_rel'])}  cosine {f(entry['cosine'], '.6f')}"
    )
    for reason in entry.get("failures", []):
        text += f"\n    - {reason}"
    return text


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.backend_protocol import backend_target, check_device, get_backend, registry_keywords, require_available
    from mograph.plugins import get_registry
    from mograph.validate import Verifier

    src = model_source(args)
    registry = get_registry(args.block_plugin)
    backend = get_backend(registry.backends, args.backend, job="validate")
    if args.profile and args.backend != "tensorrt":
        raise UsageError("--profile applies to --backend tensorrt only")
    if args.engine and not callable(getattr(backend, "build", None)):
        raise UsageError(f"--engine applies to backends that build artifacts; backend '{backend.name}' builds none")
    options: dict[str, Any] = {"profiles": args.profile} if args.profile else {}
    options.update(check_device(backend, args.device))
    device = options.get("device", "cpu")
    runner_keywords = registry_keywords(backend.make_runner, registry)
    if args.cuda_graph and (args.backend != "ort" or not device.startswith("cuda")):
        raise UsageError("--cuda-graph needs --backend ort --device cuda")
    if args.tf32 and (args.backend != "ort" or not device.startswith("cuda")):
        raise UsageError("--tf32 needs --backend ort --device cuda")
    if args.backend == "ort" and device.startswith("cuda"):
        options["tf32"] = bool(args.tf32)
    require_available(backend)  # exit 7, naming what is missing, before any work
    if args.backend == "ort" and device.startswith("cuda"):
        from mograph.backends.ort import require_device

        require_device(device)
    shapes = _feed_shapes(args)
    candidate_model = Path(args.engine) if args.engine else src
    reference = Path(args.reference) if args.reference else src

    def make_verifier() -> Any:
        return Verifier(
            str(reference), shapes=shapes, feeds=args.feeds, seed=args.seed, feed_limit=args.feed_limit,
            atol=args.atol, rtol=args.rtol, min_cosine=args.min_cosine, registry=registry,
        )

    if args.cuda_graph:  # the graph's dims are pinned to the feeds' shapes: feeds first
        verifier = make_verifier()
        options.update(cuda_graph=True, shapes={n: tuple(a.shape) for n, a in verifier.feeds.items()})
        runner = backend.make_runner(str(candidate_model), optimizations=True, **options, **runner_keywords)
    elif args.backend == "ort":
        # ONNX Runtime and the device were checked above: the reference first, its session freed before the
        # candidate's is made, so the two never hold the weights at once (peak memory, issue 25)
        verifier = make_verifier()
        runner = backend.make_runner(str(candidate_model), optimizations=True, **options, **runner_keywords)
    else:
        # The candidate first: a backend that cannot run here (TensorRT without a GPU) says so before any work.
        runner = backend.make_runner(str(candidate_model), optimizations=True, **options, **runner_keywords)
        verifier = make_verifier()
    candidate = f"backend '{backend.name}' on {candidate_model}"
    if args.backend == "ort":
        where = "" if device == "cpu" else (f", {device}" + (", CUDA graph" if args.cuda_graph else "")
                                             + (", TF32" if args.tf32 else ", TF32 off"))
        candidate = f"onnxruntime (optimizations on{where}) on {candidate_model}"
    check = verifier.check(None if args.engine else str(src), family=args.family, runner=runner, label=candidate)
    info = {"reference": f"{verifier.backend} on {reference}", "candidate": candidate}
    data: dict[str, Any] = {
        "model": str(src),
        **check,
        "backend": backend.name,
        "target": backend_target(backend),
        "reference_runtime": check["backend"],
        **info,
        "rtol": args.rtol,
        "atol": args.atol,
        "min_cosine": args.min_cosine,
        "device": device,
        "cuda_graph": bool(args.cuda_graph),
        "placement": getattr(runner, "placement", None),
        "feeds": {k: v["shape"] for k, v in check["feeds"].items()},
        "feed_info": check["feeds"],
        "tolerances": {n: t.describe() for n, t in verifier.tolerances(args.family).items()},
    }
    from mograph.cli.bench import placement_lines

    lines = [f"{info['candidate']} vs {info['reference']}", *placement_lines(data["placement"])]
    if check.get("reason"):
        lines.append(f"  cannot compare: {check['reason']}")
    for name, entry in check["outputs"].items():
        lines.append(_line(name, entry))
    lines.append(check["summary"])
    if not check["passed"]:
        failed = [n for n, e in check["outputs"].items() if not e["passed"]]
        what = f"in output(s) {', '.join(failed)}" if failed else f"({check.get('reason')})"
        err = VerificationError(
            f"{info['candidate']} differs from {info['reference']} {what}: {verifier.describe_failure(check)}",
            report=data,
        )
        sys.stderr.write(f"mograph: error: {err}\n")
        return CommandResult(
            data={**data, "error": str(err), "exit_code": err.exit_code}, text="\n".join(lines), exit_code=err.exit_code
        )
    return CommandResult(data=data, text="\n".join(lines))
