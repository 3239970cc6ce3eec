"""Built-in plugin ``mograph.backends``: the built-in backends (``ort``, ``tensorrt``), registered through
``mograph_add_backends`` exactly like a third-party one.

The protocol they follow, and the helpers the jobs use to call any backend, are declarations of the
core (:mod:`mograph.backend_protocol`), re-exported here for backend authors.

Built-in backends are listed, by module, in :data:`BUILTIN_BACKEND_MODULES`; each module exposes a
``BACKEND`` object.  A listed module that is not present in this installation is skipped, so a new
backend is added by writing its module and naming it here.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from mograph.backend_protocol import (
    Backend,
    BackendProtocol,
    NotAvailableError,
    Runner,
    backend_problems,
    backend_target,
    check_device,
    get_backend,
    is_available,
    registry_keywords,
    require_available,
    why_unavailable,
)
from mograph.hookspecs import hookimpl

__all__ = [
    "Backend",
    "BackendProtocol",
    "Runner",
    "NotAvailableError",
    "BUILTIN_BACKEND_MODULES",
    "backend_problems",
    "backend_target",
    "builtin_backends",
    "check_device",
    "get_backend",
    "is_available",
    "registry_keywords",
    "require_available",
    "why_unavailable",
    "mograph_add_backends",
]

logger = logging.getLogger(__name__)

#: Modules of the built-in backends, each exposing ``BACKEND``; a missing module is skipped.
BUILTIN_BACKEND_MODULES: tuple[str, ...] = (
    "mograph.backends.ort",
    "mograph.backends.tensorrt",
)


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
