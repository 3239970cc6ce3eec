"""GPU benchmark: mograph against ONNX Runtime's transformers optimizer, onnxscript's ORT fusions, and torch.

The grid, its variants, how cells are timed and checked, and the usage are described in
``tools/gpubench/__init__.py`` (the package that implements it, one module per job); this file is its command
line and keeps the names other tools import (``from bench_gpu import cosine, cuda_kernels, time_runners``)::

    python tools/bench_gpu.py --out results.jsonl --cache /tmp/mograph-gpu --time-budget 480
    python tools/bench_gpu.py --markdown BENCHMARKS-GPU.md --out results.jsonl
    python tools/bench_gpu.py --smoke --out /tmp/smoke.jsonl    # tiny models on CPU ONNX Runtime, ~2 min
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

_TOOLS = str(Path(__file__).resolve().parent)
if _TOOLS not in sys.path:  # also when loaded by path (the tests) rather than run from tools/
    sys.path.insert(0, _TOOLS)

from gpubench.cache import Graph, drop_intermediates, export_graph, graph_for, needed_steps, prepare  # noqa: E402
from gpubench.cli import build_parser, main  # noqa: E402
from gpubench.estimate import (  # noqa: E402
    BUILD_SECONDS,
    MODEL_SCALE,
    _spread,
    estimate_build,
    list_pending,
    measured_build_seconds,
)
from gpubench.grid import (  # noqa: E402
    ATTNS,
    EXPORTS,
    FULL,
    MODELS,
    ORT_MODEL_TYPE,
    ORT_VARIANTS,
    SHAPES,
    SMOKE,
    TORCH_VARIANTS,
    VARIANTS,
    Dims,
    Shape,
    applies,
    graph_kind,
)
from gpubench.models import make_feeds  # noqa: E402
from gpubench.results import Results, cell_key, read_results  # noqa: E402
from gpubench.run import run_grid  # noqa: E402
from gpubench.runners import cosine, cuda_kernels, time_runners  # noqa: E402
from gpubench.tables import KEEP_MARKER, _goal, _placements, grid_rows, markdown, write_markdown  # noqa: E402

__all__ = [
    "ATTNS", "BUILD_SECONDS", "EXPORTS", "FULL", "KEEP_MARKER", "MODELS", "MODEL_SCALE", "ORT_MODEL_TYPE",
    "ORT_VARIANTS", "SHAPES", "SMOKE", "TORCH_VARIANTS", "VARIANTS", "Dims", "Graph", "Results", "Shape",
    "_goal", "_placements", "_spread", "applies", "build_parser", "cell_key", "cosine", "cuda_kernels",
    "drop_intermediates", "estimate_build", "export_graph", "graph_for", "graph_kind", "grid_rows",
    "list_pending", "main", "make_feeds", "markdown", "measured_build_seconds", "needed_steps", "prepare",
    "read_results", "run_grid", "time_runners", "write_markdown",
]

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
