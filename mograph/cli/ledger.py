"""``mograph ledger``: query the ledger of measured configurations (list, show, compare, export --csv)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mograph._paths import check_io, write_text
from mograph.cli import CommandResult
from mograph.errors import UsageError
from mograph.workflow.ledger import DEFAULT_LEDGER, LEDGER_HELP, ledger_paths, open_ledger, rows_to_csv

__all__ = ["add_parser", "run", "format_rows", "format_compare", "format_show"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "ledger",
        parents=[common],
        help="query the ledger of measured configurations: list, show, compare, export --csv",
        description="Every configuration `mograph sweep` and `mograph gate` measure is a row of the ledger "
        "(a SQLite file): model hash, pipeline and options, provider, shapes, calibration and evaluation set "
        "hashes, library versions, host, time and every metric. This command reads it; it never writes.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--ledger", default=DEFAULT_LEDGER, metavar="PATH",
                        help=LEDGER_HELP + "; it must exist (this command never creates one)")

    lp = actions.add_parser("list", parents=[common, shared], help="one line per row, oldest first")
    lp.add_argument("--model-hash", metavar="HASH", help="only rows of this model (a prefix is enough)")
    lp.add_argument("--failed", action="store_true", help="include failed rows (left out by default)")
    sp = actions.add_parser("show", parents=[common, shared], help="every field of one row, as a table (--json: JSON)")
    sp.add_argument("row", metavar="ID|NAME", help="row id, or name (the newest row of that name)")
    cp = actions.add_parser(
        "compare", parents=[common, shared], help="rows side by side, metrics relative to the first (or --against)"
    )
    cp.add_argument("rows", nargs="+", metavar="ID|NAME", help="rows to compare (two or more)")
    cp.add_argument("--against", metavar="ID|NAME", help="the reference row (default: the first one given)")
    ep = actions.add_parser("export", parents=[common, shared], help="write the rows as CSV")
    ep.add_argument("--csv", required=True, metavar="FILE", help="CSV file to write ('-' for stdout)")
    ep.add_argument("--model-hash", metavar="HASH", help="only rows of this model (a prefix is enough)")
    for q in (lp, sp, cp, ep):
        q.set_defaults(run=run)
    p.set_defaults(run=run)


#: Columns of ``ledger list`` / ``compare``: (metric key, header, format).
_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("latency_p50_ms", "p50 ms", ".3f"),
    ("latency_p99_ms", "p99 ms", ".3f"),
    ("throughput", "inf/s", ".1f"),
    ("peak_mem_mb", "mem MB", ".1f"),
    ("size_bytes", "size MB", "size"),
    ("cosine_mean", "cos mean", ".6f"),
    ("cosine_min", "cos min", ".6f"),
    ("max_abs", "max abs", ".3g"),
    ("top1_agreement", "top-1", ".4f"),
    ("task_metric", "task", ".4g"),
)


#: Row labels of ``ledger compare`` that differ from the metric key (the value shown is not the raw one).
_COMPARE_LABELS = {"size_bytes": "size_mb"}


def format_show(row: dict[str, Any]) -> str:
    """``ledger show``: one row as a two-column table (fields, then metrics, then settings)."""
    lines: list[str] = []
    fields = [(k, _pipeline(row) if k == "pipeline" else v) for k, v in row.items()
              if k not in ("metrics", "settings", "options", "versions", "shapes")]
    spec_of = {k: s for k, _, s in _COLUMNS}
    head_of = {k: h for k, h, _ in _COLUMNS}

    def section(title: str, items: list[tuple[str, str]]) -> None:
        if not items:
            return
        width = max(len(k) for k, _ in items)
        lines.append(title)
        lines.extend(f"  {k:<{width}}  {v}" for k, v in items)

    section("row", [(k, "-" if v is None else str(v)) for k, v in fields])
    metrics = row.get("metrics") or {}
    section("metrics", [(head_of.get(k, k), _fmt(v, spec_of.get(k, ".6g"))) for k, v in metrics.items()])
    for name in ("options", "shapes", "versions", "settings"):
        value = row.get(name) or {}
        if isinstance(value, dict):
            section(name, [(str(k), json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v))
                           for k, v in value.items()])
    return "\n".join(lines)


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "size":
        return f"{value / 1e6:.2f}"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def _pipeline(row: dict[str, Any]) -> str:
    return ",".join(row.get("pipeline") or []) or "(none)"


def _passes(row: dict[str, Any]) -> str:
    """The passes as the sweep config named them (presets unexpanded), else the expanded pipeline."""
    given = (row.get("settings") or {}).get("passes")
    return ",".join(given) if given else _pipeline(row)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The ``ledger list`` table."""
    if not rows:
        return "(no rows)"
    cols = [c for c in _COLUMNS if any((r.get("metrics") or {}).get(c[0]) is not None for r in rows)]
    name_w = max(len("name"), *(len(r["name"]) for r in rows))
    head = f"{'id':>4}  {'name':<{name_w}}  {'status':<6} " + " ".join(f"{h:>9}" for _, h, _ in cols) + "  passes"
    lines = [head]
    for r in rows:
        m = r.get("metrics") or {}
        status = "base" if r.get("baseline") and r.get("status", "ok") == "ok" else r.get("status", "ok")
        cells = " ".join(f"{_fmt(m.get(k), spec):>9}" for k, _, spec in cols)
        tail = _passes(r) if r.get("status", "ok") == "ok" else f"{_passes(r)}  ({r.get('error') or 'failed'})"
        lines.append(f"{r['id']:>4}  {r['name']:<{name_w}}  {status:<6} {cells}  {tail}")
    return "\n".join(lines)


