"""Small ONNX models built in code, shaped like what PyTorch exporters emit.

Why build them by hand instead of exporting: fusion passes must be tested on the exact op patterns that
exporters produce (LayerNorm decomposed into ReduceMean/Sub/Pow/Sqrt/Div, GELU written with Erf, reshapes
whose target shape is computed from ``Shape``/``Gather``/``Concat``), but a test suite should not need torch
to get them. These builders write those patterns directly with ``onnx.helper`` and numpy, in milliseconds,
deterministically from a seed.

Node and value names follow the TorchScript exporter's scheme (node ``/encoder/layer.0/attention/self/query/
MatMul``, its output ``<node name>_output_0``), and weights carry Hugging Face parameter names
(``encoder.layer.0.attention.self.query.weight``), so a graph dump reads like a real export. Linear weights
are stored already transposed, ``[in, out]``, as exporters store them for ``MatMul``.

Weights are random but realistically scaled: normal(0, 0.02) for projections and embeddings, LayerNorm gamma
near 1 and beta near 0 (deliberately not exactly 1 and 0, so a rewrite that drops them is caught).

Opsets 13 and later are supported. Where an operator changed form, the opset decides the form: ``ReduceMean``
takes ``axes`` as an attribute below opset 18 and as an input from 18 on; ``Unsqueeze`` takes ``axes`` as an
input (opset 13+).

Main entry points: :func:`bert_tiny`, :func:`cnn_small`, :func:`make_model`, and the feed helpers
:func:`bert_feeds` and :func:`random_feeds`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "MIN_OPSET",
    "bert_feeds",
    "bert_tiny",
    "cnn_small",
    "make_model",
    "random_feeds",
    "tensor_info",
]

#: Lowest default-domain opset the builders emit (``Unsqueeze``/``Squeeze`` with ``axes`` as an input).
MIN_OPSET = 13

#: One dimension of a declared shape: a fixed size, a symbolic name, or unknown.
Dim = Union[int, str, None]
#: What :func:`make_model` accepts as a graph input or output.
ValueSpec = Union[onnx.ValueInfoProto, tuple]


# ----------------------------------------------------------------------------------------------- helpers


def tensor_info(name: str, dtype: np.dtype | type | int, shape: Sequence[Dim] | None) -> onnx.ValueInfoProto:
    """Declare a tensor graph input or output.

    ``dtype`` is a numpy dtype (``np.float32``) or an ``onnx.TensorProto`` element type; ``shape`` mixes
    fixed sizes, symbolic names (``"batch"``) and ``None`` for unknown dims, or is ``None`` for unknown rank.
    """
    elem_type = dtype if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(name, elem_type, shape)


def _as_value_info(spec: ValueSpec) -> onnx.ValueInfoProto:
    if isinstance(spec, onnx.ValueInfoProto):
        return spec
    return tensor_info(*spec)


def make_model(
    nodes: Iterable[onnx.NodeProto],
    inputs: Iterable[ValueSpec],
    outputs: Iterable[ValueSpec],
    initializers: Iterable[onnx.TensorProto] | Mapping[str, np.ndarray] = (),
    opset: int = 17,
    *,
    name: str = "mograph_model",
    extra_opsets: Mapping[str, int] | None = None,
    doc: str = "",
) -> onnx.ModelProto:
    """Wrap nodes into a model, the short way tests need it.

    ``inputs``/``outputs`` are ``ValueInfoProto`` or ``(name, dtype, shape)`` tuples (see
    :func:`tensor_info`); ``initializers`` are ``TensorProto`` or a ``{name: array}`` mapping. The IR version
    is the lowest one that the opsets need, rather than the installed onnx's newest, so ONNX Runtime
    releases a little older than onnx still load the model. ``extra_opsets`` adds custom domains
    (``{"com.microsoft": 1}``).
    """
    if isinstance(initializers, Mapping):
        inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()]
    else:
        inits = list(initializers)
    graph = helper.make_graph(
        list(nodes),
        name,
        [_as_value_info(s) for s in inputs],
        [_as_value_info(s) for s in outputs],
        initializer=inits,
        doc_string=doc or None,
    )
    opsets = [helper.make_opsetid("", opset)]
    opsets += [helper.make_opsetid(domain, version) for domain, version in (extra_opsets or {}).items()]
    ir_version = helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=ir_version, producer_name="mograph.models", producer_version="0"
    )


class _Builder:
    """Accumulates nodes and initializers with exporter-style unique names.

    ``op("MatMul", a, b, scope="/encoder/layer.0/query")`` appends node ``/encoder/layer.0/query/MatMul`` (or
    ``..._1``, ``..._2`` when the name is taken) and returns its output name(s). Constants are ``Constant``
    nodes, as the TorchScript exporter emits them; weights are initializers.
    """

    def __init__(self, opset: int, seed: int) -> None:
        if opset < MIN_OPSET:
            raise ValueError(f"opset {opset} is not supported: the builders emit opset {MIN_OPSET} or later")
        self.opset = opset
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._taken: Counter[str] = Counter()

    def op(self, op_type: str, *inputs: str, scope: str = "", outputs: int = 1, **attrs: object) -> str:
        base = f"{scope}/{op_type}"
        k = self._taken[base]
        self._taken[base] += 1
        name = base if k == 0 else f"{base}_{k}"
        outs = [f"{name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0]

    def const(self, value: object, scope: str = "", dtype: type = np.float32) -> str:
        return self.op("Constant", scope=scope, value=numpy_helper.from_array(np.asarray(value, dtype=dtype), ""))

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def normal(self, name: str, shape: Sequence[int], std: float = 0.02, mean: float = 0.0) -> str:
        return self.weight(name, (mean + std * self.rng.standard_normal(shape)).astype(np.float32))

    # --- patterns shared by the models ---------------------------------------------------------------

    def reduce_mean_last(self, x: str, scope: str) -> str:
        """``ReduceMean`` over the last axis, keepdims, in the form the opset requires."""
        if self.opset >= 18:
            return self.op("ReduceMean", x, self.const([-1], scope, np.int64), scope=scope, keepdims=1)
        return self.op("ReduceMean", x, scope=scope, axes=[-1], keepdims=1)

    def unsqueeze(self, x: str, axes: Sequence[int], scope: str) -> str:
        return self.op("Unsqueeze", x, self.const(list(axes), scope, np.int64), scope=scope)

    def layer_norm(self, x: str, prefix: str, scope: str, hidden: int, eps: float) -> str:
        """LayerNorm over the last axis, decomposed exactly as ``torch.onnx.export(dynamo=False)`` writes it.

        ``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * gamma + beta``: ReduceMean, Sub, Pow(., 2),
        ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta. The Sub output feeds both Pow and Div.
        """
        scope = f"{scope}/LayerNorm"
        gamma = self.normal(f"{prefix}.LayerNorm.weight", (hidden,), std=0.05, mean=1.0)
        beta = self.normal(f"{prefix}.LayerNorm.bias", (hidden,), std=0.02)
        mean = self.reduce_mean_last(x, scope)
        centered = self.op("Sub", x, mean, scope=scope)
        squared = self.op("Pow", centered, self.const(2.0, scope), scope=scope)
        var = self.reduce_mean_last(squared, scope)
        var_eps = self.op("Add", var, self.const(eps, scope), scope=scope)
        std = self.op("Sqrt", var_eps, scope=scope)
        normed = self.op("Div", centered, std, scope=scope)
        scaled = self.op("Mul", normed, gamma, scope=scope)
        return self.op("Add", scaled, beta, scope=scope)

    def linear(self, x: str, prefix: str, scope: str, n_in: int, n_out: int) -> str:
        """``x @ W + b`` as ``MatMul`` then ``Add(bias, MatMul)`` (bias first, as TorchScript emits it)."""
        w = self.normal(f"{prefix}.weight", (n_in, n_out))
        b = self.normal(f"{prefix}.bias", (n_out,))
        mm = self.op("MatMul", x, w, scope=scope)
        return self.op("Add", b, mm, scope=scope)

    def gelu_erf(self, x: str, scope: str) -> str:
        """Exact GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))``, as Div, Erf, Add 1, Mul x, Mul 0.5."""
        div = self.op("Div", x, self.const(math.sqrt(2.0), scope), scope=scope)
        erf = self.op("Erf", div, scope=scope)
        plus_one = self.op("Add", erf, self.const(1.0, scope), scope=scope)
        times_x = self.op("Mul", x, plus_one, scope=scope)
        return self.op("Mul", times_x, self.const(0.5, scope), scope=scope)

    def rename(self, old: str, new: str) -> None:
        """Rename a value everywhere, so graph outputs keep their names without an extra Identity."""
        for node in self.nodes:
            node.input[:] = [new if n == old else n for n in node.input]
            node.output[:] = [new if n == old else n for n in node.output]

    def model(self, inputs: list, outputs: list, name: str, doc: str) -> onnx.ModelProto:
        return make_model(self.nodes, inputs, outputs, self.initializers, self.opset, name=name, doc=doc)


# ----------------------------------------------------------------------------------------------- BERT


def bert_tiny(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    ffn: int = 128,
    vocab: int = 100,
    opset: int = 17,
    dynamic: bool = True,
    seed: int = 0,
    *,
    batch: int = 1,
    seq: int = 16,
    max_position: int = 128,
    position_ids: str = "slice",
    pooler: bool = False,
    eps: float = 1e-12,
) -> onnx.ModelProto:
    """A BERT encoder in the op patterns of ``torch.onnx.export(dynamo=False)`` of ``transformers.BertModel``.

    Inputs ``input_ids`` and ``attention_mask``, both int64 ``[batch, seq]``; with ``dynamic`` the two dims
    are named ``"batch"`` and ``"seq"``, otherwise they are fixed to ``batch`` x ``seq`` (1 x 16) and every
    shape computation is a constant, as an exporter with constant folding leaves it. Output
    ``last_hidden_state`` ``[batch, seq, hidden]`` float32, plus ``pooler_output`` ``[batch, hidden]``
    (first token, dense, tanh) when ``pooler``.

    The graph, per part:

    - embeddings: ``Gather`` of the word table by ``input_ids`` plus ``Gather`` of the position table;
      positions are a ``Slice`` of a stored ``[1, max_position]`` id table up to the runtime ``seq``
      (``position_ids="slice"``, HF's buffer) or ``Range(0, seq)`` + ``Unsqueeze`` (``"range"``); then
      LayerNorm.
    - mask: ``(1 - float(mask[:, None, None, :])) * float32.min``, added to the attention scores.
    - each layer: Q/K/V ``MatMul`` + bias ``Add``; ``Reshape`` to ``[batch, seq, heads, head_dim]`` whose
      target comes from ``Shape``/``Gather``/``Unsqueeze``/``Concat`` (dynamic) or a constant (static);
      ``Transpose`` (K straight to ``[0, 2, 3, 1]``); ``MatMul``; ``Div`` by ``sqrt(head_dim)``; mask ``Add``;
      ``Softmax``; ``MatMul`` by V; ``Transpose`` back and ``Reshape`` to ``[batch, seq, hidden]``; output
      projection; residual ``Add``; LayerNorm; FFN ``MatMul`` + ``Add``, Erf GELU, ``MatMul`` + ``Add``;
      residual ``Add``; LayerNorm.

    Every LayerNorm is decomposed (see ``_Builder.layer_norm``) and keeps its parameters as initializers
    ``<module>.LayerNorm.weight`` / ``.bias``. ``seq`` must not exceed ``max_position`` at run time.
    """
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if position_ids not in ("slice", "range"):
        raise ValueError(f"position_ids must be 'slice' or 'range', not {position_ids!r}")
    if not dynamic and seq > max_position:
        raise ValueError(f"seq ({seq}) exceeds max_position ({max_position})")
    b = _Builder(opset, seed)
    head_dim = hidden // heads
    batch_dim: Dim = "batch" if dynamic else batch
    seq_dim: Dim = "seq" if dynamic else seq

    # Embeddings.
    scope = "/embeddings"
    word_table = b.normal("embeddings.word_embeddings.weight", (vocab, hidden))
    pos_table = b.normal("embeddings.position_embeddings.weight", (max_position, hidden))
    if dynamic:
        shape = b.op("Shape", "input_ids", scope=scope)
        batch_size = b.op("Gather", shape, b.const(0, scope, np.int64), scope=scope, axis=0)
        seq_len = b.op("Gather", shape, b.const(1, scope, np.int64), scope=scope, axis=0)
        if position_ids == "slice":
            table = b.weight("embeddings.position_ids", np.arange(max_position, dtype=np.int64)[None, :])
            end = b.unsqueeze(seq_len, [0], scope)
            zero, one = b.const([0], scope, np.int64), b.const([1], scope, np.int64)
            positions = b.op("Slice", table, zero, end, one, one, scope=scope)
        else:
            rng = b.op("Range", b.const(0, scope, np.int64), seq_len, b.const(1, scope, np.int64), scope=scope)
            positions = b.unsqueeze(rng, [0], scope)
    else:
        batch_size = seq_len = ""
        positions = b.weight("embeddings.position_ids", np.arange(seq, dtype=np.int64)[None, :])
    words = b.op("Gather", word_table, "input_ids", scope=f"{scope}/word_embeddings")
    pos = b.op("Gather", pos_table, positions, scope=f"{scope}/position_embeddings")
    x = b.op("Add", words, pos, scope=scope)
    x = b.layer_norm(x, "embeddings", scope, hidden, eps)

    # Extended attention mask, [batch, 1, 1, seq]: 0 where attended, float32.min where masked.
    mask = b.unsqueeze("attention_mask", [1, 2], "")
    mask = b.op("Cast", mask, to=onnx.TensorProto.FLOAT)
    mask = b.op("Sub", b.const(1.0), mask)
    mask = b.op("Mul", mask, b.const(np.finfo(np.float32).min))

    def target_shape(scope: str, tail: Sequence[int]) -> str:
        """Reshape target ``[batch, seq, *tail]``: computed from the runtime shape, or a constant."""
        if not dynamic:
            return b.const([batch, seq, *tail], scope, np.int64)
        parts = [b.unsqueeze(batch_size, [0], scope), b.unsqueeze(seq_len, [0], scope)]
        parts += [b.const([t], scope, np.int64) for t in tail]
        return b.op("Concat", *parts, scope=scope, axis=0)

    for i in range(layers):
        prefix, scope = f"encoder.layer.{i}", f"/encoder/layer.{i}"
        att, att_prefix = f"{scope}/attention/self", f"{prefix}.attention.self"
        q = b.linear(x, f"{att_prefix}.query", f"{att}/query", hidden, hidden)
        k = b.linear(x, f"{att_prefix}.key", f"{att}/key", hidden, hidden)
        v = b.linear(x, f"{att_prefix}.value", f"{att}/value", hidden, hidden)
        q = b.op("Reshape", q, target_shape(att, [heads, head_dim]), scope=att)
        k = b.op("Reshape", k, target_shape(att, [heads, head_dim]), scope=att)
        v = b.op("Reshape", v, target_shape(att, [heads, head_dim]), scope=att)
        q = b.op("Transpose", q, scope=att, perm=[0, 2, 1, 3])
        k = b.op("Transpose", k, scope=att, perm=[0, 2, 3, 1])
        v = b.op("Transpose", v, scope=att, perm=[0, 2, 1, 3])
        scores = b.op("MatMul", q, k, scope=att)
        scores = b.op("Div", scores, b.const(math.sqrt(head_dim), att), scope=att)
        scores = b.op("Add", scores, mask, scope=att)
        probs = b.op("Softmax", scores, scope=att, axis=-1)
        ctx = b.op("MatMul", probs, v, scope=att)
        ctx = b.op("Transpose", ctx, scope=att, perm=[0, 2, 1, 3])
        ctx = b.op("Reshape", ctx, target_shape(att, [hidden]), scope=att)
        out_scope, out_prefix = f"{scope}/attention/output", f"{prefix}.attention.output"
        att_out = b.linear(ctx, f"{out_prefix}.dense", f"{out_scope}/dense", hidden, hidden)
        x = b.op("Add", att_out, x, scope=out_scope)
        x = b.layer_norm(x, out_prefix, out_scope, hidden, eps)

        h = b.linear(x, f"{prefix}.intermediate.dense", f"{scope}/intermediate/dense", hidden, ffn)
        h = b.gelu_erf(h, f"{scope}/intermediate/intermediate_act_fn")
        h = b.linear(h, f"{prefix}.output.dense", f"{scope}/output/dense", ffn, hidden)
        x = b.op("Add", h, x, scope=f"{scope}/output")
        x = b.layer_norm(x, f"{prefix}.output", f"{scope}/output", hidden, eps)

    b.rename(x, "last_hidden_state")
    x = "last_hidden_state"
    outputs = [tensor_info("last_hidden_state", np.float32, [batch_dim, seq_dim, hidden])]
    if pooler:
        first = b.op("Gather", x, b.const(0, "/pooler", np.int64), scope="/pooler", axis=1)
        dense = b.linear(first, "pooler.dense", "/pooler/dense", hidden, hidden)
        b.nodes.append(helper.make_node("Tanh", [dense], ["pooler_output"], name="/pooler/activation/Tanh"))
        outputs.append(tensor_info("pooler_output", np.float32, [batch_dim, hidden]))
    inputs = [
        tensor_info("input_ids", np.int64, [batch_dim, seq_dim]),
        tensor_info("attention_mask", np.int64, [batch_dim, seq_dim]),
    ]
    doc = (
        f"bert_tiny(layers={layers}, hidden={hidden}, heads={heads}, ffn={ffn}, vocab={vocab}, opset={opset}, "
        f"dynamic={dynamic}, seed={seed}): random weights, TorchScript-exporter op patterns (mograph.models)"
    )
    return b.model(inputs, outputs, "bert_tiny", doc)


def bert_feeds(
    batch: int = 2, seq: int = 16, vocab: int = 100, seed: int = 0, *, pad: bool = True
) -> dict[str, np.ndarray]:
    """Valid feeds for :func:`bert_tiny`: token ids in ``[0, vocab)`` and a 0/1 mask.

    With ``pad``, every row but the first ends in a random run of padding (mask 0), always keeping at least
    one attended token per row, so masking is exercised the way real batches exercise it.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    if pad:
        for row in range(1, batch):
            mask[row, int(rng.integers(1, seq + 1)) :] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ----------------------------------------------------------------------------------------------- CNN


def cnn_small(opset: int = 17, batch: int = 1, dynamic_batch: bool = True, seed: int = 0) -> onnx.ModelProto:
    """A small ResNet-like image classifier, in the op patterns of an eval-mode torchvision-style export.

    Input ``image`` float32 ``[batch, 3, 32, 32]`` (batch named ``"batch"`` when ``dynamic_batch``), output
    ``logits`` ``[batch, 10]``. Layers:

    - stem: Conv 3->16 3x3 + BatchNormalization + Relu, MaxPool 2x2 (to 16x16);
    - residual block: Conv + BN + Relu, Conv + BN, ``Add`` with the block input, Relu;
    - downsample: Conv 16->32 3x3 stride 2 + BN + Relu (to 8x8);
    - head: GlobalAveragePool, Flatten, Gemm (``transB=1``) to 10 classes.

    Convs have no bias (BN follows, as in torchvision); BN statistics are non-trivial so that folding BN
    into the conv is a real numeric change. Weights are He-scaled normals.
    """
    b = _Builder(opset, seed)
    batch_dim: Dim = "batch" if dynamic_batch else batch

    def conv_bn(x: str, name: str, c_in: int, c_out: int, stride: int = 1, relu: bool = True) -> str:
        scope = f"/{name}"
        w = b.normal(f"{name}.conv.weight", (c_out, c_in, 3, 3), std=math.sqrt(2.0 / (c_in * 9)))
        y = b.op("Conv", x, w, scope=f"{scope}/conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride] * 2)
        gamma = b.normal(f"{name}.bn.weight", (c_out,), std=0.1, mean=1.0)
        beta = b.normal(f"{name}.bn.bias", (c_out,), std=0.1)
        mean = b.normal(f"{name}.bn.running_mean", (c_out,), std=0.1)
        var = b.weight(f"{name}.bn.running_var", b.rng.uniform(0.5, 1.5, (c_out,)).astype(np.float32))
        y = b.op("BatchNormalization", y, gamma, beta, mean, var, scope=f"{scope}/bn", epsilon=1e-5, momentum=0.9)
        return b.op("Relu", y, scope=scope) if relu else y

    x = conv_bn("image", "stem", 3, 16)
    x = b.op("MaxPool", x, scope="/stem/maxpool", kernel_shape=[2, 2], strides=[2, 2])
    identity = x
    x = conv_bn(x, "block1.0", 16, 16)
    x = conv_bn(x, "block1.1", 16, 16, relu=False)
    x = b.op("Add", x, identity, scope="/block1")
    x = b.op("Relu", x, scope="/block1")
    x = conv_bn(x, "down", 16, 32, stride=2)
    x = b.op("GlobalAveragePool", x, scope="/head")
    x = b.op("Flatten", x, scope="/head", axis=1)
    w = b.normal("fc.weight", (10, 32), std=math.sqrt(1.0 / 32))
    bias = b.normal("fc.bias", (10,), std=0.01)
    b.nodes.append(helper.make_node("Gemm", [x, w, bias], ["logits"], name="/fc/Gemm", alpha=1.0, beta=1.0, transB=1))
    doc = f"cnn_small(opset={opset}, batch={batch}, dynamic_batch={dynamic_batch}, seed={seed}) (mograph.models)"
    return b.model(
        [tensor_info("image", np.float32, [batch_dim, 3, 32, 32])],
        [tensor_info("logits", np.float32, [batch_dim, 10])],
        "cnn_small",
        doc,
    )


# ----------------------------------------------------------------------------------------------- feeds


def random_feeds(
    model: onnx.ModelProto,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    *,
    int_high: int = 100,
) -> dict[str, np.ndarray]:
    """Seeded random feeds for any model's graph inputs (initializers excluded).

    Symbolic dims take their size from ``dims`` (``{"batch": 2, "seq": 8}``), unknown or unnamed ones
    default to 1. Floats are standard normal, integers uniform in ``[0, int_high)``, booleans fair coins.
    For models whose inputs need structure (token ids below the vocab size, masks), prefer a dedicated
    helper such as :func:`bert_feeds`.
    """
    dims = dict(dims or {})
    rng = np.random.default_rng(seed)
    init_names = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        tt = vi.type.tensor_type
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            else:
                shape.append(dims.get(d.dim_param, 1))
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(np.bool_)
        else:
            feeds[vi.name] = rng.integers(0, int_high, size=shape).astype(dtype)
    return feeds
