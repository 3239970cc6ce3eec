"""``simplify-shapes``: dynamic shapes computed once from the graph inputs, no-op reshapes removed, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from mograph.passes.cleanup import SimplifyShapesPass

from mograph.testing import assert_close, assert_untouched, check_pass, feeds_for, parse, run_ort, to_proto

pytest.importorskip("onnxruntime")

#: feeds for several sizes of the named dims, batch 1 and sizes 0 included where the graph allows it
SIZES = [{"batch": 1, "seq": 5}, {"batch": 3, "seq": 7}, {"batch": 2, "seq": 1}]
ZERO_STATS = {
    "removed_reshapes": 0, "removed_expands": 0, "merged_reshapes": 0, "reshape_targets": 0,
    "shape_constants": 0, "shapes_rebuilt": 0, "removed_nodes": 0,
}


def _stats(**counts: int) -> dict[str, int]:
    return {**ZERO_STATS, **counts}


def _same_on_all_sizes(proto, model, sizes=SIZES) -> None:
    for dims in sizes:
        feeds = feeds_for(proto, seed=1, dims=dims)
        assert_close(run_ort(proto, feeds), run_ort(to_proto(model), feeds), 1e-6)


# GPT-2's Conv1D: flatten to [-1, H], Gemm, reshape back to [batch, seq, N] read from Shape(x).
CONV1D = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, seq, 8] x, float[8, 12] w) => (float[batch, seq, 12] y) {
    s = Shape(x)
    i0 = Constant<value = int64 {0}>()
    i1 = Constant<value = int64 {1}>()
    ax = Constant<value = int64[1] {0}>()
    b = Gather<axis = 0>(s, i0)
    q = Gather<axis = 0>(s, i1)
    m1 = Constant<value = int64[1] {-1}>()
    big = Constant<value = int64[1] {9223372036854775807}>()
    h = Slice(s, m1, big)
    flat = Concat<axis = 0>(m1, h)
    x2 = Reshape(x, flat)
    g2 = Gemm(x2, w)
    ub = Unsqueeze(b, ax)
    uq = Unsqueeze(q, ax)
    n12 = Constant<value = int64[1] {12}>()
    back = Concat<axis = 0>(ub, uq, n12)
    y = Reshape(g2, back)
}
"""


def test_conv1d_reshapes_read_input_dims_once():
    proto = parse(CONV1D)
    model = check_pass(
        SimplifyShapesPass(), proto,
        # flat -> the constant [-1, 8]; back -> Concat(Shape(x, end=2), [12]); the Gather/Unsqueeze chain goes
        stats=_stats(reshape_targets=2, removed_nodes=12),
        ops_left=["Reshape", "Gemm", "Shape", "Concat", "Reshape"],
        feeds=feeds_for(proto, dims={"batch": 2, "seq": 3}),
    )
    _same_on_all_sizes(proto, model)
    shape = next(n for n in model.graph if n.op_type == "Shape")
    assert shape.inputs[0] is model.graph.inputs[0] and shape.attributes["end"].value == 2
    first = next(n for n in model.graph if n.op_type == "Reshape")
    assert first.inputs[1].const_value.numpy().tolist() == [-1, 8]


