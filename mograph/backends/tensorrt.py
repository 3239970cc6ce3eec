"""The TensorRT backend (``tensorrt``): build engines from ONNX models, load them, run them where a GPU is.

:func:`build_engine` parses a model with TensorRT's ONNX parser, with the mograph plugins
(:mod:`mograph.backends.tensorrt_plugins`) registered so that the nodes a fusion pass wrote for
``--target tensorrt`` become plugin layers, adds one optimization profile for the dynamic inputs, builds
and writes the serialized engine atomically, and returns a report: which layers became plugins, which
ONNX ops TensorRT could not take (the parser's errors, per node), what the precision flags did, timings
and sizes.

It runs on either TensorRT module (:mod:`mograph.backends._trt_loader`): ``tensorrt``, or
``tensorrt_rtx``, which builds engines ahead of time on a machine with no GPU. Where they differ:

* ``tensorrt_rtx`` networks are always strongly typed (no ``FP16``/``INT8`` builder flags): the tensor
  dtypes in the model decide the precision. ``fp16=True``/``int8=True`` are then recorded in the report
  as not applied, with the reason, instead of failing;
* explicit batch is the only mode of TensorRT 10 and RTX; the flag is set only for older ``tensorrt``.

**Profiles.** Every input with a dynamic dimension needs ``(min, opt, max)`` shapes: from the
``profiles`` argument (``{"input_ids": ((1, 16), (8, 128), (32, 512))}`` or ``mograph build --profile
input_ids:1x16,8x128,32x512``), else from the model's metadata (written by the ``set-trt-profile`` pass,
read with :func:`mograph.metadata.read_profiles`). A dynamic input left without one is an error
that names it.

**The plugin-library trap** of the ``tensorrt_rtx`` 1.7.1 wheels (the parser aborts the process on a
plugin node unless ``libtensorrt_rtx.so`` resolves) is handled before parsing: a model with nodes outside
the standard ONNX opsets is built in this process when :func:`~mograph.backends._trt_loader.plugin_lib_fix`
could make the name resolve here, and otherwise in a child process (``python -m
mograph.backends.tensorrt``) started with the right ``LD_LIBRARY_PATH``. Nothing is needed from the
user's shell.

Running an engine needs an NVIDIA GPU and a runtime that can execute it; :func:`gpu_status` says whether
this machine has one, and :class:`CannotRunError` (exit code 7) says plainly why not.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mograph.backends import Backend, Runner, _trt_loader
from mograph.backends.tensorrt_plugins import plugin_specs
from mograph.errors import BackendUnavailableError, ModelError, MographError, UsageError
from mograph.specs import Profile, check_profile, parse_profile, parse_profiles, parse_shapes

if TYPE_CHECKING:
    from mograph.custom_ops import Declarations

__all__ = [
    "BACKEND",
    "CannotRunError",
    "EngineBuildError",
    "TensorRTBackend",
    "build_engine",
    "gpu_status",
    "load_engine",
    "trt_available",
]

logger = logging.getLogger(__name__)


_REPORT_MARK = "MOGRAPH_TRT_RESULT "
_WORKER_ENV = "MOGRAPH_TRT_WORKER"
_STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training")


class EngineBuildError(ModelError):
    """TensorRT could not parse the model or build the engine. ``report`` holds what was learned (parser errors)."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


class CannotRunError(BackendUnavailableError):
    """An engine cannot be run on this machine (no GPU, or no runtime that can execute); exit code 7."""

    def __init__(self, message: str) -> None:
        MographError.__init__(self, message)
        self.extra = "tensorrt"


# ---------------------------------------------------------------------------------------------- profiles


def _normalize_profiles(profiles: Mapping[str, Any] | Sequence[str] | None) -> dict[str, Profile]:
    if profiles is None:
        return {}
    if not isinstance(profiles, Mapping):
        return parse_profiles(list(profiles))
    out: dict[str, Profile] = {}
    for name, value in profiles.items():
        if isinstance(value, str):
            out[name] = parse_profile(f"{name}:{value}")[1]
            continue
        if isinstance(value, Mapping):
            value = (value["min"], value["opt"], value["max"])
        try:
            prof = tuple(tuple(int(d) for d in shape) for shape in value)
        except (TypeError, ValueError):
            raise UsageError(f"profile of '{name}': expected (min, opt, max) shapes, got {value!r}") from None
        if len(prof) != 3:
            raise UsageError(f"profile of '{name}': expected three shapes (min, opt, max), got {len(prof)}")
        check_profile(name, prof)  # type: ignore[arg-type]
        out[name] = prof  # type: ignore[assignment]
    return out


