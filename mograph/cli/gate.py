"""``mograph gate``: measure a candidate like the ledger's rows and exit 5 on a regression."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mograph.cli import CommandResult
from mograph.workflow.gate import CONFIDENCE, DEFAULT_MAX_ACCURACY_DROP, DEFAULT_MAX_LATENCY_INCREASE, DEFAULT_REPEATS
from mograph.workflow.ledger import DEFAULT_LEDGER

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "gate",
        parents=[common],
        help="regression gate: measure a candidate against a ledger row, exit 5 on an accuracy or latency regression",
        description="Measure CANDIDATE the way the ledger measured its rows: on the evaluation set the ledger "
        "recorded (checked by hash), against the reference outputs of the unoptimized model it recorded (checked "
        "by hash), with the recorded warm-up, runs, threads and provider; the compared row's model is timed again "
        "beside the candidate (interleaved, in --repeats series of --runs rounds) when its file is still there. "
        "Fails (exit 5, one line saying why) when the accuracy metric (the task metric if the ledger has one, else "
        f"mean cosine vs the reference) dropped by more than --max-accuracy-drop (default {DEFAULT_MAX_ACCURACY_DROP:g}, "
        f"absolute) or the latency rose by more than --max-latency-increase (default "
        f"{DEFAULT_MAX_LATENCY_INCREASE * 100:g}%) beyond noise: the lower end of the {CONFIDENCE:.0%} interval of the "
        "candidate/compared ratio of medians (a bootstrap over the series and their paired runs) must pass the "
        "limit. With --json the figures are printed on failure too. Exit 0: no regression; "
        "2: the ledger, baseline model or evaluation set is missing or changed; 3: the candidate is not a valid model.",
    )
    p.add_argument("candidate", metavar="CANDIDATE.onnx", help="the model to gate")
    p.add_argument(
        "--ledger",
        default=DEFAULT_LEDGER,
        metavar="PATH",
        help=f"the ledger to gate against: a file path or sqlite:///PATH (default {DEFAULT_LEDGER}); it must exist "
        "(never created, --record included)",
    )
    p.add_argument("--baseline", metavar="ID|NAME",
                   help="the ledger row to compare with (default: the newest unoptimized baseline row)")
    p.add_argument("--max-accuracy-drop", type=float, default=DEFAULT_MAX_ACCURACY_DROP, metavar="X",
                   help=f"largest allowed drop of the accuracy metric, absolute (default {DEFAULT_MAX_ACCURACY_DROP:g})")
    p.add_argument("--max-latency-increase", default=f"{DEFAULT_MAX_LATENCY_INCREASE * 100:g}%", metavar="Y%",
                   help="largest allowed latency increase, percent, judged on the lower end of the confidence "
                   f"interval of the candidate/compared ratio (default {DEFAULT_MAX_LATENCY_INCREASE * 100:g}%%)")
    p.add_argument("--runs", type=int, metavar="N",
                   help="timed runs of each model in one series (default: the ledger's recorded timed runs shared "
                   "over the series, at least 5)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, metavar="R",
                   help=f"series of interleaved timed runs; the ratio is their median (default {DEFAULT_REPEATS})")
    p.add_argument("--task-metric", metavar="MODULE:FUNC|FILE.py:FUNC",
                   help="the task metric to gate on: imports and runs this code. Needed when the compared row was "
                   "measured with one (its source must hash as the ledger recorded); code named in a ledger is never run")
    p.add_argument("--eval-data", metavar="DATA",
                   help="the evaluation set, instead of the one the ledger names (folder of .npz, a stacked .npz, or "
                   "module:function / file.py:function, which imports and runs this code); its samples must hash as "
                   "recorded. Needed when the ledger records the set as code, which the gate never runs from a ledger")
    p.add_argument("--record", metavar="NAME",
                   help="also write the candidate's measurement into the ledger as row NAME (passed or not)")
    p.set_defaults(run=run)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.cli.sweep import ProgressBar
    from mograph.workflow.gate import GateFailed, parse_percent, run_gate
    from mograph.workflow.ledger import open_ledger

    latency = parse_percent(args.max_latency_increase)
    bar = ProgressBar(enabled=not (args.quiet or args.json), prefix="gate")
    if args.record:  # a row is added to the ledger gated against: a missing one is an error, not a new file
        from mograph._paths import check_io, model_files, spec_files
        from mograph.workflow.ledger import ledger_paths

        reads = [("the candidate", f) for f in model_files(args.candidate)]
        reads += [(flag, f) for flag, spec in (("--eval-data", args.eval_data), ("--task-metric", args.task_metric))
                  for f in spec_files(spec)]
        check_io(ledger_paths(args.ledger), reads)
        with open_ledger(args.ledger, readonly=True):
            pass
    with open_ledger(args.ledger, readonly=not args.record) as ledger:
        try:
            result = run_gate(
                args.candidate, ledger, baseline=args.baseline, max_accuracy_drop=args.max_accuracy_drop,
                max_latency_increase=latency, record=args.record, blocked=args.block_plugin, progress=bar,
                runs=args.runs, repeats=args.repeats,
                task_metric=args.task_metric, eval_data=args.eval_data,
            )
        except GateFailed:
            raise
    c, b = result.candidate, result.compared
    lines = [
        f"gate passed: {Path(args.candidate).name} vs '{result.compared_name}'",
        f"  {result.accuracy_metric}: {_fmt(c.get(result.accuracy_metric), '.6g')} vs "
        f"{_fmt(b.get(result.accuracy_metric), '.6g')} (drop {_fmt(result.accuracy_drop, '.3g')}, "
        f"allowed {args.max_accuracy_drop:g})",
        f"  p50 latency: {_fmt(c.get('latency_p50_ms'), '.3f')} ms vs {_fmt(b.get('latency_p50_ms'), '.3f')} ms "
        f"(x{_fmt(result.latency_ratio, '.3f')}"
        + (f", {CONFIDENCE:.0%} interval x{result.latency_interval[0]:.3f}..x{result.latency_interval[1]:.3f}"
           if result.latency_interval else "")
        + f", allowed +{latency * 100:g}%"
        + (f", measured side by side: {result.latency_runs.get('repeats')}x{result.latency_runs.get('runs')} "
           "interleaved runs" if result.remeasured else ", recorded figure")
        + ")",
    ]
    lines += [f"  note: {n}" for n in result.notes]
    if result.row_id is not None:
        lines.append(f"  recorded as row {result.row_id} ({args.record})")
    return CommandResult(data=result.to_dict(), text="\n".join(lines))
