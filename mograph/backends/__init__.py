"""Built-in plugin ``mograph.backends``: the runtimes a model can be run, benchmarked or validated on.

A backend is a small object registered through ``mograph_add_backends``, exactly like a third-party
one.  It must be cheap to create: registering it never imports its runtime (onnxruntime, tensorrt),
so ``import mograph`` and ``mograph --help`` work on a machine that has none of them.
:meth:`Backend.available` answers "is the runtime installed?" from package metadata only
(``importlib.util.find_spec``); the runtime is imported when a session is first made.

The protocol a backend object follows (duck-typed; subclassing :class:`Backend` documents it):

* ``name`` — short, unique, used on the command line (``ort``, ``tensorrt``);
* ``description`` — one line;
* ``extra`` — the pip extra that installs its runtime (``pip install 'mograph[ort]'``);
* ``available() -> bool`` — whether the runtime can be imported, without importing it;
* ``import_runtime()`` (optional) — import the runtime now (best effort), so that ``mograph bench``
  does not count the import in the session's memory;
* ``make_runner(model, *, optimizations=True, threads=None, providers=None) -> Runner`` — load
  ``model`` (a path, bytes, ``onnx.ModelProto`` or ``onnx_ir.Model``) and return a callable that
  maps a feed dict to an output dict; raises :class:`~mograph.errors.BackendUnavailableError`
  when the runtime is missing.

Built-in backends are listed, by module, in :data:`BUILTIN_BACKEND_MODULES`; each module exposes a
``BACKEND`` object.  A listed module that is not present in this installation is skipped, so a new
backend is added by writing its module and naming it here.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mograph.hookspecs import hookimpl

__all__ = ["Backend", "Runner", "BUILTIN_BACKEND_MODULES", "builtin_backends", "mograph_add_backends"]

logger = logging.getLogger(__name__)

#: Modules of the built-in backends, each exposing ``BACKEND``; a missing module is skipped.
BUILTIN_BACKEND_MODULES: tuple[str, ...] = (
    "mograph.backends.ort",
    "mograph.backends.tensorrt",
)

#: What ``Backend.make_runner`` returns: feeds by input name in, outputs by output name out.
Runner = Callable[[Mapping[str, Any]], dict[str, Any]]


class Backend:
    """Base of the built-in backends; documents the duck-typed backend protocol."""

    name: str = ""
    description: str = ""
    extra: str = ""
    #: Top-level module whose presence means the runtime is installed.
    module: str = ""

    def available(self) -> bool:
        """Whether the runtime is installed, decided without importing it."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def import_runtime(self) -> Any:
        """Import the runtime now, if installed (best effort; ``None`` otherwise).

        Optional in the protocol: ``mograph bench`` calls it before it starts measuring memory, so
        that importing the runtime is not counted as the session's memory.  A missing runtime is
        reported by ``make_runner``, not here.
        """
        if not self.available():
            return None
        try:
            return importlib.import_module(self.module)
        except ImportError:
            return None

    def make_runner(
        self,
        model: Any,
        *,
        optimizations: bool = True,
        threads: int | None = None,
        providers: list[str] | None = None,
    ) -> Runner:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}: {'available' if self.available() else 'not installed'}>"


def builtin_backends() -> list[Any]:
    """The ``BACKEND`` object of every built-in backend module present in this installation."""
    out = []
    for modname in BUILTIN_BACKEND_MODULES:
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:
                logger.debug("built-in backend module %s is not present", modname)
                continue
            raise
        out.append(module.BACKEND)
    return out


@hookimpl
def mograph_add_backends() -> list[Any]:
    return builtin_backends()
