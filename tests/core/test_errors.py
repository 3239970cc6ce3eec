"""What a user sees when something is wrong: one line on stderr, the documented exit code, the input
untouched, and no output (or temporary file) left behind.

Most cases run ``mograph.cli.main`` in-process (an unexpected exception would fail the test with its
traceback); a few run the real console script in a subprocess to prove the same from the outside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import mograph
from models.builders import make_model
from mograph import ir_io
from mograph.cli import main
from mograph.errors import (
    BackendUnavailableError,
    InternalError,
    ModelError,
    OptionError,
    PassFailedError,
    PluginError,
    UnknownPassError,
    UsageError,
    VerificationError,
)
from mograph.plugins import get_registry

IO = ([("x", np.float32, [2, 3])], [("y", np.float32, [2, 3])])


def _good() -> onnx.ModelProto:
    nodes = [helper.make_node("Add", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["y"])]
    return make_model(nodes, *IO, {"w": np.ones((2, 3), np.float32)})


def _cycle() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["x", "u"], ["t"], name="add"),
        helper.make_node("Relu", ["t"], ["u"], name="relu"),
        helper.make_node("Neg", ["t"], ["y"], name="neg"),
    ]
    return make_model(nodes, *IO)


def _subgraph_cycle() -> onnx.ModelProto:
    """An ``If`` whose then-branch has a cycle (the main graph has none)."""
    then_branch = helper.make_graph(
        [
            helper.make_node("Add", ["x", "u"], ["t"], name="sub_add"),
            helper.make_node("Relu", ["t"], ["u"], name="sub_relu"),
            helper.make_node("Neg", ["t"], ["o"], name="sub_neg"),
        ],
        "then", [], [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [2, 3])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["o2"])],
        "else", [], [helper.make_tensor_value_info("o2", onnx.TensorProto.FLOAT, [2, 3])],
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch, name="if")
    return make_model([node], [("x", np.float32, [2, 3]), ("c", np.bool_, [])], [("y", np.float32, [2, 3])])


def _negative_dim(where: str, dim: int = -2) -> onnx.ModelProto:
    """A dim declared as a negative ``dim_value`` on the input, the output or an intermediate value."""
    x, y = ([dim, 3] if where == "input" else [2, 3]), ([dim, 3] if where == "output" else [2, 3])
    nodes = [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, x)], [("y", np.float32, y)])
    if where == "value":
        proto.graph.value_info.append(helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2, dim]))
    return proto


def _undefined_dtype(where: str) -> onnx.ModelProto:
    """Element type UNDEFINED (0) on an input, an initializer or a ``Constant``'s tensor."""
    x_type = onnx.TensorProto.UNDEFINED if where == "input" else onnx.TensorProto.FLOAT
    const = helper.make_tensor("c", onnx.TensorProto.FLOAT, [2, 3], np.ones(6).tolist())
    nodes = [
        helper.make_node("Constant", [], ["c"], value=const, name="const"),
        helper.make_node("Add", ["x", "w"], ["t"], name="add"),
        helper.make_node("Mul", ["t", "c"], ["y"], name="mul"),
    ]
    proto = make_model(nodes, [("x", x_type, [2, 3])], [("y", np.float32, [2, 3])], {"w": np.ones((2, 3), np.float32)})
    if where == "initializer":
        proto.graph.initializer[0].data_type = onnx.TensorProto.UNDEFINED
    elif where == "constant":
        proto.graph.node[0].attribute[0].t.data_type = onnx.TensorProto.UNDEFINED
    return proto


def _missing_initializer() -> onnx.ModelProto:
    return make_model([helper.make_node("Add", ["x", "w_missing"], ["y"], name="add")], *IO)


