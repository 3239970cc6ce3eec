"""``mograph optimize``: run an ordered pipeline of passes on a model and save the result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mograph._paths import Named, check_io, model_files, option_io, spec_files, write_text
from mograph._paths import check_writable_folder as _check_folder
from mograph.cli import CommandResult
from mograph.cli._common import (
    add_device_argument,
    add_feed_limit_argument,
    add_model_arguments,
    default_output,
    model_source,
)
from mograph.errors import MographError, UsageError, VerificationError
from mograph.progress import ProgressInstrument
from mograph.specs import parse_shapes

__all__ = ["add_parser", "run"]

# Options the command itself owns; a pass declaring one of these names receives the command's value.
_OWN = {"shape", "explain", "device"}


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "optimize",
        parents=[common],
        help="run passes on a model and save the optimized model",
        description="Run an explicit, ordered pipeline of passes on MODEL and write the result atomically "
        "(never over the input). Presets such as 'cleanup' or 'fuse' expand to their passes in place. "
        "`mograph passes` lists passes and presets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument("-o", "--output", help="output file (default: IN.opt.onnx beside the input); its folder must exist. "
                   "A model that fails --verify is kept as OUT.failed.onnx (exit 5)")
    p.add_argument("--passes", default="cleanup", help="comma-separated passes and presets, in order (default: cleanup); 'lower' (for --target) "
                   "is appended when a pass writes fused ops or --target is given, followed (unless --target mograph) by "
                   "the after-lower preset (simplify-shapes, cse, eliminate-dead); a list naming 'lower' gets nothing after it")
    p.add_argument(
        "--verify",
        nargs="?",
        const="end",
        choices=["end", "each"],
        help="compare outputs with the original on seeded feeds (ONNX Runtime, its optimizations off); "
        "'each' checks after every pass and names the first that drifts. Fails with exit 5 past tolerance.",
    )
    p.add_argument(
        "--shape",
        action="append",
        metavar="NAME:DIMS",
        help="input shape, e.g. input_ids:1x128 (repeatable): sizes for dynamic dims of verification feeds, "
        "and the shapes fix-shapes pins",
    )
    add_device_argument(
        p,
        "where the model will run: cpu or cuda / cuda:N. It picks the precision recipe (int4/int8 on cuda: "
        "weight-only MatMulNBits with fp16 activations, --target ort; on cpu: weight-only int4, Q/DQ int8; "
        "--target tensorrt keeps explicit Q/DQ; a precision measured slower on the device is a warning), and "
        "with --verify it is where both models run (ONNX Runtime's CUDA provider, its optimizations and TF32 off; "
        "needs onnxruntime-gpu, exit 7 without it)",
    )
    p.add_argument("--feeds", metavar="FILE.npz", help="use these input feeds for verification instead of random ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the random verification feeds (default 0)")
    add_feed_limit_argument(p, "random verification feeds")
    p.add_argument("--report", metavar="FILE.json", help="write the full report (per-pass stats, timing, checks) as JSON")
    p.add_argument("--explain", action="store_true",
                   help="show the rules that fused or nearly fused, each near miss and unfused region with its reason "
                   "(--json: every rule's figures in the passes' details)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="a pass option that no pass of the pipeline reads is an error (exit 2), not a warning",
    )
    p.add_argument(
        "--check-modified",
        action="store_true",
        help="debug: fail a pass that reports 'unchanged' but changed the graph",
    )
    p.add_argument(
        "--external-data",
        action="store_true",
        help="save initializers to OUT.data beside the model (OUT.<id>.data when replacing an earlier output, "
        "so the old pair stays whole until the switch); without it, chosen when they need 256 MiB or more "
        "or the input had external data",
    )
    group = p.add_argument_group("pass options (each pass reads the ones it declares)")
    try:
        from mograph.cli import BLOCKED
        from mograph.plugins import get_registry

        declared = get_registry(BLOCKED).all_options()
    except MographError as exc:  # a broken plugin must not break --help; the error shows on run
        p.set_defaults(_registry_error=exc)
        declared = {}
    for key, (opt, owners) in sorted(declared.items()):
        if key in _OWN:
            continue
        kwargs: dict[str, Any] = {
            "dest": f"opt_{key}",
            "default": None,
            "metavar": opt.metavar or key.upper(),
            "help": f"{opt.help} [{', '.join(owners)}; default: {_shown(opt.default, opt.metavar)}]",
        }
        if opt.multiple:
            kwargs["action"] = "append"
        if opt.choices:
            kwargs["choices"] = [str(c) for c in opt.choices]
            kwargs.pop("metavar")
        group.add_argument(f"--{opt.name}", **kwargs)
    p.set_defaults(run=run)


def _shown(default: Any, metavar: str | None) -> str:
    """A pass option's default as a user writes it: ``yes``/``no`` for a yes|no option, not True/False."""
    if isinstance(default, bool) and metavar and "yes" in metavar:
        return "yes" if default else "no"
    return str(default)


