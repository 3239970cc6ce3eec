"""Models that lie about their sizes, and requests for huge tensors, end in one clear line, never in
tens of gigabytes of memory, terabyte-sized sparse files or an allocation traceback.

Every hostile run happens in a child process under a 3 GiB address-space limit and a 256 MiB file-size
limit (``_limited_cli``), so a regression fails the test instead of the machine.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from _limited_cli import run_cli_jobs
from onnx import TensorProto, helper, numpy_helper

HUGE = 2**40


def _graph_model(nodes, inits=(), inputs=(), outputs=(("y", TensorProto.FLOAT),)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
        initializer=list(inits),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _lying(case: str, folder: Path) -> onnx.ModelProto:
    """A model whose tensor ``w`` (feeding ``y = Identity(w)``) lies about its size."""
    w = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT)
    if case == "raw-data-2^40":
        w.dims.extend([HUGE])
        w.raw_data = b"\x01" * 16
    elif case == "typed-data-short":
        w.dims.extend([1000])
        w.float_data.extend([1.0, 2.0, 3.0, 4.0])
    elif case == "no-data":
        w.dims.extend([64, 64])
    elif case == "negative-dim":
        w.dims.extend([-4])
    elif case == "strings-short":
        w.data_type = TensorProto.STRING
        w.dims.extend([5])
        w.string_data.extend([b"a", b"b"])
    elif case.startswith("external"):
        (folder / "w.bin").write_bytes(b"\x01" * 16)
        w.data_location = TensorProto.EXTERNAL
        w.external_data.add(key="location", value="w.bin")
        if case == "external-2^40":
            w.dims.extend([HUGE])
        elif case == "external-offset":
            w.dims.extend([4])
            w.external_data.add(key="offset", value="8")
        elif case == "external-length":
            w.dims.extend([4])
            w.external_data.add(key="length", value="8")
    else:
        raise AssertionError(case)
    out_type = TensorProto.STRING if case == "strings-short" else TensorProto.FLOAT
    return _graph_model([helper.make_node("Identity", ["w"], ["y"])], inits=[w], outputs=[("y", out_type)])


def _lying_constant(folder: Path) -> onnx.ModelProto:
    value = onnx.TensorProto(name="v", data_type=TensorProto.FLOAT, dims=[HUGE], raw_data=b"\x01" * 16)
    return _graph_model([helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Relu", ["c"], ["y"])])


LYING = [
    "raw-data-2^40",
    "typed-data-short",
    "no-data",
    "negative-dim",
    "strings-short",
    "external-2^40",
    "external-offset",
    "external-length",
    "constant-raw-data-2^40",
]


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def test_models_lying_about_their_sizes_are_refused_in_one_line(tmp_path):
    jobs, folders = [], {}
    for case in LYING:
        folder = tmp_path / case
        folder.mkdir()
        model = _lying_constant(folder) if case == "constant-raw-data-2^40" else _lying(case, folder)
        onnx.save(model, folder / "m.onnx")
        folders[case] = (folder, _listing(folder))
        jobs.append({"id": f"{case}/optimize", "argv": ["optimize", str(folder / "m.onnx"), "--passes", "cleanup,fuse"]})
        jobs.append({"id": f"{case}/inspect", "argv": ["inspect", str(folder / "m.onnx")]})
    results = run_cli_jobs(jobs)
    for job in jobs:
        result = results[job["id"]]
        assert result["code"] == 3, (job["id"], result)
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mograph: error:"), (job["id"], result["stderr"])
    for case, (folder, before) in folders.items():
        assert _listing(folder) == before, case  # nothing written, nothing left behind


def _fold_model(case: str) -> tuple[onnx.ModelProto, str]:
    """``y = x + big`` where ``big`` is computed from small constants; returns the model and big's op."""
    ints = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    floats = lambda name, values: numpy_helper.from_array(np.array(values, np.float32), name)  # noqa: E731
    if case == "constant-of-shape":
        nodes = [helper.make_node("ConstantOfShape", ["s"], ["big"], value=floats("v", [1.0]))]
        inits = [ints("s", [100000, 100000])]
    # The others ask for 2 GB: small enough that evaluating them succeeds (and shows in the peak
    # memory), so a regression is seen rather than hidden by a failed allocation.
    elif case == "expand":
        nodes = [helper.make_node("Expand", ["one", "s"], ["big"])]
        inits = [floats("one", [1.0]), ints("s", [50000, 10000])]
    elif case == "tile":
        nodes = [helper.make_node("Tile", ["one", "r"], ["big"])]
        inits = [floats("one", [[1.0]]), ints("r", [50000, 10000])]
    elif case == "range":
        nodes = [helper.make_node("Range", ["a", "b", "d"], ["big"])]
        inits = [floats("a", 0.0), floats("b", 5e8), floats("d", 1.0)]
    elif case == "broadcast":
        nodes = [helper.make_node("Add", ["col", "row"], ["big"])]
        inits = [floats("col", np.ones((50000, 1))), floats("row", np.ones((1, 10000)))]
    elif case == "small-tile":  # a small result is still folded
        nodes = [helper.make_node("Tile", ["one", "r"], ["big"])]
        inits = [floats("one", [[1.0]]), ints("r", [4, 4])]
    else:
        raise AssertionError(case)
    nodes.append(helper.make_node("Add", ["x", "big"], ["y"]))
    model = _graph_model(nodes, inits=inits, inputs=[("x", TensorProto.FLOAT, [1])])
    return model, nodes[0].op_type


