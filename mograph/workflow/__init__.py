"""The optimization workflow around the pipeline: measure, sweep, record, compare, gate.

* :mod:`mograph.workflow.ledger` — the ledger of measured configurations (SQLite);
* :mod:`mograph.workflow.metrics` — how one model is measured (latency, throughput, memory, size,
  accuracy against the baseline on a fixed evaluation set);
* :mod:`mograph.workflow.sweep` — the sweep config schema and the sweep itself;
* :mod:`mograph.workflow.gate` — the regression gate;
* :mod:`mograph.workflow.executors` — where configurations run: in this process, or fanned out on Ray.

Nothing here imports ``passes/``; heavy dependencies (onnxruntime, psutil, ray) are imported lazily.
"""

from mograph.workflow.ledger import Ledger, open_ledger

__all__ = ["Ledger", "open_ledger"]