def _external(location: str) -> onnx.ModelProto:
    proto = _good()
    tensor = proto.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    return proto


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) if p.is_file() else "dir" for p in sorted(folder.rglob("*"))}


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors exit from inside the parser
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("mograph: error: ") or lines[0].startswith("mograph optimize: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    onnx.save(_good(), work / "good.onnx")
    (tmp_path / "secret.bin").write_bytes(np.ones(6, np.float32).tobytes())
    return work


def _write_case(work: Path, case: str) -> Path:
    path = work / f"{case}.onnx"
    if case == "text":
        path.write_text("this is a text file, not a model\n" * 20)
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "truncated":
        data = _good().SerializeToString()
        path.write_bytes(data[: len(data) // 2])
    elif case == "cycle":
        onnx.save(_cycle(), path)
    elif case == "missing-initializer":
        onnx.save(_missing_initializer(), path)
    elif case == "subgraph-cycle":
        onnx.save(_subgraph_cycle(), path)
    elif case.startswith("negative-dim-"):
        onnx.save(_negative_dim(case.removeprefix("negative-dim-")), path)
    elif case.startswith("undefined-dtype-"):
        onnx.save(_undefined_dtype(case.removeprefix("undefined-dtype-")), path)
    elif case == "external-parent":
        onnx.save(_external("../secret.bin"), path)
    elif case == "external-absolute":
        onnx.save(_external(str(work.parent / "secret.bin")), path)
    elif case == "external-symlink":
        (work / "link.bin").symlink_to(work.parent / "secret.bin")
        onnx.save(_external("link.bin"), path)
    return path


MODEL_ERRORS = {
    "text": "not a readable ONNX model",
    "empty": "not an ONNX model",
    "truncated": "not a readable ONNX model",
    "cycle": "cycle",
    "subgraph-cycle": "graph 'then' has a cycle through nodes",
    "missing-initializer": "w_missing",
    "negative-dim-input": "graph input 'x' dimension 0 is -2",
    "negative-dim-output": "graph output 'y' dimension 0 is -2",
    "negative-dim-value": "value 't' dimension 1 is -2",
    "undefined-dtype-input": "graph input 'x' has element type UNDEFINED",
    "undefined-dtype-initializer": "initializer 'w' has no data type (UNDEFINED)",
    "undefined-dtype-constant": "attribute 'value' of node 'const' has no data type (UNDEFINED)",
    "external-parent": "outside the model's folder",
    "external-absolute": "outside the model's folder",
    "external-symlink": "outside the model's folder",
}


@pytest.mark.parametrize("case", sorted(MODEL_ERRORS))
def test_bad_models_give_one_line_and_exit_3(capsys, workdir, case):
    path = _write_case(workdir, case)
    before = _snapshot(workdir.parent)
    code, out, err = _cli(capsys, "optimize", str(path), "-o", str(workdir / "out.onnx"))
    assert code == ModelError.exit_code == 3
    _assert_one_line(err, MODEL_ERRORS[case])
    assert out == ""
    assert _snapshot(workdir.parent) == before  # input unchanged, no output, no temporary files


@pytest.mark.parametrize("case", ["negative-dim-input", "undefined-dtype-initializer", "subgraph-cycle"])
def test_invalid_models_are_exit_3_under_verify_too(capsys, workdir, case):
    """These used to fail later: ``--verify`` with a ValueError/TypeError (exit 1), a pass with a crash."""
    pytest.importorskip("polygraphy")
    path = _write_case(workdir, case)
    before = _snapshot(workdir.parent)
    code, out, err = _cli(capsys, "optimize", str(path), "-o", str(workdir / "out.onnx"), "--verify", "-q")
    assert code == 3
    _assert_one_line(err, MODEL_ERRORS[case])
    assert _snapshot(workdir.parent) == before


@pytest.mark.parametrize("case", ["negative-dim-input", "undefined-dtype-constant", "subgraph-cycle"])
def test_invalid_models_are_refused_by_the_api_loader(case):
    proto = _negative_dim("input") if case == "negative-dim-input" else (
        _undefined_dtype("constant") if case == "undefined-dtype-constant" else _subgraph_cycle()
    )
    with pytest.raises(ModelError, match=re.escape(MODEL_ERRORS[case])):
        mograph.load(proto)
    if case == "undefined-dtype-constant":  # what a tensor holds is checked even with check=False
        with pytest.raises(ModelError, match=re.escape(MODEL_ERRORS[case])):
            ir_io.load_model(proto, check=False)
    else:
        assert ir_io.load_model(proto, check=False) is not None  # check=False still loads it


def test_a_minus_one_dim_is_read_as_unknown(capsys, workdir, caplog):
    """Converters write -1 for "unknown" and ONNX Runtime reads it so: loaded as an unset dim, with a
    warning, and ``--verify`` picks a size for it instead of crashing (``ValueError: negative dimensions``)."""
    pytest.importorskip("polygraphy")
    path = workdir / "minus_one.onnx"
    onnx.save(_negative_dim("input", -1), path)
    model = ir_io.load_model(path)
    assert model.graph.inputs[0].shape.dims[0] is None or not isinstance(model.graph.inputs[0].shape.dims[0], int)
    code, _out, err = _cli(capsys, "optimize", str(path), "-o", str(workdir / "out.onnx"), "--verify", "-q")
    assert code == 0, err
    assert onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0].dim_value == -1  # input unchanged


def test_dims_named_question_mark_are_each_unknown_not_one_shared_size(capsys, workdir):
    """paddle2onnx names every unknown dim ``?`` (PP-OCR's classifier: ``x [-1, 3, ?, ?]``).  Read as one
    symbol, height and width had to be equal: ``--shape x:1x3x48x192`` was refused (exit 2) by both
    ``--verify`` ("sets '?' to 192, but another input already set it to 48") and ``fix-shapes``."""
    pytest.importorskip("polygraphy")
    nodes = [helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["y"])]
    proto = make_model(nodes, [("x", np.float32, [-1, 3, "?", "?"])], [("y", np.float32, [-1, 3, "?", "?"])])
    path = workdir / "question_marks.onnx"
    onnx.save(proto, path)
    dims = ir_io.load_model(path).graph.inputs[0].shape.dims
    assert dims[1] == 3 and all(not isinstance(d, int) and d.value is None for d in (dims[0], dims[2], dims[3]))
    out = workdir / "out.onnx"
    code, _out, err = _cli(capsys, "optimize", str(path), "-o", str(out), "--verify", "--shape", "x:1x3x48x192", "-q")
    assert code == 0, err
    code, _out, err = _cli(capsys, "optimize", str(path), "-o", str(out), "--passes", "fix-shapes",
                           "--shape", "x:1x3x48x192", "-q")
    assert code == 0, err
    fixed = onnx.load(str(out))
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 48, 192]
    x = np.random.default_rng(0).standard_normal((1, 3, 48, 192)).astype(np.float32)
    from mograph.testing import run_ort

    np.testing.assert_array_equal(run_ort(fixed, {"x": x})[0], -np.maximum(x, 0))
    assert onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[2].dim_param == "?"  # input unchanged


