"""Shared pytest setup: put the repository root on ``sys.path`` so tests can import the top-level
``models`` package (test-model generators), which is not installed with ``mograph``."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
