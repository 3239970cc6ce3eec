"""TensorRT plugins for the mograph custom ops, over the CUDA kernels.

The ``lower`` step with ``--target tensorrt`` writes each fused op that TensorRT has no native layer for as
one ONNX node that the ONNX parser turns into a plugin layer. The parser looks a node whose ``op_type`` it
does not know (or that carries ``plugin_namespace``) up in the plugin registry by *name* = ``op_type``,
*version* = the node's ``plugin_version`` attribute and *namespace* = its ``plugin_namespace`` attribute,
and hands every other attribute to the creator as a plugin field (unknown ones are ignored here). The
node's ``domain`` does not matter to the parser; the lowering uses ``"mograph"``. Seen with
tensorrt_rtx 1.7: such a node becomes the plugin even when its op type is a standard op (``Gelu`` at
opset 20). Each plugin's table (:class:`mograph.custom_ops.TensorRTPlugin`) is part of its custom op's
declaration, declared in :mod:`mograph.kernel_plugins` and read here as :data:`PLUGINS`; it is the contract between the
lowering and these plugins:

=================  ================================  ==========  ====================================
plugin / op_type   inputs (``?`` = optional)         outputs     attributes (default)
=================  ================================  ==========  ====================================
``LayerNorm``      X, Scale, B?                      Y           epsilon (1e-5)
``RMSNorm``        X, Scale                          Y           epsilon (1e-6)
``SkipLayerNorm``  X, Skip, Scale, B?, Bias?         Y, Sum?     epsilon (1e-5), sum_output (0)
``SkipRMSNorm``    X, Skip, Scale, Bias?             Y, Sum?     epsilon (1e-6), sum_output (0)
``Gelu``           X                                 Y           approximate ("none" | "tanh")
``BiasGelu``       X, Bias                           Y           approximate ("none" | "tanh")
=================  ================================  ==========  ====================================

Every node also carries ``plugin_namespace="mograph"`` and ``plugin_version="1"``
(:meth:`~mograph.custom_ops.TensorRTPlugin.node_attributes` writes the whole set). Rules the lowering must keep, because TensorRT
checks them when it parses or builds:

* all tensors share one dtype (float32, float16 or bfloat16) and are contiguous; normalization is over
  the **last** axis; Scale, B and Bias are 1-D with exactly the last axis' size (a ``[1]`` zero constant
  is refused at build time: materialize ``[hidden]`` or leave the input out);
* optional inputs are positional and may only be left out from the end; an empty input name is refused
  by the parser (``addPluginV3: input != nullptr``) — a SkipLayerNorm with a Bias but no B takes a zero B;
* the node has exactly as many outputs as the plugin: SkipLayerNorm and SkipRMSNorm have ``Sum`` (``X + Skip (+ Bias)``,
  rounded to the dtype) as its second output only with ``sum_output=1``; the parser refuses a count
  mismatch ("Node has more output tensors than TRT expected").

How a plugin runs: ``enqueue`` is a thin call to :func:`launch`, which calls the matching C function of the
kernel library ``mograph/_kernels/build/libmograph_kernels.so`` (``mograph/_kernels/include/mograph_kernels.h``) through
ctypes with the device pointers and stream TensorRT hands over. :func:`launch` needs neither TensorRT nor
any CUDA Python package, so the GPU tests call it directly on torch tensors. The library is loaded on first
launch (``MOGRAPH_KERNELS_LIB`` overrides its path); building an engine ahead of time on a machine without
a GPU never loads it.

An engine records only each plugin's name, version, namespace and serialized fields, so a process that
deserializes one must call :func:`register_plugins` first (``mograph.backends.tensorrt.load_engine``
does). TensorRT imports are lazy: importing this module needs neither ``tensorrt`` nor ``tensorrt_rtx``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from mograph.custom_ops import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, CustomOp, TensorRTPlugin
from mograph.errors import PluginError
from mograph.kernel_plugins import TENSORRT_PLUGINS

__all__ = [
    "PLUGINS",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "plugin_specs",
    "kernel_library_path",
    "launch",
    "load_kernels",
    "plugin_attributes",
    "plugin_for_op",
    "register_plugins",
    "take_build_errors",
]

logger = logging.getLogger(__name__)

KERNELS_ENV = "MOGRAPH_KERNELS_LIB"

#: Plugins with a residual input (Skip) and the optional Sum output.
SKIP_PLUGINS = ("SkipLayerNorm", "SkipRMSNorm")
#: The plugins this module implements (one kernel switch each, in :func:`launch`).
IMPLEMENTED = ("LayerNorm", "RMSNorm", "SkipLayerNorm", "SkipRMSNorm", "Gelu", "BiasGelu")


def plugin_specs() -> dict[str, TensorRTPlugin]:
    """The mograph-namespace plugins this module implements, as declared in :mod:`mograph.kernel_plugins`."""
    return {name: spec for name, spec in TENSORRT_PLUGINS.items()
            if spec.namespace == PLUGIN_NAMESPACE and name in IMPLEMENTED}


#: The mograph TensorRT plugins, by plugin name (declared in :mod:`mograph.kernel_plugins`).
PLUGINS: Mapping[str, TensorRTPlugin] = plugin_specs()


def plugin_for_op(op: str, ops: Mapping[tuple[str, str], CustomOp] | None = None) -> TensorRTPlugin:
    """The plugin named ``op`` (``"LayerNorm"``), or, given the declared ``ops``, the plugin of the mograph
    custom op ``op`` (``"FastGelu"`` -> ``Gelu``)."""
    decl = ops.get((DOMAIN, op)) if ops is not None else None
    spec = decl.tensorrt_plugin if decl is not None else PLUGINS.get(op)
    if spec is None:
        raise PluginError(f"no mograph TensorRT plugin for op {op!r}; known: {', '.join(sorted(PLUGINS))}")
    return spec


def plugin_attributes(op: str, **attrs: Any) -> dict[str, Any]:
    """Attributes for an ONNX node of ``op``'s plugin: ``plugin_attributes("LayerNorm", epsilon=1e-12)``."""
    return plugin_for_op(op).node_attributes(**attrs)