def test_a_subgraph_out_of_order_without_a_cycle_loads():
    """Only a cycle is refused: a branch listing its nodes out of order (and reading an outer value) is fine."""
    proto = _subgraph_cycle()
    then_branch = next(a.g for a in proto.graph.node[0].attribute if a.name == "then_branch")
    del then_branch.node[:]
    then_branch.node.extend([
        helper.make_node("Neg", ["t"], ["o"], name="sub_neg"),
        helper.make_node("Relu", ["x"], ["t"], name="sub_relu"),
    ])
    model = mograph.load(proto)
    assert [n.op_type for n in model.graph.node(0).attributes["then_branch"].value] == ["Neg", "Relu"]


def test_missing_file(capsys, workdir):
    before = _snapshot(workdir)
    code, _, err = _cli(capsys, "optimize", str(workdir / "nope.onnx"))
    assert code == 3
    _assert_one_line(err, "nope.onnx", "no such file")
    assert _snapshot(workdir) == before


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--passes", "no-such-pass"], "unknown pass or preset 'no-such-pass'"),
        (["--passes", ","], "no passes given"),
        (["--fold-limit", "abc"], "bad value for --fold-limit: 'abc'"),
        (["--fold-limit", "-5"], "--fold-limit must be >= 0"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
    ids=["unknown-pass", "empty-pipeline", "option-not-int", "option-negative", "unknown-flag"],
)
def test_usage_errors_exit_2(capsys, workdir, args, fragment):
    src = workdir / "good.onnx"
    before = _snapshot(workdir)
    code, _, err = _cli(capsys, "optimize", str(src), "-o", str(workdir / "out.onnx"), "-q", *args)
    assert code == UsageError.exit_code == 2
    _assert_one_line(err, fragment)
    assert _snapshot(workdir) == before


@pytest.mark.parametrize("alias", ["same", "dot-path", "symlink", "hardlink"])
def test_output_never_overwrites_input(capsys, workdir, alias):
    src = workdir / "good.onnx"
    dest = {
        "same": str(src),
        "dot-path": str(workdir / "." / "good.onnx"),
        "symlink": str(workdir / "link.onnx"),
        "hardlink": str(workdir / "hard.onnx"),
    }[alias]
    if alias == "symlink":
        Path(dest).symlink_to(src)
    elif alias == "hardlink":
        os.link(src, dest)
    before = _snapshot(workdir)
    code, _, err = _cli(capsys, "optimize", str(src), "-o", dest, "-q")
    assert code == 2
    _assert_one_line(err, "refusing to write over the input model")
    assert _snapshot(workdir) == before


