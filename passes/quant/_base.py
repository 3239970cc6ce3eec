"""What the quantization passes share: their options, the calibration source, and the Q/DQ pass flow.

The flow of a Q/DQ pass (``qdq-int8``, ``qdq-fp8``):

1. find the candidates (MatMul, Gemm, Conv not yet quantized) and decide each one's precision: an edited
   plan (``--precision-plan``) if given, else user overrides (``--keep-fp32``), else the default rules;
2. refuse without calibration data, unless random data was asked for explicitly (``--calibration-random``);
3. observe the activations to quantize on the calibration data (streaming; positions that the model's
   ``attention_mask`` marks as padding are left out) and turn the statistics into ranges with the chosen
   calibrator; with ``smoothing`` (``qdq-int8``: ``auto`` by default) the activations of weight MatMuls
   are smoothed first (:mod:`mograph.passes.quant.smoothing`: folded into the producing LayerNorm or
   MatMul where that is exact, else a per-channel ``Mul`` in front of the Q/DQ;
   the weights' rows scaled to match, alpha measured per activation) and the ranges are those of the
   smoothed tensors;
4. with ``--accuracy-budget``, replace the default rules by a measured per-layer sensitivity analysis;
5. insert Q/DQ and write the precision plan (report ``details`` and ``--precision-plan-out``);
6. when no budget measured the result (``qdq-fp8`` by default, ``qdq-int8`` on a float16 model or a second
   run), check it once against the float model (:mod:`mograph.passes.quant._output_check`: one warning
   below its floor); ``--accuracy-budget off`` skips the check too.

Before any of it, the model's opset is raised when the Q/DQ needs a newer one (``min_opset`` of the pass;
19 whenever float16 or bfloat16 tensors are quantized, as ``QuantizeLinear`` takes them from opset 19 with
a scale of the same type).  The upgrade is ``onnx.version_converter`` applied node by node
(:func:`mograph.opset.upgrade_opset`), recorded in the stats and ``details["opset_upgrade"]``;
a model it cannot convert is refused in one line (:class:`~mograph.errors.ModelError`), unchanged.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from mograph.passes.quant import calibration as cal
from mograph.passes.quant._output_check import OutputCheck
from mograph.passes.quant._qdq import (
    Candidate,
    QdqWriter,
    Scheme,
    computed_from_constants,
    default_precision,
    find_candidates,
    sensitive_nodes,
    tensors_to_observe,
)
from mograph.passes.quant.plan import PrecisionPlan, load_plan, node_key, parse_budget
from mograph.passes.quant.smoothing import (
    SmoothGroup,
    affine_norms,
    apply_bias_correction,
    apply_smoothing,
    choose_alpha,
    smoothing_groups,
    unsmooth,
)

from mograph import _spill, specs
from mograph.errors import ModelError, OptionError
from mograph.ir_version import fit_ir_version
from mograph.pass_infra import Option, Pass, PassResult

__all__ = ["CALIBRATION_OPTIONS", "PLAN_OPTIONS", "QdqPassBase", "open_calibration", "parse_shapes"]

logger = logging.getLogger(__name__)

RANDOM_WARNING = (
    "CALIBRATED ON RANDOM DATA (--calibration-random): the ranges do not describe real inputs and the "
    "accuracy of this model is unknown; calibrate with --calibration-data before shipping it"
)

CALIBRATION_OPTIONS = (
    Option(
        "calibration-data",
        str,
        None,
        "calibration feeds: a folder of .npz files, one .npz of stacked feeds, module:function or "
        "file.py:function (from the current folder; imports and runs this code); from Python also a list, callable or "
        "generator of feeds",
        metavar="PATH|MODULE:FUNC",
        io="read",
    ),
    Option(
        "calibration-random",
        int,
        0,
        "calibrate on N seeded RANDOM samples instead of data (explicit opt-in; the report warns)",
        metavar="N",
    ),
    Option("calibration-samples", int, 0, "use at most N calibration samples (0: all)", metavar="N"),
    Option(
        "shape",
        str,
        None,
        "input shape for random calibration feeds, e.g. input_ids:1x128",
        multiple=True,
        metavar="NAME:DIMS",
    ),
)

PLAN_OPTIONS = (
    Option("precision-plan", str, None, "apply this edited precision plan (YAML) instead of deciding", metavar="FILE",
           io="read"),
    Option("precision-plan-out", str, None, "write the per-node precision plan (YAML) here (its folder must exist)",
           metavar="FILE", io="write"),
    Option(
        "keep-fp32",
        str,
        None,
        "node name or op type to keep in float (repeatable; recorded as a user override)",
        multiple=True,
        metavar="NODE|OP",
    ),
)

#: Values of ``--accuracy-budget`` that mean "no measurement: the default rules decide".
NO_BUDGET = ("off", "rules", "none")


BUDGET_OPTION = Option(
    "accuracy-budget",
    str,
    "auto",
    "measure per-layer sensitivity on the calibration data and keep the fewest layers in float that meet this "
    "budget on the model outputs; auto (default): cosine>=0.992 for qdq-int8, for qdq-fp8, weight-only and "
    "kv-cache-fp8 the default rules and a one-run output check that warns below cosine 0.8 (kv-cache-fp8 keeps "
    "nothing float: any budget runs that check), for prune-structured and sparsity-2to4 that output figure "
    "reported, never judged; off: the default rules decide, nothing measured",
    metavar="cosine>=X|max-abs<=X|auto|off",
)


QDQ_OPTIONS = (
    Option("calibrator", str, "minmax", "how ranges are chosen", choices=("minmax", "percentile", "entropy")),
    Option("percentile", float, 99.99, "percentile kept by --calibrator percentile", metavar="P"),
    BUDGET_OPTION,
    Option("sensitivity-samples", int, 8, "calibration samples used by the sensitivity analysis and the smoothing "
           "strength search", metavar="N"),
)


def parse_shapes(items: list[Any] | None) -> dict[str, tuple[int, ...]]:
    """``["input_ids:1x128"]`` (or ``(name, dims)`` pairs from Python) -> ``{"input_ids": (1, 128)}``."""
    pairs = {str(i[0]): tuple(int(d) for d in i[1]) for i in items or [] if isinstance(i, (tuple, list))}
    return {**specs.parse_shapes([i for i in items or [] if not isinstance(i, (tuple, list))]), **pairs}


def open_calibration(p: Pass, model: ir.Model) -> cal.CalibrationSource:
    """The pass's calibration source; refuses (OptionError) when there is neither data nor explicit random.

    Also gives ``model`` an IR version the installed ONNX Runtime reads (:func:`mograph.ir_version.fit_ir_version`),
    as every session the calibration opens runs a copy of it (an ``onnx_ir.Model`` handed to the pass directly
    has not been through :func:`mograph.ir_io.load_model`).
    """
    fit_ir_version(model)
    data = p.config.get("calibration_data")
    random_n = int(p.config.get("calibration_random") or 0)
    limit = int(p.config.get("calibration_samples") or 0) or None
    if data is not None and random_n:
        raise OptionError(f"{p.name}: give --calibration-data or --calibration-random, not both")
    if data is not None:
        return cal.open_source(data, model, limit=limit)
    if random_n > 0:
        logger.warning("%s: %s", p.name, RANDOM_WARNING)
        return cal.RandomSource(model, random_n, parse_shapes(p.config.get("shape")))
    raise OptionError(
        f"{p.name} needs calibration data: --calibration-data DIR|FILE.npz|module:function|file.py:function. It will not calibrate "
        "on random numbers silently; pass --calibration-random N to do so explicitly (the report will say so)."
    )


def calibration_meta(source: cal.CalibrationSource, samples: int, calibrator: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"source": source.description, "samples": samples, "random": source.random}
    if calibrator:
        meta["calibrator"] = calibrator
    if source.random:
        meta["warning"] = RANDOM_WARNING
    return meta


def computed_weights_note(count: int) -> str:
    """The note for ``count`` MatMuls whose weight is computed from constants at run time."""
    return (f"{count} MatMul(s) read a weight computed at run time from constants (a Transpose or an in-graph "
            "dequantization of a stored weight), not quantized as weights: run 'cleanup' (fold-constants) before "
            "this pass")


def publish_notes_and_plan(p: Pass, plan: PrecisionPlan, details: dict[str, Any], notes: list[str]) -> None:
    """Put ``notes`` in the report's ``details`` (and the log), and write the plan to ``--precision-plan-out``."""
    if notes:
        details["notes"] = notes
        for note in notes:
            logger.warning("%s: %s", p.name, note)
    out = p.config.get("precision_plan_out")
    if out:
        plan.write(out)
        logger.info("%s: wrote precision plan to %s", p.name, out)


