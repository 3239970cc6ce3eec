"""A real (tiny) causal language model with trained weights from PyPI: ``pokepy-generator``'s character model.

``pokepy-generator==1.1.0`` (``pip install --no-deps pokepy-generator==1.1.0``) ships, as ``.npy`` files in its
wheel, the trained weights of a makemore-style hierarchical ("WaveNet") character model of Pokémon names, and
the name list (``pokemon.txt``, 1024 names).  Its ``__init__`` imports gradio and builds a UI, so the package is
located with ``importlib.util.find_spec`` and never imported; the weights are read as arrays.

The model predicts the next character (27 symbols: ``.`` and a-z) from the previous 8::

    emb = C[context]                                    # [B, 8, 10]
    h = tanh(BN(flatten2(emb) @ W1))                    # [B, 4, 32]
    h = tanh(BN(flatten2(h) @ W5))                      # [B, 2, 32]
    h = tanh(BN(flatten2(h) @ W9))                      # [B, 32]
    logits = h @ W12 + b12                              # [B, 27]

(BN in inference form, folded here into one ``Mul`` and ``Add``.)  :func:`build_model` writes that graph as
ONNX (opset 17, float32, input ``context`` int64 ``[batch, 8]``, output ``logits``); :func:`examples` gives the
(context, next character) pairs of a list of names.  4,379 parameters: a toy next to a real LLM, but trained.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np

__all__ = ["find_dir", "load_names", "build_model", "examples", "BLOCK"]

BLOCK = 8


def find_dir() -> Path | None:
    spec = importlib.util.find_spec("pokepy")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / "C.npy").exists() else None


def _require() -> Path:
    folder = find_dir()
    if folder is None:
        raise FileNotFoundError("pokepy-generator weights not found: pip install --no-deps pokepy-generator==1.1.0")
    return folder


def load_names() -> list[str]:
    """The package's names, lower-case letters only (as its vocabulary is built)."""
    words = (_require() / "pokemon.txt").read_text().splitlines()
    return [w for w in (re.sub(r"[^a-z]", "", w.lower()) for w in words) if w]


def vocabulary(names: list[str]) -> dict[str, int]:
    chars = sorted(set("".join(names)))
    stoi = {c: i + 1 for i, c in enumerate(chars)}
    stoi["."] = 0
    return stoi


def examples(names: list[str], stoi: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Every (context of 8, next character) pair of the names, ``.`` padding the start and ending each name."""
    xs, ys = [], []
    for name in names:
        context = [0] * BLOCK
        for ch in name + ".":
            ix = stoi[ch]
            xs.append(list(context))
            ys.append(ix)
            context = context[1:] + [ix]
    return np.array(xs, np.int64), np.array(ys, np.int64)


def build_model(path: str | Path) -> Path:
    import onnx
    from onnx import helper, numpy_helper

    d = _require()

    def load(name: str) -> np.ndarray:
        return np.load(d / f"{name}.npy").astype(np.float32)

    inits = [numpy_helper.from_array(load("C"), "C")]
    nodes = [helper.make_node("Gather", ["C", "context"], ["emb"], name="embedding")]
    x = "emb"
    for i, (w, bn, shape) in enumerate(((1, 2, [0, 4, 20]), (5, 6, [0, 2, 64]), (9, 10, [0, 64]))):
        mean, var, gamma, beta = (load(f"layer_{bn}_{k}").reshape(-1) for k in ("mean", "var", "gamma", "beta"))
        scale = gamma / np.sqrt(var + 1e-5)
        shift = beta - mean * scale
        inits += [numpy_helper.from_array(np.array(shape, np.int64), f"shape{i}"),
                  numpy_helper.from_array(load(f"layer_{w}_weight"), f"W{w}"),
                  numpy_helper.from_array(scale.astype(np.float32), f"bn{bn}_scale"),
                  numpy_helper.from_array(shift.astype(np.float32), f"bn{bn}_shift")]
        nodes += [helper.make_node("Reshape", [x, f"shape{i}"], [f"flat{i}"], name=f"flatten{i}"),
                  helper.make_node("MatMul", [f"flat{i}", f"W{w}"], [f"lin{i}"], name=f"linear{w}"),
                  helper.make_node("Mul", [f"lin{i}", f"bn{bn}_scale"], [f"bnm{i}"], name=f"bn{bn}_mul"),
                  helper.make_node("Add", [f"bnm{i}", f"bn{bn}_shift"], [f"bna{i}"], name=f"bn{bn}_add"),
                  helper.make_node("Tanh", [f"bna{i}"], [f"h{i}"], name=f"tanh{i}")]
        x = f"h{i}"
    inits += [numpy_helper.from_array(load("layer_12_weight"), "W12"),
              numpy_helper.from_array(load("layer_12_bias").reshape(-1), "b12")]
    nodes += [helper.make_node("MatMul", [x, "W12"], ["head"], name="lm_head"),
              helper.make_node("Add", ["head", "b12"], ["logits"], name="lm_head_bias")]
    graph = helper.make_graph(nodes, "pokepy_char_lm",
                              [helper.make_tensor_value_info("context", onnx.TensorProto.INT64, ["batch", BLOCK])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 27])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return Path(path)
