"""A decoder's attention as ``GroupQueryAttention`` with the rotary inside (``do_rotary``), packed QKV, the KV
cache as its past/present, lengths from the ``attention_mask``, and, under the default mask format, the run-time
right-padding check that chooses between it and the exact form by an ``If``.  The conditions and what each form
assumes: :mod:`mograph.passes.fusion.lowerings.attention`.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from mograph.passes.fusion.attention_op import KV_CACHE_KEY, MASK_FORMAT_KEY, POSITION_IDS_KEY
from mograph.passes.fusion.lowerings._attention_ort import (
    GQA_HEAD_MULTIPLE,
    MS_DOMAIN,
    _add,
    _const,
    _gqa_lengths,
    _heads_to_bsh,
    _kernel,
    _key_lengths,
    _present_outputs,
    _replace,
)
from mograph.passes.fusion.lowerings._rotary import _notes
from mograph.passes.fusion.lowerings.attention_proofs import (
    _PAST_DIM_META,
    Shared,
    _all_true,
    _and_leaves,
    _angle_factors,
    _causal_from,
    _is_range_from_zero,
    _key_slice,
    _kv_cache,
    _positions,
    _present_key_output,
    _present_value_output,
    _producer,
    _projection_of,
    _range_axis,
    _rotary_positions,
    _rotated_split,
    _seq_dim,
    _through_unsqueeze,
    legacy_positions,
)
from mograph.passes.fusion.lowerings.packed_nbits import pack_nbits_biased, pack_nbits_projections

from mograph.custom_ops import Lowering
from mograph.errors import PassFailedError
from mograph.irutil import add_initializer
from mograph.lowering import LoweringContext
from mograph.metadata import LOWERED_FOR
from mograph.patterns import constant_array, remove_dead_producers

logger = logging.getLogger(__name__)

#: GroupQueryAttention's ``do_rotary`` takes head sizes of a multiple of 16 only (ONNX Runtime's cache check)
ROTARY_HEAD_MULTIPLE = 16


#: rows of the cos/sin caches GroupQueryAttention's ``do_rotary`` reads (positions 0 .. MAX-1): option ``--max-length``
GQA_MAX_LENGTH = 4096


def _slice_bounds(node: ir.Node, ctx: LoweringContext) -> list[int] | None:
    """``[start, end, axis, step]`` of a one-axis ``Slice`` whose bounds are constants or shape values the query
    proves literal (a missing step is 1, a missing axis 0)."""
    got: list[int] = []
    for i, default in ((1, None), (2, None), (3, 0), (4, 1)):
        value = node.inputs[i] if i < len(node.inputs) else None
        if value is None:
            if default is None:
                return None
            got.append(default)
            continue
        arr = constant_array(value)
        if arr is not None:
            if arr.size != 1:
                return None
            got.append(int(arr.reshape(())))
            continue
        ints = ctx.literals(value)
        if ints is None or len(ints) != 1 or ints[0] is None:
            return None
        got.append(ints[0])
    return got


def _sliced_qkv(xs: list[ir.Value], widths: list[int], ctx: LoweringContext) -> ir.Value | None:
    """``X`` where Q, K, V are ``X[..., 0:w_q]``, ``X[..., w_q:w_q+w_k]``, ``X[..., w_q+w_k:]`` (one-axis Slices, step
    1, of the last axis) and ``X``'s static last dim is ``w_q + w_k + w_v``: ``X`` is already the packed ``[q | k |
    v]`` rows GroupQueryAttention reads (Phi 3's fused ``qkv_proj``), else None."""
    src: ir.Value | None = None
    offset = 0
    for x, width in zip(xs, widths):
        node = x.producer()
        if node is None or node.op_type != "Slice" or node.domain != "" or len(node.inputs) < 3:
            return None
        if src is None:
            src = node.inputs[0]
        if src is None or node.inputs[0] is not src:
            return None
        rank, total = len(ctx.dims(src) or ()), ctx.static_dim(src, -1)
        bounds = _slice_bounds(node, ctx)
        if total is None or bounds is None:
            return None
        start, end, axis, step = bounds
        if not rank or axis not in (-1, rank - 1) or step != 1:
            return None
        start, end = (v + total if v < 0 else v for v in (start, end))
        start, end = min(max(start, 0), total), min(max(end, 0), total)
        if start != offset or end != offset + width:
            return None
        offset = end
    return src if src is not None and offset == ctx.static_dim(src, -1) else None


def _packed_qkv(xs: list[ir.Value], graph: ir.Graph, new_nodes: list[ir.Node], widths: list[int] | None = None,
                ctx: LoweringContext | None = None) -> ir.Value | None:
    """One ``h @ [W_q | W_k | W_v] (+ [b_q | b_k | b_v])`` where Q, K, V are projections of one ``h``, read by
    nothing else than what this lowering replaces (checked by the caller); or, given the ``widths`` of Q, K, V,
    the one tensor they are cut from side by side (:func:`_sliced_qkv`: nothing to build)."""
    if widths is not None and ctx is not None and (whole := _sliced_qkv(xs, widths, ctx)) is not None:
        return whole
    parts = [_projection_of(x) for x in xs]
    if any(p is None for p in parts) or len({id(p[0]) for p in parts if p is not None}) != 1:
        return None
    h = parts[0][0]  # type: ignore[index]
    if h.dtype is None:
        return None
    dtype = h.dtype.numpy()
    w = np.concatenate([p[1] for p in parts], axis=1).astype(dtype)  # type: ignore[index]
    out = _add(new_nodes, "MatMul", [h, add_initializer(graph, "mograph_qkv_weight", w)])
    if any(p[2] is not None for p in parts):  # type: ignore[index]
        b = np.concatenate([p[2] if p[2] is not None else np.zeros(p[1].shape[1], dtype)  # type: ignore[index]
                            for p in parts]).astype(dtype)
        out = _add(new_nodes, "Add", [out, add_initializer(graph, "mograph_qkv_bias", b)])
    return out


#: how many nodes (a head split Reshape, a per-head norm, the merge Reshape: Qwen 3's q_norm / k_norm) may sit between
#: a projection and the Q, K or V that GroupQueryAttention reads, for :func:`_packed_projections`
_UPSTREAM_HOPS = 4


def _upstream_projection(x: ir.Value) -> ir.Value | None:
    """The projection ``h @ W (+ b)`` (:func:`_projection_of`) that ``x`` is computed from along first inputs, through
    at most :data:`_UPSTREAM_HOPS` nodes whose other inputs are constants, else None."""
    v: ir.Value | None = x
    for _ in range(_UPSTREAM_HOPS + 1):
        if v is None:
            return None
        if _projection_of(v) is not None:
            return v
        node = v.producer()
        if node is None or any(i is not None and constant_array(i) is None for i in node.inputs[1:]):
            return None
        v = node.inputs[0]
    return None


def _packed_projections(node: ir.Node, xs: list[ir.Value], ctx: LoweringContext) -> list[ir.Value]:
    """Where Q, K and V reach three projections of one ``h`` through what sits between (Qwen 3's per-head
    ``q_norm`` / ``k_norm``, not just a head split), one ``Split(h @ [W_q | W_k | W_v] (+ [b_q | b_k | b_v]))``
    takes the three MatMuls' place: each of its outputs is read where the projection was (the values are the same,
    up to the order of a GEMM's sums), so whatever follows (the norms, the rotary) is unchanged, in both branches
    of a padding check.  The op still takes Q, K, V apart (the norms sit between); one GEMM instead of three
    (stat ``attention.packed_projections``).  Returns ``xs`` with each one that was a projection itself replaced
    by its Split output (``xs`` as they are where they are not such projections: nothing changed)."""
    found = [_upstream_projection(x) for x in xs]
    if any(f is None for f in found) or len({id(f) for f in found}) != len(found):
        return xs
    graph = node.graph
    assert graph is not None
    new_nodes: list[ir.Node] = []
    packed = _packed_qkv(found, graph, new_nodes)  # type: ignore[arg-type]
    if packed is None:
        return xs
    parts = [_projection_of(f) for f in found]  # type: ignore[arg-type]
    sizes = np.array([p[1].shape[1] for p in parts], dtype=np.int64)  # type: ignore[index]
    split = ir.node("Split", [packed, _const(new_nodes, sizes)], attributes={"axis": -1}, num_outputs=len(found))
    new_nodes.append(split)
    producers = {id(n) for f in found for n in (f.producer(), _producer(f.producer().inputs[0], "MatMul"))  # type: ignore[union-attr]
                 if n is not None}
    first = next(n for n in graph if id(n) in producers)
    base = node.name or node.op_type
    for i, n in enumerate(new_nodes):
        n.name = f"{base}/packed_projections/{i}"
        n.metadata_props.update(node.metadata_props)
        n.metadata_props[LOWERED_FOR] = ctx.target
    graph.insert_before(first, new_nodes)
    for old, new in zip(found, split.outputs):
        assert old is not None
        if old.dtype is not None:
            new.dtype = old.dtype
        new.shape = old.shape
        ir.convenience.replace_all_uses_with(old, new)
    remove_dead_producers(graph, found)
    ctx.count("attention.packed_projections")
    new_of = {id(old): new for old, new in zip(found, split.outputs)}
    return [new_of.get(id(x), x) for x in xs]


def _causal_positions(bias: ir.Value, q: ir.Value, past: ir.Value | None, ctx: LoweringContext) -> ir.Value | None:
    """The causal term's own query positions: the 1-D ``pos`` of ``Where(kv_idx <= pos[s] ..., 0, c)`` (``kv_idx`` a
    ``Range(0, n, 1)`` on axis 3, ``pos`` unsqueezed onto axis 2), if it is provably ``P + s``.  Exports that take
    ``position_ids`` as an input rotate by those, which nothing proves equal to ``P + s``; their causal mask is still
    built from the cache position (transformers' ``cache_position``), which this finds."""
    where = _producer(bias, "Where")
    if where is None:  # transformers' legacy spelling (Trilu, ScatterND)
        pos = legacy_positions(bias, ctx)
        return pos if pos is not None and _positions(pos, q, past, ctx) else None
    sliced = _key_slice(where.inputs[0])  # (what the slice keeps is checked where the causal term is proved)
    for leaf in _and_leaves(sliced[0] if sliced is not None else where.inputs[0]):
        le = leaf.producer() if leaf is not None and not _all_true(leaf) else None
        if le is None or le.domain != "" or le.op_type not in ("LessOrEqual", "GreaterOrEqual"):
            continue
        a, b = (le.inputs[1], le.inputs[0]) if le.op_type == "GreaterOrEqual" else (le.inputs[0], le.inputs[1])
        if a is None or b is None or _is_range_from_zero(a) is None or _range_axis(a) != 3:
            continue
        pos = b
        while (un := _producer(pos, "Unsqueeze")) is not None:
            pos = un.inputs[0]
        if pos is not None and _through_unsqueeze(b, pos, 4) == 2 and _positions(pos, q, past, ctx):
            return pos
    return None


def _packed_external(q: ir.Value, xs: list[ir.Value], heads: int, kv_heads: int, head_size: int, graph: ir.Graph,
                     new_nodes: list[ir.Node], ctx: LoweringContext) -> ir.Value | None:
    """The rotary-outside form with one projection: ``Concat(RotaryEmbedding(QK), V)`` of ``Split(h @ [W_q | W_k |
    W_v])``, one RotaryEmbedding over the Q and K heads together (each head rotated alike by its token's position:
    the same numbers as one kernel per projection), else None (projections not of one tensor, or Q's kernel not
    the :mod:`_rotary` form: positions ``Expand``-ed over the batch)."""
    rot = q.producer()
    if rot is None or rot.op_type != "RotaryEmbedding" or len(rot.inputs) != 4:
        return None
    expand = _producer(rot.inputs[1], "Expand")
    if expand is None or expand.inputs[0] is None:
        return None
    mark = len(new_nodes)
    packed = _packed_qkv(xs, graph, new_nodes, [heads * head_size, kv_heads * head_size, kv_heads * head_size], ctx)
    if packed is None:
        handled, packed = pack_nbits_biased(xs, graph, new_nodes, ctx)
        if not handled:
            packed = pack_nbits_projections(xs, graph, new_nodes, ctx)
    if packed is None:
        del new_nodes[mark:]
        return None
    qk_width, v_width = (heads + kv_heads) * head_size, kv_heads * head_size
    split = ir.node("Split", [packed, _const(new_nodes, np.array([qk_width, v_width], dtype=np.int64))],
                    attributes={"axis": -1}, num_outputs=2)
    new_nodes.append(split)
    qk, v = split.outputs
    batch_seq = _add(new_nodes, "Slice", [_add(new_nodes, "Shape", [qk]), _const(new_nodes, np.array([0], np.int64)),
                                          _const(new_nodes, np.array([2], np.int64))])
    pos = _add(new_nodes, "Expand", [expand.inputs[0], batch_seq])
    partial = {k: a.value for k, a in rot.attributes.items() if k == "rotary_embedding_dim"}
    kernel = _kernel("RotaryEmbedding", [qk, pos, rot.inputs[2], rot.inputs[3]],
                     {"num_heads": heads + kv_heads, "interleaved": 0, **partial})
    if q.dtype is not None:
        kernel.outputs[0].dtype = q.dtype
    new_nodes.append(kernel)
    ctx.count("attention.packed_qkv")
    ctx.stats["rotary.kernel"] = ctx.stats.get("rotary.kernel", 0) - 1  # Q's and K's kernels: one now
    return _add(new_nodes, "Concat", [kernel.outputs[0], v], axis=-1)


def _input_positions(f: ir.Value) -> tuple[ir.Value, np.ndarray] | None:
    """``(p, inv_freq)`` where the angle table ``f`` is ``Cast(p) x inv_freq`` with ``p`` an integer graph input (a
    ``position_ids`` input, through Unsqueezes), else None (``--position-ids cache`` assumes only such an input)."""
    for factor, inv, _ in _angle_factors(f):
        cast = _producer(factor, "Cast")
        value = cast.inputs[0] if cast is not None else None
        while (un := _producer(value, "Unsqueeze")) is not None:
            value = un.inputs[0]
        if (value is not None and value.is_graph_input() and value.dtype is not None and value.dtype.is_integer()
                and inv.dtype in (np.float32, np.float16)):
            return value, inv
    return None


def _input_positions_inv(f: ir.Value) -> np.ndarray | None:
    found = _input_positions(f)
    return found[1] if found is not None else None


def _no_gqa(node: ir.Node, why: str) -> bool:
    logger.debug("%s: no GroupQueryAttention with rotary: %s", node.name, why)
    return False


def _lower_gqa(node: ir.Node, ctx: LoweringContext, heads: int, kv_heads: int, scale: float,
               exact: Lowering) -> bool:
    """A decoder's causal self-attention with rotary embeddings on Q and K -> ``GroupQueryAttention`` with the
    rotary inside (``do_rotary``, cos/sin caches as initializers), Q/K/V packed into one MatMul where they are
    projections of one tensor, the KV cache (if any) as its past/present, ``seqlens_k`` / ``total_sequence_length``
    from the ``attention_mask``.  See the module docstring for when it applies and what it assumes."""
    q, k, v, bias = node.inputs
    graph = node.graph
    assert graph is not None and q is not None and k is not None and v is not None and bias is not None
    shared = node.metadata_props.get(KV_CACHE_KEY) == "shared"
    fmt = "lengths" if shared else node.metadata_props.get(MASK_FORMAT_KEY, "bias")
    if fmt == "raw" or heads % kv_heads:
        return _no_gqa(node, "--mask-format raw, or query heads not a multiple of the K/V heads")
    ck, cv = _kv_cache(k), _kv_cache(v)
    if (ck is None) != (cv is None):
        return _no_gqa(node, "only one of K and V comes from a cache")
    notes = _notes(ctx)
    k_rot = _rotated_split(ck[1], notes, ctx) if ck is not None else k
    if k_rot is None:
        return _no_gqa(node, "the step's new keys are not a plain head split of the rotated projection")
    new_nodes: list[ir.Node] = []
    v_new = _heads_to_bsh(cv[1], new_nodes, ctx) if cv is not None else v  # (a Transpose + Reshape where not provable)
    rq, rk = notes.get(id(q)), notes.get(id(k_rot))
    if (rq is None or rk is None or rq[1] is not rk[1] or rq[2] != rk[2] or (rq[3], rk[3]) != (heads, kv_heads)
            or rq[4] != rk[4]):
        return _no_gqa(node, "Q and K are not rotated by ONNX Runtime RotaryEmbedding kernels of one angle table")
    xq, f, rscale, _, partial = rq
    xk = rk[0]
    if xq.shape is None or len(xq.shape) != 3 or not isinstance(xq.shape[2], int) or xq.dtype is None:
        return _no_gqa(node, "the query's hidden size is not static")
    head_size = xq.shape[2] // heads
    if head_size % GQA_HEAD_MULTIPLE or f.shape is None or len(f.shape) != 3 or 2 * f.shape[2] != (partial or head_size):
        return _no_gqa(node, f"head size {head_size} not a multiple of {GQA_HEAD_MULTIPLE}, or the angle table is not "
                             "as wide as the rotary")
    # a partial rotary (the first R of D values rotated) goes inside where do_rotary takes R/2-wide caches: ONNX
    # Runtime's kernel (CPU, measured) rotates the first 2 x cos_cache.shape[1] values of each head and asks that width
    # of a multiple of 8 values (it refuses R = 12 of D = 16 at run time), at most (D / 16) * 8, and a head size of a
    # multiple of 16 with any rotary (it refuses D = 40, a Phi-2 shape, at run time: "head_size shall be a multiple of
    # 16"); else the rotary stays outside, in RotaryEmbedding kernels
    half = (partial or head_size) // 2
    fits = head_size % ROTARY_HEAD_MULTIPLE == 0 and half % GQA_HEAD_MULTIPLE == 0 \
        and half <= (head_size // ROTARY_HEAD_MULTIPLE) * GQA_HEAD_MULTIPLE
    past = ck[0] if ck is not None else None
    rp = _rotary_positions(f, xq, past, ctx)
    checked_ids: ir.Value | None = None  # a position_ids input the run-time check compares with P + s
    # rotary outside (do_rotary 0) where the angles are not provably (past + s) * inv_freq, e.g. position_ids given
    # as an input: ONNX Runtime's RotaryEmbedding kernels rotate Q and K by the export's own angles before the op
    external = rp is None or not fits
    if rp is None:
        found = _causal_positions(bias, xq, past, ctx)
        if found is None:
            return _no_gqa(node, "the rotary angles are not provably (past + s) * inv_freq, nor is the causal mask's "
                                 "query position")
        pos, inv = found, None
        if node.metadata_props.get(POSITION_IDS_KEY) == "cache" and fits:  # the user's assumption: ids == P + s
            inv = _input_positions_inv(f)
            external = inv is None
            if not external:
                ctx.count("attention.position_ids_assumed")
        elif fits and fmt != "lengths" and (given := _input_positions(f)) is not None:
            # behind the padding check (decided below: a mask) the check also compares the ids with P + s
            checked_ids, inv = given
            external = False
    else:
        pos, inv = rp[0], rp[1] if fits else None
    kv = ctx.dims(ck[2]) if ck is not None else None
    keys = (kv[2] if kv is not None and len(kv) == 4 else None) if ck is not None else _seq_dim(xq, ctx)
    window: list[int] = []  # a sliding window of W keys: GroupQueryAttention's local_window_size W (as measured)
    causal = _causal_from(bias, pos, keys, ctx, past, xq, window)
    if causal is None:
        return _no_gqa(node, "the bias is not provably causal (and a key-padding mask)")
    mask = causal[0]
    guarded = mask is not None and fmt != "lengths"  # the lengths assume right padding: checked at run time
    if checked_ids is not None and not guarded:  # no check to add it to: the export's angles, as given
        checked_ids, inv, external = None, None, True
    if external and _input_positions_inv(f) is not None:  # the lowering says once what --position-ids would change
        ctx.count("attention.position_ids_as_given")
    if guarded and node.metadata_props.get(_FALLBACK_KEY):
        return _no_gqa(node, "the exact fallback branch of a right-padding check")
    if mask is None and ck is not None:
        return _no_gqa(node, "a cache step without a mask to take the lengths from")
    # the caches: cos/sin of position p (rows 0 .. max-1), computed as the export does (float32 p * inv_freq)
    max_len = int(node.metadata_props.get("mograph.gqa_max_length", GQA_MAX_LENGTH))
    key = ("gqa_rotary_caches", id(f), rscale)
    if inv is not None and key not in ctx.shared:
        angles = np.arange(max_len, dtype=np.float32)[:, None] * inv.astype(np.float32)[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        if rscale is not None:
            cos, sin = cos * np.float32(rscale), sin * np.float32(rscale)
        dtype = xq.dtype.numpy()
        ctx.shared[key] = (add_initializer(graph, "mograph_gqa_cos_cache", cos.astype(dtype)),
                           add_initializer(graph, "mograph_gqa_sin_cache", sin.astype(dtype)))
    cos_cache, sin_cache = ctx.shared[key] if inv is not None else (None, None)
    outer: list[ir.Node] = []  # (guarded: what the layers share stays in the main graph)
    if mask is not None:
        seqlens, total = _mask_lengths_for_gqa(mask, outer if guarded else new_nodes, ctx.shared)
    else:  # no padding: every row holds all S keys
        seqlens, total = _gqa_lengths(xq, xq, 1, None, None, new_nodes, ctx.shared)
    if shared and external and rp is not None and mask is not None:
        _buffer_positions([q, k_rot], rp[1], rscale, mask, xq, max_len, graph, ctx)
    present_k = _present_key_output(graph, xk, f, rscale, ctx) if ck is None else None
    present_v = _present_value_output(graph, v_new, ctx) if ck is None else None
    logger.debug("%s: present outputs found: key %s, value %s", node.name, present_k, present_v)
    widths = [heads * head_size, kv_heads * head_size, kv_heads * head_size]
    packed = None if external else _packed_qkv([xq, xk, v_new], graph, new_nodes, widths, ctx)
    if packed is None and not external:  # weight-only quantized projections (MatMulNBits): one packed node if exact
        handled, packed = pack_nbits_biased([xq, xk, v_new], graph, new_nodes, ctx)  # y + b (Qwen2)
        if not handled:
            packed = pack_nbits_projections([xq, xk, v_new], graph, new_nodes, ctx)
    if external:  # one packed input: ONNX Runtime's CUDA GroupQueryAttentionFusion would take RotaryEmbedding kernels
        # feeding the op directly into it (do_rotary 1 with their caches, read by absolute position, and the
        # position ids dropped: wrong for these per-token caches); a Concat in between is not its pattern
        # (behind the padding check the exact branch reads the kernels' Q and K anyway: a second packed copy there
        # adds work; the projections packed where they are, below, serve both branches)
        packed = None if guarded else _packed_external(q, [xq, xk, v_new], heads, kv_heads, head_size, graph,
                                                       new_nodes, ctx)
        if packed is None:
            packed = _add(new_nodes, "Concat", [q, k_rot, v_new], axis=-1)
            xq, xk, v_new = _packed_projections(node, [xq, xk, v_new], ctx)  # (one GEMM for the kernels' inputs)
    elif packed is None:
        xq, xk, v_new = _packed_projections(node, [xq, xk, v_new], ctx)  # (Q, K, V stay apart: norms between)
    qkv: list[ir.Value | None] = [packed, None, None] if packed is not None else [xq, xk, v_new]
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": scale, "do_rotary": 0 if external else 1,
             "rotary_interleaved": 0}
    if window:
        attrs["local_window_size"] = window[0]
        ctx.count("attention.sliding_window")
    kernel = _kernel("GroupQueryAttention", [*qkv, past, cv[0] if cv is not None else None, seqlens, total,
                                             cos_cache, sin_cache], attrs, outputs=3)
    # no NaN guard: the causal mask leaves every query row its own key (a row of length 0 is outside the contract)
    for out in kernel.outputs:
        out.dtype = xq.dtype
    new_nodes.append(kernel)
    if guarded:
        assert mask is not None
        ok = _right_padded(mask, ck[0] if ck is not None else None, outer, ctx.shared)
        if checked_ids is not None:
            ok = _add(outer, "And", [ok, _cache_positions(checked_ids, ck[0] if ck is not None else None, outer,
                                                          ctx.shared)])
            ctx.count("attention.position_ids_checked")
        presents = (ck[2], cv[2]) if ck is not None and cv is not None else (present_k, present_v)
        _guard(node, ctx, ok, outer, new_nodes, presents, exact)
        ctx.count("attention.gqa_external_rotary" if external else "attention.gqa_rotary")
        ctx.count("attention.padding_check")
        if packed is not None:
            ctx.count("attention.packed_qkv")
        if ck is not None:
            ctx.count("attention.kv_cache")
        return True
    _replace(node, new_nodes, ctx)
    if ck is not None and cv is not None:
        _present_outputs(graph, kernel, (ck[2], cv[2]))
        ctx.count("attention.kv_cache")
        if shared:  # one [B, G, max_sequence_length, D] buffer bound as both past and present
            for past_v, present in ((ck[0], kernel.outputs[1]), (cv[0], kernel.outputs[2])):
                for val in (past_v, present):
                    if val.shape is not None and len(val.shape) == 4:
                        dims = list(val.shape)
                        known = ctx.dims(val)  # the other layers' proofs compare past lengths (the query's dims)
                        val.meta[_PAST_DIM_META] = known[2] if known is not None and len(known) == 4 else None
                        dims[2] = ir.SymbolicDim("max_sequence_length")
                        val.shape = ir.Shape(dims)
            ctx.count("attention.kv_cache_shared")
    else:
        for old, new in ((present_k, kernel.outputs[1]), (present_v, kernel.outputs[2])):
            if old is not None:
                _present_outputs(graph, kernel, (old,), (new,))
    if external:  # the rotary kernels stay in front of it
        ctx.count("attention.gqa_external_rotary")
        return True
    ctx.count("attention.gqa_rotary")
    if packed is not None:
        ctx.count("attention.packed_qkv")
    ctx.stats["rotary.kernel"] = ctx.stats.get("rotary.kernel", 0) - 2  # both went into the kernel
    return True


def _buffer_positions(rotated: list[ir.Value], inv: np.ndarray, rscale: float | None, mask: ir.Value, xq: ir.Value,
                      max_len: int, graph: ir.Graph, ctx: LoweringContext) -> None:
    """``--kv-cache shared`` with the rotary outside (its width does not fit ``do_rotary``): the export's angles read
    the past length ``P`` from the past's shape, which is the buffer's ``max_sequence_length`` now.  The kernels that
    rotate Q and K read instead rows of ``cos/sin(p * inv_freq)`` caches (``p`` 0 .. ``max_len`` - 1, float32 as
    the export computes them) at each token's position ``sum(mask[b]) - S + s`` (right padding: what the buffer's
    mask says the row holds), as ``do_rotary`` does inside the op.  Built once per mask and angle table."""
    kernels = [v.producer() for v in rotated]
    expands = [_producer(k.inputs[1], "Expand") if k is not None and len(k.inputs) == 4 else None for k in kernels]
    if any(k is None or k.op_type != "RotaryEmbedding" or k.domain != MS_DOMAIN for k in kernels) or None in expands:
        raise PassFailedError("lower", "--kv-cache shared: the rotary kernels outside GroupQueryAttention (positions "
                                       "Expand-ed over the batch) were not found")
    order = {id(n): i for i, n in enumerate(graph)}
    first = min(expands, key=lambda n: order.get(id(n), len(order)))  # (the kernels' positions are read from here)
    key = ("gqa_buffer_positions", id(mask), inv.tobytes(), rscale)
    if key not in ctx.shared:
        angles = np.arange(max_len, dtype=np.float32)[:, None] * inv.astype(np.float32)[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        if rscale is not None:
            cos, sin = cos * np.float32(rscale), sin * np.float32(rscale)
        dtype = xq.dtype.numpy() if xq.dtype is not None else np.float32
        made: list[ir.Node] = []
        lengths = _add(made, "ReduceSum", [_add(made, "Cast", [mask], to=ir.DataType.INT64.value),
                                           _const(made, np.array([1], dtype=np.int64))], keepdims=1)  # [B, 1]
        # s - S for s < S counted on the device (float64 ones: exact), not by a Range over the query's shape on the
        # host, whose Memcpy would keep the step from being captured as a CUDA graph
        ones = _add(made, "ConstantOfShape", [_add(made, "Shape", [xq], start=1, end=2)],
                    value=ir.tensor(np.array([1.0], dtype=np.float64)))  # [S]
        axis0 = _const(made, np.array(0, dtype=np.int64))
        before = _add(made, "CumSum", [ones, axis0], exclusive=1)  # s
        back = _add(made, "Sub", [before, _add(made, "ReduceSum", [ones, _const(made, np.array([0], dtype=np.int64))],
                                               keepdims=1)])  # s - S
        positions = _add(made, "Add", [lengths, _add(made, "Cast", [back], to=ir.DataType.INT64.value)])  # [B, S]
        graph.insert_before(first, made)  # type: ignore[arg-type]
        ctx.shared[key] = (positions, add_initializer(graph, "mograph_buffer_cos_cache", cos.astype(dtype)),
                           add_initializer(graph, "mograph_buffer_sin_cache", sin.astype(dtype)))
    positions, cos_cache, sin_cache = ctx.shared[key]
    for kernel, expand in zip(kernels, expands):
        assert kernel is not None and expand is not None
        expand.replace_input_with(0, positions)  # ([B, S] expanded to [B, S]: the form _packed_external reads)
        kernel.replace_input_with(2, cos_cache)
        kernel.replace_input_with(3, sin_cache)


#: node metadata of the copy of an attention lowered in the exact branch of a right-padding check: no GQA there
_FALLBACK_KEY = "mograph.attention.padding_fallback"


def _right_padded(mask: ir.Value, past: ir.Value | None, new_nodes: list[ir.Node], shared: Shared) -> ir.Value:
    """A bool scalar, true where GroupQueryAttention's lengths give the export's numbers for ``mask`` ``[B, T]``: every
    row is ones then zeros (``mask == (arange(T) < ReduceSum(mask, 1))``, compared in the mask's own dtype, so a value
    other than 0 and 1 fails it) and every row holds at least one key (a prefill), or, for a decode step over the
    cache ``past`` ``[B, G, P, D]``, every row holds every key (the export places the new tokens at ``P + s``,
    GroupQueryAttention after each row's length) and the step is one token or the batch one row (ONNX Runtime's
    kernel refuses more new tokens over a past for a batch).  Built once per mask and step kind, on the device
    (ReduceSum, Range, Less, Equal, ReduceMin; Shape reads)."""
    key = ("padding_checks", id(mask), past is not None)
    if key in shared:
        return shared[key]  # type: ignore[no-any-return]

    def dim(value: ir.Value, axis: int) -> ir.Value:
        got = _add(new_nodes, "Cast", [_add(new_nodes, "Shape", [value], start=axis, end=axis + 1)],
                   to=ir.DataType.INT32.value)
        return _add(new_nodes, "Squeeze", [got, _const(new_nodes, np.array([0], dtype=np.int64))])

    lengths = _key_lengths(mask, new_nodes, shared)
    total = dim(mask, 1)
    zero, one = _const(new_nodes, np.array(0, dtype=np.int32)), _const(new_nodes, np.array(1, dtype=np.int32))
    keys = _add(new_nodes, "Unsqueeze", [_add(new_nodes, "Range", [zero, total, one]),
                                         _const(new_nodes, np.array([0], dtype=np.int64))])
    rows = _add(new_nodes, "Unsqueeze", [lengths, _const(new_nodes, np.array([1], dtype=np.int64))])
    expected = _add(new_nodes, "Less", [keys, rows])
    if mask.dtype != ir.DataType.BOOL:
        expected = _add(new_nodes, "Cast", [expected], to=(mask.dtype or ir.DataType.INT64).value)
    same = _add(new_nodes, "Cast", [_add(new_nodes, "Equal", [mask, expected])], to=ir.DataType.INT32.value)
    least = total if past is not None else one
    ok = _add(new_nodes, "And", [_add(new_nodes, "Equal", [_add(new_nodes, "ReduceMin", [same], keepdims=0), one]),
                                 _add(new_nodes, "GreaterOrEqual",
                                      [_add(new_nodes, "ReduceMin", [lengths], keepdims=0), least])])
    if past is not None:
        step = _add(new_nodes, "Sub", [total, dim(past, 2)])
        small = _add(new_nodes, "Or", [_add(new_nodes, "Equal", [step, one]),
                                       _add(new_nodes, "Equal", [dim(mask, 0), one])])
        ok = _add(new_nodes, "And", [ok, small])
    shared[key] = ok
    return ok


def _cache_positions(ids: ir.Value, past: ir.Value | None, new_nodes: list[ir.Node], shared: Shared) -> ir.Value:
    """A bool scalar, true where the ``position_ids`` input ``ids`` ``[B, S]`` is each token's cache position,
    ``ids[b, s] == P + s`` (``P`` the past ``[B, G, P, D]``'s length, 0 without one): where GroupQueryAttention's own
    rotary gives the export's angles.  Built once per input and step kind, on the device."""
    key = ("position_checks", id(ids), past is not None)
    if key in shared:
        return shared[key]  # type: ignore[no-any-return]
    zero, one = _const(new_nodes, np.array(0, dtype=np.int64)), _const(new_nodes, np.array(1, dtype=np.int64))
    axis0 = _const(new_nodes, np.array([0], dtype=np.int64))
    seq = _add(new_nodes, "Squeeze", [_add(new_nodes, "Shape", [ids], start=1, end=2), axis0])
    start = _add(new_nodes, "Squeeze", [_add(new_nodes, "Shape", [past], start=2, end=3), axis0]) \
        if past is not None else zero
    expected = _add(new_nodes, "Unsqueeze", [_add(new_nodes, "Range", [start, _add(new_nodes, "Add", [start, seq]),
                                                                       one]), axis0])
    given = ids if ids.dtype == ir.DataType.INT64 else _add(new_nodes, "Cast", [ids], to=ir.DataType.INT64.value)
    same = _add(new_nodes, "Cast", [_add(new_nodes, "Equal", [given, expected])], to=ir.DataType.INT32.value)
    ok = _add(new_nodes, "Equal", [_add(new_nodes, "ReduceMin", [same], keepdims=0),
                                   _const(new_nodes, np.array(1, dtype=np.int32))])
    shared[key] = ok
    return ok


def _guard(node: ir.Node, ctx: LoweringContext, ok: ir.Value, outer: list[ir.Node], fast: list[ir.Node],
           presents: tuple[ir.Value | None, ...], exact: Lowering) -> None:
    """``If(ok, then: fast, else: the exact lowering of a copy of node)`` in place of ``node``: the ``fast`` nodes end
    in the GroupQueryAttention kernel (outputs ``Y, present_key, present_value``); ``presents`` are the export's
    present outputs the kernel replaces (None: none).  The else branch is what ``exact`` writes without
    GroupQueryAttention (MultiHeadAttention over repeated K/V heads with the mask as a bias, exact for every mask);
    the nodes only it reads (the rotary kernels, the separate projections, the cache Concats) move into it, so the
    fast branch computes none of them.  ``outer`` (the shared lengths and the check) goes before ``node``."""
    graph = node.graph
    assert graph is not None
    base = node.name or node.op_type
    kernel = fast[-1]
    keep = [i for i, p in enumerate(presents) if p is not None]
    then_outs = [kernel.outputs[0]] + [kernel.outputs[1 + i] for i in keep]
    for i, n in enumerate(fast):
        n.name = f"{base}/gqa/{i}"
        n.metadata_props.update(node.metadata_props)
        n.metadata_props[LOWERED_FOR] = ctx.target
    copy = ir.node(node.op_type, list(node.inputs), attributes={k: a.value for k, a in node.attributes.items()},
                   domain=node.domain, version=node.version, name=f"{base}/exact",
                   metadata_props={**node.metadata_props, _FALLBACK_KEY: "1"})
    copy.outputs[0].name = f"{base}/exact_y"
    _like(copy.outputs[0], node.outputs[0])
    idents = [ir.node("Identity", [presents[i]], name=f"{base}/exact/present{i}") for i in keep]
    for i, n in zip(keep, idents):
        n.outputs[0].name = f"{base}/exact_present{i}"
        _like(n.outputs[0], presents[i], shape=False)
    then_g = ir.Graph([], then_outs, nodes=fast, name=f"{base}_gqa")
    else_g = ir.Graph([], [copy.outputs[0]] + [n.outputs[0] for n in idents], nodes=[copy, *idents], name=f"{base}_exact")
    branch = LoweringContext(ctx.model, ctx.target, ctx.op, shape_rules=ctx.shape_rules)  # its own shared values: they live in the branch
    if not exact(copy, branch):
        raise PassFailedError("lower", f"attention '{base}': the exact branch of the right-padding check did not lower")
    guard = ir.node("If", [ok], attributes={"then_branch": then_g, "else_branch": else_g}, name=f"{base}/if",
                    num_outputs=len(then_outs), metadata_props={**node.metadata_props, LOWERED_FOR: ctx.target})
    y = guard.outputs[0]
    _like(y, node.outputs[0])
    graph.insert_before(node, [*outer, guard])
    graph.opset_imports.setdefault(MS_DOMAIN, 1)  # (the kernels sit in the branches)
    for n in outer:
        n.name = f"{base}/check/{n.name}" if n.name else f"{base}/check"
    for i, new in zip(keep, guard.outputs[1:]):
        old = presents[i]
        assert old is not None
        _like(new, old)
        if old.is_graph_output():
            name = old.name
            old.name = f"{name}_exact"
            new.name = name
        for j, out in enumerate(graph.outputs):
            if out is old:
                graph.outputs[j] = new
    ir.convenience.replace_all_uses_with(node.outputs[0], y, replace_graph_outputs=True)
    y.name = node.outputs[0].name
    node.outputs[0].name = f"{base}/replaced_y"
    graph.remove(node, safe=True)
    for sub in (else_g, then_g):  # ONNX names are one scope with the branches' (onnx-ir names per graph)
        for i, n in enumerate(sub):
            for j, out in enumerate(n.outputs):
                out.name = f"{sub.name}/{i}:{j}"
        _sink(graph, sub, ctx.shared)


def _like(dst: ir.Value, src: ir.Value | None, shape: bool = True) -> None:
    """``dst`` typed (and shaped) as ``src``."""
    if src is not None and src.dtype is not None:
        dst.dtype = src.dtype
    if shape and src is not None and src.shape is not None:
        dst.shape = src.shape


def _sink(graph: ir.Graph, branch: ir.Graph, shared: Shared) -> None:
    """Move into ``branch`` every node of ``graph`` whose outputs only ``branch`` reads (from the last, each put
    before what is already there, so the order stays topological); what a lowering shares (``shared``: later
    nodes may read it) stays."""
    keep = {id(v) for key, got in shared.items() if key[0] != "rotary_outputs"  # (a note on an input, not built)
            for v in (got if isinstance(got, tuple) else (got,))}
    moved = True
    while moved:  # until nothing moves: a node's readers may sit after it in no particular order
        moved = False
        for n in reversed(list(graph)):
            if any(id(out) in keep or out.is_graph_output() for out in n.outputs) or any(
                    a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in n.attributes.values()):
                continue
            uses = [u for out in n.outputs for u, _ in out.uses()]
            if not uses:  # dead (what the rewrites above left): it would hold its inputs outside the branch
                graph.remove(n, safe=True)
                moved = True
            elif all(u.graph is branch for u in uses):
                graph.remove(n)
                branch.insert_before(next(iter(branch)), n)
                moved = True


def _mask_lengths_for_gqa(mask: ir.Value, new_nodes: list[ir.Node], shared: Shared) -> tuple[ir.Value, ir.Value]:
    """``seqlens_k = ReduceSum(int32(mask), 1) - 1`` and ``total_sequence_length = int32(Shape(mask)[1])``, built once
    per mask (as ONNX Runtime GenAI feeds them)."""
    key = ("gqa_mask_lengths", id(mask))
    if key in shared:
        return shared[key]  # type: ignore[no-any-return]
    lengths = _key_lengths(mask, new_nodes, shared)
    seqlens = _add(new_nodes, "Sub", [lengths, _const(new_nodes, np.array(1, dtype=np.int32))])
    total = _add(new_nodes, "Cast", [_add(new_nodes, "Shape", [mask], start=1, end=2)], to=ir.DataType.INT32.value)
    total = _add(new_nodes, "Squeeze", [total, _const(new_nodes, np.array([0], dtype=np.int64))])
    shared[key] = (seqlens, total)
    return seqlens, total
