"""The ledger: every measured configuration, with what produced it.

A ledger row is one measured model (a sweep configuration, the unoptimized baseline, or a gated
candidate): the model hash, the pass pipeline and its options, the provider/backend and shapes, the
hashes of the calibration and evaluation sets, the versions of mograph / onnx / onnxruntime /
TensorRT, host and time, and every metric (latency percentiles, throughput, peak memory, size on
disk, accuracy against the baseline, a user task metric).  The point is to never repeat an old
experiment blind: ``mograph ledger list | show | compare | export --csv`` query it, ``mograph report``
draws it, ``mograph gate`` compares a new candidate with it.

Storage is a SQLite database file (the standard library's :mod:`sqlite3`), chosen by a plain path or a
``sqlite:///path`` URL; nothing else is accepted (a different URL scheme is refused with a
:class:`~mograph.errors.UsageError`).  Structured fields are stored as JSON text in one table, so the
schema never needs a migration when a metric is added.

Besides the fields above, ``settings`` holds how the row was measured (evaluation and calibration data
as given, sample counts, seed, warm-up and timed runs, threads, the built model's own hash): what
``mograph gate`` needs to measure a candidate the same way.

Writes are transactional: the database runs in WAL mode, each :meth:`Ledger.add` is one
``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction, so a sweep killed half-way keeps every row it finished
and none half-written, and several processes can write the same ledger at once (SQLite serialises the
writers; a ``busy_timeout`` makes a writer wait rather than fail).
"""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mograph._paths import check_io, sweep_dead_saves
from mograph.errors import UsageError

__all__ = [
    "Ledger",
    "LedgerError",
    "open_ledger",
    "ROW_FIELDS",
    "METRIC_KEYS",
    "DEFAULT_LEDGER",
    "LEDGER_HELP",
    "flatten_row",
    "rows_to_csv",
    "csv_cell",
    "now_iso",
    "ledger_paths",
]

#: Where a ledger lives when no ``--ledger`` is given.
DEFAULT_LEDGER = "mograph-ledger.db"

#: One line for ``--help``: what ``--ledger`` accepts.
LEDGER_HELP = (
    f"ledger database: a file path or sqlite:///PATH (SQLite; default {DEFAULT_LEDGER}); "
    "no other URL scheme is accepted"
)

#: The keys of a row, in display order.  JSON-valued ones are marked in :data:`_JSON_FIELDS`.
ROW_FIELDS: tuple[str, ...] = (
    "id", "name", "time", "host", "model_path", "model_hash", "pipeline", "options", "provider", "backend",
    "shapes", "calib_hash", "eval_hash", "versions", "metrics", "report", "plan", "profile", "baseline",
    "status", "error", "settings",
)

_JSON_FIELDS = {"pipeline", "options", "shapes", "versions", "metrics", "report", "plan", "profile", "settings"}
_TEXT_FIELDS = {"name", "time", "host", "model_path", "model_hash", "provider", "backend", "calib_hash",
                "eval_hash", "status", "error"}

#: Metrics a row may carry (others are kept too; these are the ones the tools know how to show).
METRIC_KEYS: tuple[str, ...] = (
    "latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "throughput", "peak_mem_mb", "size_bytes",
    "cosine_mean", "cosine_min", "max_abs", "top1_agreement", "task_metric",
)

_SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    time TEXT NOT NULL,
    host TEXT,
    model_path TEXT,
    model_hash TEXT,
    pipeline TEXT NOT NULL DEFAULT '[]',
    options TEXT NOT NULL DEFAULT '{}',
    provider TEXT,
    backend TEXT,
    shapes TEXT,
    calib_hash TEXT,
    eval_hash TEXT,
    versions TEXT NOT NULL DEFAULT '{}',
    metrics TEXT NOT NULL DEFAULT '{}',
    report TEXT,
    plan TEXT,
    profile TEXT,
    baseline INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL DEFAULT 'ok' CHECK (status IN ('ok', 'failed')),
    error TEXT,
    settings TEXT
);
CREATE INDEX IF NOT EXISTS runs_model_hash ON runs (model_hash);
CREATE INDEX IF NOT EXISTS runs_name ON runs (name);
"""


class LedgerError(UsageError):
    """The ledger cannot be opened, is not a mograph ledger, or a row asked for is not there (exit 2)."""


def _resolve(path_or_url: str | os.PathLike[str]) -> Path:
    text = os.fspath(path_or_url)
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme.lower() != "sqlite":
            raise LedgerError(
                f"ledger {text!r}: only SQLite ledgers are supported (a path or sqlite:///PATH), not {scheme}://"
            )
        # sqlite:///rel/path -> 'rel/path'; sqlite:////abs/path -> '/abs/path' (SQLAlchemy's spelling).
        if not rest.startswith("/"):
            raise LedgerError(f"ledger {text!r}: write sqlite:///PATH (three slashes)")
        text = rest[1:]
        if not text:
            raise LedgerError("ledger URL sqlite:/// names no file")
    if text == ":memory:":
        raise LedgerError("an in-memory ledger would be lost at exit: give a file path")
    return Path(text)


def ledger_paths(path_or_url: str | os.PathLike[str]) -> list[tuple[str, Path]]:
    """The files writing the ledger writes (the database and SQLite's ``-wal``, ``-shm`` and ``-journal``
    beside it), named for :func:`mograph._paths.check_io`."""
    path = _resolve(path_or_url)
    return [("--ledger", path)] + [(f"--ledger's {s[1:]} file", path.with_name(path.name + s)) for s in ("-wal", "-shm", "-journal")]


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=_json_default, allow_nan=True)


def _json_default(value: Any) -> Any:
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover - numpy is a core dependency
        pass
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


def now_iso() -> str:
    """The current UTC time as an ISO 8601 string (what rows carry in ``time``)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


