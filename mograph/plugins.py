"""The plugin manager and the registry it fills.

Plugins come from two places:

* **built-ins** — the modules in :data:`BUILTIN_PLUGINS`, registered first under their own names,
  through the very same hooks as third-party code;
* **entry points** in the ``mograph`` group of installed distributions, loaded unless
  ``MOGRAPH_DISABLE_PLUGIN_AUTOLOAD`` is set to a non-empty value other than ``0``.  A plugin
  named in ``MOGRAPH_BLOCK_PLUGINS`` (comma-separated) or passed to :func:`get_registry` as
  ``blocked`` is skipped.

A plugin that fails to import or whose hook raises becomes a :class:`~mograph.errors.PluginError`
that names it.  The :class:`Registry` holds what the hooks returned: passes (with the plugin each came
from), presets, custom ops, targets and backends, and expands ``--passes`` lists into ordered pass names.

Only the composition roots (:mod:`mograph.api`, :mod:`mograph.cli`, :mod:`mograph.profile`,
:mod:`mograph.workflow`, :mod:`mograph.testing`) call :func:`get_registry`; they hand the registry (a
:class:`mograph.custom_ops.Declarations`) down to what needs it: passes get it from
:meth:`Registry.instantiate`, the lowering and the backends as a ``registry`` argument.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from mograph import hookspecs
from mograph.backend_protocol import backend_problems
from mograph.custom_ops import CustomOp
from mograph.errors import PluginError, UnknownPassError
from mograph.foreign_ops import ForeignOp
from mograph.pass_infra import Option, Pass, PassResult, call_pass
from mograph.targets import DEFAULT_TARGET, LOWER_PASS, Target

__all__ = [
    "BUILTIN_PLUGINS",
    "describe_plugin",
    "ENTRY_POINT_GROUP",
    "Registry",
    "check_pending",
    "get_plugin_manager",
    "get_registry",
    "reset",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "mograph"
AUTOLOAD_ENV = "MOGRAPH_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_ENV = "MOGRAPH_BLOCK_PLUGINS"
#: Preset run after a ``lower`` step that :meth:`Registry.plan` appends (not after one the list names).
AFTER_LOWER = "after-lower"

#: Built-in plugin modules, registered under these names. Order does not define pass order.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "mograph.lowering",
    "mograph.passes.cleanup",
    "mograph.passes.fusion",
    "mograph.passes.shape",
    "mograph.passes.quant",
    "mograph.passes.prune",
    "mograph.backends",
)


class _CorePlugin:
    """The innermost ``mograph_run_pass``: actually run the pass."""

    @hookspecs.hookimpl(trylast=True)
    def mograph_run_pass(self, pass_: Pass, model: Any, context: dict[str, Any]) -> PassResult:
        return call_pass(pass_, model)


def _autoload_disabled() -> bool:
    val = os.environ.get(AUTOLOAD_ENV, "")
    return val not in ("", "0", "false", "False", "no")


def _blocked_from_env() -> set[str]:
    return {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}


def get_plugin_manager(blocked: Iterable[str] = (), autoload: bool | None = None) -> pluggy.PluginManager:
    """Build a plugin manager with the built-ins and (unless disabled) the entry-point plugins."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked_set = set(blocked) | _blocked_from_env()
    for name in blocked_set:
        pm.set_blocked(name)
    pm.register(_CorePlugin(), name="mograph.core")
    for modname in BUILTIN_PLUGINS:
        if modname in blocked_set:
            continue
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:  # family not built yet
                continue
            raise PluginError(f"built-in plugin '{modname}' failed to import: {exc}") from exc
        pm.register(module, name=modname)
    if autoload is None:
        autoload = not _autoload_disabled()
    if autoload:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in blocked_set or pm.is_blocked(ep.name):
                logger.info("plugin %s blocked", ep.name)
                continue
            if pm.get_plugin(ep.name) is not None:
                continue
            try:
                plugin = ep.load()
            except SystemExit as exc:  # ending the process would pass for a success (exit 0, nothing done)
                raise PluginError(_exited(ep.name, exc, f"while loading ({ep.value})")) from exc
            except Exception as exc:  # noqa: BLE001 - any import failure is the plugin's
                raise PluginError(
                    f"plugin '{ep.name}' ({ep.value}) failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            try:
                pm.register(plugin, name=ep.name)
            except Exception as exc:  # noqa: BLE001 - pluggy validation errors
                raise PluginError(f"plugin '{ep.name}' is not a valid mograph plugin: {exc}") from exc
            dist = getattr(ep, "dist", None)
            logger.info("loaded plugin %s from %s", ep.name, dist.name if dist else ep.value)
    check_pending(pm)  # a misspelled hook is an error naming its plugin, not a hook never called
    return pm


def describe_plugin(name: str) -> str | None:
    """``plugin 'NAME' (distribution DIST VERSION)`` for a plugin loaded through an entry point; ``None``
    for a built-in (nothing to report beyond mograph itself)."""
    if name in BUILTIN_PLUGINS:
        return None
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            dist = getattr(ep, "dist", None)
            return f"plugin '{name}' (distribution {dist.name} {dist.version})" if dist else f"plugin '{name}' ({ep.value})"
    return f"plugin '{name}'"


def check_pending(pm: pluggy.PluginManager) -> None:
    """Refuse a hook implementation that matches no hook (a misspelled ``mograph_*`` name), naming its plugin.

    pluggy keeps such an implementation aside, never calling it; without this check a plugin whose
    ``mograph_add_pass`` (for ``mograph_add_passes``) does nothing would fail silently.
    """
    known = [n for n in dir(hookspecs) if n.startswith(f"{hookspecs.PROJECT}_")]
    for hook_name in sorted(vars(pm.hook)):
        hook = getattr(pm.hook, hook_name)
        if hook_name.startswith("_") or not hasattr(hook, "has_spec") or hook.has_spec():
            continue
        for impl in hook.get_hookimpls():
            if impl.optionalhook:
                continue
            plugin = pm.get_name(impl.plugin) or repr(impl.plugin)
            close = difflib.get_close_matches(hook_name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise PluginError(
                f"plugin '{plugin}' implements {hook_name}, which is not a mograph hook{hint}; "
                "the hooks are documented in mograph.hookspecs"
            )
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin = pm.get_name(exc.plugin) or repr(exc.plugin)
        raise PluginError(f"plugin '{plugin}' is not a valid mograph plugin: {exc}") from exc


def _exited(plugin: str, exc: SystemExit, where: str) -> str:
    """The message of a :class:`PluginError` for a plugin that called ``sys.exit`` ``where``: the process ending
    there would pass for a success (exit 0, nothing written)."""
    return (f"plugin '{plugin}' misbehaved: it called sys.exit({exc.code!r}) {where}; a plugin returns its "
            "contributions or raises an error")


def _call_collecting(pm: pluggy.PluginManager, hook_name: str) -> list[tuple[str, Any]]:
    """Call a collecting hook plugin by plugin, so a failure names the plugin responsible."""
    out: list[tuple[str, Any]] = []
    hook = getattr(pm.hook, hook_name)
    for impl in hook.get_hookimpls():
        name = pm.get_name(impl.plugin) or repr(impl.plugin)
        try:
            value = impl.function()
        except SystemExit as exc:
            raise PluginError(_exited(name, exc, f"in {hook_name}")) from exc
        except Exception as exc:  # noqa: BLE001
            raise PluginError(f"plugin '{name}' failed in {hook_name}: {type(exc).__name__}: {exc}") from exc
        if value is not None:
            out.append((name, value))
    return out


def _option_difference(a: Option, b: Option) -> str:
    """What two declarations of one option name disagree on ("" when they agree)."""
    diffs = []
    if a.type is not b.type:
        diffs.append(f"types ({_type_name(a.type)} and {_type_name(b.type)})")
    if a.multiple != b.multiple:
        diffs.append("repetition (one is repeatable, the other not)")
    if (tuple(a.choices) if a.choices is not None else None) != (tuple(b.choices) if b.choices is not None else None):
        diffs.append(f"choices ({a.choices} and {b.choices})")
    if a.default != b.default or type(a.default) is not type(b.default):
        diffs.append(f"defaults ({a.default!r} and {b.default!r})")
    return ", ".join(diffs)


def _type_name(t: Any) -> str:
    module = getattr(t, "__module__", "")
    name = getattr(t, "__qualname__", repr(t))
    return name if module in ("builtins", None, "") else f"{module}.{name}"


@dataclass
class Registry:
    """What every plugin contributed."""

    pm: pluggy.PluginManager
    passes: dict[str, type[Pass]] = field(default_factory=dict)
    pass_source: dict[str, str] = field(default_factory=dict)
    presets: dict[str, list[str]] = field(default_factory=dict)
    preset_source: dict[str, str] = field(default_factory=dict)
    custom_ops: dict[tuple[str, str], CustomOp] = field(default_factory=dict)
    custom_op_source: dict[tuple[str, str], str] = field(default_factory=dict)
    backends: dict[str, Any] = field(default_factory=dict)
    backend_source: dict[str, str] = field(default_factory=dict)
    #: Targets declared through ``mograph_add_targets`` (:func:`mograph.lowering.known_targets` adds the
    #: names that only ops' lowerings or backends' ``target`` give).
    targets: dict[str, Target] = field(default_factory=dict)
    target_source: dict[str, str] = field(default_factory=dict)
    #: Facts about ops mograph does not own, declared through ``mograph_add_foreign_ops``.
    foreign_ops: dict[tuple[str, str], ForeignOp] = field(default_factory=dict)
    foreign_op_source: dict[tuple[str, str], str] = field(default_factory=dict)

    @classmethod
    def build(cls, pm: pluggy.PluginManager) -> Registry:
        check_pending(pm)
        reg = cls(pm=pm)
        for plugin, classes in _call_collecting(pm, "mograph_add_passes"):
            for pcls in classes:
                if not (isinstance(pcls, type) and issubclass(pcls, Pass)):
                    raise PluginError(f"plugin '{plugin}' returned {pcls!r} from mograph_add_passes: not a Pass subclass")
                name = pcls.name
                if not name or name != name.lower() or " " in name or "_" in name:
                    raise PluginError(f"plugin '{plugin}': pass {pcls.__name__} needs a kebab-case name, got {name!r}")
                if name in reg.passes:
                    raise PluginError(
                        f"pass name '{name}' is provided by both '{reg.pass_source[name]}' and '{plugin}'"
                    )
                reg.passes[name] = pcls
                reg.pass_source[name] = plugin
        for plugin, presets in _call_collecting(pm, "mograph_add_presets"):
            for name, items in presets.items():
                if name in reg.passes:
                    raise PluginError(f"plugin '{plugin}': preset '{name}' has the name of a pass")
                if name in reg.presets:
                    raise PluginError(
                        f"preset '{name}' is provided by both '{reg.preset_source[name]}' and '{plugin}'"
                    )
                reg.presets[name] = list(items)
                reg.preset_source[name] = plugin
        for plugin, ops in _call_collecting(pm, "mograph_add_custom_ops"):
            for op in ops:
                if not isinstance(op, CustomOp):
                    raise PluginError(
                        f"plugin '{plugin}' returned {op!r} from mograph_add_custom_ops: not a mograph.CustomOp"
                    )
                if op.key in reg.custom_ops:
                    first = reg.custom_op_source[op.key]
                    where = "twice" if first == plugin else f"by both '{first}' and '{plugin}'"
                    raise PluginError(f"plugin '{plugin}': custom op {op.domain}::{op.name} is declared {where}")
                reg.custom_ops[op.key] = op
                reg.custom_op_source[op.key] = plugin
        for plugin, targets in _call_collecting(pm, "mograph_add_targets"):
            for target in targets:
                if not isinstance(target, Target) or not target.name:
                    raise PluginError(
                        f"plugin '{plugin}' returned {target!r} from mograph_add_targets: not a named mograph.targets.Target"
                    )
                if target.name in reg.targets:
                    first = reg.target_source[target.name]
                    where = "twice" if first == plugin else f"by both '{first}' and '{plugin}'"
                    raise PluginError(f"plugin '{plugin}': target '{target.name}' is declared {where}")
                reg.targets[target.name] = target
                reg.target_source[target.name] = plugin
        for plugin, records in _call_collecting(pm, "mograph_add_foreign_ops"):
            for record in records:
                if not isinstance(record, ForeignOp):
                    raise PluginError(
                        f"plugin '{plugin}' returned {record!r} from mograph_add_foreign_ops: not a mograph.foreign_ops.ForeignOp"
                    )
                if record.key in reg.foreign_ops:
                    first = reg.foreign_op_source[record.key]
                    where = "twice" if first == plugin else f"by both '{first}' and '{plugin}'"
                    raise PluginError(f"plugin '{plugin}': foreign op {record.domain}::{record.name} is declared {where}")
                reg.foreign_ops[record.key] = record
                reg.foreign_op_source[record.key] = plugin
        for plugin, backends in _call_collecting(pm, "mograph_add_backends"):
            for backend in backends:
                problems = backend_problems(backend)
                if problems:
                    raise PluginError(
                        f"plugin '{plugin}' returned {backend!r} from mograph_add_backends, which is not a backend: "
                        + "; ".join(problems)
                        + " (the protocol is documented in mograph.backend_protocol and mograph_add_backends)"
                    )
                if backend.name in reg.backends:
                    first = reg.backend_source[backend.name]
                    if first == plugin:
                        raise PluginError(f"plugin '{plugin}': backend '{backend.name}' is declared twice")
                    raise PluginError(f"backend '{backend.name}' is provided by both '{first}' and '{plugin}'")
                reg.backends[backend.name] = backend
                reg.backend_source[backend.name] = plugin
        reg._check_options()
        return reg

    def _check_options(self) -> None:
        """Passes sharing an option name must mean the same by it: same type, default, repetition, choices."""
        first: dict[str, tuple[Option, str]] = {}
        for name in sorted(self.passes):
            for opt in self.passes[name].options:
                if opt.key not in first:
                    first[opt.key] = (opt, name)
                    continue
                other, other_pass = first[opt.key]
                diff = _option_difference(other, opt)
                if diff:
                    raise PluginError(
                        f"option '--{opt.name}' means two things: pass '{other_pass}' of plugin "
                        f"'{self.pass_source[other_pass]}' and pass '{name}' of plugin '{self.pass_source[name]}' "
                        f"declare it with different {diff}; one of them must rename it"
                    )

    def expand(self, names: Iterable[str] | str) -> list[str]:
        """Expand a pass list (``"fuse,cleanup"`` or a list) into an ordered list of pass names."""
        if isinstance(names, str):
            names = [n for n in (s.strip() for s in names.split(",")) if n]
        out: list[str] = []

        def visit(name: str, stack: tuple[str, ...]) -> None:
            if name in self.passes:
                out.append(name)
            elif name in self.presets:
                if name in stack:
                    raise PluginError(f"preset cycle: {' -> '.join(stack + (name,))}")
                for child in self.presets[name]:
                    visit(child, stack + (name,))
            else:
                known = sorted(self.passes) + sorted(self.presets)
                # closest first (difflib's ratio), ties in name order
                scored = sorted(((difflib.SequenceMatcher(None, name, k).ratio(), k) for k in known),
                                key=lambda rk: (-rk[0], rk[1]))
                close = [k for ratio, k in scored if ratio >= 0.6][:3]
                close += [k for k in known if (name in k or k in name) and k not in close]
                close = close[:3]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise UnknownPassError(f"unknown pass or preset '{name}'{hint}; `mograph passes` lists them")

        for n in names:
            visit(n, ())
        if not out:
            raise UnknownPassError("no passes given")
        return out

    def plan(self, names: Iterable[str] | str, options: dict[str, Any] | None = None) -> list[str]:
        """The pipeline to run: :meth:`expand`, then the ``lower`` step appended where one is due.

        ``lower`` (:mod:`mograph.lowering`) is added at the end when the list has none and either a
        ``target`` option is given or a pass of the list writes custom ops (``Pass.emits_custom_ops``),
        so ``--passes fuse,int8 --target ort`` fuses, quantizes, then lowers once.  The lowered forms
        leave shape computations of their own (a mask expanded per layer), so an added ``lower`` is
        followed by the preset :data:`AFTER_LOWER` where a plugin registers one (the built-in cleanup
        plugin does: shape simplification, CSE, dead-node elimination), unless the target does not lower (``mograph``: the fused ops are kept, so the lowering wrote
        nothing to tidy).  A list that names ``lower`` itself runs it where it stands, and nothing is
        added after it.
        """
        out = self.expand(names)
        options = options or {}
        if LOWER_PASS in self.passes and LOWER_PASS not in out:
            wants = options.get("target") is not None or any(self.passes[n].emits_custom_ops for n in out)
            if wants:
                out.append(LOWER_PASS)
                target = self.targets.get(options.get("target") or DEFAULT_TARGET)  # undeclared: lowers
                if AFTER_LOWER in self.presets and (target is None or target.lowers):
                    out.extend(self.expand(AFTER_LOWER))
        return out

    def recipe(self, names: Iterable[str] | str, options: dict[str, Any], device: str | None
               ) -> tuple[list[str], dict[str, Any], dict[str, Any] | None]:
        """The user's pass list and options rewritten for ``device`` by the plugins' precision recipes
        (:func:`mograph.hookspecs.mograph_precision_recipe`), with the record of what was decided; unchanged
        (and no record) without a device or when no plugin rewrites it."""
        if isinstance(names, str):
            names = [n for n in (s.strip() for s in names.split(",")) if n]
        names = list(names)
        if not device:
            return names, options, None
        hook = self.pm.hook.mograph_precision_recipe
        try:
            got = hook(passes=list(names), options=dict(options), device=device)
        except SystemExit as exc:
            owners = ", ".join(sorted(self.pm.get_name(i.plugin) or repr(i.plugin) for i in hook.get_hookimpls()))
            raise PluginError(_exited(owners, exc, "in mograph_precision_recipe")) from exc
        if got is None:
            return names, options, None
        return list(got["passes"]), dict(got["options"]), got.get("record")

    def instantiate(self, names: list[str], options: dict[str, Any] | None = None) -> list[Pass]:
        """Create pass instances, giving each only the options it declares."""
        options = options or {}
        passes = []
        for name in names:
            pcls = self.passes[name]
            mine = {o.key: options[o.key] for o in pcls.options if options.get(o.key) is not None}
            try:
                passes.append(pcls(registry=self, **mine))
            except SystemExit as exc:
                plugin = self.pass_source.get(name) or pcls.__module__.split(".")[0]
                raise PluginError(_exited(plugin, exc, f"while pass '{name}' was created")) from exc
        return passes

    def unread_options(self, names: Iterable[str], options: dict[str, Any]) -> dict[str, list[str]]:
        """Options given (not ``None``) that no pass of ``names`` declares: key -> the passes that would read it."""
        declared = self.all_options()
        taken = {o.key for n in names if n in self.passes for o in self.passes[n].options}
        return {
            k: list(declared[k][1]) if k in declared else []
            for k, v in options.items()
            if v is not None and k not in taken
        }

    def all_options(self) -> dict[str, tuple[Any, list[str]]]:
        """Every declared option: key -> (Option, [pass names declaring it])."""
        out: dict[str, tuple[Any, list[str]]] = {}
        for name in sorted(self.passes):
            for opt in self.passes[name].options:
                if opt.key in out:
                    out[opt.key][1].append(name)
                else:
                    out[opt.key] = (opt, [name])
        return out


_cache: dict[tuple[frozenset[str], bool | None], Registry] = {}


def get_registry(blocked: Iterable[str] = (), autoload: bool | None = None) -> Registry:
    """The registry for the current environment (cached per blocked set and autoload setting)."""
    key = (frozenset(blocked) | frozenset(_blocked_from_env()), autoload if autoload is not None else not _autoload_disabled())
    if key not in _cache:
        _cache[key] = Registry.build(get_plugin_manager(blocked, autoload))
    return _cache[key]


def reset() -> None:
    """Forget cached registries (after installing a plugin, or in tests)."""
    _cache.clear()
