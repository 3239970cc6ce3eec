"""``irutil.infer_types`` confirms a whole-model inference by inferring only what changed since the last one.

A fusion pass infers types before its rules; after a pass that changed the graph, the nodes that changed (and
those reading what changed) are inferred alone (``irutil._confirmed_by_region``), and the whole-model inference
runs only where that cannot show the same result.  Each test compares with the whole-model inference
(``_confirmed_by_region`` off): the same types on every value, the same model and reports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import mograph.passes.cleanup.infer_shapes  # noqa: F401 - imported before the tests patch what it imports
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import mograph
from mograph import irutil

ROOT = Path(__file__).resolve().parents[2]


def _stack(layers: int) -> onnx.ModelProto:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from bench_core import build_llama_stack
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return build_llama_stack(layers)


def _counting(monkeypatch: pytest.MonkeyPatch, region: bool) -> tuple[list[str], list[bool]]:
    """Count the whole-model inferences of ``infer_types`` (not ``infer-shapes``', which imported the function
    before) and the region's answers; the region off if not ``region``."""
    full: list[str] = []
    answers: list[bool] = []
    real_full, real_region = irutil.run_shape_inference, irutil._confirmed_by_region

    def run(model: ir.Model, **kw: object) -> None:
        full.append("full")
        real_full(model, **kw)  # type: ignore[arg-type]

    def confirm(*args: object) -> bool:
        answers.append(real_region(*args) if region else False)  # type: ignore[arg-type]
        return answers[-1]

    monkeypatch.setattr(irutil, "run_shape_inference", run)
    monkeypatch.setattr(irutil, "_confirmed_by_region", confirm)
    return full, answers


def _pipeline(monkeypatch: pytest.MonkeyPatch, region: bool) -> tuple[bytes, list[list[object]], int, list[bool]]:
    full, answers = _counting(monkeypatch, region)
    model, report = mograph.optimize(_stack(2).SerializeToString(), passes="cleanup,fuse", check_output=False)
    graph = onnx.ModelProto.FromString(model).graph.SerializeToString(deterministic=True)
    monkeypatch.undo()
    return graph, [[p.name, p.modified, p.stats, p.details] for p in report.passes], len(full), answers


def test_the_fusion_passes_infer_only_what_changed_and_write_the_same_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a LLaMA stack the three fusion passes that follow a change (``fuse-layernorm`` after the cleanup,
    ``fuse-skip-layernorm`` after ``fuse-rmsnorm``, ``fuse-gelu`` after ``fuse-skip-layernorm``) infer the
    changed region only; the model and every pass's record are those of the whole-model inferences."""
    graph, report, full, answers = _pipeline(monkeypatch, region=True)
    assert full == 0 and answers == [True, True, True]
    full_graph, full_report, full_full, _ = _pipeline(monkeypatch, region=False)
    assert full_full == 3
    assert (graph, report) == (full_graph, full_report)
    assert [p[1] for p in report if str(p[0]) in ("fuse-rmsnorm", "fuse-skip-layernorm")] == [True, True]


def _chain(x_shape: list[object] | None) -> ir.Model:
    """x -> Relu -> Sigmoid -> Neg -> y, plus NonZero(x) -> n (a dim ONNX names ``unk__N``); opset 17."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["r"], ["s"], name="sigmoid"),
             helper.make_node("Neg", ["s"], ["y"], name="neg"),
             helper.make_node("NonZero", ["x"], ["n"], name="nonzero")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                                            helper.make_tensor_value_info("n", TensorProto.INT64, None)])
    return ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _types(model: ir.Model) -> dict[str, tuple[object, object]]:
    values = [*model.graph.inputs, *model.graph.initializers.values(), *(v for n in model.graph for v in n.outputs)]
    return {str(v.name): (v.dtype, None if v.shape is None else [str(d) for d in v.shape]) for v in values}


def _edited(monkeypatch: pytest.MonkeyPatch, build: Callable[[], ir.Model], edit: Callable[[ir.Model], None],
            region: bool) -> tuple[dict[str, tuple[object, object]], int, list[bool]]:
    """Infer, edit, infer again: the types, the whole-model inferences of the second call, the region's answers."""
    model = build()
    irutil.restore_types(irutil.infer_types(model))  # as a pass that changed nothing
    full, answers = _counting(monkeypatch, region)
    irutil.infer_types(model)  # unchanged: the last inference's types, no inference of any kind
    assert (full, answers) == ([], [])
    edit(model)
    irutil.infer_types(model)
    types = _types(model)
    monkeypatch.undo()
    return types, len(full), answers


def _insert_neg(model: ir.Model) -> None:
    """A new node without types between Relu and Sigmoid (as a fusion writes one)."""
    relu = next(n for n in model.graph if n.op_type == "Relu")
    sigmoid = next(n for n in model.graph if n.op_type == "Sigmoid")
    neg = ir.node("Neg", [relu.outputs[0]], name="new_neg")
    model.graph.insert_after(relu, neg)
    sigmoid.replace_input_with(0, neg.outputs[0])
    neg.outputs[0].name = "new"


