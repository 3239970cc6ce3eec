"""The one check of every path a command writes against every path it reads, and a write that follows no link.

Why: a command reads a model (and its external-data files), plans, calibration and evaluation data,
and writes a model, its data file, a report, a plan, a plot, a ledger, an export.  Each written path
given on the command line could name a file that is read: the input model, its ``.data`` file (a hard
link or a symbolic link to it counts too), or a file that a link points elsewhere.  Writing there
destroys the input with exit 0.  So a command lists what it will write and what it reads *before any
work* and calls :func:`check_io` once; a clash is a :class:`~mograph.errors.UsageError` (exit 2).

The rules, for every write path:

* it must not be a symbolic link (an existing or a dangling one): a write through it would change, or
  create, the file it points to;
* it must not be the same file as any read path (same resolved path, or the same inode: a hard link);
* it must not be the same file as another write path (``-o x --report x``).

:func:`write_text` then writes a small file (a report, a plan) into a temporary file beside the
destination and renames it over the destination: a rename replaces a link itself, never the file it
points to, so even a link made after the check is not followed, and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mograph.errors import UsageError

__all__ = ["check_io", "model_files", "spec_files", "option_io", "write_text", "write_bytes", "check_writable_folder", "Named"]

#: A path with the flag or role that names it in an error (``("--report", "r.json")``); ``None`` paths are skipped.
Named = tuple[str, "str | os.PathLike[str] | None"]


def model_files(path: str | os.PathLike[str] | None) -> list[Path]:
    """A model file and the external-data files it names inside its folder (what loading it reads).

    Nothing for ``None`` or a path that is not a file.  Unreadable models name no data file here (the
    loader refuses them later); locations that leave the folder are never read, so they are not listed.
    """
    if path is None:
        return []
    p = Path(path)
    if not p.is_file():
        return []
    out = [p]
    try:
        from mograph import _stream_load

        proto = _stream_load.proto_without_weights(p)  # a large file's weights are not read
    except Exception:  # noqa: BLE001 - not a model we can read: the loader says why later
        return out
    names: set[str] = set()
    import onnx

    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            names.update(e.value for e in tensor.external_data if e.key == "location")
    for name in sorted(names):
        if name and not os.path.isabs(name) and (p.parent / name).exists():
            out.append(p.parent / name)
    return out


def spec_files(spec: str | os.PathLike[str] | None) -> list[Path]:
    """The files a data option reads: a file or folder path (a folder's files too), or the ``.py`` of
    ``file.py:function``; nothing for ``module:function`` or ``None``."""
    if spec is None or not isinstance(spec, (str, os.PathLike)):
        return []
    text = os.fspath(spec)
    p = Path(text)
    if p.is_dir():
        with contextlib.suppress(OSError):
            return [p, *sorted(q for q in p.iterdir() if q.is_file())]
        return [p]
    if p.exists():
        return [p]
    head, sep, _ = text.rpartition(":")
    if sep and head.endswith(".py") and Path(head).exists():
        return [Path(head)]
    return []


def _same(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
    except (OSError, RuntimeError):  # a link loop: compared by inode below
        pass
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_io(writes: Iterable[Named], reads: Iterable[Named]) -> None:
    """Refuse (exit 2) a write path that is a symbolic link, or the same file as a read path or as
    another write path (see the module docstring).  Call it once per command, before any work."""
    outs = [(flag, Path(p)) for flag, p in writes if p is not None and os.fspath(p) != "-"]
    ins = [(what, Path(p)) for what, p in reads if p is not None]
    for i, (flag, path) in enumerate(outs):
        for what, src in ins:
            if _same(path, src):
                raise UsageError(f"refusing to write over {what} {src} ({flag} {path}): this command reads it; "
                                 "choose another path")
        for other_flag, other in outs[:i]:
            if _same(path, other):
                raise UsageError(f"{flag} {path} and {other_flag} {other} are the same file; give two paths")
        if path.is_symlink():
            state = "" if path.exists() else " (dangling)"
            raise UsageError(
                f"{flag} {path} is a symbolic link{state} to {os.readlink(path)}: mograph never writes through a "
                "link; give the real path"
            )


def check_writable_folder(path: str | os.PathLike[str], flag: str) -> None:
    """Refuse (exit 2), before any work, a file whose folder does not exist (mograph creates no folders)."""
    folder = Path(path).parent
    if not folder.exists():
        raise UsageError(f"{flag} {path}: folder {folder} does not exist; create it first")
    if not folder.is_dir():
        raise UsageError(f"cannot write {flag} {path}: {folder} is not a folder")


def sweep_dead_saves(folder: str | os.PathLike[str]) -> None:
    """Remove what model saves into ``folder`` left when their process was killed (hidden folders whose lock
    nobody holds: :func:`mograph.ir_io.sweep_save_leftovers`), before this run writes a file there; a folder
    that cannot be listed is left to the write itself to report."""
    from mograph._tempfiles import sweep_stale

    with contextlib.suppress(OSError):
        sweep_stale(Path(folder) if str(folder) else Path("."), ".")


def write_text(path: str | os.PathLike[str], text: str, flag: str = "output") -> None:
    """Write ``text`` to ``path`` atomically, never through a symbolic link (a rename replaces the link).

    A missing folder or a write that fails is a :class:`UsageError` (exit 2) naming ``flag``.
    """
    write_bytes(path, text.encode("utf-8"), flag)


def write_bytes(path: str | os.PathLike[str], data: bytes, flag: str = "output") -> None:
    """:func:`write_text` for bytes."""
    dest = Path(path)
    check_writable_folder(dest, flag)
    if dest.is_symlink():
        raise UsageError(f"{flag} {dest} is a symbolic link: mograph never writes through a link; give the real path")
    sweep_dead_saves(dest.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    except OSError as exc:
        raise UsageError(f"{flag} {dest}: cannot write there ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        with contextlib.suppress(OSError):  # keep the usual permissions, not mkstemp's 0600
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise UsageError(f"{flag} {dest}: cannot write ({exc.strerror or exc})") from exc
        raise


def option_io(declared: Mapping[str, tuple[Any, Any]], options: Mapping[str, Any]) -> tuple[list[Named], list[Named]]:
    """``(writes, reads)`` named by pass options: every option given in ``options`` whose declaration
    (``declared``: :meth:`Registry.all_options`) has ``io="write"`` or ``io="read"``."""
    writes: list[Named] = []
    reads: list[Named] = []
    for key, value in options.items():
        opt = declared.get(key, (None,))[0]
        io = getattr(opt, "io", None)
        if io is None or value is None:
            continue
        flag = f"--{key.replace('_', '-')}"
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(item, (str, os.PathLike)):
                continue  # from Python: a callable or a list of feeds reads no file
            if io == "write":
                writes.append((flag, item))
            else:
                reads.extend((flag, f) for f in spec_files(item))
    return writes, reads
