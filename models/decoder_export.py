"""Export small random-weight causal-LM decoders the way Hugging Face / optimum users do, for the GQA tests.

``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``GPTNeoXForCausalLM`` built from a config in code (seeded random weights, nothing
downloaded), wrapped so ``forward`` takes plain tensors:

``prefill``
    ``input_ids`` ``[B, S]``, ``attention_mask`` ``[B, S]`` -> ``logits``, ``present.i.key`` / ``present.i.value``
    ``[B, G, S, D]``.
``decode``
    ``input_ids`` ``[B, S]``, ``attention_mask`` ``[B, P+S]``, ``past_key_values.i.key`` / ``.value``
    ``[B, G, P, D]`` -> ``logits``, ``present.i.key`` / ``.value`` ``[B, G, P+S, D]`` (the optimum / GenAI names).

Exporters: ``torchscript`` (``torch.onnx.export(dynamo=False)``, opset 17) and ``dynamo`` (opset 18).
Position ids are not an input: transformers takes them from the cache length (``P + s``).
torch and transformers are imported only when a function needs them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FAMILIES", "SMOLLM2_135M", "build", "config", "export", "feeds", "input_names", "output_names"]

FAMILIES = ("llama", "qwen2", "gpt_neox")


#: SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads of 64, FFN 1536, vocab 49152)
SMOLLM2_135M = {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "ffn": 1536, "vocab": 49152, "positions": 8192}


def config(family: str, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
           ffn: int = 128, vocab: int = 100, positions: int = 256, attn: str = "sdpa") -> Any:
    import transformers as tf

    if family == "gpt_neox":  # Pythia: one head-interleaved query_key_value, a quarter of each head rotated
        cfg = tf.GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=positions,
                               rotary_pct=0.25, use_cache=True, attn_implementation=attn, tie_word_embeddings=False)
        cfg.num_key_value_heads = heads  # (no grouped heads: what the feeds and the past shapes read)
        return cfg
    if family == "falcon":  # the new decoder architecture: one fused qkv, [q_1 .. q_n | k | v] per K/V group
        cfg = tf.FalconConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                              num_kv_heads=kv_heads, vocab_size=vocab, new_decoder_architecture=True,
                              multi_query=False, parallel_attn=True, bias=False, max_position_embeddings=positions,
                              use_cache=True, attn_implementation=attn, tie_word_embeddings=False)
        cfg.num_key_value_heads = heads  # (its cache holds K/V broadcast to every query head)
        cfg.intermediate_size = cfg.ffn_hidden_size  # (4 * hidden: what _large reads)
        return cfg
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config}[family]
    return cls(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=positions, use_cache=True,
               attn_implementation=attn, tie_word_embeddings=False)


def input_names(cfg: Any, step: str, position_ids: bool = False) -> list[str]:
    """The graph's inputs; ``position_ids`` (``[B, S]``, as optimum's exports take them) after the mask if asked."""
    names = ["input_ids", "attention_mask"] + (["position_ids"] if position_ids else [])
    if step == "decode":
        for i in range(cfg.num_hidden_layers):
            names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def output_names(cfg: Any) -> list[str]:
    out = ["logits"]
    for i in range(cfg.num_hidden_layers):
        out += [f"present.{i}.key", f"present.{i}.value"]
    return out


def build(cfg: Any, step: str, seed: int = 0, hf_dir: str | os.PathLike[str] | None = None,
          position_ids: bool = False) -> Any:
    """The eval-mode wrapper module (plain tensors in and out): seeded random weights, or the weights of a local
    Hugging Face folder ``hf_dir`` (read from disk, nothing downloaded); with ``position_ids`` the third input is
    the positions the rotary embedding takes (else transformers derives them from the past length)."""
    import torch
    import transformers as tf

    if hf_dir is not None:
        inner = tf.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, torch_dtype=torch.float32,
                                                        attn_implementation=getattr(cfg, "_attn_implementation", None))
    else:
        torch.manual_seed(seed)
        cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
               "gpt_neox": tf.GPTNeoXForCausalLM, "falcon": tf.FalconForCausalLM}[cfg.model_type]
        inner = cls(cfg)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for _, p in sorted(inner.named_parameters()):
                p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    inner.eval()
    layers = cfg.num_hidden_layers

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, *rest: Any) -> Any:
            positions, past = (rest[0], rest[1:]) if position_ids else (None, rest)
            cache = tf.DynamicCache(config=cfg)
            for i in range(len(past) // 2):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                             position_ids=positions, use_cache=True, return_dict=True)
            c = out.past_key_values
            flat = []
            for i in range(layers):
                flat += [c.layers[i].keys, c.layers[i].values]
            return (out.logits, *flat)

    return Decoder().eval()


def feeds(cfg: Any, step: str, batch: int = 2, seq: int = 5, past: int = 7, seed: int = 0,
          padding: str = "none", position_ids: bool = False) -> dict[str, np.ndarray]:
    """Seeded feeds.  ``padding``: ``none`` (all ones), ``right`` (row 1 shorter, zeros at the end; prefill only),
    ``left`` (row 1's first positions 0).  ``position_ids``: each row's count of ones in the mask before each new
    token (what generation loops feed: left padding shifts a row's positions)."""
    rng = np.random.default_rng(seed)
    total = seq + (past if step == "decode" else 0)
    out: dict[str, np.ndarray] = {"input_ids": rng.integers(1, cfg.vocab_size, size=(batch, seq), dtype=np.int64),
                                  "attention_mask": np.ones((batch, total), dtype=np.int64)}
    if padding == "right" and batch > 1:
        out["attention_mask"][1, total - 2:] = 0
    elif padding == "left" and batch > 1:
        out["attention_mask"][1, :2] = 0
    if position_ids:
        before = np.cumsum(out["attention_mask"], axis=1) - 1
        out["position_ids"] = np.maximum(before[:, total - seq:], 0).astype(np.int64)
    if step == "decode":
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        for i in range(cfg.num_hidden_layers):
            for n in ("key", "value"):
                out[f"past_key_values.{i}.{n}"] = rng.standard_normal(
                    (batch, cfg.num_key_value_heads, past, d)).astype(np.float32)
    return out


def _large(cfg: Any) -> bool:
    """Whether the float32 weights pass 1.5 GB (then external data: a protobuf holds at most 2 GB)."""
    params = cfg.vocab_size * cfg.hidden_size * 2 + cfg.num_hidden_layers * (
        4 * cfg.hidden_size * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    return params * 4 > 1.5e9


def export(cfg: Any, step: str, exporter: str, path: str | os.PathLike[str], seed: int = 0,
           hf_dir: str | os.PathLike[str] | None = None, tokens: int = 3, position_ids: bool = False) -> Path:
    """Export the ``step`` (``prefill`` | ``decode``) graph with dynamic batch / sequence / past dims (weights of
    ``hf_dir`` if given, else seeded random ones), traced with ``tokens`` new tokens; ``tokens=1`` (dynamo) gives
    a decode step specialized to one token, as an export traced with one token is (its sequence dim static 1)."""
    import torch

    path = Path(path)
    module = build(cfg, step, seed, hf_dir, position_ids)
    names, outputs = input_names(cfg, step, position_ids), output_names(cfg)
    sample = feeds(cfg, step, batch=2, seq=tokens, past=4, seed=seed, position_ids=position_ids)
    fixed = 3 if position_ids else 2  # the inputs before the past
    args = tuple(torch.from_numpy(sample[n]) for n in names)
    if exporter == "torchscript":
        axes: dict[str, dict[int, str]] = {"input_ids": {0: "batch", 1: "seq"},
                                           "attention_mask": {0: "batch", 1: "total"}, "logits": {0: "batch", 1: "seq"}}
        if position_ids:
            axes["position_ids"] = {0: "batch", 1: "seq"}
        axes.update({n: {0: "batch", 2: "past"} for n in names[fixed:]})
        axes.update({n: {0: "batch", 2: "total"} for n in outputs[1:]})
        with torch.no_grad():
            torch.onnx.export(module, args, str(path), input_names=names, output_names=outputs, opset_version=17,
                              dynamo=False, dynamic_axes=axes, do_constant_folding=True)
        return path
    batch, seq = torch.export.Dim("batch", max=1024), torch.export.Dim("seq", max=4096)
    shapes: list[Any] = [{0: batch, 1: seq} if tokens > 1 else {0: batch}]
    if step == "decode":
        past, total = torch.export.Dim("past", max=4096), torch.export.Dim("total", max=8192)
        shapes.append({0: batch, 1: total})
    else:
        shapes.append({0: batch, 1: seq})
    rest: list[Any] = [{0: batch, 1: seq} if tokens > 1 else {0: batch}] if position_ids else []
    if step == "decode":
        rest += [{0: batch, 2: past} for _ in names[fixed:]]
    if rest:
        shapes.append(tuple(rest))  # the *rest varargs: position_ids, then the past
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), input_names=names, output_names=outputs, opset_version=18,
                          dynamo=True, dynamic_shapes=tuple(shapes), external_data=_large(cfg), verbose=False)
    return path
