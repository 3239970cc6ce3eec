"""The pass infrastructure: explicit order, presets, the report, provenance, the honesty check,
failures that name the pass, and options."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper

import mograph
from models.builders import make_model
from mograph.errors import InternalError, ModelError, OptionError, PassFailedError, PluginError, UnknownPassError
from mograph.hookspecs import hookimpl
from mograph.pass_infra import PROVENANCE_PASS, PROVENANCE_RULE, Option, PassManager, PassResult
from mograph.plugins import Registry, get_plugin_manager


def _model() -> ir.Model:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("LeakyRelu", ["r"], ["y"], name="leaky", alpha=0.1),
    ]
    return ir.serde.deserialize_model(make_model(nodes, [("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])]))


# --- order, presets --------------------------------------------------------------------------------

CALLS: list[str] = []


def _recording(pass_name: str) -> type[mograph.Pass]:
    class Recording(mograph.Pass):
        """Record that it ran; change nothing."""

        name = pass_name

        def call(self, model: ir.Model) -> PassResult:
            CALLS.append(self.name)
            return PassResult(modified=False, stats={"calls": 1})

    return Recording


class _OrderPlugin:
    """Registers passes a, b, c (in that order) and some presets."""

    @hookimpl
    def mograph_add_passes(self):
        return [_recording("pass-a"), _recording("pass-b"), _recording("pass-c")]

    @hookimpl
    def mograph_add_presets(self):
        return {"outer": ["pass-c", "inner", "pass-a"], "inner": ["pass-b", "pass-a"]}


def _registry(*plugins: object) -> Registry:
    pm = get_plugin_manager(autoload=False)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"test-plugin-{i}")
    return Registry.build(pm)


def test_manager_runs_the_explicit_order_not_registration_order():
    reg = _registry(_OrderPlugin())
    names = reg.expand("pass-c,pass-a,pass-b")
    assert names == ["pass-c", "pass-a", "pass-b"]
    CALLS.clear()
    report = PassManager(reg.instantiate(names), hook=reg.pm.hook).run(_model())
    assert CALLS == ["pass-c", "pass-a", "pass-b"]
    assert [p.name for p in report.passes] == ["pass-c", "pass-a", "pass-b"]


def test_presets_expand_recursively_in_place_and_in_order():
    reg = _registry(_OrderPlugin())
    assert reg.expand("outer") == ["pass-c", "pass-b", "pass-a", "pass-a"]
    assert reg.expand(["pass-b", "outer", "inner"]) == ["pass-b", "pass-c", "pass-b", "pass-a", "pass-a", "pass-b", "pass-a"]
    # The built-in preset, from the real registry.
    assert mograph.plugins.get_registry().expand("cleanup") == [
        "infer-shapes", "fold-constants", "eliminate-identity", "cse", "eliminate-dead", "topo-sort",
    ]


def test_preset_cycle_is_an_error_naming_the_cycle():
    class Cyclic:
        @hookimpl
        def mograph_add_presets(self):
            return {"loop-a": ["pass-a", "loop-b"], "loop-b": ["loop-a"]}

    reg = _registry(_OrderPlugin(), Cyclic())
    with pytest.raises(PluginError, match="preset cycle: loop-a -> loop-b -> loop-a"):
        reg.expand("loop-a")


def test_unknown_name_suggests_close_ones():
    reg = _registry(_OrderPlugin())
    with pytest.raises(UnknownPassError, match="did you mean pass-a"):
        reg.expand("pass-a,pass")


# --- the report ------------------------------------------------------------------------------------


class _RemoveLeaky(mograph.Pass):
    """Replace LeakyRelu with Relu (creates a node)."""

    name = "leaky-to-relu"

    def call(self, model: ir.Model) -> PassResult:
        count = 0
        for node in list(model.graph):
            if node.op_type == "LeakyRelu":
                new = ir.node("Relu", inputs=[node.inputs[0]])
                mograph.stamp(new, self.name, "LeakyToRelu")
                ir.convenience.replace_nodes_and_values(model.graph, node, [node], [new], node.outputs, new.outputs)
                count += 1
        return PassResult(modified=count > 0, stats={"LeakyToRelu": count})


class _AddNeg(mograph.Pass):
    """Append Neg(Neg(y)) in front of the output (creates two nodes, no rule stamped)."""

    name = "add-neg"

    def call(self, model: ir.Model) -> PassResult:
        out = model.graph.outputs[0]
        first = ir.node("Neg", inputs=[out])
        second = ir.node("Neg", inputs=[first.outputs[0]])
        model.graph.extend([first, second])
        second.outputs[0].name = out.name + "_negneg"
        model.graph.outputs[0] = second.outputs[0]
        return PassResult(modified=True, stats={"added": 2})


def test_report_has_timing_node_counts_and_stats():
    model = _model()
    report = PassManager([_RemoveLeaky(), _AddNeg(), _RemoveLeaky()]).run(model)
    first, second, third = report.passes
    assert (first.name, first.modified, first.stats, first.nodes_before, first.nodes_after) == (
        "leaky-to-relu", True, {"LeakyToRelu": 1}, 2, 2,
    )
    assert (second.nodes_before, second.nodes_after, second.stats) == (2, 4, {"added": 2})
    assert (third.modified, third.stats) == (False, {"LeakyToRelu": 0})
    assert all(isinstance(p.seconds, float) and p.seconds >= 0 for p in report.passes)
    assert report.modified is True
    as_dict = report.to_dict()
    assert [p["name"] for p in as_dict["passes"]] == ["leaky-to-relu", "add-neg", "leaky-to-relu"]
    assert set(as_dict["passes"][0]) == {"name", "modified", "stats", "seconds", "nodes_before", "nodes_after"}


def test_nodes_a_pass_creates_carry_provenance():
    model = _model()
    PassManager([_RemoveLeaky(), _AddNeg()]).run(model)
    relu, new_relu, neg1, neg2 = list(model.graph)
    assert PROVENANCE_PASS not in relu.metadata_props  # was there before
    assert new_relu.metadata_props[PROVENANCE_PASS] == "leaky-to-relu"
    assert new_relu.metadata_props[PROVENANCE_RULE] == "LeakyToRelu"
    for neg in (neg1, neg2):  # stamped by the manager, though the pass did nothing about it
        assert neg.metadata_props[PROVENANCE_PASS] == "add-neg"
        assert PROVENANCE_RULE not in neg.metadata_props
    # It survives saving.
    proto = ir.serde.serialize_model(model)
    saved = {p.key: p.value for p in proto.graph.node[1].metadata_props}
    assert saved == {PROVENANCE_PASS: "leaky-to-relu", PROVENANCE_RULE: "LeakyToRelu"}


# --- honesty: check_modified -----------------------------------------------------------------------


class _Lying(mograph.Pass):
    """Change LeakyRelu's alpha but claim nothing changed."""

    name = "lying"

    def call(self, model: ir.Model) -> PassResult:
        model.graph.node(1).attributes["alpha"] = ir.AttrFloat32("alpha", 0.3)
        return PassResult(modified=False)


