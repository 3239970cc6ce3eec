"""``mograph build``: lower a model to a backend's deployable artifact (a TensorRT engine, or a plugin backend's).

``mograph build MODEL.onnx --backend tensorrt -o MODEL.engine [--fp16] [--int8] [--profile NAME:MIN,OPT,MAX]``
parses the model with TensorRT (``tensorrt``, else ``tensorrt_rtx``, which builds without a GPU), with the
mograph plugins registered, and writes the engine atomically. It prints which layers became plugins and,
when TensorRT refuses the model, which ops it could not take. ``--json`` prints the whole report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mograph.cli import CommandResult
from mograph.cli._common import add_model_arguments, model_source
from mograph.errors import MographError, UsageError

__all__ = ["add_parser", "run"]

def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "build",
        parents=[common],
        help="build a backend artifact from a model (a TensorRT engine)",
        description="Build a TensorRT engine from MODEL with the mograph plugins registered, so fused nodes written "
        "by `mograph optimize ... --target tensorrt` become plugin layers. Uses the `tensorrt` package, else "
        "`tensorrt_rtx` (which builds ahead of time without a GPU). A dynamic input's profile comes from "
        "--profile or from the model's metadata (set-trt-profile pass); without one it is built for one fixed "
        "shape, its --shape or its dynamic dims set to 1, with a warning (as trtexec and Polygraphy do).",
        epilog="example: mograph build bert.onnx -o bert.engine --profile input_ids:1x16,8x128,32x512 "
        "--profile attention_mask:1x16,8x128,32x512",
    )
    add_model_arguments(p)
    p.add_argument(
        "--backend",
        default="tensorrt",
        metavar="NAME",
        help="registered backend to build for, one with a build() (default: tensorrt)",
    )
    p.add_argument("-o", "--output", help="engine file to write (default: MODEL.engine beside the input)")
    p.add_argument(
        "--fp16",
        action="store_true",
        help="allow float16 kernels (tensorrt; with tensorrt_rtx networks are strongly typed and the report says so)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="allow int8 kernels (tensorrt; in practice needs Q/DQ nodes, e.g. from the qdq-int8 pass)",
    )
    p.add_argument(
        "--profile",
        action="append",
        metavar="NAME:MIN,OPT,MAX",
        help="optimization profile of a dynamic input, e.g. input_ids:1x16,8x128,32x512 (repeatable); "
        "NAME:SHAPE fixes it. Default: the profiles stored in the model",
    )
    p.add_argument(
        "--shape",
        action="append",
        metavar="NAME:DIMS",
        help="fixed shape of a dynamic input that has no profile, e.g. input_ids:1x128 (repeatable; "
        "default: its dynamic dims set to 1)",
    )
    p.add_argument("--workspace", type=int, metavar="MIB", help="cap the builder's workspace memory (MiB)")
    p.set_defaults(run=run)


def _summary(report: dict[str, Any]) -> str:
    lines = [
        f"built {report['engine']} ({report['engine_bytes'] / 1024:.1f} KiB) with {report['module']} "
        f"{report['version']} in {report['build_seconds']:.2f}s (parse {report['parse_seconds']:.2f}s)"
        + (" in a child process" if report.get("subprocess") else ""),
        f"layers: {report['layers']} ("
        + ", ".join(f"{k.lower()}={v}" for k, v in sorted(report["layer_types"].items(), key=lambda kv: -kv[1])[:8])
        + ")",
    ]
    plugins = report.get("plugin_layers") or []
    if plugins:
        lines.append(f"plugin layers: {len(plugins)}")
        for pl in plugins:
            lines.append(
                f"  {pl['layer']}: {pl.get('namespace', '?')}::{pl.get('plugin', '?')} v{pl.get('version', '?')}"
            )
    else:
        lines.append("plugin layers: none")
    if report.get("profiles"):
        for name, (mn, opt, mx) in report["profiles"].items():
            lines.append(
                f"profile {name}: min {'x'.join(map(str, mn))}, opt {'x'.join(map(str, opt))}, max {'x'.join(map(str, mx))}"
            )
    if report.get("lowered"):
        lines.append("lowered for tensorrt first: " + ", ".join(f"{k}={v}" for k, v in report["lowered"].items()))
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _generic_summary(backend: Any, out: Path, report: dict[str, Any]) -> str:
    lines = [f"built {out} with backend '{backend.name}'"]
    for key, value in report.items():
        if isinstance(value, (str, int, float, bool)) or value is None:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.backend_protocol import get_backend, registry_keywords, require_available
    from mograph.plugins import get_registry

    registry = get_registry(args.block_plugin)
    backend = get_backend(registry.backends, args.backend, job="build", needs_build=True)
    src = model_source(args)
    if args.output:
        out = Path(args.output)
    else:
        stem = src.name[:-5] if src.name.endswith(".onnx") else src.name
        suffix = getattr(backend, "artifact_suffix", None) or ".engine"
        out = (Path.cwd() if args.example else src.parent) / f"{stem}{suffix}"
    from mograph._paths import check_io, model_files

    files = model_files(src)
    check_io([("-o", out)], [("the input model", src), *(("the input model's external data", f) for f in files[1:])])
    if args.workspace is not None and args.workspace <= 0:
        raise UsageError("--workspace must be a positive number of MiB")
    options: dict[str, Any] = {}
    if args.fp16:
        options["fp16"] = True
    if args.int8:
        options["int8"] = True
    if args.profile:
        if backend.name == "tensorrt":
            from mograph.specs import parse_profiles

            parse_profiles(args.profile)  # a bad spec is a usage error before any work
        options["profiles"] = list(args.profile)
    if args.shape:
        from mograph.specs import parse_shapes

        parse_shapes(args.shape)  # a bad spec is a usage error before any work
        options["shapes"] = list(args.shape)
    if args.workspace is not None:
        options["workspace_mib"] = args.workspace
    require_available(backend)  # exit 7 naming what to install
    try:
        report = backend.build(src, out, **options, **registry_keywords(backend.build, registry))
    except MographError as exc:
        details = getattr(exc, "report", None)
        details = details if isinstance(details, dict) else {}
        unsupported = details.get("unsupported") or []
        if not unsupported:
            raise
        # Parser refusals are a result worth showing in full (and in --json), not only one line.
        sys.stderr.write(f"mograph: error: TensorRT could not take {len(unsupported)} node(s) of {src}\n")
        lines = [f"{'op':<28} {'node':<40} reason"]
        lines += [
            f"{u.get('op') or '?':<28} {u.get('node') or u.get('node_index'):<40} {u.get('error')}" for u in unsupported
        ]
        data = {"input": str(src), "output": None, "error": str(exc), "exit_code": exc.exit_code, **details}
        return CommandResult(data=data, text="\n".join(lines), exit_code=exc.exit_code)
    report = dict(report or {})
    text = _summary(report) if "engine_bytes" in report and "layer_types" in report else _generic_summary(backend, out, report)
    return CommandResult(data={"input": str(src), "output": str(out), "backend": backend.name, **report}, text=text)
