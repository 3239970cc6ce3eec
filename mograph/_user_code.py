"""Resolving a user's ``module:function`` or ``file.py:function`` spec (calibration data, task metrics).

A leaf utility: the quant passes (``--calibration-data``) and the workflow (``--task-metric``) both load
user code this one way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mograph.errors import UsageError

__all__ = ["load_function"]


def load_function(spec: str, what: str, error: type[UsageError] = UsageError) -> Callable[..., Any]:
    """Resolve ``module:function`` (imported with the current folder importable, the import path left as it
    was) or ``file.py:function`` (loaded by path); a failure raises ``error`` (exit 2) in one line naming
    ``what`` (the option)."""
    mod_name, sep, func_name = spec.rpartition(":")
    if not sep or not mod_name or not func_name:
        raise error(f"{what} {spec!r}: expected module:function or file.py:function")
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise error(f"{what} {spec}: file {path} does not exist")
        loader_spec = importlib.util.spec_from_file_location(f"_mograph_user_{path.stem}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise error(f"{what} {spec}: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's file failed: one line
            raise error(f"{what} {spec}: importing {path} failed ({type(exc).__name__}: {exc})") from exc
    else:
        added = os.getcwd() not in sys.path and "" not in sys.path
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(mod_name)
        except ImportError as exc:
            raise error(f"{what} {spec}: cannot import module {mod_name!r} ({exc})") from exc
        finally:
            if added and os.getcwd() in sys.path:
                sys.path.remove(os.getcwd())
    func = getattr(module, func_name, None)
    if not callable(func):
        raise error(f"{what} {spec}: {mod_name} has no callable {func_name!r}")
    return func
