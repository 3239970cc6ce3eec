"""make-dynamic on small hand-built graphs: one per rewrite kind, plus every refusal.

Each rewrite test shows the op types left, the exact stats, the numbers (original size: equal to the
static model; other sizes: equal to numpy), that a second run changes nothing, and the near miss (an
axis already dynamic) is left alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from _shape_testing import const, dims, f32, graph_input, i64, make, ops
from mograph.passes.shape import MakeDynamicPass
from onnx import TensorProto, helper

from mograph.errors import OptionError, PassFailedError
from mograph.pass_infra import graph_fingerprint
from mograph.testing import run_ort, to_ir

RNG = np.random.default_rng(0)


def _check(proto, spec, x_shape_at, reference, sizes, expect_ops, expect_stats, name="x"):
    """Make ``spec`` dynamic, check op types, stats, numbers at every size, and a no-op second run."""
    model = to_ir(proto)
    result = MakeDynamicPass(dynamic=[spec]).call(model)
    assert result.modified
    assert result.stats == expect_stats
    assert ops(model) == expect_ops
    for n in sizes:
        x = RNG.standard_normal(x_shape_at(n)).astype(np.float32)
        got = run_ort(model, {name: x})[0]
        np.testing.assert_allclose(got, reference(x), rtol=1e-6, atol=1e-6)
        if n == sizes[0]:  # the export size: identical to the static model
            np.testing.assert_array_equal(got, run_ort(proto, {name: x})[0])
    fp = graph_fingerprint(model)
    again = MakeDynamicPass(dynamic=[spec]).call(model)
    assert not again.modified and graph_fingerprint(model) == fp
    return model


def test_reshape_target_rewritten():
    proto = make([helper.make_node("Reshape", ["x", "t"], ["y"], name="reshape")],
                 [f32("x", [2, 6])], [f32("y", [2, 3, 2])], [i64("t", [2, 3, 2])])
    model = _check(proto, "x:0=n", lambda n: (n, 6), lambda x: x.reshape(len(x), 3, 2), [2, 5, 1],
                   {"Shape": 1, "Gather": 1, "Concat": 1, "Reshape": 1},
                   {"dims_made_dynamic": 1, "rewritten.Reshape": 1, "nodes_added": 3})
    assert dims(graph_input(model, "x")) == ["n", 6]
    assert dims(model.graph.outputs[0]) == ["n", 3, 2]


def test_reshape_target_shared_by_two_reshapes_in_a_constant_node():
    """One ``Constant`` target feeding two Reshapes (CSE merges paddle2onnx's equal targets): each is rewritten
    and the Constant goes once.  Before the fix it was removed twice (exit 1, "does not belong to this graph")."""
    target = helper.make_node("Constant", [], ["t"], name="target",
                              value=onnx.numpy_helper.from_array(np.array([1, 3, 2], np.int64), "t"))
    proto = make([target,
                  helper.make_node("Reshape", ["x", "t"], ["y"], name="reshape_a"),
                  helper.make_node("Relu", ["x"], ["r"], name="relu"),
                  helper.make_node("Reshape", ["r", "t"], ["z"], name="reshape_b"),
                  helper.make_node("Add", ["y", "z"], ["s"], name="add")],
                 [f32("x", [1, 6])], [f32("s", [1, 3, 2])], [])
    model = _check(proto, "x:0=n", lambda n: (n, 6), lambda x: (x + np.maximum(x, 0)).reshape(len(x), 3, 2),
                   [1, 4], {"Shape": 1, "Gather": 1, "Concat": 2, "Reshape": 2, "Relu": 1, "Add": 1},
                   {"dims_made_dynamic": 1, "rewritten.Reshape": 2, "nodes_added": 4})
    assert dims(model.graph.outputs[0]) == ["n", 3, 2]


def test_reshape_batch_one_flatten_and_unflatten():
    # [1, 4, 3] -> [4, 3] ([-1, 3]) -> [1, 4, 3]: with batch 1 the 1 in the second target is the batch.
    proto = make([
        helper.make_node("Reshape", ["x", "t1"], ["h"], name="flatten"),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Reshape", ["r", "t2"], ["y"], name="unflatten"),
    ], [f32("x", [1, 4, 3])], [f32("y", [1, 4, 3])], [i64("t1", [-1, 3]), i64("t2", [1, 4, 3])])
    _check(proto, "x:0=batch", lambda n: (n, 4, 3), lambda x: np.maximum(x, 0), [1, 3, 8],
           {"Shape": 1, "Gather": 1, "Concat": 1, "Reshape": 2, "Relu": 1},
           {"dims_made_dynamic": 1, "rewritten.Reshape": 1, "nodes_added": 3})


def test_expand_shape_rewritten():
    proto = make([helper.make_node("Expand", ["x", "s"], ["y"], name="expand")],
                 [f32("x", [3, 1])], [f32("y", [3, 4])], [i64("s", [3, 4])])
    _check(proto, "x:0=n", lambda n: (n, 1), lambda x: np.broadcast_to(x, (len(x), 4)), [3, 6],
           {"Expand": 1}, {"dims_made_dynamic": 1, "rewritten.Expand": 1, "nodes_added": 0})


def test_slice_end_of_dynamic_axis_rewritten():
    proto = make([helper.make_node("Slice", ["x", "st", "en", "ax"], ["s"], name="slice"),
                  helper.make_node("Relu", ["s"], ["y"])],
                 [f32("x", [5, 4])], [f32("y", [5, 4])], [i64("st", [0]), i64("en", [5]), i64("ax", [0])])
    _check(proto, "x:0=n", lambda n: (n, 4), lambda x: np.maximum(x, 0), [5, 8],
           {"Slice": 1, "Relu": 1}, {"dims_made_dynamic": 1, "rewritten.Slice": 1, "nodes_added": 0})


def test_slice_of_a_table_traced_back():
    table = RNG.standard_normal((10, 4)).astype(np.float32)
    proto = make([helper.make_node("Slice", ["P", "st", "en", "ax"], ["s"], name="slice_table"),
                  helper.make_node("Add", ["x", "s"], ["y"], name="add")],
                 [f32("x", [5, 4])], [f32("y", [5, 4])],
                 [const("P", table), i64("st", [0]), i64("en", [5]), i64("ax", [0])])
    _check(proto, "x:0=n", lambda n: (n, 4), lambda x: x + table[: len(x)], [5, 7, 2],
           {"Shape": 1, "Gather": 1, "Slice": 1, "Add": 1},
           {"dims_made_dynamic": 1, "rewritten.Slice": 1, "nodes_added": 2})


def test_constant_of_shape_rewritten():
    value = helper.make_tensor("v", TensorProto.FLOAT, [1], [2.0])
    proto = make([helper.make_node("ConstantOfShape", ["s"], ["c"], name="cos", value=value),
                  helper.make_node("Mul", ["x", "c"], ["y"])],
                 [f32("x", [3, 4])], [f32("y", [3, 4])], [i64("s", [3, 4])])
    _check(proto, "x:0=n", lambda n: (n, 4), lambda x: 2 * x, [3, 5],
           {"Shape": 1, "Gather": 1, "Concat": 1, "ConstantOfShape": 1, "Mul": 1},
           {"dims_made_dynamic": 1, "rewritten.ConstantOfShape": 1, "nodes_added": 3})


def test_tile_repeats_rewritten():
    row = RNG.standard_normal((1, 4)).astype(np.float32)
    proto = make([helper.make_node("Tile", ["row", "r"], ["t"], name="tile"),
                  helper.make_node("Add", ["x", "t"], ["y"])],
                 [f32("x", [3, 4])], [f32("y", [3, 4])], [const("row", row), i64("r", [3, 1])])
    _check(proto, "x:0=n", lambda n: (n, 4), lambda x: x + row, [3, 6],
           {"Shape": 1, "Gather": 1, "Concat": 1, "Tile": 1, "Add": 1},
           {"dims_made_dynamic": 1, "rewritten.Tile": 1, "nodes_added": 3})


def test_range_limit_rewritten():
    # A float Range (an integer one on constants is folded first, then read as an arange table).
    f = np.float32
    proto = make([helper.make_node("Range", ["a", "b", "c"], ["r"], name="range"),
                  helper.make_node("Add", ["x", "r"], ["y"])],
                 [f32("x", [3])], [f32("y", [3])], [const("a", f(0)), const("b", f(3)), const("c", f(1))])
    _check(proto, "x:0=n", lambda n: (n,), lambda x: x + np.arange(len(x)), [3, 5],
           {"Shape": 1, "Gather": 1, "Cast": 1, "Range": 1, "Add": 1},
           {"dims_made_dynamic": 1, "rewritten.Range": 1, "nodes_added": 3})


def test_arange_position_ids_become_range():
    table = RNG.standard_normal((10, 2)).astype(np.float32)
    proto = make([helper.make_node("Gather", ["T", "pos"], ["g"], name="pos_embed"),
                  helper.make_node("Add", ["x", "g"], ["y"])],
                 [f32("x", [1, 4, 2])], [f32("y", [1, 4, 2])], [const("T", table), i64("pos", [[0, 1, 2, 3]])])
    _check(proto, "x:1=seq", lambda n: (1, n, 2), lambda x: x + table[np.arange(x.shape[1])][None], [4, 7, 1],
           {"Shape": 1, "Gather": 2, "Range": 1, "Reshape": 1, "Add": 1},
           {"dims_made_dynamic": 1, "rewritten.arange": 1, "nodes_added": 4})


def test_input_name_with_colons():
    proto = make([helper.make_node("Reshape", ["onnx::Flatten_0", "t"], ["y"])],
                 [f32("onnx::Flatten_0", [2, 6])], [f32("y", [2, 3, 2])], [i64("t", [2, 3, 2])])
    model = to_ir(proto)
    assert MakeDynamicPass(dynamic=["onnx::Flatten_0:0=n"]).call(model).modified
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_array_equal(run_ort(model, {"onnx::Flatten_0": x})[0], x.reshape(4, 3, 2))


def test_already_dynamic_axis_is_a_near_miss():
    proto = make([helper.make_node("Relu", ["x"], ["y"])], [f32("x", ["n", 4])], [f32("y", ["n", 4])])
    model = to_ir(proto)
    fp = graph_fingerprint(model)
    result = MakeDynamicPass(dynamic=["x:0=batch"]).call(model)
    assert not result.modified and result.stats == {"dims_made_dynamic": 0}
    assert graph_fingerprint(model) == fp


# ----------------------------------------------------------------------------------------------- refusals


def _refused(proto, spec, *words):
    model = to_ir(proto)
    with pytest.raises(PassFailedError) as err:
        MakeDynamicPass(dynamic=[spec]).call(model)
    message = str(err.value)
    assert "make-dynamic" in message
    for w in words:
        assert w in message, message
    assert all(isinstance(d, int) for d in graph_input(model, spec.rpartition(":")[0]).shape.dims)


def test_refuses_a_weight_with_the_size_baked_in():
    w = RNG.standard_normal((3, 4)).astype(np.float32)
    proto = make([helper.make_node("Add", ["x", "W"], ["y"], name="add_w")],
                 [f32("x", [3, 4])], [f32("y", [3, 4])], [const("W", w)])
    _refused(proto, "x:0=n", "node 'add_w'", "baked in")


def test_refuses_gather_of_the_last_position():
    proto = make([helper.make_node("Gather", ["x", "i"], ["y"], name="last", axis=0)],
                 [f32("x", [3, 4])], [f32("y", [4])], [i64("i", 2)])
    _refused(proto, "x:0=n", "node 'last'", "index 2")


def test_refuses_partial_slice_of_dynamic_axis():
    proto = make([helper.make_node("Slice", ["x", "st", "en", "ax"], ["y"], name="head")],
                 [f32("x", [3, 4])], [f32("y", [2, 4])], [i64("st", [0]), i64("en", [2]), i64("ax", [0])])
    _refused(proto, "x:0=n", "node 'head'", "cannot be told apart")


def test_refuses_unknown_op():
    node = helper.make_node("Mystery", ["x"], ["y"], name="custom", domain="acme")
    graph = helper.make_graph([node], "g", [f32("x", [3, 4])], [f32("y", [3, 4])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)])
    _refused(proto, "x:0=n", "node 'custom'", "no rule")


def test_refuses_reshape_that_splits_the_dynamic_axis():
    proto = make([helper.make_node("Reshape", ["x", "t"], ["y"], name="split_axis")],
                 [f32("x", [4])], [f32("y", [2, 2])], [i64("t", [2, 2])])
    _refused(proto, "x:0=n", "node 'split_axis'", "cannot be matched")


def test_refuses_a_batch_one_reshape_that_folds_batch_into_a_larger_dim():
    # PyTorch's multi-head attention (torchvision's ViT through the dynamo exporter, batch 1): the
    # sequence-first [L, batch, E] becomes [L, batch * heads, head_dim], exported as [3, 4, 2]. [3 * batch,
    # 4, 2] fits batch 1 as well and was taken silently (the outermost placement, meant for a batch among
    # literal 1s): at batch 2 it mixed the batch rows into the sequence (cosine 0.70 on the ViT, caught
    # only by --verify).  The two readings differ at batch 2: refused.
    proto = make([
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "s"], ["y"], name="split_heads"),
    ], [f32("x", [1, 3, 8])], [f32("y", [3, 4, 2])], [i64("s", [3, 4, 2])])
    _refused(proto, "x:0=batch", "node 'split_heads'", "ambiguous")


def test_refuses_squeezing_a_size_one_dynamic_axis():
    proto = make([helper.make_node("Squeeze", ["x", "a"], ["y"], name="squeeze")],
                 [f32("x", [1, 4])], [f32("y", [4])], [i64("a", [0])])
    _refused(proto, "x:0=batch", "node 'squeeze'", "squeezes")


@pytest.mark.parametrize(
    ("specs", "words"),
    [
        (["nope:0=n"], "no input 'nope'"),
        (["x:zero=n"], "expected NAME:AXIS=SYMBOL"),
        (["x:0=1abc"], "expected NAME:AXIS=SYMBOL"),
        (["x:5=n"], "no dimension 5"),
        (["x:0=n", "x:1=n"], "one name means one size"),
    ],
)
def test_option_errors(specs, words):
    proto = make([helper.make_node("Relu", ["x"], ["y"])], [f32("x", [3, 4])], [f32("y", [3, 4])])
    with pytest.raises(OptionError, match=words):
        MakeDynamicPass(dynamic=specs).call(to_ir(proto))


def test_registered_as_plugin():
    from mograph.plugins import get_registry

    reg = get_registry()
    assert reg.passes["make-dynamic"] is MakeDynamicPass
    assert isinstance(ir.Model, type)


# --- com.microsoft ops: their class comes from their foreign-op records ---------------------------------


def _ms_model(nodes: list, inputs: list, outputs: list, inits: list) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model


def test_com_microsoft_ops_from_their_records():
    # QuickGelu (elementwise) and SkipSimplifiedLayerNormalization (normalizes) keep input 0's shape by
    # their records in mograph.foreign_ops; no hand list of make-dynamic names them
    gamma = np.linspace(0.5, 1.5, 8).astype(np.float32)
    nodes = [
        helper.make_node("QuickGelu", ["x"], ["h"], domain="com.microsoft", alpha=1.702, name="quick_gelu"),
        helper.make_node("SkipSimplifiedLayerNormalization", ["h", "x", "g"], ["n"], domain="com.microsoft",
                         epsilon=1e-5, name="skip_rms"),
        helper.make_node("Reshape", ["n", "t"], ["y"], name="reshape"),
    ]
    proto = _ms_model(nodes, [f32("x", [2, 4, 8])], [f32("y", [2, 32])], [const("g", gamma), i64("t", [2, 32])])

    def reference(x: np.ndarray) -> np.ndarray:
        s = x / (1 + np.exp(-1.702 * x)) + x
        return (s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * gamma).reshape(len(x), 32)

    model = to_ir(proto)
    result = MakeDynamicPass(dynamic=["x:0=n"]).call(model)
    assert result.modified
    assert result.stats == {"dims_made_dynamic": 1, "rewritten.Reshape": 1, "nodes_added": 3}
    assert ops(model) == {"QuickGelu": 1, "SkipSimplifiedLayerNormalization": 1, "Shape": 1, "Gather": 1,
                          "Concat": 1, "Reshape": 1}
    assert dims(model.graph.outputs[0]) == ["n", 32]
    for n in (2, 5, 1):
        x = RNG.standard_normal((n, 4, 8)).astype(np.float32)
        np.testing.assert_allclose(run_ort(model, {"x": x})[0], reference(x), rtol=1e-5, atol=1e-5)
    fp = graph_fingerprint(model)
    assert not MakeDynamicPass(dynamic=["x:0=n"]).call(model).modified and graph_fingerprint(model) == fp


def test_refuses_rotary_embedding():
    # RotaryEmbedding keeps input 0's shape, but its caches' length may be the old sequence size
    cache = np.ones((4, 2), np.float32)
    nodes = [helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft",
                              num_heads=2, name="rotary")]
    proto = _ms_model(nodes, [f32("x", [1, 4, 8])], [f32("y", [1, 4, 8])],
                      [i64("pos", [[0, 1, 2, 3]]), const("cos", cache), const("sin", cache)])
    _refused(proto, "x:1=seq", "node 'rotary'", "no rule for RotaryEmbedding")


# --- Resize (every YOLO-style detector upsamples its feature maps) ------------------------------------

_CONV_W = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)


def _conv_resize(resize_inputs: list[str], inits: list, batch: int = 1, out_batch: int | None = None,
                 opset: int = 17):  # type: ignore[no-untyped-def]
    """x [batch, 3, 8, 8] -> Conv (4 channels, pad 1) -> Resize(nearest) -> y [.., 4, 16, 16]."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Resize", ["c", *resize_inputs], ["y"], mode="nearest", name="resize"),
    ]
    return make(nodes, [f32("x", [batch, 3, 8, 8])], [f32("y", [out_batch or batch, 4, 16, 16])],
                [const("w", _CONV_W), *inits], opset=opset)


