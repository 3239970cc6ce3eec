"""The Python API: the same jobs as the command line, for export pipelines and notebooks.

::

    import mograph
    model, report = mograph.optimize("bert.onnx", passes=["cleanup", "fuse"], verify=True)
    mograph.save(model, "bert.opt.onnx")

Every function accepts a model in any form :func:`mograph.load` accepts and returns the optimized
model in the same form it was given (a path gives an ``onnx_ir.Model``).
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar, cast

import onnx_ir as ir

from mograph import ir_io
from mograph.errors import InternalError, OptionError, PassFailedError, UsageError, VerificationError
from mograph.hookspecs import hookimpl
from mograph.pass_infra import Instrument, Pass, PassManager, PassResult, PipelineReport
from mograph.plugins import Registry, describe_plugin, get_registry

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
    """Instrument: check the model numerically after every pass; name the first that drifts."""

    def __init__(self, verifier: Any) -> None:
        self.verifier = verifier

    @hookimpl(wrapper=True)
    def mograph_run_pass(self, pass_: Pass, model: ir.Model, context: dict[str, Any]):  # type: ignore[no-untyped-def]
        result: PassResult = yield
        if result.modified:
            start = time.perf_counter()
            try:
                check = self.verifier.check(model, family=pass_.family)
            finally:  # the pass manager takes the check's time out of the pass's
                context["last_check_seconds"] = time.perf_counter() - start
            context["last_check"] = check
            if not check["passed"]:
                raise VerificationError(
                    f"outputs drift after pass '{pass_.name}' (the first pass to drift): "
                    + self.verifier.describe_failure(check),
                    report=check,
                )
        return result


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _verifier(original: ir.Model, verify_options: dict[str, Any], registry: Registry) -> Any:
    from mograph.validate import Verifier

    known = [k for k in inspect.signature(Verifier.__init__).parameters if k not in ("self", "original", "registry")]
    for key in verify_options:
        if key not in known:
            raise OptionError(
                f"unknown verify option {key!r}{_did_you_mean(key, known)}; known: {', '.join(sorted(known))}"
            )
    return Verifier(original, registry=registry, **verify_options)


def run_passes(
    model: ir.Model,
    passes: Sequence[Pass],
    *,
    verify: VerifyMode | bool | None = None,
    verify_options: dict[str, Any] | None = None,
    check_modified: bool = False,
    blocked: Iterable[str] = (),
    instruments: Sequence[Instrument] = (),
    check_output: bool = True,
) -> PipelineReport:
    """Run already-built pass instances on an ``onnx_ir.Model`` in place; return the report.

    ``instruments`` wrap every pass of this run only (see :func:`optimize`); the per-pass check of
    ``verify="each"`` is one of them, innermost.  Nothing is registered on the plugin manager.
    With ``check_output`` (the default) the result must pass :mod:`mograph.output_check` (ONNX
    checker, and a load in ONNX Runtime where it can run); a model that fails is a
    :class:`~mograph.errors.PassFailedError` naming the first pass whose output fails and the node.
    """
    with _frozen_heap():
        return _run_passes(model, passes, verify, verify_options, check_modified, blocked, instruments, check_output)


_T = TypeVar("_T")

#: Makes a fresh copy of a pipeline's input, for the output check's bisection (:func:`_check_output`).
Reload = Callable[[], "ir.Model | None"]


@contextlib.contextmanager
def _frozen_heap(load: Callable[[], _T] | None = None) -> Iterator[_T | None]:
    """Keep the objects alive when the pipeline starts (the loaded model: millions of objects on a
    100k-node graph) out of the garbage collector's full collections while it runs.

    ``load`` (a model's load, for :func:`optimize`) runs first with the collector off and its result is
    what the block gets: the objects it makes are frozen without any collection walking them (once the
    collector is back on, the first young collection would otherwise walk them all).

    Every full collection walks every tracked object, and a pipeline triggers a few per pass, so on a
    large graph the collector's time grew faster than the graph (a fifth of the CPU time at 100k
    nodes).  Those objects are still freed by reference counting as usual; only reference cycles among
    them wait for the end of the pipeline (``gc.unfreeze``).  Nothing is frozen when the process has
    frozen objects of its own (``gc.get_freeze_count()``), which stay as they are.

    The objects the passes make still trigger collections: with the default first threshold (700
    allocations) a 100k-node pipeline ran 13k young and 34 full collections (11 of its 66 CPU-seconds).
    While it runs, the thresholds are raised to ``_PIPELINE_GC_THRESHOLD`` (same peak memory on that
    graph, 1.40 GB; 55 CPU-s) and put back after; large dropped copies are still collected on purpose
    (:func:`mograph._spill.free_dropped`).  The middle generation's threshold is raised too: what survives
    a young collection in a pipeline is mostly the graph being rebuilt, which lives to the end, and each
    middle collection walked it again for little (100k nodes: 5 of them, 0.6 CPU-s, found 7,946 objects
    out of the 360k the young ones found; at 10k nodes there were none).
    """
    old = gc.get_threshold()
    raise_threshold = old[0] and old[0] < _PIPELINE_GC_THRESHOLD[0]  # 0: the caller turned collection off
    if raise_threshold:
        gc.set_threshold(*_PIPELINE_GC_THRESHOLD)
    try:
        if gc.get_freeze_count():
            yield load() if load is not None else None
            return
        loaded = None
        with ir_io.collection_paused():
            if load is not None:
                loaded = load()
            gc.freeze()
        try:
            yield loaded
        finally:
            gc.unfreeze()
    finally:
        if raise_threshold:
            gc.set_threshold(*old)


#: The collector's thresholds while a pipeline runs (see :func:`_frozen_heap`).
_PIPELINE_GC_THRESHOLD = (50_000, 200, 20)


def _run_passes(
    model: ir.Model,
    passes: Sequence[Pass],
    verify: VerifyMode | bool | None,
    verify_options: dict[str, Any] | None,
    check_modified: bool,
    blocked: Iterable[str],
    instruments: Sequence[Instrument],
    check_output: bool,
    reload: Reload | None = None,
) -> PipelineReport:
    """:func:`run_passes`; ``reload`` makes a copy of the input again (a model read from a file is read
    again) only if the output check fails, in place of a copy made up front (:func:`_snapshot`: on a
    100k-node graph 4 CPU-seconds and the memory of a second graph, for a check that passes)."""
    reg = get_registry(blocked)
    if check_output and passes and reload is None:
        snapshot = _snapshot(model)
        reload = lambda: snapshot  # noqa: E731
    check_output = check_output and bool(passes)
    mode: str | None = "end" if verify is True else (verify or None)
    if mode not in (None, "end", "each"):
        raise UsageError(f"verify must be 'end', 'each', True or None, not {verify!r}")
    report = PipelineReport()
    for pass_ in passes:  # a pass made by hand gets what the plugins declared from here, the composition root
        if pass_.registry is None:
            pass_.registry = reg
    verifier = _verifier(model, verify_options or {}, reg) if mode else None
    wrappers = list(instruments)
    if mode == "each":
        wrappers.append(_VerifyEach(verifier))
    try:
        try:
            PassManager(list(passes), hook=reg.pm.hook, check_modified=check_modified, instruments=wrappers,
                        sources=reg.pass_source).run(model, report)
        except InternalError as exc:  # a third-party pass crashed: say whose it is, so the bug goes to them
            source = reg.pass_source.get(exc.pass_name)
            owner = describe_plugin(source) if source and exc.plugin is None else None
            if owner is None:
                raise
            raise InternalError(exc.pass_name, exc.detail, plugin=owner) from (exc.__cause__ or exc)
    except VerificationError as exc:  # --verify each: the report so far goes with the error
        report.verification = exc.report if isinstance(exc.report, dict) else None
        exc.pipeline_report = report
        raise
    if check_output:
        report.extra["output_check"] = _check_output(model, reload, list(passes), report, reg.pm.hook)
    if verifier is not None:
        families = {p.family for p in passes}
        check = verifier.check(model, family=families)
        report.verification = check
        if not check["passed"]:
            error = VerificationError(
                "optimized model's outputs differ from the original's: " + verifier.describe_failure(check),
                report=check,
            )
            error.pipeline_report = report
            raise error
    return report


def _snapshot(model: ir.Model) -> ir.Model | None:
    """A copy of ``model`` that passes run on ``model`` cannot change; tensors are shared (nothing is copied).

    ``Model.clone`` shares each value's type object, and passes retype values in place
    (``value.dtype = ...``), so types and shapes get copies of their own.  Where ``Model.clone`` cannot
    copy the graph (a branch that outputs an outer value), the copy is a serialized round trip (tensors
    in memory are copied then); ``None`` if that fails too, and a failed check then names the last pass
    that changed the model.
    """
    import copy

    try:
        clone = model.clone()
    except Exception as exc:  # noqa: BLE001 - onnx_ir's cloner refuses some graphs
        logger.debug("output check: Model.clone failed (%s); copying through a serialized model", exc)
        try:
            return ir_io.copy_model(model)
        except Exception as exc2:  # noqa: BLE001
            logger.debug("output check: no copy of the input to bisect with (%s)", exc2)
            return None
    for graph in clone.graphs():
        values = [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]
        for v in values:
            if v.type is not None:
                v.type = copy.copy(v.type)
            if v.shape is not None:
                v.shape = v.shape.copy()
    return clone


def _check_output(
    model: ir.Model, reload: Reload | None, passes: list[Pass], report: PipelineReport, hook: Any
) -> dict[str, str]:
    """Check the pipeline's output; on failure find the first pass whose output fails and raise.

    Only a failure costs more than one check: the passes are run again on the untouched copy of the
    input, checking after each pass that changed something.  An input that fails the check itself
    is not blamed on a pass: the result is reported as such and logged.
    """
    from mograph.output_check import InvalidModel, check_model_output

    try:
        return check_model_output(model)
    except InvalidModel as final:
        failure = final
    last = next((r.name for r in reversed(report.passes) if r.modified), report.passes[-1].name)
    blamed, reason = last, failure
    pristine = None
    if reload is not None:
        try:
            pristine = reload()
        except Exception as exc:  # noqa: BLE001 - without a copy the last pass that changed the model is blamed
            logger.debug("output check: no copy of the input to bisect with (%s)", exc)
    if pristine is None:
        raise PassFailedError(blamed, f"wrote a model that does not load: {reason}") from failure
    try:
        check_model_output(pristine)
    except InvalidModel as exc:
        logger.warning("the input model already fails the output check (%s); not blamed on a pass", exc)
        return {"result": f"the input model already fails: {exc}"}
    try:
        for p in passes:
            step = PassManager([p], hook=hook).run(pristine)
            if not step.passes[-1].modified:
                continue
            try:
                check_model_output(pristine)
            except InvalidModel as exc:
                blamed, reason = p.name, exc
                break
    except Exception as exc:  # noqa: BLE001 - a replay that fails differently still blames the last pass
        logger.debug("output check: replay of the pipeline failed (%s); blaming the last pass", exc)
    raise PassFailedError(blamed, f"wrote a model that does not load: {reason}") from failure


def optimize(
    model: ir_io.ModelSource,
    passes: Sequence[str] | str = ("cleanup",),
    *,
    options: dict[str, Any] | None = None,
    verify: VerifyMode | bool | None = None,
    verify_options: dict[str, Any] | None = None,
    check_modified: bool = False,
    blocked: Iterable[str] = (),
    instruments: Sequence[Instrument] = (),
    check_output: bool = True,
    device: str | None = None,
    strict: bool = False,
) -> tuple[Any, PipelineReport]:
    """Run a pipeline of passes; return ``(optimized_model, report)``.

    Args:
        model: path, bytes, ``onnx.ModelProto``, ``onnx_ir.Model`` (rewritten in place) or an
            ``onnx_graphsurgeon.Graph``.
        passes: pass and preset names, in order (``["cleanup", "fuse"]`` or ``"cleanup,fuse"``); the
            ``lower`` step is appended when a pass writes fused ops or ``target`` is given
            (:meth:`mograph.plugins.Registry.plan`), and the report lists it like any pass.
        options: pass options by name (``{"target": "ort", "fold_limit": 1024}``); each pass takes
            the ones it declares. Unknown names are an error (with a did-you-mean); a known option
            that no pass of the pipeline reads is a warning (an error with ``strict``).
        verify: ``True``/``"end"`` to compare the final model's outputs with the original's,
            ``"each"`` to check after every pass and name the first that drifts. A failed check
            raises :class:`mograph.VerificationError`; its ``model`` is the model that failed (after
            the drifting pass for ``"each"``) and ``pipeline_report`` the report so far.
        verify_options: ``shapes`` (``{"input_ids": (1, 128)}``), ``feeds`` (path to ``.npz``),
            ``seed``, ``atol``/``rtol``/``min_cosine`` overrides, ``device`` (``"cuda"``: check both
            models on ONNX Runtime's CUDA provider; see :class:`mograph.validate.Verifier`).
        check_modified: debug mode: fail a pass that reports "unchanged" but changed the graph.
        blocked: plugin names not to load.
        instruments: wrappers around every pass of this run only — progress display, timing, dumps.
            Each is an object with a ``mograph_run_pass(pass_, model, context)`` generator method
            (the same wrapper a plugin writes for the :func:`~mograph.hookspecs.mograph_run_pass`
            hook), or such a generator function; the first is outermost.  Unlike a plugin, an
            instrument is never registered on the process-wide plugin manager, so two runs (or
            threads) never see each other's instruments::

                def progress(pass_, model, context):
                    print("running", pass_.name)
                    result = yield
                    return result

                mograph.optimize("m.onnx", "cleanup", instruments=[progress])
        check_output: check the result with the ONNX checker and an ONNX Runtime load (see
            :mod:`mograph.output_check`); ``False`` skips it (a failed check is a pass error).
        device: where the model will run (``"cpu"``, ``"cuda"``, ``"cuda:N"``; the CLI's ``--device``): the
            plugins' precision recipes rewrite the pipeline for it before it is expanded (``int4`` on
            ``cuda``: weight-only ``MatMulNBits`` then ``fp16``, target ``ort``; see
            :mod:`mograph.passes.quant.recipe`); the report records the decisions under ``recipe``,
            and a precision measured slower on that device is a warning there.  ``None``: the
            pipeline is exactly ``passes``.  It does not say where ``verify`` runs
            (``verify_options["device"]`` does).
        strict: an option that no pass of the pipeline reads is an :class:`~mograph.errors.OptionError`
            (exit 2) instead of a logged warning.

    Returns:
        The optimized model in the form given (a path gives an ``onnx_ir.Model``) and the report.
    """
    reg = get_registry(blocked)
    options = dict(options or {})
    declared = reg.all_options()
    for key in options:
        if key.replace("-", "_") not in declared:
            raise OptionError(
                f"unknown option {key!r}{_did_you_mean(key.replace('-', '_'), declared)}; "
                "`mograph passes --json` lists each pass's options"
            )
    options = {k.replace("-", "_"): v for k, v in options.items()}
    given, options, recipe = reg.recipe(passes if isinstance(passes, str) else list(passes), options, device)
    names = reg.plan(given, options)
    # The passes' output files (--precision-plan-out) against the model and what the passes read, before any work.
    from mograph._paths import check_io, model_files, option_io

    writes, reads = option_io(declared, options)
    if isinstance(model, (str, os.PathLike)):
        files = model_files(model)
        reads = [*(("the input model", f) for f in files[:1]), *(("the input model's external data", f) for f in files[1:]), *reads]
    check_io(writes, reads)
    unread = reg.unread_options(names, options)
    if unread:
        what = "; ".join(
            f"{k!r} (read by {', '.join(v)})" if v else repr(k) for k, v in unread.items()
        )
        message = f"option(s) that no pass of the pipeline {names} reads: {what}"
        if strict:
            raise OptionError(message)
        logger.warning("%s; ignored", message)
    instances = reg.instantiate(names, options)
    if verify:
        from mograph.validate._feeds import decoder_assumptions

        assumed = decoder_assumptions(options)
        if assumed and "assumptions" not in (verify_options or {}):
            verify_options = {**(verify_options or {}), "assumptions": assumed}
    reload: Reload | None = None
    if isinstance(model, (str, os.PathLike, bytes, bytearray)):  # not rewritten in place: read it again
        source = model
        reload = lambda: ir_io.load_model(source)  # noqa: E731
    try:
        with _frozen_heap(lambda: ir_io.load_model(model)) as loaded:
            ir_model = cast(ir.Model, loaded)
            report = _run_passes(ir_model, instances, verify, verify_options, check_modified, blocked, instruments,
                                 check_output, reload)
    except VerificationError as exc:  # the failed model goes with the error, for inspection
        exc.model = ir_io.to_format(ir_model, model)
        if recipe is not None and isinstance(exc.pipeline_report, PipelineReport):
            exc.pipeline_report.extra["recipe"] = recipe
        raise
    if recipe is not None:
        report.extra["recipe"] = recipe
        for line in recipe.get("warnings", []):
            logger.warning("%s", line)
    return ir_io.to_format(ir_model, model), report
