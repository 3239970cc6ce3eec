"""Facts about ops mograph does not own, declared once: one :class:`ForeignOp` record per op.

Passes, lowerings and the profiler meet ops of other domains (ONNX Runtime's ``com.microsoft`` contrib
ops, standard ONNX ops that are a fused computation) and need a few facts about them: which computation
an op is an already-fused form of, where an attention op reads its past KV cache and writes the
present one, which inputs are a normalization's gamma and beta, which outputs have input 0's shape,
whether it is elementwise or a row normalization.
Each fact is a field of the op's record here, not a private table in the pass that needs it.

The built-in records are :data:`BUILTIN_FOREIGN_OPS`; a plugin adds records (for its runtime's ops)
with ``mograph_add_foreign_ops`` (:mod:`mograph.hookspecs`).  The mograph-owned ops carry the same
facts in their own declarations (:class:`mograph.custom_ops.CustomOp`); :func:`fused_kinds` reads both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["BUILTIN_FOREIGN_OPS", "ForeignOp", "MS_DOMAIN", "affine_inputs", "elementwise_ops", "foreign_ops",
           "fused_kinds", "normalization_ops"]

#: ONNX Runtime's contrib-op domain.
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class ForeignOp:
    """What mograph knows about one op it does not own.

    Attributes:
        name: the op type.
        domain: its domain (``""`` for a standard ONNX op).
        computes: the computation it is an already-fused form of (``"LayerNorm"``, ``"RMSNorm"``,
            ``"GELU"``, ``"attention"``), or ``None``.
        cache: ``(past input index, present output index)`` pairs of an op that carries a KV cache.
        affine: ``(gamma input index, beta input index)`` of a normalization whose output is
            ``normalized * gamma + beta`` over the last axis; ``None`` otherwise.
        same_shape_outputs: the outputs that have input 0's shape (a shape rule follows from it where
            ``shape_dims`` is not given: :func:`mograph.shapes.rules_for`).
        shape_dims: the op's symbolic shape rule ``dims(node, query)`` (as
            :attr:`mograph.custom_ops.CustomOp.shape_dims`), in force from ``since_version`` of its domain.
        shape_values: ``values(node, query)`` for an op that computes a small int64 shape vector.
        since_version: the domain version the shape rule reads the op's layout from.
        host_inputs: the inputs ONNX Runtime's CUDA kernel reads on the host (a length, a shape): a
            value there computed on the device needs a copy back, which a CUDA graph cannot hold.
        shape_rule: the built-in shape rule family the op's outputs follow (``"attention"``: output 0 is
            ``[batch, sequence, hidden]`` of a rank-3 query), ``None`` for none.
        elementwise: output 0 is computed element by element from all the inputs broadcast together
            (numpy rules), like ``Add``: ``prune-structured`` couples a channel through it on every input.
        normalizes: output 0 normalizes input 0 over the axes from its ``axis`` attribute (default -1) on,
            each row on its own; the other inputs are the norm's parameters (or a residual added first), the
            other outputs its statistics (or that sum).  The Q/DQ plans list it as a normalization, ``fp16``
            counts its reduction depth, ``prune-structured`` couples a channel on an axis before ``axis``.
        ort_default_domain: ONNX Runtime registers a kernel of it in the default domain at every opset, also
            at opsets where ONNX has no schema for it (the output check's list when ``onnxruntime`` cannot be
            asked: :data:`mograph.output_check.ORT_DEFAULT_DOMAIN_OPS_FALLBACK`).
    """

    name: str
    domain: str = MS_DOMAIN
    computes: str | None = None
    cache: tuple[tuple[int, int], ...] = ()
    affine: tuple[int, int] | None = None
    same_shape_outputs: tuple[int, ...] = ()
    shape_dims: Callable[[ir.Node, Any], Any] | None = None
    shape_values: Callable[[ir.Node, Any], Any] | None = None
    since_version: int = 1
    host_inputs: tuple[int, ...] = ()
    shape_rule: str | None = None
    elementwise: bool = False
    normalizes: bool = False
    ort_default_domain: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.domain, self.name)


def _ms(name: str, computes: str | None = None, **facts: object) -> ForeignOp:
    return ForeignOp(name, MS_DOMAIN, computes, **facts)  # type: ignore[arg-type]


#: The records every installation has (registered by the built-in plugin ``mograph.lowering``).
BUILTIN_FOREIGN_OPS: tuple[ForeignOp, ...] = (
    # standard ONNX forms of the fused computations
    ForeignOp("LayerNormalization", "", "LayerNorm", affine=(1, 2), normalizes=True, ort_default_domain=True),
    ForeignOp("RMSNormalization", "", "RMSNorm", normalizes=True),
    ForeignOp("Gelu", "", "GELU", elementwise=True),
    ForeignOp("Attention", "", "attention"),
    # ONNX Runtime's contrib op in the default domain (where ONNX Runtime registers it and the ``ort``
    # lowering writes it)
    ForeignOp("SimplifiedLayerNormalization", "", "RMSNorm", same_shape_outputs=(0,), normalizes=True,
              ort_default_domain=True),
    # ONNX Runtime contrib ops
    _ms("LayerNormalization", "LayerNorm", same_shape_outputs=(0,), normalizes=True),
    _ms("SkipLayerNormalization", "LayerNorm", affine=(2, 3), same_shape_outputs=(0, 3), normalizes=True),
    _ms("EmbedLayerNormalization", "LayerNorm"),
    _ms("SimplifiedLayerNormalization", "RMSNorm", same_shape_outputs=(0,), normalizes=True),
    _ms("SkipSimplifiedLayerNormalization", "RMSNorm", same_shape_outputs=(0, 3), normalizes=True),
    _ms("Gelu", "GELU", same_shape_outputs=(0,), elementwise=True),
    _ms("FastGelu", "GELU", same_shape_outputs=(0,), elementwise=True),
    _ms("BiasGelu", "GELU", same_shape_outputs=(0,), elementwise=True),
    _ms("QuickGelu", "GELU", same_shape_outputs=(0,), elementwise=True),
    _ms("BiasAdd", same_shape_outputs=(0,), elementwise=True),
    _ms("RotaryEmbedding", same_shape_outputs=(0,)),
    _ms("Attention", "attention", shape_rule="attention"),
    _ms("MultiHeadAttention", "attention", cache=((6, 1), (7, 2)), shape_rule="attention"),
    _ms("GroupQueryAttention", "attention", cache=((3, 1), (4, 2)), host_inputs=(6,), shape_rule="attention"),
    _ms("PackedAttention", "attention", shape_rule="attention"),
    _ms("PackedMultiHeadAttention", "attention"),
    _ms("DecoderMaskedMultiHeadAttention", "attention"),
    _ms("SparseAttention", "attention"),
)


def foreign_ops(registered: Mapping[tuple[str, str], ForeignOp] | None = None) -> dict[tuple[str, str], ForeignOp]:
    """The records by ``(domain, name)``: the built-in ones and ``registered`` (a registry's; they win)."""
    out = {op.key: op for op in BUILTIN_FOREIGN_OPS}
    out.update(registered or {})
    return out


def fused_kinds(custom_ops: Iterable[object], registered: Mapping[tuple[str, str], ForeignOp] | None = None
                ) -> dict[str, str]:
    """Op type (any domain) -> the computation it is an already-fused form of, read off the declarations:
    the custom ops' ``computes`` and the foreign ops' records."""
    out = {op.name: op.computes for op in foreign_ops(registered).values() if op.computes}
    for op in custom_ops:
        computes = getattr(op, "computes", None)
        name = getattr(op, "name", None)
        if isinstance(computes, str) and isinstance(name, str):
            out.setdefault(name, computes)
    return out


def affine_inputs(custom_ops: Iterable[object], registered: Mapping[tuple[str, str], ForeignOp] | None = None
                  ) -> dict[tuple[str, str], tuple[int, int]]:
    """``(domain, op type)`` -> ``(gamma input, beta input)`` of the normalizations whose output is
    ``normalized * gamma + beta`` over the last axis, read off the declarations: the foreign ops' records
    (a standard op under ``""`` and ``"ai.onnx"`` alike) and the custom ops' ``affine``."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for op in foreign_ops(registered).values():
        if op.affine is not None:
            out[op.key] = op.affine
            if op.domain == "":
                out[("ai.onnx", op.name)] = op.affine
    for cop in custom_ops:
        affine = getattr(cop, "affine", None)
        key = getattr(cop, "key", None)
        if affine is not None and isinstance(key, tuple):
            out.setdefault(key, tuple(affine))  # type: ignore[arg-type]
    return out


def elementwise_ops(registered: Mapping[tuple[str, str], ForeignOp] | None = None) -> frozenset[tuple[str, str]]:
    """``(domain, op type)`` of the foreign ops whose record says ``elementwise``."""
    return frozenset(op.key for op in foreign_ops(registered).values() if op.elementwise)


def normalization_ops(registered: Mapping[tuple[str, str], ForeignOp] | None = None) -> frozenset[tuple[str, str]]:
    """``(domain, op type)`` of the foreign ops whose record says ``normalizes``."""
    return frozenset(op.key for op in foreign_ops(registered).values() if op.normalizes)
