"""The regression gate: measure a candidate model the way the ledger measured its rows, and fail loudly.

``mograph gate CANDIDATE.onnx --ledger PATH`` is the command a CI job runs after the model is
retrained or the optimization pipeline changed:

1. **what it is compared with** — ``--baseline NAME`` (a ledger row: id or name), by default the newest
   unoptimized baseline row of the ledger;
2. **the reference outputs** — from the unoptimized model of that row's sweep (the baseline row with
   the same model hash): its file must still be where the ledger says and hash the same, else the
   gate refuses (exit 2) rather than compare with something else;
3. **the evaluation set** — the one the ledger recorded (``settings.eval_data``), re-read and checked
   against the recorded hash (a changed set is refused: exit 2); seeded random samples are made again
   from their recorded count and seed;
4. **measuring** — :func:`mograph.workflow.metrics.measure` with the recorded warm-up, threads,
   provider and ORT setting; the compared row's model is measured again beside the candidate
   (interleaved: run ``i`` of each model in the same round, the order rotating) when its file is still
   there, so the latency ratio is taken on this machine now; if it is gone, the recorded figures are
   used and the output says so.  The timed rounds are ``repeats`` series of ``runs`` rounds each
   (default: 5 series sharing the ledger's recorded number of timed runs, at least 5 rounds each);
5. **the verdict** — a regression when the accuracy metric (the task metric if the ledger recorded one,
   else ``cosine_mean`` against the reference) dropped by more than ``max_accuracy_drop`` (absolute,
   default 0.01), or when the latency rose by more than ``max_latency_increase`` (default 10%) **beyond
   the measurement's noise**: the latency ratio is the median over the series of each series'
   ratio of medians (candidate / compared), and its 95% interval comes from a seeded two-level bootstrap
   (series drawn with replacement, then paired rounds within each); only a lower bound above
   ``1 + max_latency_increase`` fails, so a busy machine slowing one series or a few runs does not.
   Against a recorded figure (no fresh measurement to pair with) the candidate's p50 is compared as is.
   A regression raises :class:`GateFailed` (exit code 5, "verification failed") with a one-line reason;
   the measurements go with it (``report``), as with a pass.

A ledger is data, never code.  A row records its task metric, and an evaluation set given as code
(``module:function`` or ``file.py:function``), by name and sha256; the gate never imports them from the ledger: the user
names them (``--task-metric``, ``--eval-data``: these import and run that code).  A row measured with a
task metric is refused (exit 2) without ``--task-metric``, or when its source's hash differs from the
recorded one; it is never gated silently on another metric.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mograph.errors import ModelError, UsageError, VerificationError

__all__ = ["GateFailed", "GateResult", "run_gate", "parse_percent", "latency_interval", "DEFAULT_MAX_ACCURACY_DROP",
           "DEFAULT_MAX_LATENCY_INCREASE", "DEFAULT_REPEATS", "CONFIDENCE"]

DEFAULT_MAX_ACCURACY_DROP = 0.01
DEFAULT_MAX_LATENCY_INCREASE = 0.10
#: Series of interleaved timed rounds (``--repeats``).
DEFAULT_REPEATS = 5
#: Fewest timed rounds in one series when ``--runs`` is not given.
MIN_RUNS = 5
#: Two-sided confidence of the latency ratio's interval.
CONFIDENCE = 0.95
_BOOTSTRAP = 2000


class GateFailed(VerificationError):
    """The candidate regressed past a tolerance (exit code 5)."""


@dataclass
class GateResult:
    passed: bool
    reasons: list[str]
    candidate: dict[str, Any]
    compared: dict[str, Any]
    compared_name: str
    accuracy_metric: str
    accuracy_drop: float | None
    latency_ratio: float | None
    remeasured: bool
    row_id: int | None = None
    notes: list[str] = field(default_factory=list)
    #: ``[low, high]`` of the latency ratio at :data:`CONFIDENCE` (None against a recorded figure).
    latency_interval: list[float] | None = None
    #: How latency was timed: ``runs`` rounds per series, ``repeats`` series, the per-series ratios.
    latency_runs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def parse_percent(text: str | float, flag: str = "--max-latency-increase") -> float:
    """``"10%"``, ``"10"`` -> 0.10 (a fraction)."""
    raw = str(text).strip()
    number = raw[:-1] if raw.endswith("%") else raw
    try:
        value = float(number) / 100.0
    except ValueError:
        raise UsageError(f"{flag} {raw!r}: expected a percentage such as 10%") from None
    if value < 0:
        raise UsageError(f"{flag} {raw!r}: must not be negative")
    return value


def latency_interval(
    candidate: Sequence[Sequence[float]], baseline: Sequence[Sequence[float]], *, confidence: float = CONFIDENCE,
    seed: int = 0, boots: int = _BOOTSTRAP,
) -> tuple[float, float, float, list[float]]:
    """The candidate/baseline latency ratio and its interval, from interleaved series of paired runs.

    ``candidate[k][i]`` and ``baseline[k][i]`` are run ``i`` of series ``k`` (timed in the same round).
    The ratio is the median over the series of ``median(candidate[k]) / median(baseline[k])``; the
    interval is the ``confidence`` percentile range of that statistic under a two-level bootstrap
    (series with replacement, then paired rounds with replacement inside each), seeded so a verdict is
    reproducible from the same timings.  Returns ``(ratio, low, high, per_series_ratios)``.
    """
    pairs = []
    for cand, base in zip(candidate, baseline):
        n = min(len(cand), len(base))
        if n:
            pairs.append((np.asarray(cand[:n], float), np.asarray(base[:n], float)))
    if not pairs:
        raise ValueError("no paired timings")
    per_series = [float(np.median(c) / np.median(b)) for c, b in pairs]
    ratio = float(np.median(per_series))
    rng = np.random.default_rng(seed)
    boot = np.empty((len(pairs), boots))
    for k, (c, b) in enumerate(pairs):
        idx = rng.integers(0, len(c), size=(boots, len(c)))
        boot[k] = np.median(c[idx], axis=1) / np.median(b[idx], axis=1)
    pick = rng.integers(0, len(pairs), size=(boots, len(pairs)))
    stat = np.median(boot[pick, np.arange(boots)[:, None]], axis=1)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = (float(x) for x in np.percentile(stat, [tail, 100.0 - tail]))
    return ratio, low, high, per_series


def _eval_samples(row: dict[str, Any], model: Any, eval_data: str | None = None) -> list[Any]:
    """The compared row's evaluation set, made again; ``eval_data`` is the user's ``--eval-data``.

    A ledger is data: a set the row records as code (``module:function``) is never imported from the
    ledger; the user must name it (``--eval-data``), and the samples must hash as recorded."""
    from mograph.workflow import metrics as M

    settings = row.get("settings") or {}
    spec = settings.get("eval_data")
    if not spec and not eval_data:
        raise UsageError(f"ledger row {row['name']!r} records no evaluation set; re-run the sweep with this mograph")
    if eval_data is None and M.names_code(spec):
        raise UsageError(
            f"ledger row {row['name']!r} records its evaluation set as code ({str(spec)[:200]}); the gate never runs "
            "code named in a ledger: give --eval-data DATA (a module:function there is imported and run)"
        )
    if eval_data is not None:
        samples = M.load_samples(eval_data, model, what="--eval-data", limit=int(settings.get("eval_samples") or 0))
        spec = eval_data
    elif str(spec).startswith("random:"):
        _, n, seed = str(spec).split(":")
        shapes = {k: tuple(v) for k, v in (row.get("shapes") or {}).items()}
        samples = M.random_samples(model, int(n), seed=int(seed.split("=")[1]), shapes=shapes)
    else:
        samples = M.load_samples(str(spec), model, what="the ledger's evaluation set", limit=int(settings.get("eval_samples") or 0))
    if row.get("eval_hash") and M.hash_samples(samples) != row["eval_hash"]:
        raise UsageError(f"the evaluation set {spec} changed since the ledger recorded row {row['name']!r} (hash differs)")
    return samples


def _task_metric(row: dict[str, Any], task_metric: str | None, notes: list[str]) -> Any:
    """The user's ``--task-metric`` function, checked against what the row recorded (by name and hash).

    A row that records a task metric is gated on it only with the user's ``--task-metric`` (refused
    otherwise: exit 2, never a silent pass on another metric); the code named in the ledger is never
    imported.  Its source must hash as the ledger recorded (when it recorded a hash)."""
    from mograph.workflow import metrics as M

    settings = row.get("settings") or {}
    recorded = settings.get("task_metric")
    if task_metric is None:
        if recorded:
            raise UsageError(
                f"ledger row {row['name']!r} was measured with the task metric {str(recorded)[:200]}; the gate never "
                "runs code named in a ledger: give --task-metric MODULE:FUNC (it is imported and run)"
            )
        return None
    want = settings.get("task_metric_hash")
    got = M.code_hash(task_metric)
    if want and got != want:
        raise UsageError(
            f"--task-metric {task_metric}: its source differs from the task metric ledger row {row['name']!r} "
            f"was measured with ({str(recorded)[:200]}, sha256 {str(want)[:12]}...)"
        )
    if recorded and not want:
        notes.append(f"the ledger recorded no hash of the task metric {recorded}; --task-metric {task_metric} is used as given")
    return M.load_function(task_metric, "--task-metric")


def run_gate(
    candidate: str | os.PathLike[str],
    ledger: Any,
    *,
    baseline: str | None = None,
    max_accuracy_drop: float = DEFAULT_MAX_ACCURACY_DROP,
    max_latency_increase: float = DEFAULT_MAX_LATENCY_INCREASE,
    record: str | None = None,
    blocked: list[str] | None = None,
    progress: Any = None,
    runs: int | None = None,
    repeats: int = DEFAULT_REPEATS,
    task_metric: str | None = None,
    eval_data: str | None = None,
) -> GateResult:
    """Gate ``candidate`` against the ledger (see the module docstring); record it as row ``record`` if given.

    Returns the result when it passes; raises :class:`GateFailed` (with ``result`` attached as
    ``report``) when it does not.  ``task_metric`` / ``eval_data``: code (or data) the *user* names; code
    named in the ledger is never imported (see :func:`_task_metric`).
    """
    from mograph import ir_io
    from mograph.validate import make_feeds
    from mograph.workflow import metrics as M

    cand = Path(candidate)
    if not cand.is_file():
        raise UsageError(f"candidate {cand}: no such file")
    ir_io.load_model(cand)  # a bad candidate is a ModelError (exit 3), before anything else
    if max_accuracy_drop < 0:
        raise UsageError("--max-accuracy-drop must not be negative")
    if runs is not None and runs < 1:
        raise UsageError(f"--runs {runs}: must be at least 1")
    if repeats < 1:
        raise UsageError(f"--repeats {repeats}: must be at least 1")
    if baseline is not None:
        compared = ledger.get(baseline)
    else:
        compared = ledger.baseline()
        if compared is None:
            raise UsageError(f"ledger {ledger.path} has no baseline row: run `mograph sweep` first, or give --baseline NAME")
    if compared.get("status") != "ok":
        raise UsageError(f"ledger row {compared['name']!r} is a failed run: choose another --baseline")
    reference = compared if compared.get("baseline") else ledger.baseline(compared.get("model_hash"))
    if reference is None:
        raise UsageError(f"ledger has no baseline row for the model of {compared['name']!r} (hash {compared.get('model_hash')})")
    ref_path = Path(str(reference.get("model_path") or ""))
    if not ref_path.is_file():
        raise UsageError(f"the baseline model {ref_path} recorded in the ledger is gone; the gate needs it for reference outputs")
    if M.hash_file(ref_path) != reference.get("model_hash"):
        raise UsageError(f"the baseline model {ref_path} changed since the ledger recorded it (hash differs)")
    notes: list[str] = []
    task = _task_metric(compared, task_metric, notes)  # refused before anything is measured
    ref_model = ir_io.load_model(ref_path)
    samples = _eval_samples(compared, ref_model, eval_data)
    settings = compared.get("settings") or {}
    shapes = {k: tuple(v) for k, v in (compared.get("shapes") or {}).items()}
    feed = make_feeds(ref_model, shapes=shapes, seed=int(settings.get("seed") or 0))[0]
    del ref_model
    providers = settings.get("providers") or ([compared["provider"]] if compared.get("provider") else None)
    common = dict(providers=providers, ort_optimizations=bool(settings.get("ort_optimizations", True)),
                  threads=settings.get("threads"), backend=compared.get("backend") or "ort",
                  session_config=settings.get("session_config") or None)
    targets = [M.Target("reference", ref_path, **common), M.Target("candidate", cand, **common)]  # type: ignore[arg-type]
    remeasure = compared is reference
    if not compared.get("baseline"):
        path = compared.get("model_path")
        out_hash = settings.get("output_hash")
        if path and Path(path).is_file() and out_hash and M.hash_file(path) == out_hash:
            targets.append(M.Target("compared", Path(path), **common))  # type: ignore[arg-type]
            remeasure = True
        else:
            notes.append(f"{compared['name']}'s model was not kept: its recorded latency is used, not a fresh one")
    if runs is None:
        runs = max(MIN_RUNS, math.ceil(int(settings.get("iterations", 50)) / repeats))
    measured = M.measure(
        targets, feed, samples, warmup=int(settings.get("warmup", 5)), iterations=runs, repeats=repeats,
        blocked=blocked or [], progress=progress,
    )
    for name in ("reference", "candidate"):
        if measured[name].error:
            raise ModelError(f"{name} model cannot be measured: {measured[name].error}")
    ref_out = measured["reference"].outputs

    def full(name: str) -> dict[str, Any]:
        m = dict(measured[name].metrics)
        m.update(M.accuracy(ref_out, measured[name].outputs))
        if task is not None:
            m.update(M.call_task_metric(task, measured[name].outputs, samples, ref_out))
        return m

    cand_metrics = full("candidate")
    if compared is reference:
        comp_metrics = full("reference")
    elif "compared" in measured and not measured["compared"].error:
        comp_metrics = full("compared")
    else:
        comp_metrics = dict(compared.get("metrics") or {})
        remeasure = False
    metric = "task_metric" if comp_metrics.get("task_metric") is not None else "cosine_mean"
    if metric == "task_metric" and cand_metrics.get(metric) is None:  # never a silent pass on another metric
        raise UsageError(
            f"ledger row {compared['name']!r} has a task metric figure; give --task-metric MODULE:FUNC to measure the "
            "candidate with it (it is imported and run)"
        )
    reasons = []
    drop = None
    if comp_metrics.get(metric) is not None and cand_metrics.get(metric) is not None:
        drop = float(comp_metrics[metric]) - float(cand_metrics[metric])
        if drop > max_accuracy_drop:
            reasons.append(
                f"accuracy: {metric} {cand_metrics[metric]:.6g} vs {comp_metrics[metric]:.6g} of "
                f"'{compared['name']}' (drop {drop:.4g} > {max_accuracy_drop:g})"
            )
    ratio = None
    interval = None
    timing: dict[str, Any] = {"runs": runs, "repeats": repeats, "confidence": CONFIDENCE}
    base_name = "reference" if compared is reference else "compared"
    if remeasure and measured[base_name].latencies and measured["candidate"].latencies:
        ratio, low, high, per_series = latency_interval(measured["candidate"].latencies, measured[base_name].latencies)
        interval = [low, high]
        timing["series_ratios"] = per_series
        timing["candidate_ms"] = [[x * 1000.0 for x in rep] for rep in measured["candidate"].latencies]
        timing["compared_ms"] = [[x * 1000.0 for x in rep] for rep in measured[base_name].latencies]
        if low - 1.0 > max_latency_increase:
            reasons.append(
                f"latency: p50 {cand_metrics['latency_p50_ms']:.3f} ms vs {comp_metrics['latency_p50_ms']:.3f} ms of "
                f"'{compared['name']}' (x{ratio:.3f}, {CONFIDENCE:.0%} interval x{low:.3f}..x{high:.3f} over "
                f"{repeats}x{runs} interleaved runs: at least +{(low - 1) * 100:.1f}% > {max_latency_increase * 100:g}%)"
            )
    elif comp_metrics.get("latency_p50_ms") and cand_metrics.get("latency_p50_ms") is not None:
        ratio = float(cand_metrics["latency_p50_ms"]) / float(comp_metrics["latency_p50_ms"])
        if ratio - 1.0 > max_latency_increase:
            reasons.append(
                f"latency: p50 {cand_metrics['latency_p50_ms']:.3f} ms vs {comp_metrics['latency_p50_ms']:.3f} ms of "
                f"'{compared['name']}' (+{(ratio - 1) * 100:.1f}% > {max_latency_increase * 100:g}%"
                f"{'' if remeasure else ', recorded figure'})"
            )
    result = GateResult(
        passed=not reasons, reasons=reasons, candidate=cand_metrics, compared=comp_metrics,
        compared_name=compared["name"], accuracy_metric=metric, accuracy_drop=drop, latency_ratio=ratio,
        remeasured=remeasure, notes=notes, latency_interval=interval, latency_runs=timing,
    )
    if record:
        result.row_id = ledger.add({
            "name": record, "host": socket.gethostname(), "model_path": str(cand.resolve()),
            "model_hash": M.hash_file(cand), "pipeline": [], "options": {}, "provider": next(iter(measured["candidate"].providers), None),
            "backend": common["backend"], "shapes": compared.get("shapes"), "calib_hash": None,
            "eval_hash": compared.get("eval_hash"), "versions": M.versions(), "metrics": cand_metrics, "baseline": False,
            "settings": {**settings, "gate": {"against": compared["name"], "passed": result.passed, "reasons": reasons},
                         "output_hash": M.hash_file(cand)},
        })
    if reasons:
        raise GateFailed("gate failed: " + "; ".join(reasons), report=result)
    return result