def default_profiles(
    model: Any, profiles: Mapping[str, Profile], shapes: Mapping[str, Sequence[int]] | Sequence[str] | None = None
) -> tuple[dict[str, Profile], list[str]]:
    """Give every dynamic input without a profile one, as trtexec and Polygraphy do: its ``--shape`` when
    given, else each dynamic dim 1 — or, for a named dim (``seq``) that another input's ``--shape`` or
    profile sizes, those sizes, so inputs that share a dim agree.  Returns the profiles and one warning
    per defaulted input (also logged).  A ``--shape`` that does not fit the input (rank, a fixed dim) is
    a :class:`UsageError`.
    """
    given = parse_shapes(list(shapes)) if shapes is not None and not isinstance(shapes, Mapping) else dict(shapes or {})
    inputs = {v.name: v for v in model.graph.inputs if v.name not in model.graph.initializers}
    unknown = sorted(set(given) - set(inputs))
    if unknown:
        raise UsageError(f"--shape given for {', '.join(unknown)}, which the model has no input of; "
                         f"inputs: {', '.join(inputs)}")
    out = dict(profiles)
    named: dict[str, tuple[int, int, int]] = {}  # dim name -> (min, opt, max) where an input sizes it
    for name, v in inputs.items():
        sized = out.get(name) or ((tuple(given[name]),) * 3 if name in given else None)
        known = list(v.shape.dims) if v.shape is not None else []
        if sized is None or any(len(p) != len(known) for p in sized):
            continue
        for axis, d in enumerate(known):
            if not isinstance(d, int) and d.value:
                named.setdefault(d.value, (sized[0][axis], sized[1][axis], sized[2][axis]))
    warnings: list[str] = []
    for name, v in inputs.items():
        dims = list(v.shape.dims) if v.shape is not None else None
        if dims is None or name in out:
            continue
        shown = [d if isinstance(d, int) else (d.value or "?") for d in dims]
        if name in given:
            shape = tuple(int(d) for d in given[name])
            if len(shape) != len(dims) or any(isinstance(d, int) and d != s for d, s in zip(dims, shape)):
                raise UsageError(f"--shape of '{name}': {'x'.join(map(str, shape))} does not fit the input's shape "
                                 f"{shown} (rank, or a fixed dim)")
            if all(isinstance(d, int) for d in dims):
                continue
            prof: Profile = (shape, shape, shape)
            how = "its --shape"
        elif all(isinstance(d, int) for d in dims):
            continue
        else:
            per_dim = [
                (d, d, d) if isinstance(d, int) else named.get(d.value or "", (1, 1, 1)) for d in dims
            ]
            prof = tuple(tuple(p[i] for p in per_dim) for i in range(3))  # type: ignore[assignment]
            how = "dynamic dims set to 1" if not any(not isinstance(d, int) and d.value in named for d in dims) \
                else "dims shared with other inputs sized as those, the others set to 1"
        out[name] = prof
        mn, opt, mx = ("x".join(map(str, s)) for s in prof)
        text = f"the fixed shape {opt}" if mn == opt == mx else f"the profile {mn},{opt},{mx}"
        warnings.append(
            f"dynamic input '{name}' {shown} has no --profile: building for {text} ({how}); "
            f"give --profile {name}:MIN,OPT,MAX for a range of shapes"
        )
        logger.warning("%s", warnings[-1])
    return out, warnings


def _profiles_from_metadata(model: Any) -> dict[str, Profile]:
    from mograph.metadata import read_profiles

    return _normalize_profiles(read_profiles(model))


# ---------------------------------------------------------------------------------------- environment


def trt_available() -> bool:
    """Whether a TensorRT module (``tensorrt`` or ``tensorrt_rtx``) is installed, without importing it."""
    return _trt_loader.find_trt_module() is not None