# BERT's head split and merge: [batch, seq, 16] -> [batch, seq, 4, 4] -> [batch, seq, 16], both read Shape(x).
HEADS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, seq, 16] x) => (float[batch, seq, 16] y) {
    s = Shape(x)
    i0 = Constant<value = int64 {0}>()
    i1 = Constant<value = int64 {1}>()
    b = Gather<axis = 0>(s, i0)
    q = Gather<axis = 0>(s, i1)
    ax = Constant<value = int64[1] {0}>()
    ub = Unsqueeze(b, ax)
    uq = Unsqueeze(q, ax)
    n44 = Constant<value = int64[2] {4, 4}>()
    split = Concat<axis = 0>(ub, uq, n44)
    r = Reshape(x, split)
    t = Transpose<perm = [0, 2, 1, 3]>(r)
    n = Relu(t)
    t2 = Transpose<perm = [0, 2, 1, 3]>(n)
    r2 = Shape(t2)
    b2 = Gather<axis = 0>(r2, i0)
    ub2 = Unsqueeze(b2, ax)
    m1 = Constant<value = int64[1] {-1}>()
    n16 = Constant<value = int64[1] {16}>()
    merge = Concat<axis = 0>(ub2, m1, n16)
    y = Reshape(t2, merge)
}
"""


def test_head_split_and_merge_become_constant_targets():
    proto = parse(HEADS)
    model = check_pass(
        SimplifyShapesPass(), proto,
        # split -> [0, 0, 4, 4]; merge -> [0, 0, 16] (seq copied instead of -1: both exact)
        stats=_stats(reshape_targets=2, removed_nodes=16),
        ops_left=["Reshape", "Transpose", "Relu", "Transpose", "Reshape"],
        feeds=feeds_for(proto, dims={"batch": 2, "seq": 3}),
    )
    _same_on_all_sizes(proto, model)
    targets = [n.inputs[1].const_value.numpy().tolist() for n in model.graph if n.op_type == "Reshape"]
    assert targets == [[0, 0, 4, 4], [0, 0, 16]]


# torch's expand(-1 ...) and a reshape round trip that changes nothing.
NOOPS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, 1, seq] x) => (float[batch, 4, seq] y) {
    s = Shape(x)
    j0 = Constant<value = int64[1] {0}>()
    j2 = Constant<value = int64[1] {2}>()
    n4 = Constant<value = int64[1] {4}>()
    b = Gather<axis = 0>(s, j0)
    q = Gather<axis = 0>(s, j2)
    want = Concat<axis = 0>(b, n4, q)
    minus = Constant<value = int64[3] {-1, -1, -1}>()
    is_minus = Equal(want, minus)
    ones = Constant<value = int64[3] {1, 1, 1}>()
    target = Where(is_minus, ones, want)
    e = Expand(x, target)
    m1 = Constant<value = int64[1] {-1}>()
    f = Reshape(e, m1)
    back = Shape(e)
    r = Reshape(f, back)
    y = Relu(r)
}
"""


def test_reshape_round_trip_is_removed_and_expand_reads_input_dims():
    proto = parse(NOOPS)
    model = check_pass(
        SimplifyShapesPass(), proto,
        # Reshape(Reshape(e, [-1]), Shape(e)) is e; Expand's target is Concat(Shape(x, end=1), [4], Shape(x, start=2))
        stats=_stats(removed_reshapes=1, shapes_rebuilt=1, removed_nodes=12),
        ops_left=["Shape", "Shape", "Concat", "Expand", "Relu"],
        feeds=feeds_for(proto, dims={"batch": 2, "seq": 3}),
    )
    _same_on_all_sizes(proto, model)


