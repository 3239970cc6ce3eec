"""FP8 KV cache (``kv-cache-fp8``) judged by next-token agreement with the FP32 cache, on ONNX Runtime CPU.

No trained transformer decoder can be downloaded here and none that a package ships was found, so this script
**trains a tiny character-level GPT-2 itself** (``transformers.GPT2LMHeadModel``, 2 layers, hidden 128, 4 heads,
context 128; seeded, torch on 1 thread, a few minutes) on the calibration half of ``models/sentences.py``
(``CALIBRATION_ALL``) and holds out the evaluation half (``EVALUATION_ALL``).  It is tiny and self-trained:
the figures say how FP8 rounding of its cache moves its predictions, not how a production LLM behaves.
A second data point is a random-weight LLaMA-style decoder (2 layers, hidden 256, 8 query / 2 KV heads of 32,
``initializer_range`` 0.1 so its logits are not flat) on random tokens.

Each model is exported as one decode step with a KV cache (``input_ids`` ``[B, 1]``, ``attention_mask``,
``past_key_i``/``past_value_i`` in; ``logits``, ``present_*`` out), then ``kv-cache-fp8`` is applied with
calibration on decode steps of training text (``--kv-cache-io float``: simulated; ``fp8``: stored, the cache
fed back between steps as FP8 bytes), per KV head and per tensor.  Compared side by side in one run:

- FP32 cache (the reference) and an FP16 cache (the FP32 model, its presents rounded to FP16 between steps);
- teacher-forced top-1 agreement with the FP32 cache over held text (every position of every chunk), and each
  variant's own top-1 accuracy and mean negative log-likelihood (nats per token) of the true next token;
- greedy generation of N tokens from many held-text prompts, each variant feeding back its own cache:
  tokens equal to the FP32 run's at the same position, continuations identical end to end, mean first
  divergence;
- the cache's size for the whole generated context (bytes of the presents the session returned).

Run: ``OMP_NUM_THREADS=1 nice .venv/bin/python tools/bench_kv_cache_fp8.py`` (``--quick`` for a smoke run;
the trained weights are kept in ``--work`` so a second run does not train again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FP8_TYPE = 17  # onnx.TensorProto.FLOAT8E4M3FN
EAGER: dict[str, Any] = {"attn_implementation": "eager"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- the tiny GPT-2


def _text() -> tuple[str, str]:
    from models import sentences

    return " ".join(sentences.CALIBRATION_ALL), " ".join(sentences.EVALUATION_ALL)


def _vocab(train: str, held: str) -> dict[str, int]:
    chars = sorted(set(train) | set(held))
    return {c: i for i, c in enumerate(chars)}


def train_gpt2(work: Path, steps: int, seed: int = 0) -> tuple[Any, dict[str, int]]:
    import torch
    import transformers as tf

    train, held = _text()
    stoi = _vocab(train, held)
    cfg = tf.GPT2Config(vocab_size=len(stoi), n_embd=128, n_layer=2, n_head=4, n_inner=512, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **EAGER)
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(cfg)
    ckpt = work / f"gpt2-char-{steps}-{seed}.pt"
    if ckpt.exists():
        model.load_state_dict(torch.load(ckpt))
        log(f"loaded trained weights {ckpt}")
    else:
        data = torch.tensor([stoi[c] for c in train], dtype=torch.long)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
        gen = torch.Generator().manual_seed(seed)
        model.train()
        t0 = time.time()
        for step in range(steps):
            idx = torch.randint(0, len(data) - 64, (32,), generator=gen)
            batch = torch.stack([data[i:i + 64] for i in idx])
            loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels by one
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 100 == 0 or step == steps - 1:
                log(f"train step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
        torch.save(model.state_dict(), ckpt)
    model.eval()
    return model, stoi


def random_llama(seed: int = 0) -> Any:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=100, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=256,
                         initializer_range=0.1, **EAGER)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg)
    model.eval()
    return model


# --------------------------------------------------------------------------------------- export


def export_decode_step(model: Any, path: Path) -> list[str]:
    """One decode step with a KV cache; returns the cache input names."""
    import torch
    import transformers as tf

    cfg = model.config
    layers = cfg.num_hidden_layers
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = cfg.hidden_size // cfg.num_attention_heads

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: Any, mask: Any, *past: Any) -> Any:
            cache = tf.DynamicCache(config=cfg)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                             return_dict=True)
            c = out.past_key_values
            flat = []
            for i in range(layers):
                flat += [c.layers[i].keys, c.layers[i].values]
            return (out.logits, *flat)

    past_names = [f"past_{n}_{i}" for i in range(layers) for n in ("key", "value")]
    names = ["input_ids", "attention_mask", *past_names]
    outputs = ["logits", *[n.replace("past", "present") for n in past_names]]
    b, p = 2, 5
    args = (torch.zeros((b, 1), dtype=torch.long), torch.ones((b, p + 1), dtype=torch.long),
            *[torch.randn(b, kv, p, dim) for _ in past_names])
    axes: dict[str, dict[int, str]] = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"},
                                       "logits": {0: "batch"}}
    axes.update({n: {0: "batch", 2: "past"} for n in past_names})
    axes.update({n: {0: "batch", 2: "total"} for n in outputs[1:]})
    from models.attention_corpus import _no_packed_sequences

    with torch.no_grad(), _no_packed_sequences():
        torch.onnx.export(Step().eval(), args, str(path), input_names=names, output_names=outputs, opset_version=17,
                          dynamo=False, dynamic_axes=axes, do_constant_folding=True)
    return past_names


# --------------------------------------------------------------------------------------- decoding


class Decoder:
    """Decode steps on one ONNX Runtime CPU session; ``cache``: fp32, fp16 (rounded between steps), fp8 (stored)."""

    def __init__(self, model_bytes: bytes, past_names: list[str], cache: str, kv: int, dim: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.intra_op_num_threads = 1
        self.ort = ort
        self.sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        self.past_names, self.cache, self.kv, self.dim = past_names, cache, kv, dim
        self.out_names = [o.name for o in self.sess.get_outputs()]

    def start(self, batch: int) -> dict[str, Any]:
        if self.cache == "fp8":
            z = np.zeros((batch, self.kv, 0, self.dim), np.uint8)
            return {n: z for n in self.past_names}
        return {n: np.zeros((batch, self.kv, 0, self.dim), np.float32) for n in self.past_names}

    def step(self, ids: np.ndarray, past: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
        total = next(iter(past.values())).shape[2] + 1
        feed: dict[str, Any] = {"input_ids": ids.reshape(-1, 1).astype(np.int64),
                                "attention_mask": np.ones((ids.shape[0], total), np.int64)}
        for n, v in past.items():
            feed[n] = (self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(v), FP8_TYPE)
                       if self.cache == "fp8" else v)
        outs = dict(zip(self.out_names, self.sess.run(None, feed)))
        new = {}
        for n in self.past_names:
            v = outs[n.replace("past", "present")]
            new[n] = v.astype(np.float16).astype(np.float32) if self.cache == "fp16" else v
        return outs["logits"][:, -1, :], new


def teacher_forced(dec: Decoder, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """Top-1 prediction at every position of ``tokens`` [B, T] (fed the true tokens), and the mean negative
    log-likelihood (nats) of the true next token at positions 0..T-2."""
    past = dec.start(tokens.shape[0])
    preds = []
    nll = []
    for t in range(tokens.shape[1]):
        logits, past = dec.step(tokens[:, t], past)
        preds.append(logits.argmax(-1))
        if t + 1 < tokens.shape[1]:
            z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
            nll.append(-logp[np.arange(len(z)), tokens[:, t + 1]])
    return np.stack(preds, 1), float(np.mean(nll))


def greedy(dec: Decoder, prompts: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """``n`` greedy tokens after each prompt [B, P]; also the bytes of the final cache."""
    past = dec.start(prompts.shape[0])
    logits = None
    for t in range(prompts.shape[1]):
        logits, past = dec.step(prompts[:, t], past)
    out = []
    for _ in range(n):
        assert logits is not None
        tok = logits.argmax(-1)
        out.append(tok)
        logits, past = dec.step(tok, past)
    nbytes = sum(int(v.nbytes) for v in past.values())
    if dec.cache == "fp16":
        nbytes //= 2  # held as float16 between steps (rounded here in float32 arrays)
    return np.stack(out, 1), nbytes


def calibration_steps(model_bytes: bytes, past_names: list[str], kv: int, dim: int, tokens: np.ndarray,
                      every: int) -> list[dict[str, np.ndarray]]:
    """Decode-step feeds of the FP32 model over ``tokens`` [B, T], every ``every``-th step."""
    dec = Decoder(model_bytes, past_names, "fp32", kv, dim)
    past = dec.start(tokens.shape[0])
    feeds = []
    for t in range(tokens.shape[1]):
        if t % every == every - 1:
            feeds.append({"input_ids": tokens[:, t:t + 1].astype(np.int64),
                          "attention_mask": np.ones((tokens.shape[0], t + 1), np.int64), **past})
        _, past = dec.step(tokens[:, t], past)
    return feeds


def chunks(ids: np.ndarray, n: int, length: int, offset: int = 0) -> np.ndarray:
    step = max(length, (len(ids) - offset - length) // n)
    rows = [ids[offset + i * step: offset + i * step + length] for i in range(n)]
    rows = [r for r in rows if len(r) == length]
    return np.stack(rows)


def quantize(proto_bytes: bytes, calib: list[dict[str, np.ndarray]], io: str, scale: str) -> tuple[bytes, dict]:
    import onnx_ir as ir
    from mograph.passes.quant.kv_cache_fp8 import KvCacheFp8Pass

    from mograph.plugins import get_registry
    from mograph.testing import to_proto

    model = ir.serde.deserialize_model(__import__("onnx").load_from_string(proto_bytes))
    res = KvCacheFp8Pass(calibration_data=calib, kv_cache_io=io, kv_cache_scale=scale, registry=get_registry()).call(model)
    return to_proto(model).SerializeToString(), dict(res.stats)


def evaluate(label: str, model: Any, past_names: list[str], proto_bytes: bytes, calib_tokens: np.ndarray,
             held: np.ndarray, prompts: np.ndarray, new_tokens: int, every: int) -> dict[str, Any]:
    cfg = model.config
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = cfg.hidden_size // cfg.num_attention_heads
    log(f"[{label}] calibration: {calib_tokens.shape[0]} sequences x {calib_tokens.shape[1]} steps, every {every}")
    calib = calibration_steps(proto_bytes, past_names, kv, dim, calib_tokens, every)
    variants: dict[str, tuple[bytes, str]] = {"fp32 cache": (proto_bytes, "fp32"), "fp16 cache": (proto_bytes, "fp16")}
    for scale in ("head", "tensor"):
        sim, _ = quantize(proto_bytes, calib, "float", scale)
        variants[f"fp8 simulated, per {scale}"] = (sim, "fp32")
    stored, stats = quantize(proto_bytes, calib, "fp8", "head")
    variants["fp8 stored, per head"] = (stored, "fp8")
    log(f"[{label}] kv-cache-fp8 stats (stored): {stats}")
    rows = {}
    ref_tf = ref_gen = None
    for name, (data, cache) in variants.items():
        t0 = time.time()
        dec = Decoder(data, past_names, cache, kv, dim)
        tf_pred, nll = teacher_forced(dec, held)
        tf_pred = tf_pred[:, :-1]
        gen, nbytes = greedy(dec, prompts, new_tokens)
        if ref_tf is None:
            ref_tf, ref_gen = tf_pred, gen
        assert ref_gen is not None
        same = gen == ref_gen
        first = np.where(same.all(1), new_tokens, np.argmin(same, axis=1))
        rows[name] = {
            "teacher_forced_top1_agreement": float((tf_pred == ref_tf).mean()),
            "teacher_forced_top1_accuracy": float((tf_pred == held[:, 1:]).mean()),
            "teacher_forced_nll": nll,
            "greedy_token_agreement": float(same.mean()),
            "greedy_identical_continuations": float(same.all(1).mean()),
            "greedy_mean_first_divergence": float(first.mean()),
            "cache_bytes": nbytes,
        }
        log(f"[{label}] {name}: {rows[name]} ({time.time() - t0:.1f}s)")
    assert ref_tf is not None
    return {"model": label, "positions_teacher_forced": int(ref_tf.size), "prompts": int(prompts.shape[0]),
            "new_tokens": new_tokens, "context_at_end": int(prompts.shape[1] + new_tokens),
            "calibration_steps": len(calib), "variants": rows}


def table(result: dict[str, Any]) -> str:
    ref = result["variants"]["fp32 cache"]["cache_bytes"]
    lines = [f"### {result['model']}: {result['positions_teacher_forced']} teacher-forced positions, "
             f"{result['prompts']} prompts x {result['new_tokens']} greedy tokens (context {result['context_at_end']})",
             "", "| cache | teacher-forced top-1 agreement | top-1 accuracy | NLL (nats) | greedy token agreement | "
             "identical continuations | mean first divergence | cache bytes | vs fp32 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["variants"].items():
        lines.append(f"| {name} | {r['teacher_forced_top1_agreement']:.4f} | {r['teacher_forced_top1_accuracy']:.4f} | "
                     f"{r['teacher_forced_nll']:.4f} | {r['greedy_token_agreement']:.4f} | {r['greedy_identical_continuations']:.3f} | "
                     f"{r['greedy_mean_first_divergence']:.1f} | {r['cache_bytes']} | {r['cache_bytes'] / ref:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/mograph-kv8", help="folder for the trained weights and exports")
    ap.add_argument("--steps", type=int, default=600, help="training steps of the tiny GPT-2 (more overfits its 30 KB of text)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="smoke run: 100 training steps, fewer prompts")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.quick:
        args.steps, args.prompts, args.new_tokens = 100, 8, 16
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = []

    model, stoi = train_gpt2(work, args.steps)
    train, held_text = _text()
    path = work / f"gpt2-char-{args.steps}.onnx"
    past_names = export_decode_step(model, path)
    data = path.read_bytes()
    train_ids = np.array([stoi[c] for c in train], np.int64)
    held_ids = np.array([stoi[c] for c in held_text], np.int64)
    n_held = 16 if args.quick else 64
    held = chunks(held_ids, n_held, 97)  # 96 predicted positions per chunk
    prompts = chunks(held_ids, args.prompts, 24, offset=13)
    calib_tokens = chunks(train_ids, 16, 96)
    results.append(evaluate("tiny char-level GPT-2 (self-trained, 2x128)", model, past_names, data, calib_tokens,
                            held, prompts, args.new_tokens, every=8))

    llama = random_llama()
    path = work / "llama-random.onnx"
    past_names = export_decode_step(llama, path)
    rng = np.random.default_rng(1)
    vocab = llama.config.vocab_size
    results.append(evaluate("random-weight LLaMA-style (2 layers, 8q/2kv heads)", llama, past_names,
                            path.read_bytes(), rng.integers(0, vocab, (16, 96)), rng.integers(0, vocab, (n_held, 97)),
                            rng.integers(0, vocab, (args.prompts, 24)), args.new_tokens, every=8))
    print("\n\n".join(table(r) for r in results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
