"""Passes, their results, and the manager that runs an explicit ordered list of them.

A pass is a small class: a stable kebab-case ``name``, a docstring whose first line is shown by
``mograph passes``, a ``family`` (``cleanup``, ``fusion``, ``shape``, ``quant``, ``prune``) that
selects numeric tolerances, declared :class:`Option` s with defaults, and a :meth:`Pass.call` that
rewrites an ``onnx_ir.Model`` in place and returns a :class:`PassResult`.

``PassResult.modified`` must be true exactly when the graph changed.  ``PassManager(check_modified=
True)`` enforces this (MLIR-style): it fingerprints the graph around each pass and fails a pass that
reports "unchanged" but changed something.

Cross-cutting work — timing, node counts, provenance stamping, dumping, numeric checks — happens
here or in plugins implementing the ``mograph_run_pass`` wrapper hook, never inside passes.

Options are shared by name across passes: ``--target`` means the same to every fusion pass.  The CLI
turns every option declared by any registered pass into a ``--flag``; a pass reads only the ones it
declares.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import logging
import numbers
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import onnx_ir as ir

from mograph._traverse import iter_nodes
from mograph.errors import InternalError, ModelError, MographError, OptionError, PassFailedError, PluginError
from mograph.irutil import unshadow_value_names

if TYPE_CHECKING:
    from mograph.custom_ops import Declarations

__all__ = [
    "Option",
    "Candidate",
    "Pass",
    "PassResult",
    "PassReport",
    "PipelineReport",
    "PassManager",
    "Instrument",
    "run_instrumented",
    "PROVENANCE_PASS",
    "PROVENANCE_RULE",
    "stamp",
    "graph_fingerprint",
    "call_pass",
]

logger = logging.getLogger(__name__)

from mograph.metadata import PROVENANCE_PASS, PROVENANCE_RULE  # noqa: E402 - keys put on every node a pass creates


@dataclass(frozen=True)
class Option:
    """One documented option of a pass.

    Attributes:
        name: kebab-case; becomes ``--name`` on the command line and ``name`` (with ``_`` for
            ``-``) as a Python keyword.
        type: converts a command-line string to the value (``int``, ``float``, ``str`` or any
            callable raising ``ValueError`` on bad input).
        default: used when the user gives nothing.
        help: one line shown in ``--help``.
        multiple: the option may be repeated; the value is a list.
        choices: allowed values, if limited.
        metavar: placeholder shown in ``--help``.
        io: ``"read"`` when the value names a file (or folder, or ``file.py:function``) the pass reads,
            ``"write"`` when it names a file the pass writes; the command checks every such path against
            the others before any work (:func:`mograph._paths.check_io`).  ``None``: not a path.
    """

    name: str
    type: Callable[[str], Any] = str
    default: Any = None
    help: str = ""
    multiple: bool = False
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    io: str | None = None

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    def convert(self, raw: Any, pass_name: str, *, given: bool = True) -> Any:
        """The value of this option from ``raw``, converted and checked.

        A value given from Python goes through the same converter and checks as the command line's
        string: ``{"ratio": 1.5}`` is refused exactly like ``--ratio 1.5``.  A converter that only
        takes strings gets ``str(value)`` for a number or a bool.  ``given=False`` (the pass's own
        default) skips custom converters: a default is already a value.
        """
        if self.multiple:
            items = raw if isinstance(raw, (list, tuple)) else [raw]
            return [self._one(v, pass_name, given) for v in items]
        return self._one(raw, pass_name, given)

    def _bad(self, pass_name: str, raw: Any, exc: Exception) -> OptionError:
        return OptionError(f"{pass_name}: bad value for --{self.name}: {raw!r} ({exc})")

    def _one(self, raw: Any, pass_name: str, given: bool = True) -> Any:
        if isinstance(raw, str) and self.type is not str:
            try:
                value = self.type(raw)
            except (ValueError, TypeError) as exc:
                raise self._bad(pass_name, raw, exc) from exc
        elif given and self.type not in (str, int, float):
            value = self._custom(raw, pass_name)
        elif self.type in (int, float):
            if not _is_number(raw, integral=self.type is int):
                raise OptionError(f"{pass_name}: bad value for --{self.name}: {raw!r} (expected {self.type.__name__})")
            value = self.type(raw)
        else:
            value = raw
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise OptionError(f"{pass_name}: --{self.name} must be one of {allowed}, not {value!r}")
        return value


    def _custom(self, raw: Any, pass_name: str) -> Any:
        """A non-string value through a custom converter, as the command line would give it."""
        try:
            return self.type(raw)
        except ValueError as exc:
            raise self._bad(pass_name, raw, exc) from exc
        except (TypeError, AttributeError) as exc:  # the converter reads strings only
            if not isinstance(raw, (bool, numbers.Number)):
                raise self._bad(pass_name, raw, exc) from exc
        try:
            return self.type(str(raw))
        except (ValueError, TypeError, AttributeError) as exc:
            raise self._bad(pass_name, raw, exc) from exc


def _is_number(raw: Any, *, integral: bool) -> bool:
    """Whether a non-string option value given from Python is acceptable for an int/float option."""
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real):  # numpy scalars are Real too
        return False
    return not integral or float(raw).is_integer()


@dataclass
class PassResult:
    """What a pass did.

    Attributes:
        modified: true exactly when the model changed.
        stats: counts per rule or action (``{"LayerNormFusion": 12}``); numbers only.
        details: free-form, JSON-serialisable explanations (near misses and their reasons, plans).
    """

    modified: bool
    stats: dict[str, int | float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassReport:
    """One pass run as the manager saw it."""

    name: str
    modified: bool
    stats: dict[str, int | float]
    seconds: float
    nodes_before: int
    nodes_after: int
    details: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] | None = None
    #: Time of the numeric check a wrapper ran after the pass (``--verify each``); not in ``seconds``.
    check_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "modified": self.modified,
            "stats": self.stats,
            "seconds": round(self.seconds, 6),
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
        }
        if self.details:
            out["details"] = self.details
        if self.check is not None:
            out["check"] = self.check
        if self.check_seconds is not None:
            out["check_seconds"] = round(self.check_seconds, 6)
        return out


@dataclass
class PipelineReport:
    """Everything a pipeline run produced, ready for ``--report report.json``."""

    passes: list[PassReport] = field(default_factory=list)
    verification: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def modified(self) -> bool:
        return any(p.modified for p in self.passes)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"passes": [p.to_dict() for p in self.passes], "modified": self.modified}
        if self.verification is not None:
            out["verification"] = self.verification
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class Candidate:
    """A region a pass would rewrite, or a near miss and why not (:meth:`Pass.candidates`).

    Attributes:
        rule: the rule that matched (or almost matched) the region.
        nodes: the names of the model's nodes the rewrite would replace (what matched and what dies
            with it, ``Constant`` nodes left out), or for a near miss the nodes the match got through.
        op: the op type the region would become (``None`` for a near miss).
        kind: the computation that op is a fused form of, from its declaration (``"LayerNorm"``,
            ``"GELU"``, ``"attention"`` ...), ``None`` when it declares none.
        reason: ``None`` for a region the pass would rewrite, else why it would not.
    """

    rule: str
    nodes: tuple[str, ...]
    op: str | None = None
    kind: str | None = None
    reason: str | None = None


class Pass:
    """Base class of every pass. Subclasses set ``name``, ``family``, ``options`` and ``call``.

    A pass that rewrites regions it finds by matching (the fusion passes) also says, read-only, what it
    would rewrite: :meth:`candidates`.  The profile asks it, and ``--explain`` asks the same rules from the
    anchors they declare (:attr:`mograph.patterns.Rule.anchors`), so what counts as "a decomposed LayerNorm" is
    defined once, by the rule that fuses it.
    """

    name: ClassVar[str] = ""
    family: ClassVar[str] = "cleanup"
    options: ClassVar[tuple[Option, ...]] = ()
    #: The pass writes custom ops (fused ops) that the ``lower`` step must lower: a pipeline holding it
    #: gets ``lower`` appended when it has none (:meth:`mograph.plugins.Registry.plan`).
    emits_custom_ops: ClassVar[bool] = False

    def __init__(self, *, registry: Declarations | None = None, **values: Any) -> None:
        #: What the plugins declared (custom ops, targets, backends), handed down by the composition root
        #: (:meth:`mograph.plugins.Registry.instantiate`, :func:`mograph.run_passes`, :mod:`mograph.testing`);
        #: ``None`` for a pass made by hand, which then knows no plugin's declarations (a pass that cannot
        #: work without them says so through :attr:`declarations`).
        self.registry = registry
        self.config: dict[str, Any] = {}
        known = {o.key: o for o in self.options}
        for key in values:
            if key not in known:
                names = ", ".join(sorted(known)) or "none"
                raise OptionError(f"{self.name}: unknown option {key!r} (known: {names})")
        for key, opt in known.items():
            raw = values.get(key, opt.default)
            self.config[key] = opt.convert(raw, self.name, given=key in values) if raw is not None else (
                [] if opt.multiple else None
            )

    @property
    def declarations(self) -> Declarations:
        """:attr:`registry`, for a pass that needs what the plugins declared (custom ops, targets).

        Raises:
            InternalError: the pass was made without a registry (make it with
                :meth:`mograph.plugins.Registry.instantiate`, or give ``registry=``).
        """
        if self.registry is None:
            raise InternalError(self.name, "the pass needs the registry's declarations: make it with "
                                           "Registry.instantiate or give it registry=")
        return self.registry

    @classmethod
    def summary(cls) -> str:
        """First line of the docstring."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def call(self, model: ir.Model) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def candidates(self, model: ir.Model) -> list[Candidate]:
        """The regions of ``model`` this pass would rewrite (``reason`` None) and its near misses (with
        the reason), without changing ``model``.  The base pass finds none."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


def call_pass(p: Pass, model: ir.Model) -> PassResult:
    """Run ``p`` on ``model``: the innermost step of every pass run (the plugin manager's core
    ``mograph_run_pass`` and :class:`PassManager` without plugins), so the wrappers around it see the same model.

    After a pass that changed the model, a value it added inside a subgraph under a name an enclosing
    graph already has is renamed (:func:`mograph.irutil.unshadow_value_names`): onnx_ir names new values
    per graph, and a serialized model must not have a branch's value shadow an outer one.
    """
    result = p.call(model)
    if isinstance(result, PassResult) and result.modified:
        renamed = unshadow_value_names(model)
        if renamed:
            logger.debug("pass %s: renamed %d subgraph value(s) that shadowed an outer name", p.name, renamed)
    return result


def stamp(node: ir.Node, pass_name: str, rule: str | None = None) -> None:
    """Record which pass (and rule) created ``node`` in its metadata properties."""
    node.metadata_props.setdefault(PROVENANCE_PASS, pass_name)
    if rule is not None:
        node.metadata_props.setdefault(PROVENANCE_RULE, rule)


_iter_nodes = iter_nodes


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in _iter_nodes(model.graph))


#: Attribute types whose values are plain Python scalars or lists of them (never a graph or a tensor).
_PLAIN_ATTRS = frozenset({
    ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING,
    ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS,
})


def graph_fingerprint(model: ir.Model) -> str:
    """A hash of the graph's structure: nodes, attributes, edges, inputs, outputs, initializers.

    Tensor contents are represented by identity and shape, not read (external data stays lazy);
    replacing an initializer's tensor object counts as a change.
    """
    h = hashlib.sha256()

    def upd(*parts: object) -> None:
        h.update(repr(parts).encode())

    def vname(v: ir.Value | None) -> str:
        return "" if v is None else f"{v.name}:{v.dtype}:{v.shape}"

    def walk(graph: ir.Graph) -> None:
        upd("in", [vname(v) for v in graph.inputs])
        upd("out", [vname(v) for v in graph.outputs])
        for name, v in graph.initializers.items():
            t = v.const_value
            upd("init", name, None if t is None else (id(t), t.dtype, tuple(t.shape)))
        for node in graph:
            attrs: list[tuple[str, object]] = []
            for k, a in node.attributes.items():
                if a.type in _PLAIN_ATTRS:  # ints, floats, strings: no need for the (slow) protocol check
                    attrs.append((k, repr(a.value)))
                elif a.type == ir.AttributeType.TENSOR and not a.is_ref():  # a Constant's value: its identity
                    attrs.append((k, id(a.value)))  # (ir.TensorProtocol's isinstance costs ~0.1 ms a node)
                elif isinstance(a.value, ir.Graph):
                    walk(a.value)
                    attrs.append((k, "graph"))
                elif isinstance(a.value, ir.TensorProtocol):
                    attrs.append((k, id(a.value)))
                else:
                    attrs.append((k, repr(a.value)))
            upd(
                node.domain,
                node.op_type,
                node.overload,
                [vname(i) for i in node.inputs],
                [vname(o) for o in node.outputs],
                attrs,
            )

    walk(model.graph)
    upd("opsets", sorted(model.opset_imports.items()))
    upd("functions", sorted(str(k) for k in model.functions))
    return h.hexdigest()


#: An instrument: an object with a ``mograph_run_pass(pass_, model, context)`` generator method (the
#: wrapper of :func:`mograph.hookspecs.mograph_run_pass`), or such a generator function itself.
Instrument = Any


def _wrapper_of(instrument: Instrument) -> Callable[..., Any]:
    method = getattr(instrument, "mograph_run_pass", None)
    if callable(method):
        return method
    if callable(instrument):
        return instrument
    raise MographError(
        f"instrument {instrument!r} has no mograph_run_pass(pass_, model, context) wrapper and is not callable"
    )


def run_instrumented(
    instruments: Sequence[Instrument], pass_: Pass, model: ir.Model, context: dict[str, Any], call: Callable[[], Any]
) -> Any:
    """Run ``call()`` (the pass) inside the wrappers of ``instruments``, the first one outermost.

    Each wrapper follows pluggy's new-style wrapper protocol, exactly as a plugin's
    ``@mograph.hookimpl(wrapper=True) def mograph_run_pass(...)`` does: it runs until its ``yield``,
    receives the pass's result there (or the pass's exception, raised at the ``yield``), and returns
    the result to pass on.
    """
    if not instruments:
        return call()
    wrapper = _wrapper_of(instruments[0])
    gen = wrapper(pass_=pass_, model=model, context=context)
    if not inspect.isgenerator(gen):
        raise MographError(f"instrument {instruments[0]!r}: mograph_run_pass must be a generator (it must yield once)")
    try:
        next(gen)
    except StopIteration as stop:  # did not yield: it decided the result without running the pass
        return stop.value
    try:
        result = run_instrumented(instruments[1:], pass_, model, context, call)
    except BaseException as exc:  # noqa: BLE001 - handed to the wrapper, which may handle or re-raise it
        try:
            gen.throw(exc)
        except StopIteration as stop:
            return stop.value
        raise MographError(f"instrument {instruments[0]!r}: mograph_run_pass yielded twice") from exc
    try:
        gen.send(result)
    except StopIteration as stop:
        return stop.value
    raise MographError(f"instrument {instruments[0]!r}: mograph_run_pass yielded twice")


#: ``OSError`` numbers that mean the disk (or the user's quota) is full: a pass then fails cleanly (exit 4).
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def _file_of(exc: OSError) -> str:
    return f" writing {exc.filename}" if exc.filename else ""


class PassManager:
    """Runs passes in the given order through the plugin manager's ``mograph_run_pass`` hook.

    Args:
        passes: pass instances, in the order to run them.
        hook: the plugin manager's hook relay (``pm.hook``); ``None`` runs passes directly with no
            plugin wrappers (used in unit tests of single passes).
        check_modified: fail a pass whose result says "unchanged" while the graph changed.
        context: shared data given to wrapper hooks (``verify``, feeds, reference outputs ...).
        instruments: wrappers for this run only (progress, per-pass verification), around every
            pass and outside the plugins' wrappers, the first one outermost; nothing is registered
            on the plugin manager.  See :func:`run_instrumented`.
        sources: which plugin provides each pass (``Registry.pass_source``), to name it in errors.
    """

    def __init__(
        self,
        passes: list[Pass],
        *,
        hook: Any | None = None,
        check_modified: bool = False,
        context: dict[str, Any] | None = None,
        instruments: Sequence[Instrument] = (),
        sources: Mapping[str, str] | None = None,
    ) -> None:
        self.passes = passes
        self.sources = dict(sources or {})
        self.hook = hook
        self.check_modified = check_modified
        self.context = context if context is not None else {}
        self.instruments = list(instruments)
        for instrument in self.instruments:
            _wrapper_of(instrument)  # refuse a non-instrument before any pass runs

    def _run_one(self, p: Pass, model: ir.Model) -> PassResult:
        def call() -> PassResult:
            if self.hook is None:
                return call_pass(p, model)
            return self.hook.mograph_run_pass(pass_=p, model=model, context=self.context)

        return run_instrumented(self.instruments, p, model, self.context, call)

    def _refused_input(self, index: int, model: ir.Model, before_ids: set[int]) -> MographError | None:
        """After pass ``index`` crashed: the error to raise instead of an internal one when the model it was
        given (unchanged by it: the same nodes) does not load in ONNX Runtime, as when an earlier pass's
        user-chosen option made it invalid (``fix-shapes --shape`` pinning a size that a dead branch cannot take)
        and the crashed pass opened an ONNX Runtime session on it; else None (the crash is the pass's)."""
        from mograph.output_check import InvalidModel, _ort_load, _ort_skip_reason

        if {id(n) for n in _iter_nodes(model.graph)} != before_ids or _ort_skip_reason(model) is not None:
            return None
        try:
            _ort_load(model)
        except InvalidModel as refusal:
            name = self.passes[index].name
            earlier = [q.name for q in self.passes[:index]]
            if not earlier:
                return ModelError(f"ONNX Runtime cannot load the model given to '{name}': {refusal}")
            return PassFailedError(name, f"the model it was given does not load in ONNX Runtime ({refusal}); it is "
                                         f"the output of {', '.join(earlier)}: check their options (fix-shapes' "
                                         "--shape sizes must be ones every branch of the model can take)")
        except Exception:  # noqa: BLE001 - the check itself failing says nothing about the model
            return None
        return None

    def run(self, model: ir.Model, report: PipelineReport | None = None) -> PipelineReport:
        """Run every pass in order on ``model`` (in place), appending one entry per pass to ``report``.

        Raises:
            MographError: as raised by a pass or a wrapper (e.g. :class:`PassFailedError`, a pass's
                own explained refusal), unchanged.
            PluginError: a pass or a wrapper called ``sys.exit`` (``SystemExit``), naming the plugin
                that provides the pass (``sources``: pass name -> plugin name, from the registry; else
                the pass's top-level module).  ``KeyboardInterrupt`` goes through unchanged.
            InternalError: a bug in a pass: any other exception (kept as ``__cause__``), a result
                that is not a :class:`PassResult`, or ``modified=False`` for a changed graph.
        """
        report = report if report is not None else PipelineReport()
        # One walk of the model per pass: the nodes after a pass are the nodes before the next one (nothing
        # runs in between).  The old nodes are kept alive while comparing so their ids cannot be reused.
        before_nodes = list(_iter_nodes(model.graph))
        for index, p in enumerate(self.passes):
            before_ids = {id(n) for n in before_nodes}
            nodes_before = len(before_ids)
            fp_before = graph_fingerprint(model) if self.check_modified else None
            logger.info("running pass %s", p.name)
            start = time.perf_counter()
            try:
                result = self._run_one(p, model)
            except MographError:
                raise  # the pass (or a wrapper) explains a failure the user can act on
            except SystemExit as exc:  # a plugin ending the process would pass for a success (exit 0)
                plugin = self.sources.get(p.name) or type(p).__module__.split(".")[0]
                raise PluginError(
                    f"plugin '{plugin}' misbehaved: pass '{p.name}' (or a wrapper around it) called "
                    f"sys.exit({exc.code!r}); a pass returns a PassResult or raises an error"
                ) from exc
            except OSError as exc:
                if exc.errno in _DISK_FULL:  # the machine's limit, not a bug: say what to do
                    raise PassFailedError(p.name, f"the disk is full ({exc.strerror}{_file_of(exc)}): large models "
                                          "are spilled to temporary files under TMPDIR (now "
                                          f"{tempfile.gettempdir()}); free space there or point TMPDIR at a "
                                          "larger disk") from exc
                raise InternalError(p.name, f"{type(exc).__name__}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - any other exception is a bug: name the pass
                refused = self._refused_input(index, model, before_ids)
                if refused is not None:  # not the pass's bug: the model it was given does not load
                    raise refused from exc
                raise InternalError(p.name, f"{type(exc).__name__}: {exc}") from exc
            # A wrapper's numeric check (``--verify each``) reports its own time; the pass's excludes it.
            check_seconds = self.context.pop("last_check_seconds", None)
            seconds = time.perf_counter() - start - (check_seconds or 0.0)
            if not isinstance(result, PassResult):
                raise InternalError(p.name, f"returned {type(result).__name__}, not a PassResult")
            after_nodes = list(_iter_nodes(model.graph))
            new_nodes = [n for n in after_nodes if id(n) not in before_ids]
            for node in new_nodes:
                stamp(node, p.name)
            before_nodes = after_nodes
            if fp_before is not None and not result.modified and graph_fingerprint(model) != fp_before:
                raise InternalError(p.name, "reported modified=False but changed the graph")
            if new_nodes and not result.modified:
                raise InternalError(p.name, "reported modified=False but created nodes")
            entry = PassReport(
                name=p.name,
                modified=result.modified,
                stats=dict(result.stats),
                seconds=seconds,
                nodes_before=nodes_before,
                nodes_after=len(after_nodes),
                details=dict(result.details),
                check_seconds=check_seconds,
            )
            check = self.context.pop("last_check", None)
            if check is not None:
                entry.check = check
            report.passes.append(entry)
            logger.info(
                "pass %s: modified=%s nodes %d -> %d in %.3fs %s",
                p.name, result.modified, entry.nodes_before, entry.nodes_after, seconds, result.stats,
            )
        return report
