"""mograph.progress: ``[i/N]`` per pass, a bar with elapsed time inside a pass that reports progress,
plain lines when not a terminal, nothing under ``-q``."""

from __future__ import annotations

import io

import onnx_ir as ir
from onnx import TensorProto, helper

import mograph
from mograph.cli import main
from mograph.plugins import get_registry
from mograph.progress import LINE_EVERY, Bar, ProgressInstrument


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_bar_on_a_terminal_redraws_one_line_with_elapsed_time():
    out, clock = io.StringIO(), _Clock()
    bar = Bar("qdq-int8", stream=out, tty=True, clock=clock)
    for i in range(1, 5):
        clock.t = i * 1.0
        bar(i, 4)
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 4 and text.endswith("  qdq-int8 [########################] 4/4 (4s)\n")
    assert "[######..................] 1/4 (1s)" in text


def test_bar_without_a_terminal_writes_plain_throttled_lines():
    out, clock = io.StringIO(), _Clock()
    bar = Bar("gptq", stream=out, tty=False, clock=clock)
    for i in range(1, 101):
        clock.t = i * 0.5  # 50 s in all: the first line, one every LINE_EVERY seconds, the last
        bar(i, None)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and lines[0] == "  gptq: 1 done (0s)" and lines[-1] == "  gptq: 100 done (50s)"
    assert len(lines) == 1 + int(50 // LINE_EVERY) + 1 - (1 if 50 % LINE_EVERY == 0 else 0)


class _LongPass(mograph.Pass):
    """Reports progress through ``self.progress`` as the quantization passes do (calibration, GPTQ)."""

    name = "test-long-pass"
    progress = None

    def call(self, model: ir.Model) -> mograph.PassResult:
        for i in range(3):
            if self.progress is not None:
                self.progress(i + 1, 3)
        return mograph.PassResult(modified=False)


def _model_file(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "m.onnx"
    mograph.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_cli_shows_i_of_n_and_the_bar_of_a_pass_that_reports_progress(tmp_path, capsys, monkeypatch):
    reg = get_registry()
    monkeypatch.setitem(reg.passes, _LongPass.name, _LongPass)
    src = _model_file(tmp_path)
    assert main(["optimize", str(src), "--passes", "test-long-pass,topo-sort"]) == 0
    err = capsys.readouterr().err  # not a terminal under pytest: plain lines
    assert "[1/2] test-long-pass ...\n" in err and "[2/2] topo-sort ...\n" in err
    assert "  test-long-pass [########................] 1/3 (0s)" in err
    assert "  test-long-pass [########################] 3/3 (0s)" in err
    assert main(["optimize", str(src), "--passes", "test-long-pass,topo-sort", "-q"]) == 0
    assert capsys.readouterr().err == ""  # -q: nothing
    assert _LongPass.progress is None


def test_instrument_puts_the_callback_back():
    p = _LongPass()
    inst = ProgressInstrument(1, stream=io.StringIO(), tty=False)
    gen = inst.mograph_run_pass(p, None, {})
    next(gen)
    assert isinstance(p.progress, Bar)
    try:
        gen.send(mograph.PassResult(modified=False))
    except StopIteration:
        pass
    assert p.progress is None
