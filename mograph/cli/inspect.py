"""``mograph inspect``: what is in a model (opsets, inputs/outputs, ops, parameters, sizes)."""

from __future__ import annotations

import argparse
from typing import Any

from mograph.cli import CommandResult
from mograph.cli._common import add_model_arguments, model_source
from mograph.errors import UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="summarize a model: opsets, inputs/outputs, op histogram, parameters, sizes",
        description="Summarize MODEL: producer, IR version and opsets, inputs and outputs with dtypes and shapes "
        "(symbolic dims by name), node count, a histogram of op types (domain::Op outside the default domain), "
        "parameter count (initializer elements plus Constant-node tensors) and sizes (file, initializers, "
        "external data). External data is never read: sizes come from tensor metadata and the file system.",
    )
    add_model_arguments(p, "the .onnx file (or use --example)", verb="inspect")
    p.add_argument("--top", type=int, metavar="N", help="show only the N most frequent op types")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: also say whether ONNX Runtime's CUDA provider can capture the graph as a CUDA graph "
                   "(a static prediction of its CPU/GPU placement: no Memcpy, no control flow) and name the nodes "
                   "that block it")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.inspect import format_summary, summarize

    src = model_source(args)
    if args.top is not None and args.top < 1:
        raise UsageError("--top must be at least 1")
    summary = summarize(src)
    text = format_summary(summary, top=args.top)
    if getattr(args, "device", "cpu") == "cuda":
        from mograph import ir_io
        from mograph.cuda_graph import cuda_graph_check

        report = cuda_graph_check(ir_io.load_model(src))
        summary["cuda_graph"] = report.to_dict()
        lines = [f"cuda graph capture: {'yes' if report.capturable else 'NO'} "
                 f"({report.cpu_nodes} shape nodes on the CPU, no Memcpy predicted)" if report.capturable
                 else "cuda graph capture: NO (predicted; see mograph/cuda_graph.py for the heuristic)"]
        lines += [f"  blocks: {b['op']} '{b['node']}': {b['reason']}" for b in report.blockers]
        text = text + "\n" + "\n".join(lines)
    return CommandResult(data=summary, text=text)
