"""The transformers models of the grid (random seeded weights), their ONNX-export wrappers, names and feeds."""

from __future__ import annotations

from typing import Any

import numpy as np

from .grid import Dims

# -- models -----------------------------------------------------------------------------------------------


def hf_model(model: str, kind: str, attn: str, dims: Dims) -> Any:
    """The transformers module for a graph, random weights (seed 0), in eval mode, float32, on CPU."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    if model == "bert":
        cfg = T.BertConfig(vocab_size=dims.vocab["bert"], hidden_size=dims.hidden, num_hidden_layers=dims.layers,
                           num_attention_heads=dims.heads, intermediate_size=dims.ffn, max_position_embeddings=512,
                           attn_implementation=attn)
        return T.BertModel(cfg, add_pooling_layer=False).eval()
    if model == "gpt2":
        cfg = T.GPT2Config(vocab_size=dims.vocab["gpt2"], n_positions=1024, n_embd=dims.hidden, n_layer=dims.layers,
                           n_head=dims.heads, attn_implementation=attn)
        return T.GPT2Model(cfg).eval()
    if model == "llama":
        cfg = T.LlamaConfig(vocab_size=dims.vocab["llama"], hidden_size=dims.hidden, intermediate_size=dims.llama_ffn,
                            num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                            num_key_value_heads=dims.kv_heads, max_position_embeddings=2048, attn_implementation=attn)
        return T.LlamaModel(cfg).eval()
    if model == "vit":
        cfg = T.ViTConfig(hidden_size=dims.hidden, num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
                          intermediate_size=dims.ffn, image_size=int(kind[3:]), patch_size=dims.patch,
                          attn_implementation=attn)
        return T.ViTModel(cfg, add_pooling_layer=False).eval()
    if model == "whisper":
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        cfg = T.WhisperConfig(d_model=dims.hidden, encoder_layers=dims.layers, encoder_attention_heads=dims.heads,
                              encoder_ffn_dim=dims.ffn, decoder_layers=1, decoder_attention_heads=dims.heads,
                              decoder_ffn_dim=dims.ffn, num_mel_bins=dims.mels, max_source_positions=int(kind[3:]),
                              attn_implementation=attn)
        return WhisperEncoder(cfg).eval()
    raise SystemExit(f"bench_gpu: unknown model {model!r}")


def _cache_tensors(cache: Any) -> list[Any]:
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for i in range(len(cache.key_cache)) for t in (cache.key_cache[i], cache.value_cache[i])]


def wrapper(model: str, kind: str, hf: Any, layers: int) -> Any:
    """A module with tensor inputs and outputs (main output first) for export, torch timing and reference."""
    import torch

    if kind == "decode":
        import transformers as T

        class Decode(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = hf

            def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> Any:
                cache = T.DynamicCache()
                for i in range(layers):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
                return (out.last_hidden_state, *_cache_tensors(out.past_key_values))

        return Decode().eval()

    if model in ("bert", "gpt2", "llama"):
        extra = {} if model == "bert" else {"use_cache": False}

        class Text(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = hf

            def forward(self, input_ids: Any, attention_mask: Any) -> Any:
                return self.m(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state

        return Text().eval()
    key = "pixel_values" if model == "vit" else "input_features"

    class Single(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = hf

        def forward(self, x: Any) -> Any:
            return self.m(**{key: x}).last_hidden_state

    return Single().eval()


def input_names(model: str, kind: str, layers: int) -> list[str]:
    if model == "vit":
        return ["pixel_values"]
    if model == "whisper":
        return ["input_features"]
    names = ["input_ids", "attention_mask"]
    if kind == "decode":
        names += [f"past_{i}_{kv}" for i in range(layers) for kv in ("key", "value")]
    return names


def output_names(kind: str, layers: int) -> list[str]:
    out = ["last_hidden_state"]
    if kind == "decode":
        out += [f"present_{i}_{kv}" for i in range(layers) for kv in ("key", "value")]
    return out


def make_feeds(model: str, kind: str, batch: int, seq: int, dims: Dims, seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs of one cell (``seq`` is the KV cache length for ``decode``)."""
    rng = np.random.default_rng(seed)
    if model == "vit":
        side = int(kind[3:])
        return {"pixel_values": rng.standard_normal((batch, 3, side, side), dtype=np.float32)}
    if model == "whisper":
        return {"input_features": rng.standard_normal((batch, dims.mels, 2 * int(kind[3:])), dtype=np.float32)}
    vocab = dims.vocab[model]
    if kind != "decode":
        return {"input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64),
                "attention_mask": np.ones((batch, seq), dtype=np.int64)}
    kv = dims.kv_heads if model == "llama" else dims.heads
    head = dims.hidden // dims.heads
    feeds = {"input_ids": rng.integers(0, vocab, (batch, 1), dtype=np.int64),
             "attention_mask": np.ones((batch, seq + 1), dtype=np.int64)}
    for i in range(dims.layers):
        for name in ("key", "value"):
            feeds[f"past_{i}_{name}"] = rng.standard_normal((batch, kv, seq, head), dtype=np.float32)
    return feeds


def dynamic_spec(model: str, kind: str, layers: int) -> tuple[dict[str, dict[int, str]], Any]:
    """``dynamic_axes`` (TorchScript) and ``dynamic_shapes`` (dynamo) of a graph."""
    import torch

    dyn = torch.export.Dim.DYNAMIC
    if model in ("vit", "whisper"):
        name = input_names(model, kind, layers)[0]
        return ({name: {0: "batch"}, "last_hidden_state": {0: "batch"}}, ({0: dyn},))
    if kind != "decode":
        axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                "last_hidden_state": {0: "batch", 1: "seq"}}
        return axes, ({0: dyn, 1: dyn}, {0: dyn, 1: dyn})
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"}, "last_hidden_state": {0: "batch"}}
    for name in input_names(model, kind, layers)[2:]:
        axes[name] = {0: "batch", 2: "past"}
    for name in output_names(kind, layers)[1:]:
        axes[name] = {0: "batch", 2: "total"}
    return axes, ({0: dyn}, {0: dyn, 1: dyn}, tuple({0: dyn, 2: dyn} for _ in range(2 * layers)))
