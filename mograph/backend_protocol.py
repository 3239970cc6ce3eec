"""The backend protocol: what a runtime a model can be run, benchmarked, built or validated on must offer.

A declaration, below everything that uses it: the registry checks backends against it, the built-in
backends (:mod:`mograph.backends`) and plugins' implement it, the jobs call it.  A backend is a small
object registered through ``mograph_add_backends``, and every job that runs a model takes it from the
registry by name: ``mograph bench``, ``mograph build``, ``mograph validate`` and ``mograph diff``
(``--backend NAME``).  It must be cheap to create: registering it never imports its runtime
(onnxruntime, tensorrt), so ``import mograph`` and ``mograph --help`` work on a machine that has none
of them.

**The backend protocol** (:class:`BackendProtocol`; subclassing :class:`Backend` gives the optional
members their defaults).  Required:

* ``name`` — short, unique, used on the command line (``ort``, ``tensorrt``);
* ``make_runner(model, *, optimizations=True, threads=None, providers=None, **options) -> Runner`` —
  load ``model`` (a path, bytes, ``onnx.ModelProto`` or ``onnx_ir.Model``) and return a callable that
  maps a feed dict (input name -> numpy array) to an output dict (output name -> numpy array).  A
  backend ignores the keywords that mean nothing to it (``optimizations`` is the runtime's own graph
  optimizations: on for ``bench``, off for the reference side of ``validate`` and for ``diff``).  Raises
  :class:`~mograph.errors.BackendUnavailableError` when the runtime is missing.

Optional (what the job does without it in brackets):

* ``description`` — one line [``""``];
* ``extra`` — the pip extra (of mograph, or of the plugin) that installs its runtime [``""``];
* ``target`` — the ``--target`` the backend lowers models to: its first act on a model is
  ``mograph.lowering.lower_model(model, target, registry=registry)``, which turns each custom-op node
  (``mograph.*`` or a plugin's) into the target's form through the op's ``lowerings[target]``
  [the backend's ``name``];
* ``available() -> bool`` — whether the runtime is there, decided without importing it [``True``];
* ``why_unavailable() -> str`` — one sentence saying what is missing and how to install it, shown
  (exit code 7) when ``available()`` is false [``"backend NAME is not available"``];
* ``import_runtime()`` — import the runtime now (best effort), so that ``mograph bench`` does not
  count the import in the session's memory [nothing];
* ``build(model, path, **options) -> dict`` — write a deployable artifact (an engine) of ``model``
  to ``path`` atomically and return a JSON-serialisable report; what ``mograph build`` calls, with
  only the options the user gave (``fp16=True``, ``int8=True``, ``profiles=[...]``,
  ``workspace_mib=N``) [``mograph build --backend NAME`` is a usage error saying the backend builds
  nothing];
* ``artifact_suffix`` — the file suffix of what ``build`` writes, for ``mograph build``'s default
  output name [``".engine"``];
* ``registry`` keyword of ``make_runner`` and ``build`` — the registry of the job (its custom ops,
  for the lowering), given by the job only to a backend whose method names it or takes ``**options``
  (:func:`registry_keywords`) [not given: the backend lowers nothing and runs custom ops as their
  function bodies];
* ``devices`` — the device kinds ``make_runner(model, device=...)`` takes (``("cpu", "cuda")`` for
  ``ort``; ``"cuda:1"`` picks a GPU), which the jobs' ``--device`` passes on; a backend without it
  gets no ``device`` keyword and ``--device`` is a usage error for it [none].

A runner may also have ``bind(feeds) -> step``: copy the feeds to the device once and return a
function that runs the model on them and waits for it, the outputs staying on the device
(``runner.outputs()`` copies them back).  ``mograph bench`` times ``step()`` when ``--io-binding`` is
on (the default on CUDA), so host copies do not hide the kernels' time; without ``bind`` it times
``runner(feeds)``.

:func:`backend_problems` checks an object against the protocol (the registry refuses, naming the
plugin, a backend that lacks a required member); :func:`get_backend`, :func:`is_available`,
:func:`require_available` are how the jobs use one, so an optional member that is missing never
becomes an ``AttributeError``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from mograph.errors import BackendUnavailableError, MographError, UsageError

__all__ = [
    "Backend",
    "BackendProtocol",
    "Runner",
    "NotAvailableError",
    "backend_problems",
    "backend_target",
    "check_device",
    "get_backend",
    "is_available",
    "registry_keywords",
    "require_available",
    "why_unavailable",
]

logger = logging.getLogger(__name__)

#: What ``Backend.make_runner`` returns: feeds by input name in, outputs by output name out.
Runner = Callable[[Mapping[str, Any]], dict[str, Any]]


@runtime_checkable
class BackendProtocol(Protocol):
    """The members every backend has (the optional ones are listed in the module docstring)."""

    name: str

    def make_runner(
        self,
        model: Any,
        *,
        optimizations: bool = True,
        threads: int | None = None,
        providers: list[str] | None = None,
    ) -> Runner: ...


class NotAvailableError(BackendUnavailableError):
    """A backend cannot run here; the message is the backend's own ``why_unavailable()`` (exit code 7)."""

    def __init__(self, message: str, extra: str = "") -> None:
        MographError.__init__(self, message)
        self.extra = extra