class _LyingShape(mograph.Pass):
    """Set a value's shape but claim nothing changed."""

    name = "lying-shape"

    def call(self, model: ir.Model) -> PassResult:
        model.graph.node(0).outputs[0].shape = ir.Shape([2, 3])
        return PassResult(modified=False)


class _LyingNewNode(mograph.Pass):
    """Create a node but claim nothing changed."""

    name = "lying-new-node"

    def call(self, model: ir.Model) -> PassResult:
        model.graph.append(ir.node("Neg", inputs=[model.graph.inputs[0]]))
        return PassResult(modified=False)


@pytest.mark.parametrize("liar", [_Lying, _LyingShape])
def test_check_modified_fails_a_pass_that_lies(liar):
    with pytest.raises(InternalError, match=f"in pass '{liar.name}': reported modified=False but changed"):
        PassManager([liar()], check_modified=True).run(_model())
    # Off by default: the lie goes unnoticed (the check costs two graph hashes per pass).
    report = PassManager([liar()]).run(_model())
    assert report.passes[0].modified is False


def test_a_pass_that_creates_nodes_while_saying_unchanged_always_fails():
    with pytest.raises(InternalError, match="reported modified=False but created nodes"):
        PassManager([_LyingNewNode()]).run(_model())


def test_check_modified_passes_honest_passes():
    model = _model()
    report = PassManager([_RemoveLeaky(), _RemoveLeaky(), _AddNeg()], check_modified=True).run(model)
    assert [p.modified for p in report.passes] == [True, False, True]
    reg = mograph.plugins.get_registry()
    report = PassManager(reg.instantiate(reg.expand("cleanup")), check_modified=True).run(model)
    assert len(report.passes) == 6  # the built-in cleanup passes are honest too


