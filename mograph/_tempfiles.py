"""Temporary folders that are removed even when the process that made them was killed.

A save writes into a hidden folder beside its destination, and a verification run writes models with
external data into a folder under the system's temporary directory; both can hold gigabytes.
``finally`` blocks remove them when an exception unwinds (the CLI turns SIGTERM into one), but
nothing runs on SIGKILL or a power cut.  So every such folder holds a lock file, locked by the
process that owns it for as long as the folder lives; the kernel drops the lock when the process dies,
however it dies.  Before making a new folder, :func:`owned_tempdir` removes the folders of the same
prefix whose lock nobody holds any more: leftovers of processes that are gone.  A folder that is still
locked (a live run, in this process or another) is never touched.

Where ``fcntl`` is not available (Windows) folders carry no lock and are never swept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["OwnedTempDir", "owned_tempdir", "sweep_stale"]

LOCK_NAME = ".mograph-lock"


def _try_lock(handle: IO[Any]) -> bool:
    if fcntl is None:  # pragma: no cover - Windows
        return False
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def sweep_stale(folder: str | os.PathLike, prefix: str) -> list[Path]:
    """Remove the folders ``folder/prefix*`` left by processes that died; return what was removed."""
    removed: list[Path] = []
    if fcntl is None:  # pragma: no cover - Windows
        return removed
    try:
        entries = list(os.scandir(os.fspath(folder)))
    except OSError:
        return removed
    for entry in entries:
        if not str(entry.name).startswith(prefix):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            lock_path = Path(entry.path) / LOCK_NAME
            with open(lock_path, "rb") as handle:  # no lock file: not ours, or not fully made yet
                if not _try_lock(handle):
                    continue  # its owner is alive
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


class OwnedTempDir:
    """A temporary folder locked by this process until :meth:`cleanup` (or garbage collection).

    ``name`` is its path as a string, like :class:`tempfile.TemporaryDirectory`.
    """

    def __init__(self, prefix: str, dir: str | os.PathLike | None = None) -> None:
        self.name = tempfile.mkdtemp(prefix=prefix, dir=dir)
        self._lock: IO[Any] | None = None
        if fcntl is not None:
            # Locked under a private name, then renamed: a sweeper only considers a folder whose lock
            # file exists, and by then it is already held.
            fd, private = tempfile.mkstemp(prefix=".lock-", dir=self.name)
            self._lock = os.fdopen(fd, "wb")
            _try_lock(self._lock)
            os.replace(private, os.path.join(self.name, LOCK_NAME))
        self._finalizer = weakref.finalize(self, _remove, self.name, self._lock)

    @property
    def path(self) -> Path:
        return Path(self.name)

    def cleanup(self) -> None:
        self._finalizer()

    def __enter__(self) -> OwnedTempDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _remove(name: str, lock: IO[Any] | None) -> None:
    shutil.rmtree(name, ignore_errors=True)
    if lock is not None:
        with contextlib.suppress(OSError):
            lock.close()


def owned_tempdir(prefix: str, dir: str | os.PathLike | None = None) -> OwnedTempDir:
    """Sweep the dead leftovers of ``prefix`` in ``dir`` (default: the system's temporary directory),
    then make a new locked folder there."""
    sweep_stale(dir if dir is not None else tempfile.gettempdir(), prefix)
    return OwnedTempDir(prefix, dir)
