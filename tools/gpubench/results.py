"""The results file: one JSON line per cell, appended as cells finish; what is done, what crashed."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from .grid import TORCH_VARIANTS

# -- results file -------------------------------------------------------------------------------------


def cell_key(model: str, export: str, attn: str, variant: str, shape: str) -> str:
    return f"{model}/{export}/{attn}/{variant}/{shape}"


def torch_ids(model: str, export: str, attn: str, variant: str) -> tuple[str, str, str]:
    """Torch references belong to the model, not to an export: one cell per model and shape."""
    return (model, "torch", "sdpa") if variant in TORCH_VARIANTS else (model, export, attn)


def read_results(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line))
    return rows


class Results:
    """The JSON-lines file: appended line by line (flushed, fsynced), read back to resume."""

    def __init__(self, path: Path, retry_errors: bool) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        started: set[str] = set()
        for row in read_results(path):
            if row.get("status") == "started":
                started.add(row["key"])
            elif "key" in row:
                if row.get("status") == "ok" or not retry_errors:
                    self.done[row["key"]] = row
                started.discard(row["key"])
        self.crashed = started - set(self.done)

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if row.get("status") != "started":
            self.done[row["key"]] = row
