"""A decoder-shaped model of any size, written straight to disk with external data (no torch).

Why: models above protobuf's 2 GB limit must go through every pass and command, and a test of that must
not need an exported LLM.  :func:`write_decoder` writes a small ``.onnx`` graph and its weights into one
external-data file, one tensor at a time (random normal(0, 0.02) weights, generated and written tensor by
tensor, so making a 2.3 GB model holds about one tensor in memory).

The graph is what the passes look for in a real decode step, with few nodes so every pass is quick:

- ``input_ids`` ``[batch, seq]`` -> ``Gather`` of the embedding ``[vocab, hidden]``;
- per layer: Q/K/V ``MatMul`` s, ``Reshape``/``Transpose`` into ``[batch, heads, seq, head_dim]``, the
  cache grown by ``Concat(past_key_i, k, axis=2)`` -> graph output ``present_key_i`` (same for values),
  scaled scores, ``Softmax``, the output projection and a residual ``Add``; then an FFN
  ``MatMul -> Relu -> MatMul`` with its residual ``Add``;
- an LM head ``MatMul`` ``[hidden, vocab]`` -> ``logits``.

The bulk of the bytes is the embedding and the LM head (``2 * vocab * hidden`` floats) and the FFN.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

__all__ = ["write_decoder", "decoder_bytes", "decoder_feeds"]


def decoder_bytes(*, hidden: int, ffn: int, vocab: int, layers: int) -> int:
    """Bytes of float32 weights :func:`write_decoder` writes for these sizes."""
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn
    return 4 * (2 * vocab * hidden + layers * per_layer)


def write_decoder(
    folder: str | Path,
    *,
    hidden: int = 64,
    ffn: int = 256,
    vocab: int = 512,
    layers: int = 2,
    heads: int = 4,
    opset: int = 17,
    seed: int = 0,
    name: str = "decoder.onnx",
) -> Path:
    """Write the model into ``folder`` (``name`` and ``name.data``); return the model's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    data_name = f"{name}.data"
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    initializers: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    offset = 0
    with open(folder / data_name, "wb") as data:

        def weight(wname: str, shape: tuple[int, ...]) -> str:
            nonlocal offset
            array = rng.standard_normal(shape, dtype=np.float32)
            array *= np.float32(0.02)
            raw = array.tobytes()
            del array
            data.write(raw)
            t = TensorProto(name=wname, data_type=TensorProto.FLOAT, dims=list(shape))
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                t.external_data.add(key=key, value=value)
            offset += len(raw)
            initializers.append(t)
            return wname

        def const(cname: str, values: list[int] | float) -> str:
            if isinstance(values, float):
                initializers.append(helper.make_tensor(cname, TensorProto.FLOAT, [], [values]))
            else:
                initializers.append(helper.make_tensor(cname, TensorProto.INT64, [len(values)], values))
            return cname

        def node(op: str, inputs: list[str], out: str, **attrs: object) -> str:
            nodes.append(helper.make_node(op, inputs, [out], name=f"/{out}/{op}", **attrs))
            return out

        split = const("split_heads", [0, 0, heads, head_dim])
        merge = const("merge_heads", [0, 0, hidden])
        scale = const("score_scale", 1.0 / math.sqrt(head_dim))
        h = node("Gather", [weight("embed.weight", (vocab, hidden)), "input_ids"], "embeds")
        inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])]
        outputs = []
        for i in range(layers):
            p = f"layers.{i}"
            q, k, v = (node("MatMul", [h, weight(f"{p}.attn.{x}_proj.weight", (hidden, hidden))], f"{p}/{x}")
                       for x in "qkv")
            q, k, v = (node("Transpose", [node("Reshape", [t, split], f"{t}_split")], f"{t}_bnsh", perm=[0, 2, 1, 3])
                       for t in (q, k, v))
            cache = []
            for kind, new in (("key", k), ("value", v)):
                past, present = f"past_{kind}_{i}", f"present_{kind}_{i}"
                inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT,
                                                            ["batch", heads, "past", head_dim]))
                cache.append(node("Concat", [past, new], present, axis=2))
                outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT,
                                                             ["batch", heads, "total", head_dim]))
            kt = node("Transpose", [cache[0]], f"{p}/k_t", perm=[0, 1, 3, 2])
            scores = node("Mul", [node("MatMul", [q, kt], f"{p}/scores_raw"), scale], f"{p}/scores")
            probs = node("Softmax", [scores], f"{p}/probs", axis=-1)
            ctx = node("Transpose", [node("MatMul", [probs, cache[1]], f"{p}/ctx_bnsh")], f"{p}/ctx_bsnh",
                       perm=[0, 2, 1, 3])
            ctx = node("Reshape", [ctx, merge], f"{p}/ctx")
            attn = node("MatMul", [ctx, weight(f"{p}.attn.o_proj.weight", (hidden, hidden))], f"{p}/attn_out")
            h = node("Add", [h, attn], f"{p}/resid_attn")
            up = node("MatMul", [h, weight(f"{p}.mlp.up_proj.weight", (hidden, ffn))], f"{p}/up")
            down = node("MatMul", [node("Relu", [up], f"{p}/act"), weight(f"{p}.mlp.down_proj.weight", (ffn, hidden))],
                        f"{p}/down")
            h = node("Add", [h, down], f"{p}/resid_mlp")
        node("MatMul", [h, weight("lm_head.weight", (hidden, vocab))], "logits")
    outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]))
    graph = helper.make_graph(nodes, "large_decoder", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.save(model, str(path))
    return path


def decoder_feeds(*, heads: int, hidden: int, vocab: int, layers: int, ffn: int = 0, batch: int = 1, seq: int = 4,
                  past: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded feeds for :func:`write_decoder`'s model: token ids and a random cache of ``past`` steps (``ffn`` is
    accepted and unused, so the sizes given to :func:`write_decoder` can be passed as they are)."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {"input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64)}
    for i in range(layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = rng.standard_normal((batch, heads, past, hidden // heads), dtype=np.float32)
    return feeds
