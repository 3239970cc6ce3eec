"""INT8 on real all-MiniLM-L6-v2, ONNX Runtime CPU: mograph's defaults against the peers, in one run.

Rows, all from the same exported FP32 model and the same calibration feeds:

- ``mograph int8``: ``qdq-int8`` with calibration data and no other option (what ``--passes int8`` does:
  float layers chosen by measured sensitivity for the default budget, see :mod:`mograph.passes.quant.sensitivity`);
- ``mograph int8 rules`` and ``mograph int8 no-smooth`` (``--ablations``): the same with
  ``accuracy_budget=off`` (float layers by the default rules) and with ``smoothing=off``;
- ``ort dynamic``: ``quantize_dynamic`` (per-channel, QInt8 weights);
- ``ort static``: ``quantize_static`` (QDQ, per-channel weights) at several settings — its defaults (every
  op type it quantizes); MatMul only (``op_types_to_quantize``) with the MinMax, Entropy and Percentile
  calibrators (UINT8 activations; the histogram ones calibrate on feeds padded to 128, as they need one
  shape) and MinMax with symmetric INT8 activations; and weight MatMuls only (``w-mm``: the attention
  MatMuls of two activations excluded, as mograph's rules do) with MinMax, Percentile and Entropy; the best
  of them (highest minimum cosine) is timed (marked ``*``);
- ``modelopt int8``: NVIDIA ModelOpt's ONNX INT8 (``modelopt.onnx.quantization.quantize``, CPU calibration,
  max calibrator, float32 kept where it does not quantize), at its defaults and with MatMul only; run in its
  own venv (``.venv-modelopt``, made by ``tools/make_modelopt_venv.sh``, since it brings onnxruntime-gpu
  and a CUDA torch) by ``tools/modelopt_int8.py``; evaluated here with the same ONNX Runtime as every
  other row; the better of the two is timed (marked ``*``).

Data: calibration on ``models.sentences.CALIBRATION_ALL`` (124 short sentences and passages, batch 1, no
padding); accuracy on every text of ``models.sentences.EVALUATION_ALL`` that is 5..128 tokens long (disjoint
from the calibration set): mean-pooled sentence embeddings against FP32 (FP32 with ORT optimizations off,
quantized models as they run, optimizations on), mean and minimum cosine.

Latency: ONNX Runtime CPU, all graph optimizations on, 2 intra-op threads, batch 8 and batch 1 at sequence
128 (real evaluation texts padded to 128), all models in this one process, timed in interleaved rounds
(:func:`bench_quant.interleaved_rounds`: each round runs every model ``--reps`` times per batch, the model
order rotating, and keeps the median); ``x fp32`` is the median over ``--rounds`` rounds of the ratio to
FP32 measured in the same round, with the spread (min-max of those per-round ratios) beside it.  The load
average of the machine before and after timing is printed: on a loaded machine the ratios are not the
figures to quote.

Run: ``python tools/bench_int8.py [--out DIR] [--rounds N] [--reps N] [--ablations] [--fp32 MODEL.onnx]
[--no-modelopt]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_quant import _embeddings, _session, calibration_reader, interleaved_rounds, round_ratios  # noqa: E402

from models import minilm  # noqa: E402

SEQ = 128
MODELOPT_PY = ROOT / ".venv-modelopt" / "bin" / "python"


def _activation_matmuls(path: Path) -> list[str]:
    """Names of the MatMuls of two activations (attention scores and context) in the model at ``path``."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    consts = {i.name for i in model.graph.initializer}
    consts |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and not any(i in consts for i in n.input)]


def _static_configs(fp32: Path) -> list[tuple[str, dict[str, Any], bool]]:
    """(label, quantize_static options, calibrate on feeds padded to 128) for each ORT static setting."""
    from onnxruntime.quantization import CalibrationMethod, QuantType

    u8 = {"activation_type": QuantType.QUInt8, "weight_type": QuantType.QInt8}
    mm = {"op_types_to_quantize": ["MatMul"]}
    weights_only = {**mm, "nodes_to_exclude": _activation_matmuls(fp32)}  # as mograph: attention MatMuls float
    return [
        ("ort static minmax u8 w-mm", {**u8, **weights_only, "calibrate_method": CalibrationMethod.MinMax}, False),
        ("ort static percentile u8 w-mm", {**u8, **weights_only, "calibrate_method": CalibrationMethod.Percentile},
         True),
        ("ort static entropy u8 w-mm", {**u8, **weights_only, "calibrate_method": CalibrationMethod.Entropy}, True),
        ("ort static minmax u8 all-ops", {**u8, "calibrate_method": CalibrationMethod.MinMax}, False),
        ("ort static minmax u8", {**u8, **mm, "calibrate_method": CalibrationMethod.MinMax}, False),
        # ORT's histogram calibrators stack the samples: they need feeds of one shape (padded to 128)
        ("ort static entropy u8", {**u8, **mm, "calibrate_method": CalibrationMethod.Entropy}, True),
        ("ort static percentile u8", {**u8, **mm, "calibrate_method": CalibrationMethod.Percentile}, True),
        ("ort static minmax s8 sym", {"activation_type": QuantType.QInt8, "weight_type": QuantType.QInt8, **mm,
                                      "calibrate_method": CalibrationMethod.MinMax,
                                      "extra_options": {"ActivationSymmetric": True}}, False),
    ]