# Two layers each reading Shape of their own activation: both targets come from the input's dims, built once.
LAYERS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, seq, 8] x, float[8, 8] w) => (float[batch, seq, 8] y) {
    ax = Constant<value = int64[1] {0}>()
    i0 = Constant<value = int64 {0}>()
    i1 = Constant<value = int64 {1}>()
    n8 = Constant<value = int64[1] {8}>()
    h = Relu(x)
    s1 = Shape(h)
    a1 = Gather<axis = 0>(s1, i0)
    b1 = Gather<axis = 0>(s1, i1)
    ua1 = Unsqueeze(a1, ax)
    ub1 = Unsqueeze(b1, ax)
    t1 = Concat<axis = 0>(ua1, ub1, n8)
    f1 = Flatten<axis = 2>(h)
    g1 = Gemm(f1, w)
    m1 = Reshape(g1, t1)
    h2 = Sigmoid(m1)
    s2 = Shape(h2)
    a2 = Gather<axis = 0>(s2, i0)
    b2 = Gather<axis = 0>(s2, i1)
    ua2 = Unsqueeze(a2, ax)
    ub2 = Unsqueeze(b2, ax)
    t2 = Concat<axis = 0>(ua2, ub2, n8)
    f2 = Flatten<axis = 2>(h2)
    g2 = Gemm(f2, w)
    y = Reshape(g2, t2)
}
"""


def test_per_layer_shape_chains_become_one():
    proto = parse(LAYERS)
    model = check_pass(
        SimplifyShapesPass(), proto,
        stats=_stats(reshape_targets=2, removed_nodes=14),
        ops_left=["Relu", "Flatten", "Gemm", "Shape", "Concat", "Reshape", "Sigmoid", "Flatten", "Gemm", "Reshape"],
        feeds=feeds_for(proto, dims={"batch": 2, "seq": 3}),
    )
    _same_on_all_sizes(proto, model)
    reshapes = [n for n in model.graph if n.op_type == "Reshape"]
    assert reshapes[0].inputs[1] is reshapes[1].inputs[1]  # one target shared by both layers


def test_static_shape_vector_becomes_a_constant():
    proto = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 3, 4] x) => (float[6, 4] y) {
        s = Shape(x)
        j0 = Constant<value = int64[1] {0}>()
        j2 = Constant<value = int64[1] {2}>()
        n4 = Constant<value = int64[1] {4}>()
        lead = Slice(s, j0, j2)
        n = ReduceProd<keepdims = 1>(lead)
        t = Concat<axis = 0>(n, n4)
        y = Reshape(x, t)
    }
    """)
    # ReduceProd's input [2, 3] is static, and the shape query reads ReduceProd's value (6) since session 12:
    # the whole Reshape target [6, 4] is a constant (before: only the Slice folded, ReduceProd and Concat stayed)
    check_pass(SimplifyShapesPass(), proto, stats=_stats(reshape_targets=1, removed_nodes=7), ops_left=["Reshape"])
    proto = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 3, 4] x) => (float[2, 4, 3] y) {
        s = Shape(x)
        j0 = Constant<value = int64[1] {0}>()
        j1 = Constant<value = int64[1] {1}>()
        n4 = Constant<value = int64[1] {4}>()
        ones = Constant<value = int64[3] {1, 1, 1}>()
        a = Gather<axis = 0>(s, j0)
        b = Gather<axis = 0>(s, j1)
        t = Concat<axis = 0>(a, n4, b)
        r = Reshape(x, t)
        y = Tile(r, ones)
    }
    """)
    # ...while one computed from static dims becomes the constant [2, 4, 3] (a static dim stays a literal).
    model = check_pass(SimplifyShapesPass(), proto, stats=_stats(reshape_targets=1, removed_nodes=7),
                       ops_left=["Constant", "Reshape", "Tile"])
    assert next(n for n in model.graph if n.op_type == "Reshape").inputs[1].const_value.numpy().tolist() == [2, 4, 3]


def test_near_misses_are_left_alone():
    # The target reads the dims of another tensor (z's first dim is not x's): no 0 copy, no -1 invented;
    # it is already built from z's shape the short way.
    other = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[a, 6] x, float[c, 3] z) => (float[c, d] y) {
        sz = Shape<end = 1>(z)
        m1 = Constant<value = int64[1] {-1}>()
        t = Concat<axis = 0>(sz, m1)
        y = Reshape(x, t)
    }
    """)
    assert_untouched(SimplifyShapesPass(), other)
    # allowzero=1: a 0 in the target would mean a zero-size dim, so a dim is never replaced by 0.
    allowzero = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch, seq, 16] x) => (float[batch, seq, 4, 4] y) {
        sx = Shape<end = 2>(x)
        n44 = Constant<value = int64[2] {4, 4}>()
        t = Concat<axis = 0>(sx, n44)
        y = Reshape<allowzero = 1>(x, t)
    }
    """)
    assert_untouched(SimplifyShapesPass(), allowzero)
    # An Expand that broadcasts (the target's middle dim is 4, the input's 1) stays.
    expand = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[batch, 1, seq] x) => (float[batch, 4, seq] y) {
        sa = Shape<end = 1>(x)
        sb = Shape<start = 2>(x)
        n4 = Constant<value = int64[1] {4}>()
        t = Concat<axis = 0>(sa, n4, sb)
        y = Expand(x, t)
    }
    """)
    assert_untouched(SimplifyShapesPass(), expand)
    # Two symbolic entries that do not repeat the input's dims at their index: no -1 (a zero-size dim would
    # make it ambiguous), so the target is left as it is.
    two = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[n, 12] x, float[batch, seq] ref) => (float[batch, seq, 12] y) {
        sr = Shape(ref)
        n12 = Constant<value = int64[1] {12}>()
        t = Concat<axis = 0>(sr, n12)
        y = Reshape(x, t)
    }
    """)
    assert_untouched(SimplifyShapesPass(), two)


def test_reading_another_tensor_is_exact_where_the_dims_differ():
    # Numbers with a = 2, c = 3 (x [2, 6] -> [3, 4]): copying x's dim would give [2, 6].
    proto = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[a, 6] x, float[c, 3] z) => (float[c, d] y) {
        s = Shape(z)
        i0 = Constant<value = int64 {0}>()
        ax = Constant<value = int64[1] {0}>()
        m1 = Constant<value = int64[1] {-1}>()
        c0 = Gather<axis = 0>(s, i0)
        uc = Unsqueeze(c0, ax)
        t = Concat<axis = 0>(uc, m1)
        y = Reshape(x, t)
    }
    """)
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(2, 6), "z": np.zeros((3, 3), np.float32)}
    model = check_pass(SimplifyShapesPass(), proto, stats=_stats(reshape_targets=1, removed_nodes=5),
                       ops_left=["Shape", "Concat", "Reshape"], feeds=feeds)
    assert run_ort(to_proto(model), feeds)[0].shape == (3, 4)


