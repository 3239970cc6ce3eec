"""Which keys ONNX Runtime's ``GroupQueryAttention`` keeps for ``local_window_size`` W, on each provider.

mograph writes a sliding-window layer (Mistral, Gemma 2/3: the mask keeps ``q_idx - W < kv_idx <= q_idx``) as
``local_window_size`` W; that is exact only where the kernel keeps the last W keys (not W + 1).  This runs one
float16 GroupQueryAttention node (prefill and a decode step over a past) on every provider given and compares it
with NumPy attention over a band of W and of W + 1 keys; then, with ``--gemma3``, the committed Gemma 3 optimum
export (window 3) fused with ``--mask-format lengths`` and ``fp16`` against the float32 export on the CPU.

    python tools/gpu_window_check.py --providers CUDAExecutionProvider,CPUExecutionProvider --gemma3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

HEADS, KV, HEAD = 4, 2, 16


def gqa_model(window: int) -> onnx.ModelProto:
    f16, i32 = TensorProto.FLOAT16, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("query", f16, ["B", "S", HEADS * HEAD]),
              helper.make_tensor_value_info("key", f16, ["B", "S", KV * HEAD]),
              helper.make_tensor_value_info("value", f16, ["B", "S", KV * HEAD]),
              helper.make_tensor_value_info("past_key", f16, ["B", KV, "P", HEAD]),
              helper.make_tensor_value_info("past_value", f16, ["B", KV, "P", HEAD]),
              helper.make_tensor_value_info("seqlens_k", i32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", i32, [])]
    outputs = [helper.make_tensor_value_info("out", f16, None),
               helper.make_tensor_value_info("present_key", f16, None),
               helper.make_tensor_value_info("present_value", f16, None)]
    node = helper.make_node("GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV, local_window_size=window)
    graph = helper.make_graph([node], "gqa_window", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=9)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, keep: int) -> np.ndarray:
    """Causal attention where query at absolute position i sees keys ``i - keep < j <= i``."""
    b, s, _ = q.shape
    t = k.shape[2]
    qh = q.astype(np.float64).reshape(b, s, HEADS, HEAD).transpose(0, 2, 1, 3)
    rep = HEADS // KV
    kh = np.repeat(k.astype(np.float64), rep, axis=1)
    vh = np.repeat(v.astype(np.float64), rep, axis=1)
    scores = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(HEAD)
    i = past + np.arange(s)[:, None]
    j = np.arange(t)[None, :]
    scores = np.where((j <= i) & (j > i - keep), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w @ vh).transpose(0, 2, 1, 3).reshape(b, s, HEADS * HEAD)


def one_node(providers: list[str], window: int) -> list[dict]:
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    rows = []
    data = gqa_model(window).SerializeToString()
    b, s0 = 2, 7
    q0 = rng.standard_normal((b, s0, HEADS * HEAD)).astype(np.float16)
    k0 = rng.standard_normal((b, s0, KV * HEAD)).astype(np.float16)
    v0 = rng.standard_normal((b, s0, KV * HEAD)).astype(np.float16)
    q1 = rng.standard_normal((b, 1, HEADS * HEAD)).astype(np.float16)
    k1 = rng.standard_normal((b, 1, KV * HEAD)).astype(np.float16)
    v1 = rng.standard_normal((b, 1, KV * HEAD)).astype(np.float16)
    heads = lambda x: x.reshape(b, -1, KV, HEAD).transpose(0, 2, 1, 3)  # noqa: E731
    for prov in providers:
        sess = ort.InferenceSession(data, providers=[prov])
        empty = np.zeros((b, KV, 0, HEAD), np.float16)
        pre = sess.run(None, {"query": q0, "key": k0, "value": v0, "past_key": empty, "past_value": empty,
                              "seqlens_k": np.full(b, s0 - 1, np.int32),
                              "total_sequence_length": np.array(s0, np.int32)})
        dec = sess.run(None, {"query": q1, "key": k1, "value": v1, "past_key": pre[1], "past_value": pre[2],
                              "seqlens_k": np.full(b, s0, np.int32),
                              "total_sequence_length": np.array(s0 + 1, np.int32)})
        kall = np.concatenate([heads(k0), heads(k1)], axis=2)
        vall = np.concatenate([heads(v0), heads(v1)], axis=2)
        row = {"provider": prov, "window": window}
        for keep in (window, window + 1):
            want_pre = reference(q0, heads(k0), heads(v0), 0, keep)
            want_dec = reference(q1, kall, vall, s0, keep)
            row[f"prefill_vs_{keep}_keys"] = float(np.abs(pre[0].astype(np.float64) - want_pre).max())
            row[f"decode_vs_{keep}_keys"] = float(np.abs(dec[0].astype(np.float64) - want_dec).max())
        rows.append(row)
    return rows


def gemma3(providers: list[str]) -> list[dict]:
    """The committed Gemma 3 optimum export (window 3), fused and fp16, against the float32 export on the CPU."""
    import onnxruntime as ort

    import mograph

    path = Path(__file__).resolve().parents[1] / "tests" / "data" / "decoders" / "gemma3_sliding_optimum_transformers457.onnx"
    src = onnx.load(path)
    model, _ = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse", "fp16"],
                                options={"target": "ort", "mask_format": "lengths", "calibration_random": 4})
    ref = ort.InferenceSession(src.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    names = [i.name for i in ref.get_inputs() if i.name.startswith("past_key_values")]
    b, s = 2, 9
    ids = rng.integers(0, 100, (b, s))
    feeds = {"input_ids": ids, "attention_mask": np.ones((b, s), np.int64)}
    for n in names:
        feeds[n] = np.zeros((b, 2, 0, 16), np.float32)
    want = ref.run(None, feeds)
    dec = {"input_ids": rng.integers(0, 100, (b, 1)), "attention_mask": np.ones((b, s + 1), np.int64)}
    for n, p in zip(names, want[1:]):
        dec[n] = p
    want_dec = ref.run(None, dec)
    rows = []
    for prov in providers:
        sess = ort.InferenceSession(model.SerializeToString(), providers=[prov])
        cast = {i.name: i.type for i in sess.get_inputs()}

        def conv(f: dict, cast: dict = cast) -> dict:
            return {k: (v.astype(np.float16) if "float16" in cast[k] else v) for k, v in f.items()}

        got = sess.run(None, conv(feeds))
        dec_o = dict(dec)
        for n, p in zip(names, got[1:]):
            dec_o[n] = p.astype(np.float32)
        got_dec = sess.run(None, conv(dec_o))
        rows.append({"provider": prov, "gemma3_prefill_logits_max_abs": float(np.abs(got[0].astype(np.float32) - want[0]).max()),
                     "gemma3_decode_logits_max_abs": float(np.abs(got_dec[0].astype(np.float32) - want_dec[0]).max()),
                     "logits_peak": float(np.abs(want[0]).max())})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", default="CPUExecutionProvider")
    ap.add_argument("--windows", default="2,3")
    ap.add_argument("--gemma3", action="store_true")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401  (lets the CUDA provider find cuDNN / cuBLAS)
    except ImportError:
        pass
    provs = args.providers.split(",")
    for w in (int(x) for x in args.windows.split(",")):
        for row in one_node(provs, w):
            print(json.dumps(row))
    if args.gemma3:
        for row in gemma3(provs):
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
