"""The report you look at: one self-contained HTML page drawn from ledger rows.

``mograph report --ledger PATH -o report.html`` turns the rows of a ledger (see
:mod:`mograph.workflow.ledger`) into a page that needs nothing but a browser: CSS, the few lines of
script (column sorting) and the plots (SVG) are all inline; no font, script or style is fetched from
anywhere, so it opens offline and can be attached to a ticket.

What the page holds, per model (rows are grouped by ``model_hash``; a sweep measures one model):

* **configurations** — one line per row: pipeline, provider, latency p50/p90/p99, throughput, peak
  memory, size, accuracy against the baseline (cosine mean/min, max-abs, top-1 agreement, a task
  metric), status, and whether the row is on the Pareto frontier;
* **Pareto plots** — accuracy against latency and accuracy against size on disk, every successful row a
  point, the frontier (rows no other row beats on both axes) joined and marked;
* **per configuration**, when the row carries them: the per-pass table (what each pass did, nodes
  before/after, seconds, stats), the precision plan (precision counts and every node's precision and
  reason), and the profile (time per op type, top nodes, GPU kernels, fusion candidates).

Accuracy is the metric named by ``accuracy`` (default: the first of ``cosine_mean``, ``top1_agreement``,
``task_metric``, ``cosine_min`` that some row has).  ``max_abs`` is lower-is-better; the others are
higher-is-better.  The unoptimized baseline is the reference the accuracy was measured against: when
it carries no value of its own it is drawn at the metric's perfect value (cosine 1, top-1 1, max-abs 0),
and its tooltip says so.  Rows with ``status`` ``failed`` are listed but never plotted.

The plot alone can be written as SVG (:func:`pareto_svg`) or as PNG (:func:`svg_to_png`), which renders
the same SVG in headless Chromium, so the PNG is exactly what the page shows.  Chromium is found on
``PATH`` (``chromium``, ``chromium-browser``, ``google-chrome``) or named by ``MOGRAPH_CHROMIUM``; without
it a PNG is refused with exit code 7 (an SVG needs nothing).
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mograph.errors import MographError, UsageError

__all__ = [
    "ACCURACY_METRICS",
    "ChromiumNotFoundError",
    "Point",
    "accuracy_metric",
    "find_chromium",
    "frontier",
    "group_rows",
    "pareto_front",
    "pareto_svg",
    "plot_points",
    "render_html",
    "svg_to_png",
    "write_plot",
    "write_report",
]

#: Accuracy metrics the report knows, with their direction (True: higher is better) and perfect value.
ACCURACY_METRICS: dict[str, tuple[bool, float | None]] = {
    "cosine_mean": (True, 1.0),
    "top1_agreement": (True, 1.0),
    "task_metric": (True, None),
    "cosine_min": (True, 1.0),
    "max_abs": (False, 0.0),
}

#: The x axes a Pareto plot can have: metric key, axis label, unit scale.
X_AXES: dict[str, tuple[str, str]] = {
    "latency": ("latency_p50_ms", "latency p50 (ms)"),
    "size": ("size_bytes", "size on disk (MB)"),
}

_FRONT = "#d62728"
_POINT = "#1f77b4"
_BASE = "#2ca02c"


class ChromiumNotFoundError(MographError):
    """A PNG was asked for and no Chromium/Chrome binary is there to render the SVG (exit 7)."""

    exit_code = 7


# -- data ------------------------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    """A finite float, or None (ledger metrics may be missing, None, NaN or strings)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _metrics(row: Mapping[str, Any]) -> dict[str, Any]:
    m = row.get("metrics")
    return m if isinstance(m, dict) else {}


def _ok(row: Mapping[str, Any]) -> bool:
    return str(row.get("status") or "ok") == "ok"


def accuracy_metric(rows: Sequence[Mapping[str, Any]], requested: str | None = None) -> str | None:
    """The accuracy metric to plot: ``requested`` if given (it must be known), else the first of
    :data:`ACCURACY_METRICS` that some successful row has; None when no row has any."""
    if requested:
        if requested not in ACCURACY_METRICS:
            raise UsageError(f"--accuracy {requested!r}: choose from {', '.join(ACCURACY_METRICS)}")
        return requested
    for key in ACCURACY_METRICS:
        if any(_num(_metrics(r).get(key)) is not None for r in rows if _ok(r)):
            return key
    return None