def test_zero_size_batch_stays_exact():
    proto = parse(CONV1D)
    model = check_pass(SimplifyShapesPass(), proto, feeds=feeds_for(proto, dims={"batch": 2, "seq": 3}))
    feeds = feeds_for(proto, dims={"batch": 0, "seq": 3})
    got = run_ort(to_proto(model), feeds)
    assert got[0].shape == run_ort(proto, feeds)[0].shape == (0, 3, 12)


# Rotary-style: positions Range(0, seq), a half-split by Slice; the product's dims are still [batch, seq, 16].
ROTARY = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, seq, 16] x) => (float[batch, seq, 16] y) {
    s = Shape(x)
    i1 = Constant<value = int64 {1}>()
    zero = Constant<value = int64 {0}>()
    one = Constant<value = int64 {1}>()
    q = Gather<axis = 0>(s, i1)
    r = Range(zero, q, one)
    rf = Cast<to = 1>(r)
    axes = Constant<value = int64[2] {0, 2}>()
    u = Unsqueeze(rf, axes)
    j0 = Constant<value = int64[1] {0}>()
    j8 = Constant<value = int64[1] {8}>()
    big = Constant<value = int64[1] {9223372036854775807}>()
    j2 = Constant<value = int64[1] {2}>()
    lo = Slice(x, j0, j8, j2)
    hi = Slice(x, j8, big, j2)
    c = Concat<axis = 2>(hi, lo)
    m = Mul(c, u)
    t = Shape(m)
    k0 = Constant<value = int64[1] {0}>()
    k1 = Constant<value = int64[1] {1}>()
    b0 = Gather<axis = 0>(t, k0)
    b1 = Gather<axis = 0>(t, k1)
    n16 = Constant<value = int64[1] {16}>()
    target = Concat<axis = 0>(b0, b1, n16)
    yy = Reshape(m, target)
    y = Relu(yy)
}
"""


def test_range_and_slice_dims_are_followed():
    proto = parse(ROTARY)
    model = check_pass(SimplifyShapesPass(), proto, stats=_stats(removed_reshapes=1, removed_nodes=8),
                       feeds=feeds_for(proto, dims={"batch": 2, "seq": 3}))
    _same_on_all_sizes(proto, model)
    assert "Reshape" not in [n.op_type for n in model.graph]  # [batch, seq, 16] to [batch, seq, 16]


def test_pipeline_runs_it_after_the_appended_lower():
    import mograph

    proto = parse(CONV1D)
    _, report = mograph.optimize(proto, "cleanup", options={"target": "ort"})
    names = [p.name for p in report.passes]
    assert names[-4:] == ["lower", "simplify-shapes", "cse", "eliminate-dead"]
    _, explicit = mograph.optimize(proto, "cleanup,lower", options={"target": "ort"})
    assert "simplify-shapes" not in [p.name for p in explicit.passes]


def test_float_constant_of_shape_is_not_taken_for_a_shape_vector():
    # ConstantOfShape's default value is float 0 (here 1.0): its output is data, never an int64 constant.
    proto = parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[3] x) => (float[3] y) {
        n = Constant<value = int64[1] {3}>()
        ones = ConstantOfShape<value = float[1] {1.0}>(n)
        y = Mul(x, ones)
    }
    """)
    assert_untouched(SimplifyShapesPass(), proto)


