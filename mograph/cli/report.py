"""``mograph report``: the ledger as one self-contained HTML page, and the Pareto plot alone."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mograph.cli import CommandResult
from mograph.errors import UsageError

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "report",
        parents=[common],
        help="draw a ledger as one self-contained HTML page (tables, Pareto plots) or write the plot alone",
        description="Read the rows of a ledger (written by mograph sweep and gate) and write one HTML file that opens "
        "offline (inline CSS, script and SVG; nothing fetched): per model, the configurations table (latency "
        "p50/p90/p99, throughput, peak memory, size, accuracy against the baseline, status), Pareto plots of "
        "accuracy against latency and against size with the frontier marked, and for each configuration its "
        "per-pass table, precision plan and profile when the ledger holds them. --plot writes one Pareto plot "
        "alone: .svg needs nothing, .png is rendered by headless Chromium (exit 7 when none is installed).",
    )
    p.add_argument("--ledger", metavar="PATH", default="mograph-ledger.db",
                   help="the ledger to read: a SQLite file or sqlite:///PATH (default mograph-ledger.db); never created")
    p.add_argument("-o", "--output", metavar="FILE.html",
                   help="where to write the HTML report (default report.html, unless only --plot is given)")
    p.add_argument("--plot", metavar="FILE.svg|FILE.png", help="write one Pareto plot alone: accuracy vs --plot-x (latency by default)")
    p.add_argument("--plot-x", choices=("latency", "size"), default="latency",
                   help="x axis of the --plot file: latency p50 (default) or size on disk")
    p.add_argument("--model-hash", metavar="HASH",
                   help="only rows of this model (a prefix of its hash is enough); --plot needs it when the ledger "
                   "holds several models")
    p.add_argument("--name", action="append", metavar="NAME", help="only rows of this name (repeatable)")
    p.add_argument("--accuracy", metavar="METRIC",
                   help="accuracy metric to plot: cosine_mean, top1_agreement, task_metric, cosine_min, max_abs "
                   "(default: the first of these the rows have)")
    p.add_argument("--title", default="mograph report", help="page title")
    p.set_defaults(run=run)


def _select(rows: list[dict[str, Any]], model_hash: str | None) -> list[dict[str, Any]]:
    if not model_hash:
        return rows
    hashes = sorted({str(r.get("model_hash")) for r in rows if r.get("model_hash")})
    match = [h for h in hashes if h.startswith(model_hash)]
    if not match:
        known = ", ".join(h[:12] for h in hashes) or "none"
        raise UsageError(f"--model-hash {model_hash}: no row of such a model (models in the ledger: {known})")
    if len(match) > 1:
        raise UsageError(f"--model-hash {model_hash} is ambiguous: {', '.join(h[:16] for h in match)}")
    return [r for r in rows if r.get("model_hash") == match[0]]


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.workflow import report as rep
    from mograph.workflow.ledger import open_ledger

    out = Path(args.output) if args.output else (None if args.plot else Path("report.html"))
    plot = Path(args.plot) if args.plot else None
    if plot is not None and plot.suffix.lower() not in (".svg", ".png"):
        raise UsageError(f"--plot {plot}: the plot is written as .svg or .png")
    for path, flag in ((out, "-o"), (plot, "--plot")):
        if path is not None and not (path.parent if str(path.parent) else Path(".")).is_dir():
            raise UsageError(f"{flag} {path}: folder {path.parent} does not exist; create it first")
    ledger_path = str(args.ledger)
    from mograph._paths import check_io
    from mograph.workflow.ledger import ledger_paths

    check_io([("-o", out), ("--plot", plot)], [(f"the ledger{'' if flag == '--ledger' else flag[8:]}", f)
                                                for flag, f in ledger_paths(args.ledger)])
    with open_ledger(args.ledger, readonly=True) as ledger:
        rows = ledger.rows(names=args.name)
    rows = _select(rows, args.model_hash)
    if not rows:
        raise UsageError(f"ledger {args.ledger} has no rows{' of those names' if args.name else ''} to report")
    accuracy = rep.accuracy_metric(rows, args.accuracy)
    groups = rep.group_rows(rows)
    data: dict[str, Any] = {"ledger": ledger_path, "rows": len(rows), "models": list(groups), "accuracy": accuracy}
    lines = []
    if out is not None:
        rep.write_report(rows, out, title=args.title, source=ledger_path, accuracy=args.accuracy)
        data["output"] = str(out)
        lines.append(f"wrote {out}: {len(rows)} row(s), {len(groups)} model(s), accuracy metric {accuracy or 'none'}")
    data["frontier"] = {}
    for model_hash, group in groups.items():
        front = [p.name for p in rep.frontier(group, x="latency", accuracy=args.accuracy) if p.frontier]
        data["frontier"][model_hash] = front
        lines.append(f"model {model_hash[:12]}: frontier (accuracy vs latency): {', '.join(front) or 'none'}")
    if plot is not None:
        if len(groups) > 1:
            known = ", ".join(h[:12] for h in groups)
            raise UsageError(f"--plot draws one model and the ledger holds {len(groups)} ({known}): add --model-hash")
        rep.write_plot(rows, plot, x=args.plot_x, accuracy=args.accuracy)
        data["plot"] = str(plot)
        lines.append(f"wrote {plot} (accuracy vs {args.plot_x})")
    return CommandResult(data=data, text="\n".join(lines))
