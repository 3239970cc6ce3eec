"""Error types of mograph.

Everything a user can cause — a bad model, a bad option, an unknown pass, a pass that failed, a
plugin that broke, a backend that is not installed, numbers that drift — raises a subclass of
:class:`MographError`.  The CLI turns these into one clear line and a non-zero exit code; anything
else that escapes is an internal bug and is shown with its traceback.

A bug inside a pass — any exception that is not a :class:`MographError`, or a pass that breaks the
pass contract (a wrong return type, ``modified=False`` for a changed graph) — is an
:class:`InternalError` naming the pass, with the original exception as its ``__cause__``.  It is a
:class:`MographError` too, so a caller needs one ``except`` clause for everything mograph raises; the CLI
still tells it apart (exit code 1, the traceback at ``-v``, "please report it").  A pass that cannot do its job on a valid model reports that itself by
raising :class:`PassFailedError` (exit 4).

Exit codes (also documented in ``mograph --help``):

====  =========================================================
 0    success
 1    internal error (a bug in mograph or a plugin: please report)
 2    usage error: bad command line, unknown pass, bad option value
 3    the input model could not be loaded or is invalid
 4    a pass failed
 5    numeric verification failed (outputs drifted past tolerance)
 6    a plugin failed to load or misbehaved
 7    an optional dependency (backend) is missing
====  =========================================================
"""

from __future__ import annotations

__all__ = [
    "MographError",
    "UsageError",
    "UnknownPassError",
    "OptionError",
    "ModelError",
    "PassFailedError",
    "VerificationError",
    "PluginError",
    "BackendUnavailableError",
    "InternalError",
]


class MographError(Exception):
    """Base of every error a user can cause. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class UsageError(MographError):
    """The request itself is malformed (command line, API arguments)."""

    exit_code = 2


class UnknownPassError(UsageError):
    """A pass or preset name that no plugin provides."""


class OptionError(UsageError):
    """A pass option has a bad value or is unknown."""


class ModelError(MographError):
    """The model cannot be loaded, is not ONNX, is truncated, or is structurally invalid."""

    exit_code = 3


class PassFailedError(MographError):
    """A pass could not do its job on this model and said so. The message names the pass.

    Raised by a pass itself (a refusal it explains), never for a crash: see :class:`InternalError`.
    """

    exit_code = 4

    def __init__(self, pass_name: str, message: str) -> None:
        super().__init__(f"pass '{pass_name}' failed: {message}")
        self.pass_name = pass_name


class VerificationError(MographError):
    """The optimized model's outputs differ from the original's by more than the tolerance."""

    exit_code = 5

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message)
        self.report = report
        #: Set by :func:`mograph.api.optimize`: the model that failed (in the form given) and the
        #: pipeline report so far, so a caller can keep them for inspection.
        self.model: object | None = None
        self.pipeline_report: object | None = None


class PluginError(MographError):
    """A plugin failed to load, registered something invalid, or clashed with another plugin."""

    exit_code = 6


class BackendUnavailableError(MographError):
    """An optional dependency is missing. The message names the pip extra that installs it."""

    exit_code = 7

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(f"{what} is not installed: pip install 'mograph[{extra}]'")
        self.extra = extra


class InternalError(MographError):
    """A bug: a pass crashed with a non-mograph exception or broke the pass contract.

    A :class:`MographError` (one ``except`` catches everything mograph raises) with exit code 1; code that
    must tell a bug from a user's mistake catches it first.  ``pass_name`` names the pass;
    ``__cause__`` is the original exception, if there was one.
    """

    exit_code = 1

    def __init__(self, pass_name: str, message: str, plugin: str | None = None) -> None:
        where = f" of {plugin}" if plugin else ""
        super().__init__(f"internal error in pass '{pass_name}'{where}: {message}")
        self.pass_name = pass_name
        self.detail = message
        #: Which third-party plugin provides the pass (``plugin 'x' (distribution d 1.0)``), when one does.
        self.plugin = plugin
