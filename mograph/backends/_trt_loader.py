"""Finding a TensorRT Python module, and working around the plugin-library trap of the RTX wheels.

Two distributions provide the TensorRT API mograph uses (``Builder``, ``INetworkDefinition``,
``OnnxParser``, ``IBuilderConfig``, optimization profiles, ``IPluginV3``):

* ``tensorrt`` — the datacenter TensorRT (needs a GPU to build an engine);
* ``tensorrt_rtx`` — TensorRT for RTX, which also builds engines ahead of time on a machine without a
  GPU. Its networks are always strongly typed, so it has no fp16/int8 builder flags and no
  explicit-batch flag.

:func:`import_trt` returns the first one importable (``tensorrt`` first; ``MOGRAPH_TRT_MODULE`` forces
one) and raises :class:`~mograph.errors.BackendUnavailableError` naming the ``tensorrt`` extra when
neither is.

**The symlink trap.** The 1.7.1 RTX wheels ship ``libtensorrt_rtx.so.1`` only, but the library
``dlopen``\\ s ``libtensorrt_rtx.so`` when the ONNX parser reaches a node it must turn into a plugin;
when that name is not found the process aborts (``terminate called without an active exception``),
no Python exception, no message. ``dlopen`` looks beside the library (its RPATH is ``$ORIGIN``) and in
the ``LD_LIBRARY_PATH`` the process *started* with — changing ``os.environ`` later does nothing.
:func:`plugin_lib_fix` therefore makes sure the name resolves, in this order:

1. it already does: a ``libtensorrt_rtx.so`` beside the ``.so.1``, or in a folder of the
   ``LD_LIBRARY_PATH`` this process started with (read from ``/proc/self/environ``);
2. the library's folder is writable: create the symlink there (atomically), which works even after
   ``tensorrt_rtx`` was imported, because the failed lookup is not cached;
3. otherwise: create it in a per-user cache folder, and the caller runs the work in a child process
   whose ``LD_LIBRARY_PATH`` starts with that folder (:attr:`PluginLibFix.env`).

``MOGRAPH_TRT_LIB_FIX=subprocess`` skips step 2 (never touch the installation) and forces step 3 when
step 1 does not hold; ``MOGRAPH_TRT_LIB_FIX=subprocess-always`` forces the child process even when
step 1 holds (used by tests to exercise that path).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from mograph.errors import BackendUnavailableError

__all__ = [
    "MODULES",
    "PluginLibFix",
    "find_trt_module",
    "import_trt",
    "is_rtx",
    "plugin_lib_fix",
]

logger = logging.getLogger(__name__)

#: Module names tried, in order.
MODULES: tuple[str, ...] = ("tensorrt", "tensorrt_rtx")
MODULE_ENV = "MOGRAPH_TRT_MODULE"
FIX_ENV = "MOGRAPH_TRT_LIB_FIX"

_RTX_LIB = "libtensorrt_rtx.so.1"
_RTX_LINK = "libtensorrt_rtx.so"

_cached: ModuleType | None = None


def _candidates() -> tuple[str, ...]:
    forced = os.environ.get(MODULE_ENV, "").strip()
    if forced:
        return (forced,)
    return MODULES


def find_trt_module() -> str | None:
    """Name of the TensorRT module :func:`import_trt` would import, without importing it (or ``None``)."""
    for name in _candidates():
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def import_trt() -> ModuleType:
    """Import and return ``tensorrt`` or, failing that, ``tensorrt_rtx``.

    Raises:
        BackendUnavailableError: neither is importable (the message names the ``tensorrt`` extra).
    """
    global _cached
    if _cached is not None:
        return _cached
    errors = []
    for name in _candidates():
        if importlib.util.find_spec(name) is None:
            continue
        try:
            _cached = importlib.import_module(name)
        except (ImportError, OSError) as exc:  # e.g. the wheel is there but its libraries are not
            errors.append(f"{name}: {exc}")
            continue
        logger.debug("using %s %s", name, getattr(_cached, "__version__", "?"))
        return _cached
    for err in errors:
        logger.warning("TensorRT module present but not importable: %s", err)
    raise BackendUnavailableError("TensorRT (the 'tensorrt' or 'tensorrt_rtx' Python package)", "tensorrt")


def is_rtx(trt: ModuleType) -> bool:
    """Whether ``trt`` is TensorRT for RTX (strongly typed networks only, builds without a GPU)."""
    return trt.__name__.split(".")[0] == "tensorrt_rtx"


@dataclass
class PluginLibFix:
    """How the plugin-library trap is handled for this process.

    Attributes:
        in_process: plugin nodes can be parsed in this process.
        env: when not ``in_process``, environment variables for a child process that can
            (``LD_LIBRARY_PATH`` with the link's folder first).
        link: the ``libtensorrt_rtx.so`` symlink that makes it work (``None`` when not needed).
        how: one line saying what was found or done, for reports.
    """

    in_process: bool
    env: dict[str, str] = field(default_factory=dict)
    link: Path | None = None
    how: str = ""


def _rtx_lib_dir() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / _RTX_LIB).exists():
                return Path(loc)
    spec = importlib.util.find_spec("tensorrt_rtx")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            for cand in (Path(loc), Path(loc).parent / "tensorrt_rtx_libs"):
                if (cand / _RTX_LIB).exists():
                    return cand
    return None


def _startup_ld_library_path() -> list[str]:
    """The ``LD_LIBRARY_PATH`` this process started with (what ``dlopen`` uses), not today's ``os.environ``."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        raw = b""
        value = os.environ.get("LD_LIBRARY_PATH", "")
    else:
        value = ""
        for item in raw.split(b"\0"):
            if item.startswith(b"LD_LIBRARY_PATH="):
                value = item.split(b"=", 1)[1].decode(errors="replace")
    return [p for p in value.split(os.pathsep) if p]


def _resolves_to(link: Path, target: Path) -> bool:
    try:
        return link.exists() and link.resolve() == target.resolve()
    except OSError:
        return False


def _make_link(folder: Path, target: Path) -> Path:
    """Atomically create ``folder/libtensorrt_rtx.so`` -> ``target`` (relative when beside it)."""
    link = folder / _RTX_LINK
    dest = target.name if target.parent.resolve() == folder.resolve() else str(target.resolve())
    tmp = folder / f".{_RTX_LINK}.{os.getpid()}.tmp"
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    os.symlink(dest, tmp)
    os.replace(tmp, link)
    return link


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mograph" / "trt-lib-links"


def plugin_lib_fix(trt: ModuleType | None = None) -> PluginLibFix:
    """Make ``libtensorrt_rtx.so`` resolvable for plugin nodes, or say how a child process can (see module doc).

    Only TensorRT for RTX needs it; for the ``tensorrt`` module this returns ``in_process=True`` at once.
    """
    if trt is not None and not is_rtx(trt):
        return PluginLibFix(in_process=True, how="not needed (not tensorrt_rtx)")
    lib_dir = _rtx_lib_dir()
    if lib_dir is None:
        return PluginLibFix(in_process=True, how=f"{_RTX_LIB} not found in a wheel folder: nothing done")
    target = lib_dir / _RTX_LIB
    mode = os.environ.get(FIX_ENV, "auto").strip() or "auto"
    beside = lib_dir / _RTX_LINK
    found = None
    if _resolves_to(beside, target):
        found = beside
    else:
        for folder in _startup_ld_library_path():
            cand = Path(folder) / _RTX_LINK
            if _resolves_to(cand, target):
                found = cand
                break
    if found is not None and mode != "subprocess-always":
        return PluginLibFix(in_process=True, link=found, how=f"{found} already resolves to {target.name}")
    if found is None and mode == "auto" and os.access(lib_dir, os.W_OK):
        try:
            link = _make_link(lib_dir, target)
        except OSError as exc:
            logger.info("could not create %s beside %s: %s", _RTX_LINK, target, exc)
        else:
            logger.info("created %s -> %s (works around the RTX plugin-library abort)", link, target.name)
            return PluginLibFix(in_process=True, link=link, how=f"created {link} -> {target.name}")
    cache = _cache_dir() / hashlib.sha256(str(lib_dir.resolve()).encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    link = cache / _RTX_LINK
    if not _resolves_to(link, target):
        link = _make_link(cache, target)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(cache), *[p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]]
    )
    return PluginLibFix(
        in_process=False,
        env=env,
        link=link,
        how=f"child process with LD_LIBRARY_PATH={cache} ({link} -> {target})",
    )


def python_executable() -> str:
    """The interpreter to start child processes with."""
    return sys.executable
