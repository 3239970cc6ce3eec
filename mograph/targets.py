"""Declarations of lowering targets: one record per ``--target``, registered through plugins.

A target says what the one ``lower`` step (:mod:`mograph.lowering`) does with a model's custom ops
(``mograph.*`` and plugins' ops): whether it asks each op's declared lowering for it, and what
happens to a node whose op has no lowering for it or whose lowering declines (a *leftover*):

``inline``
    the op's function body replaces the node, so the result has no custom domain; an op without a
    body is an error (``--target onnx``);
``keep``
    the node stays as the custom op with its function body (any ONNX runtime can still run it).

The built-in targets are :data:`BUILTIN_TARGETS`; a plugin adds one with ``mograph_add_targets``
(:mod:`mograph.hookspecs`).  A name that only an op's lowerings or a backend's ``target`` names is a
target too, with the defaults of :class:`Target` (lower, keep leftovers).  Nothing in mograph
compares a target's name with a literal: what differs between targets is written here, as data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BUILTIN_TARGETS", "DEFAULT_TARGET", "LOWER_PASS", "Target"]

#: The ``--target`` of a pipeline that names none.
DEFAULT_TARGET = "onnx"
#: Name of the lowering pass.
LOWER_PASS = "lower"


@dataclass(frozen=True)
class Target:
    """One lowering target.

    Attributes:
        name: the ``--target`` name.
        description: one line for listings.
        lowers: the ``lower`` step asks each op's ``lowerings[name]``; ``False`` keeps every custom op
            as it is (with its function body), and no clean-up preset follows the step.
        leftovers: what becomes of a node that has no lowering for the target or whose lowering
            declines: ``"inline"`` (its function body, an error without one) or ``"keep"``.
        standard_opset: its forms are standard ONNX ops whose availability depends on the model's
            default-domain opset, so ``--upgrade-opset`` may raise the opset before lowering.
    """

    name: str
    description: str = ""
    lowers: bool = True
    leftovers: Literal["inline", "keep"] = "keep"
    standard_opset: bool = False


#: The targets every installation has: ``onnx`` and ``mograph`` are generic; ``ort`` and
#: ``tensorrt`` are the built-in backends' targets.  Registered by the built-in plugin
#: ``mograph.lowering``, through the same hook as a plugin's targets.
BUILTIN_TARGETS: tuple[Target, ...] = (
    Target("onnx", "standard ONNX only: standard ops where the opset has them, else the function body inlined",
           leftovers="inline", standard_opset=True),
    Target("ort", "ONNX Runtime contrib ops; what has none stays a custom op with its function body"),
    Target("tensorrt", "native TensorRT layers or mograph TensorRT plugins; the rest stays a custom op"),
    Target("mograph", "keep the mograph custom ops with their function bodies", lowers=False),
)
