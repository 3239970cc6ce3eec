"""Declarations of custom operators: one record per op, registered through plugins.

A fused op (``mograph.LayerNorm``, ``mograph.Gelu`` ...) is declared once, by the plugin that owns it,
with everything every other part of mograph needs:

* ``schema``: inputs, outputs, attributes with defaults;
* ``reference``: a numpy implementation — the ground truth kernels and lowerings are tested against;
* ``function``: an ONNX function body in standard ops, so any ONNX runtime runs the fused model as
  it is and numerics can always be checked;
* ``infer_shapes``: output types/shapes from input ones;
* ``lowerings``: per target (``"onnx"``, ``"ort"``, ``"tensorrt"``, or a plugin's own) how a node of
  this op becomes what that runtime runs natively.  The one ``lower`` step
  (:mod:`mograph.lowering`) calls them; fusion passes never lower;
* ``tensorrt_plugin``: the TensorRT plugin that implements the op, with its attribute table — the
  contract between the lowering that writes plugin nodes and the backend that builds them.

Fusion rules emit and match only these canonical ops; nothing else knows how an op is spelled on a
target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mograph.errors import PluginError

if TYPE_CHECKING:
    import onnx_ir as ir

    from mograph.foreign_ops import ForeignOp
    from mograph.targets import Target

__all__ = ["CustomOp", "Declarations", "TensorRTPlugin", "Lowering", "ShapeFn", "DOMAIN", "DOMAIN_VERSION", "PLUGIN_NAMESPACE",
           "PLUGIN_VERSION"]

#: The domain all built-in fused ops live in, and its version.
DOMAIN = "mograph"
DOMAIN_VERSION = 1
#: Namespace and version of mograph's TensorRT plugins (attributes of every plugin node).
PLUGIN_NAMESPACE = "mograph"
PLUGIN_VERSION = "1"

#: ``dims(node, query) -> list | None``: a shape rule's symbolic dims of each output, read from the inputs through
#: ``query`` (a :class:`mograph.shapes.ShapeQuery`; the shape facility sits above these declarations, so the
#: type is not named here).  ``values(node, query)``: the elements of a small int64 vector the op computes.
ShapeFn = Callable[["ir.Node", Any], Any]

#: ``lower(node, ctx) -> bool``: replace ``node`` (still in its graph) by the target's form and
#: return True, or return False to leave it (it then keeps its function body, or is inlined for
#: ``--target onnx``).  ``ctx`` is a :class:`mograph.lowering.LoweringContext` (the lowering layer
#: sits above these declarations, so the type is not named here).
Lowering = Callable[["ir.Node", Any], bool]


@dataclass(frozen=True)
class TensorRTPlugin:
    """A TensorRT plugin (IPluginV3) as ONNX sees it: one node whose ``op_type`` is the plugin name.

    TensorRT's ONNX parser looks such a node up by name, ``plugin_version`` and ``plugin_namespace``
    and hands every other attribute to the plugin as a field.

    Attributes:
        name: plugin name, the ``op_type`` of its nodes.
        inputs: input names in order; a trailing ``?`` marks an optional input (left out only from
            the end: the parser refuses empty input names).
        outputs: output names; a trailing ``?`` marks one present only when ``output_flag`` is 1.
        attributes: field name -> default; the default's Python type (float, int, str) is the type.
        choices: field name -> allowed values.
        minimum: field name -> smallest allowed value (numbers).
        vector_inputs: indices of inputs that must be 1-D ``[hidden]`` (the last axis of input 0).
        output_flag: the int field that switches the optional outputs on.
        doc: the math, in one line.
        namespace, version: ``plugin_namespace`` / ``plugin_version`` of its nodes.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, Any] = field(default_factory=dict)
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    minimum: dict[str, float] = field(default_factory=dict)
    vector_inputs: tuple[int, ...] = ()
    output_flag: str | None = None
    doc: str = ""
    namespace: str = PLUGIN_NAMESPACE
    version: str = PLUGIN_VERSION

    @property
    def min_inputs(self) -> int:
        return sum(1 for i in self.inputs if not i.endswith("?"))

    @property
    def max_inputs(self) -> int:
        return len(self.inputs)

    def num_outputs(self, attrs: dict[str, Any]) -> int:
        """How many outputs a node with these fields has."""
        required = sum(1 for o in self.outputs if not o.endswith("?"))
        if self.output_flag is not None and int(attrs.get(self.output_flag, 0)):
            return len(self.outputs)
        return required

    def check_fields(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """The plugin's fields with defaults filled in; :class:`PluginError` for an unknown or bad one."""
        unknown = set(attrs) - set(self.attributes) - {"plugin_namespace", "plugin_version"}
        if unknown:
            raise PluginError(f"plugin {self.name}: unknown attribute(s) {sorted(unknown)}")
        out = {k: v for k, v in {**self.attributes, **attrs}.items() if k in self.attributes}
        for key, default in self.attributes.items():
            value = out[key]
            try:
                value = type(default)(value.decode() if isinstance(value, bytes) else value)
            except (TypeError, ValueError) as exc:
                raise PluginError(f"plugin {self.name}: {key} must be a {type(default).__name__}, got {value!r}") from exc
            if isinstance(value, float) and not math.isfinite(value):
                raise PluginError(f"plugin {self.name}: {key} must be finite, got {value!r}")
            allowed = self.choices.get(key)
            if allowed is not None and value not in allowed:
                raise PluginError(f"plugin {self.name}: {key} must be one of {', '.join(map(repr, allowed))}, "
                                  f"got {value!r}")
            low = self.minimum.get(key)
            if low is not None and value < low:
                raise PluginError(f"plugin {self.name}: {key} must be >= {low:g}, got {value!r}")
            out[key] = value
        return out

    def node_attributes(self, **attrs: Any) -> dict[str, Any]:
        """Every attribute of a node of this plugin: fields (checked, defaults filled in), namespace, version."""
        out = self.check_fields(attrs)
        out["plugin_namespace"] = self.namespace
        out["plugin_version"] = self.version
        return out


@dataclass(frozen=True)
class CustomOp:
    """One custom operator.

    Attributes:
        name: op type, e.g. ``"LayerNorm"``.
        domain: op domain (``"mograph"`` for built-ins).
        version: domain version the op belongs to.
        doc: one paragraph: the math, dtypes, limits.
        inputs: input names in order; a trailing ``?`` marks an optional input.
        outputs: output names in order; a trailing ``?`` marks an optional output.
        attributes: attribute names and their defaults.
        reference: numpy implementation ``reference(*inputs, **attributes) -> tuple[np.ndarray, ...]``.
        function: ``function(opset) -> onnx_ir.Function``: the body in default-domain ops of that
            opset (``None`` if the op has none: then it cannot run outside its lowerings).
        infer_shapes: ``infer_shapes(node) -> None`` sets the output values' dtype and shape.
        shape_dims: the op's symbolic shape rule (:data:`ShapeFn`): the dims of each output as
            :class:`mograph.shapes.Dim` tuples, read from the inputs through the query passes ask; the
            registry files it under ``(domain, name, version)`` (:func:`mograph.shapes.rules_for`).
            ``None``: the query keeps what ONNX inference left on the outputs.
        shape_values: for an op that computes a small int64 shape vector, its elements (same table).
        lowerings: target name -> :data:`Lowering`.
        onnx_opset: the default-domain opset from which the ``onnx`` lowering has a standard op
            (``--upgrade-opset`` raises the opset to reach it); ``None`` if it never has one.
        tensorrt_plugin: the TensorRT plugin implementing the op, if any.
        tensorrt_fields: the plugin fields that tell this op apart from other ops sharing its plugin
            (``FastGelu``: ``{"approximate": "tanh"}`` on the ``Gelu`` plugin), so a plugin node can be
            read back as its op (to check it through the op's function body).
        computes: the computation the op is a fused form of (``"LayerNorm"``, ``"RMSNorm"``, ``"GELU"``,
            ``"attention"``), so "which op types are an already-fused X" is read off the declarations
            (:func:`fused_kinds`); ``None`` for an op that is no such computation.
        affine: ``(gamma input, beta input)`` of a normalization whose output is ``normalized * gamma +
            beta`` over the last axis (a pass may fold a per-channel scale into them); ``None`` otherwise.
        float_generic_opset: the lowest default-domain opset at which the function body computes in its
            float inputs' dtype (15 for a body that needs ``CastLike``); below it the body computes float32
            whatever it is given, so the fp16 pass raises such a model to it (or, where it cannot be converted,
            keeps the node float32).  ``None``: at every opset.
    """

    name: str
    domain: str = DOMAIN
    version: int = DOMAIN_VERSION
    doc: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    attributes: dict[str, Any] = field(default_factory=dict)
    reference: Callable[..., Any] | None = None
    function: Callable[[int], Any] | None = None
    infer_shapes: Callable[..., Any] | None = None
    shape_dims: ShapeFn | None = None
    shape_values: ShapeFn | None = None
    lowerings: dict[str, Lowering] = field(default_factory=dict)
    onnx_opset: int | None = None
    tensorrt_plugin: TensorRTPlugin | None = None
    tensorrt_fields: dict[str, Any] = field(default_factory=dict)
    computes: str | None = None
    affine: tuple[int, int] | None = None
    float_generic_opset: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.name)


class Declarations(Protocol):
    """What the plugins declared, as library code reads it: the facts a composition root hands down.

    :class:`mograph.plugins.Registry` is one; library code (lowering, backends, passes) takes such an
    object as a parameter instead of looking the registry up itself.
    """

    @property
    def custom_ops(self) -> Mapping[tuple[str, str], CustomOp]: ...

    @property
    def custom_op_source(self) -> Mapping[tuple[str, str], str]: ...

    @property
    def backends(self) -> Mapping[str, Any]: ...

    @property
    def targets(self) -> Mapping[str, Target]: ...

    @property
    def foreign_ops(self) -> Mapping[tuple[str, str], ForeignOp]: ...