def group_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Rows by ``model_hash`` (one Pareto plot per model), in first-seen order."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(str(row.get("model_hash") or "unknown model"), []).append(row)
    return groups


@dataclass
class Point:
    """One plotted row: its name, x and y, and whether y is the baseline's implied perfect value."""

    name: str
    x: float
    y: float
    baseline: bool = False
    implied: bool = False
    index: int = -1  #: position of the row in the rows given
    frontier: bool = False


def plot_points(rows: Sequence[Mapping[str, Any]], x_key: str, y_key: str) -> list[Point]:
    """The successful rows that have both metrics (the baseline's missing accuracy is its perfect value)."""
    perfect = ACCURACY_METRICS.get(y_key, (True, None))[1]
    points = []
    for index, row in enumerate(rows):
        if not _ok(row):
            continue
        m = _metrics(row)
        x, y = _num(m.get(x_key)), _num(m.get(y_key))
        implied = False
        if y is None and row.get("baseline") and perfect is not None:
            y, implied = perfect, True
        if x is None or y is None:
            continue
        if x_key == "size_bytes":
            x = x / 1e6
        points.append(Point(str(row.get("name", "?")), x, y, bool(row.get("baseline")), implied, index))
    return points


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool = True) -> list[bool]:
    """For each ``(x, y)`` — x to minimise, y to maximise (or minimise when not ``higher_is_better``) —
    whether no other point is at least as good on both axes and strictly better on one."""
    sign = 1.0 if higher_is_better else -1.0
    out = []
    for i, (xi, yi) in enumerate(points):
        dominated = False
        for j, (xj, yj) in enumerate(points):
            if i == j:
                continue
            if xj <= xi and sign * yj >= sign * yi and (xj < xi or sign * yj > sign * yi):
                dominated = True
                break
        out.append(not dominated)
    return out


def frontier(rows: Sequence[Mapping[str, Any]], *, x: str = "latency", accuracy: str | None = None) -> list[Point]:
    """The plotted points of ``rows`` with ``frontier`` set, frontier first (by x), then the others."""
    if x not in X_AXES:
        raise UsageError(f"plot x axis {x!r}: choose from {', '.join(X_AXES)}")
    y_key = accuracy_metric(rows, accuracy)
    if y_key is None:
        return []
    points = plot_points(rows, X_AXES[x][0], y_key)
    for p, front in zip(points, pareto_front([(p.x, p.y) for p in points], ACCURACY_METRICS[y_key][0])):
        p.frontier = front
    return sorted(points, key=lambda p: (not p.frontier, p.x))


# -- the plot --------------------------------------------------------------------------------------------