class Backend:
    """Base of the built-in backends: the protocol's optional members with their defaults.

    ``available()`` looks for :attr:`module` without importing it; ``why_unavailable()`` names the
    pip extra; ``target`` is the backend's ``name`` unless set.  Subclasses set ``name`` and
    implement ``make_runner`` (and ``build`` when they produce an artifact).
    """

    name: str = ""
    description: str = ""
    extra: str = ""
    #: The ``--target`` models are lowered to before this backend runs them (``None``: its name).
    target: str | None = None
    #: Top-level module whose presence means the runtime is installed.
    module: str = ""

    def available(self) -> bool:
        """Whether the runtime is installed, decided without importing it."""
        if not self.module:
            return True
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def why_unavailable(self) -> str:
        """What is missing, and the pip extra that installs it."""
        what = self.module or f"the runtime of backend '{self.name}'"
        return f"{what} is not installed: pip install 'mograph[{self.extra or self.name}]'"

    def import_runtime(self) -> Any:
        """Import the runtime now, if installed (best effort; ``None`` otherwise).

        Optional in the protocol: ``mograph bench`` calls it before it starts measuring memory, so
        that importing the runtime is not counted as the session's memory.  A missing runtime is
        reported by ``make_runner``, not here.
        """
        if not self.module or not self.available():
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


def backend_problems(backend: Any) -> list[str]:
    """What keeps ``backend`` from following the protocol (``[]``: nothing)."""
    problems = []
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name:
        problems.append("it has no 'name' (a non-empty string)")
    if not callable(getattr(backend, "make_runner", None)):
        problems.append("it has no make_runner(model, ...) method")
    for member in ("available", "why_unavailable", "import_runtime", "build"):
        if hasattr(backend, member) and not callable(getattr(backend, member)):
            problems.append(f"its '{member}' is not callable")
    for member in ("target", "description", "extra"):
        value = getattr(backend, member, None)
        if value is not None and not isinstance(value, str):
            problems.append(f"its '{member}' is not a string")
    devices = getattr(backend, "devices", None)
    if devices is not None and (isinstance(devices, str) or not all(isinstance(d, str) for d in devices)):
        problems.append("its 'devices' is not a tuple of strings")
    return problems


def check_device(backend: Any, device: str | None) -> dict[str, Any]:
    """The ``make_runner`` keywords for ``--device``: ``{}`` when none was given, else ``{"device": device}``.

    Raises:
        UsageError: the backend takes no device, or not this one (its ``devices`` lists what it takes).
    """
    if device is None:
        return {}
    devices = tuple(getattr(backend, "devices", None) or ())
    if not devices:
        raise UsageError(f"--device applies to backends that run on several devices (ort); '{backend.name}' does not")
    kind = str(device).strip().lower().partition(":")[0]
    if kind not in devices:
        raise UsageError(f"backend '{backend.name}' runs on {', '.join(devices)}, not {device!r}")
    return {"device": str(device).strip().lower()}


def backend_target(backend: Any) -> str:
    """The ``--target`` a backend lowers to: its ``target``, else its ``name``."""
    return getattr(backend, "target", None) or backend.name


def is_available(backend: Any) -> bool:
    """``backend.available()``, or ``True`` for a backend that does not say."""
    check = getattr(backend, "available", None)
    return True if check is None else bool(check())


def why_unavailable(backend: Any) -> str:
    """The backend's own sentence on what is missing, or a generic one."""
    why = getattr(backend, "why_unavailable", None)
    text = why() if why is not None else None
    return str(text) if text else f"backend '{backend.name}' is not available"


def require_available(backend: Any) -> None:
    """Raise :class:`NotAvailableError` (exit code 7) with the backend's reason when it cannot run here."""
    if not is_available(backend):
        raise NotAvailableError(why_unavailable(backend), getattr(backend, "extra", "") or "")


def get_backend(backends: Mapping[str, Any], name: str, *, job: str = "run", needs_build: bool = False) -> Any:
    """The registered backend called ``name``, for ``job`` (named in errors).

    Raises:
        UsageError: no backend has that name, or ``needs_build`` and the backend has no ``build()``.
    """
    if name not in backends:
        known = ", ".join(sorted(backends)) or "none"
        raise UsageError(f"unknown backend '{name}'; available: {known}")
    backend = backends[name]
    if needs_build and not callable(getattr(backend, "build", None)):
        able = ", ".join(sorted(n for n, b in backends.items() if callable(getattr(b, "build", None)))) or "none"
        raise UsageError(f"unknown --backend '{name}' for {job}: it builds no artifact; backends that build: {able}")
    return backend


def registry_keywords(method: Any, registry: Any) -> dict[str, Any]:
    """``{"registry": registry}`` for a backend method (``make_runner``, ``build``) that takes that keyword
    (a ``registry`` parameter or ``**options``), else ``{}``: the smallest backend need not know of it."""
    if registry is None:
        return {}
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return {}
    takes = any(p.name == "registry" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return {"registry": registry} if takes else {}