def test_check_modified_through_the_api():
    with pytest.raises(InternalError, match="internal error in pass 'lying'"):
        mograph.run_passes(_model(), [_Lying()], check_modified=True)
    mograph.run_passes(_model(), [_Lying()])  # off unless asked for


# --- failures name the pass ------------------------------------------------------------------------


class _Crashing(mograph.Pass):
    """Crash."""

    name = "crashing"

    def call(self, model: ir.Model) -> PassResult:
        return {}["missing"]


class _WrongReturn(mograph.Pass):
    """Return the wrong thing."""

    name = "wrong-return"

    def call(self, model: ir.Model):
        return True


class _UserError(mograph.Pass):
    """Raise a user-facing error itself."""

    name = "user-error"

    def call(self, model: ir.Model) -> PassResult:
        raise OptionError("user-error: --thing must be set")


class _Refusing(mograph.Pass):
    """Refuse, saying why."""

    name = "refusing"

    def call(self, model: ir.Model) -> PassResult:
        raise PassFailedError(self.name, "node 'relu' is not supported")


def test_a_crashing_pass_is_an_internal_error_naming_it():
    with pytest.raises(InternalError, match=r"internal error in pass 'crashing': KeyError: 'missing'") as info:
        PassManager([_RemoveLeaky(), _Crashing()]).run(_model())
    assert info.value.pass_name == "crashing"
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, mograph.MographError) and info.value.exit_code == 1  # one except; still a bug
    with pytest.raises(InternalError, match="in pass 'wrong-return': returned bool, not a PassResult"):
        PassManager([_WrongReturn()]).run(_model())


def test_mograph_errors_from_a_pass_pass_through_as_they_are():
    with pytest.raises(OptionError, match="--thing must be set"):
        PassManager([_UserError()]).run(_model())
    with pytest.raises(PassFailedError, match="pass 'refusing' failed: node 'relu' is not supported") as info:
        PassManager([_Refusing()]).run(_model())
    assert info.value.pass_name == "refusing" and info.value.__cause__ is None


# --- wrappers act from outside ---------------------------------------------------------------------


def test_run_pass_wrappers_wrap_every_pass_and_feed_the_report():
    seen: list[tuple[str, bool]] = []

    class Instrument:
        @hookimpl(wrapper=True)
        def mograph_run_pass(self, pass_, model, context):
            result = yield
            seen.append((pass_.name, result.modified))
            context["last_check"] = {"nodes": len(model.graph)}
            return result

    reg = _registry(Instrument())
    report = PassManager([_RemoveLeaky(), _AddNeg()], hook=reg.pm.hook).run(_model())
    assert seen == [("leaky-to-relu", True), ("add-neg", True)]
    assert [p.check for p in report.passes] == [{"nodes": 2}, {"nodes": 4}]


# --- options ---------------------------------------------------------------------------------------


class _Configurable(mograph.Pass):
    """A pass with one option of each kind."""

    name = "configurable"
    options = (
        Option("size-limit", int, 10, "elements"),
        Option("scale", float, 0.5, "a factor"),
        Option("mode", str, "fast", "how", choices=("fast", "exact")),
        Option("keep", str, None, "names to keep", multiple=True),
    )

    def call(self, model: ir.Model) -> PassResult:
        return PassResult(modified=False)