def test_a_new_node_without_types_is_typed_as_the_whole_inference_types_it(monkeypatch: pytest.MonkeyPatch) -> None:
    build = lambda: _chain([2, 8])  # noqa: E731
    types, full, answers = _edited(monkeypatch, build, _insert_neg, region=True)
    assert (full, answers) == (0, [True])
    assert types["new"] == (ir.DataType.FLOAT, ["2", "8"])
    assert (types, 1) == _edited(monkeypatch, build, _insert_neg, region=False)[:2]


def _give_x_a_shape(model: ir.Model) -> None:
    model.graph.inputs[0].shape = ir.Shape([3, 5])


def test_a_graph_input_given_a_shape_reaches_every_reader_as_in_the_whole_inference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The input had no shape at the first inference; with one, its readers and theirs get it (the region grows
    along the values whose types change), as the whole-model inference gives them."""
    build = lambda: _chain(None)  # noqa: E731
    types, full, answers = _edited(monkeypatch, build, _give_x_a_shape, region=False)
    assert full == 1 and types["y"] == (ir.DataType.FLOAT, ["3", "5"])
    region_types, region_full, region_answers = _edited(monkeypatch, build, _give_x_a_shape, region=True)
    assert region_types == types
    assert (region_full, region_answers) == (0, [True])  # NonZero's made-up dim stays as the first one named it


def _second_nonzero(model: ir.Model) -> None:
    relu = next(n for n in model.graph if n.op_type == "Relu")
    extra = ir.node("NonZero", [relu.outputs[0]], name="nonzero2")
    model.graph.insert_after(relu, extra)
    extra.outputs[0].name = "n2"
    model.graph.outputs.append(extra.outputs[0])


def test_a_dim_onnx_makes_up_is_named_by_the_whole_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first inference named NonZero's dim ``unk__0``; a second NonZero's dim is ``unk__1`` in the whole
    model, ``unk__0`` in a region of its own: the region does not decide it."""
    build = lambda: _chain([2, 8])  # noqa: E731
    types, full, answers = _edited(monkeypatch, build, _second_nonzero, region=True)
    assert (full, answers) == (1, [False])
    assert types["n2"] != types["n"] and types["n2"][1][1].startswith("unk__")
    assert types == _edited(monkeypatch, build, _second_nonzero, region=False)[0]


def _shape_chain() -> ir.Model:
    """Shape(b) -> Cast -> Reshape(d, .) -> Relu: the Reshape's shape is data ONNX propagates from b's shape
    (named dims ``p``, ``q``)."""
    nodes = [helper.make_node("Shape", ["b"], ["sb"], name="shape_b"),
             helper.make_node("Cast", ["sb"], ["target"], name="cast", to=TensorProto.INT64),
             helper.make_node("Reshape", ["d", "target"], ["reshaped"], name="reshape"),
             helper.make_node("Relu", ["reshaped"], ["out"], name="relu")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 12]),
                                       helper.make_tensor_value_info("b", TensorProto.FLOAT, ["p", "q"]),
                                       helper.make_tensor_value_info("d", TensorProto.FLOAT, [24])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    return ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _cast_reads_another_shape(model: ir.Model) -> None:
    """The Cast now reads Shape(a): the data the (unchanged) Reshape reads changes ([p, q] -> [2, 12]), the type
    of what it reads does not (int64 [2])."""
    cast = next(n for n in model.graph if n.op_type == "Cast")
    shape_a = ir.node("Shape", [model.graph.inputs[0]], name="shape_a")
    model.graph.insert_before(cast, shape_a)
    shape_a.outputs[0].name = "sa"
    shape_a.outputs[0].dtype, shape_a.outputs[0].shape = ir.DataType.INT64, ir.Shape([2])
    cast.replace_input_with(0, shape_a.outputs[0])


def test_data_onnx_propagates_out_of_the_region_sends_it_to_the_whole_inference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Cast (re-inferred: it reads a new value) gives the Reshape outside the region other data with the same
    type; the region cannot show what the Reshape infers from it, so the whole-model inference runs, and the
    Reshape's named dims become the sizes."""
    types, full, answers = _edited(monkeypatch, _shape_chain, _cast_reads_another_shape, region=True)
    assert (full, answers) == (1, [False])
    assert types["reshaped"] == types["out"] == (ir.DataType.FLOAT, ["2", "12"])
    assert types == _edited(monkeypatch, _shape_chain, _cast_reads_another_shape, region=False)[0]


def _with_initializer_data(model: ir.Model) -> None:
    """A new small initializer (sent with its data, as the whole model sends it) read by a new Reshape."""
    relu = next(n for n in model.graph if n.op_type == "Relu")
    sigmoid = next(n for n in model.graph if n.op_type == "Sigmoid")
    shape = ir.Value(name="new_shape", const_value=ir.tensor(np.array([4, 4], dtype=np.int64)))
    model.graph.register_initializer(shape)
    reshape = ir.node("Reshape", [relu.outputs[0], shape], name="new_reshape")
    model.graph.insert_after(relu, reshape)
    reshape.outputs[0].name = "new"
    sigmoid.replace_input_with(0, reshape.outputs[0])