def _check_attrs(spec: TensorRTPlugin, attrs: dict[str, Any]) -> dict[str, Any]:
    return spec.check_fields(attrs)


# ------------------------------------------------------------------------------------------ kernel library

_GELU_TANH = 1
_DTYPE_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def kernel_library_path() -> Path:
    """Where the kernel library is looked for: ``$MOGRAPH_KERNELS_LIB``, else ``mograph/_kernels/build/``."""
    from mograph._kernels import build

    return build.library_path()


def load_kernels(path: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """Load (once) the mograph CUDA kernel library and declare its C functions (:func:`mograph._kernels.abi.load`).

    Raises:
        PluginError: the library is missing (build it with ``python -m mograph._kernels.build``), cannot be
            loaded, or has another ABI version.
    """
    from mograph._kernels import abi

    global _lib
    with _lib_lock:
        if _lib is not None and path is None:
            return _lib
        lib_path = Path(path) if path is not None else kernel_library_path()
        if not lib_path.exists():
            raise PluginError(
                f"mograph kernel library not found at {lib_path}: build it with `python -m mograph._kernels.build` "
                f"or point {KERNELS_ENV} at it"
            )
        try:
            lib = abi.load(lib_path)
        except (OSError, AttributeError, RuntimeError) as exc:
            raise PluginError(f"cannot load the mograph kernel library {lib_path}: {exc}") from exc
        if path is None:
            _lib = lib
        return lib


def _dtype_name(dtype: Any) -> str:
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    name = str(name if name is not None else dtype)
    aliases = {
        "float": "float32",
        "fp32": "float32",
        "half": "float16",
        "fp16": "float16",
        "bf16": "bfloat16",
        "torch.float32": "float32",
        "torch.float16": "float16",
        "torch.bfloat16": "bfloat16",
    }
    name = aliases.get(name.lower(), name.lower())
    if name not in _DTYPE_SUFFIX:
        raise PluginError(f"mograph plugins run float32, float16 or bfloat16, not {dtype!r}")
    return name


def _rows_hidden(shape: Sequence[int]) -> tuple[int, int]:
    dims = [int(d) for d in shape]
    if not dims:
        return 1, 1
    return math.prod(dims[:-1]), dims[-1]


def _skip_broadcast(spec: TensorRTPlugin, x: tuple[int, ...], skip: tuple[int, ...]) -> tuple[tuple[int, ...], int, bool]:
    """SkipLayerNorm's X and Skip shapes -> (full shape, launches, swap X and Skip).

    Equal shapes take one launch. One of them may be broadcast over *leading* axes (``[1, seq, hidden]``
    position embeddings added to ``[batch, seq, hidden]``): then there is one launch per leading index.
    """
    if x == skip:
        return x, 1, False
    if len(x) != len(skip):
        raise PluginError(f"{spec.name}: X {x} and Skip {skip} have different ranks")
    full = tuple(max(a, b) for a, b in zip(x, skip))
    small, swap = (x, True) if x != full else (skip, False)
    if (skip if swap else x) != full:
        raise PluginError(f"{spec.name}: X {x} and Skip {skip} do not broadcast to one of them")
    k = 0
    while k < len(full) and small[k] == 1 and full[k] != 1:
        k += 1
    if small[k:] != full[k:]:
        raise PluginError(
            f"{spec.name}: Skip {skip} broadcasts against X {x} over inner axes; only leading axes may be broadcast"
        )
    return full, math.prod(full[:k]), swap


def launch(
    op: str,
    attrs: dict[str, Any],
    input_ptrs: Sequence[int],
    output_ptrs: Sequence[int],
    shapes: Sequence[Sequence[int]],
    dtype: Any,
    stream: int = 0,
    *,
    lib: ctypes.CDLL | None = None,
) -> None:
    """Enqueue the kernel of ``op`` on ``stream``; returns at once (no synchronization, no allocation).

    This is all a plugin's ``enqueue`` does, so it can be tested without TensorRT.

    Args:
        op: a mograph op / plugin name (``"LayerNorm"``).
        attrs: the op's attributes (missing ones take the defaults of :data:`PLUGINS`).
        input_ptrs: device pointers of the present inputs, in the order of the plugin's inputs.
        output_ptrs: device pointers of the outputs (``Sum`` of SkipLayerNorm only when ``sum_output``).
        shapes: shapes of the inputs (at least the first), in elements.
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` (or a numpy/torch dtype of those).
        stream: ``cudaStream_t`` as an integer; 0 is the legacy default stream.
        lib: the kernel library (default: :func:`load_kernels`).

    Raises:
        PluginError: wrong number of pointers, mismatched shapes, an unsupported dtype, or a kernel that
            returned an error status (its message says which).
    """
    spec = plugin_for_op(op)
    attrs = _check_attrs(spec, attrs)
    n_in = len(input_ptrs)
    if not spec.min_inputs <= n_in <= spec.max_inputs:
        raise PluginError(f"{spec.name}: takes {spec.min_inputs}..{spec.max_inputs} inputs, got {n_in}")
    n_out = spec.num_outputs(attrs)
    if len(output_ptrs) != n_out:
        raise PluginError(f"{spec.name}: expects {n_out} output pointer(s), got {len(output_ptrs)}")
    if not shapes:
        raise PluginError(f"{spec.name}: the shape of input 0 is needed")
    x_shape = tuple(int(d) for d in shapes[0])
    reps, stride = 1, 0
    if spec.name in SKIP_PLUGINS and len(shapes) > 1:
        x_shape, reps, swap = _skip_broadcast(spec, x_shape, tuple(int(d) for d in shapes[1]))
        if swap:  # X is the broadcast one: s = x + skip is symmetric, so hand the kernel the full one as x
            input_ptrs = [input_ptrs[1], input_ptrs[0], *input_ptrs[2:]]
        stride = math.prod(x_shape) // reps
    rows, hidden = _rows_hidden(x_shape)
    if rows * hidden == 0:
        return
    for k in range(1, min(len(shapes), n_in)):
        name = spec.inputs[k].rstrip("?")
        if name != "Skip" and math.prod(int(d) for d in shapes[k]) != hidden:
            raise PluginError(
                f"{spec.name}: {name} must have {hidden} elements (X's last axis), got {tuple(shapes[k])}"
            )
    dname = _dtype_name(dtype)
    suffix = _DTYPE_SUFFIX[dname]
    lib = lib if lib is not None else load_kernels()
    ins = [ctypes.c_void_p(int(p)) for p in input_ptrs]
    outs = [ctypes.c_void_p(int(p)) for p in output_ptrs]
    null = ctypes.c_void_p(None)
    strm = ctypes.c_void_p(int(stream) if stream else None)
    eps = ctypes.c_float(float(attrs.get("epsilon", 0.0)))
    flags = _GELU_TANH if attrs.get("approximate") == "tanh" else 0

    def opt(k: int) -> ctypes.c_void_p:
        return ins[k] if k < n_in else null

    if spec.name == "LayerNorm":
        status = getattr(lib, f"mograph_layer_norm_{suffix}")(
            ins[0], ins[1], opt(2), outs[0], rows, hidden, eps, 0, strm
        )
    elif spec.name == "RMSNorm":
        status = getattr(lib, f"mograph_rms_norm_{suffix}")(ins[0], ins[1], outs[0], rows, hidden, eps, 0, strm)
    elif spec.name in SKIP_PLUGINS:
        rms = spec.name == "SkipRMSNorm"
        fn = getattr(lib, f"mograph_skip_{'rms' if rms else 'layer'}_norm_{suffix}")
        step = stride * _ITEMSIZE[dname]
        status = 0
        for r in range(reps):  # one launch, or one per leading index the Skip is broadcast over
            off = r * step

            def at(ptr: ctypes.c_void_p, off: int = off) -> ctypes.c_void_p:
                return ctypes.c_void_p(ptr.value + off) if ptr.value else ptr

            sum_out = at(outs[1]) if n_out > 1 else null
            if rms:  # X, Skip, Scale, Bias?
                status = fn(at(ins[0]), ins[1], opt(3), ins[2], at(outs[0]), sum_out, rows // reps, hidden, eps, 0,
                            strm)  # fmt: skip
            else:  # X, Skip, Scale, B?, Bias?
                status = fn(at(ins[0]), ins[1], opt(4), ins[2], opt(3), at(outs[0]), sum_out, rows // reps, hidden,
                            eps, 0, strm)  # fmt: skip
            if status != 0:
                break
    elif spec.name == "Gelu":
        status = getattr(lib, f"mograph_gelu_{suffix}")(ins[0], outs[0], rows * hidden, flags, strm)
    elif spec.name == "BiasGelu":
        status = getattr(lib, f"mograph_bias_gelu_{suffix}")(ins[0], ins[1], outs[0], rows, hidden, flags, strm)
    else:  # pragma: no cover - PLUGINS and this switch are kept in step
        raise PluginError(f"{spec.name}: no kernel")
    if status != 0:
        msg = lib.mograph_kernels_status_string(status)
        text = msg.decode(errors="replace") if isinstance(msg, bytes) else str(msg)
        raise PluginError(f"{spec.name}: kernel failed with status {status} ({text})")


# ------------------------------------------------------------------------------------ TensorRT plugins

_registered: dict[str, Any] = {}  # keeps the creators alive: TensorRT holds only a raw pointer
_classes: dict[str, dict[str, tuple[type, type]]] = {}  # TensorRT module name -> plugin name -> classes
_reg_lock = threading.Lock()


def _field_type(trt: ModuleType, default: Any) -> Any:
    if isinstance(default, bool) or isinstance(default, int):
        return trt.PluginFieldType.INT32
    if isinstance(default, float):
        return trt.PluginFieldType.FLOAT32
    return trt.PluginFieldType.CHAR


def _to_field(trt: ModuleType, name: str, value: Any, default: Any) -> Any:
    import numpy as np

    if isinstance(default, str):
        data = np.frombuffer(str(value).encode() + b"\0", dtype=np.int8).copy()
    elif isinstance(default, float):
        data = np.array([float(value)], dtype=np.float32)
    else:
        data = np.array([int(value)], dtype=np.int32)
    return trt.PluginField(name, data, _field_type(trt, default))


def _from_field(f: Any, default: Any) -> Any:
    import numpy as np

    data = f.data
    if isinstance(default, str):
        raw = np.asarray(data).astype(np.uint8).tobytes() if not isinstance(data, (bytes, str)) else data
        if isinstance(raw, str):
            return raw.rstrip("\0")
        return raw.split(b"\0", 1)[0].decode()
    arr = np.asarray(data).reshape(-1)
    if arr.size == 0:
        return default
    return float(arr[0]) if isinstance(default, float) else int(arr[0])


def _fields_to_attrs(spec: TensorRTPlugin, fc: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for f in fc or []:
        if f.name in spec.attributes:
            attrs[f.name] = _from_field(f, spec.attributes[f.name])
        else:  # the parser hands every node attribute over; ours are named in PLUGINS
            logger.debug("%s: ignoring field %r", spec.name, f.name)
    return _check_attrs(spec, attrs)


_build_errors: list[str] = []


def take_build_errors() -> list[str]:
    """Messages of the shape checks that refused plugin inputs since the last call (for build reports)."""
    out = list(_build_errors)
    _build_errors.clear()
    return out


def _const_dims(dims: Any) -> list[int | None]:
    """A DimsExprs as sizes, ``None`` for a dimension only known at run time."""
    out: list[int | None] = []
    for i in range(len(dims)):
        d = dims[i]
        out.append(int(d.get_constant_value()) if d.is_constant() else None)
    return out


def _check_plugin_dims(spec: TensorRTPlugin, shapes: list[list[int | None]]) -> None:
    """Refuse, at build time, input shapes the kernels cannot take (what :func:`launch` would refuse later)."""
    x = shapes[0]
    if not x:
        raise ValueError(f"{spec.name}: X must have at least one dimension")
    hidden = x[-1]
    for k in range(1, len(shapes)):
        name = spec.inputs[k].rstrip("?")
        shape = shapes[k]
        if name == "Skip":
            if len(shape) != len(x) or any(
                a is not None and b is not None and a != b and 1 not in (a, b) for a, b in zip(shape, x)
            ):
                raise ValueError(
                    f"{spec.name}: Skip {shape} must have X's shape {x} (or be broadcast over leading axes)"
                )
            if shape[-1] != x[-1] and None not in (shape[-1], x[-1]):
                raise ValueError(f"{spec.name}: Skip {shape} and X {x} differ in the normalized (last) axis")
            continue
        known = [d for d in shape if d is not None]
        if len(known) == len(shape) and hidden is not None and math.prod(known) != hidden:
            raise ValueError(
                f"{spec.name}: {name} has shape {shape}, but must be 1-D of X's last axis ({hidden}); "
                "materialize it as a [hidden] tensor"
            )


def _plugin_classes(trt: ModuleType) -> dict[str, tuple[type, type]]:
    """Define (once per TensorRT module) one IPluginV3 class and one creator class per :data:`PLUGINS` entry."""
    import numpy as np

    key = trt.__name__
    if key in _classes:
        return _classes[key]
    supported = {trt.DataType.FLOAT: "float32", trt.DataType.HALF: "float16"}
    if hasattr(trt.DataType, "BF16"):
        supported[trt.DataType.BF16] = "bfloat16"

    class MographPluginBase(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):  # type: ignore[name-defined,misc]
        """Shape/type inference, formats and serialization shared by the mograph plugins; enqueue -> launch()."""

        spec: TensorRTPlugin

        def __init__(self, attrs: dict[str, Any] | None = None, phase: Any = None) -> None:
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.attrs = _check_attrs(self.spec, dict(attrs or {}))
            self.phase = phase
            self.plugin_name = self.spec.name
            self.plugin_namespace = PLUGIN_NAMESPACE
            self.plugin_version = PLUGIN_VERSION
            self.num_outputs = self.spec.num_outputs(self.attrs)
            self.timing_cache_id = ""

        # core
        def get_capability_interface(self, type: Any) -> Any:
            return self

        def clone(self) -> Any:
            return type(self)(dict(self.attrs), self.phase)

        def get_fields_to_serialize(self) -> Any:
            return trt.PluginFieldCollection(
                [_to_field(trt, k, self.attrs[k], d) for k, d in self.spec.attributes.items()]
            )

        # build
        def get_output_data_types(self, input_types: Sequence[Any]) -> list[Any]:
            return [input_types[0]] * self.num_outputs

        def get_output_shapes(self, inputs: Sequence[Any], shape_inputs: Sequence[Any], expr_builder: Any) -> list[Any]:
            n = len(inputs)
            if not self.spec.min_inputs <= n <= self.spec.max_inputs:
                raise ValueError(
                    f"{self.spec.name}: takes {self.spec.min_inputs}..{self.spec.max_inputs} inputs, got {n}"
                )
            try:
                _check_plugin_dims(self.spec, [_const_dims(d) for d in inputs])
            except ValueError as exc:
                _build_errors.append(str(exc))  # TensorRT reports only "output shape computation failed"
                raise
            out = trt.DimsExprs(inputs[0])
            if self.spec.name in SKIP_PLUGINS and len(inputs[1]) == len(out):  # leading-axis broadcast of Skip
                for i in range(len(out)):
                    out[i] = expr_builder.operation(trt.DimensionOperation.MAX, inputs[0][i], inputs[1][i])
            return [trt.DimsExprs(out) for _ in range(self.num_outputs)]

        def supports_format_combination(self, pos: int, in_out: Sequence[Any], num_inputs: int) -> bool:
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR or desc.type not in supported:
                return False
            return pos == 0 or desc.type == in_out[0].desc.type

        def configure_plugin(self, inp: Sequence[Any], out: Sequence[Any]) -> None:
            return None

        def get_workspace_size(self, inp: Sequence[Any], out: Sequence[Any]) -> int:
            return 0

        # runtime
        def on_shape_change(self, inp: Sequence[Any], out: Sequence[Any]) -> None:
            return None

        def attach_to_context(self, context: Any) -> Any:
            return self.clone()

        def enqueue(
            self,
            input_desc: Sequence[Any],
            output_desc: Sequence[Any],
            inputs: Sequence[int],
            outputs: Sequence[int],
            workspace: int,
            stream: int,
        ) -> None:
            launch(
                self.spec.name,
                self.attrs,
                list(inputs),
                list(outputs),
                [tuple(d.dims) for d in input_desc],
                supported.get(input_desc[0].type, str(input_desc[0].type)),
                stream,
            )

    class MographCreatorBase(trt.IPluginCreatorV3One):  # type: ignore[name-defined,misc]
        spec: TensorRTPlugin
        plugin_class: type

        def __init__(self) -> None:
            trt.IPluginCreatorV3One.__init__(self)
            self.name = self.spec.name
            self.plugin_namespace = PLUGIN_NAMESPACE
            self.plugin_version = PLUGIN_VERSION
            self.field_names = trt.PluginFieldCollection(
                [trt.PluginField(k, np.array([]), _field_type(trt, d)) for k, d in self.spec.attributes.items()]
            )

        def create_plugin(self, name: str, fc: Any, phase: Any) -> Any:
            return self.plugin_class(_fields_to_attrs(self.spec, fc), phase)

    classes = {}
    for spec in PLUGINS.values():
        plugin_cls = type(
            f"{spec.name}Plugin", (MographPluginBase,), {"spec": spec, "__doc__": f"{spec.name}: {spec.doc}"}
        )
        creator_cls = type(f"{spec.name}PluginCreator", (MographCreatorBase,), {"spec": spec, "plugin_class": plugin_cls})
        classes[spec.name] = (plugin_cls, creator_cls)
    _classes[key] = classes
    return classes


def register_plugins(trt: ModuleType | None = None) -> list[str]:
    """Register every mograph plugin creator in TensorRT's plugin registry under namespace ``mograph``.

    Idempotent. Call it before parsing a model with mograph plugin nodes or deserializing an engine
    that contains them. Returns the registered plugin names.

    Raises:
        BackendUnavailableError: no TensorRT module (when ``trt`` is not given).
        PluginError: TensorRT refused a creator.
    """
    if trt is None:
        from mograph.backends._trt_loader import import_trt

        trt = import_trt()
    with _reg_lock:
        registry = trt.get_plugin_registry()
        names = []
        for name, (_plugin_cls, creator_cls) in _plugin_classes(trt).items():
            key = f"{trt.__name__}:{name}"
            names.append(name)
            if key in _registered:
                continue
            creator = creator_cls()
            if not registry.register_creator(creator, PLUGIN_NAMESPACE):
                existing = None
                try:
                    existing = registry.get_creator(name, PLUGIN_VERSION, PLUGIN_NAMESPACE)
                except Exception:  # noqa: BLE001 - some versions raise instead of returning None
                    existing = None
                if existing is None:
                    raise PluginError(f"TensorRT refused to register the plugin creator {PLUGIN_NAMESPACE}::{name}")
                logger.info(
                    "plugin %s::%s was already registered by someone else; keeping theirs", PLUGIN_NAMESPACE, name
                )
            _registered[key] = creator
        return names