FOLD_CASES = ["constant-of-shape", "expand", "tile", "range", "broadcast", "small-tile"]


def test_folding_never_evaluates_a_huge_result_from_small_constants(tmp_path):
    jobs, ops = [], {}
    for case in FOLD_CASES:
        model, ops[case] = _fold_model(case)
        onnx.save(model, tmp_path / f"{case}.onnx")
        argv = ["optimize", str(tmp_path / f"{case}.onnx"), "-o", str(tmp_path / f"{case}.out.onnx"), "--passes", "cleanup"]
        jobs.append({"id": case, "argv": argv})
    results = run_cli_jobs(jobs, memory=6 << 30, timeout=120)
    for case in FOLD_CASES:
        assert results[case]["code"] == 0, (case, results[case])
        peak = results[case]["peak_rss"]
        assert peak is None or peak < 1 << 30, (case, f"peak RSS {peak / 2**20:.0f} MiB: the result was evaluated")
        saved = onnx.load(str(tmp_path / f"{case}.out.onnx"))
        left = [n.op_type for n in saved.graph.node]
        if case == "small-tile":
            assert left == ["Add"]  # folded: 16 elements
            (big,) = [t for t in saved.graph.initializer]
            np.testing.assert_array_equal(numpy_helper.to_array(big), np.ones((4, 4), np.float32))
        else:
            assert left == [ops[case], "Add"], case
        assert os.path.getsize(tmp_path / f"{case}.out.onnx") < 2 << 20  # the huge result was not stored


def _feed_model(shape) -> onnx.ModelProto:
    return _graph_model(
        [helper.make_node("Relu", ["x"], ["y"])], inputs=[("x", TensorProto.FLOAT, shape)]
    )


def test_verification_feeds_past_the_limit_are_a_usage_error(tmp_path):
    pytest.importorskip("onnxruntime")
    onnx.save(_feed_model(["n", "m"]), tmp_path / "dyn.onnx")
    onnx.save(_feed_model([100000, 100000]), tmp_path / "fixed.onnx")
    out = str(tmp_path / "o.onnx")
    jobs = [
        {"id": "shape", "argv": ["optimize", str(tmp_path / "dyn.onnx"), "-o", out, "--verify", "--shape", "x:100000x100000"]},
        {"id": "declared", "argv": ["optimize", str(tmp_path / "fixed.onnx"), "-o", out, "--verify"]},
        {"id": "own-limit", "argv": ["optimize", str(tmp_path / "dyn.onnx"), "-o", out, "--verify",
                                     "--shape", "x:2x3", "--feed-limit", "16"]},
        {"id": "within", "argv": ["optimize", str(tmp_path / "dyn.onnx"), "-o", out, "--verify",
                                  "--shape", "x:2x3", "--feed-limit", "24"]},
    ]
    results = run_cli_jobs(jobs)
    for case, given_by in (("shape", "from --shape"), ("declared", "from the model's declared shape"), ("own-limit", "")):
        result = results[case]
        assert result["code"] == 2, (case, result)
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and "past the limit" in lines[0] and given_by in lines[0], (case, lines)
    assert results["within"]["code"] == 0, results["within"]
    assert "verify: " in results["within"]["stdout"]


def test_every_command_that_makes_random_feeds_bounds_them(tmp_path):
    """``validate``, ``diff`` and ``bench`` take ``--feed-limit`` as ``optimize`` does, and default to 1 GiB."""
    pytest.importorskip("onnxruntime")
    onnx.save(_feed_model(["n", "m"]), tmp_path / "dyn.onnx")
    dyn = str(tmp_path / "dyn.onnx")
    commands = {
        "validate": ["validate", dyn, "--backend", "ort"],
        "diff": ["diff", dyn, dyn],
        "bench": ["bench", dyn, "--iterations", "1", "--warmup", "0"],
    }
    jobs = []
    for name, argv in commands.items():
        jobs += [
            {"id": f"{name}-default", "argv": [*argv, "--shape", "x:100000x100000"]},
            {"id": f"{name}-own", "argv": [*argv, "--shape", "x:2x3", "--feed-limit", "16"]},
            {"id": f"{name}-within", "argv": [*argv, "--shape", "x:2x3", "--feed-limit", "24"]},
            {"id": f"{name}-negative", "argv": [*argv, "--shape", "x:2x3", "--feed-limit", "-1"]},
        ]
    results = run_cli_jobs(jobs)
    for name in commands:
        for case, limit in (("default", f"{1 << 30:,}"), ("own", "16")):
            result = results[f"{name}-{case}"]
            assert result["code"] == 2, (name, case, result)
            lines = result["stderr"].strip().splitlines()
            assert len(lines) == 1 and f"past the limit of {limit}" in lines[0], (name, case, lines)
        assert results[f"{name}-within"]["code"] == 0, (name, results[f"{name}-within"])
        negative = results[f"{name}-negative"]
        assert negative["code"] == 2 and "--feed-limit" in negative["stderr"], (name, negative)


def test_feed_limit_help_states_the_real_default():
    from mograph.cli import build_parser
    from mograph.validate import FEED_LIMIT_BYTES

    assert FEED_LIMIT_BYTES == 1 << 30  # the help below says "1 GiB"
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("optimize", "validate", "diff", "bench"):
        text = sub.choices[name].format_help()
        assert "--feed-limit BYTES" in text and "default 1 GiB" in " ".join(text.split()), name
