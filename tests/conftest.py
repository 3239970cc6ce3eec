"""Shared pytest setup.

* Put the repository root on ``sys.path`` so tests can import the top-level ``models`` package
  (test-model generators), which is not installed with ``mograph``.
* Tests are collected with ``--import-mode=importlib`` (so test files in different folders may share
  a name); folders that hold private test helpers (``_something.py``) are put on ``sys.path`` so tests
  import them by plain name. Helper module names must therefore be unique across ``tests/``.
"""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_ROOT = str(_TESTS.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
for _helper in sorted(_TESTS.rglob("_*.py")):
    if _helper.name != "__init__.py" and "__pycache__" not in _helper.parts:
        _folder = str(_helper.parent)
        if _folder not in sys.path:
            sys.path.append(_folder)