#: How long opening a ledger waits for another process's lock (as the connection's busy timeout does for writes).
_LOCK_WAIT_S = 60.0


def _locked(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _write_ahead_log(db: sqlite3.Connection) -> None:
    """``PRAGMA journal_mode = WAL``, retried while another process holds the file: SQLite answers a journal-mode
    change that meets another connection's lock with "database is locked" at once, without its busy handler
    (two sweeps opening one new ledger at the same moment)."""
    start, delay = time.monotonic(), 0.005
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if not _locked(exc) or time.monotonic() - start > _LOCK_WAIT_S:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


class Ledger:
    """A ledger open on one SQLite file.  Use :func:`open_ledger` to get one; close it (or use ``with``)."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        try:
            if readonly:
                if not path.exists():
                    raise LedgerError(f"ledger {path} does not exist")
                self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60, isolation_level=None)
            else:
                if path.parent and not path.parent.exists():
                    raise LedgerError(f"ledger {path}: folder {path.parent} does not exist")
                # Never written (nor created) through a symbolic link: it would change the file it points to.
                check_io(ledger_paths(path), [])
                sweep_dead_saves(path.parent)  # a killed save's leftovers in the folder this run writes into
                self._db = sqlite3.connect(str(path), timeout=60, isolation_level=None)
            self._db.execute("PRAGMA busy_timeout = 60000")
            if not readonly:
                _write_ahead_log(self._db)
                self._db.execute("PRAGMA synchronous = NORMAL")
                self._init_schema()
            else:
                self._check_schema()
        except sqlite3.OperationalError as exc:
            if _locked(exc):
                raise LedgerError(f"ledger {path} stayed locked by another process for {_LOCK_WAIT_S:.0f} s ({exc})") from exc
            raise LedgerError(f"ledger {path} cannot be opened ({exc})") from exc
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"ledger {path} is not a SQLite database ({exc})") from exc

    # -- schema --------------------------------------------------------------------------------------------
    def _init_schema(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if version == 0 and tables - {"sqlite_sequence"}:
                raise LedgerError(f"ledger {self.path} is a SQLite database, but not a mograph ledger")
            if version > _SCHEMA_VERSION:
                raise LedgerError(f"ledger {self.path} was written by a newer mograph (schema {version})")
            for statement in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                self._db.execute(statement)
            self._db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _check_schema(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version != _SCHEMA_VERSION:
            raise LedgerError(f"ledger {self.path} is not a mograph ledger (schema version {version})")

    # -- writing -------------------------------------------------------------------------------------------
    def add(self, row: Mapping[str, Any]) -> int:
        """Store one row in its own transaction and return its id.

        ``name`` is required; ``time`` and ``host`` default to now and this host; unknown keys are a
        :class:`LedgerError` (a typo would otherwise vanish silently).
        """
        if self.readonly:
            raise LedgerError(f"ledger {self.path} is open read-only")
        unknown = set(row) - set(ROW_FIELDS)
        if unknown:
            raise LedgerError(f"unknown ledger field(s): {', '.join(sorted(unknown))}")
        if not row.get("name"):
            raise LedgerError("a ledger row needs a name")
        values: dict[str, Any] = {}
        for key in ROW_FIELDS:
            if key == "id":
                continue
            value = row.get(key)
            if key == "time" and value is None:
                value = now_iso()
            elif key == "host" and value is None:
                value = socket.gethostname()
            elif key == "status" and value is None:
                value = "ok"
            elif key == "baseline":
                value = 1 if value else 0
            elif key in ("pipeline",) and value is None:
                value = []
            elif key in ("options", "versions", "metrics") and value is None:
                value = {}
            if key in _JSON_FIELDS and value is not None:
                value = _dumps(value)
            elif key in _TEXT_FIELDS and value is not None:
                value = str(value)
            values[key] = value
        if values["status"] not in ("ok", "failed"):
            raise LedgerError(f"ledger status must be 'ok' or 'failed', not {values['status']!r}")
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            cur = self._db.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", tuple(values.values()))
            rowid = int(cur.lastrowid or 0)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        return rowid

    # -- reading -------------------------------------------------------------------------------------------
    def _decode(self, record: sqlite3.Row | tuple[Any, ...], columns: Sequence[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in zip(columns, record):
            if key in _JSON_FIELDS and value is not None:
                value = json.loads(value)
            elif key == "baseline":
                value = bool(value)
            out[key] = value
        return out

    def _select(self, where: str = "", params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        cur = self._db.execute(f"SELECT {', '.join(ROW_FIELDS)} FROM runs {where} ORDER BY id", tuple(params))
        return [self._decode(r, ROW_FIELDS) for r in cur.fetchall()]

    def rows(self, model_hash: str | None = None, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every row, oldest first; only those of one model (``model_hash``) or with these ``names``."""
        clauses, params = [], []
        if model_hash is not None:
            clauses.append("model_hash = ?")
            params.append(model_hash)
        if names is not None:
            names = list(names)
            if not names:
                return []
            clauses.append(f"name IN ({', '.join('?' for _ in names)})")
            params.extend(names)
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        return self._select(where, params)

    def get(self, id_or_name: int | str) -> dict[str, Any]:
        """One row by id (an int, or a string of digits) or by name (the newest row of that name)."""
        text = str(id_or_name)
        if text.isdigit():
            found = self._select("WHERE id = ?", (int(text),))
            if found:
                return found[0]
        found = self._select("WHERE name = ?", (text,))
        if found:
            return found[-1]
        names = sorted({r["name"] for r in self._select()})
        hint = f"; names: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}" if names else "; it is empty"
        raise LedgerError(f"no row {text!r} in ledger {self.path}{hint}")

    def baseline(self, model_hash: str | None = None) -> dict[str, Any] | None:
        """The newest baseline row (of one model, if ``model_hash`` is given), or ``None``."""
        clause, params = "WHERE baseline = 1 AND status = 'ok'", []
        if model_hash is not None:
            clause += " AND model_hash = ?"
            params.append(model_hash)
        found = self._select(clause, params)
        return found[-1] if found else None

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r})"


