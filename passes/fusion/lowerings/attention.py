"""Lowerings of ``mograph.Attention``.

``ort``
    self-attention whose Q, K, V are ``x @ W (+ b)`` of one ``x`` with constant weights (and as many K/V heads as
    query heads) becomes ``com.microsoft.Attention`` with the three projections packed into one
    ``[hidden, 3*H*D]`` GEMM inside the op (what ONNX Runtime's transformers optimizer emits: one kernel per
    layer instead of three MatMuls and three bias Adds); anything else (cross-attention, a KV cache, grouped
    query heads, projections read elsewhere) gets ``com.microsoft.MultiHeadAttention`` with separate Q, K, V
    (cuDNN flash attention on CUDA: the kernels BENCHMARKS-GPU.md names, session 4).  Such a self-attention whose
    projections are weight-only quantized (already ``com.microsoft.MatMulNBits``, which ``Attention`` cannot take)
    gets ONE packed ``MatMulNBits`` ``[3*H*D]`` wide, a ``Split`` into Q, K, V and ``[b_q | b_k | b_v]`` as
    ``MultiHeadAttention``'s ``bias`` (stats ``attention.packed_qkv``, ``attention.packed_qkv.nbits``,
    ``attention.qkv_bias``; near misses ``attention.unpacked_qkv.<why>``): :mod:`.packed_nbits`.  How a mask gets
    there is the node's :data:`~mograph.passes.fusion.attention_op.MASK_FORMAT_KEY` hint (the
    ``fuse-attention`` option ``--mask-format``):

    ``bias`` (default)
        (for a LLaMA/Qwen-style decoder's attention: ``GroupQueryAttention`` behind a run-time right-padding
        check, this form in its else branch, below.)  ``M`` as ``attention_bias`` (of either op), expanded to ``[B|1, H|1, S, T]`` where the kernel needs it (one
        expansion per bias and query length, shared by every layer).  Exact for every mask (left or right
        padding, causal, anything additive), and an additive bias still reaches flash attention on CUDA.  A
        key-padding bias whose data is computed from shape values (transformers 5's index-based padding lookup,
        TorchScript's flat ``Gather`` or dynamo's ``GatherND``, And-ed with ``Range >= 0``: run on the host by
        ONNX Runtime's CUDA provider and copied to the device, so no CUDA graph) is built again from the mask
        input, ``Where(Unsqueeze(bool(mask), [1, 2]), a, b)`` with the export's own ``a``/``b`` (stat
        ``device_padding_bias``): the same numbers, computed on the device.
    ``lengths``
        (for a LLaMA/Qwen-style decoder's attention that becomes ``GroupQueryAttention`` with rotary, below: that
        form without a run-time check, assuming right padding.)  Otherwise,
        where ``M`` is provably a key-padding bias of a 2-D ``[B, T]`` ``attention_mask`` input (0 where the
        mask is 1, a negative constant ``c`` where it is 0: ``(1 - mask) * c``, ``Where(mask, 0, c)``, or
        ``transformers``' index-based padding lookup as TorchScript exports it), the key lengths
        ``ReduceSum(mask, 1)`` (int32 ``[B]``, built once) go to ``key_padding_mask`` (the 1-D ``mask_index`` of
        the packed ``Attention``) and the float bias is
        dropped: the fastest form, but it equals the original **only for right-padded masks** (ones, then
        zeros); a left-padded row attends to its first ``length`` keys instead.  Other biases stay ``bias``.
    ``raw``
        the traced mask itself, cast once to int32, as a 2-D ``mask_index`` (``com.microsoft.Attention`` with
        the three projections packed into one ``[hidden, 3*H*D]`` GEMM when Q, K, V are ``x @ W + b`` of one
        ``x`` with constant weights, else ``MultiHeadAttention``'s ``key_padding_mask``), with
        ``mask_filter_value = c``: exact for 0/1 masks, even a fully padded row, but ONNX Runtime CUDA runs it
        with its slow unfused ``SoftmaxWithRawMask`` kernel.

    Where Q, K, V are the three equal parts of one ``Split`` of ``Reshape(Gemm(x, W, b))`` or ``Add(y, b)``
    (GPT-2's Conv1D) read by nothing else, ``b`` goes to ``MultiHeadAttention``'s ``bias`` input (stat
    ``attention.qkv_bias``) and the Gemm loses its ``C``: ONNX Runtime's CUDA Gemm writes a broadcast bias
    into its output before every GEMM (``BroadcastBiasKernel``, 0.46 ms of 2.5 for GPT-2 at 32x128 on the
    H200), the kernel adds it while it splits the heads.

    ``nan_to_zero`` adds ``Where(IsNaN(Y), 0, Y)`` after the kernel (a fully ``-inf``-masked row gives NaN
    there, 0 in the original).

    Causal masks: where ``M`` is provably ``Where(kv_idx <= q_idx, 0, c)`` (one ``Range(0, S)`` as key and
    query index, its length provably the query and key length; more ``And``-ed terms only if provably all
    true), the kernel's own causal mask replaces it: ``unidirectional=1`` (Attention / MultiHeadAttention, no
    bias), or for grouped K/V heads ``GroupQueryAttention`` (``seqlens_k = S - 1``, ``total_sequence_length =
    S``; head size a multiple of 8, as its CPU kernel requires).  Causal + a key-padding term does so only
    with ``lengths`` (right padding: key lengths, ``seqlens_k = lengths - 1``); ``bias`` and ``raw`` keep the
    dense bias there (exact for left padding and fully padded rows).  Exporters' other causal forms (the
    TorchScript ``Trilu`` of ``sdpa``, two Ranges of lengths not provably equal) keep the bias too.

    KV cache: where K and V are ``Concat(past, new, axis=2)`` of ``[B, G, P, D]`` graph inputs (the decode
    step of an export with ``past_key_values``), the past goes into the kernel and its ``present_key`` /
    ``present_value`` outputs replace the Concats (names kept): ``MultiHeadAttention`` with ``M`` as
    ``attention_bias`` (exact), or for grouped heads ``GroupQueryAttention`` when there is no ``M`` and the step
    is provably one token (its causal mask then hides nothing; its CUDA kernel refuses ``attention_bias``, so a
    masked grouped decode step keeps the Concat and repeats the cache in its own ``[B, G, P+1, D]`` layout,
    Unsqueeze/Expand/Reshape to ``[B, N, P+1, D]``, which ``MultiHeadAttention`` reads as 4-D K/V: the cache is
    never transposed).  Other grouped-query attention repeats K and V per head in their ``[B, T, Hkv*D]`` layout
    (Reshape/Expand/Reshape, as ``repeat_kv`` does), then ``MultiHeadAttention`` as above.  A step's new K/V go
    in as the exporter's own ``[B, S, H]`` projections where the head split is provably a split of the last dim
    (``[b, s, G, D]`` with ``0``, ``-1``, the static dims or ``Shape`` reads of the same tensor).
    Decoders (checked first): causal self-attention whose Q and K are ``com.microsoft.RotaryEmbedding`` kernels
    (lowered just before, from one angle table ``f``) becomes ``GroupQueryAttention`` with the rotary inside
    (``do_rotary=1``, ``cos_cache``/``sin_cache`` ``[GQA_MAX_LENGTH, D/2]`` initializers computed as the export
    does, float32 ``p * inv_freq``) where it is provably the standard one: ``f = Cast(pos) * inv_freq`` laid out
    ``[1, S, D/2]`` with ``inv_freq`` a constant and ``pos`` the query positions ``Range(0, S, 1)`` (or the constant
    ``[0 .. S-1]`` where ``S`` is static: a dynamo export traced with one new token) (+ the past
    length ``Shape(past_key)[2]`` of a decode step); the bias ``Where(kv_idx <= pos[s] [& mask[b, kv_idx]], 0, c)``
    with ``kv_idx`` a ``Range`` of the key count (the padding lookup as TorchScript's flat ``Gather`` or
    dynamo's ``GatherND`` of that very index); head size a multiple of 8.  Q/K/V that are projections of one
    tensor are packed (``x @ [Wq|Wk|Wv] (+ [bq|bk|bv])``, ``key``/``value`` empty; weight-only quantized ones, already
    ``MatMulNBits``, by :mod:`.packed_nbits`); Q/K/V that are ``X[..., :wq]``, ``X[..., wq:wq+wk]``, ``X[..., wq+wk:]``
    of one ``X`` exactly ``wq + 2 wk`` wide (Phi 3's fused ``qkv_proj``, Sliced) are ``X`` as it is; where Q and K
    reach their projections through per-head norms (Qwen 3's ``q_norm`` / ``k_norm``) the three projections become
    one ``Split(h @ [Wq|Wk|Wv])`` read where each was (stat ``attention.packed_projections``; the op still takes Q,
    K, V apart).  A partial
    rotary (``rotary_dim`` R < D: ``rotary_embedding_dim`` kernels, ``f`` ``[.., R/2]``) goes inside with R/2-wide
    caches where R/2 is a multiple of 8 (ONNX Runtime's kernel refuses other widths at run time), else stays
    outside as below; the cache is the kernel's past
    and present (the exporter's Concat removed), and a prefill's present outputs (the exporter's own rotated keys
    and split values) become the kernel's.  Lengths: ``seqlens_k = ReduceSum(int32(mask), 1) - 1``,
    ``total_sequence_length = int32(Shape(mask)[1])`` (as ONNX Runtime GenAI builds them) -- which assume RIGHT
    padding.  With a padding term:

    - ``lengths`` (or ``--kv-cache shared``, :data:`~mograph.passes.fusion.attention_op.KV_CACHE_KEY`: past and
      present then carry the dim ``max_sequence_length``, bound to one buffer) takes the form as it is: the user
      promises right padding (a left-padded row gives other numbers), and the graph stays one a CUDA graph can
      capture.
    - ``bias`` (the default) checks it on the device: ``If(ok, GroupQueryAttention, exact form)`` per layer, ``ok``
      built once per mask (stat ``padding_checks``; ``attention.padding_check`` counts the layers): every row of
      the mask is ones then zeros (``mask == (arange(T) < ReduceSum(mask, 1))`` in the mask's dtype, so a value
      other than 0/1 fails it) with at least one key; for a decode step every key present (the export puts the
      new tokens at ``P + s``, the kernel after each row's length) and one new token or one row (ONNX Runtime's
      kernel refuses more).  The else branch is what this lowering writes without GroupQueryAttention
      (``MultiHeadAttention`` over repeated K/V heads, the mask as ``attention_bias``: exact for any mask); the
      nodes only it reads (rotary kernels, separate projections, the exporter's presents and Concats) are moved
      into it, so the taken branch computes nothing of the other.  The packed QKV weight is a second copy of
      the three projections' weights (the else branch reads the originals).  ONNX Runtime's CUDA provider runs
      an ``If``'s condition on the host: such a graph cannot be captured as a CUDA graph (``--kv-cache
      shared`` is the capturable form).

    Where the angles are NOT provably ``(past + s) * inv_freq`` (an export that takes ``position_ids`` as an input,
    as optimum's do, or an ``inv_freq`` computed at run time) but the causal mask's own query positions are
    (transformers builds the mask from the cache position, ``Range(0, S, 1) [+ P]``), the rotary stays outside:
    ``GroupQueryAttention`` with ``do_rotary=0`` on the Q and K that the two RotaryEmbedding kernels rotated by the
    export's own angles, packed into the op's one QKV input by a ``Concat`` (with one packed projection, one kernel
    rotates the Q and K heads of ``Split(h @ [Wq|Wk|Wv])``, or of the Sliced ``X`` above; no cos/sin caches; stat
    ``attention.gqa_external_rotary``): ONNX Runtime's CUDA ``GroupQueryAttentionFusion`` takes RotaryEmbedding
    kernels that feed the op directly into ``do_rotary`` with their caches read by absolute position and the
    position ids dropped, which is wrong for these per-token caches (the H200 refused the unpacked form: "cos_cache
    dimension 0 shall not be less than total_sequence_length"); the Concat is outside that pattern.  Everything
    else (lengths, the check, the cache, ``--kv-cache shared``) as above.

    Without a mask input it is exact and taken by default.  No
    NaN guard: the causal mask leaves every query its own key.  Stats ``attention.gqa_rotary``,
    ``attention.packed_qkv``, ``attention.kv_cache_shared``; the two rotary kernels taken in are subtracted from
    ``rotary.kernel`` (not where a check keeps them for the else branch).  Why a node did not take this form is
    logged at DEBUG (``-vv``).
``RotaryEmbedding``
    ``ort``: ``com.microsoft.RotaryEmbedding`` where the export's cos/sin are provably ``Cos/Sin(Concat(f, f))``
    of one per-token angle table ``f`` ``[Bc, S, D/2]`` (transformers' ``rotary_emb``, times its scaling
    constant): ONNX Runtime's kernel takes position-indexed caches, so the caches are that table itself
    (``Cos(f)``, ``Sin(f)`` reshaped to ``[Bc*S, D/2]``, built once per table) and each token's position id is its
    own row ``b*S + s``: exact whatever positions the export used; a partial rotary (``rotary_dim`` R, ``f`` ``[Bc,
    S, R/2]``) as the kernel's ``rotary_embedding_dim`` R.  Otherwise, and for the other targets, the
    body is inlined (X rotated in its ``[B, S, N, D]`` view; only cos/sin are transposed).
    Where the attention after it becomes ``GroupQueryAttention`` with ``do_rotary`` (above), the kernel is
    absorbed into it.
``onnx``
    the standard ``Attention`` (3-D form, ``q_num_heads``, ``kv_num_heads``; ``M`` as ``attn_mask``, expanded
    the same way, since ONNX Runtime does not broadcast its dim -2) at opset >= 23; below that ONNX has no
    attention op: the lowering declines and the ``lower`` step inlines the function body.
``tensorrt``
    the function body, inlined: mograph has no TensorRT plugin for attention yet, and TensorRT's ONNX
    parser would take a node named ``Attention`` for its own op and refuse it; TensorRT fuses the
    decomposed attention itself.

Lowerings of one ``lower`` run share what they build for the same input (the expanded bias, the int32
mask, the key lengths, GroupQueryAttention's ``seqlens_k``/``total_sequence_length``: stats ``bias_expansions``,
``mask_index_casts``, ``mask_lengths``, ``gqa_lengths``) through :attr:`~mograph.lowering.LoweringContext.shared`;
stats ``attention.causal`` and ``attention.kv_cache`` count the nodes whose causal mask / KV cache went into the
kernel, ``rotary.kernel`` the rotary embeddings lowered to ``com.microsoft.RotaryEmbedding`` (``rotary_caches``:
their tables).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from mograph.passes.fusion.attention_op import KV_CACHE_KEY, MASK_FORMAT_KEY
from mograph.passes.fusion.lowerings._attention_gqa import _lower_gqa
from mograph.passes.fusion.lowerings._attention_onnx import _inline, _lower_onnx
from mograph.passes.fusion.lowerings._attention_ort import (
    _bias_for_kernel,
    _finish,
    _gqa_head_ok,
    _gqa_lengths,
    _kernel,
    _key_lengths,
    _lower_cached,
    _mask_index,
    _repeat_heads,
    _repeat_heads_bnsh,
    _split_bias,
    device_padding_bias,
    host_computed,
)
from mograph.passes.fusion.lowerings._rotary import _lower_rotary_ort
from mograph.passes.fusion.lowerings.attention_proofs import _causal, _kv_cache, _packed, _padding_mask, is_zero_bias
from mograph.passes.fusion.lowerings.packed_nbits import pack_nbits_qkv

from mograph.custom_ops import Lowering
from mograph.errors import PassFailedError
from mograph.irutil import add_initializer, attr_value, is_zero
from mograph.lowering import LoweringContext

__all__ = ["is_zero_bias", "LOWERINGS"]

def _through_casts(v: ir.Value) -> ir.Value:
    """``v`` above any ``Cast`` chain (an attention kept float32 by ``fp16`` reads its float16 cache through one)."""
    while (p := v.producer()) is not None and p.op_type == "Cast" and p.domain in ("", "ai.onnx") and p.inputs \
            and p.inputs[0] is not None:
        v = p.inputs[0]
    return v


def _lower_ort(node: ir.Node, ctx: LoweringContext) -> bool:
    """``com.microsoft`` Attention / MultiHeadAttention / GroupQueryAttention (see the module docstring)."""
    q, k, v, bias = node.inputs
    graph = node.graph
    assert graph is not None and q is not None and k is not None and v is not None and bias is not None
    heads = int(attr_value(node, "num_heads", 1))
    kv_heads = int(attr_value(node, "kv_num_heads", 0)) or heads
    attrs: dict[str, Any] = {"num_heads": heads, "scale": float(attr_value(node, "scale", 1.0))}
    if _lower_gqa(node, ctx, heads, kv_heads, attrs["scale"], _lower_ort):
        return True
    if node.metadata_props.get(KV_CACHE_KEY) == "shared" and _kv_cache(_through_casts(k)) is not None:
        raise PassFailedError("lower", f"--kv-cache shared: attention '{node.name}' over a KV cache cannot become "
                              "GroupQueryAttention with rotary inside (run with -vv for why; after fp16 the past inputs must feed it "
                              "directly: --fp16-io yes); drop --kv-cache shared")
    if _lower_cached(node, ctx, heads, kv_heads, attrs):
        return True
    fmt = node.metadata_props.get(MASK_FORMAT_KEY, "bias")
    new_nodes: list[ir.Node] = []
    causal = None if is_zero(bias) else _causal(bias, q, k, ctx.shared, ctx)
    if causal is not None and kv_heads != heads and not _gqa_head_ok(q, heads, ctx):
        causal = None
    if causal is not None and causal[0] is not None and fmt != "lengths":
        causal = None  # causal + key padding: a kernel mask only as (right-padding) lengths
    lengths = _key_lengths(causal[0], new_nodes, ctx.shared) if causal is not None and causal[0] is not None else None
    if causal is not None:  # the kernel's own causal mask replaces the bias
        ctx.count("attention.causal")
        if kv_heads != heads:
            seqlens, total = _gqa_lengths(q, k, 1, None, lengths, new_nodes, ctx.shared)
            kernel = _kernel("GroupQueryAttention", [q, k, v, None, None, seqlens, total],
                             {**attrs, "kv_num_heads": kv_heads}, outputs=3)
            return _finish(node, kernel, q, new_nodes, ctx)
        attrs["unidirectional"] = 1
        bias = None
    elif kv_heads != heads:  # MultiHeadAttention has one K/V head per query head: repeat them (as repeat_kv does)
        ck, cv = _kv_cache(k), _kv_cache(v)
        if ck is not None and cv is not None:  # a (masked) decode step: the cache itself, [B, G, P+S, D]
            k = _repeat_heads_bnsh(ck[2], heads, heads // kv_heads, new_nodes, ctx.shared, ctx)
            v = _repeat_heads_bnsh(cv[2], heads, heads // kv_heads, new_nodes, ctx.shared, ctx)
        else:
            k = _repeat_heads(k, kv_heads, heads // kv_heads, new_nodes, ctx.shared)
            v = _repeat_heads(v, kv_heads, heads // kv_heads, new_nodes, ctx.shared)
    padding = None if bias is None or is_zero(bias) or fmt == "bias" else _padding_mask(bias, ctx)
    if padding is not None:  # raw: the [B, T] mask, masked scores filled with mask_filter_value;
        mask, attrs["mask_filter_value"] = padding  # lengths: the 1-D [B] right-padding key lengths
        lengths = (_key_lengths(mask, new_nodes, ctx.shared) if fmt == "lengths"
                   else _mask_index(mask, new_nodes, ctx.shared))
    if bias is not None and not is_zero(bias) and padding is None and host_computed(bias):
        # the key-padding bias built from shape values on the host (transformers' index lookup): the same values
        # from the mask input on the device, which a CUDA graph can capture
        bias = device_padding_bias(bias, new_nodes, ctx, ctx.shared) or bias
    packed = _packed(node) if kv_heads == heads else None
    # weight-only quantized projections (already MatMulNBits): one packed node, Split, the biases into the kernel
    nbits = pack_nbits_qkv(q, k, v, node, graph, new_nodes, ctx) if packed is None and kv_heads == heads else None
    seq_of = packed[0] if packed is not None else nbits.x if nbits is not None else q
    ab = None if bias is None or is_zero(bias) or padding is not None else _bias_for_kernel(bias, seq_of, new_nodes,
                                                                                             ctx, ctx.shared)
    if packed is not None:  # self-attention: one [hidden, 3*H*D] GEMM for Q, K and V inside the kernel
        x, w, b = packed
        wv = add_initializer(graph, "mograph_qkv_weight", w)
        bv = add_initializer(graph, "mograph_qkv_bias", b)
        kernel = _kernel("Attention", [x, wv, bv, lengths, None, ab], attrs)
    else:
        if nbits is not None:
            q, k, v, qkv_bias = nbits.q, nbits.k, nbits.v, nbits.bias
            ctx.count("attention.packed_qkv")
        else:
            qkv_bias = _split_bias(node, q, k, v) if kv_heads == heads else None
        kernel = _kernel("MultiHeadAttention", [q, k, v, qkv_bias, lengths, ab], attrs)
        if qkv_bias is not None:
            ctx.count("attention.qkv_bias")
    return _finish(node, kernel, q, new_nodes, ctx)


LOWERINGS: dict[str, dict[str, Lowering]] = {
    "Attention": {"ort": _lower_ort, "onnx": _lower_onnx, "tensorrt": _inline},
    # ort: com.microsoft.RotaryEmbedding over the export's own angle table where it is provably one; else (and
    # for the other targets) the body, rotating X in its [B, S, N, D] view (no transpose of X)
    "RotaryEmbedding": {"ort": _lower_rotary_ort, "onnx": _inline, "tensorrt": _inline},
}
