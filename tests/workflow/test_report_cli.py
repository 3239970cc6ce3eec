"""``mograph report``: from a real ledger file to the HTML page and the plot files; its refusals."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess

import pytest
from _report_rows import chromium, near, pixels, sweep_rows

from mograph.cli import main
from mograph.workflow import report as rep
from mograph.workflow.ledger import open_ledger


@pytest.fixture
def ledger(tmp_path):
    path = tmp_path / "sweep.db"
    with open_ledger(path) as led:
        for row in sweep_rows():
            led.add({k: v for k, v in row.items() if k != "id"})
    return path


def test_report_from_ledger(ledger, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", "--ledger", str(ledger), "-o", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"] == 6 and data["accuracy"] == "cosine_mean" and data["output"] == str(out)
    assert data["frontier"] == {"a1b2c3d4e5f6": ["int8", "fp16", "fuse", "baseline"]}
    page = out.read_text()
    assert re.search(r'id="pareto-latency-0"[^>]*data-points="5" data-frontier="4"', page)
    assert page.count('<tr class="') == 6 and "fuse-layernorm" in page and "default rule: final projection" in page
    assert f"from {ledger}" in page


def test_report_plot_only_and_filters(ledger, tmp_path, capsys):
    svg = tmp_path / "p.svg"
    assert main(["report", "--ledger", f"sqlite:///{ledger}", "--plot", str(svg), "--plot-x", "size",
                 "--name", "int8", "--name", "int8-slow", "--name", "baseline"]) == 0
    text = capsys.readouterr().out
    assert "wrote" in text and "report.html" not in text  # --plot alone writes no page
    body = svg.read_text()
    assert 'data-points="3" data-frontier="2"' in body and "size on disk" in body
    assert not (tmp_path / "report.html").exists()


def test_report_refusals(ledger, tmp_path, capsys, monkeypatch):
    missing = tmp_path / "none.db"
    assert main(["report", "--ledger", str(missing), "-o", str(tmp_path / "r.html")]) == 2
    assert not missing.exists()  # a report never creates a ledger
    assert main(["report", "--ledger", str(ledger), "-o", str(tmp_path / "no" / "r.html")]) == 2
    assert main(["report", "--ledger", str(ledger), "--plot", str(tmp_path / "p.gif")]) == 2
    assert main(["report", "--ledger", str(ledger), "-o", str(tmp_path / "r.html"), "--model-hash", "zz"]) == 2
    assert main(["report", "--ledger", str(ledger), "-o", str(tmp_path / "r.html"), "--name", "nope"]) == 2
    assert main(["report", "--ledger", str(ledger), "-o", str(tmp_path / "r.html"), "--accuracy", "f1"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "f1" in err and "no rows" in err
    monkeypatch.setenv("MOGRAPH_CHROMIUM", str(tmp_path / "no-chromium"))
    assert main(["report", "--ledger", str(ledger), "--plot", str(tmp_path / "p.png")]) == 7
    assert "apt-get install chromium" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_plot_of_two_models_needs_model_hash(ledger, tmp_path, capsys):
    with open_ledger(ledger) as led:
        led.add({"name": "other", "model_hash": "ffff0000", "baseline": True, "metrics": {"latency_p50_ms": 3.0}})
    assert main(["report", "--ledger", str(ledger), "--plot", str(tmp_path / "p.svg")]) == 2
    assert "--model-hash" in capsys.readouterr().err
    assert main(["report", "--ledger", str(ledger), "--plot", str(tmp_path / "p.svg"), "--model-hash", "a1b2"]) == 0
    assert main(["report", "--ledger", str(ledger), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert 'id="model-1"' in page


def test_not_a_ledger(tmp_path):
    bad = tmp_path / "bad.db"
    sqlite3.connect(bad).execute("CREATE TABLE t (x)").connection.commit()
    assert main(["report", "--ledger", str(bad), "-o", str(tmp_path / "r.html")]) == 2


@pytest.mark.slow
def test_report_of_a_real_sweep(tmp_path, capsys):
    """The shipped bert-tiny sweep (five configurations and the baseline, measured) drawn as a report."""
    pytest.importorskip("onnxruntime")
    db = tmp_path / "sweep.db"
    assert main(["sweep", "--example", "bert-tiny", "--ledger", str(db), "-q"]) == 0
    out, svg = tmp_path / "report.html", tmp_path / "pareto.svg"
    assert main(["report", "--ledger", str(db), "-o", str(out), "--plot", str(svg), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"] == 6 and len(data["models"]) == 1
    page = out.read_text()
    # every configuration measured is a point; the per-pass tables and the fp16 / int8 plans are there
    assert re.search(r'id="pareto-latency-0"[^>]*data-points="6"', page)
    for name in ("baseline", "fused", "fp16", "int8", "int8-budget", "pruned"):
        assert f'data-name="{name}"' in page
    assert "fuse-attention" in page and "precision plan of fp16" in page and "precision plan of qdq-int8" in page
    front = data["frontier"][data["models"][0]]
    assert front and 'data-points="6"' in svg.read_text()
    if rep.find_chromium() is None and not os.environ.get("MOGRAPH_REQUIRE_CHROMIUM"):
        return
    shot = tmp_path / "shot.png"
    cmd = rep.chromium_command(chromium(), f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000",
                               f"--screenshot={shot}", out.as_uri())
    subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    px = pixels(shot.read_bytes())
    assert (px > 245).all(axis=-1).mean() < 0.97
    assert near(px, rep._FRONT).sum() > 100 and near(px, rep._BASE).sum() > 50  # the plots' frontier and baseline