def test_option_defaults_are_applied_with_python_keys():
    assert _Configurable().config == {"size_limit": 10, "scale": 0.5, "mode": "fast", "keep": []}
    assert mograph.passes.cleanup.FoldConstantsPass().config == {"fold_limit": 1 << 20}


def test_option_values_are_converted():
    p = _Configurable(size_limit="25", scale="2", mode="exact", keep=["a", "b"])
    assert p.config == {"size_limit": 25, "scale": 2.0, "mode": "exact", "keep": ["a", "b"]}
    assert _Configurable(size_limit=7.0, scale=3).config["size_limit"] == 7
    assert _Configurable(size_limit=np.int64(9), scale=np.float32(0.25)).config == {
        "size_limit": 9, "scale": 0.25, "mode": "fast", "keep": [],
    }
    assert _Configurable(keep="only").config["keep"] == ["only"]


def test_unknown_option_is_an_option_error():
    with pytest.raises(OptionError, match="configurable: unknown option 'sise_limit' .*known: keep, mode, scale, size_limit"):
        _Configurable(sise_limit=3)
    with pytest.raises(OptionError, match=r"unknown option 'no_such_option'; "):
        mograph.optimize(_model(), passes="cse", options={"no_such_option": 1})
    with pytest.raises(OptionError, match=r"unknown option 'fold_limt' \(did you mean 'fold_limit'\?\)"):
        mograph.optimize(_model(), passes="cse", options={"fold_limt": 1})
    with pytest.raises(OptionError, match=r"unknown verify option 'min_cosin' \(did you mean 'min_cosine'\?\)"):
        mograph.optimize(_model(), passes="cse", verify=True, verify_options={"min_cosin": 0.99})


