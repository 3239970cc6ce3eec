"""SIGTERM as an exception, so that ``finally`` blocks (temporary folders, half-written files) run.

Python's default SIGTERM action ends the process on the spot: a save caught half-way leaves its
hidden temporary folder beside the output, and a verification run leaves gigabytes of model copies in
the temporary directory.  Inside :func:`terminate_as_exception`, SIGTERM raises :class:`Terminated`
instead; it derives from ``BaseException`` so that no ``except Exception`` swallows it on the way up.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "terminate_as_exception"]


class Terminated(BaseException):
    """The process received SIGTERM."""


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"received signal {signum}")


@contextlib.contextmanager
def terminate_as_exception() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` for the duration (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