def test_a_region_reading_an_initializers_data_infers_as_the_whole_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new Reshape to a new constant shape: the Reshape's output and every reader after it change type
    ([2, 8] -> [4, 4]) where they had none... and keep theirs where ONNX merges into it: as the whole inference."""
    build = lambda: _chain([2, 8])  # noqa: E731
    types, full, answers = _edited(monkeypatch, build, _with_initializer_data, region=True)
    assert (full, answers) == (0, [True])
    assert types["new"] == (ir.DataType.FLOAT, ["4", "4"])
    assert types == _edited(monkeypatch, build, _with_initializer_data, region=False)[0]


def _two_new_negs(model: ir.Model) -> None:
    """Two new Negs between Relu and Sigmoid: the first made without a type, the second with the type it infers (as
    a fusion types what it writes)."""
    relu = next(n for n in model.graph if n.op_type == "Relu")
    sigmoid = next(n for n in model.graph if n.op_type == "Sigmoid")
    first = ir.node("Neg", [relu.outputs[0]], name="first_neg")
    second = ir.node("Neg", [first.outputs[0]], name="second_neg")
    model.graph.insert_after(relu, [first, second])
    first.outputs[0].name, second.outputs[0].name = "untyped", "typed"
    second.outputs[0].dtype, second.outputs[0].shape = ir.DataType.FLOAT, ir.Shape([2, 8])
    sigmoid.replace_input_with(0, second.outputs[0])


def test_a_changed_type_read_only_inside_the_region_is_inferred_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The region (the new Negs, and the Sigmoid that reads a new value) is inferred once: that inference types the
    first Neg's output and sees it reach its only reader (the second Neg, in the region), so no second inference of
    the region confirms it (there were two before); the types are the whole inference's."""
    calls: list[int] = []
    real = onnx.shape_inference.infer_shapes

    def counted(proto: onnx.ModelProto, *args: object, **kwargs: object) -> onnx.ModelProto:
        calls.append(len(proto.graph.node))
        return real(proto, *args, **kwargs)  # type: ignore[arg-type]

    build = lambda: _chain([2, 8])  # noqa: E731
    model = build()
    irutil.restore_types(irutil.infer_types(model))  # as a pass that changed nothing
    irutil.infer_types(model)  # unchanged: the last inference's types back
    _two_new_negs(model)
    full, answers = _counting(monkeypatch, region=True)
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counted)
    irutil.infer_types(model)
    types = _types(model)
    monkeypatch.undo()
    assert (len(full), answers, calls) == (0, [True], [3])  # one inference: the new Negs and the Sigmoid reading one
    assert types["untyped"] == types["typed"] == (ir.DataType.FLOAT, ["2", "8"])
    assert types == _edited(monkeypatch, build, _two_new_negs, region=False)[0]


def test_the_walk_marks_where_each_node_begins() -> None:
    """``_walk``'s marks: each node's part of the structure (the node, its inputs, outputs and attributes) starts
    at its mark and ends at the next; the region check reads the nodes' parts from them."""
    model = _shape_chain()
    structure, _, marks = irutil._walk([model.graph])
    assert [structure[i] for i in marks] == list(model.graph)
    ends = [*marks[1:], len(structure)]
    for node, s, e in zip(model.graph, marks, ends):
        assert structure[s:e] == [node, *node.inputs, None, *node.outputs, None, *node.attributes.values(), None]


def _opset13_chain() -> ir.Model:
    """x [p, q] -> Relu -> Sigmoid -> y, and Identity(Shape(x)) -> t, the target a new Reshape will read (data that
    ONNX does not propagate through the Identity: the region is not refused for it); opset 13."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Identity", ["s"], ["t"], name="identity"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["r"], ["y"], name="sigmoid")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["p", "q"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))


def _reshape_to_computed_target(model: ir.Model) -> None:
    """A new Reshape-13 of Relu's output to Shape(x), between Relu and Sigmoid: ONNX infers no shape for it (its
    target is not a constant); the whole inference completes it from the shape rules."""
    relu = next(n for n in model.graph if n.op_type == "Relu")
    sigmoid = next(n for n in model.graph if n.op_type == "Sigmoid")
    target = next(n for n in model.graph if n.op_type == "Identity").outputs[0]
    reshape = ir.node("Reshape", [relu.outputs[0], target], name="new_reshape")
    model.graph.insert_after(relu, reshape)
    reshape.outputs[0].name = "new"
    sigmoid.replace_input_with(0, reshape.outputs[0])


def test_a_reshape_below_14_in_the_region_is_completed_by_the_whole_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX alone, on the region, leaves the new Reshape-13 and the Sigmoid after it without a shape; the whole
    inference gives them [p, q] (``run_shape_inference`` completes a Reshape below 14): the region does not decide."""
    types, full, answers = _edited(monkeypatch, _opset13_chain, _reshape_to_computed_target, region=True)
    assert (full, answers) == (1, [False])
    assert types["new"] == types["y"] == (ir.DataType.FLOAT, ["p", "q"])
    assert types == _edited(monkeypatch, _opset13_chain, _reshape_to_computed_target, region=False)[0]
