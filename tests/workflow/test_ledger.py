"""The ledger: rows round-trip, one transaction per row, concurrent writers, the ``ledger`` command."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from mograph.cli import main
from mograph.errors import UsageError
from mograph.workflow.ledger import LedgerError, open_ledger


def _row(name: str, **kw) -> dict:
    row = {
        "name": name,
        "model_path": "m.onnx",
        "model_hash": "abc123",
        "pipeline": ["fuse-layernorm", "qdq-int8"],
        "options": {"qdq-int8": {"per_channel": True}},
        "provider": "CPUExecutionProvider",
        "backend": "ort",
        "shapes": {"input_ids": [1, 16]},
        "calib_hash": "c1",
        "eval_hash": "e1",
        "versions": {"mograph": "0.1.0", "onnx": "1.17"},
        "metrics": {"latency_p50_ms": 1.5, "latency_p99_ms": 2.5, "cosine_mean": 0.999, "size_bytes": 1000},
    }
    row.update(kw)
    return row


def test_round_trip(tmp_path):
    path = tmp_path / "l.db"
    with open_ledger(path) as ledger:
        a = ledger.add(_row("base", baseline=True, pipeline=[]))
        b = ledger.add(_row("int8", report=[{"pass": "qdq-int8", "seconds": 0.1}], plan={"n1": "int8"}))
        c = ledger.add(_row("other", model_hash="zzz", status="failed", error="pass 'x' failed: no"))
        assert (a, b, c) == (1, 2, 3)
    with open_ledger(f"sqlite:///{path}", readonly=True) as ledger:
        row = ledger.get("int8")
        assert row["id"] == 2 and row["pipeline"] == ["fuse-layernorm", "qdq-int8"]
        assert row["options"] == {"qdq-int8": {"per_channel": True}}
        assert row["metrics"]["cosine_mean"] == 0.999 and row["baseline"] is False and row["status"] == "ok"
        assert row["report"] == [{"pass": "qdq-int8", "seconds": 0.1}] and row["plan"] == {"n1": "int8"}
        assert row["time"].endswith("+00:00") and row["host"]
        assert ledger.get(1)["baseline"] is True and ledger.get("1")["name"] == "base"
        assert [r["name"] for r in ledger.rows(model_hash="abc123")] == ["base", "int8"]
        assert [r["id"] for r in ledger.rows(names=["other", "base"])] == [1, 3]
        assert ledger.rows(names=[]) == []
        assert ledger.baseline("abc123")["name"] == "base"
        assert ledger.baseline("zzz") is None
        assert ledger.get("other")["error"] == "pass 'x' failed: no"
        with pytest.raises(LedgerError, match="no row 'nope'.*names: base, int8, other"):
            ledger.get("nope")
        with pytest.raises(LedgerError, match="read-only"):
            ledger.add(_row("x"))


def test_refusals(tmp_path):
    with pytest.raises(UsageError, match="only SQLite ledgers"):
        open_ledger("postgresql://host/db")
    with pytest.raises(LedgerError, match="three slashes"):
        open_ledger("sqlite://l.db")
    with pytest.raises(LedgerError, match="does not exist"):
        open_ledger(tmp_path / "missing" / "l.db")
    with pytest.raises(LedgerError, match="does not exist"):
        open_ledger(tmp_path / "l.db", readonly=True)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(LedgerError, match="not a SQLite database"):
        open_ledger(junk)
    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    with pytest.raises(LedgerError, match="not a mograph ledger"):
        open_ledger(other)
    with open_ledger(tmp_path / "l.db") as ledger:
        with pytest.raises(LedgerError, match="unknown ledger field.*latency"):
            ledger.add({"name": "x", "latency": 1})
        with pytest.raises(LedgerError, match="needs a name"):
            ledger.add({"metrics": {}})
        with pytest.raises(LedgerError, match="status"):
            ledger.add({"name": "x", "status": "maybe"})
        assert len(ledger) == 0  # nothing half-written by the refusals


_WRITER = """
import sys, time
from mograph.workflow.ledger import open_ledger
path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open_ledger(path) as ledger:
    for i in range(n):
        ledger.add({"name": f"{tag}-{i}", "metrics": {"i": i, "blob": "x" * 2000}, "pipeline": [tag] * 3})
        print(i, flush=True)
        if n > 1000:
            time.sleep(0.01)
