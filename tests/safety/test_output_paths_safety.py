"""No path mograph writes may destroy what it reads (issue 30: R1, R2, R5 and the plan-path usage errors).

Every written path (``-o``, ``--report``, ``--precision-plan-out``, a ledger, ``--csv``, ``report -o`` /
``--plot``, ``build -o``) is checked once, before any work, against every path the command reads (the
model, its external-data file, plans, data): the same file, a hard link or a symbolic link to it is exit 2
with one line, and nothing on disk changes.  A write never goes through a symbolic link, and a ledger is
never created through a dangling one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mograph import _paths
from mograph.cli import main
from mograph.errors import UsageError


def _model(path: Path, external: bool = False) -> Path:
    """y = Relu(x @ w + b); with ``external`` the weights are in ``<name>.data`` beside it."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["s"]),
         helper.make_node("Relu", ["s"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    else:
        onnx.save(model, str(path))
    return path


def _snapshot(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key] = "-> " + os.readlink(p)
        elif p.is_file():
            out[key] = p.read_bytes()
    return out


def _cli(capsys, *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _one_line(err: str, text: str) -> None:
    assert err.count("\n") == 1 and err.startswith("mograph: error:"), err
    assert text in err, err


@pytest.fixture
def work(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    _model(tmp_path / "m.onnx")
    _model(tmp_path / "ext.onnx", external=True)
    (tmp_path / "victim.txt").write_text("victim")
    return tmp_path


# --------------------------------------------------------------------------- R1: other outputs onto the input
@pytest.mark.parametrize("alias", ["same", "hardlink", "symlink"])
@pytest.mark.parametrize("flag", ["--report", "--precision-plan-out"])
def test_report_and_plan_out_never_overwrite_the_input_model(work, capsys, flag, alias):
    target = {"same": "m.onnx", "hardlink": "hard.onnx", "symlink": "soft.onnx"}[alias]
    if alias == "hardlink":
        os.link(work / "m.onnx", work / "hard.onnx")
    elif alias == "symlink":
        (work / "soft.onnx").symlink_to("m.onnx")
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "fp16", "--calibration-random", "2", "-o", "out.onnx",
                     flag, target)
    assert code == 2, err  # was 0, the input overwritten with the report / the plan
    _one_line(err, "refusing to write over the input model m.onnx")
    assert _snapshot(work) == before  # before any work: no output model either


@pytest.mark.parametrize("flag", ["--report", "--precision-plan-out"])
def test_report_and_plan_out_never_overwrite_the_input_data_file(work, capsys, flag):
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "ext.onnx", "--passes", "fp16", "--calibration-random", "2", "-o", "out.onnx",
                     flag, "ext.onnx.data")
    assert code == 2, err  # --report: was 0, the weights replaced by JSON
    _one_line(err, "refusing to write over the input model's external data ext.onnx.data")
    assert _snapshot(work) == before


# --------------------------------------------------------------------------- R2: -o onto the input's data file
@pytest.mark.parametrize("alias", ["same", "hardlink"])
def test_output_never_overwrites_the_input_data_file(work, capsys, alias):
    target = "ext.onnx.data"
    if alias == "hardlink":
        os.link(work / "ext.onnx.data", work / "hard.data")
        target = "hard.data"
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "ext.onnx", "--passes", "cleanup", "-o", target, "-q")
    assert code == 2, err  # was 0, and ext.onnx no longer loaded
    _one_line(err, "external data ext.onnx.data")
    assert _snapshot(work) == before
    assert main(["inspect", "ext.onnx", "--json"]) == 0  # the input still loads


def test_build_output_never_overwrites_the_input_data_file(work, capsys):
    before = _snapshot(work)
    code, err = _cli(capsys, "build", "ext.onnx", "--backend", "tensorrt", "-o", "ext.onnx.data")
    assert code == 2, err
    _one_line(err, "external data ext.onnx.data")
    assert _snapshot(work) == before


def test_two_outputs_on_one_file_are_refused(work, capsys):
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "cleanup", "-o", "out.onnx", "--report", "out.onnx")
    assert code == 2, err
    _one_line(err, "are the same file")
    assert _snapshot(work) == before