def test_below_opset_15_the_pieces_are_gathered_from_one_shape():
    # Shape has no start/end before opset 15: [batch, seq] is Gather(Shape(x), [0, 1]), and a second run
    # recognizes it.
    proto = parse(CONV1D.replace('"" : 17', '"" : 14'))
    model = check_pass(SimplifyShapesPass(), proto, stats=_stats(reshape_targets=2, removed_nodes=11),
                       ops_left=["Reshape", "Gemm", "Shape", "Gather", "Concat", "Reshape"],
                       feeds=feeds_for(proto, dims={"batch": 2, "seq": 3}))
    _same_on_all_sizes(proto, model)


# A dim first carried by an intermediate value: Add(x, p) broadcasts seq with pos (no rule says which wins),
# so the sum's dim 1 is a new unknown; the exporter reads it from Shape(t), t = Relu(sum), as BERT's attention
# masks read the embeddings' LayerNorm output and never the sum the embedding fusion takes whole.
BORN_INSIDE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch, seq, 8] x, float[1, pos, 8] p) => (float[batch, seq, 8] w, float[batch, seq, 2, 4] y) {
    s = Add(x, p)
    t = Relu(s)
    sh = Shape(t)
    i0 = Constant<value = int64 {0}>()
    i1 = Constant<value = int64 {1}>()
    ax = Constant<value = int64[1] {0}>()
    b = Gather<axis = 0>(sh, i0)
    q = Gather<axis = 0>(sh, i1)
    ub = Unsqueeze(b, ax)
    uq = Unsqueeze(q, ax)
    rest = Constant<value = int64[2] {2, 4}>()
    target = Concat<axis = 0>(ub, uq, rest)
    w = Neg(t)
    one = Constant<value = float[1] {1.0}>()
    y = Expand(one, target)
}
"""


def test_rebuilt_dim_reads_a_value_whose_shape_is_read_already():
    """The batch is rebuilt from the input ``x``; the sum's new dim from ``t``, whose shape the graph reads already,
    not from the sum (the first value carrying it), so no ``Shape`` reader is added to the sum."""
    proto = parse(BORN_INSIDE)
    sizes = [{"batch": 2, "seq": 5, "pos": 5}, {"batch": 3, "seq": 1, "pos": 1}, {"batch": 1, "seq": 4, "pos": 1}]
    model = check_pass(SimplifyShapesPass(), proto, stats=_stats(shapes_rebuilt=1, removed_nodes=7),
                       feeds=feeds_for(proto, seed=1, dims=sizes[0]))
    shapes = [n for n in model.graph if n.op_type == "Shape"]
    assert sorted((n.inputs[0].name, n.attributes["start"].value if "start" in n.attributes else 0,
                   n.attributes["end"].value) for n in shapes) == [("t", 1, 2), ("x", 0, 1)]
    _same_on_all_sizes(proto, model, sizes)