class _ExplodingPass(mograph.Pass):
    """Raise halfway through (a bug in a pass)."""

    name = "explode"

    def call(self, model):
        model.graph.remove(model.graph.node(0), safe=False)  # half-done rewrite ...
        raise RuntimeError("boom")  # ... then a crash


class _RefusingPass(mograph.Pass):
    """Refuse, saying why (a genuine pass failure, not a bug)."""

    name = "refuse"

    def call(self, model):
        model.graph.remove(model.graph.node(0), safe=False)
        raise PassFailedError(self.name, "cannot rewrite node 'x': unsupported attribute")


class _ChattyPass(mograph.Pass):
    """Log at every level on a mograph logger and on a third-party one, then change nothing."""

    name = "chatty"

    def call(self, model):
        for logger in (logging.getLogger("mograph.tests.chatty"), logging.getLogger("some_library.core")):
            logger.debug("%s debug line", logger.name)
            logger.info("%s info line", logger.name)
            logger.warning("%s warning line", logger.name)
        return mograph.PassResult(modified=False)


@pytest.fixture
def test_passes(monkeypatch):
    reg = get_registry()
    for cls in (_ExplodingPass, _RefusingPass, _ChattyPass):
        monkeypatch.setitem(reg.passes, cls.name, cls)
        monkeypatch.setitem(reg.pass_source, cls.name, "tests")


def test_a_bug_in_a_pass_is_exit_1_one_line_and_writes_nothing(capsys, workdir, test_passes):
    src = workdir / "good.onnx"
    before = _snapshot(workdir)
    code, _, err = _cli(
        capsys, "optimize", str(src), "-o", str(workdir / "out.onnx"), "--passes", "cleanup,explode", "-q"
    )
    assert code == InternalError.exit_code == 1
    _assert_one_line(
        err, "internal error in pass 'explode'", "RuntimeError: boom", "a bug", "run with -v for the traceback"
    )
    assert _snapshot(workdir) == before


@pytest.mark.parametrize("flag", ["-v", "-vv"])
def test_a_bug_in_a_pass_shows_its_traceback_at_v(capsys, workdir, test_passes, flag):
    src = workdir / "good.onnx"
    before = _snapshot(workdir)
    code, _, err = _cli(capsys, "optimize", str(src), "-o", str(workdir / "out.onnx"), "--passes", "explode", flag)
    assert code == 1
    assert err.splitlines()[0] == "[1/1] explode ..."  # progress, then the traceback, then the one error line
    assert err.splitlines()[1] == "Traceback (most recent call last):"
    assert 'raise RuntimeError("boom")' in err and "in call" in err  # the frame inside the pass
    last = err.splitlines()[-1]
    # the pass's provider is named (the fixture's pseudo plugin 'tests'; an installed one adds its distribution)
    assert last.startswith("mograph: error: internal error in pass 'explode' of plugin 'tests': RuntimeError: boom (a bug")
    assert "run with -v" not in last
    assert _snapshot(workdir) == before


def test_a_pass_that_reports_a_failure_is_exit_4_one_line_naming_it(capsys, workdir, test_passes):
    src = workdir / "good.onnx"
    before = _snapshot(workdir)
    code, _, err = _cli(capsys, "optimize", str(src), "-o", str(workdir / "out.onnx"), "--passes", "refuse", "-q")
    assert code == PassFailedError.exit_code == 4
    _assert_one_line(err, "pass 'refuse' failed: cannot rewrite node 'x'")
    code, _, err = _cli(capsys, "optimize", str(src), "-o", str(workdir / "out.onnx"), "--passes", "refuse", "-v")
    assert code == 4  # a pass failure is the pass's own message, never a traceback, even at -v
    assert err.splitlines() == ["[1/1] refuse ...", "mograph: error: pass 'refuse' failed: cannot rewrite node 'x': "
                                "unsupported attribute"]
    assert _snapshot(workdir) == before


