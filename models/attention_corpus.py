"""The attention corpus: small transformers models of every common attention shape, exported for the tests.

Each *case* is (family, exporter, attention implementation, mask): a tiny random-weight model built from a
``transformers`` config class in code (nothing downloaded), wrapped so its ``forward`` takes plain tensors,
exported with ``torch.onnx.export`` (``dynamo=False``: TorchScript, or ``dynamo=True``) with dynamic batch
and sequence dims.  The families cover the attention forms the ``fuse-attention`` pass must know:

=================  ==================================================================================
family             attention
=================  ==================================================================================
``bert``           encoder self-attention, key-padding mask (``BertModel``)
``roberta``        the same with RoBERTa's position ids (``RobertaModel``)
``vit``            encoder self-attention, no mask (``ViTModel``, 32x32 images in 8x8 patches)
``whisper-enc``    encoder self-attention, no mask, K projected without bias (``WhisperModel`` encoder)
``gpt2``           causal decoder self-attention, ``Conv1D`` projections, padding mask (``GPT2Model``)
``llama``          causal decoder self-attention, rotary embeddings, 2 KV heads for 8 query heads
``whisper-dec``    causal decoder self-attention and cross-attention over encoder states
=================  ==================================================================================

``mask``: ``"pad"`` feeds an ``attention_mask`` input (right padding in :func:`feeds`), ``"none"`` exports
without one (where the family takes one), ``"cache"`` (``gpt2``, ``llama``) exports one decode step with a KV
cache: inputs ``input_ids`` ``[B, 1]``, ``attention_mask`` ``[B, P+1]``, ``past_key_i``/``past_value_i``
``[B, Hkv, P, D]``; outputs ``last_hidden_state`` and ``present_key_i``/``present_value_i``.  ``attn``: ``"eager"`` (explicit MatMul/Softmax) or ``"sdpa"``
(``scaled_dot_product_attention``, transformers' default, which both exporters decompose).

Sizes: 2 layers, hidden 64 (4 heads of 16), vocab 100; ``llama`` hidden 256 with 8 query / 2 KV heads of 32.
torch and transformers are imported only when a function needs them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FAMILIES", "ATTNS", "EXPORTERS", "MASKS", "Case", "all_cases", "build", "export", "feeds"]

FAMILIES = ("bert", "roberta", "vit", "whisper-enc", "gpt2", "llama", "whisper-dec")
ATTNS = ("eager", "sdpa")
EXPORTERS = ("torchscript", "dynamo")
MASKS = ("pad", "none", "cache")
#: families exported with a KV cache too (mask "cache")
CACHED = ("gpt2", "llama")
VOCAB = 100
HIDDEN = 64
HEADS = 4
LAYERS = 2
#: families that have no attention_mask input at all
NO_MASK = ("vit", "whisper-enc")
#: attention instances per layer (whisper's decoder: self + cross)
PER_LAYER = {"whisper-dec": 2}


@dataclass(frozen=True)
class Case:
    family: str
    exporter: str
    attn: str
    mask: str

    @property
    def name(self) -> str:
        return f"{self.family}-{self.exporter}-{self.attn}-{self.mask}"

    @property
    def attention_count(self) -> int:
        """How many attention instances the exported graph holds."""
        return LAYERS * PER_LAYER.get(self.family, 1)

    @property
    def opset(self) -> int:
        return 17 if self.exporter == "torchscript" else 18


def all_cases() -> list[Case]:
    """Every (family, exporter, attn, mask) combination; mask ``none`` only for families without a mask input."""
    out = []
    for family in FAMILIES:
        masks = ("none",) if family in NO_MASK else tuple(m for m in MASKS if m != "cache" or family in CACHED)
        for exporter in EXPORTERS:
            for attn in ATTNS:
                for mask in masks:
                    out.append(Case(family, exporter, attn, mask))
    return out


def _perturb(torch: Any, module: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=gen, dtype=param.dtype))


def build(case: Case, seed: int = 0) -> tuple[Any, list[str], list[str]]:
    """The eval-mode torch module of ``case``, its input names and output names."""
    import torch
    import transformers as tf

    attn: dict[str, Any] = {"attn_implementation": case.attn}
    f = case.family
    small: dict[str, Any] = {"vocab_size": VOCAB, "max_position_embeddings": 128}
    cfg: Any
    inner: Any
    if f in ("bert", "roberta"):
        cls_cfg: Any = tf.BertConfig if f == "bert" else tf.RobertaConfig
        cfg = cls_cfg(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      intermediate_size=2 * HIDDEN, **small, **attn)
        inner = (tf.BertModel if f == "bert" else tf.RobertaModel)(cfg, add_pooling_layer=False)
    elif f == "vit":
        cfg = tf.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=2 * HIDDEN, image_size=32, patch_size=8, num_channels=3, **attn)
        inner = tf.ViTModel(cfg, add_pooling_layer=False)
    elif f == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=2 * HIDDEN,
                            n_positions=128, use_cache=False, **attn)
        inner = tf.GPT2Model(cfg)
    elif f == "llama":
        cfg = tf.LlamaConfig(hidden_size=256, num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2,
                             intermediate_size=512, use_cache=False, **small, **attn)
        inner = tf.LlamaModel(cfg)
    else:  # whisper
        cfg = tf.WhisperConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                               encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN,
                               decoder_ffn_dim=2 * HIDDEN, num_mel_bins=8, max_source_positions=16,
                               max_target_positions=64, use_cache=False, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, decoder_start_token_id=1, **attn)
        whole = tf.WhisperModel(cfg)
        inner = whole.encoder if f == "whisper-enc" else whole.decoder
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _perturb(torch, inner, seed)
    inner.eval()
    with_mask = case.mask in ("pad", "cache") and f not in NO_MASK
    if case.mask == "cache":
        return _cached_wrapper(torch, tf, cfg, inner)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x0: Any, x1: Any = None, x2: Any = None) -> Any:
            args = [a for a in (x0, x1, x2) if a is not None]
            if f == "vit":
                return self.inner(pixel_values=args[0], return_dict=True)[0]
            if f == "whisper-enc":
                return self.inner(input_features=args[0], return_dict=True)[0]
            kw: dict[str, Any] = {"input_ids": args[0], "return_dict": True}
            rest = list(args[1:])
            if f == "whisper-dec":
                kw["encoder_hidden_states"] = rest.pop(0)
            if with_mask:
                kw["attention_mask"] = rest.pop(0)
            if f in ("gpt2", "llama", "whisper-dec"):
                kw["use_cache"] = False
            return self.inner(**kw)[0]

    if f == "vit":
        names = ["pixel_values"]
    elif f == "whisper-enc":
        names = ["input_features"]
    else:
        names = ["input_ids"] + (["encoder_hidden_states"] if f == "whisper-dec" else [])
        names += ["attention_mask"] if with_mask else []
    return Wrapper().eval(), names, ["last_hidden_state"]


def _kv_shape(case: Case) -> tuple[int, int]:
    """(KV heads, head dim) of a cached family."""
    return (2, 32) if case.family == "llama" else (HEADS, HIDDEN // HEADS)


def _cached_wrapper(torch: Any, tf: Any, cfg: Any, inner: Any) -> tuple[Any, list[str], list[str]]:
    class Cached(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: Any, mask: Any, pk0: Any, pv0: Any, pk1: Any, pv1: Any) -> Any:
            cache = tf.DynamicCache(config=cfg)
            cache.update(pk0, pv0, 0)
            cache.update(pk1, pv1, 1)
            out = self.inner(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                             return_dict=True)
            c = out.past_key_values
            return (out.last_hidden_state, c.layers[0].keys, c.layers[0].values, c.layers[1].keys,
                    c.layers[1].values)

    names = ["input_ids", "attention_mask", "past_key_0", "past_value_0", "past_key_1", "past_value_1"]
    outputs = ["last_hidden_state", "present_key_0", "present_value_0", "present_key_1", "present_value_1"]
    return Cached().eval(), names, outputs


def feeds(case: Case, batch: int = 3, seq: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded feeds: right-padded masks (row 0 full, later rows shorter, none empty); with a cache, one new
    token over ``seq`` past positions (row 1's last past position masked)."""
    rng = np.random.default_rng(seed)
    f = case.family
    if case.mask == "cache":
        kvh, d = _kv_shape(case)
        out = {"input_ids": rng.integers(3, VOCAB, size=(batch, 1), dtype=np.int64),
               "attention_mask": np.ones((batch, seq + 1), dtype=np.int64)}
        out["attention_mask"][1 % batch, seq - 1] = 0
        for i in range(LAYERS):
            for n in ("key", "value"):
                out[f"past_{n}_{i}"] = rng.standard_normal((batch, kvh, seq, d)).astype(np.float32)
        return out
    if f == "vit":
        return {"pixel_values": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    if f == "whisper-enc":
        return {"input_features": rng.standard_normal((batch, 8, 32)).astype(np.float32)}
    out = {"input_ids": rng.integers(3, VOCAB, size=(batch, seq), dtype=np.int64)}
    if f == "whisper-dec":
        out["encoder_hidden_states"] = rng.standard_normal((batch, 16, HIDDEN)).astype(np.float32)
    if case.mask == "pad" and f not in NO_MASK:
        mask = np.ones((batch, seq), dtype=np.int64)
        for row in range(1, batch):
            mask[row, seq - row * max(1, seq // (2 * batch)):] = 0
        out["attention_mask"] = mask
    return out


def export(case: Case, path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Export ``case`` to ``path`` (dynamic batch and sequence); returns the path."""
    import torch

    path = Path(path)
    module, names, outputs = build(case, seed)
    sample = feeds(case, batch=2, seq=8, seed=seed)
    args = tuple(torch.from_numpy(sample[n]) for n in names)
    if case.mask == "cache":
        with _no_packed_sequences():
            _export_cached(case, module, args, names, outputs, path)
        return path
    seq_axis: dict[str, int | None] = {"input_ids": 1, "attention_mask": 1, "encoder_hidden_states": None,
                "pixel_values": None, "input_features": None}
    with _no_packed_sequences():
        _export(case, module, args, names, outputs, path, seq_axis)
    return path


@contextlib.contextmanager
def _no_packed_sequences() -> Iterator[None]:
    """Without an attention mask, transformers' decoders look for packed sequences in their position ids
    (``torch.diff``, which TorchScript cannot export); our inputs are never packed, so the lookup is off."""
    from transformers import masking_utils

    saved = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


def _export_cached(case: Case, module: Any, args: tuple, names: list[str], outputs: list[str], path: Path) -> None:
    import torch

    if case.exporter == "torchscript":
        axes: dict[str, dict[int, str]] = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"}}
        axes.update({n: {0: "batch", 2: "past"} for n in names[2:]})
        axes["last_hidden_state"] = {0: "batch"}
        axes.update({n: {0: "batch", 2: "total"} for n in outputs[1:]})
        with torch.no_grad():
            torch.onnx.export(module, args, str(path), input_names=names, output_names=outputs, opset_version=17,
                              dynamo=False, dynamic_axes=axes, do_constant_folding=True)
        return
    batch, past, total = (torch.export.Dim(n, max=m) for n, m in (("batch", 1024), ("past", 100), ("total", 101)))
    shapes = ({0: batch}, {0: batch, 1: total}) + tuple({0: batch, 2: past} for _ in names[2:])
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), input_names=names, output_names=outputs, opset_version=18,
                          dynamo=True, dynamic_shapes=shapes, external_data=False, verbose=False)


def _export(case: Case, module: Any, args: tuple, names: list[str], outputs: list[str], path: Path,
            seq_axis: dict[str, int | None]) -> None:
    import torch

    if case.exporter == "torchscript":
        axes: dict[str, dict[int, str]] = {}
        for n in names:
            axes[n] = {0: "batch"}
            if seq_axis[n]:
                axes[n][seq_axis[n]] = "seq"  # type: ignore[index]
            if n == "encoder_hidden_states":
                axes[n][1] = "enc_seq"
        axes["last_hidden_state"] = {0: "batch"} | ({} if case.family in NO_MASK else {1: "seq"})
        with torch.no_grad():
            torch.onnx.export(module, args, str(path), input_names=names, output_names=outputs, opset_version=17,
                              dynamo=False, dynamic_axes=axes, do_constant_folding=True)
        return
    batch = torch.export.Dim("batch", max=1024)
    seq = torch.export.Dim("seq", max=64)
    shapes = []
    for n in names:
        d: dict[int, Any] = {0: batch}
        if seq_axis[n]:
            d[seq_axis[n]] = seq  # type: ignore[index]
        shapes.append(d)
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), input_names=names, output_names=outputs, opset_version=18,
                          dynamo=True, dynamic_shapes=tuple(shapes), external_data=False, verbose=False)