def format_compare(rows: list[dict[str, Any]], ref: dict[str, Any]) -> str:
    """Metrics of ``rows`` side by side, each with its ratio (or difference) to ``ref``."""
    keys = [k for k, _, _ in _COLUMNS if any((r.get("metrics") or {}).get(k) is not None for r in rows)]
    extra = sorted({k for r in rows for k in (r.get("metrics") or {})} - set(keys))
    keys += extra
    spec_of = {k: s for k, _, s in _COLUMNS}
    width = max(12, *(len(r["name"]) + len(str(r["id"])) + 3 for r in rows))
    label = {k: _COMPARE_LABELS.get(k, k) for k in keys}
    key_w = max(len(x) for x in [*label.values(), "metric"])
    lines = [f"{'metric':<{key_w}}  " + "  ".join(f"{r['name'] + ' #' + str(r['id']):>{width}}" for r in rows)]
    ref_m = ref.get("metrics") or {}
    for key in keys:
        cells = []
        for r in rows:
            v = (r.get("metrics") or {}).get(key)
            text = _fmt(v, spec_of.get(key, ".4g"))
            base = ref_m.get(key)
            if r is not ref and isinstance(v, (int, float)) and isinstance(base, (int, float)):
                if key in ("cosine_mean", "cosine_min", "top1_agreement", "max_abs", "task_metric") or not base:
                    text += f" ({v - base:+.3g})"
                else:
                    text += f" (x{v / base:.2f})"
            cells.append(f"{text:>{width}}")
        lines.append(f"{label[key]:<{key_w}}  " + "  ".join(cells))
    for field in ("pipeline", "provider", "calib_hash", "eval_hash", "model_hash"):
        vals = [_pipeline(r) if field == "pipeline" else str(r.get(field) or "-") for r in rows]
        lines.append(f"{field:<{key_w}}  " + "  ".join(f"{v[:width]:>{width}}" for v in vals))
    lines.append(f"(ratios x and differences +/- are against {ref['name']} #{ref['id']})")
    return "\n".join(lines)


def _by_hash(rows: list[dict[str, Any]], prefix: str | None) -> list[dict[str, Any]]:
    if not prefix:
        return rows
    return [r for r in rows if str(r.get("model_hash") or "").startswith(prefix)]


def run(args: argparse.Namespace) -> CommandResult:
    with open_ledger(args.ledger, readonly=True) as ledger:
        if args.action == "list":
            rows = _by_hash(ledger.rows(), args.model_hash)
            if not args.failed:
                rows = [r for r in rows if r.get("status") == "ok"]
            return CommandResult(data={"ledger": str(ledger.path), "rows": rows}, text=format_rows(rows))
        if args.action == "show":
            row = ledger.get(args.row)
            return CommandResult(data=row, text=format_show(row))
        if args.action == "compare":
            rows = [ledger.get(r) for r in args.rows]
            if len(rows) < 2 and not args.against:
                raise UsageError("ledger compare needs two or more rows (or --against)")
            ref = ledger.get(args.against) if args.against else rows[0]
            if args.against:
                rows = [ref, *[r for r in rows if r["id"] != ref["id"]]]
            return CommandResult(data={"reference": ref["id"], "rows": rows}, text=format_compare(rows, ref))
        if args.action == "export":
            rows = _by_hash(ledger.rows(), args.model_hash)
            text = rows_to_csv(rows)
            if args.csv == "-":
                return CommandResult(data={"rows": len(rows)}, text=text)
            dest = Path(args.csv)
            if not dest.parent.exists():
                raise UsageError(f"--csv {dest}: folder {dest.parent} does not exist")
            check_io([("--csv", dest)], [("the ledger", f) for _, f in ledger_paths(args.ledger)])
            write_text(dest, text, "--csv")  # atomic, never through a link: a reader never sees half a file
            return CommandResult(data={"rows": len(rows), "csv": str(dest)}, text=f"wrote {len(rows)} rows to {dest}")
    raise UsageError(f"unknown ledger action {args.action!r}")  # pragma: no cover - argparse refuses first