def test_report_never_overwrites_feeds_or_a_plan_it_reads(work, capsys):
    np.savez(work / "feeds.npz", x=np.ones((2, 8), np.float32))
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "cleanup", "-o", "out.onnx", "--verify",
                     "--feeds", "feeds.npz", "--report", "feeds.npz")
    assert code == 2, err
    _one_line(err, "refusing to write over --feeds feeds.npz")
    assert _snapshot(work) == before
    (work / "plan.yaml").write_text("pass: fp16\nnodes: []\n")
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "fp16", "--calibration-random", "2", "-o", "out.onnx",
                     "--precision-plan", "plan.yaml", "--precision-plan-out", "plan.yaml")
    assert code == 2, err
    _one_line(err, "refusing to write over --precision-plan plan.yaml")
    assert _snapshot(work) == before


# --------------------------------------------------------------------------- R5: no write through a link
@pytest.mark.parametrize("flag", ["--report", "--precision-plan-out"])
def test_no_write_follows_a_symbolic_link(work, capsys, flag):
    (work / "link.json").symlink_to("victim.txt")
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "fp16", "--calibration-random", "2", "-o", "out.onnx",
                     flag, "link.json")
    assert code == 2, err  # was 0, victim.txt rewritten
    _one_line(err, f"{flag} link.json is a symbolic link to victim.txt")
    assert (work / "victim.txt").read_text() == "victim" and _snapshot(work) == before


def test_output_model_through_a_dangling_link_is_refused(work, capsys):
    (work / "out.onnx").symlink_to("elsewhere.onnx")
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "cleanup", "-o", "out.onnx")
    assert code == 2, err
    _one_line(err, "is a symbolic link (dangling)")
    assert not (work / "elsewhere.onnx").exists()


def test_a_ledger_is_never_created_through_a_dangling_link(work, capsys):
    (work / "s.yaml").write_text("eval_samples: 2\nwarmup: 1\niterations: 2\nconfigurations:\n"
                                 "  - {name: a, passes: [cleanup]}\n")
    (work / "l.db").symlink_to("nowhere.db")
    code, err = _cli(capsys, "sweep", "m.onnx", "--config", "s.yaml", "--ledger", "l.db", "-q")
    assert code == 2, err  # was 0, with the database created as nowhere.db
    _one_line(err, "--ledger l.db is a symbolic link (dangling) to nowhere.db")
    assert not (work / "nowhere.db").exists() and (work / "l.db").is_symlink()
    # and from Python: the ledger refuses it too
    from mograph.workflow.ledger import open_ledger

    with pytest.raises(UsageError, match="symbolic link"):
        open_ledger(work / "l.db")
    assert not (work / "nowhere.db").exists()


def test_ledger_outputs_never_overwrite_the_ledger_or_follow_links(work, capsys):
    from mograph.workflow.ledger import open_ledger

    with open_ledger(work / "l.db") as ledger:
        ledger.add({"name": "row", "model_hash": "abc", "metrics": {"latency_p50_ms": 1.0, "cosine_mean": 1.0}})
    before = _snapshot(work)
    code, err = _cli(capsys, "ledger", "export", "--ledger", "l.db", "--csv", "l.db")
    assert code == 2, err
    _one_line(err, "refusing to write over the ledger l.db")
    code, err = _cli(capsys, "report", "--ledger", "l.db", "-o", "l.db")
    assert code == 2, err
    _one_line(err, "refusing to write over the ledger l.db")
    (work / "link.csv").symlink_to("victim.txt")
    code, err = _cli(capsys, "ledger", "export", "--ledger", "l.db", "--csv", "link.csv")
    assert code == 2, err
    _one_line(err, "is a symbolic link")
    (work / "link.svg").symlink_to("victim.txt")
    code, err = _cli(capsys, "report", "--ledger", "l.db", "--plot", "link.svg")
    assert code == 2, err
    _one_line(err, "is a symbolic link")
    assert (work / "victim.txt").read_text() == "victim"
    before.update({"link.csv": "-> victim.txt", "link.svg": "-> victim.txt"})
    after = _snapshot(work)
    assert after["l.db"] == before["l.db"]  # reading may add SQLite's -wal/-shm files; the database is untouched
    assert {k: v for k, v in after.items() if not k.startswith("l.db")} == {
        k: v for k, v in before.items() if not k.startswith("l.db")}