class QdqPassBase(Pass):
    """Shared flow of the Q/DQ passes; subclasses give the scheme."""

    family = "quant"
    precision: ClassVar[str] = "int8"
    #: Oldest default-domain opset the pass's Q/DQ form exists at, and what needs it (for the report).
    min_opset: ClassVar[int] = 13
    min_opset_reason: ClassVar[str] = "per-channel DequantizeLinear (13)"
    #: The budget ``--accuracy-budget auto`` (the default) means; None: the default rules decide.
    default_budget: ClassVar[str | None] = None
    #: Optional ``callback(done, total)`` for calibration and sensitivity progress (set on the instance).
    progress: Callable[[int, int | None], None] | None = None

    def scheme(self) -> Scheme:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_model(self, model: ir.Model) -> None:
        """Raise if the model cannot hold this pass's Q/DQ (beyond the opset, which is upgraded)."""

    def _ensure_opset(self, model: ir.Model, half: bool, stats: dict[str, int | float],
                      details: dict[str, Any]) -> bool:
        """Raise the opset to what the Q/DQ needs (see the module docstring); True if it was raised."""
        from mograph.opset import model_opset

        need, reason = self.min_opset, self.min_opset_reason
        if half and need < 19:
            need, reason = 19, "float16 tensors are quantized (QuantizeLinear 19)"
        if model_opset(model) >= need:
            return False
        details["opset_upgrade"] = raise_opset(self, model, need, f"needs opset >= {need} for {reason}", reason,
                                               stats)
        return True

    def _decide(self, model: ir.Model, cands: list[Candidate]) -> tuple[dict[str, tuple[str, str]], set[str], list[str]]:
        decisions = default_precision(model, cands, self.precision)
        overridden: set[str] = set()
        notes: list[str] = []
        plan_src = self.config.get("precision_plan")
        if plan_src:
            user = load_plan(plan_src)
            keys = {c.key for c in cands}
            for e in user.entries:
                if e.node not in keys:
                    continue
                if e.precision not in (self.precision, "fp32", "fp16", "float"):
                    raise OptionError(
                        f"{self.name}: plan entry {e.node!r} has precision {e.precision!r}; "
                        f"use {self.precision} or fp32"
                    )
                prec = self.precision if e.precision == self.precision else "fp32"
                if prec != decisions[e.node][0]:
                    decisions[e.node] = (prec, f"user override (plan {plan_src})")
                else:
                    decisions[e.node] = (prec, f"from plan {plan_src}: {e.reason}" if e.reason else "from plan")
                overridden.add(e.node)
            unknown = [e.node for e in user.entries if e.op in ("MatMul", "Gemm", "Conv") and e.node not in keys]
            if unknown:
                notes.append(f"plan names {len(unknown)} node(s) not found or not quantizable here: {unknown[:5]}")
        keep = set(self.config.get("keep_fp32") or [])
        for c in cands:
            if c.key in keep or c.node.op_type in keep:
                decisions[c.key] = ("fp32", "user override (--keep-fp32)")
                overridden.add(c.key)
        return decisions, overridden, notes

    def _smoothing_alpha(self) -> float | str | None:
        """``"auto"``, a fixed alpha in (0, 1], or None (no smoothing) from the ``smoothing`` option."""
        value = self.config.get("smoothing")
        if value is None or str(value).lower() in ("off", "none", "0", "0.0", "false"):
            return None
        if str(value).lower() == "auto":
            return "auto"
        try:
            alpha = float(value)
        except ValueError:
            raise OptionError(f"{self.name}: --smoothing {value!r}: expected auto, off or a number in (0, 1]") from None
        if not 0.0 < alpha <= 1.0:
            raise OptionError(f"{self.name}: --smoothing {value!r}: alpha must be in (0, 1]")
        return alpha

    def _smooth(self, model: ir.Model, groups: list[SmoothGroup], raw: dict[str, cal.TensorStats],
                source: cal.CalibrationSource, scheme: Scheme, alpha: float | str, mask: str | None,
                plan: PrecisionPlan, stats: dict[str, int | float],
                captured: dict[str, list[np.ndarray]] | None = None) -> list[SmoothGroup]:
        """Smooth every group whose activation statistics allow it (see :mod:`.smoothing`); return those done.

        ``captured``: the groups' activations on the first samples, kept by the calibration run
        (:func:`~mograph.passes.quant.calibration.observe`); the model is run again only for a group missing there."""
        # only the main graph: the tensors of If branches are seen on the samples that take the branch only
        groups = [g for g in groups if all(c.node.graph is model.graph for c in g.cands)]
        xs: dict[str, list[np.ndarray]] = dict(captured or {})
        missing = [g.name for g in groups if g.name not in xs]
        if alpha == "auto" and missing:
            n = int(self.config.get("sensitivity_samples") or 8)
            xs.update(cal.collect(model, missing, list(itertools.islice(iter(source), n)), mask))
        correct = self.config.get("bias_correction") == "on"
        done: list[SmoothGroup] = []
        records = []
        observed = set(raw)
        norms = affine_norms(self.registry)  # the norms whose gamma/beta can take a scale, from the declarations
        for i, g in enumerate(groups):
            if self.progress is not None and alpha == "auto":  # the alpha search: ~70 s on a 135M LLM
                self.progress(i, len(groups))
            amax = raw[g.name].channel_amax if g.name in raw else None
            if amax is None or (alpha == "auto" and not any(x.size for x in xs.get(g.name, []))):
                continue
            a = choose_alpha(g, xs[g.name], amax, scheme, bias_shift=correct) if alpha == "auto" else float(alpha)
            xs.pop(g.name, None)  # searched: its rows are not needed again
            if correct and g.bias_shift:
                for key in apply_bias_correction(model, g):
                    self._bias_corrected.add(key)
            if apply_smoothing(model, g, amax, a, observed, self._reobserve, norms):
                done.append(g)
                assert g.scale is not None
                rec: dict[str, Any] = {"tensor": g.name, "alpha": a, "consumers": [c.key for c in g.cands],
                                       "max_scale": round(float(g.scale.max()), 4),
                                       "min_scale": round(float(g.scale.min()), 4),
                                       "folded_into" if g.folded else "mul": g.folded or (g.smoothed.name if g.smoothed else "")}
                if g.errors:
                    rec["error_by_alpha"] = {str(k): round(v, 5) for k, v in g.errors.items()}
                records.append(rec)
                for c in g.cands:
                    self._smoothed_keys[c.key] = a
        if self.progress is not None and alpha == "auto" and groups:
            self.progress(len(groups), len(groups))
        stats["smoothed"] = len(done)
        if done:
            stats["smoothed.folded"] = sum(1 for g in done if g.folded)
            stats["smoothed.mul"] = len(done) - stats["smoothed.folded"]
        if self._bias_corrected:
            stats["bias_corrected"] = len(self._bias_corrected)
        plan.meta["smoothing"] = {"mode": alpha if alpha == "auto" else f"alpha {alpha}", "activations": records,
                                  "folded": int(stats.get("smoothed.folded", 0)), "mul": int(stats.get("smoothed.mul", 0))}
        return done

    def _unsmooth_float(self, model: ir.Model, decisions: dict[str, tuple[str, str]], plan: PrecisionPlan,
                        stats: dict[str, int | float]) -> None:
        """Consumers of a ``Mul``-smoothed activation that stay float read ``X`` and their own weights again
        (:func:`~mograph.passes.quant.smoothing.unsmooth`); a ``Mul`` nothing quantized reads is removed."""
        floats = {k for k, (prec, _) in decisions.items() if prec != self.precision}
        records = {r["tensor"]: r for r in plan.meta.get("smoothing", {}).get("activations", [])}
        for g in self._smoothed_groups:
            back = unsmooth(model, g, floats)
            if not back:
                continue
            for key in back:
                self._smoothed_keys.pop(key, None)
            stats["smoothed.unsmoothed_float"] = stats.get("smoothed.unsmoothed_float", 0) + len(back)
            rec = records.get(g.name)
            if rec is not None:
                rec["float_consumers_unsmoothed"] = back
            if g.smoothed is None:  # the Mul is gone: nothing quantized read it
                stats["smoothed"] -= 1
                stats["smoothed.mul"] -= 1
                if rec is not None:
                    rec["mul"] = "removed: every consumer stays float"
                    plan.meta["smoothing"]["mul"] -= 1

    def quantize_extra(self, model: ir.Model, plan: PrecisionPlan, stats: dict[str, int | float]) -> None:
        """Weights quantized without calibration besides the Q/DQ candidates (none by default)."""

    def call(self, model: ir.Model) -> PassResult:
        try:
            return self._call(model)
        finally:
            _spill.page_in(model)  # what stays float of the weights paged out after smoothing

    def _call(self, model: ir.Model) -> PassResult:
        self._smoothed_keys: dict[str, float] = {}
        self._bias_corrected: set[str] = set()
        self._reobserve: set[str] = set()
        self._smoothed_groups: list[SmoothGroup] = []
        scheme = self.scheme()
        cands, done = find_candidates(model)
        stats: dict[str, int | float] = {"quantized": 0, "kept_float": 0, "skipped_already_quantized": len(done)}
        plan = PrecisionPlan(self.name, meta={"scheme": scheme.name})
        if not cands:
            for node in done:
                plan.add(node, "quantized", "already quantized (inputs come from DequantizeLinear)")
            return PassResult(False, stats, {"plan": plan.to_dict()} if done else {})
        self.check_model(model)
        details: dict[str, Any] = {}
        half = has_half_tensors(model)
        upgraded = self._ensure_opset(model, half, stats, details)
        if upgraded:
            cands, done = find_candidates(model)  # nodes the converter rewrote are new objects
        float_types = {k: ir.DataType(t) for k, t in cal.infer_dtypes(model).items()} if half else {}
        decisions, overridden, notes = self._decide(model, cands)
        computed = sum(1 for c in cands if not c.has_weight and computed_from_constants(c.node.inputs[1]))
        if computed:
            notes.append(computed_weights_note(computed))
        budget = None
        budget_text = str(self.config.get("accuracy_budget") or "auto").strip()
        is_default = budget_text.lower() == "auto"
        explicit_off = budget_text.lower() in NO_BUDGET  # also skips the output check (:mod:`._output_check`)
        if is_default:
            budget_text = self.default_budget or "off"
        if budget_text.lower() not in NO_BUDGET and not self.config.get("precision_plan"):
            budget = parse_budget(budget_text)
        if budget is not None and is_default and half:
            # the per-layer measurement builds float32 one-node models: float16 models keep the default rules
            notes.append(f"float16/bfloat16 model: the default rules chose the float layers, not a measurement "
                         f"(give --accuracy-budget {budget} to measure)")
            budget = None
        if budget is not None and done and is_default:
            # a second run on its own output: what the first run measured and kept float stays float
            for c in cands:
                if c.key not in overridden:
                    decisions[c.key] = ("fp32", f"kept float: {len(done)} layer(s) of this model are quantized already "
                                        "(an earlier run chose these to stay float; give --accuracy-budget to "
                                        "measure again)")
            budget = None
        # the sensitivity analysis measures layers of the main graph; those in subgraphs keep their rules
        measured = [c for c in cands if c.key not in overridden and c.node.graph is model.graph] if budget else []
        # ... and are left out of its end-to-end figure: the report says so rather than claim the budget met
        unmeasured = sum(1 for c in cands if budget and c.node.graph is not model.graph
                         and decisions[c.key][0] == self.precision)
        fixed_main = any(c.key in overridden and decisions[c.key][0] == self.precision and c.node.graph is model.graph
                         for c in cands)
        if budget is not None and not measured and not fixed_main:
            # nothing to measure (every layer in an If/Loop body, or fixed by the user): no figure to report
            plan.meta["accuracy_budget"] = {
                "budget": str(budget), "default": is_default, "measured": None, "met": None, "kept_float": 0,
                "samples": 0, "evaluations": 0, "unmeasured": unmeasured,
                "reason": "no layer of the main graph to measure: the default rules decided"}
            notes.append(f"accuracy budget {budget} not measured: no candidate layer in the main graph "
                         + (f"({unmeasured} inside subgraphs, left to the default rules)" if unmeasured else ""))
            budget = None
        wanted = [c for c in cands if decisions[c.key][0] == self.precision]
        observe_for = wanted if not budget else [c for c in cands if c in measured or c in wanted]
        source = None
        ranges: dict[str, tuple[float, float]] = {}
        check = None
        if observe_for:
            source = open_calibration(self, model)
            if budget is None and not explicit_off:  # nothing measured the result: the one-run output check
                check = OutputCheck.start(self.name, model, source,
                                          samples=int(self.config.get("sensitivity_samples") or 8))
            calibrator = self.config.get("calibrator") or "minmax"
            mask = cal.padding_mask_input(model)
            alpha = self._smoothing_alpha()
            groups = smoothing_groups(observe_for) if alpha is not None else []
            captured: dict[str, list[np.ndarray]] = {}
            raw = cal.observe(
                model,
                tensors_to_observe(observe_for),
                source,
                histogram=cal.needs_histogram(calibrator),
                progress=self.progress,
                channels=[g.name for g in groups],
                padding_mask=mask,
                # the alpha search's inputs come from this run: no second run of the model for them
                capture=[g.name for g in groups] if alpha == "auto" else (),
                capture_samples=int(self.config.get("sensitivity_samples") or 8),
                captured=captured,
            )
            if mask is not None:
                plan.meta["calibration_padding"] = f"positions where {mask} is 0 are left out of the statistics"
            if groups and alpha is not None:
                smoothed = self._smooth(model, groups, raw, source, scheme, alpha, mask, plan, stats, captured)
                captured.clear()
                # the smoothed weights are read again only to run and quantize the model: mapped from a file,
                # they are not beside the sessions of the calibration and sensitivity runs that follow
                _spill.page_out(model)
                self._smoothed_groups = smoothed
                names = [g.smoothed.name or "" for g in smoothed if g.smoothed is not None]
                if names and cal.needs_histogram(calibrator):
                    raw.update(cal.observe(model, names, source, histogram=True, padding_mask=mask))
                elif names:  # min/max of X / s follow from the per-channel extremes of X
                    for g in smoothed:
                        raw[g.smoothed.name or ""] = cal.scaled_stats(raw[g.name], g.scale)  # type: ignore[arg-type,union-attr]
                if self._reobserve:  # tensors a fold changed after their ranges were taken (attention values)
                    raw.update(cal.observe(model, sorted(self._reobserve), source,
                                           histogram=cal.needs_histogram(calibrator), padding_mask=mask))
                    stats["smoothed.reobserved"] = len(self._reobserve)
            ranges = cal.compute_ranges(raw, calibrator, percentile=float(self.config.get("percentile") or 99.99))
            stats["calibration_samples"] = max((s.samples for s in raw.values()), default=0)
            plan.meta["calibration"] = calibration_meta(source, int(stats["calibration_samples"]), calibrator)
            if source.random:
                stats["calibrated_on_random_data"] = 1
        if budget is not None and source is not None:
            from mograph.passes.quant.sensitivity import CHEAP_FRACTION, TIE_FACTOR, analyse

            n = int(self.config.get("sensitivity_samples") or 8)
            samples = list(itertools.islice(iter(source), n))
            fixed = {c.key for c in cands if c.key in overridden and decisions[c.key][0] == self.precision}
            res = analyse(model, measured, ranges, scheme, samples, budget, fixed=fixed, progress=self.progress,
                          source=source)
            rank = {k: i + 1 for i, k in enumerate(res.order)}
            for c in measured:
                value = (f"layer output relative error {res.alone[c.key]:.5f} when quantized alone, "
                         f"{res.cost[c.key] / 1e6:.3g} MMAC/sample, rank {rank[c.key]} of {len(res.order)}")
                if c.key in res.keep:
                    decisions[c.key] = ("fp32", f"measured sensitivity: {value}; kept float to meet {budget}")
                else:
                    decisions[c.key] = (self.precision, f"measured sensitivity: {value}; quantized within {budget}")
            plan.meta["accuracy_budget"] = {
                "budget": str(budget),
                "default": is_default,
                "measured": round(res.final, 6),
                "met": res.met,
                "kept_float": len(res.keep),
                "samples": len(samples),
                "evaluations": res.evaluations,
                "order": f"layers under {CHEAP_FRACTION:g} x the median layer's multiply-adds first (cheap to "
                         "keep float), then the rest; in each, by quantized-alone error, most sensitive first "
                         f"(errors within a factor {TIE_FACTOR:g}: cheapest first)",
                "metric_by_kept_float": {int(k): round(v, 6) for k, v in res.curve.items()},
                "unmeasured": unmeasured,
            }
            if unmeasured:
                notes.append(f"{unmeasured} layer(s) inside subgraphs, left to the default rules, are not in the "
                             f"measured {budget} figure")
            stats["sensitivity_evaluations"] = res.evaluations
            if not res.met:
                notes.append(f"accuracy budget {budget} not met even with every measured layer in float")
        self._unsmooth_float(model, decisions, plan, stats)
        self.quantize_extra(model, plan, stats)  # before the rule-based float list: an INT8 table is not float
        loop_bodies = _loop_bodies(model)
        sensitive = sensitive_nodes(model, self.registry.foreign_ops if self.registry is not None else None)
        writer = QdqWriter(model, scheme, ranges, float_types)
        for c in cands:
            prec, reason = decisions[c.key]
            if prec == self.precision:
                if writer.quantize(c):
                    stats["quantized"] += 1
                    stats[f"quantized.{c.node.op_type}"] = stats.get(f"quantized.{c.node.op_type}", 0) + 1
                else:
                    prec, reason = "fp32", "no calibrated range for an input (never observed as a float tensor)"
                    if id(c.node.graph) in loop_bodies:
                        reason = "inside a Loop/Scan body, whose tensors calibration cannot observe"
            if prec != self.precision:
                stats["kept_float"] += 1
            else:
                if c.key in self._smoothed_keys:
                    reason += f"; input smoothed (SmoothQuant, alpha {self._smoothed_keys[c.key]:g})"
                if c.key in self._bias_corrected:
                    reason += "; bias corrected by the measured mean output shift"
            plan.add(c.node, prec, reason)
        for node, reason in sensitive:
            plan.add(node, "fp32", reason)
        for node in done:
            plan.add(node, "quantized", "already quantized (inputs come from DequantizeLinear)")
        stats["q_nodes"] = writer.q_nodes
        stats["dq_nodes"] = writer.dq_nodes
        if check is not None and (stats["quantized"] or stats.get("quantized.embeddings")):
            check.finish(model, stats, details, notes)
        details = {"plan": plan.to_dict(), **details}
        if source is not None and source.random:
            details = {"WARNING": RANDOM_WARNING, **details}
        publish_notes_and_plan(self, plan, details, notes)
        modified = (upgraded or stats["quantized"] > 0 or stats.get("quantized.embeddings", 0) > 0
                    or stats.get("smoothed", 0) > 0 or stats.get("bias_corrected", 0) > 0)
        return PassResult(modified, stats, details)


