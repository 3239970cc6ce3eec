"""The plugin author's manual: every hook mograph calls, when, with what, and what a return means.

mograph is built from plugins.  Its own passes, presets, custom ops and backends are registered
through exactly these hooks (by the built-in plugins ``mograph.passes.cleanup``,
``mograph.passes.fusion`` ...), so a third-party plugin has the same powers as the built-ins.

Writing a plugin
----------------
1. Write a module with functions named after the hooks below, decorated with
   ``mograph.hookimpl``::

       import mograph

       @mograph.hookimpl
       def mograph_add_passes():
           return [MyPass]

2. Declare it in your distribution's ``pyproject.toml``::

       [project.entry-points.mograph]
       my-plugin = "my_package.plugin"

   The entry-point *name* (``my-plugin``) is the plugin's name: it is shown by ``mograph passes``,
   named in errors, and used to block it.

3. ``pip install`` it.  ``mograph passes`` now lists your pass.

Only functions whose names start with ``mograph_`` are hooks; anything else in the module is
ignored.  A function marked ``@mograph.hookimpl`` whose name is not one of the hooks below (a
misspelling such as ``mograph_add_pass``) is a plugin error naming the plugin, not a hook that is
silently never called.  Passes of different plugins may share an option name (``--shape``) only if
they declare it alike (type, default, repetition, choices); otherwise loading both is an error
naming both.  Set ``MOGRAPH_DISABLE_PLUGIN_AUTOLOAD=1`` to load no third-party plugin at all, or
``MOGRAPH_BLOCK_PLUGINS=name1,name2`` (or ``mograph --block-plugin NAME``) to skip some by name.
A plugin that fails to import, or whose hook raises, stops mograph with an error naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import onnx_ir as ir

    from mograph.custom_ops import CustomOp
    from mograph.foreign_ops import ForeignOp
    from mograph.pass_infra import Pass, PassResult
    from mograph.targets import Target

__all__ = ["hookspec", "hookimpl", "PROJECT"]

PROJECT = "mograph"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def mograph_add_passes() -> list[type[Pass]]:
    """Contribute pass classes.

    Called once, when the registry is first built (at the first ``mograph`` command or API call
    that needs passes), for every registered plugin.

    Returns:
        A list of :class:`mograph.Pass` subclasses.  Each must have a unique kebab-case ``name``;
        a name already taken by another plugin is an error naming both plugins.  Return ``[]`` (or
        nothing) to add none.
    """


@hookspec
def mograph_add_presets() -> dict[str, list[str]]:
    """Contribute pipeline presets: names that expand to ordered lists of pass or preset names.

    Called once, when the registry is built, after every plugin's passes are known.

    Returns:
        A mapping ``{"preset-name": ["pass-a", "pass-b", ...]}``.  Entries may name other presets;
        expansion is recursive and a cycle is an error.  A preset name may not equal a pass name.
        ``--passes fuse,cleanup`` expands each preset in place, preserving order.
    """


@hookspec
def mograph_add_custom_ops() -> list[CustomOp]:
    """Contribute custom operators (fused ops in a plugin-owned domain).

    Called once, when the registry is built.

    The pipeline uses a plugin's op exactly like a built-in one: the ``lower`` step (``--target
    NAME``, or a backend's first act, :func:`mograph.lowering.lower_model`) calls its
    ``lowerings[target](node, ctx) -> bool`` for each of its nodes (``ctx`` a
    :class:`mograph.lowering.LoweringContext`; ``False`` leaves the node; a target name no built-in
    knows becomes valid by being named here), inlines its ``function`` for ``--target onnx`` where
    its lowering declines, and keeps it with its function body otherwise.  The pass that fuses into
    the op gives the model the op's function body with :func:`mograph.lowering.ensure_functions` (as
    the built-in fusion passes do) and sets ``emits_custom_ops = True``, so ``lower`` is appended to
    pipelines holding it; ``mograph passes`` lists the op with its targets.  ``tensorrt_plugin``
    declares the TensorRT plugin implementing it, if any.

    Returns:
        A list of :class:`mograph.custom_ops.CustomOp`: name, domain, version, numpy reference,
        ONNX function body, shape function, symbolic shape rule (``shape_dims``: what the core's shape
        query, :class:`mograph.shapes.ShapeQuery`, concludes about the op's outputs; filed under
        ``(domain, name, version)``), per-target lowerings and TensorRT plugin.
        ``(domain, name)`` must be unique across plugins: a second declaration is an error naming
        both plugins.
    """


@hookspec
def mograph_add_targets() -> list[Target]:
    """Contribute lowering targets (``--target NAME``) as declared data.

    Called once, when the registry is built.  A :class:`mograph.targets.Target` says whether the
    ``lower`` step asks each op's ``lowerings[NAME]`` (``lowers``), what becomes of a node no lowering
    takes (``leftovers``: ``"inline"`` its function body, or ``"keep"`` the custom op with its body), and
    whether ``--upgrade-opset`` applies (``standard_opset``).  The built-in plugin ``mograph.lowering``
    declares ``onnx``, ``ort``, ``tensorrt`` and ``mograph`` this way.  A name that only an op's
    ``lowerings`` or a backend's ``target`` gives is a target too, with the defaults (lower, keep).

    Returns:
        A list of :class:`mograph.targets.Target`; a name declared twice is an error naming both plugins.
    """


@hookspec
def mograph_add_foreign_ops() -> list[ForeignOp]:
    """Contribute facts about ops mograph does not own (a runtime's contrib ops), one record per op.

    Called once, when the registry is built.  A :class:`mograph.foreign_ops.ForeignOp` says which
    computation the op is an already-fused form of (``computes``: the profile counts its time as
    fused), where it reads and writes a KV cache (``cache``: ``kv-cache-fp8`` quantizes it there),
    its gamma/beta inputs (``affine``), the outputs shaped like input 0 (``same_shape_outputs``, from which
    its shape rule follows) or its own shape rule (``shape_dims`` from ``since_version``), whether it is
    elementwise over its broadcast inputs (``elementwise``) or normalizes rows of input 0 (``normalizes``:
    the Q/DQ plans, ``fp16`` and ``prune-structured`` treat it as they treat ``LayerNormalization``).  The built-in plugin
    ``mograph.lowering`` declares the ``com.microsoft`` and standard ops mograph meets this way.

    Returns:
        A list of :class:`mograph.foreign_ops.ForeignOp`; ``(domain, name)`` declared twice is an error
        naming both plugins.
    """


@hookspec
def mograph_add_backends() -> list[Any]:
    """Contribute backends: runtimes a model can be run, benchmarked, built or validated on.

    Called once, when the registry is built.  Every job that runs a model takes its backend from
    the registry by name (``--backend NAME``): ``mograph bench``, ``mograph build``, ``mograph validate``
    and ``mograph diff``, so a plugin's backend works in all four exactly like ``ort`` or ``tensorrt``.
    Contributing a backend must not import its runtime (onnxruntime, tensorrt, torch): do that in
    ``make_runner``/``build``.

    A backend is any object with these members (:class:`mograph.backend_protocol.BackendProtocol`;
    subclass :class:`mograph.backend_protocol.Backend`, re-exported by :mod:`mograph.backends`, to get
    the optional ones with their defaults).

    Required:

    * ``name: str`` — short and unique, used on the command line (``"ort"``);
    * ``make_runner(model, *, optimizations=True, threads=None, providers=None, **options)`` —
      load ``model`` (a path, bytes, ``onnx.ModelProto`` or ``onnx_ir.Model``) and return a
      callable ``runner(feeds) -> outputs`` mapping input names to numpy arrays and back.
      ``optimizations`` is the runtime's own graph optimizations (on in ``bench``; off on both
      sides of ``diff`` and on the reference side of ``validate``); ``threads``/``providers`` may be
      ignored.  Raise :class:`mograph.BackendUnavailableError` when the runtime is missing.

    Optional (the default in brackets):

    * ``description: str`` — one line [``""``];
    * ``extra: str`` — the pip extra that installs the runtime [``""``];
    * ``target: str`` — the ``--target`` the backend lowers to: its first act on a model is
      ``mograph.lowering.lower_model(model, target, registry=registry)``, which asks each custom op's
      ``lowerings[target]`` (built-in and plugin ops alike) [the backend's ``name``];
    * a ``registry`` keyword of ``make_runner`` and ``build`` — the job's registry (custom ops to lower,
      targets), given only to a method that names it or takes ``**options``; a backend never looks the
      registry up itself [not given];
    * ``available() -> bool`` — whether the runtime is there, without importing it [``True``];
    * ``why_unavailable() -> str`` — the sentence shown (exit code 7) when ``available()`` is
      false: what is missing and how to install it [``"backend NAME is not available"``];
    * ``import_runtime()`` — import the runtime now, so ``mograph bench`` leaves the import out of
      the memory it measures [nothing is imported early];
    * ``build(model, path, **options) -> dict`` — write a deployable artifact of ``model`` to
      ``path`` (atomically) and return a JSON-serialisable report; ``mograph build --backend NAME``
      calls it with only the options the user gave (``fp16=True``, ``int8=True``,
      ``profiles=[...]``, ``workspace_mib=N``) [``mograph build`` refuses the backend: it builds
      nothing];
    * ``artifact_suffix: str`` — suffix of the file ``build`` writes, for the default output name
      [``".engine"``].

    Returns:
        A list of backend objects.  A name already taken is an error naming both plugins; an
        object without a ``name`` or a ``make_runner`` is an error naming the plugin.
    """


@hookspec(firstresult=True)
def mograph_run_pass(pass_: Pass, model: ir.Model, context: dict[str, Any]) -> PassResult:
    """Run one pass on the model.  Implement it as a *wrapper* to act around every pass.

    Called by the pass manager once per pass in the pipeline, in order.  The built-in core plugin
    provides the innermost implementation, which calls ``pass_.call(model)``.

    Plugins normally implement this hook as a wrapper, to time, log, dump or check each pass
    without the pass knowing::

        @mograph.hookimpl(wrapper=True)
        def mograph_run_pass(pass_, model, context):
            result = yield          # the pass runs here; it may raise
            ...                     # inspect `model` (already rewritten) and `result`
            return result

    The same wrapper, as a method of any object (or a bare generator function), is an *instrument*
    when given to one run only — ``mograph.optimize(..., instruments=[obj])`` — instead of being
    registered as a plugin: ``mograph optimize`` shows its progress that way, and ``verify="each"``
    checks every pass that way.  Instruments wrap the plugins' wrappers, the first one outermost.

    Args:
        pass_: the :class:`mograph.Pass` instance about to run (its ``config`` holds its options).
        model: the ``onnx_ir.Model`` the pass rewrites in place.
        context: a dict shared by the whole pipeline run.  Keys set by mograph: ``"verify"`` (the
            numeric-check setting or ``None``), ``"feeds"`` (the input feeds, when verifying),
            ``"reference"`` (the original model's outputs on those feeds).  A wrapper that
            measures something for the report stores it under ``"last_check"``; the manager
            moves it into that pass's report entry.

    Returns:
        The :class:`mograph.PassResult` of the pass (first non-``None`` result wins).  A wrapper
        may raise a :class:`mograph.MographError` to stop the pipeline.
    """


@hookspec(firstresult=True)
def mograph_precision_recipe(passes: list[str], options: dict[str, Any], device: str) -> Any:
    """Rewrite a pipeline for the device the model will run on (``--device``, ``optimize(device=...)``).

    Called by :meth:`mograph.plugins.Registry.recipe` once per ``optimize`` run that names a device,
    before presets are expanded, so ``int4`` can become what that device runs fastest (the built-in
    quant plugin: weight-only ``MatMulNBits`` then ``fp16`` on ONNX Runtime CUDA, from a table of
    measured kernel times).  Not called without a device: the pipeline is then exactly ``--passes``.

    Args:
        passes: the pass and preset names as the user gave them, in order.
        options: the pass options (a copy; ``target`` among them when given).
        device: ``cpu``, ``cuda`` or ``cuda:N``.

    Returns:
        ``None`` to leave the pipeline alone, or a dict with ``passes`` (the new list, still
        unexpanded), ``options`` (the complete options) and ``record`` (JSON-serialisable: what was
        decided and why; it goes into the report under ``recipe``, and each line of its
        ``warnings`` is shown to the user).  Raise :class:`mograph.OptionError` for a pipeline that
        cannot be made for the device.  The first plugin returning a dict wins.
    """