def _summary(report: Any, out: Path | None) -> str:
    lines = [f"{'pass':<24} {'changed':<8} {'nodes':>13} {'time':>9}  stats"]
    for p in report.passes:
        stats = ", ".join(f"{k}={v}" for k, v in p.stats.items() if v) or "-"
        lines.append(
            f"{p.name:<24} {('yes' if p.modified else 'no'):<8} {p.nodes_before:>6}->{p.nodes_after:<6} "
            f"{p.seconds * 1000:>7.1f}ms  {stats}"
        )
    for p in report.passes:
        warning = p.details.get("WARNING") if isinstance(p.details, dict) else None
        if warning:
            lines.append(f"WARNING ({p.name}): {warning}")
    recipe = report.extra.get("recipe")
    if recipe:
        for d in recipe.get("decisions", []):
            lines.append(f"recipe ({recipe['device']}): {d['precision']} -> {','.join(d['passes'])}")
        if any(d["passes"] != [d["precision"]] for d in recipe.get("decisions", [])):
            for opt in (recipe.get("runtime_options") or {}).values():  # measured, not settable from the file
                cfg = ", ".join(f"{k}={v}" for k, v in opt["session_config"].items())
                lines.append(f"recipe ({recipe['device']}): not set, your session's choice: {cfg} ({opt['what']}): "
                             f"{opt['advice']}")
    if report.verification is not None:
        v = report.verification
        lines.append(f"verify: {v.get('summary', 'passed' if v['passed'] else 'FAILED')}")
    if out is not None:
        lines.append(f"wrote {out}")
    return "\n".join(lines)


def _region_text(r: dict[str, Any]) -> str:
    """One unfused region (``unfused_regions``) or unfused Softmax (``unfused_softmax``) as a line."""
    where = f"{r.get('op', 'Softmax')} '{r.get('anchor') or r.get('softmax') or '?'}'"
    text = f"    unfused {where}: "
    if r.get("rule"):
        stop = f" at '{r['failed_at']}' ({r.get('failed_at_op')})" if r.get("failed_at") else ""
        text += f"{r['rule']} got furthest ({r.get('nodes_matched', '?')} node(s) from '{r.get('root')}'), stopped{stop}: "
    text += str(r.get("reason") or "no reason given")
    if r.get("constants_off"):
        text += "; constants off: " + "; ".join(map(str, r["constants_off"]))
    return text