def _loop_bodies(model: ir.Model) -> set[int]:
    """Ids of the graphs inside ``Loop`` and ``Scan`` bodies (at any depth)."""
    out: set[int] = set()
    for graph in model.graphs():
        for node in graph:
            if node.op_type in ("Loop", "Scan"):
                for attr in node.attributes.values():
                    if attr.type == ir.AttributeType.GRAPH:
                        out.update(id(g) for g in attr.value.subgraphs())
                        out.add(id(attr.value))
    return out


__all__ += ["node_key", "RANDOM_WARNING", "QDQ_OPTIONS", "calibration_meta"]


def has_half_tensors(model: ir.Model) -> bool:
    """Whether ``model`` holds float16/bfloat16 tensors a Q/DQ may read: an input, an initializer, or a ``Constant``
    node's value in any graph (the weights of paddle2onnx's and onnxconverter-common's models are ``Constant``
    nodes that cleanup keeps; missing them left the opset below 19 and wrote float16 scales the model's
    ``DequantizeLinear`` refuses)."""
    from mograph._traverse import iter_nodes

    half_types = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    if any(v.dtype in half_types for v in (*model.graph.inputs, *model.graph.initializers.values())):
        return True
    for node in iter_nodes(model.graph):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        attr = node.attributes.get("value")
        if attr is not None and not attr.is_ref() and attr.value.dtype in half_types:
            return True
        if node.outputs and node.outputs[0].dtype in half_types:
            return True
    return False


