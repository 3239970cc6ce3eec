"""A ledger is data, never code (issue 30, R3).

Ledgers travel between machines and CI jobs.  A row's ``settings`` name the evaluation set and the task
metric, which may be code (``file.py:function``).  ``mograph gate`` used to import and run that code from
the ledger: a crafted ledger ran the attacker's file, and with the task metric it also passed the gate
(exit 0).  Now ``gate`` and ``report`` never import code a ledger names: code runs only when the user
names it on the command line (``gate --task-metric`` / ``--eval-data``), recorded rows hold its name and
hash, and a row that needs code the command line did not name is refused (exit 2), never passed silently.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mograph.cli import main
from mograph.workflow.ledger import open_ledger

sys.path.insert(0, str(Path(__file__).parent))
from test_sweep import small_model, write  # noqa: E402

METRIC = textwrap.dedent("""
    import numpy as np
    def score(outputs, samples, reference):
        return float(np.mean([np.allclose(o["z"], r["z"], atol=1e-3) for o, r in zip(outputs, reference)]))
""")


def _evil(folder: Path) -> Path:
    """A file whose import leaves a marker; its functions return a perfect score and no samples."""
    marker = folder / "PWNED"
    (folder / "evil.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        Path({str(marker)!r}).write_text("ran")
        def score(outputs, samples, reference=None):
            return 1.0
        def samples():
            return []
    """))
    return marker


@pytest.fixture()
def swept(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    small_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "eval.npz", x=np.random.default_rng(3).standard_normal((4, 1, 8)).astype(np.float32))
    (tmp_path / "mymetric.py").write_text(METRIC)
    write(tmp_path / "s.yaml", """
        eval_data: eval.npz
        task_metric: mymetric.py:score
        warmup: 1
        iterations: 5
        configurations:
          - {name: clean, passes: [cleanup]}
    """)
    (tmp_path / "kept").mkdir()
    code = main(["sweep", "m.onnx", "--config", "s.yaml", "--ledger", "l.db", "-q", "--keep-models", "kept"])
    assert code == 0
    return tmp_path


def _settings(db: Path, **changes: object) -> None:
    """Rewrite every row's settings the way an attacker would edit a shared ledger."""
    con = sqlite3.connect(db)
    for rowid, text in con.execute("SELECT id, settings FROM runs").fetchall():
        settings = json.loads(text)
        settings.update(changes)
        con.execute("UPDATE runs SET settings = ? WHERE id = ?", (json.dumps(settings), rowid))
    con.commit()
    con.close()


def _gate(capsys, *args: object) -> tuple[int, str, str]:
    code = main(["gate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_sweep_records_code_by_name_and_hash(swept):
    import hashlib

    with open_ledger(swept / "l.db", readonly=True) as ledger:
        settings = ledger.get("clean")["settings"]
    assert settings["task_metric"].endswith("mymetric.py:score")
    assert settings["task_metric_hash"] == hashlib.sha256((swept / "mymetric.py").read_bytes()).hexdigest()
    assert settings["eval_data_hash"] is None  # a .npz is data, not code


def test_gate_never_runs_a_task_metric_named_in_the_ledger(swept, capsys):
    marker = _evil(swept)
    _settings(swept / "l.db", task_metric=str(swept / "evil.py") + ":score", task_metric_hash=None)
    code, _, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "l.db",
                         "--max-latency-increase", "1000%")
    assert code == 2, err  # was 0: evil.py ran and its score passed the gate
    assert "never runs code named in a ledger" in err and "--task-metric" in err and err.count("\n") == 1
    assert not marker.exists()


def test_gate_never_runs_an_eval_set_named_in_the_ledger(swept, capsys):
    marker = _evil(swept)
    _settings(swept / "l.db", eval_data=str(swept / "evil.py") + ":samples")
    code, _, err = _gate(capsys, swept / "kept" / "clean.onnx", "--ledger", swept / "l.db",
                         "--task-metric", "mymetric.py:score", "--max-latency-increase", "1000%")
    assert code == 2, err  # was 2 too, but only after evil.py had run
    assert "never runs code named in a ledger" in err and "--eval-data" in err
    assert not marker.exists()


def test_report_never_runs_code_named_in_the_ledger(swept, capsys):
    marker = _evil(swept)
    _settings(swept / "l.db", task_metric=str(swept / "evil.py") + ":score", eval_data=str(swept / "evil.py") + ":samples")
    assert main(["report", "--ledger", str(swept / "l.db"), "-o", str(swept / "r.html"), "-q"]) == 0
    assert main(["ledger", "show", "clean", "--ledger", str(swept / "l.db"), "-q"]) == 0
    assert not marker.exists() and (swept / "r.html").exists()


def test_gate_runs_the_task_metric_the_user_names_and_checks_its_hash(swept, capsys):
    cand = swept / "kept" / "clean.onnx"
    code, _, err = _gate(capsys, cand, "--ledger", swept / "l.db", "--max-latency-increase", "1000%")
    assert code == 2 and "--task-metric" in err  # the row has a task metric: never gated silently on another one
    code, out, err = _gate(capsys, cand, "--ledger", swept / "l.db", "--max-latency-increase", "1000%",
                           "--task-metric", "mymetric.py:score", "--json")
    assert code == 0, err
    assert json.loads(out)["accuracy_metric"] == "task_metric"
    (swept / "mymetric.py").write_text(METRIC + "\n# edited\n")
    code, _, err = _gate(capsys, cand, "--ledger", swept / "l.db", "--max-latency-increase", "1000%",
                         "--task-metric", "mymetric.py:score")
    assert code == 2 and "its source differs" in err, err


def test_gate_help_says_the_options_run_code(capsys):
    with pytest.raises(SystemExit):
        main(["gate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--task-metric" in text and "imports and runs this code" in text
