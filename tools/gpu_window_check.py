"""Which keys ONNX Runtime's ``GroupQueryAttention`` keeps for ``local_window_size`` W, on each provider.

mograph writes a sliding-window layer (Mistral, Gemma 2/3: the mask keeps ``q_idx - W < kv_idx <= q_idx``) as
``local_window_size`` W; that is exact only where the kernel keeps the last W keys (not W + 1).  This runs one
float16 GroupQueryAttention node (prefill and a decode step over a past) on every provider given and compares it
with NumPy attention over a band of W and of W + 1 keys; then, with ``--gemma3``, the committed Gemma 3 optimum
export (window 3) fused with ``--mask-format lengths`` and ``fp16`` against the float32 export on the CPU;
with ``--decoders``, every committed optimum export (tests/data/decoders), default and ``lengths`` forms.

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


DECODERS = Path(__file__).resolve().parents[1] / "tests" / "data" / "decoders"
#: The forms ``--decoders`` checks: the default (padding check), lengths, and the rotary inside (position_ids assumed).
DECODER_FORMS = [{}, {"mask_format": "lengths"}, {"mask_format": "lengths", "position_ids": "cache"}]


def decoder_rows(path: Path, providers: list[str], options: dict) -> list[dict]:
    """A committed optimum export, fused with ``options`` and ``fp16``, against the float32 export on the CPU: a
    9-token prompt then a token step over the export's presents (the optimized graph's own presents fed back)."""
    import onnxruntime as ort

    import mograph

    src = onnx.load(path)
    model, _ = mograph.optimize(onnx.load(path), passes=["cleanup", "fuse", "fp16"],
                                options={"target": "ort", "calibration_random": 4, **options})
    ref = ort.InferenceSession(src.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in ref.get_inputs()}
    rng = np.random.default_rng(0)
    names = [n for n in inputs if n.startswith("past_key_values")]
    kv, head = inputs[names[0]].shape[1], inputs[names[0]].shape[3]
    b, s = 2, 9

    def feeds_for(ids: np.ndarray, past: list[np.ndarray] | None) -> dict:
        p = past[0].shape[2] if past else 0
        f = {"input_ids": ids, "attention_mask": np.ones((b, p + ids.shape[1]), np.int64)}
        if "position_ids" in inputs:
            f["position_ids"] = np.tile(np.arange(p, p + ids.shape[1], dtype=np.int64), (b, 1))
        for i, n in enumerate(names):
            f[n] = past[i] if past else np.zeros((b, kv, 0, head), np.float32)
        return f

    prompt = feeds_for(rng.integers(0, 100, (b, s)), None)
    want = ref.run(None, prompt)
    step_ids = rng.integers(0, 100, (b, 1))
    want_dec = ref.run(None, feeds_for(step_ids, want[1:]))
    rows = []
    for prov in providers:
        so = ort.SessionOptions()
        if prov != "CPUExecutionProvider":
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        try:
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=[prov])
            all_on = True
        except Exception:  # noqa: BLE001 - some node has no kernel on this provider: run with the CPU beside it
            sess = ort.InferenceSession(model.SerializeToString(), providers=[prov, "CPUExecutionProvider"])
            all_on = False
        types = {i.name: i.type for i in sess.get_inputs()}

        def conv(f: dict, types: dict = types) -> dict:
            return {k: (v.astype(np.float16) if "float16" in types[k] else v) for k, v in f.items()}

        got = sess.run(None, conv(prompt))
        got_dec = sess.run(None, conv(feeds_for(step_ids, [g.astype(np.float32) for g in got[1:]])))
        rows.append({"model": path.stem, "options": options, "provider": prov, "every_node_on_provider": all_on,
                     "prefill_logits_max_abs": float(np.abs(got[0].astype(np.float32) - want[0]).max()),
                     "decode_logits_max_abs": float(np.abs(got_dec[0].astype(np.float32) - want_dec[0]).max()),
                     "logits_peak": float(np.abs(want[0]).max())})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--providers", default="CPUExecutionProvider")
    ap.add_argument("--windows", default="2,3")
    ap.add_argument("--gemma3", action="store_true", help="the Gemma 3 export (window 3) only, --mask-format lengths")
    ap.add_argument("--decoders", action="store_true",
                    help="every committed optimum export, default and --mask-format lengths forms")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401  (lets the CUDA provider find cuDNN / cuBLAS)
    except ImportError:
        pass
    provs = args.providers.split(",")
    for w in (int(x) for x in args.windows.split(",")):
        for row in one_node(provs, w):
            print(json.dumps(row))
    paths = sorted(DECODERS.glob("*optimum*.onnx"))
    if args.gemma3 or args.decoders:
        for path in paths if args.decoders else [p for p in paths if "gemma3" in p.name]:
            for options in (DECODER_FORMS if args.decoders else [{"mask_format": "lengths"}]):
                for row in decoder_rows(path, provs, options):
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