def open_ledger(path_or_url: str | os.PathLike[str] = DEFAULT_LEDGER, *, readonly: bool = False) -> Ledger:
    """Open (creating if missing, unless ``readonly``) the ledger at a path or ``sqlite:///PATH`` URL."""
    return Ledger(_resolve(path_or_url), readonly=readonly)


def flatten_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One flat dict per row for CSV: scalar fields as they are, metrics as ``metric.KEY``, the other
    structured fields as JSON text (``report``/``plan``/``profile`` are left out: too big for a cell)."""
    out: dict[str, Any] = {}
    for key in ROW_FIELDS:
        if key in ("metrics", "report", "plan", "profile", "settings"):
            continue
        value = row.get(key)
        if key == "pipeline" and isinstance(value, list):
            value = ",".join(value)
        elif key in _JSON_FIELDS and value is not None:
            value = _dumps(value)
        out[key] = value
    for key, value in (row.get("metrics") or {}).items():
        out[f"metric.{key}"] = value
    return out


#: What a spreadsheet reads as the start of a formula in a cell (OWASP's list for CSV injection).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def csv_cell(value: Any) -> Any:
    """``value`` safe to open in a spreadsheet: a text cell beginning with ``=``, ``+``, ``-``, ``@``, a
    tab or a carriage return gets a leading ``'`` (so it is not run as a formula); numbers, negative ones
    included, and text that is a number stay as they are."""
    if isinstance(value, str) and value.startswith(_FORMULA_START) and not _is_number(value):
        return "'" + value
    return value


def rows_to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as CSV text: the fixed fields, then every metric any row has (known ones first).

    Every cell goes through :func:`csv_cell` (formula injection: a configuration's name, an error
    message or a task metric's key are the user's text), the header included."""
    flat = [flatten_row(r) for r in rows]
    metric_cols: list[str] = [f"metric.{k}" for k in METRIC_KEYS if any(f"metric.{k}" in f for f in flat)]
    for f in flat:
        for k in f:
            if k.startswith("metric.") and k not in metric_cols:
                metric_cols.append(k)
    fields = [k for k in ROW_FIELDS if k not in ("metrics", "report", "plan", "profile", "settings")] + metric_cols
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([csv_cell(k) for k in fields])
    for f in flat:
        writer.writerow([csv_cell(f.get(k)) if f.get(k) is not None else "" for k in fields])
    return buf.getvalue()
