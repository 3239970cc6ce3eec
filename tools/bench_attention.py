"""Benchmark mograph's attention fusion on BERT-base against ONNX Runtime's transformers optimizer.

One run, side by side, on a BERT-base-shaped ``transformers.BertModel`` (random seeded weights, eager
attention; hidden 768, 12 heads, FFN 3072, ``--layers`` layers, vocab 100: the embedding table's size
does not change the latency) exported with TorchScript at ``--opset`` (default 14):

* ``original``: the export as it is;
* ``mograph``: ``cleanup`` then ``fuse`` (``--target ort``), which now includes ``fuse-attention``;
* ``ort_optimizer``: ``onnxruntime.transformers.optimizer.optimize_model(model_type="bert",
  num_heads=12, hidden_size=768)`` with its default ``opt_level``.

For each it prints the fused-op counts, the max abs error against the original on a padded batch
(ONNX Runtime optimizations off), and the ONNX Runtime CPU latency with ``--threads`` intra-op
threads and graph optimizations ``all`` (as deployed), batch ``--batch`` x ``--seq`` tokens: the
three sessions run in turn within each repetition, and medians are reported with ratios.

Usage::

    python tools/bench_attention.py --layers 12 --repeat 30

Exports are cached in ``--cache`` (default ``/tmp/mograph-bench``).  ``--json FILE`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN, HEADS, FFN, VOCAB, POSITIONS = 768, 12, 3072, 100, 512
ATTENTION_OPS = ("Attention", "MultiHeadAttention")
NORM_OPS = ("LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization")
GELU_OPS = ("Gelu", "FastGelu", "BiasGelu")


def export_bert_base(path: Path, layers: int, opset: int) -> None:
    """TorchScript export of a random-weight BERT-base-shaped BertModel (dynamic batch and sequence)."""
    import torch
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                                     num_attention_heads=HEADS, intermediate_size=FFN,
                                     max_position_embeddings=POSITIONS, attn_implementation="eager")
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
            return out["last_hidden_state"], out["pooler_output"]

    ids = torch.randint(0, VOCAB, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(Wrapper().eval(), (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state", "pooler_output"], opset_version=opset, dynamo=False,
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "last_hidden_state": axes,
                                        "pooler_output": {0: "batch"}}, do_constant_folding=True)


def feeds_for(batch: int, seq: int, seed: int, pad: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    if pad:
        for row in range(1, batch):
            mask[row, int(rng.integers(1, seq)):] = 0
    return {"input_ids": ids, "attention_mask": mask}


def session(proto: onnx.ModelProto, threads: int, level: str):  # noqa: ANN201 - onnxruntime is imported lazily
    from tools.ort_cpu import cpu_session

    return cpu_session(proto, threads, level)


def counts(proto: onnx.ModelProto) -> dict[str, int]:
    ops = Counter(n.op_type for n in proto.graph.node)
    return {"attention": sum(ops[o] for o in ATTENTION_OPS), "softmax": ops["Softmax"],
            "norms": sum(ops[o] for o in NORM_OPS), "gelus": sum(ops[o] for o in GELU_OPS), "nodes": sum(ops.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--opset", type=int, default=14)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ort-level", default="all", choices=["disable", "basic", "all"],
                    help="ONNX Runtime graph optimizations when measuring latency (default: all, as deployed)")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--cache", default="/tmp/mograph-bench")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    import onnx_ir as ir
    from onnxruntime.transformers.optimizer import optimize_model

    from mograph.plugins import get_registry

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"bert_base_torchscript_{args.opset}_L{args.layers}.onnx"
    if not path.exists():
        export_bert_base(path, args.layers, args.opset)
    original = onnx.load(str(path))

    reg = get_registry()
    model = ir.serde.deserialize_model(original)
    t = time.perf_counter()
    for p in reg.instantiate(reg.expand("cleanup") + reg.expand("fuse"), {"target": "ort"}):
        p.call(model)
    mograph_s = time.perf_counter() - t
    ours = ir.serde.serialize_model(model)

    t = time.perf_counter()
    theirs = optimize_model(str(path), model_type="bert", num_heads=HEADS, hidden_size=HIDDEN, use_gpu=False).model
    ort_s = time.perf_counter() - t

    models = {"original": original, "mograph": ours, "ort_optimizer": theirs}
    check = feeds_for(2, 32, seed=1, pad=True)
    ref = session(original, args.threads, "disable").run(None, check)
    errors = {}
    for name in ("mograph", "ort_optimizer"):
        got = session(models[name], args.threads, "disable").run(None, check)
        errors[name] = float(max(np.max(np.abs(r - g)) for r, g in zip(ref, got)))

    feeds = feeds_for(args.batch, args.seq, seed=0, pad=False)
    sessions = {name: session(m, args.threads, args.ort_level) for name, m in models.items()}
    for s in sessions.values():
        for _ in range(3):
            s.run(None, feeds)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    order = list(sessions)
    for rep in range(args.repeat):
        # Rotate the order every repetition: a fixed order was seen to move a model by ~5 %.
        for name in order[rep % len(order):] + order[: rep % len(order)]:
            s = sessions[name]
            t = time.perf_counter()
            s.run(None, feeds)
            times[name].append(time.perf_counter() - t)
    latency = {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}
    row = {
        "layers": args.layers, "opset": args.opset, "batch": args.batch, "seq": args.seq, "threads": args.threads,
        "ort_level": args.ort_level, "repeat": args.repeat,
        "fuse_s": {"mograph": round(mograph_s, 2), "ort_optimizer": round(ort_s, 2)},
        "counts": {name: counts(m) for name, m in models.items()},
        "max_abs_error_padded": errors,
        "latency_ms": latency,
        "ratio_mograph_over_ort_optimizer": round(latency["mograph"] / latency["ort_optimizer"], 3),
        "ratio_original_over_mograph": round(latency["original"] / latency["mograph"], 3),
    }
    for key in ("counts", "max_abs_error_padded", "fuse_s", "latency_ms"):
        sys.stdout.write(f"{key}: {row[key]}\n")
    sys.stdout.write(f"mograph / ort_optimizer latency: {row['ratio_mograph_over_ort_optimizer']}; "
                     f"original / mograph: {row['ratio_original_over_mograph']}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
