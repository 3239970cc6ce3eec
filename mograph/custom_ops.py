"""Declarations of custom operators: one record per op, registered through plugins.

A fused op (``mograph.LayerNorm``, ``mograph.Gelu`` ...) is declared once, here in shape, by the
plugin that owns it, with everything every other part of mograph needs:

* ``schema``: inputs, outputs, attributes with defaults;
* ``reference``: a numpy implementation — the ground truth kernels and lowerings are tested against;
* ``function``: an ONNX function body in standard ops, so any ONNX runtime runs the fused model as
  it is and numerics can always be checked;
* ``infer_shapes``: output types/shapes from input ones;
* ``lowerings``: per target (``"onnx"``, ``"ort"``, ``"tensorrt"``) how a node of this op becomes
  something that runtime runs natively.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CustomOp", "DOMAIN", "DOMAIN_VERSION"]

#: The domain all built-in fused ops live in, and its version.
DOMAIN = "mograph"
DOMAIN_VERSION = 1


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
        function: builds the ONNX function body (an ``onnx_ir.Function``) for given attributes,
            or ``None`` if the op has none.
        infer_shapes: ``infer_shapes(node) -> None`` sets the output values' dtype and shape.
        lowerings: target name -> ``lower(node, model) -> bool`` that replaces the node with what
            the target runs natively (returns ``False`` when it cannot, leaving the node).
    """

    name: str
    domain: str = DOMAIN
    version: int = DOMAIN_VERSION
    doc: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    attributes: dict[str, Any] = field(default_factory=dict)
    reference: Callable[..., Any] | None = None
    function: Callable[..., Any] | None = None
    infer_shapes: Callable[..., Any] | None = None
    lowerings: dict[str, Callable[..., Any]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.name)