def test_a_bug_in_a_pass_is_one_json_error_too(capsys, workdir, test_passes):
    code, out, _ = _cli(capsys, "optimize", str(workdir / "good.onnx"), "--passes", "explode", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["exit_code"] == 1 and data["error"].startswith("internal error in pass 'explode'")


@pytest.mark.parametrize(
    ("flags", "seen"),
    [
        ([], {"warning"}),
        (["-v"], {"info", "warning"}),
        (["-vv"], {"debug", "info", "warning"}),
        (["-q"], set()),
    ],
    ids=["default", "v", "vv", "q"],
)
def test_verbosity_raises_only_mographs_loggers(capsys, caplog, workdir, test_passes, flags, seen):
    root, mine = logging.getLogger(), logging.getLogger("mograph")
    levels = (root.level, mine.level)
    code, _, _ = _cli(capsys, "optimize", str(workdir / "good.onnx"), "--passes", "chatty", *flags)
    assert code == 0
    lines = set(caplog.messages)
    assert {m for m in ("debug", "info", "warning") if f"mograph.tests.chatty {m} line" in lines} == seen
    third = {m for m in ("debug", "info", "warning") if f"some_library.core {m} line" in lines}
    assert third == ({"warning"} if flags != ["-q"] else set())  # third-party loggers stay at WARNING
    assert (root.level, mine.level) == levels  # main() leaves logging as it found it


_SUBPROCESS_SCRIPT = """
import logging, sys
import mograph
from mograph.cli import main
from mograph.plugins import get_registry

class Chatty(mograph.Pass):
    name = "chatty-crash"

    def call(self, model):
        logging.getLogger("mograph.tests.chatty").debug("mograph debug line")
        logging.getLogger("some_library.core").debug("third-party debug line")
        raise ValueError("kaput")

reg = get_registry()
reg.passes["chatty-crash"] = Chatty
reg.pass_source["chatty-crash"] = "tests"
sys.exit(main(sys.argv[1:]))
"""


def test_console_logging_and_traceback_in_a_subprocess(workdir, tmp_path):
    """The real process (no pytest log capture): -vv logs mograph's debug lines on stderr and not a
    third-party library's, and prints the crashed pass's traceback above the one error line."""
    src = workdir / "good.onnx"
    script = tmp_path / "run_chatty.py"
    script.write_text(_SUBPROCESS_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), "optimize", str(src), "--passes", "chatty-crash", "-vv"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "DEBUG mograph.tests.chatty: mograph debug line" in proc.stderr
    assert "third-party debug line" not in proc.stderr
    assert "Traceback (most recent call last):" in proc.stderr and 'raise ValueError("kaput")' in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        "mograph: error: internal error in pass 'chatty-crash' of plugin 'tests': ValueError: kaput (a bug"
    )
    assert sorted(p.name for p in workdir.iterdir()) == ["good.onnx"]


def test_unwritable_output_is_one_line(capsys, workdir):
    (workdir / "blocker").write_text("a file where a folder should be")
    before = _snapshot(workdir)
    code, _, err = _cli(capsys, "optimize", str(workdir / "good.onnx"), "-o", str(workdir / "blocker" / "o.onnx"), "-q")
    assert code == 2
    _assert_one_line(err, "cannot write")
    assert _snapshot(workdir) == before


def test_successful_run_leaves_input_unchanged_and_no_temporary_files(capsys, workdir):
    src = workdir / "good.onnx"
    digest = _digest(src)
    code, out, _ = _cli(capsys, "optimize", str(src))
    assert code == 0
    assert _digest(src) == digest
    assert sorted(p.name for p in workdir.iterdir()) == ["good.onnx", "good.opt.onnx"]
    assert "wrote" in out


def test_exit_codes_are_documented():
    assert [c.exit_code for c in (UsageError, UnknownPassError, OptionError)] == [2, 2, 2]
    assert ModelError.exit_code == 3 and PassFailedError.exit_code == 4 and VerificationError.exit_code == 5
    assert PluginError.exit_code == 6 and BackendUnavailableError.exit_code == 7
    assert InternalError.exit_code == 1 and issubclass(InternalError, mograph.MographError)  # one except clause
    assert "pip install 'mograph[ort]'" in str(BackendUnavailableError("onnxruntime", "ort"))
    from mograph.cli import EXIT_CODES_HELP

    for code in range(8):
        assert f"\n  {code}  " in "\n" + EXIT_CODES_HELP


@pytest.mark.parametrize("case", ["missing", "truncated"])
def test_console_script_in_a_subprocess(workdir, case):
    path = workdir / "nope.onnx" if case == "missing" else _write_case(workdir, "truncated")
    proc = subprocess.run(
        [sys.executable, "-m", "mograph", "optimize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3
    _assert_one_line(proc.stderr)
    assert proc.stdout == ""


def test_the_package_exports_every_error_type():
    import mograph.errors

    for name in mograph.errors.__all__:
        assert name in mograph.__all__ and getattr(mograph, name) is getattr(mograph.errors, name), name