def gpu_status() -> tuple[bool, str]:
    """``(True, "N CUDA device(s)")`` when the CUDA driver sees a GPU, else ``(False, why)``. Imports nothing heavy."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no NVIDIA GPU driver on this machine (libcuda.so.1 not found)"
    status = cuda.cuInit(0)
    if status != 0:
        return False, f"the CUDA driver could not start (cuInit error {status}): no usable GPU"
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return False, "the CUDA driver sees no GPU"
    return True, f"{count.value} CUDA device(s)"


def _nonstandard_ops(model: Any) -> list[str]:
    """``domain::op`` of nodes (subgraphs included) that are not standard ONNX ops: the parser makes those plugins."""
    import onnx
    import onnx_ir as ir

    seen = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        try:
            known = node.domain in _STANDARD_DOMAINS and onnx.defs.has(node.op_type, node.domain)
        except Exception:  # noqa: BLE001 - an odd domain name
            known = False
        if not known or "plugin_namespace" in node.attributes:
            key = f"{node.domain}::{node.op_type}"
            if key not in seen:
                seen.append(key)
    return seen


def _mograph_plugin_nodes(model: Any) -> list[Any]:
    import onnx_ir as ir

    from mograph.backends.tensorrt_plugins import PLUGIN_NAMESPACE, PLUGINS

    out = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        ns = node.attributes.get("plugin_namespace")
        if ns is not None and str(ns.value) == PLUGIN_NAMESPACE and node.op_type in PLUGINS:
            out.append(node)
    return out


def _needs_lowering(model: Any, registry: Declarations | None) -> bool:
    """Whether ``model`` holds registered custom-op nodes not yet lowered for TensorRT.

    Raises:
        UsageError: no ``registry`` was given and the model calls custom ops (nodes with a model-local
            function body, not plugin nodes): they cannot be lowered without the ops' declarations.
    """
    from mograph._traverse import iter_nodes
    from mograph.lowering import has_custom_ops, is_plugin_node

    if registry is not None:
        return has_custom_ops(model, registry)
    calls = sorted({f"{n.domain}.{n.op_type}" for n in iter_nodes(model.graph)
                    if (n.domain, n.op_type, n.overload) in model.functions and not is_plugin_node(n)})
    if calls:
        raise UsageError(f"the model calls custom ops ({', '.join(calls)}) that must be lowered for tensorrt first: "
                         "give the backend the registry (registry=), as mograph's commands do")
    return False


def _plugin_node_problems(model: Any) -> list[str]:
    """What is wrong with the mograph plugin nodes, each as ``node: problem``; empty when all are legal.

    A plugin node must be exactly what the plugin takes (:class:`mograph.custom_ops.TensorRTPlugin`): its
    fields valid, between the plugin's minimum and maximum input count with no empty input, as many
    outputs as its fields say, and every vector input 1-D of X's last axis where that is known.  The
    ``lower`` step writes nodes this way; anything else (a hand-edited or foreign model) is refused
    here, naming the node, instead of failing inside TensorRT.
    """
    from mograph.errors import PluginError
    from mograph.patterns import constant_array

    problems: list[str] = []
    specs = plugin_specs()
    for node in _mograph_plugin_nodes(model):
        label = f"{node.name or node.op_type} ({node.op_type} plugin)"
        spec = specs[node.op_type]
        try:
            fields = spec.check_fields({k: a.value for k, a in node.attributes.items()})
        except PluginError as exc:
            problems.append(f"{label}: {exc}")
            continue
        version = node.attributes.get("plugin_version")
        if version is None or str(version.value) != spec.version:
            problems.append(f"{label}: plugin_version must be {spec.version!r}")
        n_in = len(node.inputs)
        if not spec.min_inputs <= n_in <= spec.max_inputs:
            problems.append(f"{label}: takes {spec.min_inputs}..{spec.max_inputs} inputs, has {n_in}")
        if any(v is None for v in node.inputs):
            problems.append(f"{label}: has an empty input (leave optional inputs off the end only)")
        want = spec.num_outputs(fields)
        if len(node.outputs) != want:
            problems.append(f"{label}: has {len(node.outputs)} outputs, the plugin gives {want} with these fields")
        x = node.inputs[0] if node.inputs else None
        hidden = x.shape[-1] if x is not None and x.shape is not None and len(x.shape) else None
        for k in spec.vector_inputs:
            value = node.inputs[k] if k < n_in else None
            if value is None:
                continue
            arr = constant_array(value)
            shape = tuple(arr.shape) if arr is not None else (tuple(value.shape) if value.shape is not None else None)
            if shape is None:
                continue
            if len(shape) != 1 or (isinstance(hidden, int) and isinstance(shape[0], int) and shape[0] != hidden):
                problems.append(f"{label}: input {k} ({spec.inputs[k].rstrip('?')}) has shape {list(shape)}, "
                                f"must be 1-D of X's last axis ({hidden})")
    return problems


def _make_logger(trt: Any) -> Any:
    class _Bridge(trt.ILogger):
        """TensorRT's log lines into Python logging; errors and warnings also kept for the report."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.warnings: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                logger.debug("TensorRT error: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings.append(msg)
                logger.debug("TensorRT warning: %s", msg)
            else:
                logger.debug("TensorRT: %s", msg)

    return _Bridge()