def test_an_option_no_pass_of_the_pipeline_reads_warns_or_fails_with_strict(caplog):
    with caplog.at_level("WARNING", logger="mograph"):
        mograph.optimize(_model(), passes="cse", options={"fold_limit": 1024})
    assert "no pass of the pipeline ['cse'] reads: 'fold_limit' (read by fold-constants)" in caplog.text
    with pytest.raises(OptionError, match="no pass of the pipeline .* reads: 'fold_limit'"):
        mograph.optimize(_model(), passes="cse", options={"fold_limit": 1024}, strict=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mograph"):
        mograph.optimize(_model(), passes="fold-constants", options={"fold_limit": 1024}, strict=True)
    assert "reads" not in caplog.text


@pytest.mark.parametrize(
    ("values", "fragment"),
    [
        ({"size_limit": "ten"}, "bad value for --size-limit: 'ten'"),
        ({"size_limit": 2.5}, "bad value for --size-limit: 2.5 (expected int)"),
        ({"size_limit": True}, "bad value for --size-limit: True"),
        ({"size_limit": [1]}, "bad value for --size-limit: [1]"),
        ({"scale": "half"}, "bad value for --scale: 'half'"),
        ({"mode": "slow"}, "--mode must be one of fast, exact, not 'slow'"),
    ],
)
def test_bad_option_values_are_option_errors(values, fragment):
    with pytest.raises(OptionError) as info:
        _Configurable(**values)
    assert fragment in str(info.value)


def test_api_options_reach_the_passes_that_declare_them():
    model, report = mograph.optimize(_model(), passes="cse,fold-constants", options={"fold-limit": 5, "cse_size_limit": 3})
    assert [p.name for p in report.passes] == ["cse", "fold-constants"]
    reg = mograph.plugins.get_registry()
    instances = reg.instantiate(["cse", "fold-constants"], {"fold_limit": 5, "cse_size_limit": 3})
    assert [i.config for i in instances] == [{"cse_size_limit": 3}, {"fold_limit": 5}]


@pytest.mark.parametrize("builder", ["bert_tiny", "cnn_small"])
def test_cleanup_is_honest_on_exporter_shaped_models(builder):
    from models import builders

    proto = getattr(builders, builder)()
    model, report = mograph.optimize(proto, passes="cleanup", check_modified=True)
    assert [p.name for p in report.passes] == mograph.plugins.get_registry().expand("cleanup")
    assert report.passes[-1].nodes_after <= report.passes[0].nodes_before


def test_python_option_values_go_through_the_command_line_converter():
    # prune-structured's --ratio is converted by a function that checks the range: from Python too.
    reg = mograph.plugins.get_registry()
    with pytest.raises(OptionError) as from_cli:
        reg.instantiate(["prune-structured"], {"ratio": "1.5"})
    with pytest.raises(OptionError) as from_python:
        mograph.optimize(_model(), passes="prune-structured", options={"ratio": 1.5})
    assert str(from_cli.value) == "prune-structured: bad value for --ratio: '1.5' (must be in [0, 1))"
    assert str(from_python.value) == "prune-structured: bad value for --ratio: 1.5 (must be in [0, 1))"
    assert reg.instantiate(["prune-structured"], {"ratio": 0.25})[0].config["ratio"] == 0.25
    # A converter that reads strings only gets str(value) for numbers and bools: True means --fp16-io true.
    assert reg.instantiate(["fp16"], {"fp16_io": True})[0].config["fp16_io"] is True
    with pytest.raises(OptionError, match=r"bad value for --fp16-io: 2 \(expected yes or no\)"):
        reg.instantiate(["fp16"], {"fp16_io": 2})
    with pytest.raises(OptionError, match=r"bad value for --fp16-io: \['yes'\]"):
        reg.instantiate(["fp16"], {"fp16_io": ["yes"]})


def test_defaults_are_not_reconverted():
    class Listing(mograph.Pass):
        """A pass whose converter turns 'a,b' into a list and whose default is already a list."""

        name = "listing"
        options = (Option("names", lambda text: text.split(","), ["x"], "names"),)

        def call(self, model: ir.Model) -> PassResult:
            return PassResult(modified=False)

    assert Listing().config == {"names": ["x"]}
    assert Listing(names="a,b").config == {"names": ["a", "b"]}


# --- instruments ------------------------------------------------------------------------------------


class _Log:
    """An instrument object with the same wrapper a plugin writes."""

    def __init__(self, tag: str, events: list[str]) -> None:
        self.tag, self.events = tag, events

    @hookimpl(wrapper=True)
    def mograph_run_pass(self, pass_, model, context):
        self.events.append(f"{self.tag}>{pass_.name}")
        result = yield
        self.events.append(f"{self.tag}<{pass_.name}:{result.modified}")
        return result


def test_instruments_wrap_every_pass_of_one_run_only():
    events: list[str] = []

    def bare(pass_, model, context):  # a generator function is an instrument too
        events.append(f"bare>{pass_.name}")
        return (yield)

    pm_plugins_before = {name for name, _ in mograph.plugins.get_registry().pm.list_name_plugin()}
    _, report = mograph.optimize(_model(), passes="eliminate-identity,topo-sort", instruments=[_Log("a", events), bare])
    assert events == [
        "a>eliminate-identity", "bare>eliminate-identity", "a<eliminate-identity:False",
        "a>topo-sort", "bare>topo-sort", "a<topo-sort:False",
    ]
    assert [p.name for p in report.passes] == ["eliminate-identity", "topo-sort"]
    # Nothing was registered on the process-wide plugin manager, and the next run has no instruments.
    assert {name for name, _ in mograph.plugins.get_registry().pm.list_name_plugin()} == pm_plugins_before
    events.clear()
    mograph.optimize(_model(), passes="topo-sort")
    assert events == []


def test_an_instrument_sees_a_pass_failure_and_may_replace_the_result():
    class Boom(mograph.Pass):
        """Raise."""

        name = "boom"

        def call(self, model: ir.Model) -> PassResult:
            raise RuntimeError("kaput")

    seen: list[str] = []

    def recover(pass_, model, context):
        try:
            yield
        except RuntimeError as exc:
            seen.append(str(exc))
            return PassResult(modified=False, stats={"recovered": 1})

    report = PassManager([Boom()], instruments=[recover]).run(_model())
    assert seen == ["kaput"] and report.passes[0].stats == {"recovered": 1}
    with pytest.raises(InternalError, match="internal error in pass 'boom': RuntimeError: kaput"):
        PassManager([Boom()], instruments=[_Log("x", [])]).run(_model())  # a bug in a pass (issue 14 item 8)


def test_a_non_instrument_is_refused_before_any_pass_runs():
    with pytest.raises(mograph.MographError, match="has no mograph_run_pass"):
        PassManager([], instruments=[42])


def test_the_cli_progress_is_an_instrument_not_a_registered_plugin(tmp_path, capsys):
    from mograph.cli import main

    src = tmp_path / "m.onnx"
    mograph.save(_model(), str(src))
    assert main(["optimize", str(src), "--passes", "eliminate-identity,topo-sort"]) == 0
    err = capsys.readouterr().err
    assert "[1/2] eliminate-identity ...\n[2/2] topo-sort ...\n" in err
    names = {name for name, _ in mograph.plugins.get_registry().pm.list_name_plugin()}
    assert not any("progress" in name or "verify" in name for name in names)


def test_graph_fingerprint_sees_a_constant_value_replaced_and_nothing_else():
    """A ``Constant``'s tensor counts by identity (no protocol check): replacing it, or changing an
    int attribute, changes the fingerprint; a second fingerprint of the same graph is the same."""
    from mograph.pass_infra import graph_fingerprint

    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    const = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", ir.tensor(np.ones(3, np.float32)))])
    add = ir.Node("", "Add", [x, const.outputs[0]])
    concat = ir.Node("", "Concat", [add.outputs[0], x], attributes=[ir.AttrInt64("axis", 0)])
    graph = ir.Graph([x], concat.outputs, nodes=[const, add, concat], opset_imports={"": 17})
    model = ir.Model(graph, ir_version=10)
    before = graph_fingerprint(model)
    assert graph_fingerprint(model) == before
    const.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.ones(3, np.float32)))  # equal values, new tensor
    replaced = graph_fingerprint(model)
    assert replaced != before
    concat.attributes["axis"] = ir.AttrInt64("axis", -1)
    assert graph_fingerprint(model) != replaced


