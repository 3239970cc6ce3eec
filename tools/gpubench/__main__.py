"""``python -m gpubench`` (with ``tools/`` on the path): the same as ``python tools/bench_gpu.py``."""

from __future__ import annotations

import contextlib

from .cli import main

with contextlib.suppress(BrokenPipeError):
    raise SystemExit(main())
