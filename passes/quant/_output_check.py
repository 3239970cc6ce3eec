"""The default output check of the lossy precision passes: one float run, one quantized run, one figure.

``qdq-int8`` and ``fp16`` choose what stays float by measuring the model outputs against an accuracy
budget; ``weight-only`` (``int4``), ``qdq-fp8`` and ``kv-cache-fp8`` decide by rules by default and measured
nothing, so a model they wrecked (a GNN whose outputs came back at cosine -0.5 after ``int4``) was written with
exit 0 and no word about it.  Whenever such a pass has not measured its own result (no ``--accuracy-budget``
search ran; ``--accuracy-budget off`` skips this check too), it now:

1. runs the float model, before anything is rewritten, on the first :data:`CHECK_SAMPLES` feeds it has
   (its calibration data; without any, as ``int4``'s default RTN needs none, seeded random feeds sized
   like ``--calibration-random``'s, dynamic dims 1 unless ``--shape`` says otherwise);
2. runs the written model on the same feeds (ONNX Runtime, optimizations off: the graph as written; a stored FP8
   KV cache is fed and read back through its recorded scales, as ``--verify`` does; ``weight-only``
   runs the float model with the dequantized layer weights fed in, as its budget does: what the kernels compute,
   without dequantizing every weight in ONNX Runtime's generic ops on each run, 22 s for 4 runs of a 135M LLaMA);
3. judges each float output of each sample on its own, as the budgets and ``--verify`` do
   (:func:`~mograph.passes.quant._fp16_measure.output_value`: a scale-aware cosine, padded positions of an
   ``attention_mask`` left out), and records the smallest figure, the output and the sample it came from in
   ``details["output_check"]`` (the report's pass details; the stats stay counts of what the pass did);
4. below :data:`CHECK_FLOOR` (a figure no healthy quantized model of the test corpus comes near: see the
   constant) says so in one warning line that names the output, the figure and the ways out, and adds
   ``output_check.below_floor`` to the stats.  The pass still succeeds (exit 0): the figure comes from a
   few samples, possibly random ones, and a failing exit is what ``--verify`` (exit 5) is for.

The pruning passes (``prune-structured``, ``sparsity-2to4``) take the same figure with ``judged=False``: recorded
in their details, never warned about (:data:`UNJUDGED_NOTE`).

Cost: two sessions (one for ``weight-only``) and ``2 x CHECK_SAMPLES`` runs: 15 s of a 265 s default ``int4``
(GPTQ, 8 samples of 128 tokens) of a 135M LLaMA on the loaded 2-core machine, 6 s of 12 s without data.  A model whose weights exceed the output check's
ONNX Runtime load limit (:data:`mograph.output_check.ORT_MAX_BYTES`, 1 GiB: a session holds a copy of
them) is not run, and the details say so, so a large LLM's default ``int4`` costs nothing more.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import calibration as cal
from mograph.passes.quant._fp16_measure import _rows, output_value
from mograph.passes.quant.plan import Budget

from mograph import _spill

__all__ = ["CHECK_FLOOR", "CHECK_SAMPLES", "OutputCheck", "UNJUDGED_NOTE"]

logger = logging.getLogger(__name__)

#: Feeds the check runs (at most; fewer when ``--sensitivity-samples`` or the data has fewer).
CHECK_SAMPLES = 4
#: Smallest per-output cosine that does not warn.  Measured with this check on the healthy models of the test
#: corpus (the attention corpus' BERT, RoBERTa, ViT, Whisper, GPT-2 and LLaMA exports, tests/data/corpus,
#: bert-tiny, the LLaMA decode step: about 130 models) the lowest figures were 0.955 (int4 RTN on random feeds,
#: a LLaMA), 0.997 (int4 GPTQ) and 0.996 (qdq-fp8); real all-MiniLM-L6-v2 weights: 0.934 (int4 RTN, random
#: feeds), 0.998 (GPTQ), 0.997 (fp8); a SmolLM2-135M-shaped LLaMA: 0.927 (RTN) and 0.984 (GPTQ).  The GNN
#: of issue 27 gave -0.5 (int4) and -0.25 (fp8).  At 0.8 the error's norm is 0.63 of the output's
#: (``1 - cos = e^2 / 2``): wrecked, not merely lossy, and 0.13 below the lowest healthy figure.
CHECK_FLOOR = 0.8

_COSINE = Budget("cosine", CHECK_FLOOR)

#: What an unjudged figure (``judged=False``) says in the report: pruning is lossy by design.  Measured with
#: this check (4 seeded random feeds): ``sparsity-2to4`` on the attention corpus' LLaMA export 0.664, on its
#: BERT 0.999; ``prune`` (ratio 0.3, ffn) 0.967 and 0.9997: a correct 2:4 model can read below
#: :data:`CHECK_FLOOR` before its fine-tuning, so a floor would cry wolf.
UNJUDGED_NOTE = "lossy by design, fine-tuning expected: the figure is reported, not held against a floor"


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for g in model.graphs() for v in g.initializers.values()
               if v.const_value is not None)


@dataclass
class OutputCheck:
    """The float side of the check, taken by :meth:`start` before the pass rewrites anything."""

    pass_name: str
    samples: list[cal.Feed] = field(default_factory=list)
    refs: list[list[np.ndarray]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    keeps: list[np.ndarray | None] = field(default_factory=list)
    random: bool = False
    skipped: str | None = None
    outs: list[list[np.ndarray]] | None = None  # the quantized side, when run before the model is rewritten
    form: str = "the written model"
    judged: bool = True  # False: the figure is recorded, never held against CHECK_FLOOR (lossy by design)

    @classmethod
    def start(cls, pass_name: str, model: ir.Model, source: cal.CalibrationSource | None, *, samples: int,
              shapes: dict[str, tuple[int, ...]] | None = None,
              run: Callable[[list[cal.Feed]], list[list[np.ndarray]]] | None = None,
              judged: bool = True) -> OutputCheck:
        """Run the float ``model`` on the first ``samples`` feeds of ``source`` (seeded random feeds when
        ``None``); a check that cannot run says why in ``skipped`` and never fails the pass.  ``run``: how
        to run the float side (default: an ONNX Runtime session of ``model``).  ``judged`` False (the
        pruning passes, lossy by design and followed by fine-tuning): the figure is recorded only, with no
        floor, warning or stat."""
        check = cls(pass_name, judged=judged)
        from mograph.output_check import ORT_MAX_BYTES

        size = _weight_bytes(model)
        if size > ORT_MAX_BYTES:
            check.skipped = (f"{size / 2**30:.1f} GiB of weights, over the {ORT_MAX_BYTES / 2**30:g} GiB a check "
                             "session may hold (give --accuracy-budget cosine>=X to measure, or --verify)")
            return check
        n = max(1, min(samples, CHECK_SAMPLES))
        if source is None:
            source = cal.RandomSource(model, n, shapes)
        check.random = bool(source.random)
        try:
            check.samples = list(itertools.islice(iter(source), n))
            mask = cal.padding_mask_input(model)
            check.keeps = [cal._kept_positions(f, mask) for f in check.samples]
            check.names = [v.name or f"output {i}" for i, v in enumerate(model.graph.outputs)]
            check.refs = run(check.samples) if run is not None else list(cal.run_model(model, check.samples))
        except Exception as exc:  # noqa: BLE001 - a check that cannot run must not fail the pass
            reason = " ".join(str(exc).split())[:200] or type(exc).__name__
            check.skipped = f"the float model did not run on the check's {'random ' if check.random else ''}feeds: {reason}"
            check.samples, check.refs = [], []
            logger.debug("%s: output check skipped", pass_name, exc_info=True)
        return check

    def run_quantized(self, run: Callable[[list[cal.Feed]], list[list[np.ndarray]]], form: str) -> None:
        """Take the quantized side now with ``run`` (before the pass rewrites the model; ``form`` says what
        it runs, for the report) instead of in :meth:`finish`."""
        if self.skipped is not None or not self.samples:
            return
        self.form = form
        try:
            self.outs = run(self.samples)
        except Exception as exc:  # noqa: BLE001 - as in finish
            self.skipped = "the quantized model did not run: " + (" ".join(str(exc).split())[:200] or type(exc).__name__)

    def finish(self, model: ir.Model, stats: dict[str, int | float], details: dict[str, Any],
               notes: list[str] | None = None) -> None:
        """Run the written ``model`` on the same feeds (unless :meth:`run_quantized` did), judge and record
        (module docstring)."""
        if self.skipped is None and not self.samples:
            self.skipped = "no feeds"
        if self.skipped is None and self.outs is not None:
            self._record(self.outs, stats, details, notes)
            self.outs = None
            return
        if self.skipped is None:
            try:
                outs = list(cal.run_model(model, self.samples))
            except Exception as exc:  # noqa: BLE001 - the output check after the pipeline reports a model ORT refuses
                self.skipped = "the quantized model did not run: " + (" ".join(str(exc).split())[:200] or type(exc).__name__)
            else:
                self._record(outs, stats, details, notes)
                return
        details["output_check"] = {"measured": None, "skipped": self.skipped}
        logger.info("%s: output check not run: %s", self.pass_name, self.skipped)

    def _record(self, outs: Sequence[list[np.ndarray]], stats: dict[str, int | float], details: dict[str, Any],
                notes: list[str] | None) -> None:
        worst, where, sample = 1.0, None, 0
        for s, (ref, out) in enumerate(zip(self.refs, outs)):
            keep = self.keeps[s] if s < len(self.keeps) else None
            for name, r, o in zip(self.names, ref, out):
                r, o = np.asarray(r), np.asarray(o)
                if not (np.issubdtype(r.dtype, np.floating) or np.issubdtype(o.dtype, np.floating)):
                    continue
                value = output_value(_COSINE, _rows(r, keep), _rows(o, keep))
                if where is None or value < worst:
                    worst, where, sample = value, name, s
        _spill.trim_heap()
        data = "seeded random" if self.random else "calibration"
        record: dict[str, Any] = {"measured": round(worst, 6), "output": where, "sample": sample,
                                  "samples": len(self.samples), "data": data}
        if not self.judged:
            record.update(ran=self.form, judged=False, note=UNJUDGED_NOTE)
            details["output_check"] = record
            logger.info("%s: output %r has cosine %.3g against the original (%s)", self.pass_name, where, worst,
                        UNJUDGED_NOTE)
            return
        record.update(floor=CHECK_FLOOR, passed=bool(_COSINE.met(worst)), ran=self.form)
        details["output_check"] = record
        if where is None or _COSINE.met(worst):
            return
        stats["output_check.below_floor"] = 1
        message = (f"output {where!r} of the quantized model has cosine {worst:.3g} against the float model "
                   f"(scale-aware, as the accuracy budgets judge it; sample {sample} of {len(self.samples)} {data} "
                   f"feeds; floor {CHECK_FLOOR:g}): its numbers are wrecked; give --accuracy-budget cosine>=0.99 to "
                   f"keep the sensitive layers in higher precision, or leave {self.pass_name} out")
        record["warning"] = message
        if notes is not None:
            notes.append(message)  # logged once, with the pass's other notes
        else:
            logger.warning("%s: %s", self.pass_name, message)