# --------------------------------------------------------------------------- plan paths are usage errors
def test_plan_out_into_a_missing_folder_is_a_usage_error_before_any_work(work, capsys):
    before = _snapshot(work)
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "fp16", "--calibration-random", "2", "-o", "out.onnx",
                     "--precision-plan-out", "nodir/plan.yaml")
    assert code == 2, err  # was 1, "internal error in pass 'fp16': FileNotFoundError"
    _one_line(err, "--precision-plan-out nodir/plan.yaml: folder nodir does not exist")
    assert _snapshot(work) == before


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"\xff\xfe\xaa garbage", b"nodes: [\x00]"])
def test_a_binary_plan_is_a_usage_error(work, capsys, content):
    (work / "plan.yaml").write_bytes(content)
    code, err = _cli(capsys, "optimize", "m.onnx", "--passes", "fp16", "--calibration-random", "2", "-o", "out.onnx",
                     "--precision-plan", "plan.yaml", "-q")
    assert code == 2, err  # was 1, "internal error in pass 'fp16': UnicodeDecodeError"
    assert err.count("\n") == 1 and "--precision-plan plan.yaml" in err and "internal error" not in err
    assert not (work / "out.onnx").exists()


# --------------------------------------------------------------------------- the check itself
def test_check_io_rules(tmp_path):
    a = tmp_path / "a"
    a.write_text("a")
    os.link(a, tmp_path / "hard")
    (tmp_path / "soft").symlink_to("a")
    (tmp_path / "dangling").symlink_to("none")
    _paths.check_io([("-o", tmp_path / "b"), ("--report", None), ("--csv", "-")], [("in", a)])  # fine
    for out, text in ((a, "refusing to write over in"), (tmp_path / "hard", "refusing to write over in"),
                      (tmp_path / "soft", "refusing to write over in"), (tmp_path / "dangling", "(dangling)")):
        with pytest.raises(UsageError, match=text.replace("(", r"\(").replace(")", r"\)")):
            _paths.check_io([("-o", out)], [("in", a)])
    with pytest.raises(UsageError, match="same file"):
        _paths.check_io([("-o", tmp_path / "b"), ("--report", tmp_path / "." / "b")], [])


def test_write_text_replaces_a_link_made_after_the_check(tmp_path):
    """Even a link that appears between the check and the write is replaced, never followed."""
    victim = tmp_path / "victim.txt"
    victim.write_text("victim")
    dest = tmp_path / "out.json"
    _paths.check_io([("--report", dest)], [])
    dest.symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"):
        _paths.write_text(dest, "{}", "--report")
    assert victim.read_text() == "victim"
    dest.unlink()
    _paths.write_text(dest, "{}", "--report")
    assert dest.read_text() == "{}" and not dest.is_symlink()


def test_api_plan_out_never_overwrites_the_input(work):
    import mograph

    before = _snapshot(work)
    for target in ("m.onnx", "ext.onnx.data"):
        src = "ext.onnx" if target.startswith("ext") else "m.onnx"
        with pytest.raises(UsageError, match="refusing to write over the input model"):
            mograph.optimize(str(work / src), ["fp16"], options={"calibration_random": 2, "precision_plan_out": target})
    assert _snapshot(work) == before


def test_sweep_kept_models_never_overwrite_the_input(work, capsys):
    (work / "s.yaml").write_text("eval_samples: 2\nwarmup: 1\niterations: 2\nconfigurations:\n"
                                 "  - {name: m, passes: [cleanup]}\n")
    before = _snapshot(work)
    code, err = _cli(capsys, "sweep", "m.onnx", "--config", "s.yaml", "--ledger", "l.db", "--keep-models", ".", "-q")
    assert code == 2, err  # was 4 after building and measuring, with a failed row in the ledger
    _one_line(err, "refusing to write over the input model m.onnx (--keep-models (configuration 'm')")
    assert _snapshot(work) == before  # no ledger created either