def _per_sample(proto):  # type: ignore[no-untyped-def]
    """The static (batch 1) model run on each sample of a batch: what the dynamic model must compute."""
    return lambda x: np.concatenate([run_ort(proto, {"x": x[i : i + 1]})[0] for i in range(len(x))])


def test_resize_with_scales_is_batch_safe():
    scales = const("scales", np.array([1, 1, 2, 2], np.float32))
    proto = _conv_resize(["", "scales"], [scales])
    model = _check(proto, "x:0=batch", lambda n: (n, 3, 8, 8), _per_sample(proto), [1, 3],
                   {"Conv": 1, "Resize": 1}, {"dims_made_dynamic": 1, "nodes_added": 0})
    assert dims(model.graph.outputs[0]) == ["batch", 4, 16, 16]


def test_resize_sizes_follow_the_inputs_batch_and_channels():
    sizes = i64("sizes", [1, 4, 16, 16])
    proto = _conv_resize(["", "", "sizes"], [sizes])
    model = _check(proto, "x:0=batch", lambda n: (n, 3, 8, 8), _per_sample(proto), [1, 2, 5],
                   {"Conv": 1, "Resize": 1, "Shape": 1, "Gather": 1, "Concat": 1},
                   {"dims_made_dynamic": 1, "rewritten.Resize": 1, "nodes_added": 3})
    assert dims(model.graph.outputs[0]) == ["batch", 4, 16, 16]
    resize = next(n for n in model.graph if n.op_type == "Resize")
    assert resize.inputs[3].producer().op_type == "Concat"


