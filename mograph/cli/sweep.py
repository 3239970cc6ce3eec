"""``mograph sweep``: build and measure many configurations of one model side by side, into the ledger."""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from mograph.cli import CommandResult
from mograph.cli._common import add_model_arguments, model_source
from mograph.errors import UsageError
from mograph.workflow.ledger import DEFAULT_LEDGER, LEDGER_HELP

__all__ = ["add_parser", "run", "ProgressBar", "add_executor_options"]


def add_executor_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--executor", choices=("local", "ray"), default="local",
        help="where the configurations are built: local (this process, one after another; the default) or ray "
        "(one Ray task each, and the quantization passes' per-layer sensitivity analysis fans out too; needs "
        "pip install 'mograph[ray]', else exit 7). Measuring always runs here, side by side",
    )
    p.add_argument(
        "--address", metavar="ADDR",
        help="with --executor ray: join this existing cluster (auto, HOST:6379 or ray://HOST:10001) instead of "
        "starting a local Ray instance; model and data paths must be readable on its workers",
    )
    p.add_argument("--workers", type=int, metavar="N",
                   help="with --executor ray and no --address: CPUs (parallel tasks) of the local Ray instance (default: all)")


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "sweep",
        parents=[common],
        help="build and measure many configurations side by side (latency, throughput, memory, size, accuracy) into the ledger",
        description="Build every configuration of a sweep config (a pass pipeline with options, backend/provider, "
        "shapes), then measure them and the unoptimized baseline together in one run: latency p50/p90/p99 and "
        "throughput from interleaved timed runs, peak memory (RSS increase), size on disk, and accuracy on a fixed "
        "evaluation set against the baseline (cosine mean/min, max-abs, top-1 agreement, and an optional task "
        "metric). Every measured model becomes one ledger row (see `mograph ledger`). The config schema is in "
        "the docstring of mograph.workflow.sweep; mograph/examples/bert-tiny.sweep.yaml is an example. A config's "
        "task_metric and a module:function eval_data or calibration_data import and run that code: run only configs "
        "you trust. "
        "Exits 0 when every configuration was measured, 4 when some failed to build or run (their rows say why).",
    )
    add_model_arguments(
        p, "the unoptimized .onnx model (or use --example)",
        example_help="sweep a model shipped with mograph (bert-tiny has a shipped config, used when --config is not given)",
    )
    p.add_argument("--config", metavar="SWEEP.yaml", help="the sweep config (YAML or JSON)")
    p.add_argument("--ledger", default=DEFAULT_LEDGER, metavar="PATH", help=LEDGER_HELP + "; created if missing")
    p.add_argument("--eval-data", metavar="DATA",
                   help="evaluation set (folder of .npz, a stacked .npz, or module:function / file.py:function, which "
                   "imports and runs this code); overrides the config's")
    p.add_argument("--calibration-data", metavar="DATA",
                   help="calibration set for the passes that take one (same forms); overrides the config's")
    p.add_argument("--keep-models", metavar="DIR",
                   help="keep the built models in this existing folder (rows point there; gate --baseline NAME can then "
                   "re-measure them); by default they are removed after measuring")
    add_executor_options(p)
    p.set_defaults(run=run)


class ProgressBar:
    """A progress bar on stderr: one line redrawn in place on a terminal, a line every 10 s otherwise."""

    def __init__(self, enabled: bool, prefix: str = "sweep") -> None:
        self.enabled = enabled
        self.prefix = prefix
        self.tty = enabled and sys.stderr.isatty()
        self.start = self.last = time.perf_counter()
        self.phase = ""

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        head = phase.split(" ")[0]
        new_phase = head != self.phase
        finished = total > 0 and done >= total
        if self.tty:
            due = new_phase or finished or now - self.last >= 0.2
        else:  # logs and CI: the first line, then one every 10 s, and the end of each stage
            due = self.phase == "" or finished or now - self.last >= 10.0
        if not due:
            return
        self.phase = head
        self.last = now
        width = 24
        filled = int(width * done / total) if total else 0
        bar = "#" * filled + "." * (width - filled)
        text = f"{self.prefix}: [{bar}] {done}/{total} {phase} ({now - self.start:.0f}s)"
        if self.tty:
            sys.stderr.write("\r\x1b[K" + text + ("\n" if finished else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _shipped_config(name: str) -> Path | None:
    path = Path(str(resources.files("mograph.examples") / f"{name}.sweep.yaml"))
    return path if path.exists() else None


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.cli.ledger import format_rows
    from mograph.workflow.executors import make_executor
    from mograph.workflow.ledger import open_ledger
    from mograph.workflow.sweep import check_against_registry, load_config, run_sweep

    src = model_source(args)
    config = args.config
    if config is None and args.example:
        shipped = _shipped_config(args.example)
        if shipped is None:
            raise UsageError(f"example {args.example!r} has no shipped sweep config: give --config")
        config = str(shipped)
    if config is None:
        raise UsageError("--config SWEEP.yaml is required (see mograph/examples/bert-tiny.sweep.yaml)")
    sweep = load_config(config)
    check_against_registry(sweep, args.block_plugin)  # refuse a bad config before starting anything
    if not src.is_file():
        raise UsageError(f"model {src}: no such file")
    if args.executor != "ray" and (args.address or args.workers):
        raise UsageError("--address and --workers need --executor ray")
    from mograph._paths import check_io
    from mograph.workflow.ledger import ledger_paths
    from mograph.workflow.sweep import io_paths

    writes, reads = io_paths(src, sweep, config=config, eval_data=args.eval_data, calibration_data=args.calibration_data,
                             keep_models=args.keep_models, blocked=args.block_plugin)
    check_io([*ledger_paths(args.ledger), *writes], reads)  # once, before any work
    bar = ProgressBar(enabled=not (args.quiet or args.json))
    with open_ledger(args.ledger) as ledger, make_executor(args.executor, address=args.address, workers=args.workers) as ex:
        rows = run_sweep(
            src, sweep, ledger, executor=ex, eval_data=args.eval_data, calibration_data=args.calibration_data,
            keep_models=args.keep_models, blocked=args.block_plugin, progress=bar,
        )
        where = str(ledger.path)
    failed = [r for r in rows if r.get("status") == "failed"]
    text = format_rows(rows) + f"\n{len(rows)} row(s) written to {where}"
    if failed:
        text += "\nFAILED: " + "; ".join(f"{r['name']}: {r.get('error')}" for r in failed)
    return CommandResult(data={"ledger": where, "rows": rows}, text=text, exit_code=4 if failed else 0)