def test_a_full_disk_is_a_pass_failure_that_says_what_to_do_not_a_bug():
    """ENOSPC inside a pass (a 4.9 GB decoder's fp16 spill on a full /tmp) is exit 4 naming the pass, the file and
    TMPDIR; any other OSError stays an internal error."""
    import errno

    class Full(mograph.Pass):
        """Write to a full disk."""

        name = "full"

        def call(self, model: ir.Model) -> PassResult:
            raise OSError(errno.ENOSPC, "No space left on device", "/tmp/spill/w.bin")

    class Denied(mograph.Pass):
        """Another OS error."""

        name = "denied"

        def call(self, model: ir.Model) -> PassResult:
            raise OSError(errno.EACCES, "Permission denied", "/x")

    with pytest.raises(PassFailedError, match=r"pass 'full' failed: the disk is full \(No space left on device "
                                              r"writing /tmp/spill/w.bin\).*TMPDIR") as info:
        PassManager([Full()]).run(_model())
    assert info.value.exit_code == 4 and isinstance(info.value.__cause__, OSError)
    with pytest.raises(InternalError, match="internal error in pass 'denied': PermissionError"):
        PassManager([Denied()]).run(_model())


def _branch(name: str, node_outputs: list[str], reads: ir.Value) -> ir.Graph:
    """A branch: a chain of Neg nodes from ``reads`` (an outer value), outputs named ``node_outputs``."""
    nodes, prev = [], reads
    for out in node_outputs:
        n = ir.node("Neg", [prev])
        n.outputs[0].name = out
        nodes.append(n)
        prev = n.outputs[0]
    return ir.Graph([], [prev], nodes=nodes, name=name)