def test_resize_sizes_computed_from_the_input_shape():
    # sizes = Concat(Shape(c)[:2], [16, 16]): already follows the input at run time
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Shape", ["c"], ["cs"], end=2),
        helper.make_node("Concat", ["cs", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["c", "", "", "sizes"], ["y"], mode="nearest", name="resize"),
    ]
    proto = make(nodes, [f32("x", [1, 3, 8, 8])], [f32("y", [1, 4, 16, 16])], [const("w", _CONV_W), i64("hw", [16, 16])])
    # the fold before the walk turns Shape(c)[:2] into a constant (the dead Constant node it leaves is
    # cleanup's job), so the sizes are rewritten as in the test above
    model = _check(proto, "x:0=batch", lambda n: (n, 3, 8, 8), _per_sample(proto), [1, 4],
                   {"Conv": 1, "Resize": 1, "Shape": 1, "Gather": 1, "Concat": 1, "Constant": 1},
                   {"dims_made_dynamic": 1, "rewritten.Resize": 1, "nodes_added": 3})
    assert dims(model.graph.outputs[0]) == ["batch", 4, 16, 16]


def test_resize_to_a_fixed_batch_is_refused():
    # the export's batch of 2 is resized to 1: a fixed size on the dynamic axis has no batch-safe meaning
    proto = _conv_resize(["", "", "sizes"], [i64("sizes", [1, 4, 16, 16])], batch=2, out_batch=1)
    model = to_ir(proto)
    with pytest.raises(PassFailedError, match=r"node 'resize' \(Resize\): it resizes the dynamic dim batch .* fixed size"):
        MakeDynamicPass(dynamic=["x:0=batch"]).call(model)


def test_resize_with_computed_scales_is_refused():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("ReduceMean", ["c"], ["m"], keepdims=0),
        helper.make_node("Expand", ["m", "four"], ["s"]),
        helper.make_node("Resize", ["c", "", "s"], ["y"], mode="nearest", name="resize"),
    ]
    proto = make(nodes, [f32("x", [1, 3, 8, 8])], [f32("y", ["n", "c", "h", "w"])], [const("w", _CONV_W), i64("four", [4])])
    with pytest.raises(PassFailedError, match=r"node 'resize' \(Resize\): it has neither constant scales nor sizes"):
        MakeDynamicPass(dynamic=["x:0=batch"]).call(to_ir(proto))
