"""A saved model and its external data are one pair: a reader sees the old pair or the new one, never
the old graph with the new weights; and no temporary folder outlives the run, killed or not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import mograph
from models.builders import make_model
from mograph import _tempfiles, ir_io

SHAPE = [16, 32]  # 2 KiB of weights: above the size from which tensors go to external data
X = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(SHAPE)


def _model(scale: float, op: str) -> onnx.ModelProto:
    """y = op(x * w), w = scale everywhere: graph and weights both tell which save a file came from."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["t"]), helper.make_node(op, ["t"], ["y"])]
    return make_model(nodes, [("x", np.float32, SHAPE)], [("y", np.float32, SHAPE)], {"w": np.full(SHAPE, scale, np.float32)})


def _expected(scale: float, op: str) -> np.ndarray:
    t = X * scale
    return np.maximum(t, 0) if op == "Relu" else -t


def _run(path: Path) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


class _Killed(BaseException):
    """Stands in for a signal arriving at the worst moment."""


def test_a_kill_between_the_renames_leaves_the_old_pair(tmp_path, monkeypatch):
    out = tmp_path / "out.onnx"
    ir_io.save_model(mograph.load(_model(2.0, "Relu")), out, external_data=True)
    listing = sorted(os.listdir(tmp_path))
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == out:  # everything else is in place: the model's own rename is the next step
            raise _Killed()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_Killed):
        ir_io.save_model(mograph.load(_model(-3.0, "Neg")), out, external_data=True)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(os.listdir(tmp_path)) == listing  # no new data file, no temporary folder
    np.testing.assert_array_equal(_run(out), _expected(2.0, "Relu"))  # the old graph with the old weights


def test_replacing_a_pair_switches_to_the_new_pair_and_removes_the_old_data(tmp_path):
    out = tmp_path / "out.onnx"
    ir_io.save_model(mograph.load(_model(2.0, "Relu")), out, external_data=True)
    for scale, op in ((-3.0, "Neg"), (5.0, "Relu"), (0.5, "Neg")):
        ir_io.save_model(mograph.load(_model(scale, op)), out, external_data=True)
        np.testing.assert_array_equal(_run(out), _expected(scale, op))
        files = sorted(os.listdir(tmp_path))
        assert len(files) == 2 and files[0] == "out.onnx", files  # the model and the one data file it reads
        locations = {
            e.value for t in onnx.load(str(out), load_external_data=False).graph.initializer for e in t.external_data
            if e.key == "location"
        }
        assert locations == {files[1]}
    # Saved inline at last: the old data file goes too.
    ir_io.save_model(mograph.load(_model(1.0, "Relu")), out, external_data=False)
    assert sorted(os.listdir(tmp_path)) == ["out.onnx"]


def test_data_files_not_named_after_the_output_are_never_removed(tmp_path):
    # out.onnx was written by someone else and reads shared.bin, which another model reads too.
    out = tmp_path / "out.onnx"
    proto = _model(2.0, "Relu")
    onnx.save(onnx.ModelProto.FromString(proto.SerializeToString()), out, save_as_external_data=True,
              location="shared.bin", size_threshold=0)
    shared = (tmp_path / "shared.bin").read_bytes()
    ir_io.save_model(mograph.load(_model(-3.0, "Neg")), out, external_data=True)
    assert (tmp_path / "shared.bin").read_bytes() == shared
    np.testing.assert_array_equal(_run(out), _expected(-3.0, "Neg"))


def _sigkilled_child_dir(folder: Path, prefix: str) -> Path:
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from mograph._tempfiles import owned_tempdir
        tmp = owned_tempdir({prefix!r}, dir={str(folder)!r})
        open(os.path.join(tmp.name, "big.data"), "wb").write(b"x" * 1000)
        print(tmp.name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = Path(proc.stdout.strip())
    assert (left / "big.data").is_file()  # SIGKILL ran no cleanup: the leftover is there
    return left


def test_temporary_folders_of_killed_saves_are_swept_by_the_next_save(tmp_path):
    left = _sigkilled_child_dir(tmp_path, ".out.onnx.")
    live = _tempfiles.owned_tempdir(".out.onnx.", dir=tmp_path)  # a save running right now
    try:
        ir_io.save_model(mograph.load(_model(2.0, "Relu")), tmp_path / "out.onnx")
        assert not left.exists()
        assert live.path.is_dir()  # its owner holds the lock: never touched
        assert sorted(os.listdir(tmp_path)) == sorted(["out.onnx", live.path.name])
    finally:
        live.cleanup()
    assert not live.path.exists()


def test_a_killed_save_of_another_model_is_swept_by_any_run_writing_into_the_folder(tmp_path, capsys):
    """Issue 27: the leftovers of a killed save of ``a.onnx`` used to stay until a later save of ``a.onnx``;
    now a save of any model into the folder, and ``mograph optimize -o`` into it from its start, sweep them."""
    from mograph.cli import main

    left = _sigkilled_child_dir(tmp_path, ".a.onnx.")
    live = _tempfiles.owned_tempdir(".c.onnx.", dir=tmp_path)  # a save of c.onnx running right now
    plain = tmp_path / ".not-ours"  # a hidden folder without mograph's lock file
    plain.mkdir()
    try:
        ir_io.save_model(mograph.load(_model(2.0, "Relu")), tmp_path / "b.onnx")
        assert not left.exists() and live.path.is_dir() and plain.is_dir()
        left2 = _sigkilled_child_dir(tmp_path, ".a.onnx.")
        out = tmp_path / "sub" / "d.onnx"
        out.parent.mkdir()
        left3 = _sigkilled_child_dir(out.parent, ".e.onnx.")
        seen: list[bool] = []
        real_run = ir_io.save_model

        def spy(model, dest, **kw):  # the sweep ran at the start, before any pass or the save
            seen.append(left3.exists())
            return real_run(model, dest, **kw)

        ir_io.save_model = spy  # type: ignore[assignment]
        try:
            assert main(["optimize", str(tmp_path / "b.onnx"), "-o", str(out), "--passes", "cleanup"]) == 0
        finally:
            ir_io.save_model = real_run  # type: ignore[assignment]
        assert seen == [False] and not left3.exists() and out.is_file()
        assert left2.exists()  # another folder: untouched by a run writing into sub/
        assert main(["optimize", str(tmp_path / "b.onnx"), "-o", str(tmp_path / "f.onnx"), "--passes", "cleanup"]) == 0
        assert not left2.exists() and live.path.is_dir() and plain.is_dir()
    finally:
        live.cleanup()
    capsys.readouterr()


def _sigterm_run(tmp_path: Path, patch: str, argv: list[str], env: dict[str, str] | None = None):
    code = textwrap.dedent(
        """
        import os, signal, sys, time
        {patch}
        from mograph.cli import main
        sys.exit(main({argv!r}))
        """
    ).format(patch=textwrap.dedent(patch), argv=argv)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )


def test_sigterm_during_a_save_leaves_nothing_behind(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_model(2.0, "Relu"), src)
    (tmp_path / "out.onnx").write_bytes(b"previous result")
    listing = sorted(os.listdir(tmp_path))
    patch = """
        import onnx_ir as ir
        real_save = ir.save
        def save(*args, **kwargs):
            real_save(*args, **kwargs)  # the temporary files are written ...
            os.kill(os.getpid(), signal.SIGTERM)  # ... and the run is told to stop
            time.sleep(30)
        ir.save = save
    """
    proc = _sigterm_run(tmp_path, patch, ["optimize", str(src), "-o", str(tmp_path / "out.onnx"), "--external-data"])
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "mograph: terminated"
    assert "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == listing
    assert (tmp_path / "out.onnx").read_bytes() == b"previous result"


def test_sigterm_during_verify_removes_the_runtime_copies(tmp_path):
    pytest.importorskip("onnxruntime")
    src = tmp_path / "m.onnx"
    onnx.save(_model(2.0, "Relu"), src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    temp = tmp_path / "temp"
    temp.mkdir()
    patch = """
        from mograph import _spill
        real = _spill.spill
        def spill(model):
            result = real(model)  # a full copy of the model sits in the temporary directory ...
            print(result.path, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # ... when the run is told to stop
            time.sleep(30)
            return result
        _spill.spill = spill
    """
    out = tmp_path / "out.onnx"
    # A protobuf limit of 0: every model reaches ONNX Runtime spilled to a temporary folder, as one above 2 GB does.
    proc = _sigterm_run(tmp_path, patch, ["optimize", str(src), "-o", str(out), "--verify"],
                        env={"TMPDIR": str(temp), "MOGRAPH_PROTO_LIMIT": "0"})
    assert proc.returncode == 143, proc.stderr
    assert "Traceback" not in proc.stderr
    copy = Path(proc.stdout.strip().splitlines()[-1])
    assert copy.parent.parent == temp and copy.parent.name.startswith("mograph-spill-")
    assert not copy.parent.exists()
    assert [p for p in os.listdir(temp) if p.startswith("mograph")] == []  # (the sandbox may leave its own)
    assert not out.exists()


def test_runtime_copies_of_a_killed_verification_are_swept_by_the_next_one(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    import tempfile

    from mograph import _spill

    left = _sigkilled_child_dir(tmp_path, "mograph-spill-")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = mograph.load(_model(2.0, "Relu"))
    spilled = _spill.spill(model)
    path = spilled.path
    try:
        assert not left.exists()
        assert Path(path).parent.parent == tmp_path and Path(path).is_file()
    finally:
        spilled.cleanup()
    assert not Path(path).parent.exists()


@pytest.mark.parametrize("what", ["ledger-csv", "report-html", "optimize-report-json", "ledger-db"])
def test_a_killed_save_is_swept_by_a_run_writing_any_file_into_the_folder(tmp_path, capsys, what):
    """Issue 27 item 6: a run that writes into the folder sweeps a killed save's leftovers, not only a run that
    saves a model there (a CSV export, an HTML report, ``--report``'s JSON and a ledger created there left the
    dead save's data in place)."""
    from mograph.cli import main
    from mograph.workflow.ledger import open_ledger

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    src = elsewhere / "m.onnx"
    onnx.save(_model(2.0, "Relu"), src)
    with open_ledger(elsewhere / "l.db") as ledger:
        ledger.add({"name": "baseline", "baseline": True, "status": "ok", "model_hash": "a1", "pipeline": [],
                    "metrics": {"latency_p50_ms": 1.0, "size_bytes": 100.0}})
    folder = tmp_path / "out"
    folder.mkdir()
    left = _sigkilled_child_dir(folder, ".a.onnx.")
    if what == "ledger-csv":
        assert main(["ledger", "export", "--ledger", str(elsewhere / "l.db"), "--csv", str(folder / "x.csv")]) == 0
    elif what == "report-html":
        assert main(["report", "--ledger", str(elsewhere / "l.db"), "-o", str(folder / "r.html")]) == 0
    elif what == "optimize-report-json":
        assert main(["optimize", str(src), "-o", str(elsewhere / "o.onnx"), "--report", str(folder / "r.json")]) == 0
    else:
        with open_ledger(folder / "l.db"):
            pass
    capsys.readouterr()
    assert not left.exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], list(folder.iterdir())
