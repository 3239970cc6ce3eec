"""Progress of a run, for people: ``[i/N] pass ...`` per pass and a bar inside long passes.

One facility for every command and pass.  Long loops (calibration, the sensitivity search, GPTQ) do
not print: they call a ``progress(done, total)`` callback (``total`` may be ``None`` when unknown), which
passes expose as their ``progress`` attribute (``passes/quant``).  :class:`ProgressInstrument` wraps each
pass of a run from outside (a pass instrument, like timing or ``--verify each``): it writes the pass line
and hands the pass a callback that draws a :class:`Bar`, then takes it back.

How it looks is decided here, once:

* on a terminal, one line redrawn in place: ``  qdq-int8 [########........] 12/36 (41s)``, or
  ``12 done (41s)`` when the total is unknown; the line is closed when the pass ends;
* when stderr is not a terminal (CI logs, pipes), plain lines: the first, then one every
  :data:`LINE_EVERY` seconds, and the last;
* nothing at all where no instrument is installed (``-q``, ``--json``, the Python API by default).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Generator
from typing import Any, TextIO

__all__ = ["Bar", "ProgressInstrument", "LINE_EVERY"]

#: Seconds between plain progress lines when stderr is not a terminal.
LINE_EVERY = 10.0
#: Seconds between redraws on a terminal.
_REDRAW_EVERY = 0.2
_WIDTH = 24


class Bar:
    """A progress display for one loop; call it as ``bar(done, total)``; :meth:`close` ends its line.

    Args:
        label: what is progressing (a pass name, ``"calibration"``).
        stream: where to write (default ``sys.stderr``).
        tty: draw in place (default: whether ``stream`` is a terminal); ``False`` writes plain lines.
        clock: time source (tests give their own).
    """

    def __init__(
        self, label: str, *, stream: TextIO | None = None, tty: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.clock = clock
        self.start = clock()
        self.last: float | None = None
        self.drawn = False
        self.state: tuple[int, int | None] | None = None

    def text(self, done: int, total: int | None) -> str:
        elapsed = f"({self.clock() - self.start:.0f}s)"
        if total:
            filled = max(0, min(_WIDTH, int(_WIDTH * done / total)))
            return f"  {self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {done}/{total} {elapsed}"
        return f"  {self.label}: {done} done {elapsed}"

    def __call__(self, done: int, total: int | None = None) -> None:
        now = self.clock()
        self.state = (int(done), total)
        finished = bool(total) and done >= (total or 0)
        every = _REDRAW_EVERY if self.tty else LINE_EVERY
        if not (self.last is None or finished or now - self.last >= every):
            return
        self.last = now
        self._write(self.text(int(done), total), finished)

    def _write(self, text: str, finished: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if finished else ""))
            self.drawn = not finished
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the display: on a terminal, the open line is finished; otherwise the last state is written
        if the throttle held it back."""
        if self.state is None:
            return
        done, total = self.state
        if self.tty:
            if self.drawn:
                self.stream.write("\r\x1b[K" + self.text(done, total) + "\n")
                self.stream.flush()
        elif self.last is not None and self.clock() > self.last:
            self._write(self.text(done, total), True)
        self.drawn = False


class ProgressInstrument:
    """Pass instrument of one run: ``[i/N] name ...`` before each pass, and a :class:`Bar` for a pass that
    reports progress (one with a ``progress`` attribute left ``None``: the instrument sets it for the
    pass's run and puts it back).

    Args:
        total: passes in the run (the ``N``).
        stream: where to write (default ``sys.stderr``).
        tty: see :class:`Bar`.
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.total = total
        self.i = 0
        self.stream = stream
        self.tty = tty

    def mograph_run_pass(self, pass_: Any, model: Any, context: dict[str, Any]) -> Generator[None, Any, Any]:
        self.i += 1
        out = self.stream if self.stream is not None else sys.stderr
        out.write(f"[{self.i}/{self.total}] {pass_.name} ...\n")
        out.flush()
        bar = None
        if hasattr(pass_, "progress") and getattr(pass_, "progress", None) is None:
            bar = Bar(pass_.name, stream=out, tty=self.tty)
            pass_.progress = bar
        try:
            return (yield)
        finally:
            if bar is not None:
                bar.close()
                pass_.progress = None
