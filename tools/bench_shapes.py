"""Benchmark: what ``fix-shapes`` + ``cleanup`` buys on a BERT-base export (node count, ONNX Runtime CPU latency).

A ``transformers.BertModel`` with the default ``BertConfig`` (12 layers, hidden 768, 12 heads, FFN 3072,
vocab 30522) and random weights is exported with ``torch.onnx.export`` (TorchScript exporter, opset 17)
with dynamic ``batch`` and ``sequence`` axes.  Three models are measured side by side in one process:

- ``original``: the dynamic export as it is;
- ``cleanup``: the ``cleanup`` preset only (control: what folding does without fixing shapes);
- ``fixed``: ``fix-shapes --shape input_ids:1x128`` followed by the ``cleanup`` preset.

Latency is the median of ``--runs`` timed runs after ``--warmup`` runs, at batch 1 x sequence 128, on
the CPU execution provider, measured round-robin (one run of each model in turn) so that load on the
machine affects all three alike.  It is reported with ONNX Runtime's graph optimizations at their
default (what a deployment runs) and, with ``--ort-opt-off``, also with them disabled.  The outputs of
the fixed model are checked against the original's before timing.

Run:  python tools/bench_shapes.py [--runs 30] [--threads 1] [--ort-opt-off]
Needs: torch, transformers, onnxruntime (``pip install 'mograph[torch,ort]'``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def export_bert_base(path: Path, seed: int = 0) -> None:
    import torch
    from transformers import BertConfig, BertModel

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = BertModel(BertConfig(attn_implementation="eager"))

        def forward(self, input_ids, attention_mask):  # type: ignore[no-untyped-def]
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state, out.pooler_output

    torch.manual_seed(seed)
    model = Wrapped().eval()
    ids = torch.randint(0, 30522, (2, 128))
    mask = torch.ones(2, 128, dtype=torch.int64)
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            model,
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes, "pooler_output": {0: "batch"}},
            opset_version=17,
            dynamo=False,
            do_constant_folding=True,
        )


def session(path: Path, threads: int, optimize: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ort-opt-off", action="store_true", help="also time with ORT graph optimizations disabled")
    args = ap.parse_args()

    import onnx_ir as ir

    from mograph import api, ir_io

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        src = tmp_path / "bert_base.onnx"
        t0 = time.perf_counter()
        export_bert_base(src)
        print(f"exported BERT-base (dynamic batch x sequence) in {time.perf_counter() - t0:.1f}s")

        models = {"original": src}
        variants = {"cleanup": ["cleanup"], "fixed": ["fix-shapes", "cleanup"]}
        nodes = {"original": sum(1 for _ in ir_io.load_model(src).graph)}
        for name, passes in variants.items():
            t0 = time.perf_counter()
            model, report = api.optimize(ir_io.load_model(src), passes, options={"shape": ["input_ids:1x128"]})
            seconds = time.perf_counter() - t0
            out = tmp_path / f"bert_base.{name}.onnx"
            ir_io.save_model(model, out, external_data=True)
            models[name] = out
            nodes[name] = sum(1 for _ in model.graph) if isinstance(model, ir.Model) else len(model.graph.node)
            print(f"{name:>9}: {' -> '.join(p.name for p in report.passes)} in {seconds:.1f}s")

        rng = np.random.default_rng(0)
        feeds = {
            "input_ids": rng.integers(0, 30522, size=(1, 128), dtype=np.int64),
            "attention_mask": np.ones((1, 128), dtype=np.int64),
        }
        settings = [True] + ([False] if args.ort_opt_off else [])
        print(f"\nbatch 1 x sequence 128, CPU, {args.threads} thread(s), median of {args.runs} runs (round-robin)")
        for optimize in settings:
            sessions = {name: session(path, args.threads, optimize) for name, path in models.items()}
            ref = sessions["original"].run(None, feeds)
            for name, s in sessions.items():
                got = s.run(None, feeds)
                diff = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
                if diff > 1e-3:
                    raise SystemExit(f"{name} disagrees with the original: max abs diff {diff}")
            times: dict[str, list[float]] = {name: [] for name in sessions}
            for i in range(args.warmup + args.runs):
                for name, s in sessions.items():
                    t0 = time.perf_counter()
                    s.run(None, feeds)
                    if i >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["original"])
            label = "ORT optimizations ON (default)" if optimize else "ORT optimizations OFF"
            print(f"\n{label}")
            print(f"{'model':>9} {'nodes':>6} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'speedup':>8}")
            for name, ts in times.items():
                ts_sorted = sorted(ts)
                med = statistics.median(ts)
                p10 = ts_sorted[len(ts) // 10]
                p90 = ts_sorted[(9 * len(ts)) // 10]
                print(f"{name:>9} {nodes[name]:>6} {med * 1e3:>10.2f} {p10 * 1e3:>8.2f} {p90 * 1e3:>8.2f} {base / med:>7.3f}x")


if __name__ == "__main__":
    main()