# --------------------------------------------------------------------------------------------- building


def build_engine(
    model: Any,
    path: str | os.PathLike[str],
    *,
    fp16: bool = False,
    int8: bool = False,
    profiles: Mapping[str, Any] | Sequence[str] | None = None,
    workspace_mib: int | None = None,
    in_subprocess: bool | None = None,
    shapes: Mapping[str, Sequence[int]] | Sequence[str] | None = None,
    registry: Declarations | None = None,
) -> dict[str, Any]:
    """Build a TensorRT engine from ``model`` and write it to ``path`` (atomically).

    Args:
        model: a path to an ``.onnx`` file, bytes, ``onnx.ModelProto`` or ``onnx_ir.Model``.
        path: the engine file to write.
        fp16: allow float16 kernels (``tensorrt`` only; with ``tensorrt_rtx`` the model's dtypes decide).
        int8: allow int8 kernels (``tensorrt`` only; in practice the model needs Q/DQ nodes).
        profiles: ``{input: (min, opt, max)}`` or ``["input:1x16,8x128,32x512", ...]``; default: the
            model's metadata. A dynamic input without one is built for one fixed shape (``shapes``, else
            its dynamic dims 1), with a warning, as trtexec and Polygraphy do.
        workspace_mib: cap of the builder's workspace memory pool.
        shapes: ``{input: shape}`` or ``["input:1x128", ...]``: the fixed shape of a dynamic input
            without a profile.
        in_subprocess: ``None`` decides (a child process only when the plugin-library trap needs one);
            ``True``/``False`` force it.
        registry: the job's registry (its custom ops): custom-op nodes are lowered for ``tensorrt``
            first; without it nothing is lowered.

    Returns:
        A JSON-able report: ``module``, ``version``, ``engine``, ``engine_bytes``, ``parse_seconds``,
        ``build_seconds``, ``layers``, ``layer_types``, ``plugin_layers`` (layer, plugin, namespace,
        version), ``nonstandard_ops``, ``unsupported`` (empty on success), ``precision``, ``profiles``,
        ``notes``, ``subprocess``.

    Raises:
        BackendUnavailableError: no TensorRT module (names the ``tensorrt`` extra).
        ModelError: the model cannot be loaded.
        UsageError: a profile or shape names no input or does not fit it (rank, a fixed dim).
        EngineBuildError: the parser refused nodes (listed in the message and in ``.report``) or the
            build failed.
    """
    from mograph import ir_io

    trt = _trt_loader.import_trt()
    dest = Path(path)
    source_path = Path(model) if isinstance(model, (str, os.PathLike)) else None
    ir_model = ir_io.load_model(model)
    if source_path is not None and dest.exists() and dest.resolve() == source_path.resolve():
        raise UsageError(f"refusing to write the engine over the input model {source_path}")
    resolved = _normalize_profiles(profiles) if profiles else _profiles_from_metadata(ir_model)
    explicit = set(resolved)
    resolved, defaulted = default_profiles(ir_model, resolved, shapes)
    lowered: dict[str, Any] = {}
    if _needs_lowering(ir_model, registry):  # the backend's first act: the lower step for its target
        from mograph.lowering import lower_model

        if ir_model is model:  # the caller's model: work on a copy
            from mograph import ir_io

            ir_model = ir_io.copy_model(ir_model)
        assert registry is not None
        lowered = dict(lower_model(ir_model, "tensorrt", registry=registry).stats)
        source_path = None  # parse the lowered copy
    problems = _plugin_node_problems(ir_model)
    if problems:
        raise EngineBuildError(
            f"{len(problems)} problem(s) with mograph plugin nodes: " + "; ".join(problems[:5])
            + ("; ..." if len(problems) > 5 else ""),
            report={"plugin_node_problems": problems},
        )
    nonstandard = _nonstandard_ops(ir_model)
    fix = None
    if nonstandard:
        fix = _trt_loader.plugin_lib_fix(trt)
    use_child = in_subprocess if in_subprocess is not None else bool(fix is not None and not fix.in_process)
    if os.environ.get(_WORKER_ENV):
        use_child = False
    with tempfile.TemporaryDirectory(prefix="mograph-trt-") as tmp:
        model_path = source_path
        if model_path is None:
            model_path = Path(tmp) / "model.onnx"
            ir_io.save_model(ir_model, model_path)
        request = {
            "model": str(model_path),
            "engine": str(dest),
            "fp16": bool(fp16),
            "int8": bool(int8),
            "profiles": {k: [list(s) for s in v] for k, v in resolved.items()},
            "workspace_mib": workspace_mib,
        }
        if use_child:
            env = fix.env if fix is not None and fix.env else dict(os.environ)
            report = _build_in_child(request, env)
        else:
            report = _build_here(trt, request)
    report["nonstandard_ops"] = nonstandard
    report["lowered"] = lowered
    report["defaulted_profiles"] = sorted(set(resolved) - explicit)
    report.setdefault("notes", []).extend(defaulted)
    report["plugin_lib_fix"] = fix.how if fix is not None else "not needed (no plugin nodes)"
    report["subprocess"] = use_child
    return report