def _nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        span = abs(lo) * 0.1 or 1.0
        lo, hi = lo - span, hi + span
    raw = (hi - lo) / max(count - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    first = math.floor(lo / step) * step
    ticks: list[float] = []
    t = first
    while t <= hi + step * 0.5 and len(ticks) < 50:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _padded(lo: float, hi: float, floor: float | None) -> tuple[float, float]:
    """The axis range for data in [lo, hi]: 8% room on each side (not below ``floor``)."""
    span = hi - lo
    if span <= 0:
        span = abs(hi) * 0.02 or 1.0
    lo, hi = lo - 0.08 * span, hi + 0.08 * span
    if floor is not None and lo < floor <= lo + 0.08 * span * 2:
        lo = floor
    return lo, hi


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    a = abs(value)
    if a >= 1000:
        return f"{value:.0f}"
    if a >= 1:
        return f"{value:.3g}"
    return f"{value:.6g}"


def pareto_svg(
    rows: Sequence[Mapping[str, Any]],
    *,
    x: str = "latency",
    accuracy: str | None = None,
    title: str | None = None,
    width: int = 640,
    height: int = 420,
    element_id: str | None = None,
) -> str:
    """An SVG scatter plot of accuracy against ``x`` (``latency`` or ``size``), the frontier marked.

    Every successful row with both metrics is a point (its name beside it, details in a tooltip);
    frontier points are red and joined by a step line; the baseline is a green square.  When no row
    can be plotted the SVG says so in words instead of drawing empty axes.
    """
    if x not in X_AXES:
        raise UsageError(f"plot x axis {x!r}: choose from {', '.join(X_AXES)}")
    x_key, x_label = X_AXES[x]
    y_key = accuracy_metric(rows, accuracy)
    higher = ACCURACY_METRICS.get(y_key or "", (True, None))[0]
    points = sorted(frontier(rows, x=x, accuracy=accuracy), key=lambda p: p.index)
    ident = f' id="{html.escape(element_id)}"' if element_id else ""
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg"{ident} class="pareto" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" '
        f'data-points="{len(points)}" data-frontier="{sum(p.frontier for p in points)}">'
    )
    parts = [head, f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>']
    caption = title or f"{y_key or 'accuracy'} vs {x_label}"
    parts.append(f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="14" font-weight="bold">'
                 f"{html.escape(caption)}</text>")
    if not points:
        why = "no accuracy metric in these rows" if y_key is None else f"no successful row has both {y_key} and {x_key}"
        parts.append(f'<text x="{width / 2:.1f}" y="{height / 2:.1f}" text-anchor="middle" fill="#555">'
                     f"nothing to plot: {html.escape(why)}</text></svg>")
        return "".join(parts)

    left, right, top, bottom = 78, 24, 34, 70
    pw, ph = width - left - right, height - top - bottom
    xs, ys = [p.x for p in points], [p.y for p in points]
    x0, x1 = _padded(min(xs), max(xs), 0.0)
    y0, y1 = _padded(min(ys), max(ys), None)
    xt = [t for t in _nice_ticks(x0, x1) if x0 <= t <= x1]
    yt = [t for t in _nice_ticks(y0, y1) if y0 <= t <= y1]

    def sx(v: float) -> float:
        return left + (v - x0) / (x1 - x0) * pw

    def sy(v: float) -> float:
        return top + ph - (v - y0) / (y1 - y0) * ph

    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#888"/>')
    for t in xt:
        px = sx(t)
        parts.append(f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{top + ph}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{px:.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt(t)}</text>')
    for t in yt:
        py = sy(t)
        parts.append(f'<line x1="{left}" y1="{py:.1f}" x2="{left + pw}" y2="{py:.1f}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{left - 6}" y="{py + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    parts.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph + 34}" text-anchor="middle">{html.escape(x_label)}</text>')
    better = "higher is better" if higher else "lower is better"
    parts.append(f'<text transform="translate(16 {top + ph / 2:.1f}) rotate(-90)" text-anchor="middle">'
                 f"{html.escape(str(y_key))} ({better})</text>")

    front = sorted((p for p in points if p.frontier), key=lambda p: (p.x, -p.y if higher else p.y))
    if len(front) > 1:
        path = [f"M{sx(front[0].x):.1f},{sy(front[0].y):.1f}"]
        for prev, cur in zip(front, front[1:]):
            path.append(f"L{sx(cur.x):.1f},{sy(prev.y):.1f}L{sx(cur.x):.1f},{sy(cur.y):.1f}")
        parts.append(f'<path class="frontier" d="{"".join(path)}" fill="none" stroke="{_FRONT}" '
                     'stroke-width="1.5" stroke-dasharray="5 3"/>')
    placed: list[tuple[float, float, float, float]] = []  # label boxes (x0, y0, x1, y1), so labels never overprint
    unlabelled: list[str] = []
    for p in sorted(points, key=lambda p: p.baseline):  # the baseline last: on top
        px, py = sx(p.x), sy(p.y)
        color = _FRONT if p.frontier else _POINT
        tip = f"{p.name}: {x_label} {_fmt(p.x)}, {y_key} {_fmt(p.y)}"
        if p.implied:
            tip += " (baseline: the reference, perfect by definition)"
        if p.frontier:
            tip += " - on the Pareto frontier"
        cls = "point frontier-point" if p.frontier else "point"
        title_el = f"<title>{html.escape(tip)}</title>"
        if p.baseline:
            parts.append(f'<rect class="{cls} baseline" x="{px - 6:.1f}" y="{py - 6:.1f}" width="12" height="12" '
                         f'fill="{_BASE}" stroke="{color}" stroke-width="2">{title_el}</rect>')
        else:
            fill = color if p.frontier else "#ffffff"
            parts.append(f'<circle class="{cls}" cx="{px:.1f}" cy="{py:.1f}" r="6" fill="{fill}" '
                         f'stroke="{color}" stroke-width="2">{title_el}</circle>')
        spot = _label_spot(px, py, 6.6 * len(p.name), placed, prefer_left=px > left + pw * 0.75,
                           bounds=(0.0, 22.0, float(width), float(top + ph)))
        if spot is None:  # no free place near the point: named in the note under the plot, never overprinted
            unlabelled.append(p.name)
            continue
        x_text, y_text, anchor = spot
        parts.append(f'<text x="{x_text:.1f}" y="{y_text:.1f}" text-anchor="{anchor}" fill="#333">'
                     f"{html.escape(p.name)}</text>")
    if unlabelled:
        parts.append(f'<text class="unlabelled" x="{left}" y="{top + ph + 48}" font-size="11" fill="#555">'
                     f"{html.escape('not labelled (crowded; hover the points): ' + ', '.join(unlabelled))}</text>")
    # legend, in one line under the x axis label
    ly = height - 10
    parts.append('<g class="legend" font-size="11">'
                 f'<circle cx="{left + 6}" cy="{ly - 4}" r="5" fill="{_FRONT}" stroke="{_FRONT}"/>'
                 f'<text x="{left + 15}" y="{ly}">on the Pareto frontier (dashed: the frontier)</text>'
                 f'<circle cx="{left + 276}" cy="{ly - 4}" r="5" fill="#fff" stroke="{_POINT}" stroke-width="2"/>'
                 f'<text x="{left + 285}" y="{ly}">dominated</text>'
                 f'<rect x="{left + 356}" y="{ly - 9}" width="10" height="10" fill="{_BASE}"/>'
                 f'<text x="{left + 371}" y="{ly}">baseline (unoptimized)</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _label_spot(
    px: float, py: float, w: float, placed: list[tuple[float, float, float, float]], *, prefer_left: bool,
    bounds: tuple[float, float, float, float],
) -> tuple[float, float, str] | None:
    """Where a label of width ``w`` for the point at ``(px, py)`` can go without touching any label in
    ``placed`` (boxes ``(x0, y0, x1, y1)``) or leaving ``bounds``: beside the point, then further above and
    below, on the preferred side first.  Records the box in ``placed``; ``None`` when nothing is free."""
    sides = [("end", -9.0), ("start", 9.0)] if prefer_left else [("start", 9.0), ("end", -9.0)]
    for k in range(12):
        dy = (-4.0 if k == 0 else (k + 1) // 2 * 14.0 * (1 if k % 2 else -1) - 4.0)
        for anchor, dx in sides:
            x0 = px + dx - (w if anchor == "end" else 0.0)
            base = py + dy  # text baseline; the box spans [base - 10, base + 3]
            box = (x0, base - 10.0, x0 + w, base + 3.0)
            if box[0] < bounds[0] or box[2] > bounds[2] or box[1] < bounds[1] or box[3] > bounds[3] + 12:
                continue
            if any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                continue
            placed.append(box)
            return px + dx, base, anchor
    return None


# -- the page --------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
h3{font-size:15px;margin:18px 0 6px}h4{font-size:13px;margin:12px 0 4px}
table{border-collapse:collapse;font-size:12px;margin:6px 0 12px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f2f2f2;cursor:pointer;user-select:none}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.frontier td:first-child{border-left:4px solid #d62728}tr.failed{color:#a00;background:#fff5f5}
.meta{color:#555;font-size:12px}.plots{display:flex;flex-wrap:wrap;gap:16px}
.bar{display:inline-block;height:9px;background:#1f77b4;vertical-align:middle;margin-right:4px}
details{margin:8px 0;border:1px solid #e5e5e5;border-radius:4px;padding:4px 10px}
summary{cursor:pointer;font-weight:600}code{font-size:12px}.tag{font-size:11px;padding:0 5px;border-radius:3px;background:#eee}
.tag.front{background:#fde0e0;color:#a00}.tag.base{background:#e0f5e0;color:#060}
"""

_JS = """
document.querySelectorAll('table.sortable th').forEach(function(th){
  th.addEventListener('click',function(){
    var table=th.closest('table'),body=table.tBodies[0],i=Array.prototype.indexOf.call(th.parentNode.children,th);
    var asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
    var rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){
      var x=a.cells[i].dataset.v!==undefined?a.cells[i].dataset.v:a.cells[i].textContent;
      var y=b.cells[i].dataset.v!==undefined?b.cells[i].dataset.v:b.cells[i].textContent;
      var nx=parseFloat(x),ny=parseFloat(y);
      var c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:String(x).localeCompare(String(y));
      return asc?c:-c;});
    rows.forEach(function(r){body.appendChild(r);});
  });
});
"""

#: Metric columns of the configurations table: key, heading, format.
_METRIC_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("latency_p50_ms", "p50 ms", ".3f"),
    ("latency_p90_ms", "p90 ms", ".3f"),
    ("latency_p99_ms", "p99 ms", ".3f"),
    ("throughput", "throughput /s", ".1f"),
    ("peak_mem_mb", "peak mem MB", ".1f"),
    ("size_bytes", "size MB", "size"),
    ("cosine_mean", "cosine mean", ".6f"),
    ("cosine_min", "cosine min", ".6f"),
    ("max_abs", "max abs", ".3g"),
    ("top1_agreement", "top-1 agree", ".4f"),
    ("task_metric", "task metric", ".4g"),
)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _cell_num(value: Any, spec: str) -> str:
    v = _num(value)
    if v is None:
        return '<td class="n" data-v="">-</td>'
    shown = f"{v / 1e6:.2f}" if spec == "size" else format(v, spec)
    return f'<td class="n" data-v="{v!r}">{shown}</td>'


def _pipeline_text(row: Mapping[str, Any]) -> str:
    pipe = row.get("pipeline")
    if isinstance(pipe, (list, tuple)):
        return ",".join(str(p) for p in pipe) or "(none)"
    return str(pipe) if pipe else "(none)"


def _short(value: Any, n: int = 12) -> str:
    text = "" if value is None else str(value)
    return text[:n] + ("…" if len(text) > n else "")


def _json_inline(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(value)


def _config_table(rows: Sequence[Mapping[str, Any]], front_ids: set[int], table_id: str) -> str:
    present = [c for c in _METRIC_COLUMNS if any(_num(_metrics(r).get(c[0])) is not None for r in rows)]
    head = ["name", "pipeline", "provider", *[h for _, h, _ in present], "status"]
    out = [f'<table class="sortable configs" id="{_e(table_id)}"><thead><tr>']
    out += [f"<th>{_e(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        ok = _ok(row)
        cls = "failed" if not ok else ("frontier" if i in front_ids else "")
        tags = ""
        if row.get("baseline"):
            tags += ' <span class="tag base">baseline</span>'
        if i in front_ids:
            tags += ' <span class="tag front">frontier</span>'
        provider = row.get("provider") or row.get("backend") or ""
        out.append(f'<tr class="{cls}" data-name="{_e(row.get("name"))}">')
        out.append(f"<td>{_e(row.get('name'))}{tags}</td><td><code>{_e(_pipeline_text(row))}</code></td>"
                   f"<td>{_e(provider)}</td>")
        m = _metrics(row)
        out += [_cell_num(m.get(k), spec) for k, _, spec in present]
        status = "ok" if ok else f"failed: {row.get('error') or ''}"
        out.append(f"<td>{_e(status)}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _provenance_table(rows: Sequence[Mapping[str, Any]]) -> str:
    out = ['<table class="sortable provenance"><thead><tr>']
    out += [f"<th>{h}</th>" for h in ("name", "id", "time", "host", "options", "shapes", "calibration set",
                                       "evaluation set", "versions", "measured with")]
    out.append("</tr></thead><tbody>")
    for row in rows:
        versions = row.get("versions") if isinstance(row.get("versions"), dict) else {}
        vtext = ", ".join(f"{k} {v}" for k, v in versions.items() if v) if versions else ""
        opts, settings = row.get("options"), row.get("settings")
        out.append(
            f"<tr><td>{_e(row.get('name'))}</td><td>{_e(row.get('id'))}</td><td>{_e(row.get('time'))}</td>"
            f"<td>{_e(row.get('host'))}</td><td><code>{_e(_json_inline(opts) if opts else '')}</code></td>"
            f"<td><code>{_e(_json_inline(row.get('shapes')) if row.get('shapes') else '')}</code></td>"
            f"<td title=\"{_e(row.get('calib_hash'))}\">{_e(_short(row.get('calib_hash')))}</td>"
            f"<td title=\"{_e(row.get('eval_hash'))}\">{_e(_short(row.get('eval_hash')))}</td>"
            f"<td>{_e(vtext)}</td><td><code>{_e(_json_inline(settings) if settings else '')}</code></td></tr>"
        )
    out.append("</tbody></table>")
    return "".join(out)


def _stats_text(stats: Any) -> str:
    if not isinstance(stats, dict) or not stats:
        return ""
    return ", ".join(f"{k} {v}" for k, v in stats.items() if v not in (0, 0.0, None)) or "(all zero)"


def _passes_table(report: Any) -> str:
    entries = report.get("passes") if isinstance(report, dict) else report
    if not isinstance(entries, list) or not entries:
        return ""
    out = ['<h4>per-pass table</h4><table class="passes"><thead><tr><th>pass</th><th>changed</th>'
           '<th>nodes before</th><th>nodes after</th><th>seconds</th><th>stats</th></tr></thead><tbody>']
    for p in entries:
        if not isinstance(p, dict):
            continue
        changed = p.get("modified")
        out.append(
            f"<tr><td>{_e(p.get('name'))}</td><td>{'yes' if changed else 'no' if changed is not None else '-'}</td>"
            f"{_cell_num(p.get('nodes_before'), '.0f')}"
            f"{_cell_num(p.get('nodes_after'), '.0f')}{_cell_num(p.get('seconds'), '.3f')}"
            f"<td>{_e(_stats_text(p.get('stats')))}</td></tr>"
        )
    out.append("</tbody></table>")
    return "".join(out)


def _flat(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """Nested dicts as dotted keys (``budget.metric``); other values as they are."""
    if isinstance(value, dict) and value:
        return [item for k, v in value.items() for item in _flat(f"{prefix}.{k}" if prefix else str(k), v)]
    return [(prefix, value)]


def _settings_table(meta: dict[str, Any]) -> str:
    """A plan's settings and figures as a two-column table (a list of records as its own small table)."""
    out = ['<table class="plan-settings"><tbody>']
    for key, value in _flat("", meta):
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            cols = list(dict.fromkeys(k for v in value for k in v))
            inner = ("<table class=\"plan-list\"><thead><tr>" + "".join(f"<th>{_e(c)}</th>" for c in cols)
                     + "</tr></thead><tbody>"
                     + "".join("<tr>" + "".join(f"<td>{_e(_scalar(v.get(c)))}</td>" for c in cols) + "</tr>"
                               for v in value)
                     + "</tbody></table>")
            out.append(f"<tr><th>{_e(key)}</th><td>{inner}</td></tr>")
        else:
            out.append(f"<tr><th>{_e(key)}</th><td>{_e(_scalar(value))}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ", ".join(_scalar(v) for v in value)
    if isinstance(value, dict):
        return _json_inline(value)
    return str(value)


def _plan_html(plan: Any) -> str:
    plans = plan if isinstance(plan, list) else [plan]
    out = []
    for one in plans:
        if not isinstance(one, dict):
            continue
        nodes = [n for n in one.get("nodes", []) if isinstance(n, dict)]
        counts: dict[str, int] = {}
        for n in nodes:
            counts[str(n.get("precision"))] = counts.get(str(n.get("precision")), 0) + 1
        meta = {k: v for k, v in one.items() if k not in ("nodes", "pass")}
        out.append(f"<h4>precision plan{(' of ' + _e(one.get('pass'))) if one.get('pass') else ''}</h4>")
        out.append('<p class="meta">' + _e(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "no nodes"))
        out.append("</p>")
        if meta:
            out.append(_settings_table(meta))
        if nodes:
            out.append(f"<details class=\"plan-nodes\"><summary>every node ({len(nodes)})</summary>")
            out.append('<table class="sortable plan"><thead><tr><th>node</th><th>op</th><th>precision</th>'
                       "<th>reason</th></tr></thead><tbody>")
            for n in nodes:
                out.append(f"<tr><td><code>{_e(n.get('node'))}</code></td><td>{_e(n.get('op'))}</td>"
                           f"<td>{_e(n.get('precision'))}</td><td>{_e(n.get('reason'))}</td></tr>")
            out.append("</tbody></table></details>")
    return "".join(out)


def _profile_table(title: str, items: Any, columns: Sequence[tuple[str, str]]) -> str:
    if not isinstance(items, list) or not items:
        return ""
    out = [f'<h4>{_e(title)}</h4><table class="sortable profile"><thead><tr>']
    out += [f"<th>{_e(h)}</th>" for _, h in columns]
    out.append("</tr></thead><tbody>")
    for item in items:
        if not isinstance(item, dict):
            continue
        out.append("<tr>")
        for key, _ in columns:
            value = item.get(key)
            if key == "pct":
                v = _num(value)
                if v is None:
                    out.append('<td class="n">-</td>')
                else:
                    w = max(0.0, min(v, 100.0)) * 1.2
                    out.append(f'<td class="n" data-v="{v!r}"><span class="bar" style="width:{w:.0f}px"></span>'
                               f"{v:.1f}%</td>")
            elif key in ("ms", "count", "instances"):
                out.append(_cell_num(value, ".3f" if key == "ms" else ".0f"))
            else:
                out.append(f"<td>{_e(value)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _profile_html(profile: Any) -> str:
    if not isinstance(profile, dict) or not profile:
        return ""
    total = _num(profile.get("total_ms"))
    out = ["<h4>profile</h4>"]
    if total is not None:
        extra = f" on {_e(profile.get('provider'))}" if profile.get("provider") else ""
        out.append(f'<p class="meta">total {total:.3f} ms per run{extra}</p>')
    out.append(_profile_table("time by op type", profile.get("by_op_type"),
                              [("op_type", "op type"), ("ms", "ms"), ("pct", "share"), ("count", "nodes")]))
    out.append(_profile_table("top nodes", profile.get("top_nodes"),
                              [("name", "node"), ("op_type", "op type"), ("ms", "ms"), ("pct", "share"),
                               ("provider", "provider")]))
    out.append(_profile_table("GPU kernels", profile.get("kernels"), [("name", "kernel"), ("ms", "ms"),
                                                                       ("count", "launches")]))
    out.append(_profile_table("fusion candidates (time a fused op would replace)", profile.get("candidates"),
                              [("kind", "kind"), ("instances", "instances"), ("ms", "ms"), ("pct", "share")]))
    return "".join(out)


def _details_html(row: Mapping[str, Any]) -> str:
    body = _passes_table(row.get("report")) + _plan_html(row.get("plan")) + _profile_html(row.get("profile"))
    if not body:
        return ""
    return (f'<details class="config" open data-name="{_e(row.get("name"))}"><summary>{_e(row.get("name"))}'
            f' <span class="meta">{_e(_pipeline_text(row))}</span></summary>{body}</details>')


def _model_section(index: int, model_hash: str, rows: Sequence[Mapping[str, Any]], accuracy: str | None) -> str:
    y_key = accuracy_metric(rows, accuracy)
    front_ids = {p.index for p in frontier(rows, x="latency", accuracy=accuracy) if p.frontier}
    paths = sorted({str(r.get("model_path")) for r in rows if r.get("model_path")})
    out = [f'<section class="model" id="model-{index}"><h2>model {_e(_short(model_hash, 16))}</h2>']
    out.append(f'<p class="meta">{len(rows)} configuration(s); model file(s): {_e(", ".join(paths) or "-")}; '
               f"accuracy metric: {_e(y_key or 'none recorded')} (against the baseline on the evaluation set); "
               f"frontier: lowest latency for its accuracy.</p>")
    out.append("<h3>configurations</h3>")
    out.append(_config_table(rows, front_ids, f"configs-{index}"))
    out.append('<h3>Pareto plots</h3><div class="plots">')
    out.append(pareto_svg(rows, x="latency", accuracy=accuracy, element_id=f"pareto-latency-{index}"))
    out.append(pareto_svg(rows, x="size", accuracy=accuracy, element_id=f"pareto-size-{index}"))
    out.append("</div>")
    details = [d for d in (_details_html(r) for r in rows) if d]
    out.append("<h3>per configuration: passes, precision plan, profile</h3>")
    out.append("".join(details) if details else '<p class="meta">no row carries a per-pass table, plan or profile</p>')
    out.append("<h3>provenance</h3>")
    out.append(_provenance_table(rows))
    out.append("</section>")
    return "".join(out)


def render_html(
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str = "mograph report",
    source: str | None = None,
    accuracy: str | None = None,
) -> str:
    """The whole page for these ledger rows (one section per model), as one self-contained string."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    groups = group_rows(rows)
    body = [f"<h1>{_e(title)}</h1>",
            f'<p class="meta">{len(rows)} ledger row(s){" from " + _e(source) if source else ""}; '
            f"{len(groups)} model(s); generated {now}. Click a column heading to sort.</p>"]
    if not rows:
        body.append("<p>The ledger has no rows to show.</p>")
    for i, (model_hash, group) in enumerate(groups.items()):
        body.append(_model_section(i, model_hash, group, accuracy))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
            + "".join(body) + f"<script>{_JS}</script></body></html>\n")


# -- files -----------------------------------------------------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it, so no half-written file is left."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"cannot write {path}: folder {folder} does not exist; create it first")
    from mograph._paths import sweep_dead_saves

    sweep_dead_saves(folder)  # a killed save's leftovers in the folder this run writes into
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_report(rows: Sequence[Mapping[str, Any]], out: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write :func:`render_html` of ``rows`` to ``out`` (atomically) and return the path."""
    path = Path(out)
    _atomic_write(path, render_html(rows, **kwargs).encode("utf-8"))
    return path


def find_chromium() -> str | None:
    """The Chromium/Chrome binary to render with: ``MOGRAPH_CHROMIUM``, else the first one on PATH."""
    env = os.environ.get("MOGRAPH_CHROMIUM")
    if env:
        return env if (Path(env).exists() or shutil.which(env)) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium_command(binary: str, *args: str) -> list[str]:
    """A headless Chromium command line that works as root and in containers (no sandbox, no GPU)."""
    return [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", "--no-first-run", "--no-default-browser-check", "--mute-audio", *args]


def svg_to_png(svg: str, out: str | os.PathLike[str], *, width: int = 640, height: int = 420,
               scale: float = 1.0, timeout: float = 60.0) -> Path:
    """Render ``svg`` to a PNG at ``out`` with headless Chromium (same pixels as the page shows)."""
    binary = find_chromium()
    if binary is None:
        raise ChromiumNotFoundError(
            "a PNG plot needs Chromium or Chrome to render the SVG (apt-get install chromium, or set "
            "MOGRAPH_CHROMIUM to its path); write the plot as .svg to need nothing"
        )
    path = Path(out)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"cannot write {path}: folder {folder} does not exist; create it first")
    with tempfile.TemporaryDirectory(prefix="mograph-png-") as tmp:
        page = Path(tmp) / "plot.html"
        page.write_text("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><style>html,body{margin:0;padding:0;"
                        f"background:#fff;overflow:hidden}}svg{{display:block}}</style></head><body>{svg}</body></html>")
        shot = Path(tmp) / "plot.png"
        cmd = chromium_command(
            binary, f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}",
            f"--force-device-scale-factor={scale:g}", f"--screenshot={shot}", page.as_uri(),
        )
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise MographError(f"Chromium did not render the plot within {timeout:g} s") from exc
        if not shot.exists() or shot.stat().st_size == 0:
            last = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise MographError(f"Chromium wrote no PNG (exit {proc.returncode}): {last[0]}")
        _atomic_write(path, shot.read_bytes())
    return path


def write_plot(rows: Sequence[Mapping[str, Any]], out: str | os.PathLike[str], *, x: str = "latency",
               accuracy: str | None = None, title: str | None = None) -> Path:
    """Write one Pareto plot as ``.svg`` (no dependency) or ``.png`` (headless Chromium)."""
    path = Path(out)
    suffix = path.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise UsageError(f"--plot {path}: the plot is written as .svg or .png, not {suffix or 'no extension'}")
    width, height = 640, 420
    svg = pareto_svg(rows, x=x, accuracy=accuracy, title=title, width=width, height=height)
    if suffix == ".svg":
        _atomic_write(path, ('<?xml version="1.0" encoding="UTF-8"?>\n' + svg + "\n").encode("utf-8"))
        return path
    return svg_to_png(svg, path, width=width, height=height)