def _run_modelopt(fp32: Path, calib: list[dict], out: Path, matmul_only: bool) -> tuple[Path | None, str]:
    """Quantize with ModelOpt in its own venv; (path, "") or (None, why not)."""
    if not MODELOPT_PY.exists():
        return None, f"not run: {MODELOPT_PY} missing (bash tools/make_modelopt_venv.sh)"
    folder = out / "calib_npz"
    folder.mkdir(exist_ok=True)
    for i, feed in enumerate(calib):
        np.savez(folder / f"{i:04d}.npz", **feed)
    target = out / f"minilm.modelopt_int8{'_matmul' if matmul_only else ''}.onnx"
    cmd = [str(MODELOPT_PY), str(ROOT / "tools" / "modelopt_int8.py"), str(fp32), str(folder), str(target)]
    proc = subprocess.run(cmd + (["--matmul-only"] if matmul_only else []), capture_output=True, text=True)
    if proc.returncode != 0 or not target.exists():
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return None, f"failed (exit {proc.returncode}): {tail[:400]}"
    return target, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the models and results.json (default: a temporary folder)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (each runs every model)")
    ap.add_argument("--reps", type=int, default=3, help="runs per model, batch and round (their median is kept)")
    ap.add_argument("--ablations", action="store_true",
                    help="add mograph int8 with the default rules instead of the measured float layers, and with "
                         "smoothing off")
    ap.add_argument("--fp32", help="use this exported FP32 MiniLM instead of exporting it again")
    ap.add_argument("--no-modelopt", action="store_true", help="leave ModelOpt out")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging
    import warnings

    # quiet: ONNX Runtime's quantizers log advice through the root logger; export warnings are not results
    logging.getLogger().setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import onnx_ir as ir
    from mograph.passes.quant.qdq_int8 import QdqInt8Pass
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    from models.sentences import CALIBRATION_ALL, EVALUATION_ALL
    from mograph.plugins import get_registry

    out = Path(args.out or tempfile.mkdtemp(prefix="bench_int8_"))
    out.mkdir(parents=True, exist_ok=True)
    tok = minilm.load_tokenizer()
    fp32 = Path(args.fp32) if args.fp32 else minilm.export_minilm(out / "minilm.fp32.onnx")
    calib = [minilm.tokenize(tok, [s]) for s in CALIBRATION_ALL]
    evaluation = [f for f in (minilm.tokenize(tok, [s]) for s in EVALUATION_ALL) if 5 <= f["input_ids"].shape[1] <= SEQ]
    lengths = [f["input_ids"].shape[1] for f in evaluation]
    lat_feeds = {b: minilm.tokenize(tok, list(EVALUATION_ALL[-b:]), pad_to=SEQ) for b in (8, 1)}
    paths: dict[str, Path] = {"fp32": fp32}
    seconds: dict[str, float] = {}
    notes: dict[str, str] = {}

    mograph_rows: list[tuple[str, dict[str, Any]]] = [("mograph int8", {})]
    if args.ablations:
        mograph_rows.append(("mograph int8 rules", {"accuracy_budget": "off"}))
        mograph_rows.append(("mograph int8 no-smooth", {"smoothing": "off"}))
    plan = None
    for label, extra in mograph_rows:
        model = ir.load(str(fp32))
        t = time.perf_counter()
        result = QdqInt8Pass(calibration_data=calib, **extra, registry=get_registry()).call(model)
        seconds[label] = time.perf_counter() - t
        path = out / f"minilm.{label.replace(' ', '_')}.onnx"
        ir.save(model, str(path))
        paths[label] = path
        if plan is None:
            plan = result.details["plan"]
            (out / "mograph_int8_plan.json").write_text(json.dumps(plan, indent=1))

    padded = [minilm.tokenize(tok, [s], pad_to=SEQ) for s in CALIBRATION_ALL]

    t = time.perf_counter()
    quantize_dynamic(str(fp32), str(out / "minilm.ort_dynamic.onnx"), weight_type=QuantType.QInt8, per_channel=True)
    seconds["ort dynamic"] = time.perf_counter() - t
    paths["ort dynamic"] = out / "minilm.ort_dynamic.onnx"
    static_labels = []
    for label, cfg, pad in _static_configs(fp32):
        target = out / f"minilm.{label.replace(' ', '_')}.onnx"
        t = time.perf_counter()
        try:
            quantize_static(str(fp32), str(target), calibration_reader(padded if pad else calib), quant_format=QuantFormat.QDQ,
                            per_channel=True, **cfg)
        except Exception as exc:  # noqa: BLE001 - a peer setting that fails is reported, not fatal
            notes[label] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        seconds[label] = time.perf_counter() - t
        paths[label] = target
        static_labels.append(label)
    modelopt_labels = []
    for label, matmul_only in (("modelopt int8", False), ("modelopt int8 matmul", True)):
        if args.no_modelopt:
            break
        t = time.perf_counter()
        mo, why = _run_modelopt(fp32, calib, out, matmul_only)
        if mo is not None:
            seconds[label] = time.perf_counter() - t
            paths[label] = mo
            modelopt_labels.append(label)
        else:
            notes[label] = why

    ref = _embeddings(_session(fp32, optimize=False), evaluation)
    cos = {label: minilm.cosine_rows(ref, _embeddings(_session(p), evaluation)) for label, p in paths.items()}
    def best(labels: list[str]) -> str | None:
        return max(labels, key=lambda k: (round(float(cos[k].min()), 5), float(cos[k].mean())), default=None)

    best_static, best_mo = best(static_labels), best(modelopt_labels)
    timed = [k for k in paths if (k not in static_labels and k not in modelopt_labels) or k in (best_static, best_mo)]
    sessions = {k: _session(paths[k]) for k in timed}
    load_before = os.getloadavg()
    t = time.perf_counter()
    times = interleaved_rounds(sessions, lat_feeds, args.rounds, args.reps)
    timing_s = time.perf_counter() - t
    load_after = os.getloadavg()
    ratios = round_ratios(times)
    lat = {k: {b: float(np.median(v)) for b, v in per.items()} for k, per in times.items()}

    print(f"all-MiniLM-L6-v2 (real weights), ONNX Runtime CPU, 2 threads; accuracy over {len(evaluation)} evaluation "
          f"texts ({min(lengths)}..{max(lengths)} tokens, mean {np.mean(lengths):.1f}), calibration on "
          f"{len(calib)} other texts")  # fmt: skip
    print(f"latency: seq {SEQ}, {args.rounds} interleaved rounds x {args.reps} runs (median per round), after 3 "
          f"warm-up runs; x fp32: median of the per-round ratios [min-max]; load average {load_before[0]:.1f} "
          f"before, {load_after[0]:.1f} after timing on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'model':<28}{'cos mean':>9}{'cos min':>9}{'b8 ms':>8}{'b8 x fp32':>20}{'b1 ms':>7}{'b1 x fp32':>20}"
          f"{'MiB':>7}{'quant s':>9}")  # fmt: skip
    rows = []
    for label, path in paths.items():
        c = cos[label]
        row: dict[str, Any] = {"model": label, "cos_mean": float(c.mean()), "cos_min": float(c.min()),
                               "mib": path.stat().st_size / 2**20, "quant_s": seconds.get(label)}
        name = f"{label} *" if label in (best_static, best_mo) else label
        line = f"{name:<28}{c.mean():>9.5f}{c.min():>9.5f}"
        if label in lat:
            for b in (8, 1):
                med, lo, hi = ratios[label][b]
                row.update({f"b{b}_ms": lat[label][b], f"b{b}_x": med, f"b{b}_x_min": lo, f"b{b}_x_max": hi,
                            f"b{b}_ms_rounds": times[label][b]})
                line += f"{lat[label][b]:>{8 if b == 8 else 7}.1f}{f'{med:.3f} [{lo:.3f}-{hi:.3f}]':>20}"
        else:
            line += f"{'-':>8}{'-':>20}{'-':>7}{'-':>20}"
        q = f"{seconds[label]:.1f}" if label in seconds else "-"
        print(f"{line}{row['mib']:>7.1f}{q:>9}")
        rows.append(row)
    print(f"* best ort static / modelopt setting (highest min cosine), the ones timed; timing took {timing_s:.0f} s")
    for label, why in notes.items():
        print(f"{label}: {why}")
    if plan is not None:
        sm = plan.get("smoothing", {}).get("activations", [])
        alphas: dict[float, int] = {}
        for rec in sm:
            alphas[rec["alpha"]] = alphas.get(rec["alpha"], 0) + 1
        prec: dict[str, int] = {}
        for e in plan["nodes"]:
            if e["op"] in ("MatMul", "Gemm", "Conv"):
                prec[e["precision"]] = prec.get(e["precision"], 0) + 1
        print(f"mograph int8 default plan: MatMul precisions {prec}; smoothed activations {len(sm)}, alpha counts "
              f"{dict(sorted(alphas.items()))}; plan in {out / 'mograph_int8_plan.json'}")  # fmt: skip
        budget = plan.get("accuracy_budget")
        if budget:
            print(f"  float layers chosen for {budget['budget']} on {budget['samples']} calibration samples: "
                  f"{budget['kept_float']} kept float, measured {budget['measured']} ({budget['evaluations']} "
                  f"end-to-end evaluations; metric by layers kept float {budget['metric_by_kept_float']})")
            for e in plan["nodes"]:
                if e["op"] in ("MatMul", "Gemm", "Conv") and e["precision"] == "fp32":
                    print(f"  fp32 {e['node']}: {e['reason']}")
    (out / "results.json").write_text(json.dumps({"rows": rows, "notes": notes, "eval_texts": len(evaluation),
                                                  "calib_texts": len(calib), "rounds": args.rounds, "reps": args.reps,
                                                  "load_before": load_before, "load_after": load_after}, indent=1))
    print(f"models and results.json in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