def _build_here(trt: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Parse and build in this process. ``request`` is what :func:`build_engine` passes (JSON-able)."""
    from mograph.backends.tensorrt_plugins import PLUGIN_NAMESPACE, register_plugins, take_build_errors

    rtx = _trt_loader.is_rtx(trt)
    register_plugins(trt)
    take_build_errors()
    log = _make_logger(trt)
    report: dict[str, Any] = {
        "backend": "tensorrt",
        "module": trt.__name__,
        "version": getattr(trt, "__version__", "?"),
        "model": request["model"],
        "engine": request["engine"],
        "unsupported": [],
        "notes": [],
    }
    builder = trt.Builder(log)
    flags = 0
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    major = str(report["version"]).split(".")[0]
    if explicit is not None and not rtx and major.isdigit() and int(major) < 10:  # TensorRT 8/9: not the default
        flags |= 1 << int(explicit)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, log)
    t0 = time.perf_counter()
    ok = parser.parse_from_file(request["model"])
    report["parse_seconds"] = round(time.perf_counter() - t0, 4)
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        report["unsupported"].append(
            {
                "node": _call(err, "node_name"),
                "op": _call(err, "node_operator"),
                "node_index": _call(err, "node"),
                "error": str(_call(err, "desc")),
            }
        )
    plugin_errors = take_build_errors()
    if plugin_errors:
        report["plugin_errors"] = plugin_errors
        for u in report["unsupported"]:
            if "output shape computation failed" in u["error"]:
                u["error"] = "; ".join(e for e in plugin_errors if e.startswith(f"{u['op']}:")) or u["error"]
    if not ok:
        listed = "; ".join(
            f"{u['op'] or '?'} (node {u['node'] or u['node_index']}): {u['error']}" for u in report["unsupported"][:8]
        )
        more = len(report["unsupported"]) - 8
        raise EngineBuildError(
            f"TensorRT ({trt.__name__}) could not parse {request['model']}: {listed or 'no details'}"
            + (f" (+{more} more)" if more > 0 else ""),
            report,
        )
    _describe_network(trt, network, report, PLUGIN_NAMESPACE)
    config = builder.create_builder_config()
    if request.get("workspace_mib"):
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(request["workspace_mib"]) << 20)
    report["precision"] = _set_precision(trt, config, network, request, rtx, report)
    report["profiles"] = _add_profile(trt, builder, config, network, request["profiles"], report)
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    report["build_seconds"] = round(time.perf_counter() - t0, 3)
    if serialized is None:
        raise EngineBuildError(
            f"TensorRT ({trt.__name__}) could not build an engine: "
            + ("; ".join(log.errors[-5:]) or "no error message"),
            report,
        )
    data = memoryview(serialized)
    report["engine_bytes"] = len(data)
    _write_atomic(Path(request["engine"]), data)
    if log.warnings:
        report["warnings"] = log.warnings[-20:]
    return report


def _call(obj: Any, name: str) -> Any:
    attr = getattr(obj, name, None)
    try:
        return attr() if callable(attr) else attr
    except Exception:  # noqa: BLE001 - a binding that does not have it
        return None


def _describe_network(trt: Any, network: Any, report: dict[str, Any], namespace: str) -> None:
    types: Counter[str] = Counter()
    plugins = []
    plugin_types = {
        getattr(trt.LayerType, n) for n in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3") if hasattr(trt.LayerType, n)
    }
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        types[str(layer.type).split(".")[-1]] += 1
        if layer.type in plugin_types:
            plugins.append(_plugin_info(trt, layer))
    report["layers"] = network.num_layers
    report["layer_types"] = dict(sorted(types.items()))
    report["plugin_layers"] = plugins
    report["mograph_plugin_layers"] = sum(1 for p in plugins if p.get("namespace") == namespace)
    report["inputs"] = {network.get_input(i).name: list(network.get_input(i).shape) for i in range(network.num_inputs)}


def _plugin_info(trt: Any, layer: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"layer": layer.name, "type": str(layer.type).split(".")[-1]}
    try:
        if hasattr(trt, "IPluginV3Layer") and str(layer.type).endswith("PLUGIN_V3"):
            layer.__class__ = trt.IPluginV3Layer
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            info.update(plugin=core.plugin_name, namespace=core.plugin_namespace, version=core.plugin_version)
        elif hasattr(trt, "IPluginV2Layer"):
            layer.__class__ = trt.IPluginV2Layer
            plugin = layer.plugin
            info.update(plugin=plugin.plugin_type, namespace=plugin.plugin_namespace, version=plugin.plugin_version)
    except Exception as exc:  # noqa: BLE001 - the name is a nicety; the layer name is there anyway
        logger.debug("cannot read the plugin of layer %s: %s", layer.name, exc)
    return info


def _set_precision(
    trt: Any, config: Any, network: Any, request: dict[str, Any], rtx: bool, report: dict[str, Any]
) -> dict[str, str]:
    out = {}
    strongly_typed = rtx
    st_flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if st_flag is not None and hasattr(network, "get_flag"):
        strongly_typed = strongly_typed or bool(network.get_flag(st_flag))
    for key, flag_name in (("fp16", "FP16"), ("int8", "INT8")):
        if not request.get(key):
            out[key] = "off"
            continue
        flag = getattr(trt.BuilderFlag, flag_name, None)
        if flag is None or strongly_typed:
            why = f"not applied: {trt.__name__} builds strongly typed networks (no {flag_name} builder flag); " + (
                "the model's own dtypes decide: convert it to float16 first"
                if key == "fp16"
                else "int8 comes only from Q/DQ nodes in the model (e.g. the qdq-int8 pass)"
            )
            out[key] = why
            report["notes"].append(f"--{key} {why}")
            continue
        config.set_flag(flag)
        out[key] = "on"
        if key == "int8":
            has_qdq = any(
                str(network.get_layer(i).type).split(".")[-1] in ("QUANTIZE", "DEQUANTIZE")
                for i in range(network.num_layers)
            )
            if not has_qdq:
                report["notes"].append(
                    "--int8: the model has no Q/DQ nodes and no calibrator is set, so few or no layers run in int8"
                )
    return out


def _add_profile(
    trt: Any, builder: Any, config: Any, network: Any, profiles: dict[str, list[list[int]]], report: dict[str, Any]
) -> dict[str, Any]:
    inputs = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    unknown = sorted(set(profiles) - set(inputs))
    if unknown:
        raise UsageError(
            f"profile given for {', '.join(unknown)}, which the model has no input of; inputs: {', '.join(inputs)}"
        )
    dynamic = {n: s for n, s in inputs.items() if any(d < 0 for d in s)}
    missing = [n for n in dynamic if n not in profiles]
    if missing:
        shown = ", ".join(f"{n} {list(dynamic[n])}" for n in missing)
        example = ",".join("x".join(str(d) if d >= 0 else str(k) for d in dynamic[missing[0]]) for k in (1, 8, 32))
        raise UsageError(
            f"dynamic input(s) without an optimization profile: {shown}; give --profile NAME:MIN,OPT,MAX for each "
            f"(e.g. --profile {missing[0]}:{example}) or store profiles in the model with the set-trt-profile pass"
        )
    used: dict[str, Any] = {}
    for name, prof in profiles.items():
        shape = inputs[name]
        for which in prof:
            if len(which) != len(shape) or any(d >= 0 and d != w for d, w in zip(shape, which)):
                raise UsageError(
                    f"profile of '{name}': shape {tuple(which)} does not fit the input's shape {list(shape)} "
                    "(rank, or a fixed dim)"
                )
        if name not in dynamic:
            report["notes"].append(f"input '{name}' is static {list(shape)}: its profile is not needed, ignored")
            continue
        used[name] = [list(s) for s in prof]
    if used:
        profile = builder.create_optimization_profile()
        for name, (mn, opt, mx) in used.items():
            profile.set_shape(name, tuple(mn), tuple(opt), tuple(mx))
        config.add_optimization_profile(profile)
    return used


def _write_atomic(dest: Path, data: memoryview | bytes) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; an engine is an ordinary output file
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _build_in_child(request: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    env = dict(env)
    env[_WORKER_ENV] = "1"
    level = logging.getLogger("mograph").getEffectiveLevel()
    env["MOGRAPH_TRT_WORKER_LOGLEVEL"] = str(level)
    cmd = [_trt_loader.python_executable(), "-m", "mograph.backends.tensorrt"]
    logger.info("building in a child process (LD_LIBRARY_PATH=%s)", env.get("LD_LIBRARY_PATH", ""))
    proc = subprocess.run(cmd, input=json.dumps(request), capture_output=True, text=True, env=env, check=False)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(_REPORT_MARK):
            result = json.loads(line[len(_REPORT_MARK) :])
    tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
    if proc.stderr:
        logger.debug("child process stderr:\n%s", proc.stderr)
    if result is None:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        raise EngineBuildError(f"the TensorRT build process died ({how}) without a result: {tail or 'no output'}")
    if "error" in result:
        raise _rebuild_error(result)
    return result["report"]


def _rebuild_error(result: dict[str, Any]) -> MographError:
    from mograph import errors

    kind = result.get("type", "")
    message = result["error"]
    if kind == "EngineBuildError":
        return EngineBuildError(message, result.get("report"))
    if kind == "CannotRunError":
        return CannotRunError(message)
    cls = getattr(errors, kind, None)
    if (
        isinstance(cls, type)
        and issubclass(cls, MographError)
        and kind not in ("PassFailedError", "BackendUnavailableError")
    ):
        return cls(message)
    err = MographError(message)
    err.exit_code = int(result.get("exit_code", 1))
    return err


def _worker_main() -> int:
    """Child-process entry: read a build request (JSON) on stdin, print the result line on stdout."""
    level = int(os.environ.get("MOGRAPH_TRT_WORKER_LOGLEVEL", logging.WARNING))
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    request = json.loads(sys.stdin.read())
    try:
        trt = _trt_loader.import_trt()
        report = _build_here(trt, request)
        payload: dict[str, Any] = {"report": report}
    except MographError as exc:
        payload = {"error": str(exc), "type": type(exc).__name__, "exit_code": exc.exit_code}
        if isinstance(exc, EngineBuildError):
            payload["report"] = exc.report
    sys.stdout.write(_REPORT_MARK + json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------------------------- running


def load_engine(path: str | os.PathLike[str]) -> Any:
    """Deserialize an engine file, with the mograph plugins registered first (the engine names them only).

    Raises:
        BackendUnavailableError: no TensorRT module.
        CannotRunError: this TensorRT cannot deserialize here (e.g. ``tensorrt_rtx`` with no GPU).
        ModelError: the file is missing or not an engine of this TensorRT version.
    """
    from mograph.backends.tensorrt_plugins import register_plugins

    trt = _trt_loader.import_trt()
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"{p}: no such engine file")
    register_plugins(trt)
    gpu, why = gpu_status()
    if not gpu:
        raise CannotRunError(f"cannot load a TensorRT engine here: {why}")
    log = _make_logger(trt)
    runtime = trt.Runtime(log)
    engine = runtime.deserialize_cuda_engine(p.read_bytes())
    if engine is None:
        raise ModelError(
            f"{p}: {trt.__name__} {getattr(trt, '__version__', '')} could not deserialize it: "
            + ("; ".join(log.errors[-3:]) or "not an engine of this TensorRT version/GPU")
        )
    # keep the runtime alive as long as the engine
    engine._mograph_runtime = runtime  # type: ignore[attr-defined]
    return engine


def ensure_can_run() -> Any:
    """The TensorRT module, if this machine can run engines; else :class:`CannotRunError` saying why."""
    trt = _trt_loader.import_trt()
    gpu, why = gpu_status()
    if not gpu:
        extra = (
            f" ({trt.__name__} can build engines ahead of time here, but running one needs an NVIDIA GPU)"
            if _trt_loader.is_rtx(trt)
            else ""
        )
        raise CannotRunError(f"cannot run TensorRT engines on this machine: {why}{extra}")
    return trt


class TensorRTBackend(Backend):
    """TensorRT engines (``tensorrt``, or ``tensorrt_rtx`` which also builds without a GPU)."""

    name = "tensorrt"
    target = "tensorrt"
    description = (
        "TensorRT engines with the mograph plugins (builds with tensorrt or tensorrt_rtx; runs on an NVIDIA GPU)"
    )
    extra = "tensorrt"
    module = "tensorrt"

    def available(self) -> bool:
        return trt_available()

    def build(self, model: Any, path: str | os.PathLike[str], **options: Any) -> dict[str, Any]:
        """Build an engine file: see :func:`build_engine`."""
        return build_engine(model, path, **options)

    def make_runner(
        self,
        model: Any,
        *,
        optimizations: bool = True,
        threads: int | None = None,
        providers: list[str] | None = None,
        profiles: Mapping[str, Any] | Sequence[str] | None = None,
        registry: Declarations | None = None,
    ) -> Runner:
        """A runner over an engine built from ``model`` (or an ``.engine``/``.plan`` file), through Polygraphy's TrtRunner.

        Raises :class:`CannotRunError` where no GPU is (``optimizations``/``threads``/``providers`` do not apply).
        """
        trt = ensure_can_run()
        try:
            if _trt_loader.is_rtx(trt):  # Polygraphy picks its TensorRT module from this setting
                os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1"
                import polygraphy.config

                polygraphy.config.USE_TENSORRT_RTX = True
            from polygraphy.backend.trt import TrtRunner
        except ImportError as exc:
            raise BackendUnavailableError("polygraphy", "polygraphy") from exc
        src = Path(model) if isinstance(model, (str, os.PathLike)) else None
        if src is not None and src.suffix in (".engine", ".plan", ".trt"):
            engine = load_engine(src)
        else:
            with tempfile.TemporaryDirectory(prefix="mograph-trt-") as tmp:
                out = Path(tmp) / "model.engine"
                build_engine(model, out, profiles=profiles, registry=registry)
                engine = load_engine(out)
        runner = TrtRunner(engine)
        runner.activate()

        def run(feeds: Mapping[str, Any]) -> dict[str, Any]:
            return dict(runner.infer(dict(feeds)))

        run.runner = runner  # type: ignore[attr-defined]
        return run


BACKEND = TensorRTBackend()


if __name__ == "__main__":  # the child process of build_engine
    sys.exit(_worker_main())
