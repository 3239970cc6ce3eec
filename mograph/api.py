"""The Python API: the same jobs as the command line, for export pipelines and notebooks.

::

    import mograph
    model, report = mograph.optimize("bert.onnx", passes=["cleanup", "fuse"], verify=True)
    mograph.save(model, "bert.opt.onnx")

Every function accepts a model in any form :func:`mograph.load` accepts and returns the optimized
model in the same form it was given (a path gives an ``onnx_ir.Model``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import onnx_ir as ir

from mograph import ir_io
from mograph.errors import OptionError, UsageError, VerificationError
from mograph.hookspecs import hookimpl
from mograph.pass_infra import Pass, PassManager, PassResult, PipelineReport
from mograph.plugins import get_registry

__all__ = ["optimize", "run_passes", "list_passes", "load", "save", "VerifyMode"]

logger = logging.getLogger(__name__)

VerifyMode = Literal["end", "each"]


def load(source: ir_io.ModelSource, *, base_dir: str | None = None) -> ir.Model:
    """Load a model from a path, bytes, ``onnx.ModelProto``, ``onnx_ir.Model`` or graphsurgeon graph.

    External data must lie inside the model's folder; bytes and protos have none, so their external data
    is read from ``base_dir`` (and refused without it).
    """
    return ir_io.load_model(source, base_dir=base_dir)


def save(model: ir.Model, path: str, *, external_data: bool | None = None, overwrite: bool = False) -> None:
    """Save a model atomically (external data beside it when needed or asked).

    Writing over the file the model was loaded from is refused unless ``overwrite`` is true.
    """
    ir_io.save_model(
        ir_io.load_model(model, check=False), path, external_data=external_data, overwrite_source=overwrite
    )


def list_passes(*, blocked: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Every available pass: name, family, one-line doc, plugin it comes from, options."""
    reg = get_registry(blocked)
    out = []
    for name in sorted(reg.passes):
        pcls = reg.passes[name]
        out.append(
            {
                "name": name,
                "family": pcls.family,
                "summary": pcls.summary(),
                "plugin": reg.pass_source[name],
                "options": [
                    {"name": o.name, "default": o.default, "help": o.help, "multiple": o.multiple}
                    for o in pcls.options
                ],
            }
        )
    return out


class _VerifyEach:
    """Wrapper plugin: check the model numerically after every pass; name the first that drifts."""

    def __init__(self, verifier: Any) -> None:
        self.verifier = verifier

    @hookimpl(wrapper=True)
    def mograph_run_pass(self, pass_: Pass, model: ir.Model, context: dict[str, Any]):  # type: ignore[no-untyped-def]
        result: PassResult = yield
        if result.modified:
            check = self.verifier.check(model, family=pass_.family)
            context["last_check"] = check
            if not check["passed"]:
                raise VerificationError(
                    f"outputs drift after pass '{pass_.name}' (the first pass to drift): "
                    + self.verifier.describe_failure(check),
                    report=check,
                )
        return result


def _verifier(original: ir.Model, verify_options: dict[str, Any]) -> Any:
    from mograph.validate import Verifier

    return Verifier(original, **verify_options)


def run_passes(
    model: ir.Model,
    passes: Sequence[Pass],
    *,
    verify: VerifyMode | bool | None = None,
    verify_options: dict[str, Any] | None = None,
    check_modified: bool = False,
    blocked: Iterable[str] = (),
) -> PipelineReport:
    """Run already-built pass instances on an ``onnx_ir.Model`` in place; return the report."""
    reg = get_registry(blocked)
    mode: str | None = "end" if verify is True else (verify or None)
    if mode not in (None, "end", "each"):
        raise UsageError(f"verify must be 'end', 'each', True or None, not {verify!r}")
    report = PipelineReport()
    verifier = _verifier(model, verify_options or {}) if mode else None
    instrument = _VerifyEach(verifier) if mode == "each" else None
    if instrument is not None:
        reg.pm.register(instrument, name="mograph.verify-each")
    try:
        PassManager(list(passes), hook=reg.pm.hook, check_modified=check_modified).run(model, report)
    finally:
        if instrument is not None:
            reg.pm.unregister(instrument)
    if verifier is not None:
        families = {p.family for p in passes}
        check = verifier.check(model, family=families)
        report.verification = check
        if not check["passed"]:
            raise VerificationError(
                "optimized model's outputs differ from the original's: " + verifier.describe_failure(check),
                report=check,
            )
    return report


def optimize(
    model: ir_io.ModelSource,
    passes: Sequence[str] | str = ("cleanup",),
    *,
    options: dict[str, Any] | None = None,
    verify: VerifyMode | bool | None = None,
    verify_options: dict[str, Any] | None = None,
    check_modified: bool = False,
    blocked: Iterable[str] = (),
) -> tuple[Any, PipelineReport]:
    """Run a pipeline of passes; return ``(optimized_model, report)``.

    Args:
        model: path, bytes, ``onnx.ModelProto``, ``onnx_ir.Model`` (rewritten in place) or an
            ``onnx_graphsurgeon.Graph``.
        passes: pass and preset names, in order (``["cleanup", "fuse"]`` or ``"cleanup,fuse"``).
        options: pass options by name (``{"target": "ort", "fold_limit": 1024}``); each pass takes
            the ones it declares. Unknown names are an error.
        verify: ``True``/``"end"`` to compare the final model's outputs with the original's,
            ``"each"`` to check after every pass and name the first that drifts. A failed check
            raises :class:`mograph.VerificationError`.
        verify_options: ``shapes`` (``{"input_ids": (1, 128)}``), ``feeds`` (path to ``.npz``),
            ``seed``, ``atol``/``rtol``/``min_cosine`` overrides.
        check_modified: debug mode: fail a pass that reports "unchanged" but changed the graph.
        blocked: plugin names not to load.

    Returns:
        The optimized model in the form given (a path gives an ``onnx_ir.Model``) and the report.
    """
    reg = get_registry(blocked)
    names = reg.expand(passes if isinstance(passes, str) else list(passes))
    options = dict(options or {})
    declared = reg.all_options()
    unknown = [k for k in options if k.replace("-", "_") not in declared]
    if unknown:
        raise OptionError(f"unknown option(s) {unknown}; `mograph passes --json` lists each pass's options")
    options = {k.replace("-", "_"): v for k, v in options.items()}
    instances = reg.instantiate(names, options)
    ir_model = ir_io.load_model(model)
    report = run_passes(
        ir_model,
        instances,
        verify=verify,
        verify_options=verify_options,
        check_modified=check_modified,
        blocked=blocked,
    )
    return ir_io.to_format(ir_model, model), report