"""


def _writer(path, tag: str, n: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), tag, str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_two_processes_write_one_ledger(tmp_path):
    path = tmp_path / "l.db"
    procs = [_writer(path, tag, 60) for tag in ("a", "b")]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with open_ledger(path, readonly=True) as ledger:
        rows = ledger.rows()
        assert len(rows) == 120 and len({r["id"] for r in rows}) == 120
        for tag in ("a", "b"):
            mine = [r for r in rows if r["name"].startswith(tag + "-")]
            assert [r["metrics"]["i"] for r in mine] == list(range(60))  # each writer's order kept
            assert all(r["pipeline"] == [tag] * 3 for r in mine)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_killed_writer_keeps_finished_rows(tmp_path):
    path = tmp_path / "l.db"
    proc = _writer(path, "k", 100000)  # runs until killed
    assert proc.stdout is not None
    done = -1
    deadline = time.monotonic() + 60
    while done < 20 and time.monotonic() < deadline:
        done = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with open_ledger(path) as ledger:  # opening for writing recovers the WAL
        rows = ledger.rows()
        # Every row the writer reported finished is there and whole; at most one more (committed before
        # the kill, not yet printed); nothing half-written.
        assert done + 1 <= len(rows) <= done + 2
        assert [r["metrics"]["i"] for r in rows] == list(range(len(rows)))
        assert all(r["metrics"]["blob"] == "x" * 2000 for r in rows)
        ledger.add({"name": "after"})
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def _ledger_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["ledger", *map(str, args)])
    return code, capsys.readouterr().out


def test_ledger_command(tmp_path, capsys):
    path = tmp_path / "l.db"
    with open_ledger(path) as ledger:
        ledger.add(_row("baseline", baseline=True, pipeline=[]))
        ledger.add(_row("int8", metrics={"latency_p50_ms": 0.75, "cosine_mean": 0.99, "size_bytes": 250}))
        ledger.add(_row("broken", status="failed", error="pass 'qdq-int8' failed: x"))
    code, out = _ledger_cli(capsys, "list", "--ledger", path)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["id", "name", "status"] and "p50" in lines[0]
    assert lines[1].split()[:4] == ["1", "baseline", "base", "1.500"]
    assert lines[2].split()[:4] == ["2", "int8", "ok", "0.750"] and len(lines) == 3
    code, out = _ledger_cli(capsys, "list", "--ledger", path, "--failed")
    assert "broken" in out and "pass 'qdq-int8' failed" in out
    code, out = _ledger_cli(capsys, "list", "--ledger", path, "--model-hash", "zz", "--json")
    assert json.loads(out)["rows"] == []
    code, out = _ledger_cli(capsys, "show", "int8", "--ledger", path, "--json")
    assert json.loads(out)["metrics"]["latency_p50_ms"] == 0.75
    code, out = _ledger_cli(capsys, "show", "int8", "--ledger", path)  # a table, not JSON, without --json
    assert code == 0 and not out.lstrip().startswith("{")
    assert out.splitlines()[0] == "row" and "metrics" in out.splitlines()
    assert next(line for line in out.splitlines() if line.strip().startswith("p50 ms")).split()[-1] == "0.750"
    assert next(line for line in out.splitlines() if line.strip().startswith("pipeline")).split()[-1] == (
        "fuse-layernorm,qdq-int8")
    code, out = _ledger_cli(capsys, "compare", "baseline", "int8", "--ledger", path)
    assert code == 0
    assert "size_bytes" not in out  # the figures are megabytes: labelled so
    p50 = next(line for line in out.splitlines() if line.startswith("latency_p50_ms"))
    assert "(x0.50)" in p50  # 0.75 / 1.5
    cos = next(line for line in out.splitlines() if line.startswith("cosine_mean"))
    assert "(-0.009)" in cos
    dest = tmp_path / "out.csv"
    code, out = _ledger_cli(capsys, "export", "--ledger", path, "--csv", dest)
    assert code == 0 and "wrote 3 rows" in out
    table = list(csv.DictReader(io.StringIO(dest.read_text())))
    assert [r["name"] for r in table] == ["baseline", "int8", "broken"]
    assert table[1]["metric.latency_p50_ms"] == "0.75" and table[1]["pipeline"] == "fuse-layernorm,qdq-int8"
    assert table[2]["status"] == "failed"
    code = main(["ledger", "show", "nope", "--ledger", str(path)])
    assert code == 2 and "no row 'nope'" in capsys.readouterr().err
    code = main(["ledger", "list", "--ledger", str(tmp_path / "none.db")])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    code = main(["ledger", "list", "--ledger", "mysql://x/y"])
    assert code == 2 and "only SQLite ledgers" in capsys.readouterr().err


def test_csv_export_escapes_formulas_and_keeps_numbers(tmp_path, capsys):
    """Issue 27: text cells beginning with =, +, -, @ (or a tab / CR) are written with a leading ' so a
    spreadsheet shows them as text; numbers, negative ones included, stay numbers."""
    path = tmp_path / "l.db"
    with open_ledger(path) as ledger:
        ledger.add(_row("=HYPERLINK(\"http://x\",\"y\")", metrics={"delta": -0.5, "count": -3, "=evil": 1.0}))
        ledger.add(_row("@SUM(A1)", status="failed", error="-cmd|' /C calc'!A0"))
        ledger.add(_row("+1+2", metrics={"note": "-2.5", "tab": "\tx"}))
        ledger.add(_row("plain-name", metrics={"delta": 0.25}))
    dest = tmp_path / "out.csv"
    code, _ = _ledger_cli(capsys, "export", "--ledger", path, "--csv", dest)
    assert code == 0
    text = dest.read_text()
    table = list(csv.DictReader(io.StringIO(text)))
    assert [r["name"] for r in table] == ["'=HYPERLINK(\"http://x\",\"y\")", "'@SUM(A1)", "'+1+2", "plain-name"]
    assert table[1]["error"] == "'-cmd|' /C calc'!A0"
    assert table[0]["metric.delta"] == "-0.5" and table[0]["metric.count"] == "-3"  # numbers stay numbers
    assert table[2]["metric.note"] == "-2.5"  # text that is a number is no formula
    assert table[2]["metric.tab"] == "'\tx"
    assert "metric.=evil" in table[0]  # a header cell starting with 'metric.' is safe as it is
    for row in table:
        for cell in row.values():
            assert (cell or " ")[0] not in "=+@" and not (cell.startswith("-") and not _number(cell)), row


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_opening_waits_out_a_journal_mode_lock(tmp_path, monkeypatch):
    """SQLite answers a journal-mode change that meets another process's lock with "database is locked" at once
    (no busy handler): opening retries it, a lasting lock is worded as a lock (not "not a SQLite database"), and
    other errors are not retried."""
    from mograph.workflow import ledger as L

    class Flaky:
        def __init__(self, fails: int, message: str = "database is locked") -> None:
            self.fails, self.message, self.calls = fails, message, 0

        def execute(self, sql: str) -> None:
            assert sql == "PRAGMA journal_mode = WAL"
            self.calls += 1
            if self.calls <= self.fails:
                raise sqlite3.OperationalError(self.message)

    db = Flaky(3)
    L._write_ahead_log(db)  # type: ignore[arg-type]
    assert db.calls == 4
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        L._write_ahead_log(Flaky(1, "disk I/O error"))  # type: ignore[arg-type]
    monkeypatch.setattr(L, "_LOCK_WAIT_S", 0.05)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        L._write_ahead_log(Flaky(10**6))  # type: ignore[arg-type]

    def locked(db: object) -> None:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(L, "_write_ahead_log", locked)
    with pytest.raises(L.LedgerError, match="stayed locked by another process"):
        open_ledger(tmp_path / "l.db")