def test_a_value_added_inside_a_branch_never_shadows_an_enclosing_graphs_name():
    """onnx_ir names new values per graph (``val_0`` in the main graph and in a branch): after a pass that
    changed the model the manager renames the branch's clashing values, outer and inner alike, and keeps the
    main graph's names and the names sibling branches may share."""
    x = ir.Value(name="x", shape=ir.Shape([3]), type=ir.TensorType(ir.DataType.FLOAT))
    c = ir.Value(name="c", shape=ir.Shape([]), type=ir.TensorType(ir.DataType.BOOL))
    main = ir.node("Relu", [x])
    main.outputs[0].name = "val_0"
    then_g = _branch("then", ["val_0", "t1"], main.outputs[0])  # shadows the main graph's val_0
    inner_if = ir.node("If", [c], attributes={"then_branch": _branch("in_then", ["t1", "u"], then_g.outputs[0]),
                                              "else_branch": _branch("in_else", ["u"], then_g.outputs[0])},
                       num_outputs=1)
    inner_if.outputs[0].name = "w"
    then_g.append(inner_if)
    then_g.outputs[0] = inner_if.outputs[0]
    else_g = _branch("else", ["t1"], main.outputs[0])  # t1 again, in a sibling: allowed
    outer_if = ir.node("If", [c], attributes={"then_branch": then_g, "else_branch": else_g}, num_outputs=1)
    outer_if.outputs[0].name = "y"
    outer_if.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    outer_if.outputs[0].shape = ir.Shape([3])
    graph = ir.Graph([x, c], [outer_if.outputs[0]], nodes=[main, outer_if], opset_imports={"": 17}, name="g")
    model = ir.Model(graph, ir_version=8)

    class Touch(mograph.Pass):
        name = "touch"

        def call(self, model: ir.Model) -> PassResult:
            return PassResult(modified=True)

    PassManager([Touch()]).run(model)
    names = lambda g: [o.name for n in g for o in n.outputs]  # noqa: E731
    assert names(graph) == ["val_0", "y"]
    assert names(then_g) == ["val_0_1", "t1", "w"]
    assert names(inner_if.attributes["then_branch"].value) == ["t1_1", "u"]  # t1 is its enclosing branch's
    assert names(inner_if.attributes["else_branch"].value) == ["u"]  # a sibling may reuse u
    assert names(else_g) == ["t1"]
    import onnx

    from mograph.testing import run_ort

    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto)
    xs = np.array([-1.0, 0.5, 2.0], np.float32)
    for cond, want in ((True, np.maximum(xs, 0)), (False, -np.maximum(xs, 0))):  # four Negs, or one
        (got,) = run_ort(proto, {"x": xs, "c": np.array(cond)})
        np.testing.assert_array_equal(got, want)


class _BreakForOrt(mograph.Pass):
    """Make the model one ONNX Runtime refuses to load (Relu's output declared int64: a type clash at load),
    as a user's option can (fix-shapes pinning a size a dead branch cannot take)."""

    name = "break-for-ort"

    def call(self, model: ir.Model) -> PassResult:
        relu = next(n for n in model.graph if n.op_type == "Relu")
        relu.outputs[0].dtype = ir.DataType.INT64
        return PassResult(modified=True, stats={"broken": 1})


class _OrtSession(mograph.Pass):
    """Open an ONNX Runtime session on the model it gets (as calibration does), crashing if it cannot."""

    name = "ort-session"

    def call(self, model: ir.Model) -> PassResult:
        import onnxruntime as ort

        ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
        return PassResult(modified=False)


def test_a_crash_on_a_model_onnx_runtime_refuses_names_the_earlier_passes():
    """A pass that crashes because the model it was given does not load in ONNX Runtime is not called a bug:
    exit 4 naming the passes that wrote it (exit 3 when it is the user's own model); a crash on a model that
    loads stays an internal error."""
    pytest.importorskip("onnxruntime")
    with pytest.raises(PassFailedError, match=r"pass 'ort-session' failed: the model it was given does not load in "
                                              r"ONNX Runtime .*output of break-for-ort") as info:
        PassManager([_BreakForOrt(), _OrtSession()]).run(_model())
    assert info.value.exit_code == 4
    broken = _model()
    _BreakForOrt().call(broken)
    with pytest.raises(ModelError, match="ONNX Runtime cannot load the model given to 'ort-session'"):
        PassManager([_OrtSession()]).run(broken)
    with pytest.raises(InternalError, match="internal error in pass 'crashing'"):
        PassManager([_RemoveLeaky(), _Crashing()]).run(_model())  # the model loads: the crash is the pass's
