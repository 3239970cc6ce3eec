"""``mograph.workflow.report``: the Pareto frontier, the self-contained page, the plot files, and the
page as headless Chromium renders it (its DOM and its pixels)."""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from _report_rows import chromium as _chromium
from _report_rows import near as _near
from _report_rows import pixels as _pixels
from _report_rows import sweep_rows

from mograph.errors import UsageError
from mograph.workflow import report as rep

_rows = sweep_rows

SVG_NS = "{http://www.w3.org/2000/svg}"


# -- the frontier -----------------------------------------------------------------------------------------


def test_pareto_front_exact():
    pts = [(4.0, 0.995), (6.0, 0.9995), (7.0, 0.99999), (8.0, 0.99), (10.0, 1.0), (6.0, 0.9995), (5.0, 0.99)]
    # (8, .99) is beaten by (4, .995); (5, .99) too; the duplicated (6, .9995) points do not beat each other
    assert rep.pareto_front(pts) == [True, True, True, False, True, True, False]
    # lower-is-better accuracy (max-abs): now the smallest y wins
    assert rep.pareto_front([(1.0, 0.5), (2.0, 0.1), (3.0, 0.3)], higher_is_better=False) == [True, True, False]
    assert rep.pareto_front([]) == []


def test_frontier_of_rows_and_baseline_reference():
    points = {p.name: p for p in rep.frontier(_rows())}
    assert set(points) == {"baseline", "fuse", "fp16", "int8", "int8-slow"}  # failed row not plotted
    assert {n for n, p in points.items() if p.frontier} == {"baseline", "fuse", "fp16", "int8"}
    base = points["baseline"]
    assert base.implied and base.y == 1.0  # the reference: cosine 1 by definition, and said so
    # by size: fuse (40 MB, 0.99999) loses to the baseline (40 MB, 1.0); int8-slow (10 MB, .99) to int8
    by_size = {p.name: p.frontier for p in rep.frontier(_rows(), x="size")}
    assert by_size == {"baseline": True, "fuse": False, "fp16": True, "int8": True, "int8-slow": False}
    # max-abs is lower-is-better; only "fuse" has it, and the baseline's implied value is 0
    assert {p.name for p in rep.frontier(_rows(), accuracy="max_abs")} == {"baseline", "fuse"}


def test_accuracy_metric_choice():
    rows = _rows()
    assert rep.accuracy_metric(rows) == "cosine_mean"
    only_top1 = [{"name": "a", "metrics": {"latency_p50_ms": 1, "top1_agreement": 0.9}}]
    assert rep.accuracy_metric(only_top1) == "top1_agreement"
    assert rep.accuracy_metric([{"name": "a", "metrics": {"latency_p50_ms": 1}}]) is None
    with pytest.raises(UsageError, match="choose from"):
        rep.accuracy_metric(rows, "f1")


# -- the page and the plot, as text ---------------------------------------------------------------------


def _external_refs(page: str) -> list[str]:
    """Everything in the page that a browser would fetch: src/href attributes, CSS url(), @import."""
    refs = re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"' >]+)""", page)
    refs += re.findall(r"url\(([^)]*)\)", page) + re.findall(r"@import[^;]*", page)
    return refs


def test_page_is_self_contained_and_complete():
    page = rep.render_html(_rows(), source="sweep.db")
    assert _external_refs(page) == []
    assert "<link" not in page and "<img" not in page
    # the only URL is the SVG namespace (an identifier, never fetched)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}
    for name in ("baseline", "fuse", "fp16", "int8", "int8-slow", "broken"):
        assert f'data-name="{name}"' in page
    assert "no prunable layer" in page  # the failed row is listed with its error
    # plots: 5 points each, frontier of 4 by latency and 3 by size
    assert re.search(r'id="pareto-latency-0"[^>]*data-points="5" data-frontier="4"', page)
    assert re.search(r'id="pareto-size-0"[^>]*data-points="5" data-frontier="3"', page)
    # the per-pass table, the plan and the profile of the rows that carry them
    assert "fuse-layernorm" in page and "layernorm 4" in page
    assert "default rule: final projection" in page and "fp32: 1, int8: 1" in page
    assert "ampere_sgemm_128x64" in page and "57.1%" in page and "gelu" in page


def test_page_escapes_and_tolerates_sparse_rows():
    rows = [
        {"name": "<script>alert(1)</script>", "metrics": {"latency_p50_ms": 2.0, "cosine_mean": 0.9}},
        {"name": "bare"},
        {"name": "odd", "metrics": {"latency_p50_ms": "n/a", "cosine_mean": float("nan")}, "pipeline": "fuse",
         "report": {"passes": [{"name": "p"}]}, "plan": [{"nodes": [{"node": "n", "precision": "fp16"}]}, "junk"],
         "profile": {"by_op_type": "junk", "top_nodes": [None, {"name": "x"}]}},
    ]
    page = rep.render_html(rows)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert re.search(r'id="pareto-latency-0"[^>]*data-points="1" data-frontier="1"', page)
    svg = rep.pareto_svg([{"name": "bare"}])
    assert "nothing to plot" in svg
    assert "no rows" in rep.render_html([])


def test_rows_of_two_models_get_two_sections():
    other = [{**r, "model_hash": "ffff0000", "name": r["name"] + "-b"} for r in _rows()[:3]]
    page = rep.render_html(_rows() + other)
    assert 'id="model-0"' in page and 'id="model-1"' in page and 'id="model-2"' not in page
    assert re.search(r'id="pareto-latency-1"[^>]*data-points="3"', page)


