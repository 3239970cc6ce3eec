"""Speed-up of ``--executor ray`` on this machine: the sensitivity analysis and a sweep's builds, 1 vs 2 workers.

On real all-MiniLM-L6-v2 (exported from its PyPI package, as ``tools/sweep_minilm.py`` does):

* **sensitivity analysis** — ``qdq-int8 --accuracy-budget cosine>=0.99`` (the per-layer ranking, then
  the search over how many layers stay float, each step an end-to-end evaluation of a Q/DQ build on
  the first calibration samples).  Timed three ways, each in one run of this script: in this process
  (no Ray), and through a local Ray instance with 1 and with 2 worker CPUs (the search then evaluates
  ``width`` mixes per round).  The chosen layers must be the same in all three, and the script checks it.
* **sweep builds** — the five configurations of the MiniLM sweep (fp32 fused, fp16, int8, int8 with
  budget, pruned), each built as one task: in this process, then on Ray with 1 and 2 workers.  Only the
  build phase is timed: measuring stays on the driver in every mode.

Ray start-up (tens of seconds on a loaded 2-core machine) is timed apart and left out of the speed-ups.
The projection to more machines uses the figures measured here: per-evaluation time and the (w+1)-ary
search's round count for the sensitivity analysis; the longest-processing-time schedule of the measured
per-configuration build times for the sweep.

Run: ``python tools/bench_ray.py --out DIR [--samples N] [--skip-sweep]`` (needs ``mograph[ray]`` and the
MiniLM weights package).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BUDGET = "cosine>=0.99"


class Timed:
    """A map function that counts rounds and times them (wraps an executor's map)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.width = inner.width
        self.rounds: list[tuple[int, float]] = []

    def __call__(self, fn: Any, items: list[Any]) -> list[Any]:
        t = time.perf_counter()
        out = self.inner(fn, items)
        self.rounds.append((len(items), time.perf_counter() - t))
        return out


def _search_rounds(n: int, k_star: int, width: int) -> int:
    """Rounds the (width+1)-ary search of passes/quant/sensitivity.py needs when k layers kept meet the
    budget exactly for k >= k_star (monotone)."""
    lo, hi, rounds, seen = -1, n, 0, set()
    while lo + 1 < hi:
        if lo < 0:
            ks = sorted({0} | {hi * (i + 1) // width for i in range(width - 1)} - {hi})
        else:
            ks = sorted({lo + (hi - lo) * (i + 1) // (width + 1) for i in range(width)} - {lo, hi})
        rounds += 1
        seen.update(ks)
        for k in ks:
            if k >= k_star:
                hi = k
                break
            lo = k
    return rounds + (0 if hi in seen else 1)


def sensitivity(model: Path, calib: Path, samples: int) -> dict[str, Any]:
    from mograph import api
    from mograph.workflow.executors import LocalExecutor, RayExecutor, use_executor

    options = {"calibration_data": str(calib), "accuracy_budget": BUDGET, "sensitivity_samples": samples}
    results: dict[str, Any] = {}

    def once(label: str, map_fn: Timed) -> None:
        t = time.perf_counter()
        with use_executor(map_fn):  # type: ignore[arg-type]
            _, report = api.optimize(str(model), ["qdq-int8"], options=options, check_output=False)
        total = time.perf_counter() - t
        p = next(p for p in report.passes if p.name == "qdq-int8")
        budget = p.details["plan"]["accuracy_budget"]
        results[label] = {
            "total_s": total, "search_s": sum(s for _, s in map_fn.rounds), "rounds": len(map_fn.rounds),
            "evaluations": budget["evaluations"], "kept_float": p.stats["kept_float"], "quantized": p.stats["quantized"],
            "measured": budget["measured"],
        }
        print(f"  {label:<16} pass {total:7.1f} s, search {results[label]['search_s']:7.1f} s in "
              f"{len(map_fn.rounds)} rounds / {budget['evaluations']} evaluations; kept float {p.stats['kept_float']}, "
              f"cosine {budget['measured']:.5f}", file=sys.stderr, flush=True)

    once("local", Timed(LocalExecutor().as_map()))
    for workers in (1, 2):
        t = time.perf_counter()
        with RayExecutor(workers=workers) as ex:
            results[f"ray-start-{workers}"] = time.perf_counter() - t
            once(f"ray {workers} worker{'s' if workers > 1 else ''}", Timed(ex.as_map()))
    return results


def sweep_builds(model: Path, config: Path) -> dict[str, Any]:
    from mograph.plugins import get_registry
    from mograph.workflow.executors import RayExecutor
    from mograph.workflow.sweep import BuildJob, build_configuration, check_against_registry, load_config

    sweep = load_config(config)
    pipelines = check_against_registry(sweep)
    reg = get_registry()
    jobs = []
    for c in sweep.configurations:
        options = dict(c.options)
        names = pipelines[c.name]
        if any(any(o.key == "calibration_data" for o in reg.passes[n].options) for n in names):
            options["calibration_data"] = sweep.calibration_data
        jobs.append(BuildJob(c.name, str(model), names, options, [], os.getcwd(), None))
    results: dict[str, Any] = {}
    t = time.perf_counter()
    local = [build_configuration(j) for j in jobs]
    results["local"] = {"total_s": time.perf_counter() - t, "each": {b.name: b.seconds for b in local},
                        "ok": [b.ok for b in local]}
    print(f"  local            {results['local']['total_s']:7.1f} s: "
          + ", ".join(f"{b.name} {b.seconds:.1f}s" for b in local), file=sys.stderr, flush=True)
    hashes = {b.name: _digest(b.files) for b in local}
    for b in local:
        b.files = {}
    for workers in (1, 2):
        t = time.perf_counter()
        with RayExecutor(workers=workers) as ex:
            results[f"ray-start-{workers}"] = time.perf_counter() - t
            t = time.perf_counter()
            built = ex.map(functools.partial(build_configuration, nested=False), jobs)
            label = f"ray {workers} worker{'s' if workers > 1 else ''}"
            results[label] = {"total_s": time.perf_counter() - t, "each": {b.name: b.seconds for b in built},
                              "ok": [b.ok for b in built],
                              "same_models": all(_digest(b.files) == hashes[b.name] for b in built)}
            print(f"  {label:<16} {results[label]['total_s']:7.1f} s: "
                  + ", ".join(f"{b.name} {b.seconds:.1f}s" for b in built), file=sys.stderr, flush=True)
    return results


def _digest(files: dict[str, bytes]) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name])
    return h.hexdigest()


def _lpt(times: list[float], workers: int) -> float:
    loads = [0.0] * workers
    for t in sorted(times, reverse=True):
        loads[loads.index(min(loads))] += t
    return max(loads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the exported model and its data (reused if there)")
    ap.add_argument("--samples", type=int, default=8, help="calibration samples of the sensitivity analysis (default 8)")
    ap.add_argument("--skip-sweep", action="store_true", help="time the sensitivity analysis only")
    ap.add_argument("--skip-sensitivity", action="store_true", help="time the sweep builds only")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from sweep_minilm import prepare

    out = Path(args.out)
    model = prepare(out)
    print(f"machine: {os.cpu_count()} CPU(s) visible; load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    lines = []
    if not args.skip_sensitivity:
        print("sensitivity analysis (qdq-int8 --accuracy-budget cosine>=0.99):", file=sys.stderr)
        s = sensitivity(model, out / "calib", args.samples)
        loc, r1, r2 = s["local"], s["ray 1 worker"], s["ray 2 workers"]
        same = all(x["kept_float"] == loc["kept_float"] and x["measured"] == loc["measured"] for x in (r1, r2))
        n = loc["kept_float"] + loc["quantized"]
        per_eval = loc["search_s"] / max(loc["evaluations"], 1)
        lines += [
            "== sensitivity analysis, all-MiniLM-L6-v2, qdq-int8 --accuracy-budget cosine>=0.99, "
            f"{args.samples} samples, {n} candidate layers",
            f"{'mode':<16} {'pass s':>8} {'search s':>9} {'rounds':>7} {'evals':>6}  speed-up of the search vs ray 1 worker",
        ]
        for label, r in (("local", loc), ("ray 1 worker", r1), ("ray 2 workers", r2)):
            lines.append(f"{label:<16} {r['total_s']:>8.1f} {r['search_s']:>9.1f} {r['rounds']:>7} {r['evaluations']:>6}  "
                         f"x{r1['search_s'] / r['search_s']:.2f}")
        lines.append(f"same layers kept in all three: {same} (kept float {loc['kept_float']}, cosine {loc['measured']:.5f})")
        lines.append(f"whole pass, ray 2 vs 1 worker: x{r1['total_s'] / r2['total_s']:.2f}; Ray start-up "
                     f"{s['ray-start-1']:.1f} s / {s['ray-start-2']:.1f} s (not counted)")
        k_star = loc["kept_float"]
        proj = []
        for w in (1, 2, 4, 8, 16, 32):
            rounds = _search_rounds(n, k_star, w)
            proj.append(f"{w} workers: {rounds} rounds ~{rounds * per_eval:.0f} s")
        lines.append(f"projection (search only, {per_eval:.1f} s per evaluation measured here, rounds of the "
                     f"(w+1)-ary search for this outcome): " + "; ".join(proj))
    if not args.skip_sweep:
        print("sweep builds (5 configurations):", file=sys.stderr)
        b = sweep_builds(model, out / "sweep.yaml")
        loc, r1, r2 = b["local"], b["ray 1 worker"], b["ray 2 workers"]
        lines += [
            "== sweep builds, all-MiniLM-L6-v2, 5 configurations (fp32-fused, fp16, int8, int8-budget, pruned)",
            f"{'mode':<16} {'build s':>8}  speed-up vs ray 1 worker",
        ]
        for label, r in (("local", loc), ("ray 1 worker", r1), ("ray 2 workers", r2)):
            lines.append(f"{label:<16} {r['total_s']:>8.1f}  x{r1['total_s'] / r['total_s']:.2f}")
        lines.append(f"all built: {all(loc['ok'] + r1['ok'] + r2['ok'])}; identical models from Ray and local builds: "
                     f"{r1['same_models'] and r2['same_models']}; Ray start-up {b['ray-start-1']:.1f} s / {b['ray-start-2']:.1f} s (not counted)")
        each = list(loc["each"].values())
        proj = [f"{w} workers ~{_lpt(each, w):.0f} s" for w in (1, 2, 3, 5)]
        lines.append("projection (longest-first schedule of the measured per-configuration build times; the longest, "
                     f"{max(loc['each'], key=loc['each'].get)} {max(each):.0f} s, bounds it): " + "; ".join(proj))
    lines.append(
        "more machines: start Ray on each (`ray start --head` on one, `ray start --address HEAD:6379` on the others, "
        "the same RAY_AUTH_TOKEN everywhere), then `mograph sweep ... --executor ray --address HEAD:6379`; every "
        "configuration is one task and every round of the sensitivity search runs `width` (= cluster CPUs) evaluations "
        "at once, so configurations scale until each has a worker and the search until its rounds stop shrinking "
        "(log base w+1 of the layer count); the model and data paths must be readable on every node."
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