def _explain_text(report: Any) -> str:
    """``--explain`` for people: per pass, the rules that fused or nearly fused (each near miss with its
    reason), and the regions left unfused; rules with no candidate are left out (``--json`` has them all)."""
    lines = []
    for p in report.passes:
        details = p.details if isinstance(p.details, dict) else {}
        body: list[str] = []
        quiet = 0
        for rule, e in (details.get("rules") or {}).items():
            if not isinstance(e, dict) or not (e.get("fused") or e.get("near_misses")):
                quiet += 1
                continue
            variants = e.get("variants") or {}
            vtext = f" [{', '.join(f'{k}: {v}' for k, v in variants.items())}]" if variants else ""
            body.append(f"  {rule}: {e.get('fused', 0)} fused, {e.get('near_misses', 0)} near miss(es){vtext}")
            for m in e.get("near_miss_list") or []:
                body.append(f"    near miss at '{m.get('root')}': {m.get('reason')}")
        for key in ("unfused_regions", "unfused_softmax"):
            body.extend(_region_text(r) for r in details.get(key) or [] if isinstance(r, dict))
        for key, value in details.items():
            if key in ("rules", "unfused_regions", "unfused_softmax") or value in (None, [], {}):
                continue
            shown = value if isinstance(value, (str, int, float, bool)) else json.dumps(value, default=str)
            body.append(f"  {key}: {shown}")
        if body:
            lines.append(f"== {p.name}" + (f" ({quiet} rule(s) without candidates not shown)" if quiet else ""))
            lines.extend(body)
    return "\n".join(lines) if lines else "(no rule matched or nearly matched)"


def run(args: argparse.Namespace) -> CommandResult:
    from mograph import api, ir_io
    from mograph.plugins import get_registry

    if getattr(args, "_registry_error", None) is not None:
        raise args._registry_error
    src = model_source(args)
    out = Path(args.output) if args.output else default_output(src, cwd_for=bool(args.example))
    if src.exists() and out.exists() and out.resolve() == src.resolve():
        raise UsageError(f"refusing to write over the input model {src}; choose another -o")
    if args.output:  # the default output lies beside the input (or in the current folder)
        _check_folder(out, "-o")
    if out.parent.is_dir():  # what a killed run left where this one writes goes first (the save sweeps too)
        ir_io.sweep_save_leftovers(out.parent)
    if args.report:
        _check_folder(Path(args.report), "--report")
    if args.device:
        from mograph.backends.ort import parse_device, require_device

        parse_device(args.device)
        if args.verify:
            require_device(args.device)  # exit 7 naming onnxruntime-gpu, before any pass runs
    reg = get_registry(args.block_plugin)
    shapes = parse_shapes(args.shape)
    options: dict[str, Any] = {}
    for key in reg.all_options():
        val = getattr(args, f"opt_{key}", None)
        if val is not None:
            options[key] = val
    if args.shape:
        options["shape"] = args.shape
    if args.explain:
        options["explain"] = True
    if args.device:
        options["device"] = args.device  # kept only if a pass declares it (below)
    options = {k: v for k, v in options.items() if k in reg.all_options()}
    given, planned, _ = reg.recipe(args.passes, options, args.device)
    names = reg.plan(given, planned)  # the report names the pipeline as it runs, lower included
    _check_paths(src, out, args, reg.all_options(), planned)
    # --shape, --explain, --device serve the command too (verification feeds, the report): handed to passes
    # only where one of the pipeline reads them, never warned about.
    taken = {o.key for n in names for o in reg.passes[n].options}
    options = {k: v for k, v in options.items() if k not in _OWN or k in taken}
    # [i/N] per pass and a bar inside long passes (mograph.progress); nothing under -q or --json
    instruments = [] if (args.json or args.quiet) else [ProgressInstrument(len(names))]
    verify_options: dict[str, Any] = {"shapes": shapes, "feeds": args.feeds, "seed": args.seed}
    if args.device and args.verify:
        verify_options["device"] = args.device
    pinned = _pinned_dims(options.get("dim"))
    if pinned:  # fix-shapes' --dim sizes the verification feeds too, as --shape does
        verify_options["dims"] = pinned
    if args.feed_limit is not None:
        verify_options["feed_limit"] = args.feed_limit
    external = True if args.external_data else None
    try:
        model, report = api.optimize(
            src,
            args.passes,  # api.optimize applies the device's recipe itself (names above is the same plan)
            options=options,
            verify=args.verify,
            verify_options=verify_options,
            check_modified=args.check_modified,
            blocked=args.block_plugin,
            instruments=instruments,
            strict=args.strict,
            device=args.device,
        )
    except VerificationError as exc:
        raise _keep_failed(exc, src, out, names, args, external) from exc
    ir_io.save_model(model, out, external_data=external, forbid=src)
    data = {"input": str(src), "output": str(out), "pipeline": names, **report.to_dict()}
    if args.report:
        write_text(args.report, json.dumps(data, indent=2, default=str), "--report")
    text = _summary(report, out)
    if args.explain:
        text += "\n" + _explain_text(report)
    return CommandResult(data=data, text=text)


