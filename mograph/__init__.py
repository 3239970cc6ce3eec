"""mograph: a plugin-based, compiler-style optimizer for ONNX models.

A model goes in; an explicit, ordered pipeline of passes rewrites it in memory (onnx-ir); it is saved
once, optionally lowered to a backend, and numerically checked against the original.

Public API (heavy optional dependencies — onnxruntime, polygraphy, tensorrt, torch — are imported only
when a function needs them)::

    import mograph
    model, report = mograph.optimize("model.onnx", passes="cleanup,fuse", verify=True)
    mograph.save(model, "model.opt.onnx")
"""

from __future__ import annotations

from mograph import errors as _errors
from mograph.api import VerifyMode, list_passes, load, optimize, run_passes, save
from mograph.custom_ops import CustomOp
from mograph.errors import *  # noqa: F403 - every error type, listed once in mograph.errors.__all__
from mograph.hookspecs import hookimpl
from mograph.pass_infra import Option, Pass, PassManager, PassResult, PipelineReport, stamp

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "optimize",
    "run_passes",
    "list_passes",
    "load",
    "save",
    "VerifyMode",
    "Pass",
    "PassResult",
    "PassManager",
    "PipelineReport",
    "Option",
    "stamp",
    "CustomOp",
    "hookimpl",
    *_errors.__all__,  # every error type, as mograph.errors lists them
]