def raise_opset(pass_: Any, model: ir.Model, need: int, needs: str, reason: str,
                stats: dict[str, int | float]) -> dict[str, Any]:
    """Upgrade ``model`` to opset ``need`` for a precision pass (its op declarations from the registry), count it in
    ``stats`` and return the report's ``opset_upgrade`` entry; :class:`ModelError` (``"NAME: NEEDS; the model's
    opset cannot be upgraded ..."``) where it cannot be."""
    from mograph.opset import OpsetUpgradeError, model_opset, upgrade_opset

    old = model_opset(model)
    try:
        done = upgrade_opset(model, need, ops=pass_.registry.custom_ops if pass_.registry is not None else {})
    except OpsetUpgradeError as exc:
        raise ModelError(f"{pass_.name}: {needs}; the model's opset cannot be upgraded from {old}: {exc}") from exc
    stats["opset_upgrade.from"] = done.from_opset
    stats["opset_upgrade.to"] = done.to_opset
    stats["opset_upgrade.rewritten"] = sum(done.rewritten.values())
    logger.info("%s: opset %d -> %d for %s", pass_.name, done.from_opset, done.to_opset, reason)
    return {"done": True, "from": done.from_opset, "to": done.to_opset, "reason": reason,
            "rewritten": dict(done.rewritten)}