def _pinned_dims(specs: Any) -> dict[str, int]:
    """``--dim SYMBOL=SIZE`` values as ``{symbol: size}`` for the verification feeds; a malformed one is left
    to the pass that reads it (it names the mistake)."""
    out: dict[str, int] = {}
    for spec in specs or []:
        sym, sep, size = str(spec).partition("=")
        if sep and sym.strip() and size.strip().isdigit() and int(size) > 0:
            out[sym.strip()] = int(size)
    return out


def _check_paths(src: Path, out: Path, args: argparse.Namespace, declared: dict[str, Any], options: dict[str, Any]) -> None:
    """Every path this run writes against every path it reads (:func:`mograph._paths.check_io`), once,
    before any work: -o, the model kept when --verify fails, --report and the passes' output files
    (--precision-plan-out) against the input model, its external data, --feeds and the passes' input
    files (--precision-plan, --calibration-data)."""
    opt_writes, opt_reads = option_io(declared, options)
    for flag, path in opt_writes:
        _check_folder(path, flag)  # type: ignore[arg-type]
    writes = [("-o", out), ("--report", args.report), *opt_writes]
    if args.verify:
        writes.append(("-o (the model kept when --verify fails)", failed_path(out)))
    files = model_files(src)
    reads: list[Named] = [("the input model", src), *(("the input model's external data", f) for f in files[1:])]
    reads += [("--feeds", f) for f in spec_files(args.feeds)]
    reads += opt_reads
    check_io(writes, reads)


def failed_path(out: Path) -> Path:
    """``m.opt.onnx`` -> ``m.opt.failed.onnx``: where a model that failed verification is kept."""
    stem = out.name[:-5] if out.name.endswith(".onnx") else out.name
    return out.with_name(f"{stem}.failed.onnx")


def _keep_failed(
    exc: VerificationError, src: Path, out: Path, names: list[str], args: argparse.Namespace, external: bool | None
) -> VerificationError:
    """Save the model that failed verification as ``OUT.failed.onnx`` (never as ``OUT``) and the report
    with ``"verification": {"passed": false, ...}``; the error line says where both are."""
    from mograph import ir_io

    kept: list[str] = []
    data: dict[str, Any] = {"input": str(src), "pipeline": names}
    if exc.model is not None:
        failed = failed_path(out)
        ir_io.save_model(ir_io.load_model(exc.model, check=False), failed, external_data=external, forbid=src)
        data["output"] = str(failed)
        kept.append(f"model {failed}")
    report = exc.pipeline_report
    data.update(report.to_dict() if report is not None and hasattr(report, "to_dict") else {})
    verification = dict(exc.report) if isinstance(exc.report, dict) else {}
    verification["passed"] = False
    data["verification"] = verification
    if args.report:
        write_text(args.report, json.dumps(data, indent=2, default=str), "--report")
        kept.append(f"report {args.report}")
    message = str(exc) + (f" (kept for inspection: {', '.join(kept)})" if kept else "")
    error = VerificationError(message, report=verification)
    error.model, error.pipeline_report = exc.model, exc.pipeline_report
    return error