def test_plot_svg_file(tmp_path):
    out = rep.write_plot(_rows(), tmp_path / "plot.svg")
    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG_NS}svg"
    circles = root.findall(f".//{SVG_NS}circle[@class]")
    classes = sorted(c.get("class") for c in circles)
    assert classes == ["point", "point frontier-point", "point frontier-point", "point frontier-point"]
    assert len(root.findall(f".//{SVG_NS}rect[@class='point frontier-point baseline']")) == 1
    assert len(root.findall(f".//{SVG_NS}path[@class='frontier']")) == 1
    with pytest.raises(UsageError, match=r"\.svg or \.png"):
        rep.write_plot(_rows(), tmp_path / "plot.jpg")


def test_png_without_chromium_is_exit_7(tmp_path, monkeypatch):
    monkeypatch.setenv("MOGRAPH_CHROMIUM", str(tmp_path / "no-such-chromium"))
    with pytest.raises(rep.ChromiumNotFoundError, match="apt-get install chromium") as info:
        rep.write_plot(_rows(), tmp_path / "plot.png")
    assert info.value.exit_code == 7
    assert not (tmp_path / "plot.png").exists()


# -- rendered by headless Chromium ---------------------------------------------------------------------


@pytest.mark.slow
def test_chromium_dom_has_plot_and_table(tmp_path):
    binary = _chromium()
    page = rep.write_report(_rows(), tmp_path / "report.html")
    cmd = rep.chromium_command(binary, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri())
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    # parsed by a browser: the SVG elements are real (lower-cased, closed), the table rows are there
    plot = re.search(r'<svg[^>]*id="pareto-latency-0".*?</svg>', dom, re.S)
    assert plot is not None
    svg = plot.group(0)
    assert svg.count('class="point frontier-point"') == 3 and svg.count('class="point frontier-point baseline"') == 1
    assert svg.count('class="point"') == 1 and svg.count('class="frontier"') == 1
    body = re.search(r'<table class="sortable configs" id="configs-0">.*?</table>', dom, re.S)
    assert body is not None
    assert len(re.findall(r"<tr class=", body.group(0))) == 6


@pytest.mark.slow
def test_chromium_screenshot_shows_plot_and_table(tmp_path):
    binary = _chromium()
    page = rep.write_report(_rows(), tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    cmd = rep.chromium_command(binary, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000",
                               f"--screenshot={shot}", page.as_uri())
    subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    px = _pixels(shot.read_bytes())
    assert px.shape == (1000, 1400, 3)
    white = (px > 245).all(axis=-1)
    assert white.mean() < 0.97, "the page rendered (almost) blank"
    # the frontier's red and the baseline's green are drawn (only the plot uses them)
    assert _near(px, rep._FRONT).sum() > 200
    assert _near(px, rep._BASE).sum() > 50
    # the table's header background (#f2f2f2) fills a band near the top of the page
    assert _near(px, "#f2f2f2", 6)[:400].sum() > 5000


@pytest.mark.slow
def test_png_plot_is_the_svg_rendered(tmp_path):
    _chromium()
    out = rep.write_plot(_rows(), tmp_path / "plot.png")
    px = _pixels(Path(out).read_bytes())
    assert px.shape == (420, 640, 3)
    assert (px > 245).all(axis=-1).mean() < 0.95
    red = _near(px, rep._FRONT)
    assert red.sum() > 200
    # the frontier points sit left of (faster than) the dominated one: red pixels span most of the width
    cols = np.nonzero(red.any(axis=0))[0]
    assert cols.max() - cols.min() > 300


def test_pareto_labels_never_overlap_when_points_crowd():
    """Close points get labels at free places around them; where none is free the name goes to a note."""
    rows = [{"name": f"config-{i:02d}", "status": "ok",
             "metrics": {"latency_p50_ms": 1.0 + 0.001 * (i % 20), "cosine_mean": 0.999 - 0.00001 * (i % 20)}}
            for i in range(60)]  # 60 points on 20 spots: more names than free places near them
    svg = rep.pareto_svg(rows)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    labels = [t for t in root.iter(f"{ns}text") if (t.text or "").startswith("config-")]
    boxes = []
    for t in labels:
        x, y, w = float(t.get("x")), float(t.get("y")), 6.6 * len(t.text)
        x0 = x - w if t.get("text-anchor") == "end" else x
        boxes.append((x0, y - 10, x0 + w, y + 3))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)
    note = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "unlabelled"]
    named = {t.text for t in labels} | {n for text in note for n in text.split(": ", 1)[1].split(", ")}
    assert named == {r["name"] for r in rows}  # every point is named once: beside it or in the note
    assert labels and note


def test_precision_plan_settings_are_a_table_not_json():
    plan = [{"pass": "qdq-int8", "budget": {"metric": "cosine", "min": 0.992}, "kept_float": 2,
             "layers": [{"node": "a", "error": 0.01}, {"node": "b", "error": 0.02}],
             "nodes": [{"node": "a", "op": "MatMul", "precision": "int8", "reason": "r"}]}]
    html_text = rep._plan_html(plan)
    assert '<table class="plan-settings">' in html_text and "<th>budget.metric</th><td>cosine</td>" in html_text
    assert "<th>kept_float</th><td>2</td>" in html_text and '<table class="plan-list">' in html_text
    assert "{&quot;" not in html_text and '{"' not in html_text
